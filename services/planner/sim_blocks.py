"""The engine's BlockManager with an incremental `commit_computed`, for the simulator's speed.

`BlockManager.commit_computed` walks every full block of a sequence on every call (once
per scheduled entry per step), skipping the ones already indexed: O(blocks) per decode
step, which for Mooncake's 12k-token prompts is most of a simulation's wall time.
`IncrementalCommitBlockManager.commit_computed` has exactly the same effect (the same
blocks indexed under the same hashes, in the same order) but remembers, per sequence and
per block table, how far it has walked and which blocks below that were left unindexed
because another block held their hash (only those can change: they are indexed once that
holder is evicted), so each call costs only the new blocks and those few.

Everything else is the engine's code, inherited unchanged. The override is used only
while the engine's method is the one it was written against (`UPSTREAM_DIGEST`, a digest
of its bytecode and constants): if `commit_computed` changes upstream, the simulator falls
back to the engine's method (slower, never different) until this is checked again.
`tests/unit/test_sim_blocks.py` compares both on random workloads.
"""

from __future__ import annotations

import hashlib
from itertools import chain

from workers.engine.block_manager import BlockManager
from workers.engine.sequence import Sequence

__all__ = ["IncrementalCommitBlockManager", "UPSTREAM_DIGEST", "make_block_manager", "upstream_digest"]

UPSTREAM_DIGEST = "538eda3c1ec8"  # of BlockManager.commit_computed as of this file (see upstream_digest)


def upstream_digest() -> str:
    code = BlockManager.commit_computed.__code__
    h = hashlib.sha256(code.co_code)
    h.update(repr(code.co_consts).encode())
    h.update(repr(code.co_names).encode())
    return h.hexdigest()[:12]


class IncrementalCommitBlockManager(BlockManager):
    """`BlockManager` whose `commit_computed` walks only blocks that may have changed."""

    def commit_computed(self, seq: Sequence) -> None:
        if not self.enable_prefix_caching:
            return
        hashes = self.update_block_hashes(seq)
        table = seq.block_table
        full = min(seq.num_computed_tokens // self.block_size, len(table))
        state = getattr(seq, "_sim_commit", None)
        if state is None or state[0] is not table or state[1] > full:
            walked, pending = 0, []  # a new table (admit, adopt, free): walk from the start
        else:
            walked, pending = state[1], state[2]
            if walked == full and not pending:
                return  # nothing new (most decode steps)
        blocks, index, block_tokens = self.blocks, self._hash_to_block, seq.block_tokens
        still: list[int] = []
        # In the engine's order: the pending blocks (all below `walked`), then the new ones.
        for i, block_id, h in chain(((i, table[i], hashes[i]) for i in pending),
                                    zip(range(walked, full), table[walked:full], hashes[walked:full])):
            block = blocks[block_id]
            if block.block_hash is not None:
                continue
            if h in index:
                still.append(i)  # another block holds this hash: recheck next time, as the engine does
                continue
            block.block_hash = h
            block.token_ids = block_tokens[i]
            index[h] = block_id
        seq._sim_commit = (table, max(walked, full), still)


def make_block_manager(num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> BlockManager:
    """The incremental block manager while it matches the engine's method, else the engine's own."""
    cls = IncrementalCommitBlockManager if upstream_digest() == UPSTREAM_DIGEST else BlockManager
    return cls(num_blocks, block_size, enable_prefix_caching)
