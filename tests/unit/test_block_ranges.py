"""BlockManager's range operations are the old per-block code, only faster.

`ReferenceBlockManager` below is the engine's block manager as it was before its
operations were made to work on whole ranges of blocks (one `_pop_free` / `_uncache` /
`hash_block` call per block) and before `commit_computed` became incremental (it walks
every full block on every call). Random operation sequences run on both, on twin copies
of the same sequences, and every answer (prefix hits, costs, block tables, errors) and
every piece of state (ref counts, hashes, contents, free pools in order, the prefix index)
must be identical after every step, prefix-cache resets included; so must whole
simulations.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict, deque

import numpy as np
import pytest
from conftest import prefix_sharing_workload
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from loadgen import arrivals
from loadgen.sessions import ToolDelay, generate_sessions
from services.planner import sim_worker
from services.planner.simulator import Simulator
from splitserve.core import BlockManager, SamplingParams, Sequence, StageKey
from splitserve.core.block_manager import Block, hash_block
from splitserve.perf.presets import preset

_ROOT_HASH = 0x5EED


class ReferenceBlockManager:
    """The per-block implementation (verbatim but for names), kept as the specification."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free_plain: deque[int] = deque(range(num_blocks))
        self._free_cached: OrderedDict[int, None] = OrderedDict()
        self._hash_to_block: dict[int, int] = {}
        self.prefix_hits_tokens = 0
        self.prefix_queries_tokens = 0
        self.num_evictions = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_plain) + len(self._free_cached)

    @property
    def free_plain_blocks(self) -> list[int]:
        return list(self._free_plain)

    @property
    def free_cached_blocks(self) -> list[int]:
        return list(self._free_cached)

    def indexes_any(self, hashes: list[int]) -> bool:
        return any(h in self._hash_to_block for h in hashes)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def update_block_hashes(self, seq: Sequence) -> list[int]:
        hashes = seq.block_hashes
        bs = self.block_size
        for i in range(len(hashes), seq.num_tokens // bs):
            parent = hashes[-1] if hashes else _ROOT_HASH
            hashes.append(hash_block(parent, tuple(seq.token_ids[i * bs : (i + 1) * bs])))
        return hashes

    def seed_block_hashes(self, seq: Sequence, tokens, hashes) -> bool:
        return False  # the reference hashes every block itself: seeding must change nothing

    def cached_prefix_blocks(self, seq: Sequence) -> list[int]:
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
                break
            hits.append(block_id)
        return hits

    def cached_prefix_hint_tokens(self, seq: Sequence) -> int:
        # Without hash collisions (none here) the hint is the verified prefix.
        return len(self.cached_prefix_blocks(seq)) * self.block_size

    def blocks_to_grow(self, seq: Sequence, num_new_tokens: int) -> int:
        needed = self.blocks_for_tokens(seq.num_computed_tokens + num_new_tokens)
        return max(0, needed - len(seq.block_table))

    def can_grow(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.blocks_to_grow(seq, num_new_tokens) <= self.num_free_blocks

    def admission_cost(self, seq: Sequence, prefix_hits: list[int], num_new_tokens: int) -> int:
        cached_tokens = len(prefix_hits) * self.block_size
        new_blocks = self.blocks_for_tokens(cached_tokens + num_new_tokens) - len(prefix_hits)
        reclaimed = sum(1 for b in prefix_hits if self.blocks[b].ref_count == 0)
        return new_blocks + reclaimed

    def admit(self, seq: Sequence, prefix_hits: list[int], num_new_tokens: int) -> None:
        assert not seq.block_table
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
        need = self.blocks_to_grow(seq, num_new_tokens)
        if need > self.num_free_blocks:
            raise MemoryError("not enough free KV blocks to grow sequence")
        for _ in range(need):
            block_id = self._pop_free()
            self.blocks[block_id].ref_count = 1
            seq.block_table.append(block_id)

    def reserve(self, num_blocks: int) -> list[int]:
        if num_blocks > self.num_free_blocks:
            raise MemoryError(f"need {num_blocks} free KV blocks, have {self.num_free_blocks}")
        taken = []
        for _ in range(num_blocks):
            block_id = self._pop_free()
            self.blocks[block_id].ref_count = 1
            taken.append(block_id)
        return taken

    def release_reserved(self, block_ids: list[int]) -> None:
        for block_id in block_ids:
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count == 0 and block.block_hash is None
            self._free_plain.append(block_id)

    def adopt(self, seq: Sequence, block_ids: list[int], num_computed_tokens: int, prefix=()) -> None:
        assert not seq.block_table
        needed = self.blocks_for_tokens(num_computed_tokens) - len(prefix)
        if len(block_ids) < needed or needed < 0:
            raise ValueError(f"{len(block_ids)} blocks cannot hold {num_computed_tokens} tokens")
        self.retain(list(prefix))
        self.release_reserved(block_ids[needed:])
        seq.block_table = list(prefix) + list(block_ids[:needed])
        seq.num_computed_tokens = num_computed_tokens
        self.commit_computed(seq)

    def commit_computed(self, seq: Sequence) -> None:
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
                continue
            block.block_hash = h
            block.token_ids = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            self._hash_to_block[h] = block.block_id

    def free(self, seq: Sequence) -> None:
        self.release_blocks(seq.block_table)
        seq.block_table = []
        seq.num_computed_tokens = 0

    # Session pins (splitserve.core.session_pins): extra references on indexed blocks.
    def indexed_prefix(self, seq: Sequence) -> list[int]:
        if not self.enable_prefix_caching:
            return []
        hashes = self.update_block_hashes(seq)
        prefix = []
        for h in hashes[:min(seq.num_computed_tokens // self.block_size, len(hashes))]:
            block_id = self._hash_to_block.get(h)
            if block_id is None:
                break
            prefix.append(block_id)
        return prefix

    def retain(self, block_ids: list[int]) -> None:
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self._free_cached[block_id]
            block.ref_count += 1

    def freeable_if_released(self, block_ids: list[int]) -> int:
        drops = {b: block_ids.count(b) for b in set(block_ids)}
        return sum(1 for b, n in drops.items() if self.blocks[b].ref_count == n)

    def release_blocks(self, block_ids: list[int]) -> None:
        for block_id in reversed(block_ids):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {block_id} freed twice"
            if block.ref_count == 0:
                if block.block_hash is not None:
                    self._free_cached[block_id] = None
                else:
                    self._free_plain.append(block_id)

    def reset_prefix_cache(self) -> None:
        for block_id in list(self._free_cached):
            self._uncache(block_id)
            self._free_plain.append(block_id)
        self._free_cached.clear()
        for block in self.blocks:
            if block.block_hash is not None:
                self._uncache(block.block_id)

    def _pop_free(self) -> int:
        if self._free_plain:
            return self._free_plain.popleft()
        block_id, _ = self._free_cached.popitem(last=False)
        self.num_evictions += 1
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


def _seq(tokens, rid: str, stop_at: int | None = None) -> Sequence:
    return Sequence(StageKey(rid), list(tokens), len(tokens), SamplingParams(), 0, 0.0, stop_at=stop_at)


def _state(bm) -> tuple:
    return ([(b.block_id, b.ref_count, b.block_hash, b.token_ids) for b in bm.blocks], list(bm.free_plain_blocks),
            list(bm.free_cached_blocks), dict(bm._hash_to_block), bm.prefix_hits_tokens, bm.prefix_queries_tokens)


def _outcome(f):
    """A call's result, or the type of the error it raised (both managers must agree)."""
    try:
        return f()
    except (MemoryError, ValueError) as e:
        return type(e)


class RangesMachine(RuleBasedStateMachine):
    """The same random operations on the reference and the core's manager."""

    @initialize(num_blocks=st.integers(1, 16), block_size=st.sampled_from([1, 2, 3, 4]), caching=st.booleans(),
                run_blocks=st.integers(1, 4))
    def init(self, num_blocks, block_size, caching, run_blocks):
        self.bms = [ReferenceBlockManager(num_blocks, block_size, caching), BlockManager(num_blocks, block_size, caching)]
        self.bms[1]._run_blocks = run_blocks  # indexed contents kept in runs of this many blocks
        self.seqs: list[list[Sequence]] = []  # per live sequence: its twin in each manager
        self.reservations: list[list[int]] = []
        self.n = 0

    def _each(self, f, twins=None) -> list:
        return [_outcome(lambda i=i: f(bm, twins[i] if twins else None)) for i, bm in enumerate(self.bms)]

    def _new_twins(self, tokens, stop_at=None) -> list[Sequence]:
        self.n += 1
        return [_seq(tokens, f"s{self.n}", stop_at) for _ in self.bms]

    @rule(tokens=st.lists(st.integers(0, 2), min_size=1, max_size=20), data=st.data(), stopped=st.booleans())
    def admit(self, tokens, data, stopped):
        stop_at = data.draw(st.integers(1, len(tokens)), label="stop_at") if stopped else None
        twins = self._new_twins(tokens, stop_at)
        hits = self._each(lambda bm, s: bm.cached_prefix_blocks(s), twins)
        assert all(h == hits[0] for h in hits)
        room = len(tokens) - len(hits[0]) * self.bms[0].block_size
        n = data.draw(st.integers(1, max(1, room)), label="n")
        assert len(set(self._each(lambda bm, s: bm.admission_cost(s, hits[0], n), twins))) == 1
        done = self._each(lambda bm, s: bm.admit(s, list(hits[0]), n), twins)
        assert all(d == done[0] for d in done)
        if done[0] is None:
            self.seqs.append(twins)

    @precondition(lambda self: bool(self.seqs))
    @rule(data=st.data(), new_tokens=st.lists(st.integers(0, 2), max_size=9), n=st.integers(0, 12))
    def grow(self, data, new_tokens, n):
        twins = data.draw(st.sampled_from(self.seqs), label="seq")
        for s in twins:
            s.token_ids += new_tokens
        assert len(set(self._each(lambda bm, s: (bm.blocks_to_grow(s, n), bm.can_grow(s, n)), twins))) == 1
        assert len(set(map(str, self._each(lambda bm, s: bm.grow(s, n), twins)))) == 1

    @precondition(lambda self: bool(self.seqs))
    @rule(data=st.data())
    def compute_and_commit(self, data):
        twins = data.draw(st.sampled_from(self.seqs), label="seq")
        s0 = twins[0]  # never past its tokens, as the engine never is
        room = min(len(s0.block_table) * self.bms[0].block_size, s0.num_tokens) - s0.num_computed_tokens
        n = data.draw(st.integers(0, max(0, room)), label="n")
        self._each(lambda bm, s: setattr(s, "num_computed_tokens", s.num_computed_tokens + n), twins)
        self._each(lambda bm, s: bm.commit_computed(s), twins)

    @precondition(lambda self: bool(self.seqs))
    @rule(data=st.data())
    def free(self, data):
        twins = data.draw(st.sampled_from(self.seqs), label="seq")
        self.seqs.remove(twins)
        self._each(lambda bm, s: bm.free(s), twins)

    @rule(n=st.integers(0, 6))
    def reserve(self, n):
        taken = self._each(lambda bm, s: bm.reserve(n))
        assert all(t == taken[0] for t in taken)
        if taken[0] is not MemoryError:
            self.reservations.append(taken[0])

    @precondition(lambda self: bool(self.reservations))
    @rule(data=st.data(), adopt=st.booleans(), tokens=st.lists(st.integers(0, 2), min_size=1, max_size=24))
    def release_or_adopt(self, data, adopt, tokens):
        blocks = data.draw(st.sampled_from(self.reservations), label="reservation")
        self.reservations.remove(blocks)
        if not adopt:
            self._each(lambda bm, s: bm.release_reserved(blocks))
            return
        computed = data.draw(st.integers(0, min(len(tokens), len(blocks) * self.bms[0].block_size)), label="computed")
        twins = self._new_twins(tokens)
        self._each(lambda bm, s: bm.adopt(s, list(blocks), computed), twins)
        self.seqs.append(twins)

    @rule()
    def reset(self):
        # The incremental commit must walk again the blocks a reset un-indexed.
        self._each(lambda bm, s: bm.reset_prefix_cache())

    @invariant()
    def identical(self):
        ref = _state(self.bms[0])
        for bm in self.bms[1:]:
            assert _state(bm) == ref
        for twins in self.seqs:
            assert len({(tuple(s.block_table), s.num_computed_tokens) for s in twins}) == 1
            assert all(s.block_hashes == twins[0].block_hashes for s in twins)


# Fewer examples than before: CommitEquivalenceMachine (test_block_manager.py) checks the
# incremental commit against a full walk too, so the two machines share that work.
RangesMachine.TestCase.settings = settings(
    max_examples=120, stateful_step_count=50, deadline=None, derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestRangesMachine = RangesMachine.TestCase


def test_block_hashes_chain_every_full_block():
    bm = BlockManager(8, 3)
    seq = _seq([4, 4, 4, 1], "a")
    for t in [2, 9, 9, 9, 3, 3, 7]:
        seq.token_ids.append(t)
        bm.update_block_hashes(seq)
        full = len(seq.token_ids) // 3
        assert len(seq.block_hashes) == full
        parent = _ROOT_HASH
        for i in range(full):
            parent = hash_block(parent, tuple(seq.token_ids[i * 3 : (i + 1) * 3]))
            assert seq.block_hashes[i] == parent


@pytest.mark.parametrize("cls", [ReferenceBlockManager, BlockManager])
def test_a_hash_collision_cuts_the_prefix_where_contents_differ(cls):
    bm = cls(16, 2)
    a = _seq([1, 1, 2, 2, 3, 3, 4], "a")
    bm.admit(a, [], 7)
    a.num_computed_tokens = 7
    bm.commit_computed(a)
    # b's second block differs from a's, but its hashes are made equal to a's: a collision.
    b = _seq([1, 1, 5, 5, 3, 3, 4], "b")
    b.block_hashes = list(a.block_hashes)
    assert bm.cached_prefix_blocks(b) == a.block_table[:1]


@pytest.mark.parametrize("policy,roles", [("least_loaded", None), ("pd_disaggregated", ("prefill", "decode", "decode"))])
def test_whole_simulations_match_the_reference(monkeypatch, policy, roles):
    made: list = []

    def run(cls):
        def make(*args):
            made.append(bm := cls(*args))
            return bm

        monkeypatch.setattr(sim_worker, "BlockManager", make)  # what each SimWorker builds
        sim = Simulator(3, preset("H100", "llama-3-8b"), num_kv_blocks=80, placement_policy=policy, roles=roles,
                        max_num_batched_tokens=512)
        outcome = sim.run(prefix_sharing_workload(), arrivals.poisson(200.0), seed=2)
        return [dataclasses.astuple(r) for r in outcome.results], dataclasses.asdict(outcome.stats)

    reference, ranges = run(ReferenceBlockManager), run(BlockManager)
    assert [type(bm) for bm in made] == [ReferenceBlockManager] * 3 + [BlockManager] * 3  # the patch took
    assert ranges[0] == reference[0]
    for key in ("virtual_s", "events", "steps", "kv_transfers", "kv_recomputes", "preemptions"):
        assert ranges[1][key] == reference[1][key], key
    assert reference[1]["preemptions"] > 0  # a small cache: eviction, preemption and re-admission happened


def test_whole_session_simulations_match_the_reference(monkeypatch):
    """AMPD sessions (pinned histories, leases, remote incremental prefills): the core's block
    manager, which takes a round's hashes from its pin or its lease, against the reference,
    which hashes every block itself."""
    made: list = []

    def run(cls):
        def make(*args):
            made.append(bm := cls(*args))
            return bm

        monkeypatch.setattr(sim_worker, "BlockManager", make)
        sim = Simulator(3, preset("H20", "qwen3-32b", link="rdma-200g"), num_kv_blocks=300, placement_policy="ampd",
                        roles=("prefill", "decode", "decode"))
        sessions = generate_sessions("toolbench", 12, np.random.default_rng(3), length_scale=0.25,
                                     tool_delay=ToolDelay("exponential", 0.5))
        outcome = sim.run(sessions, arrivals.poisson(4.0), seed=3)
        stats = dataclasses.asdict(outcome.stats)
        del stats["wall_s"]
        return [dataclasses.astuple(r) for r in outcome.results], stats

    reference, core = run(ReferenceBlockManager), run(BlockManager)
    assert [type(bm) for bm in made] == [ReferenceBlockManager] * 3 + [BlockManager] * 3
    assert core == reference
    assert reference[1]["kv_pulls"] > 0 and reference[1]["incremental_prefills_local"] > 0  # both routes taken
