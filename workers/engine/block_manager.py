"""Paged KV block accounting with prefix caching (pure: no torch, no clock)."""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass

from workers.engine.sequence import Sequence

_ROOT_HASH = 0x5EED


def hash_block(parent_hash: int, token_ids: tuple[int, ...]) -> int:
    """Chained hash of one full block: equal hashes mean equal whole prefixes."""
    return hash((parent_hash, token_ids))


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    # Set only while this block is the indexed holder of `block_hash` in the prefix cache.
    block_hash: int | None = None
    token_ids: tuple[int, ...] = ()


class BlockManager:
    """Allocates fixed-size KV blocks to sequences; reuses cached full blocks by hash.

    Free blocks live in two pools: never-hashed ones (`_free_plain`) and cached ones
    whose KV is still valid (`_free_cached`, LRU order), reused only when no plain block
    is left, so a prefix freed recently can still be hit.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be > 0, got {num_blocks}")
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free_plain: deque[int] = deque(range(num_blocks))
        self._free_cached: OrderedDict[int, None] = OrderedDict()
        self._hash_to_block: dict[int, int] = {}
        self.prefix_hits_tokens = 0
        self.prefix_queries_tokens = 0

    # ---- queries -------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free_plain) + len(self._free_cached)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def update_block_hashes(self, seq: Sequence) -> list[int]:
        """Extend `seq.block_hashes` to cover every full block of its tokens."""
        hashes = seq.block_hashes
        bs = self.block_size
        for i in range(len(hashes), seq.num_tokens // bs):
            parent = hashes[-1] if hashes else _ROOT_HASH
            hashes.append(hash_block(parent, tuple(seq.token_ids[i * bs : (i + 1) * bs])))
        return hashes

    def cached_prefix_blocks(self, seq: Sequence) -> list[int]:
        """Block ids holding this sequence's longest cached prefix (no allocation).

        At least one token (of this stage's range) is always left to compute, since the
        forward pass over it produces the logits for the next token.
        """
        if not self.enable_prefix_caching:
            return []
        hits: list[int] = []
        hashes = self.update_block_hashes(seq)
        end = seq.num_tokens if seq.stop_at is None else min(seq.num_tokens, seq.stop_at)
        max_blocks = (end - 1) // self.block_size
        bs = self.block_size
        for i, h in enumerate(hashes[:max_blocks]):
            block_id = self._hash_to_block.get(h)
            if block_id is None:
                break
            if self.blocks[block_id].token_ids != tuple(seq.token_ids[i * bs : (i + 1) * bs]):
                break  # hash collision
            hits.append(block_id)
        return hits

    def blocks_to_grow(self, seq: Sequence, num_new_tokens: int) -> int:
        """Blocks a running sequence needs to hold `num_new_tokens` more computed tokens."""
        needed = self.blocks_for_tokens(seq.num_computed_tokens + num_new_tokens)
        return max(0, needed - len(seq.block_table))

    def can_grow(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.blocks_to_grow(seq, num_new_tokens) <= self.num_free_blocks

    def admission_cost(self, seq: Sequence, prefix_hits: list[int], num_new_tokens: int) -> int:
        """Free blocks consumed by admitting `seq` with these prefix hits and new tokens."""
        cached_tokens = len(prefix_hits) * self.block_size
        new_blocks = self.blocks_for_tokens(cached_tokens + num_new_tokens) - len(prefix_hits)
        reclaimed = sum(1 for b in prefix_hits if self.blocks[b].ref_count == 0)
        return new_blocks + reclaimed

    # ---- mutations -----------------------------------------------------------
    def admit(self, seq: Sequence, prefix_hits: list[int], num_new_tokens: int) -> None:
        """Give a sequence without blocks its cached prefix plus room for new tokens."""
        assert not seq.block_table, "admit() is for sequences holding no blocks"
        if self.admission_cost(seq, prefix_hits, num_new_tokens) > self.num_free_blocks:
            raise MemoryError("not enough free KV blocks to admit sequence")
        for block_id in prefix_hits:
            self._take_cached(block_id)
        seq.block_table = list(prefix_hits)
        seq.num_computed_tokens = len(prefix_hits) * self.block_size
        self.prefix_queries_tokens += seq.num_tokens
        self.prefix_hits_tokens += seq.num_computed_tokens
        self.grow(seq, num_new_tokens)

    def grow(self, seq: Sequence, num_new_tokens: int) -> None:
        """Append blocks so the table covers `num_computed_tokens + num_new_tokens`."""
        need = self.blocks_to_grow(seq, num_new_tokens)
        if need > self.num_free_blocks:
            raise MemoryError("not enough free KV blocks to grow sequence")
        for _ in range(need):
            block_id = self._pop_free()
            self.blocks[block_id].ref_count = 1
            seq.block_table.append(block_id)

    def reserve(self, num_blocks: int) -> list[int]:
        """Take blocks for KV arriving from another worker; they belong to no sequence yet."""
        if num_blocks > self.num_free_blocks:
            raise MemoryError(f"need {num_blocks} free KV blocks, have {self.num_free_blocks}")
        taken = []
        for _ in range(num_blocks):
            block_id = self._pop_free()
            self.blocks[block_id].ref_count = 1
            taken.append(block_id)
        return taken

    def release_reserved(self, block_ids: list[int]) -> None:
        """Return reserved blocks that no sequence adopted."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count == 0 and block.block_hash is None, f"block {block_id} was not a plain reservation"
            self._free_plain.append(block_id)

    def adopt(self, seq: Sequence, block_ids: list[int], num_computed_tokens: int) -> None:
        """Make reserved blocks (holding KV for [0, num_computed_tokens)) a new sequence's table."""
        assert not seq.block_table, "adopt() is for sequences holding no blocks"
        needed = self.blocks_for_tokens(num_computed_tokens)
        if len(block_ids) < needed:
            raise ValueError(f"{len(block_ids)} blocks cannot hold {num_computed_tokens} tokens")
        self.release_reserved(block_ids[needed:])
        seq.block_table = list(block_ids[:needed])
        seq.num_computed_tokens = num_computed_tokens
        self.commit_computed(seq)

    def commit_computed(self, seq: Sequence) -> None:
        """Index every fully computed block of `seq` in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        hashes = self.update_block_hashes(seq)
        bs = self.block_size
        full = min(seq.num_computed_tokens // bs, len(seq.block_table))
        for i in range(full):
            block = self.blocks[seq.block_table[i]]
            if block.block_hash is not None:
                continue
            h = hashes[i]
            if h in self._hash_to_block:
                continue  # another sequence computed the same prefix first
            block.block_hash = h
            block.token_ids = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            self._hash_to_block[h] = block.block_id

    def free(self, seq: Sequence) -> None:
        """Drop the sequence's references; cached blocks stay reusable until evicted."""
        # Tail blocks go to the LRU first so that a prefix's head outlives its tail.
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {block_id} freed twice"
            if block.ref_count == 0:
                if block.block_hash is not None:
                    self._free_cached[block_id] = None
                else:
                    self._free_plain.append(block_id)
        seq.block_table = []
        seq.num_computed_tokens = 0

    def reset_prefix_cache(self) -> None:
        """Forget every cached block (e.g. after weights change)."""
        for block_id in list(self._free_cached):
            self._uncache(block_id)
            self._free_plain.append(block_id)
        self._free_cached.clear()
        for block in self.blocks:
            if block.block_hash is not None:
                self._uncache(block.block_id)

    # ---- internals -----------------------------------------------------------
    def _pop_free(self) -> int:
        if self._free_plain:
            return self._free_plain.popleft()
        block_id, _ = self._free_cached.popitem(last=False)  # least recently freed
        self._uncache(block_id)
        return block_id

    def _take_cached(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self._free_cached[block_id]
        block.ref_count += 1

    def _uncache(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.block_hash is not None and self._hash_to_block.get(block.block_hash) == block_id:
            del self._hash_to_block[block.block_hash]
        block.block_hash = None
        block.token_ids = ()
