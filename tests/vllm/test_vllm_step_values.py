"""Small values of the vLLM step read and the sweep's block index worked out by hand: the sweep's stated
latency at its edges (fewer indexed blocks than one sweep takes, one block per sweep, the sweep off), the blocks
one sweep takes (a step's tokens in whole blocks, at least one), a slot
looked up through a step's block table, a per-token array put in the canary's token order, the count of
indexed blocks over groups, a runner tensor that refuses a NumPy view read through a host copy, each row's
expected history and accepted length under draft tokens (:func:`with_drafts`), and the rows the same-step look-up
names (:func:`_same_step_rows`: exactly the rows whose prefix ends at a block boundary in every group and holds,
inside its window, a block the step writes; never a row for its own new block)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

from kvcanary_cupy.integrations.vllm.blocks import BlockIndex, sweep_latency_steps
from kvcanary_cupy.integrations.vllm.canary import GroupGeometry, sweep_blocks
from kvcanary_cupy.integrations.vllm.step import RequestHistories, VllmStep, _host, _same_step_rows, with_drafts


@pytest.mark.parametrize(("indexed", "per_sweep", "interval", "steps"), [
    (0, 4, 3, 3),  # nothing indexed yet: a pass still takes one sweep
    (3, 4, 3, 3),  # fewer blocks than one sweep takes: one sweep
    (4, 4, 3, 3),
    (5, 4, 3, 6),  # one block more: two sweeps
    (5, 1, 2, 10),  # one block per sweep: a sweep per block
    (7, 0, 2, 14),  # a sweep takes at least one block
    (9, 4, 0, 0),  # the sweep is off
    (9, 4, -1, 0),
], ids=["empty", "under-one-sweep", "one-sweep", "two-sweeps", "one-per-sweep", "zero-per-sweep", "off",
        "negative-interval"])
def test_the_sweep_latency_is_the_interval_times_the_sweeps_one_pass_takes(indexed, per_sweep, interval, steps):
    assert sweep_latency_steps(indexed, per_sweep, interval) == steps


@pytest.mark.parametrize(("max_tokens", "block_size", "blocks"), [(64, 16, 4), (40, 16, 2), (20, 16, 1), (4, 16, 1)],
                         ids=["exact", "whole-blocks", "one", "under-one-block"])
def test_one_sweep_takes_the_whole_blocks_of_a_steps_tokens_and_at_least_one(max_tokens, block_size, blocks):
    got = sweep_blocks(max_tokens, block_size)
    assert got == blocks and isinstance(got, int)


@dataclass
class Geo:
    index: int
    block_size: int
    layer_names: list[str] = field(default_factory=list)


def step_with(block_tables=None, source_index=None, restamped=False, deferred=None) -> VllmStep:
    empty = np.zeros(0, np.int64)
    return VllmStep(step=0, request_ids=["a", "b"], rows=np.array([1, 2]), prefix_lens=empty, extend_lens=empty,
                    input_ids=empty, positions=empty, expected_input_ids=empty, expected_positions=empty,
                    history_ids=empty, valid_lens=empty, block_tables=block_tables or {}, slot_mappings={},
                    source_index=empty if source_index is None else np.array(source_index, np.int64),
                    forward_tokens=0, restamped=restamped, deferred=deferred or {})


def test_a_steps_slot_is_read_through_its_own_block_table_per_group():
    # group 0: blocks of 4 slots, row 1 holds blocks 7 and 2; group 3: blocks of 2, row 1 holds 5, 9, 1
    tables = {0: np.array([[0, 0], [7, 2]], np.int32), 3: np.array([[0, 0, 0], [5, 9, 1]], np.int32)}
    step = step_with(tables)
    assert [step.slot(Geo(0, 4), 1, p) for p in range(8)] == [28, 29, 30, 31, 8, 9, 10, 11]
    assert [step.slot(Geo(3, 2), 1, p) for p in range(6)] == [10, 11, 18, 19, 2, 3]


def test_the_block_index_counts_the_blocks_indexed_in_every_group():
    index = BlockIndex([6, 4], [2, 2], blocks_per_sweep=2, group_ids=[0, 3])
    assert len(index) == 0
    index.where[0][[1, 4]] = [0, 1]
    index.where[3][2] = 5
    assert len(index) == 3
    assert sorted(index) == [(0, 1), (0, 4), (3, 2)]


@pytest.mark.parametrize("deferred", [{}, {"b": 3}], ids=["restamped", "deferred"])
def test_canary_tokens_take_each_forward_token_by_its_source_and_each_restamp_from_the_restamp_values(deferred):
    # canary order: forward token 0, a re-stamp, forward tokens 2 and 1 (forward token 3 deferred)
    step = step_with(source_index=[0, -1, 2, 1], restamped=not deferred, deferred=deferred)
    forward = np.array([10, 11, 12, 13])
    restamps = np.array([20, 21, 22, 23])
    assert step.canary_tokens(forward, restamps).tolist() == [10, 21, 12, 11]


def test_canary_tokens_of_a_step_in_forward_order_are_the_forward_values_themselves():
    forward = np.array([10, 11])
    assert step_with(source_index=[0, 1]).canary_tokens(forward, np.array([20, 21])) is forward


def test_a_runner_tensor_that_refuses_a_numpy_view_is_read_through_a_detached_copy():
    # a tensor that requires grad refuses ``.numpy()``: its values come through the detached host copy
    tensor = torch.tensor([1.5, -2.0, 3.25], requires_grad=True)
    with pytest.raises(RuntimeError):
        tensor.numpy()
    assert _host(tensor).tolist() == [1.5, -2.0, 3.25]
    assert _host(torch.tensor([4, 5], dtype=torch.int32)).tolist() == [4, 5]


@dataclass
class State:
    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)


def test_a_rows_drafts_follow_its_accepted_history_and_at_most_its_new_tokens_are_drafts():
    """A schedules 4 new tokens ending at 9 with 3 drafts: its state's first 6 tokens, then the drafts (6
    accepted). B has no drafts: its history up to 4. C has 5 drafts but only 2 new tokens: the first 2 drafts
    follow its first 5 tokens. D's draft list is empty: its history up to 3."""
    requests = {"A": State([1, 2, 3, 4, 5, 6]), "B": State([10, 11, 12], [13]), "C": State([20, 21, 22, 23, 24]),
                "D": State([30, 31, 32])}
    drafts = {"A": [70, 71, 72], "C": [80, 81, 82, 83, 84], "D": []}
    parts, confirmed = with_drafts(RequestHistories(), ["A", "B", "C", "D"], requests, np.array([9, 4, 7, 3]),
                                   np.array([4, 1, 2, 1]), drafts)
    assert [p.tolist() for p in parts] == [[1, 2, 3, 4, 5, 6, 70, 71, 72], [10, 11, 12, 13],
                                           [20, 21, 22, 23, 24, 80, 81], [30, 31, 32]]
    assert all(p.dtype == np.int64 for p in parts)
    assert confirmed.tolist() == [6, 4, 5, 3]


