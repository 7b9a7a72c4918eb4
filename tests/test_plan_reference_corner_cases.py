"""The NumPy plan on hand-picked corner cases the random differential tests reach rarely, against the scalar
oracle (``tests/oracle.py``) in "flag" mode: every output buffer and the status word must agree."""

from __future__ import annotations

import numpy as np
import oracle
import pytest
from differential import plan_matches_oracle, run_plan
from plan_helpers import linear_rtt
from strategies import PlanCase

import kvcanary_cupy as kc

RTT = linear_rtt(4, 32)  # row r, column c holds 1000 + 32 r + c
LUT = np.arange(4096, dtype=np.int64)


def case(rpi, prefix, extend, *, rtt=RTT, window=0, lut=None, capacity=64, pool=None, lens=None, offset=0,
         write_capacity=None) -> PlanCase:
    return PlanCase(kwargs={
        "req_pool_indices": np.asarray(rpi, np.int64), "prefix_lens": np.asarray(prefix, np.int64),
        "extend_seq_lens": np.asarray(extend, np.int64), "req_to_token": np.asarray(rtt, np.int32),
        "swa_window_size": window, "full_to_swa_index_mapping": lut, "verify_capacity": capacity,
        "req_to_verify_expected_tokens": None if pool is None else np.asarray(pool, np.int32),
        "req_to_verify_expected_tokens_valid_lens": None if lens is None else np.asarray(lens, np.int64),
        "kv_token_id_vs_position_offset": offset}, write_req_capacity=write_capacity or len(rpi))


POOL = np.arange(100, 100 + 4 * 5, dtype=np.int32).reshape(4, 5)

POOL8 = np.arange(100, 100 + 4 * 8, dtype=np.int32).reshape(4, 8)


def _with(table: np.ndarray, row: int, column: int, value: int) -> np.ndarray:
    out = table.copy()
    out[row, column] = value
    return out


def _lut_case() -> PlanCase:
    # A LUT that moves slot 0 too (lut[0] = 100) and a row holding 0, a negative value and the LUT's last index:
    # the negative value sends the translation through its masked path.
    rtt = RTT.copy()
    rtt[1, :3] = [0, -5, 1039]
    lut = np.arange(1040, dtype=np.int64) + 100
    lut[1035] = 2**53 + 1  # a value a float64 temporary could not hold
    return case([1], [5], [1], rtt=rtt, window=64, lut=lut)


CASES = {
    # A table with no columns: every entry lies beyond the row; nothing can be gathered.
    "empty-req-to-token": case([1], [2], [0], rtt=np.zeros((4, 0), np.int32)),
    # Prefix one past the row width: only the entry at position 32 (== width) is beyond the row.
    "prefix-one-past-the-row": case([1], [33], [0]),
    "lut-moves-slot-zero-and-keeps-negatives": _lut_case(),
    # Request 0 wants 2 of its 4 tokens; request 1 wants 12 from 8-wide rows: positions 8 and 9 are outside.
    "pool-read-outside-beside-unwanted-tokens": case([1, 2], [4, 10], [1, 1], pool=POOL8, lens=[2, 12]),
    # Request 0's row is outside req_to_token (and the pool); request 1 reads positions 8, 9 outside the pool.
    "bad-row-and-pool-read-outside": case([9, 2], [2, 10], [0, 0], pool=POOL8, lens=[2, 12]),
    # Request 0's row is outside both tables: its entries are neutralised and want no token, so the pool is
    # not flagged; request 1 wants 1 of its 3 tokens.
    "bad-row-beside-a-pool-reader": case([9, 1], [2, 3], [0, 0], pool=POOL8, lens=[2, 1]),
    "bad-row-alone-reads-no-pool": case([9], [2], [0], pool=POOL8, lens=[2]),
    # Position 8 of row 1 holds 1040, the first slot outside a 1040-entry LUT; the seed 1051 is outside too.
    "entry-slot-outside-the-lut": case([1], [20], [1], window=64, lut=np.arange(1040, dtype=np.int64)),
    # Entries at 16..19 inside the LUT, the predecessor at 15 outside it: only the head is neutralised.
    "predecessor-before-the-window-outside-the-lut": case([1], [20], [0], rtt=_with(RTT, 1, 15, 5000), window=4,
                                                          lut=np.arange(2000, dtype=np.int64)),
    # Seeds 1034 (inside) and 1083 (outside a 1040-entry LUT); entries overflow, only seeds are planned.
    "seed-outside-the-lut": case([1, 2], [3, 20], [1, 1], window=64, lut=np.arange(1040, dtype=np.int64),
                                 capacity=4),
    # Only the first slot (5000) is outside a 2000-entry LUT: it and its successor (whose predecessor it is)
    # are neutralised, the third entry is not.
    "first-slot-outside-the-lut": case([1], [3], [0], rtt=_with(RTT, 1, 0, 5000), window=64,
                                       lut=np.arange(2000, dtype=np.int64)),
    # Positions 32, 33 lie beyond the row (bit 2) and position 5 holds 5000, outside the LUT (bit 4): both
    # checks neutralise their own entries and only those.
    "lut-outside-beside-entries-beyond-the-row": case([1], [34], [0], rtt=_with(RTT, 1, 5, 5000), window=64,
                                                      lut=np.arange(4096, dtype=np.int64)),
    # Row index 4 of a 4-row table: the first index outside, for the seed and the entries alike.
    "row-index-equal-to-the-row-count": case([4], [2], [1]),
    # A pool with no columns: nothing can be read, every expected token is -1.
    "empty-pool": case([1, 2], [3, 2], [1, 1], pool=np.zeros((4, 0), np.int32), lens=[0, 0]),
    # Window [4, 8) read with offset -2: source positions 2..5 of a 5-wide pool row; 5 is outside.
    "negative-offset-window-reads-past-the-pool": case([1], [8], [0], window=4, lut=LUT, pool=POOL, lens=[100],
                                                        offset=-2),
}


