"""The synthetic engine's parts on their own: allocator, prefix cache, workload, SWA window, EAGLE keys."""

from __future__ import annotations

import numpy as np
import pytest

from kvcanary_cupy.sim.allocator import SlotAllocator
from kvcanary_cupy.sim.engine import Engine, size_engine
from kvcanary_cupy.sim.radix import RadixTree
from kvcanary_cupy.sim.workload import WorkloadShape, make_workload


def i64(values) -> np.ndarray:
    return np.asarray(values, np.int64)


def test_allocator_reserves_slot_zero_and_reuses_freed_slots_first():
    alloc = SlotAllocator(8)
    got = alloc.alloc(3)
    assert got.tolist() == [1, 2, 3]
    assert alloc.free([2]) == [2]
    assert alloc.alloc(1).tolist() == [2]  # a stack: the freed slot comes back first
    assert alloc.alloc(5) is None  # only 4 left (slot 0 is never handed out)
    assert 0 not in alloc.alloc(4).tolist()


def test_allocator_counts_references_and_ignores_double_frees():
    alloc = SlotAllocator(4)
    (slot,) = alloc.alloc(1).tolist()
    alloc.share(slot)
    assert alloc.free([slot]) == []  # still held once
    assert alloc.free([slot]) == [slot]
    assert alloc.free([slot]) == []  # not held any more: refused
    assert alloc.available == 3


def test_radix_tree_match_splits_and_returns_the_shared_slots():
    tree = RadixTree()
    assert tree.insert(i64([1, 2, 3, 4]), i64([11, 12, 13, 14]), now=0) [0] == 0
    slots, node = tree.match(i64([1, 2, 9]), now=1)
    assert slots.tolist() == [11, 12]
    assert node.slots.tolist() == [11, 12]  # the node was split at the divergence
    cached, leaf = tree.insert(i64([1, 2, 7, 8]), i64([21, 22, 23, 24]), now=2)
    assert cached == 2 and leaf.slots.tolist() == [23, 24]
    slots, positions, prevs = tree.walk()
    walk = sorted(zip(slots.tolist(), positions.tolist(), prevs.tolist(), strict=True))
    assert walk == [(11, 0, -1), (12, 1, 11), (13, 2, 12), (14, 3, 13), (23, 2, 12), (24, 3, 23)]
    assert tree.size == 6


def test_radix_tree_evicts_unlocked_leaves_lru_first():
    tree = RadixTree()
    tree.insert(i64([1, 2]), i64([1, 2]), now=0)
    _, b = tree.insert(i64([5, 6]), i64([5, 6]), now=1)
    tree.lock(b, +1)
    released: list[int] = []
    freed = tree.evict(10, lambda s: released.extend(s.tolist()))
    assert freed == 2 and released == [1, 2]  # the locked path stays
    tree.lock(b, -1)
    assert tree.evict(10, lambda s: released.extend(s.tolist())) == 2
    assert tree.walk()[0].shape[0] == 0


def test_workload_is_reproducible_and_shares_prefixes():
    shape = WorkloadShape(p_system=1.0, p_followup=0.0, system_prompts=1)
    a = make_workload(shape, 6, 50, np.random.default_rng(3))
    b = make_workload(shape, 6, 50, np.random.default_rng(3))
    assert all(np.array_equal(x.tokens, y.tokens) and x.arrival == y.arrival for x, y in zip(a, b, strict=True))
    system = a[0].tokens[:16]
    assert all(np.array_equal(spec.tokens[:16], system) for spec in a)  # one system prompt for all
    assert all(spec.output_len >= 1 and spec.prompt_len >= 2 for spec in a)


def _run_engine(engine: Engine, steps: int) -> None:
    for t in range(steps):
        batch = engine.schedule(t)
        engine.sample(batch)
        engine.finish_step(batch)


def test_engine_recycles_rows_reuses_prefixes_and_keeps_slots_consistent():
    shape = WorkloadShape(p_system=0.9, p_followup=0.3, suffix_len=(4, 16), output_len=(2, 8), max_total_len=128)
    specs = make_workload(shape, 24, 60, np.random.default_rng(1))
    engine = Engine(size_engine(specs, max_running=4, chunk_size=32), specs, np)
    _run_engine(engine, 120)
    assert engine.stats["requests_finished"] == 24
    assert engine.stats["rows_recycled"] > 0
    assert engine.stats["prefix_tokens_reused"] > 0
    # every slot is either free or held by the prefix cache, exactly once
    slots, _, _ = engine.tree.walk()
    held = np.flatnonzero(engine.alloc.refs)
    assert sorted(slots.tolist()) == held.tolist()
    assert engine.alloc.available + held.shape[0] == engine.cfg.num_slots - 1


def test_swa_window_evicts_decode_positions_but_protects_the_prompt():
    shape = WorkloadShape(p_system=0.0, p_followup=0.0, suffix_len=(20, 20), output_len=(40, 40), max_total_len=128)
    specs = make_workload(shape, 1, 200, np.random.default_rng(0))
    engine = Engine(size_engine(specs, max_running=2, chunk_size=64, swa_window=8), specs, np)
    for t in range(30):
        batch = engine.schedule(t)
        engine.sample(batch)
        engine.finish_step(batch)
    (req,) = engine.decoding
    mapped = engine.lut_host[req.slots[: req.computed]] != 0
    assert mapped[: req.prompt_len].all()  # prompt positions keep their SWA slots
    assert not mapped[req.prompt_len : req.computed - 8].any()  # decoded positions out of the window are gone
    assert mapped[req.computed - 8 : req.computed].all()
    assert np.array_equal(np.asarray(engine.lut), engine.lut_host)  # the device LUT follows the host's


def test_eagle_prefix_keys_are_bigrams():
    specs = make_workload(WorkloadShape(), 1, 4, np.random.default_rng(0))
    engine = Engine(size_engine(specs, max_running=2, eagle=True), specs, np)
    keys = engine.keys(i64([3, 5, 7]))
    assert keys.tolist() == [(3 << 32) | 5, (5 << 32) | 7]


@pytest.mark.parametrize("eagle", [False, True])
def test_batches_are_request_major_with_trailing_padding(eagle):
    shape = WorkloadShape(p_system=0.0, p_followup=0.0, suffix_len=(4, 4), output_len=(6, 6), arrival_fraction=0.001)
    specs = make_workload(shape, 3, 200, np.random.default_rng(0))
    engine = Engine(size_engine(specs, max_running=3, chunk_size=64, eagle=eagle), specs, np)
    _run_engine(engine, 1)  # prefill all three
    batch = engine.schedule(1)  # decode only: padded to a CUDA-graph size (4)
    assert batch.num_padding == 1
    assert np.asarray(batch.req_pool_indices).tolist()[-1] == 0
    assert np.asarray(batch.positions)[:3].tolist() == [4, 4, 4]
    rows = np.asarray(batch.req_pool_indices)[:3]
    assert np.array_equal(np.asarray(batch.out_cache_loc)[:3], engine.rtt_host[rows, 4])
    engine.sample(batch)
    if eagle:  # the draft's slot at position p takes token p + 1
        want = [r.tokens[5] for r in batch.reqs]
        assert np.asarray(batch.draft_input_ids)[:3].tolist() == want