def test_a_drafting_row_whose_state_lacks_its_accepted_tokens_is_refused_by_its_request_id():
    # A ends at 9 with one draft: its state must hold 8 tokens, it holds 6
    with pytest.raises(ValueError, match="^kv-canary: request A schedules positions up to 8 but its state holds 6 "
                                         r"tokens \(async scheduling is not supported: use async_scheduling=False\)$"):
        with_drafts(RequestHistories(), ["A"], {"A": State([1, 2, 3, 4, 5, 6])}, np.array([9]), np.array([2]),
                    {"A": [70]})


def geometry(index: int, block_size: int, window: int = 0) -> GroupGeometry:
    return GroupGeometry(index=index, name=f"g{index}", block_size=block_size, num_blocks=64, layer_names=[],
                         caches=[], window=window)


def slots_of_blocks(blocks: list[int], bs: int) -> np.ndarray:
    """Every slot of ``blocks``, as a forward writing them whole writes them."""
    return np.array([b * bs + k for b in blocks for k in range(bs)], np.int64)


def test_the_same_step_look_up_names_only_aligned_rows_with_a_verified_prefix_block_written_in_the_step():
    """One full-attention group, blocks of 4. Row 0 writes blocks 9 and 10 from position 0 (no prefix). Row 1
    (prefix 8: blocks 9, 10) hits them in the same step: the one row named. Row 2 (prefix 8: blocks 5, 6, cached
    before) writes its own new block 7 right after its prefix: not named (the block past the prefix is the
    row's own). Row 3 (prefix 6, inside block 12) reads block 9 too: not named (its prefix ends mid-block)."""
    geo = geometry(0, 4)
    table = np.array([[9, 10, 0], [9, 10, 11], [5, 6, 7], [9, 12, 0]], np.int32)
    prefix = np.array([0, 8, 8, 6])
    written = np.concatenate([slots_of_blocks([9, 10], 4), [44], slots_of_blocks([7], 4), [50, 51]])
    rows = _same_step_rows(prefix, {0: table}, {0: written}, [geo])
    assert rows.tolist() == [1]
    # no row with a prefix written in the step: none, whatever the other rows' own blocks
    assert _same_step_rows(prefix[2:], {0: table[2:]}, {0: written[9:]}, [geo]).tolist() == []