# The status bits each case must raise, worked out by hand (PlanStatus: 1 row, 2 beyond the row, 4 LUT, 8 pool).
STATUS = {"empty-req-to-token": 2, "prefix-one-past-the-row": 2, "lut-moves-slot-zero-and-keeps-negatives": 0,
          "pool-read-outside-beside-unwanted-tokens": 8, "bad-row-and-pool-read-outside": 1 | 8,
          "bad-row-beside-a-pool-reader": 1, "bad-row-alone-reads-no-pool": 1, "empty-pool": 0,
          "negative-offset-window-reads-past-the-pool": 8,
          "row-index-equal-to-the-row-count": 1,
          "entry-slot-outside-the-lut": 4, "predecessor-before-the-window-outside-the-lut": 4,
          "seed-outside-the-lut": 4, "first-slot-outside-the-lut": 4,
          "lut-outside-beside-entries-beyond-the-row": 2 | 4}


def test_each_case_raises_the_status_bits_worked_out_by_hand():
    assert set(STATUS) == set(CASES)
    for name, c in CASES.items():
        assert run_plan("numpy", c)["verify.status"][0] == STATUS[name], name


@pytest.mark.parametrize("name", list(CASES), ids=list(CASES))
def test_the_numpy_plan_matches_the_oracle(name):
    c = CASES[name]
    plan_matches_oracle(run_plan("numpy", c), oracle.plan_oracle(**c.oracle_kwargs()), c)


def test_a_page_list_without_req_pool_indices_reads_pool_row_zero_for_batch_row_zero():
    # Without req_pool_indices, batch row r reads expected-token pool row r, row 0 included (no padding
    # sentinel). Page 2 of 4 slots: slots 8, 9, 10; the pool row holds 50..53, 3 of them valid.
    layout = kc.PageList(np.array([0, 1], np.int32), np.array([2], np.int32), 4)
    vp, wp = kc.VerifyPlan.allocate(verify_capacity=8), kc.WritePlan.allocate(write_req_capacity=1)
    kc.launch_canary_plan_kernels(
        verify_plan_out=vp, write_plan_out=wp, prefix_lens=np.array([3], np.int64),
        extend_seq_lens=np.array([1], np.int64), layout=layout, swa_window_size=0, full_to_swa_index_mapping=None,
        verify_capacity=8, req_to_verify_expected_tokens=np.array([[50, 51, 52, 53]], np.int32),
        req_to_verify_expected_tokens_valid_lens=np.array([3], np.int64), kv_token_id_vs_position_offset=0)
    assert int(vp.status[0]) == 0
    assert vp.verify_slot_indices[:3].tolist() == [8, 9, 10]
    assert vp.verify_expected_tokens[:3].tolist() == [50, 51, 52]


def test_pool_row_zero_of_a_page_list_is_read_on_the_masked_path_too():
    # Batch row 1 reads position 3 of 3-wide pool rows (flagged, bit 8), which sends the batch through the
    # per-entry path; batch row 0 still reads pool row 0. Pages 2 and 3 of 4 slots: slots 8.. and 12..
    layout = kc.PageList(np.array([0, 1, 2], np.int32), np.array([2, 3], np.int32), 4)
    vp, wp = kc.VerifyPlan.allocate(verify_capacity=8), kc.WritePlan.allocate(write_req_capacity=2)
    kc.launch_canary_plan_kernels(
        verify_plan_out=vp, write_plan_out=wp, prefix_lens=np.array([3, 4], np.int64),
        extend_seq_lens=np.array([1, 1], np.int64), layout=layout, swa_window_size=0,
        full_to_swa_index_mapping=None, verify_capacity=8,
        req_to_verify_expected_tokens=np.array([[50, 51, 52], [60, 61, 62]], np.int32),
        req_to_verify_expected_tokens_valid_lens=np.array([3, 4], np.int64), kv_token_id_vs_position_offset=0,
        on_invalid="flag", backend="numpy")
    assert int(vp.status[0]) == 8
    assert vp.verify_slot_indices[:7].tolist() == [8, 9, 10, 12, 13, 14, 0]
    assert vp.verify_expected_tokens[:7].tolist() == [50, 51, 52, 60, 61, 62, -1]
