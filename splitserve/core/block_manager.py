"""Paged KV block accounting with prefix caching (pure: no torch, no clock)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from functools import partial
from itertools import chain, islice, takewhile
from operator import is_not

from splitserve.core.sequence import Sequence

_ROOT_HASH = 0x5EED
# Blocks whose contents are kept together in one token list when they are indexed (a "run").
_RUN_BLOCKS = 32
_is_not_none = partial(is_not, None)


def hash_block(parent_hash: int, token_ids: tuple[int, ...]) -> int:
    """Chained hash of one full block: equal hashes mean equal whole prefixes."""
    return hash((parent_hash, token_ids))


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    # Set only while this block is the indexed holder of `block_hash` in the prefix cache.
    block_hash: int | None = None
    token_ids: tuple[int, ...] = ()


class BlockManager:
    """Allocates fixed-size KV blocks to sequences; reuses cached full blocks by hash.

    Free blocks live in two pools: never-hashed ones (the plain pool, FIFO) and cached
    ones whose KV is still valid (the LRU), reused only when no plain block is left, so a
    prefix freed recently can still be hit.

    A 12k-token prompt is ~750 blocks and the simulator runs this code for millions of
    blocks (an hour of Mooncake: 9.3M blocks computed, 8.1M evicted on 64 workers), where
    the cost is memory traffic, not bytecodes: per-block state is flat lists indexed by
    block id (reference count, indexed hash, contents) rather than an object per block,
    and an indexed block's contents are not a tuple of its own but a slice of a run: one
    token list per up to `_RUN_BLOCKS` blocks indexed together (`_block_run`, with the
    block's place in it in `_block_offset`). A tuple per block meant creating, keeping
    and freeing 9.3M objects: a sixth of the simulator's time. A run lives until its last
    block is evicted, so it keeps at most `_RUN_BLOCKS` blocks' tokens per indexed block.
    `blocks` builds `Block` views for tests and debugging.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be > 0, got {num_blocks}")
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref_count = [0] * num_blocks
        # A block's hash and contents (`_block_run[b][_block_offset[b] * block_size:]`,
        # block_size tokens) are set only while it is the indexed holder of that hash in the
        # prefix cache (`_hash_to_block[hash] == block id`). Runs are never mutated.
        self._block_hash: list[int | None] = [None] * num_blocks
        self._block_run: list[list[int] | None] = [None] * num_blocks
        self._block_offset = [0] * num_blocks
        self._run_blocks = _RUN_BLOCKS  # tests lower it so that small tables span several runs
        # The plain pool is a FIFO: a list consumed from `_plain_head`, compacted now and
        # then, so that taking n blocks is one slice instead of n pops.
        self._plain: list[int] = list(range(num_blocks))
        self._plain_head = 0
        # The LRU of free cached blocks, least recently freed first, kept lazily: a block
        # enters at the tail when freed and is not taken out when a prefix hit takes it
        # back, so an entry counts only if it is its block's last (`_lru_entries`) and the
        # block is still free and cached. Eviction skips the rest; `_compact_lru` drops them
        # once they outnumber the blocks. (An OrderedDict did the same with a node per entry
        # and two dict operations per block freed and evicted: a third of the simulator's time.)
        self._lru: deque[int] = deque()
        self._lru_entries = [0] * num_blocks
        self._num_free_cached = 0
        self._hash_to_block: dict[int, int] = {}
        self._cache_epoch = 0  # bumped by reset_prefix_cache: every commit_state walks again
        # Bumped whenever a hash leaves the index (eviction, reset): a memoised prefix hint
        # (`cached_prefix_hint_tokens`) stays valid while it is unchanged, since entries only get added.
        self._index_removals = 0
        self.num_evictions = 0  # cached blocks taken for reuse (their prefix-cache entries dropped)
        self.prefix_hits_tokens = 0
        self.prefix_queries_tokens = 0

    # ---- queries -------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._plain) - self._plain_head + self._num_free_cached

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def blocks(self) -> list[Block]:
        """Every block's state as a `Block` (a snapshot, O(num_blocks): for tests and debugging)."""
        return [Block(i, r, h, self._contents(i)) for i, (r, h) in enumerate(zip(self._ref_count, self._block_hash))]

    def _contents(self, block_id: int) -> tuple[int, ...]:
        """The tokens an indexed block holds (() for a block not in the prefix cache)."""
        run, bs = self._block_run[block_id], self.block_size
        if run is None:
            return ()
        start = self._block_offset[block_id] * bs
        return tuple(run[start:start + bs])

    @property
    def free_plain_blocks(self) -> list[int]:
        """The free never-hashed blocks, in the order they will be taken (a snapshot)."""
        return self._plain[self._plain_head:]

    @property
    def free_cached_blocks(self) -> list[int]:
        """The free cached blocks, least recently freed (first evicted) first (a snapshot)."""
        return self._lru_order()

    def ref_counts(self, block_ids: list[int]) -> list[int]:
        """The reference counts of these blocks."""
        ref_count = self._ref_count
        return [ref_count[b] for b in block_ids]

    def indexes_any(self, hashes: list[int]) -> bool:
        """Whether any of these hashes is in the prefix index."""
        return not self._hash_to_block.keys().isdisjoint(hashes)

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def update_block_hashes(self, seq: Sequence) -> list[int]:
        """Extend `seq.block_hashes` to cover every full block of its tokens."""
        hashes, bs = seq.block_hashes, self.block_size
        start, end = len(hashes) * bs, len(seq.token_ids) // bs * bs
        if end <= start:
            return hashes
        h = hashes[-1] if hashes else _ROOT_HASH
        # zip() over bs references to one iterator yields consecutive bs-token tuples (one
        # tuple, reused: nothing else keeps it).
        hashes += [h := hash((h, tokens)) for tokens in zip(*[iter(seq.token_ids[start:end])] * bs)]  # = hash_block
        return hashes

    def seed_block_hashes(self, seq: Sequence, tokens: list[int], hashes: list[int]) -> bool:
        """Give `seq` the chained hashes this manager computed for `tokens` (a session's history,
        a prompt hashed for a lease) when its token ids start with them: hashes are a function of
        the tokens alone, so this is what `update_block_hashes` would compute, without hashing
        every block again. Checked token for token (one C-level comparison); whether seeded."""
        n = len(hashes)
        if n <= len(seq.block_hashes) or len(tokens) < n * self.block_size or len(seq.token_ids) < n * self.block_size:
            return False
        end = n * self.block_size
        token_ids = seq.token_ids
        # The ends first: a prompt that is not this one differs there almost always, and the full
        # comparison copies both slices.
        if token_ids[end - 1] != tokens[end - 1] or token_ids[0] != tokens[0] or token_ids[:end] != tokens[:end]:
            return False
        seq.block_hashes[:] = hashes
        return True

    def cached_prefix_blocks(self, seq: Sequence) -> list[int]:
        """Block ids holding this sequence's longest cached prefix (no allocation).

        At least one token (of this stage's range) is always left to compute, since the
        forward pass over it produces the logits for the next token.
        """
        if not self.enable_prefix_caching or seq.params.prompt_logprobs is not None:
            # A stage asking for prompt logprobs computes every position (vLLM skips the prefix
            # cache for prompt_logprobs too): a cached block's logits were never kept.
            return []
        hashes = self.update_block_hashes(seq)
        end = seq.num_tokens if seq.stop_at is None else min(seq.num_tokens, seq.stop_at)
        max_blocks = (end - 1) // self.block_size
        # The indexed blocks up to the first miss, then their contents checked at once:
        # equal hashes of unequal blocks (a collision) cut the prefix where they differ.
        hits = list(takewhile(_is_not_none, map(self._hash_to_block.get, hashes[:max_blocks])))
        del hits[self._matching_contents(hits, seq.token_ids):]
        return hits

    def cached_prefix_hint_tokens(self, seq: Sequence) -> int:
        """Tokens of this waiting sequence's longest cached prefix by the index's hashes alone:
        what a scheduling step shows its policy (`QueuedRequest.num_computed_tokens`) for every
        waiting request, each step. `cached_prefix_blocks` (admission) also checks the blocks'
        contents; a hash collision can only make this hint larger than what admission finds,
        so a policy never asks for more tokens than admission can schedule.

        Memoised on the sequence: while no hash has left the index the hits found stay indexed,
        so the walk resumes where it stopped (a deep queue costs O(1) per request per step,
        not a walk over each prompt; LAPS looks at every waiting request)."""
        if not self.enable_prefix_caching or seq.params.prompt_logprobs is not None:
            return 0
        hashes = self.update_block_hashes(seq)
        end = seq.num_tokens if seq.stop_at is None else min(seq.num_tokens, seq.stop_at)
        max_blocks = (end - 1) // self.block_size
        memo = seq.prefix_hint
        start = min(memo[1], max_blocks) if memo is not None and memo[0] == self._index_removals else 0
        found = start + sum(1 for _ in takewhile(self._hash_to_block.__contains__, islice(hashes, start, max_blocks)))
        seq.prefix_hint = (self._index_removals, found)
        return found * self.block_size

    def _matching_contents(self, hits: list[int], token_ids: list[int]) -> int:
        """How many of `hits` (the blocks for positions 0, 1, ...) hold exactly those
        positions' tokens: the consecutive blocks of one run are compared in one slice."""
        runs, offsets, bs, n = self._block_run, self._block_offset, self.block_size, len(hits)
        i = 0
        while i < n:
            run, offset = runs[hits[i]], offsets[hits[i]]
            j = i + 1  # hits[i:j]: consecutive blocks of one run
            while j < n and runs[hits[j]] is run and offsets[hits[j]] == offset + j - i:
                j += 1
            if run[offset * bs:(offset + j - i) * bs] != token_ids[i * bs:j * bs]:
                # A collision (equal hashes of unequal blocks): the prefix ends at the first differing block.
                while run[offset * bs:(offset + 1) * bs] == token_ids[i * bs:(i + 1) * bs]:
                    i, offset = i + 1, offset + 1
                return i
            i = j
        return n

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
        ref_count = self._ref_count
        reclaimed = [ref_count[b] for b in prefix_hits].count(0)
        return new_blocks + reclaimed

    # ---- mutations -----------------------------------------------------------
    def admit(self, seq: Sequence, prefix_hits: list[int], num_new_tokens: int) -> None:
        """Give a sequence without blocks its cached prefix plus room for new tokens."""
        assert not seq.block_table, "admit() is for sequences holding no blocks"
        if self.admission_cost(seq, prefix_hits, num_new_tokens) > self.num_free_blocks:
            raise MemoryError("not enough free KV blocks to admit sequence")
        self.retain(prefix_hits)
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
        seq.block_table += self._allocate(need)

    def reserve(self, num_blocks: int) -> list[int]:
        """Take blocks for KV arriving from another worker; they belong to no sequence yet."""
        if num_blocks > self.num_free_blocks:
            raise MemoryError(f"need {num_blocks} free KV blocks, have {self.num_free_blocks}")
        return self._allocate(num_blocks)

    def release_reserved(self, block_ids: list[int]) -> None:
        """Return reserved blocks that no sequence adopted."""
        ref_count, block_hash, plain = self._ref_count, self._block_hash, self._plain
        for block_id in block_ids:
            ref_count[block_id] -= 1
            assert ref_count[block_id] == 0 and block_hash[block_id] is None, \
                f"block {block_id} was not a plain reservation"
            plain.append(block_id)

    def adopt(self, seq: Sequence, block_ids: list[int], num_computed_tokens: int,
              prefix: list[int] | tuple[int, ...] = ()) -> None:
        """Make reserved blocks a new sequence's table: `prefix` (this worker's cached blocks,
        one more reference each) then `block_ids`, together holding KV for [0, num_computed_tokens)."""
        assert not seq.block_table, "adopt() is for sequences holding no blocks"
        needed = self.blocks_for_tokens(num_computed_tokens) - len(prefix)
        if len(block_ids) < needed or needed < 0:
            raise ValueError(f"{len(prefix)} cached and {len(block_ids)} reserved blocks cannot hold "
                             f"{num_computed_tokens} tokens")
        self.retain(list(prefix))
        self.release_reserved(block_ids[needed:])
        seq.block_table = list(prefix) + list(block_ids[:needed])
        seq.num_computed_tokens = num_computed_tokens
        self.commit_computed(seq)

    def commit_computed(self, seq: Sequence) -> None:
        """Index every fully computed block of `seq` in the prefix cache.

        Called once per scheduled entry per step, so it walks only what may have changed
        since its last call on this block table (`seq.commit_state`): the new full blocks,
        and the few below them left unindexed because another block held their hash (they
        are indexed once that holder is evicted). A new table (admit, adopt, free) is
        walked from the start. For a 12k-token prompt that is the difference between ~750
        blocks and ~0 per decode step. `tests/unit/test_block_manager.py` checks it against
        a full walk of every block on random workloads.
        """
        if not self.enable_prefix_caching:
            return
        hashes = self.update_block_hashes(seq)
        table = seq.block_table
        full = min(seq.num_computed_tokens // self.block_size, len(table))
        state = seq.commit_state
        if state is None or state[0] is not table or state[3] != self._cache_epoch or state[1] > full:
            walked, pending = 0, ()
        else:
            walked, pending = state[1], state[2]
            if walked == full and not pending:
                return  # nothing new (most decode steps)
        block_hash, block_run, block_offset = self._block_hash, self._block_run, self._block_offset
        index_if_absent = self._hash_to_block.setdefault  # one probe of the index per block, not two
        token_ids, bs = seq.token_ids, self.block_size
        run: list[int] = []
        run_start = run_end = 0  # the blocks [run_start, run_end) whose tokens `run` holds
        still: list[int] = []
        # Blocks in table order: the pending ones (all below `walked`), then the new ones.
        for i in chain(pending, range(walked, full)):
            block_id = table[i]
            if block_hash[block_id] is not None:
                continue  # indexed already
            h = hashes[i]
            if index_if_absent(h, block_id) != block_id:
                still.append(i)  # another sequence computed this hash first: look again later
                continue
            if not run_start <= i < run_end:
                run_start, run_end = i, min(full, i + self._run_blocks)
                run = token_ids[run_start * bs:run_end * bs]
            block_hash[block_id] = h
            block_run[block_id] = run
            block_offset[block_id] = i - run_start
        seq.commit_state = (table, max(walked, full), still, self._cache_epoch)

    def indexed_prefix(self, seq: Sequence) -> list[int]:
        """The blocks a later prompt starting with `seq`'s computed tokens would hit: the
        indexed holders of its full computed blocks' hashes, up to the first not indexed."""
        if not self.enable_prefix_caching:
            return []
        hashes = self.update_block_hashes(seq)
        full = min(seq.num_computed_tokens // self.block_size, len(hashes))
        return list(takewhile(_is_not_none, map(self._hash_to_block.get, hashes[:full])))

    def retain(self, block_ids: list[int]) -> None:
        """Take one more reference on in-use or cached blocks (a session pin); a cached free
        block leaves the LRU. Given back with `release_blocks`."""
        ref_count, block_hash = self._ref_count, self._block_hash
        for block_id in block_ids:
            if ref_count[block_id] == 0:
                assert block_hash[block_id] is not None, f"block {block_id} is free and uncached: nothing to retain"
                self._num_free_cached -= 1  # its LRU entry lapses: the block is in use
            ref_count[block_id] += 1

    def freeable_if_released(self, block_ids: list[int]) -> int:
        """How many blocks would become free if one reference per listed occurrence were dropped."""
        drops: dict[int, int] = {}
        for block_id in block_ids:
            drops[block_id] = drops.get(block_id, 0) + 1
        ref_count = self._ref_count
        return sum(ref_count[b] == n for b, n in drops.items())

    def release_blocks(self, block_ids: list[int]) -> None:
        """Drop one reference on each block; a block left with none becomes free (cached
        ones into the LRU, tail first so that a prefix's head outlives its tail)."""
        ref_count, block_hash, plain = self._ref_count, self._block_hash, self._plain
        lru, lru_entries = self._lru, self._lru_entries
        freed_cached = 0
        for block_id in reversed(block_ids):
            count = ref_count[block_id] - 1
            ref_count[block_id] = count
            if count == 0:
                if block_hash[block_id] is not None:
                    lru.append(block_id)
                    lru_entries[block_id] += 1
                    freed_cached += 1
                else:
                    plain.append(block_id)
            else:
                assert count > 0, f"block {block_id} freed twice"
        self._num_free_cached += freed_cached
        if len(lru) > 2 * self.num_blocks:
            self._compact_lru()

    def free(self, seq: Sequence) -> None:
        """Drop the sequence's references; cached blocks stay reusable until evicted."""
        self.release_blocks(seq.block_table)
        seq.block_table = []
        seq.num_computed_tokens = 0

    def reset_prefix_cache(self) -> None:
        """Forget every cached block (e.g. after weights change)."""
        self._cache_epoch += 1
        self._index_removals += 1
        self._plain += self._lru_order()  # free cached blocks become plain, LRU order kept
        self._lru.clear()
        self._lru_entries = [0] * self.num_blocks
        self._num_free_cached = 0
        self._hash_to_block.clear()
        self._block_hash = [None] * self.num_blocks
        self._block_run = [None] * self.num_blocks

    # ---- internals -----------------------------------------------------------
    def _allocate(self, n: int) -> list[int]:
        """Take `n` free blocks (the caller checked there are), each with one reference.

        Plain blocks first, in FIFO order; then cached ones, least recently freed first,
        each evicted from the prefix cache as it is taken.
        """
        plain, head = self._plain, self._plain_head
        taken = plain[head:head + n]
        head += len(taken)
        if head > 4096 and head * 2 > len(plain):
            del plain[:head]  # compact: the consumed head outgrew what is left
            head = 0
        self._plain_head = head
        ref_count = self._ref_count
        for block_id in taken:
            ref_count[block_id] = 1
        if len(taken) < n:
            taken += self._evict(n - len(taken))
        return taken

    def _evict(self, n: int) -> list[int]:
        """Take the `n` least recently freed cached blocks out of the LRU and the prefix cache,
        each with one reference."""
        lru_entries, ref_count, block_hash, block_run = self._lru_entries, self._ref_count, self._block_hash, self._block_run
        popleft, drop_hash = self._lru.popleft, self._hash_to_block.pop
        evicted: list[int] = []
        take = evicted.append
        left = n
        while left:
            block_id = popleft()
            entries = lru_entries[block_id] - 1
            lru_entries[block_id] = entries
            if entries or ref_count[block_id]:
                continue  # a lapsed entry: the block was freed again later, or is in use
            # The last entry of a free block: it is cached (only cached blocks enter the LRU,
            # and only eviction uncaches them), the indexed holder of its hash.
            drop_hash(block_hash[block_id])
            block_hash[block_id] = None
            block_run[block_id] = None
            ref_count[block_id] = 1
            take(block_id)
            left -= 1
        self._num_free_cached -= n
        self.num_evictions += n
        self._index_removals += 1
        return evicted

    def _lru_order(self) -> list[int]:
        """The free cached blocks, least recently freed first: each one's last LRU entry."""
        seen = list(self._lru_entries)
        order = []
        ref_count, block_hash = self._ref_count, self._block_hash
        for block_id in self._lru:
            seen[block_id] -= 1
            if not seen[block_id] and not ref_count[block_id] and block_hash[block_id] is not None:
                order.append(block_id)
        return order

    def _compact_lru(self) -> None:
        """Drop the lapsed LRU entries (they outnumbered the blocks)."""
        order = self._lru_order()
        self._lru = deque(order)
        self._lru_entries = [0] * self.num_blocks
        for block_id in order:
            self._lru_entries[block_id] = 1