def test_the_same_step_look_up_takes_a_row_only_where_its_prefix_ends_at_a_block_boundary_in_every_group():
    """Two groups, blocks of 8 (group 0) and 4 (group 1). The row's prefix of 4 tokens ends at a block boundary
    in group 1 only; its group-1 block 9 is written in the step by another row: still not a candidate (a prefix
    hit is whole blocks in every group). With a prefix of 8, aligned in both, the same block makes it one."""
    geos = [geometry(0, 8), geometry(1, 4)]
    written = {0: slots_of_blocks([3], 8)[:4], 1: slots_of_blocks([9], 4)}
    for prefix, want in ((4, []), (8, [0])):
        tables = {0: np.array([[3, 0]], np.int32), 1: np.array([[9, 2, 0]], np.int32)}
        assert _same_step_rows(np.array([prefix]), tables, written, geos).tolist() == want, prefix


@pytest.mark.parametrize("seed", range(60))
def test_the_same_step_look_up_names_exactly_the_rows_a_position_by_position_search_names(seed):
    """Random batches over one to three groups (full attention or a sliding window, blocks of 2, 4 or 8, shared
    block ids), against a search position by position: a row is named when its prefix ends at a block boundary
    in every group and some prefix position inside a group's window sits in a non-null block the step writes a
    slot of."""
    rng = np.random.default_rng(seed)
    geos = [geometry(g, int(rng.choice([2, 4, 8])), window=int(rng.choice([0, 0, 3, 6, 12])))
            for g in range(int(rng.integers(1, 4)))]
    b = int(rng.integers(1, 7))
    boundary = int(np.lcm.reduce([geo.block_size for geo in geos]))
    prefix = np.array([int(rng.integers(0, 4)) * boundary + (int(rng.integers(0, 3)) if rng.random() < 0.3 else 0)
                       for _ in range(b)], np.int64)
    tables, written = {}, {}
    for geo in geos:
        width = int(prefix.max()) // geo.block_size + 2
        tables[geo.index] = rng.integers(0, 12, (b, width)).astype(np.int32)
        written[geo.index] = rng.integers(0, 12 * geo.block_size, int(rng.integers(0, 10))).astype(np.int64)
    want = []
    for i in range(b):
        p = int(prefix[i])
        if p == 0 or any(p % geo.block_size for geo in geos):
            continue
        hit = False
        for geo in geos:
            start = max(p - geo.window + 1, 0) if geo.window else 0
            blocks_written = {int(s) // geo.block_size for s in written[geo.index]}
            for pos in range(start, p):
                col = pos // geo.block_size
                if col < tables[geo.index].shape[1]:
                    block = int(tables[geo.index][i, col])
                    hit |= block > 0 and block in blocks_written
        if hit:
            want.append(i)
    assert _same_step_rows(prefix, tables, written, geos).tolist() == want


def test_the_same_step_look_up_in_a_sliding_window_group_reads_only_the_prefix_blocks_inside_the_window():
    """A sliding-window group (window 4, blocks of 4). Row 0 (prefix 8, window from position 5: block column 1)
    writes its own new block 22 and, in the step, another row writes block 20, which the row's table names
    below its window: neither makes it a candidate. Row 1 (prefix 8) reads block 30 in its window, written in
    the step: a candidate."""
    geo = geometry(0, 4, window=4)
    table = np.array([[20, 21, 22], [40, 30, 31]], np.int32)
    written = np.concatenate([slots_of_blocks([20, 22, 30], 4)])
    rows = _same_step_rows(np.array([8, 8]), {0: table}, {0: written}, [geo])
    assert rows.tolist() == [1]
