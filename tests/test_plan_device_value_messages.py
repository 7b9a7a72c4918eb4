"""The plan's refusals of hostile device values name the first offending request and value exactly.

Each case is worked out by hand from SPEC §3.3 on a table whose slot values are known (row r, column c of
``req_to_token`` holds 1000 + 32 r + c); seeds are checked in isolation by making the verify entries overflow
(then only seeds are checked), entries by giving the request nothing to write (then it needs no seed).
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from plan_helpers import linear_rtt, run_plan

import kvcanary_cupy as kc
from kvcanary_cupy.constants import PlanStatus

RTT = linear_rtt(4, 32)  # 1000 + 32 r + c


def refused(**kwargs) -> str:
    with pytest.raises(ValueError) as info:
        run_plan("numpy", **kwargs)
    return str(info.value)


def flagged(**kwargs) -> int:
    return run_plan("numpy", on_invalid="flag", **kwargs).status


def test_a_seed_row_outside_req_to_token_is_named():
    # Entries overflow (capacity 2 < 3 + 4): only the seeds are checked; request 1's row 9 does not exist.
    message = refused(rpi=[1, 9], prefix=[3, 4], extend=[1, 1], rtt=RTT, capacity=2)
    assert message == "kv-canary: req_pool_indices[1]=9 is outside req_to_token's 4 rows"


def test_a_seed_prefix_beyond_the_row_is_named():
    message = refused(rpi=[1, 2], prefix=[3, 40], extend=[1, 1], rtt=RTT, capacity=2)
    assert message == "kv-canary: prefix_lens[1]=40 reaches beyond req_to_token's row width 32"


def test_an_entry_row_outside_req_to_token_names_its_own_request():
    # Request 1 writes nothing (no seed); its first entry is flat entry 3, the head of request 1, not the tail
    # of request 0.
    message = refused(rpi=[1, 9], prefix=[3, 4], extend=[1, 0], rtt=RTT)
    assert message == "kv-canary: req_pool_indices[1]=9 is outside req_to_token's 4 rows"


def test_an_entry_beyond_the_row_names_its_own_request():
    message = refused(rpi=[1, 2], prefix=[3, 40], extend=[1, 0], rtt=RTT)
    assert message == "kv-canary: prefix_lens[1]=40 reaches beyond req_to_token's row width 32"


def test_a_seed_outside_the_lut_is_named():
    # Seeds req_to_token[1, 2] = 1034 (inside a 1040-entry LUT) and req_to_token[2, 19] = 1083 (outside): the
    # second is named. Entries overflow.
    lut = np.arange(1040, dtype=np.int64)
    message = refused(rpi=[1, 2], prefix=[3, 20], extend=[1, 1], rtt=RTT, window=64, lut=lut, capacity=4)
    assert message == ("kv-canary: req_to_token[2, 19]=1083 is outside full_to_swa_index_mapping (length 1040)")


def test_an_entry_slot_outside_the_lut_is_named():
    # Slots of row 1 are 1032.. ; position 8 holds 1040, the first one outside a 1040-entry LUT.
    lut = np.arange(1040, dtype=np.int64)
    message = refused(rpi=[1], prefix=[20], extend=[0], rtt=RTT, window=64, lut=lut)
    assert message == ("kv-canary: req_to_token[1, 8]=1040 is outside full_to_swa_index_mapping (length 1040)")


def test_a_predecessor_before_the_window_outside_the_lut_is_named():
    # Window 4 of prefix 20: entries at positions 16..19, all inside the LUT; the head's predecessor at
    # position 15 is 5000, outside it: the message names position 15, not the entry's own position 16.
    rtt = RTT.copy()
    rtt[1, 15] = 5000
    lut = np.arange(2000, dtype=np.int64)
    message = refused(rpi=[1], prefix=[20], extend=[0], rtt=rtt, window=4, lut=lut)
    assert message == ("kv-canary: req_to_token[1, 15]=5000 is outside full_to_swa_index_mapping (length 2000)")
    out = run_plan("numpy", rpi=[1], prefix=[20], extend=[0], rtt=rtt, window=4, lut=lut, on_invalid="flag")
    assert out.status == PlanStatus.SWA_SLOT_OUTSIDE_LUT
    # Only the head is neutralised (its predecessor is unusable); the rest keep their slots and predecessors.
    assert out.slots == [0, 1049, 1050, 1051]
    assert out.prevs == [0, 1048, 1049, 1050]
    assert out.tokens == [-1] * 4


def test_an_expected_token_beyond_the_pool_row_is_named():
    # Request 1 (pool row 2) wants 12 tokens, the pool rows hold 8: position 8 is the first read outside.
    pool = np.arange(32, dtype=np.int32).reshape(4, 8)
    message = refused(rpi=[1, 2], prefix=[3, 10], extend=[1, 1], rtt=RTT, pool=pool, lens=[3, 12])
    assert message == ("kv-canary: req_to_verify_expected_tokens_valid_lens[1]=12 makes position 8 read "
                       "req_to_verify_expected_tokens[2, 8], outside its shape (4, 8)")


def test_an_expected_token_pool_row_outside_the_pool_is_named():
    pool = np.arange(16, dtype=np.int32).reshape(2, 8)
    message = refused(rpi=[1, 3], prefix=[3, 2], extend=[1, 1], rtt=RTT, pool=pool, lens=[3, 2])
    assert message == ("kv-canary: req_to_verify_expected_tokens_valid_lens[1]=2 makes position 0 read "
                       "req_to_verify_expected_tokens[3, 0], outside its shape (2, 8)")


def test_the_lowest_status_bit_gives_the_message_whatever_the_order_found():
    # Request 0's seed is outside the LUT (bit 4), found first, while seeds are checked; request 1 writes
    # nothing and its row does not exist (bit 1), found later, while entries are checked: the row is named.
    lut = np.arange(1040, dtype=np.int64)
    kwargs = {"rpi": [1, 9], "prefix": [20, 2], "extend": [1, 0], "rtt": RTT, "window": 64, "lut": lut}
    message = refused(**kwargs)
    assert re.fullmatch(r"kv-canary: req_pool_indices\[1\]=9 is outside req_to_token's 4 rows", message)
    assert flagged(**kwargs) == PlanStatus.REQ_POOL_INDEX_OUT_OF_RANGE | PlanStatus.SWA_SLOT_OUTSIDE_LUT


def test_a_paged_seed_flagged_while_entries_overflow_is_refused():
    # Block table row [0, 5] of 4-slot blocks in a 16-slot buffer: the seed (position 5) lies in block 5,
    # outside the buffer. Capacity 2 < 6 entries: only the seed is checked.
    layout = kc.BlockTable(np.array([[0, 5]], np.int32), 4, batch_rows=True, num_slots=16)
    kwargs = {"prefix_lens": np.array([6], np.int64), "extend_seq_lens": np.array([1], np.int64),
              "swa_window_size": 0, "full_to_swa_index_mapping": None, "verify_capacity": 2, "layout": layout}
    vp, wp = kc.VerifyPlan.allocate(verify_capacity=2), kc.WritePlan.allocate(write_req_capacity=1)
    with pytest.raises(kc.CanaryArgumentError, match=r"^kv-canary: .*block id 5"):
        kc.launch_canary_plan_kernels(verify_plan_out=vp, write_plan_out=wp, **kwargs)
    kc.launch_canary_plan_kernels(verify_plan_out=vp, write_plan_out=wp, on_invalid="flag", backend="numpy", **kwargs)
    assert int(vp.status[0]) == PlanStatus.BLOCK_ID_OUTSIDE_SLOTS
    assert (int(vp.enable[0]), int(wp.write_seed_slot_indices[0])) == (0, -1)
