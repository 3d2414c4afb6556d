"""BlockManager: paged KV blocks, chained-hash prefix caching, ref counts, LRU reuse.

`commit_computed` is incremental (it walks only blocks that may have changed since its
last call on a block table, `Sequence.commit_state`); the second half of this file checks
that it has exactly the effect of the full walk it replaced (`FullWalkBlockManager`, the
old method's body kept here as the specification) on random workloads, block by block
and over whole simulations.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from conftest import prefix_sharing_workload
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from loadgen import arrivals
from services.planner import sim_worker
from services.planner.simulator import Simulator
from splitserve.core import BlockManager, SamplingParams, Sequence, StageKey
from splitserve.core.block_manager import hash_block
from splitserve.perf.presets import preset

_counter = iter(range(10**9))


def make_seq(tokens, rid: str | None = None, stop_at: int | None = None) -> Sequence:
    tokens = list(tokens)
    return Sequence(
        key=StageKey(rid or f"r{next(_counter)}", 0),
        token_ids=tokens,
        prompt_len=len(tokens),
        params=SamplingParams(),
        seed=0,
        arrival_time=0.0,
        stop_at=stop_at,
    )


def compute(bm: BlockManager, seq: Sequence, n: int, commit: bool = True) -> None:
    """What the engine does after a forward pass over n new tokens."""
    assert len(seq.block_table) * bm.block_size >= seq.num_computed_tokens + n
    seq.num_computed_tokens += n
    if commit:
        bm.commit_computed(seq)


def admit_and_compute(bm: BlockManager, tokens, n: int | None = None) -> Sequence:
    """Admit with whatever prefix hits exist and compute the rest (or n tokens)."""
    seq = make_seq(tokens)
    hits = bm.cached_prefix_blocks(seq)
    todo = seq.num_tokens - len(hits) * bm.block_size if n is None else n
    bm.admit(seq, hits, todo)
    compute(bm, seq, todo)
    return seq


def check_accounting(bm: BlockManager, seqs) -> None:
    """Structural invariants that hold between any two public calls."""
    refs = [0] * bm.num_blocks
    for s in seqs:
        assert len(set(s.block_table)) == len(s.block_table)
        for b in s.block_table:
            refs[b] += 1
    assert [b.ref_count for b in bm.blocks] == refs
    plain, cached = list(bm.free_plain_blocks), list(bm.free_cached_blocks)
    free = plain + cached
    assert len(set(free)) == len(free), "a block is in the free pools twice"
    assert set(free) == {i for i, r in enumerate(refs) if r == 0}, "free pools != unreferenced blocks"
    assert bm.num_free_blocks == len(free)
    assert bm.num_free_blocks + bm.num_used_blocks == bm.num_blocks
    assert bm.num_used_blocks == sum(1 for r in refs if r > 0)
    for b in plain:
        assert bm.blocks[b].block_hash is None, "plain free block still indexed"
    for b in cached:
        assert bm.blocks[b].block_hash is not None, "cached free block without a hash"
    for h, b in bm._hash_to_block.items():
        blk = bm.blocks[b]
        assert blk.block_hash == h
        assert len(blk.token_ids) == bm.block_size
    for blk in bm.blocks:
        if blk.block_hash is not None:
            assert bm._hash_to_block.get(blk.block_hash) == blk.block_id
    # Every sequence's hashed blocks carry exactly this sequence's content and chain hash.
    bs = bm.block_size
    for s in seqs:
        hashes = bm.update_block_hashes(s)
        for i, b in enumerate(s.block_table):
            blk = bm.blocks[b]
            if blk.block_hash is not None:
                assert blk.token_ids == tuple(s.token_ids[i * bs : (i + 1) * bs])
                assert blk.block_hash == hashes[i]


# ---- construction ----------------------------------------------------------------


@pytest.mark.parametrize("num_blocks,block_size", [(0, 4), (-1, 4), (4, 0), (4, -2)])
def test_constructor_rejects_non_positive_sizes(num_blocks, block_size):
    with pytest.raises(ValueError):
        BlockManager(num_blocks, block_size)


def test_fresh_manager_is_all_free():
    bm = BlockManager(7, 4)
    assert bm.num_free_blocks == 7 and bm.num_used_blocks == 0
    assert bm.blocks_for_tokens(0) == 0
    assert bm.blocks_for_tokens(1) == 1
    assert bm.blocks_for_tokens(4) == 1
    assert bm.blocks_for_tokens(5) == 2


# ---- hashing ---------------------------------------------------------------------


def test_hashes_cover_only_full_blocks():
    bm = BlockManager(8, 4)
    for n in range(0, 14):
        seq = make_seq(range(n))
        assert len(bm.update_block_hashes(seq)) == n // 4


def test_same_prefix_same_hashes_and_chain_is_explicit():
    bm = BlockManager(8, 4)
    a = make_seq([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13])
    b = make_seq([1, 2, 3, 4, 5, 6, 7, 8, 99, 98, 97, 96])
    ha, hb = bm.update_block_hashes(a), bm.update_block_hashes(b)
    assert ha[:2] == hb[:2]
    assert ha[2] != hb[2]
    # chain: each hash is hash_block(previous hash, block tokens)
    assert ha[1] == hash_block(ha[0], (5, 6, 7, 8))
    assert ha[2] == hash_block(ha[1], (9, 10, 11, 12))


def test_different_earlier_block_changes_every_later_hash():
    bm = BlockManager(8, 4)
    tail = [5, 6, 7, 8, 9, 10, 11, 12]
    a = make_seq([1, 2, 3, 4] + tail)
    b = make_seq([1, 2, 3, 0] + tail)  # only block 0 differs
    ha, hb = bm.update_block_hashes(a), bm.update_block_hashes(b)
    assert len(ha) == len(hb) == 3
    assert all(x != y for x, y in zip(ha, hb))


def test_hashes_extend_incrementally_like_from_scratch():
    bm = BlockManager(8, 3)
    grown = make_seq([4, 4, 4, 1])
    bm.update_block_hashes(grown)
    for t in [2, 9, 9, 9, 3, 3]:
        grown.token_ids.append(t)
        bm.update_block_hashes(grown)
    fresh = make_seq(grown.token_ids)
    assert bm.update_block_hashes(fresh) == grown.block_hashes
    assert len(grown.block_hashes) == len(grown.token_ids) // 3


# ---- admission with prefix hits --------------------------------------------------


def test_prefix_hit_shares_blocks_and_sets_computed_tokens():
    bm = BlockManager(16, 4)
    a = admit_and_compute(bm, range(10))  # 2 full blocks + 2 tokens
    assert a.num_computed_tokens == 10 and len(a.block_table) == 3
    b = make_seq(list(range(8)) + [50, 51, 52])
    hits = bm.cached_prefix_blocks(b)
    assert hits == a.block_table[:2]
    free_before = bm.num_free_blocks
    bm.admit(b, hits, b.num_tokens - 8)
    assert b.num_computed_tokens == 8
    assert b.block_table[:2] == a.block_table[:2]
    assert b.block_table[2] not in a.block_table
    assert [bm.blocks[x].ref_count for x in a.block_table] == [2, 2, 1]
    assert bm.num_free_blocks == free_before - 1  # hits were held already: only the tail is new
    assert bm.prefix_hits_tokens == 8
    assert bm.prefix_queries_tokens == 10 + 11
    check_accounting(bm, [a, b])


def test_prefix_stops_at_first_mismatching_block():
    bm = BlockManager(16, 2)
    a = admit_and_compute(bm, [1, 2, 3, 4, 5, 6, 7])
    b = make_seq([1, 2, 0, 4, 5, 6, 7])  # block 1 differs, block 2 equal but chained after it
    assert bm.cached_prefix_blocks(b) == [a.block_table[0]]


def test_exact_full_block_prompt_leaves_one_block_to_compute():
    bm = BlockManager(16, 4)
    a = admit_and_compute(bm, range(12))  # exactly 3 full blocks, all committed
    assert len(bm._hash_to_block) == 3
    b = make_seq(range(12))
    hits = bm.cached_prefix_blocks(b)
    assert hits == a.block_table[:2]  # k-1 of k
    bm.admit(b, hits, 4)
    assert b.num_computed_tokens == 8
    assert b.num_uncomputed_tokens == 4
    # one more token than full blocks: every full block is a hit
    c = make_seq(list(range(12)) + [0])
    assert bm.cached_prefix_blocks(c) == a.block_table
    # a single-token prompt or one block + nothing: never a hit
    assert bm.cached_prefix_blocks(make_seq(range(4))) == []
    assert bm.cached_prefix_blocks(make_seq([0])) == []


def test_at_least_one_token_uncomputed_block_size_one():
    bm = BlockManager(16, 1)
    admit_and_compute(bm, [3, 1, 4, 1, 5])
    seq = make_seq([3, 1, 4, 1, 5])
    assert len(bm.cached_prefix_blocks(seq)) == 4


def test_prefix_caching_disabled_never_hits_nor_indexes():
    bm = BlockManager(8, 2, enable_prefix_caching=False)
    a = admit_and_compute(bm, range(9))
    assert bm._hash_to_block == {}
    assert all(b.block_hash is None for b in bm.blocks)
    assert bm.cached_prefix_blocks(make_seq(range(9))) == []
    bm.free(a)
    assert len(bm.free_cached_blocks) == 0 and bm.num_free_blocks == 8


# ---- commit_computed --------------------------------------------------------------


def test_commit_indexes_only_fully_computed_blocks():
    bm = BlockManager(8, 4)
    seq = make_seq(range(14))
    bm.admit(seq, [], 6)
    compute(bm, seq, 6)  # block 0 full, block 1 half
    assert set(bm._hash_to_block.values()) == {seq.block_table[0]}
    assert bm.blocks[seq.block_table[1]].block_hash is None
    bm.grow(seq, 2)
    compute(bm, seq, 2)  # 8 computed: blocks 0, 1
    assert set(bm._hash_to_block.values()) == set(seq.block_table[:2])
    bm.grow(seq, 5)
    compute(bm, seq, 5)  # 13 computed: still blocks 0..2 (12 tokens)
    assert set(bm._hash_to_block.values()) == set(seq.block_table[:3])
    assert bm.blocks[seq.block_table[2]].token_ids == (8, 9, 10, 11)
    check_accounting(bm, [seq])


def test_commit_ignores_claims_beyond_the_block_table():
    bm = BlockManager(8, 2)
    seq = make_seq(range(8))
    bm.admit(seq, [], 2)
    seq.num_computed_tokens = 8  # inconsistent on purpose: only 1 block is held
    bm.commit_computed(seq)
    assert list(bm._hash_to_block.values()) == [seq.block_table[0]]


def test_commit_is_idempotent():
    bm = BlockManager(8, 2)
    seq = admit_and_compute(bm, range(5))
    before = dict(bm._hash_to_block)
    bm.commit_computed(seq)
    bm.commit_computed(seq)
    assert bm._hash_to_block == before


def test_duplicate_content_is_indexed_once():
    bm = BlockManager(8, 2)
    a = make_seq(range(5))
    b = make_seq(range(5))
    bm.admit(a, [], 5)
    bm.admit(b, [], 5)  # both computing the same prefix concurrently: no hits yet
    compute(bm, a, 5)
    compute(bm, b, 5)
    a_table = list(a.block_table)
    assert sorted(bm._hash_to_block.values()) == sorted(a_table[:2])
    assert all(bm.blocks[x].block_hash is None for x in b.block_table)
    bm.free(a)
    bm.free(b)
    check_accounting(bm, [])
    # b's duplicates were never indexed, so they are plain; a's are cached
    assert set(bm.free_cached_blocks) == set(a_table[:2])


# ---- free, LRU pool, eviction -----------------------------------------------------


def test_free_moves_hashed_blocks_to_cached_pool_and_rest_to_plain():
    bm = BlockManager(8, 4)
    seq = admit_and_compute(bm, range(10))
    table = list(seq.block_table)
    bm.free(seq)
    assert seq.block_table == [] and seq.num_computed_tokens == 0
    assert list(bm.free_cached_blocks) == [table[1], table[0]]  # tail first
    assert table[2] in bm.free_plain_blocks
    assert bm.num_free_blocks == 8
    check_accounting(bm, [])


def test_freed_cached_blocks_can_be_hit_again():
    bm = BlockManager(8, 4)
    a = admit_and_compute(bm, range(10))
    table = list(a.block_table)
    bm.free(a)
    b = make_seq(list(range(8)) + [77])
    hits = bm.cached_prefix_blocks(b)
    assert hits == table[:2]
    assert bm.admission_cost(b, hits, 1) == 3  # 2 reclaimed from the pool + 1 new
    bm.admit(b, hits, 1)
    assert b.num_computed_tokens == 8
    assert bm.num_free_blocks == 5
    assert all(bm.blocks[x].ref_count == 1 for x in b.block_table)
    assert not (set(hits) & set(bm.free_cached_blocks))
    check_accounting(bm, [b])


def test_plain_free_blocks_are_used_before_evicting_cached_ones():
    bm = BlockManager(6, 2)
    a = admit_and_compute(bm, range(5))  # 3 blocks, 2 hashed
    a_table = list(a.block_table)
    bm.free(a)
    assert len(bm.free_plain_blocks) == 4 and len(bm.free_cached_blocks) == 2
    filler = make_seq([100] * 8)
    bm.admit(filler, [], 8)  # takes exactly the 4 plain blocks
    assert len(bm.free_cached_blocks) == 2
    assert len(bm._hash_to_block) == 2
    assert not set(filler.block_table) & set(a_table[:2])
    assert bm.cached_prefix_blocks(make_seq(range(5))) == a_table[:2]
    check_accounting(bm, [filler])


def test_eviction_order_lru_and_tail_before_head():
    bm = BlockManager(6, 2)
    a = admit_and_compute(bm, [1, 1, 2, 2, 3, 3])  # 3 full blocks, all hashed
    b = admit_and_compute(bm, [5, 5, 6, 6, 7, 7])
    a_table, b_table = list(a.block_table), list(b.block_table)
    assert bm.num_free_blocks == 0
    bm.free(a)  # a freed first: least recently freed
    bm.free(b)
    expected = [a_table[2], a_table[1], a_table[0], b_table[2], b_table[1], b_table[0]]
    assert list(bm.free_cached_blocks) == expected
    taken = []
    for i in range(6):
        s = make_seq([200 + i])
        bm.admit(s, [], 1)
        taken.append(s.block_table[0])
        if i == 0:
            # a's tail evicted: a's head still hits, the tail no longer does
            hits = bm.cached_prefix_blocks(make_seq([1, 1, 2, 2, 3, 3, 0]))
            assert hits == a_table[:2]
        if i == 2:
            assert bm.cached_prefix_blocks(make_seq([1, 1, 2, 2, 3, 3, 0])) == []
            assert bm.cached_prefix_blocks(make_seq([5, 5, 6, 6, 7, 7, 0])) == b_table
    assert taken == expected
    assert bm._hash_to_block == {}
    assert all(blk.block_hash is None for blk in bm.blocks)


def test_hitting_a_cached_block_refreshes_its_lru_position():
    bm = BlockManager(4, 2)
    a = admit_and_compute(bm, [1, 1, 9])  # block [1,1] hashed + partial
    b = admit_and_compute(bm, [2, 2, 9])
    a_head, b_head = a.block_table[0], b.block_table[0]
    bm.free(a)
    bm.free(b)
    # reuse a's head: it leaves the pool and comes back as most recently freed
    c = admit_and_compute(bm, [1, 1, 8])
    assert c.block_table[0] == a_head
    bm.free(c)
    assert list(bm.free_cached_blocks) == [b_head, a_head]
    # 2 plain + then b's head is evicted before a's
    hog = make_seq([0] * 6)
    bm.admit(hog, [], 6)
    assert b_head in hog.block_table and a_head not in hog.block_table
    assert bm.cached_prefix_blocks(make_seq([1, 1, 0])) == [a_head]
    assert bm.cached_prefix_blocks(make_seq([2, 2, 0])) == []


def test_evicted_block_reused_by_another_sequence_is_not_hit():
    bm = BlockManager(2, 2)
    a = admit_and_compute(bm, [1, 2, 3])
    bm.free(a)
    other = admit_and_compute(bm, [8, 8, 8, 8])  # needs both blocks: evicts a's cached head
    assert bm.cached_prefix_blocks(make_seq([1, 2, 3])) == []
    check_accounting(bm, [other])


# ---- admission cost, growth, memory errors ---------------------------------------


def test_admission_cost_accounting():
    bm = BlockManager(16, 4)
    a = admit_and_compute(bm, range(13))  # 3 full hashed blocks + 1
    b = make_seq(list(range(12)) + [40, 41, 42, 43, 44])
    hits = bm.cached_prefix_blocks(b)
    assert len(hits) == 3
    # held by a (ref 1): hits are free of charge; 5 new tokens after 12 cached -> 2 blocks
    assert bm.admission_cost(b, hits, 5) == 2
    assert bm.admission_cost(b, hits, 4) == 1
    assert bm.admission_cost(b, hits, 1) == 1
    assert bm.admission_cost(b, [], 17) == 5
    bm.free(a)
    # now every hit must be reclaimed from the free pool: +1 each
    assert bm.admission_cost(b, hits, 5) == 2 + 3
    assert bm.admission_cost(b, hits[:1], 13) == (bm.blocks_for_tokens(4 + 13) - 1) + 1
    free_before = bm.num_free_blocks
    bm.admit(b, hits, 5)
    assert free_before - bm.num_free_blocks == 5
    check_accounting(bm, [b])


def test_admission_cost_matches_actual_consumption_mixed_refs():
    bm = BlockManager(16, 2)
    a = admit_and_compute(bm, [1, 1, 2, 2, 3, 3, 4])
    keep = make_seq([1, 1, 2, 2, 5])
    keep_hits = bm.cached_prefix_blocks(keep)
    bm.admit(keep, keep_hits, 1)  # holds blocks 0,1 of a's prefix
    bm.free(a)  # block 2 ([3,3]) has ref 0 now, blocks 0,1 ref 1
    c = make_seq([1, 1, 2, 2, 3, 3, 9, 9, 9])
    hits = bm.cached_prefix_blocks(c)
    assert len(hits) == 3
    cost = bm.admission_cost(c, hits, 3)
    assert cost == 1 + 2  # one reclaimed, ceil((6+3)/2) - 3 = 2 new
    before = bm.num_free_blocks
    bm.admit(c, hits, 3)
    assert before - bm.num_free_blocks == cost
    check_accounting(bm, [keep, c])


def test_admit_raises_memory_error_and_leaves_state_untouched():
    bm = BlockManager(3, 4)
    hog = make_seq(range(8))
    bm.admit(hog, [], 8)
    seq = make_seq(range(100, 109))
    snapshot = (list(bm.free_plain_blocks), list(bm.free_cached_blocks), [b.ref_count for b in bm.blocks])
    with pytest.raises(MemoryError):
        bm.admit(seq, [], 9)
    assert seq.block_table == []
    assert snapshot == (list(bm.free_plain_blocks), list(bm.free_cached_blocks), [b.ref_count for b in bm.blocks])
    bm.admit(seq, [], 4)  # a chunk that fits is fine
    assert len(seq.block_table) == 1


def test_admit_requires_a_sequence_without_blocks():
    bm = BlockManager(4, 4)
    seq = make_seq(range(3))
    bm.admit(seq, [], 3)
    with pytest.raises(AssertionError):
        bm.admit(seq, [], 3)


def test_grow_and_can_grow():
    bm = BlockManager(3, 4)
    seq = make_seq(range(20))
    bm.admit(seq, [], 3)
    assert len(seq.block_table) == 1
    compute(bm, seq, 3)
    assert bm.blocks_to_grow(seq, 1) == 0  # token 4 still fits in block 0
    assert bm.blocks_to_grow(seq, 2) == 1
    assert bm.can_grow(seq, 9) and not bm.can_grow(seq, 10)
    bm.grow(seq, 9)
    assert len(seq.block_table) == 3 and bm.num_free_blocks == 0
    compute(bm, seq, 9)
    with pytest.raises(MemoryError):
        bm.grow(seq, 1)
    assert len(seq.block_table) == 3
    bm.grow(seq, 0)  # no-op
    check_accounting(bm, [seq])


# ---- double free, reset ----------------------------------------------------------


def test_double_free_asserts():
    bm = BlockManager(4, 2)
    seq = admit_and_compute(bm, [1, 2, 3])
    stale_table = list(seq.block_table)
    bm.free(seq)
    bm.free(seq)  # the sequence no longer holds anything: a no-op
    assert bm.num_free_blocks == 4
    seq.block_table = stale_table  # freeing the same blocks again
    with pytest.raises(AssertionError, match="freed twice"):
        bm.free(seq)


def test_double_free_via_a_second_holder_asserts():
    bm = BlockManager(4, 2)
    a = admit_and_compute(bm, [1, 2, 3])
    impostor = make_seq([1, 2, 3])
    impostor.block_table = list(a.block_table)  # never took a reference
    bm.free(a)
    with pytest.raises(AssertionError):
        bm.free(impostor)


def test_reset_prefix_cache_forgets_everything_but_keeps_capacity():
    bm = BlockManager(8, 2)
    live = admit_and_compute(bm, [1, 1, 2, 2, 3])
    dead = admit_and_compute(bm, [4, 4, 5, 5, 6])
    bm.free(dead)
    assert len(bm.free_cached_blocks) == 2
    free_before = bm.num_free_blocks
    bm.reset_prefix_cache()
    assert bm.num_free_blocks == free_before
    assert len(bm.free_cached_blocks) == 0
    assert bm._hash_to_block == {}
    assert all(b.block_hash is None and b.token_ids == () for b in bm.blocks)
    assert bm.cached_prefix_blocks(make_seq([1, 1, 2, 2, 3])) == []
    assert bm.cached_prefix_blocks(make_seq([4, 4, 5, 5, 6])) == []
    check_accounting(bm, [live])
    bm.free(live)  # live's blocks were un-indexed: they go back as plain
    assert len(bm.free_plain_blocks) == 8 and len(bm.free_cached_blocks) == 0
    # caching works again afterwards
    again = admit_and_compute(bm, [1, 1, 2, 2, 3])
    bm.free(again)
    assert len(bm.cached_prefix_blocks(make_seq([1, 1, 2, 2, 3]))) == 2


def test_capacity_invariant_through_a_scenario():
    bm = BlockManager(10, 3)
    seqs = []
    for toks in ([1] * 7, [1] * 7 + [2] * 3, [2] * 9, [1] * 6 + [5]):
        seqs.append(admit_and_compute(bm, toks))
        assert bm.num_free_blocks + bm.num_used_blocks == bm.num_blocks
        check_accounting(bm, seqs)
    for s in list(seqs):
        bm.free(s)
        seqs.remove(s)
        check_accounting(bm, seqs)
    assert bm.num_free_blocks == 10


# ---- hypothesis: random operation sequences --------------------------------------


class BlockManagerMachine(RuleBasedStateMachine):
    """Random admit/grow/compute/commit/free over token lists from a tiny alphabet.

    Alongside the manager we keep a fake KV store (block id -> token per slot), written
    when tokens are 'computed', so that reading a prefix hit or a shared block checks
    that the KV really belongs to the sequence's tokens.
    """

    @initialize(num_blocks=st.integers(1, 12), block_size=st.sampled_from([1, 2, 3, 4]),
                caching=st.booleans(), run_blocks=st.integers(1, 3))
    def init(self, num_blocks, block_size, caching, run_blocks):
        self.bm = BlockManager(num_blocks, block_size, caching)
        self.bm._run_blocks = run_blocks  # small runs: one commit indexes several
        self.kv: dict[int, list] = {i: [None] * block_size for i in range(num_blocks)}
        self.seqs: list[Sequence] = []

    def _check_reads(self, seq: Sequence, upto: int) -> None:
        bs = self.bm.block_size
        for pos in range(upto):
            b = seq.block_table[pos // bs]
            assert self.kv[b][pos % bs] == seq.token_ids[pos], (
                f"seq {seq.request_id} reads wrong KV at position {pos}"
            )

    def _compute(self, seq: Sequence, n: int) -> None:
        bs = self.bm.block_size
        start = seq.num_computed_tokens
        assert len(seq.block_table) >= self.bm.blocks_for_tokens(start + n)
        self._check_reads(seq, start)
        for pos in range(start, start + n):
            b = seq.block_table[pos // bs]
            # a block another live sequence also maps must not be overwritten
            holders = [s for s in self.seqs if b in s.block_table]
            assert holders == [seq], f"writing into shared block {b}"
            self.kv[b][pos % bs] = seq.token_ids[pos]
        seq.num_computed_tokens = start + n

    @rule(tokens=st.lists(st.integers(0, 2), min_size=1, max_size=14), data=st.data(),
          commit=st.booleans())
    def admit(self, tokens, data, commit):
        bm = self.bm
        seq = make_seq(tokens)
        hits = bm.cached_prefix_blocks(seq)
        assert len(hits) * bm.block_size < seq.num_tokens
        for i, b in enumerate(hits):
            assert bm.blocks[b].token_ids == tuple(seq.token_ids[i * bm.block_size : (i + 1) * bm.block_size])
        n = data.draw(st.integers(1, seq.num_tokens - len(hits) * bm.block_size), label="n")
        cost = bm.admission_cost(seq, hits, n)
        free_before = bm.num_free_blocks
        if cost > free_before:
            with pytest.raises(MemoryError):
                bm.admit(seq, hits, n)
            assert bm.num_free_blocks == free_before
            return
        refs_before = {b: bm.blocks[b].ref_count for b in hits}
        bm.admit(seq, hits, n)
        assert bm.num_free_blocks == free_before - cost
        assert seq.block_table[: len(hits)] == hits
        assert seq.num_computed_tokens == len(hits) * bm.block_size
        for b in hits:
            assert bm.blocks[b].ref_count == refs_before[b] + 1
        self.seqs.append(seq)
        self._check_reads(seq, seq.num_computed_tokens)  # the hit KV is really ours
        self._compute(seq, n)
        if commit:
            bm.commit_computed(seq)

    @precondition(lambda self: bool(self.seqs))
    @rule(data=st.data(), commit=st.booleans())
    def grow(self, data, commit):
        bm = self.bm
        seq = data.draw(st.sampled_from(self.seqs), label="seq")
        if seq.num_uncomputed_tokens == 0:
            seq.token_ids.append(data.draw(st.integers(0, 2), label="new token"))
        n = data.draw(st.integers(1, seq.num_uncomputed_tokens), label="n")
        need = bm.blocks_to_grow(seq, n)
        free_before = bm.num_free_blocks
        assert bm.can_grow(seq, n) == (need <= free_before)
        if need > free_before:
            table = list(seq.block_table)
            with pytest.raises(MemoryError):
                bm.grow(seq, n)
            assert seq.block_table == table and bm.num_free_blocks == free_before
            return
        bm.grow(seq, n)
        assert bm.num_free_blocks == free_before - need
        self._compute(seq, n)
        if commit:
            bm.commit_computed(seq)

    @precondition(lambda self: bool(self.seqs))
    @rule(data=st.data())
    def commit(self, data):
        seq = data.draw(st.sampled_from(self.seqs), label="seq")
        self.bm.commit_computed(seq)
        bs = self.bm.block_size
        for i in range(seq.num_computed_tokens // bs):
            # every fully computed block is either indexed itself or its hash is held by another
            blk = self.bm.blocks[seq.block_table[i]]
            if self.bm.enable_prefix_caching:
                assert seq.block_hashes[i] in self.bm._hash_to_block
                if blk.block_hash is not None:
                    assert blk.block_hash == seq.block_hashes[i]

    @precondition(lambda self: bool(self.seqs))
    @rule(data=st.data())
    def free(self, data):
        seq = data.draw(st.sampled_from(self.seqs), label="seq")
        used_before = self.bm.num_used_blocks
        exclusive = sum(1 for b in seq.block_table if self.bm.blocks[b].ref_count == 1)
        self.seqs.remove(seq)
        self.bm.free(seq)
        assert seq.block_table == [] and seq.num_computed_tokens == 0
        assert self.bm.num_used_blocks == used_before - exclusive

    @rule()
    def reset(self):
        free_before = self.bm.num_free_blocks
        self.bm.reset_prefix_cache()
        assert self.bm.num_free_blocks == free_before
        assert self.bm._hash_to_block == {}

    @invariant()
    def consistent(self):
        check_accounting(self.bm, self.seqs)
        for s in self.seqs:
            self._check_reads(s, s.num_computed_tokens)


BlockManagerMachine.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=40,
    deadline=None, derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestBlockManagerMachine = BlockManagerMachine.TestCase


# ---- incremental commit_computed == the full walk it replaced -----------------------


class FullWalkBlockManager(BlockManager):
    """The block manager with `commit_computed` as it was before it became incremental (the
    body of the old `workers/engine/block_manager.py`): every call walks every fully
    computed block in table order, indexing each one that is not indexed yet and whose hash
    no other block holds. It is the specification the incremental method must meet."""

    def commit_computed(self, seq: Sequence) -> None:
        if not self.enable_prefix_caching:
            return
        hashes = self.update_block_hashes(seq)
        bs = self.block_size
        full = min(seq.num_computed_tokens // bs, len(seq.block_table))
        index = self._hash_to_block
        for i, (block_id, h) in enumerate(zip(seq.block_table[:full], hashes)):
            # Skip blocks indexed already, and hashes another sequence computed first.
            if self._block_hash[block_id] is None and h not in index:
                self._block_hash[block_id] = h
                self._block_run[block_id] = seq.token_ids[i * bs:(i + 1) * bs]  # a run of one block
                self._block_offset[block_id] = 0
                index[h] = block_id


def manager_state(bm: BlockManager) -> tuple:
    """Everything observable: per-block state, both free pools in order, the index in insertion order."""
    return ([(b.ref_count, b.block_hash, b.token_ids) for b in bm.blocks], list(bm.free_plain_blocks),
            list(bm.free_cached_blocks), list(bm._hash_to_block.items()), bm.prefix_hits_tokens, bm.prefix_queries_tokens)


def test_a_block_left_unindexed_is_indexed_once_the_holder_of_its_hash_is_evicted():
    bm = BlockManager(5, 2)
    a, b = make_seq([1, 2, 3]), make_seq([1, 2, 4])
    bm.admit(a, [], 3)
    bm.admit(b, [], 3)  # both compute block [1, 2] (no hit yet)
    compute(bm, a, 3)
    compute(bm, b, 3)
    h = a.block_hashes[0]
    assert bm._hash_to_block == {h: a.block_table[0]}  # b's block waits: a holds its hash
    bm.free(a)  # a's block stays indexed, in the LRU
    hog = make_seq([9] * 6)
    bm.admit(hog, [], 6)  # 3 blocks: both plain ones, then a's cached block is evicted
    assert h not in bm._hash_to_block
    bm.commit_computed(b)  # nothing new was computed, but b's block may hold the hash now
    assert bm._hash_to_block == {h: b.block_table[0]}
    assert bm.cached_prefix_blocks(make_seq([1, 2, 7])) == b.block_table[:1]
    check_accounting(bm, [b, hog])


def test_commit_after_a_reset_indexes_a_live_sequences_blocks_again():
    bm = BlockManager(8, 2)
    seq = admit_and_compute(bm, [1, 2, 3, 4, 5])
    bm.reset_prefix_cache()
    assert bm._hash_to_block == {}
    bm.commit_computed(seq)  # nothing new computed: the reset alone makes it walk again
    assert bm._hash_to_block == {seq.block_hashes[0]: seq.block_table[0], seq.block_hashes[1]: seq.block_table[1]}
    assert bm.cached_prefix_blocks(make_seq([1, 2, 3, 4, 0])) == seq.block_table[:2]
    check_accounting(bm, [seq])


def test_commit_walks_a_new_table_from_the_start():
    bm = BlockManager(4, 2)
    seq = admit_and_compute(bm, [1, 2, 3, 4, 5])  # its 2 full blocks indexed (walked: 2)
    bm.free(seq)
    hog = admit_and_compute(bm, [9] * 8)  # takes every block: seq's cached ones are evicted
    bm.free(hog)
    assert seq.block_hashes[0] not in bm._hash_to_block
    assert bm.cached_prefix_blocks(seq) == []
    bm.admit(seq, [], 5)  # a new table, as long as the old one: its blocks must still be walked
    compute(bm, seq, 5)
    assert bm._hash_to_block[seq.block_hashes[0]] == seq.block_table[0]
    assert bm._hash_to_block[seq.block_hashes[1]] == seq.block_table[1]
    check_accounting(bm, [seq])


def test_incremental_and_full_walk_agree_block_by_block_under_eviction():
    """A long deterministic random workload with few distinct tokens (many equal hashes),
    a pool small enough to evict constantly, commits that are sometimes skipped (a
    fast-forwarded run commits only when a block fills) and an occasional reset."""
    rng = np.random.default_rng(5)
    managers = [FullWalkBlockManager(24, 4), BlockManager(24, 4)]
    seqs: list[list[Sequence]] = [[], []]
    resets = 0
    for step in range(3000):
        op = int(rng.integers(0, 5))
        live = seqs[0]
        if op == 0 or not live:
            n = int(rng.integers(1, 20))
            tokens = [int(t) for t in rng.integers(0, 3, n)]
            for m, ss in zip(managers, seqs):
                s = make_seq(tokens, f"q{step}")
                hits = m.cached_prefix_blocks(s)
                want = n - len(hits) * 4
                if m.admission_cost(s, hits, want) <= m.num_free_blocks:
                    m.admit(s, hits, want)
                    s.num_computed_tokens = n
                    m.commit_computed(s)
                    ss.append(s)
        elif op == 1:
            i = int(rng.integers(0, len(live)))
            for m, ss in zip(managers, seqs):
                m.free(ss.pop(i))
        elif op == 4 and rng.integers(0, 40) == 0:
            resets += 1
            for m in managers:
                m.reset_prefix_cache()
        else:
            i = int(rng.integers(0, len(live)))
            commit = bool(rng.integers(0, 4))
            for m, ss in zip(managers, seqs):
                s = ss[i]
                if m.can_grow(s, 1):
                    m.grow(s, 1)
                    s.token_ids.append(int(step % 3))
                    s.num_computed_tokens += 1
                    if commit:
                        m.commit_computed(s)
        assert manager_state(managers[1]) == manager_state(managers[0]), f"step {step}"
        assert [s.block_table for s in seqs[1]] == [s.block_table for s in seqs[0]]
    assert resets > 0 and managers[0].num_used_blocks > 0


class CommitEquivalenceMachine(RuleBasedStateMachine):
    """The same random operations on twin sequences in the incremental and the full-walk
    manager (reservations and adoption, stage ends, resets, commits skipped or repeated,
    even computed counts moved back); every piece of state must stay identical."""

    @initialize(num_blocks=st.integers(1, 16), block_size=st.sampled_from([1, 2, 3, 4]), run_blocks=st.integers(1, 3))
    def init(self, num_blocks, block_size, run_blocks):
        self.bms = [BlockManager(num_blocks, block_size), FullWalkBlockManager(num_blocks, block_size)]
        self.bms[0]._run_blocks = run_blocks
        self.twins: list[list[Sequence]] = []
        self.reservations: list[list[int]] = []
        self.n = 0

    def _new_twins(self, tokens, stop_at=None) -> list[Sequence]:
        self.n += 1
        return [make_seq(tokens, f"s{self.n}", stop_at) for _ in self.bms]

    def _each(self, f, twins=None) -> list:
        results = []
        for i, bm in enumerate(self.bms):
            try:
                results.append(f(bm, twins[i] if twins else None))
            except (MemoryError, ValueError) as e:
                results.append(type(e))
        assert all(r == results[0] for r in results), results
        return results

    @rule(tokens=st.lists(st.integers(0, 1), min_size=1, max_size=16), data=st.data(), stopped=st.booleans(),
          commit=st.booleans())
    def admit(self, tokens, data, stopped, commit):
        stop_at = data.draw(st.integers(1, len(tokens)), label="stop_at") if stopped else None
        twins = self._new_twins(tokens, stop_at)
        hits = self._each(lambda bm, s: bm.cached_prefix_blocks(s), twins)[0]
        room = len(tokens) - len(hits) * self.bms[0].block_size
        n = data.draw(st.integers(1, max(1, room)), label="n")
        if self._each(lambda bm, s: bm.admit(s, list(hits), n), twins)[0] is None:
            self.twins.append(twins)
            for s in twins:
                s.num_computed_tokens = min(s.num_computed_tokens + n, len(s.block_table) * self.bms[0].block_size)
            if commit:
                self._each(lambda bm, s: bm.commit_computed(s), twins)

    @precondition(lambda self: bool(self.twins))
    @rule(data=st.data(), new_tokens=st.lists(st.integers(0, 1), max_size=6), n=st.integers(1, 8),
          commit=st.booleans())
    def grow_and_compute(self, data, new_tokens, n, commit):
        twins = data.draw(st.sampled_from(self.twins), label="seq")
        for s in twins:
            s.token_ids += new_tokens
        n = min(n, max(1, twins[0].num_uncomputed_tokens))
        if self._each(lambda bm, s: bm.grow(s, n), twins)[0] is None:
            for s in twins:
                s.num_computed_tokens = min(s.num_computed_tokens + n, s.num_tokens,
                                            len(s.block_table) * self.bms[0].block_size)
            if commit:
                self._each(lambda bm, s: bm.commit_computed(s), twins)

    @precondition(lambda self: bool(self.twins))
    @rule(data=st.data())
    def commit(self, data):
        twins = data.draw(st.sampled_from(self.twins), label="seq")
        self._each(lambda bm, s: bm.commit_computed(s), twins)

    @precondition(lambda self: bool(self.twins))
    @rule(data=st.data())
    def rewind(self, data):
        # Not something the scheduler does; the incremental walk must still equal the full one.
        twins = data.draw(st.sampled_from(self.twins), label="seq")
        back = data.draw(st.integers(0, twins[0].num_computed_tokens), label="computed")
        for s in twins:
            s.num_computed_tokens = back
        self._each(lambda bm, s: bm.commit_computed(s), twins)

    @precondition(lambda self: bool(self.twins))
    @rule(data=st.data())
    def free(self, data):
        twins = data.draw(st.sampled_from(self.twins), label="seq")
        self.twins.remove(twins)
        self._each(lambda bm, s: bm.free(s), twins)

    @rule(n=st.integers(0, 5))
    def reserve(self, n):
        taken = self._each(lambda bm, s: bm.reserve(n))[0]
        if taken is not MemoryError:
            self.reservations.append(taken)

    @precondition(lambda self: bool(self.reservations))
    @rule(data=st.data(), adopt=st.booleans(), tokens=st.lists(st.integers(0, 1), min_size=1, max_size=20))
    def release_or_adopt(self, data, adopt, tokens):
        blocks = data.draw(st.sampled_from(self.reservations), label="reservation")
        self.reservations.remove(blocks)
        if not adopt:
            self._each(lambda bm, s: bm.release_reserved(list(blocks)))
            return
        computed = data.draw(st.integers(0, min(len(tokens), len(blocks) * self.bms[0].block_size)), label="computed")
        twins = self._new_twins(tokens)
        self._each(lambda bm, s: bm.adopt(s, list(blocks), computed), twins)
        self.twins.append(twins)

    @rule()
    def reset(self):
        self._each(lambda bm, s: bm.reset_prefix_cache())

    @invariant()
    def identical(self):
        incremental, full = self.bms
        assert manager_state(incremental) == manager_state(full)
        for a, b in self.twins:
            assert (a.block_table, a.num_computed_tokens) == (b.block_table, b.num_computed_tokens)


CommitEquivalenceMachine.TestCase.settings = settings(
    max_examples=100, stateful_step_count=50, deadline=None, derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestCommitEquivalenceMachine = CommitEquivalenceMachine.TestCase


@pytest.mark.parametrize("policy,roles", [("least_loaded", None), ("pd_disaggregated", ("prefill", "decode", "decode"))])
def test_whole_simulations_match_the_full_walk(monkeypatch, policy, roles):
    made: list[BlockManager] = []

    def run(cls):
        def make(*args):
            made.append(bm := cls(*args))
            return bm

        monkeypatch.setattr(sim_worker, "BlockManager", make)
        sim = Simulator(3, preset("H100", "llama-3-8b"), num_kv_blocks=80, placement_policy=policy, roles=roles,
                        max_num_batched_tokens=512)
        outcome = sim.run(prefix_sharing_workload(), arrivals.poisson(200.0), seed=2)
        return [dataclasses.astuple(r) for r in outcome.results], dataclasses.asdict(outcome.stats)

    full, incremental = run(FullWalkBlockManager), run(BlockManager)
    assert [type(bm) for bm in made] == [FullWalkBlockManager] * 3 + [BlockManager] * 3  # the patch took
    assert incremental[0] == full[0]
    for key in ("virtual_s", "events", "steps", "kv_transfers", "kv_recomputes", "preemptions"):
        assert incremental[1][key] == full[1][key], key
    assert full[1]["preemptions"] > 0  # a small cache: eviction, preemption and re-admission happened


# ---- the lazily kept LRU and the runs of indexed contents -----------------------------


def test_prefix_hits_that_never_evict_keep_the_lru_bounded_and_in_order():
    """Every hit on a free cached block leaves a lapsed LRU entry behind; with no eviction to
    consume them they are compacted away, and the LRU order stays the one of the frees."""
    bm = BlockManager(8, 2)
    first = admit_and_compute(bm, [1, 2, 3, 4, 5, 6, 7])
    table = list(first.block_table)
    bm.free(first)
    for n in range(200):
        seq = admit_and_compute(bm, [1, 2, 3, 4, 5, 6, 7])
        assert seq.block_table[:3] == table[:3]  # all three full blocks hit
        bm.free(seq)
        assert len(bm._lru) <= 2 * bm.num_blocks
    assert bm.free_cached_blocks == [table[2], table[1], table[0]]  # tail first, as freed
    assert bm.num_free_blocks == 8
    # The LRU still evicts in that order once plain blocks run out.
    assert bm.reserve(8)[-3:] == [table[2], table[1], table[0]]
    assert bm.num_evictions == 3 and bm._hash_to_block == {}


def test_a_collision_inside_a_later_run_cuts_the_prefix_at_that_block():
    bm = BlockManager(16, 2)
    bm._run_blocks = 2  # blocks 0-1 in one run, 2-3 in the next
    a = make_seq(list(range(9)))
    bm.admit(a, [], 9)
    a.num_computed_tokens = 9
    bm.commit_computed(a)
    assert len({id(bm._block_run[b]) for b in a.block_table[:4]}) == 2
    b = make_seq([0, 1, 2, 3, 4, 5, 99, 7, 8])
    b.block_hashes = list(a.block_hashes)  # made equal: the fourth block collides
    assert bm.cached_prefix_blocks(b) == a.block_table[:3]
    c = make_seq(list(range(9)))
    assert bm.cached_prefix_blocks(c) == a.block_table[:4]


# ---- the scheduling hint: hashes alone, memoised while nothing leaves the index -------------


def test_the_prefix_hint_equals_the_verified_prefix_and_resumes_as_blocks_get_indexed():
    bm = BlockManager(16, 2)
    waiting = make_seq([1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert bm.cached_prefix_hint_tokens(waiting) == 0 and waiting.prefix_hint == (0, 0)
    a = admit_and_compute(bm, [1, 2, 3, 4, 5])  # indexes two blocks: the hint grows from the memo
    assert bm.cached_prefix_hint_tokens(waiting) == 4 == len(bm.cached_prefix_blocks(waiting)) * 2
    admit_and_compute(bm, [1, 2, 3, 4, 5, 6, 7, 8, 0])
    assert bm.cached_prefix_hint_tokens(waiting) == 8 == len(bm.cached_prefix_blocks(waiting)) * 2
    bm.free(a)
    assert bm.cached_prefix_hint_tokens(make_seq([1, 2, 3, 4, 5, 6, 7, 8])) == 6  # one token always left


def test_an_eviction_invalidates_the_memoised_hint():
    bm = BlockManager(2, 2)
    a = admit_and_compute(bm, [1, 2, 3])
    bm.free(a)
    waiting = make_seq([1, 2, 3])
    assert bm.cached_prefix_hint_tokens(waiting) == 2
    other = admit_and_compute(bm, [8, 8, 8, 8])  # evicts a's cached block
    assert bm.cached_prefix_hint_tokens(waiting) == 0 == len(bm.cached_prefix_blocks(waiting))
    bm.free(other)
    bm.reset_prefix_cache()
    assert bm.cached_prefix_hint_tokens(make_seq([8, 8, 8, 8, 8])) == 0


def test_a_hash_collision_can_only_make_the_hint_larger_than_admission_finds():
    bm = BlockManager(16, 2)
    a = admit_and_compute(bm, list(range(9)))
    b = make_seq([0, 1, 2, 3, 4, 5, 99, 7, 8])
    b.block_hashes = list(a.block_hashes)  # made equal: the fourth block collides
    assert bm.cached_prefix_hint_tokens(b) == 8 and len(bm.cached_prefix_blocks(b)) * 2 == 6
    logprobs = dataclasses.replace(make_seq(list(range(9))), params=SamplingParams(prompt_logprobs=1))
    assert bm.cached_prefix_hint_tokens(logprobs) == 0  # prompt logprobs compute every position
