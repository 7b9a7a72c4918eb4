"""The NumPy reference on block tables and CSR page lists, against the scalar layout oracle.

Valid batches must give the oracle's outputs in "raise" mode and the very plan of the token table that
describes the same slots; hostile device values must give the oracle's flagged outputs in "flag" mode and a
``kv-canary: `` ValueError with nothing written in "raise" mode.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import strategies
from differential import examples, plan_matches_oracle, run_plan
from hypothesis import given, settings
from layout_oracle import layout_plan_oracle
from layout_strategies import layout_cases
from plan_helpers import fresh_plans

import kvcanary_cupy as kc


def _plans(case):
    return (kc.VerifyPlan.allocate(verify_capacity=case.kwargs["verify_capacity"]),
            kc.WritePlan.allocate(write_req_capacity=case.write_req_capacity))


def _same_plan(got: dict[str, np.ndarray], want: dict[str, np.ndarray], bs: int) -> None:
    for name in want:
        g, w = got[name], want[name]
        if name == "write.verify_offsets":  # scratch: only [0, bs] is defined by the contract
            g, w = g[: bs + 1], w[: bs + 1]
        np.testing.assert_array_equal(g, w, err_msg=name)


@settings(max_examples=examples(800))
@given(layout_cases())
def test_paged_plan_matches_oracle_on_valid_batches(case):
    expect = layout_plan_oracle(**case.oracle_kwargs())
    assert expect.status == 0
    vp, wp = _plans(case)
    kc.launch_canary_plan_kernels(verify_plan_out=vp, write_plan_out=wp, **case.kwargs)  # raise mode: no raise
    plan_matches_oracle(run_plan("numpy", case), expect, case)


@settings(max_examples=examples(800))
@given(layout_cases(hostile=True))
def test_paged_plan_flags_hostile_values_like_the_oracle_and_raises_otherwise(case):
    expect = layout_plan_oracle(**case.oracle_kwargs())
    plan_matches_oracle(run_plan("numpy", case), expect, case)
    vp, wp = _plans(case)
    before = [a.copy() for a in (*vars(vp).values(), *vars(wp).values())]
    if expect.status:
        with pytest.raises(ValueError, match=r"^kv-canary: "):
            kc.launch_canary_plan_kernels(verify_plan_out=vp, write_plan_out=wp, **case.kwargs)
        after = [*vars(vp).values(), *vars(wp).values()]
        assert all(np.array_equal(x, y) for x, y in zip(before, after, strict=True))
    else:
        kc.launch_canary_plan_kernels(verify_plan_out=vp, write_plan_out=wp, **case.kwargs)


@settings(max_examples=examples(400))
@given(layout_cases())
def test_paged_batch_gives_the_plan_of_the_token_table_it_describes(case):
    token = strategies.PlanCase(kwargs=case.token_kwargs, write_req_capacity=case.write_req_capacity)
    _same_plan(run_plan("numpy", case), run_plan("numpy", token), case.bs)


def test_token_table_layout_is_req_to_token():
    rtt = (np.arange(3 * 8, dtype=np.int32) + 50).reshape(3, 8)
    common = {"req_pool_indices": np.array([2, 0, 1], np.int64), "prefix_lens": np.array([5, 9, 8], np.int64),
              "extend_seq_lens": np.array([1, 1, 2], np.int64), "swa_window_size": 0,
              "full_to_swa_index_mapping": None, "verify_capacity": 16}
    outs = []
    for layout_kw in ({"req_to_token": rtt}, {"layout": kc.TokenTable(rtt)}):
        vp, wp = fresh_plans(16, 3)
        kc.launch_canary_plan_kernels(verify_plan_out=vp, write_plan_out=wp, **common, **layout_kw)
        outs.append([a.copy() for a in (*vars(vp).values(), *vars(wp).values())])
    assert all(np.array_equal(a, b) for a, b in zip(*outs, strict=True))
    assert outs[0][0][:13].tolist() == [*range(66, 71), *range(58, 66)]


def test_transformers_block_stride_leaves_gaps_between_blocks():
    """block_physical_stride > block_size: block b covers slots [b * stride, b * stride + size)."""
    table = np.array([[3, 1, 0]], np.int32)
    vp, wp = kc.VerifyPlan.allocate(verify_capacity=8), kc.WritePlan.allocate(write_req_capacity=1)
    kc.launch_canary_plan_kernels(
        verify_plan_out=vp, write_plan_out=wp, prefix_lens=np.array([5], np.int64),
        extend_seq_lens=np.array([1], np.int64), layout=kc.BlockTable(table, 2, block_stride=10, batch_rows=True),
        swa_window_size=0, full_to_swa_index_mapping=None, verify_capacity=8)
    assert vp.verify_slot_indices[:5].tolist() == [30, 31, 10, 11, 0]
    assert vp.verify_prev_slot_indices[:5].tolist() == [-1, 30, 31, 10, 11]
    assert wp.write_seed_slot_indices[0] == 0


def test_csr_rows_without_req_pool_indices_are_all_active():
    """FlashInfer-style: batch row r owns pages indptr[r]:indptr[r+1]; no padding sentinel."""
    layout = kc.PageList(np.array([0, 2, 2, 3], np.int32), np.array([7, 4, 9], np.int32), 4)
    vp, wp = kc.VerifyPlan.allocate(verify_capacity=16), kc.WritePlan.allocate(write_req_capacity=3)
    kc.launch_canary_plan_kernels(
        verify_plan_out=vp, write_plan_out=wp, prefix_lens=np.array([6, 0, 2], np.int64),
        extend_seq_lens=np.array([1, 3, 1], np.int64), layout=layout, swa_window_size=0,
        full_to_swa_index_mapping=None, verify_capacity=16)
    assert int(vp.verify_num_valid[0]) == 8
    assert vp.verify_slot_indices[:8].tolist() == [28, 29, 30, 31, 16, 17, 36, 37]
    assert wp.write_offsets[:4].tolist() == [0, 1, 4, 5]
    assert wp.write_seed_slot_indices[:3].tolist() == [17, -1, 37]


@pytest.mark.parametrize(("layout", "bit", "words"), [
    (kc.BlockTable(np.array([[0, 5]], np.int32), 4, num_slots=16), kc.PlanStatus.BLOCK_ID_OUTSIDE_SLOTS,
     "block id 5"),
    (kc.BlockTable(np.array([[0, -1]], np.int32), 4), kc.PlanStatus.BLOCK_ID_OUTSIDE_SLOTS, "block id -1"),
    (kc.BlockTable(np.array([[0]], np.int32), 4), kc.PlanStatus.POSITION_BEYOND_BLOCKS, "beyond the row's 1 blocks"),
    (kc.PageList(np.array([0, 3], np.int64), np.array([0, 1], np.int32), 4), kc.PlanStatus.PAGE_INDPTR_INVALID,
     re.escape("kv_page_indptr[0:2]=(0, 3)")),
])
def test_each_paged_check_has_its_status_bit_and_message(layout, bit, words):
    kwargs = {"prefix_lens": np.array([6], np.int64), "extend_seq_lens": np.array([1], np.int64),
              "swa_window_size": 0, "full_to_swa_index_mapping": None, "verify_capacity": 8}
    if isinstance(layout, kc.BlockTable):
        layout = kc.BlockTable(layout.block_table, layout.block_size, batch_rows=True, num_slots=layout.num_slots)
    vp, wp = kc.VerifyPlan.allocate(verify_capacity=8), kc.WritePlan.allocate(write_req_capacity=1)
    with pytest.raises(kc.CanaryArgumentError, match=words):
        kc.launch_canary_plan_kernels(verify_plan_out=vp, write_plan_out=wp, layout=layout, **kwargs)
    kc.launch_canary_plan_kernels(verify_plan_out=vp, write_plan_out=wp, layout=layout, on_invalid="flag",
                                  backend="numpy", **kwargs)
    assert int(vp.status[0]) == bit
    assert wp.write_seed_slot_indices[0] == -1
