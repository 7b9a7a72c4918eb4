"""The NumPy write on hand-picked cases the random tests reach rarely, against the scalar oracle
(``tests/oracle.py``) in "flag" mode: a request seeding from a slot written in the same launch (requests run
in batch order, so the seed is read as the earlier request left it), and hostile write plans (offsets that run
backwards, token ranges outside ``input_ids``, seeds and slots outside the buffer)."""

from __future__ import annotations

import numpy as np
import oracle
import pytest
from chain_helpers import context

import kvcanary_cupy as kc

NUM_SLOTS = 16


def _canary() -> np.ndarray:
    # Every slot holds a distinct old record: token 900 + s, position 40 + s, some hash, no real-KV hash.
    canary = np.zeros((NUM_SLOTS, 4), np.int64)
    canary[:, 0] = 900 + np.arange(NUM_SLOTS)
    canary[:, 1] = 40 + np.arange(NUM_SLOTS)
    canary[:, 2] = 0x1234567 * (np.arange(NUM_SLOTS) + 3)
    return canary.view(np.uint8)


CASES = {
    # Request 1 seeds from slot 6, the largest slot written, written once by request 0.
    "seed-is-the-largest-slot-an-earlier-request-writes": ([0, 2, 3], [-1, 6], [11, 12, 13], [0, 1, 2], [5, 6, 3]),
    # Request 1 seeds from slot 0, which request 0 writes (slot 0 is written like any other).
    "seed-is-slot-zero-written-by-an-earlier-request": ([0, 1, 2], [-1, 0], [11, 12], [0, 1], [0, 4]),
    # Request 0 seeds from slot 5 and then writes slot 5 itself: the seed is the slot as it was before.
    "a-request-seeds-from-a-slot-it-writes-itself": ([0, 2], [5], [11, 12], [46, 47], [5, 6]),
    # Request 1's offsets run backwards: it and every later request (request 2, valid on its own) are skipped.
    "offsets-running-backwards-skip-the-rest": ([0, 2, 1, 3], [-1, -1, -1], [11, 12, 13], [0, 1, 2], [1, 2, 3]),
    # An empty request is never range-checked, wherever its offsets point.
    "an-empty-request-with-negative-offsets": ([-4, -4], [-1], [11, 12], [0, 1], [1, 2]),
    # Request 1's range [2, 5) leaves the 3 tokens: skipped and flagged; request 0 is written.
    "a-token-range-beyond-input-ids": ([0, 2, 5], [-1, -1], [11, 12, 13], [0, 1, 2], [1, 2, 3]),
    "a-token-range-starting-below-zero": ([-1, 2, 3], [-1, -1], [11, 12, 13], [0, 1, 2], [1, 2, 3]),
    # A seed outside the buffer: the request is written as a chain head, flagged.
    "a-seed-outside-the-buffer": ([0, 2], [99], [11, 12], [0, 1], [1, 2]),
    # Slot 16 (== num_slots) is outside: that entry is skipped and flagged, the others are written.
    "a-slot-at-the-buffer-end": ([0, 3], [-1], [11, 12, 13], [0, 1, 2], [1, 16, 2]),
    # A seed at slot 0 (not written in the launch): position 45 does not follow slot 0's stored position 40.
    "seed-is-slot-zero": ([0, 1], [0], [11], [45], [3]),
    # Request 1 seeds from slot 6, which request 0 writes before slot 9; request 1's own slot 3 sorts first.
    "seed-slot-followed-by-a-larger-slot-of-the-same-writer": ([0, 2, 3], [-1, 6], [11, 12, 13], [0, 1, 1],
                                                               [6, 9, 3]),
    # One request writes slots 1..10 twenty times each: every slot keeps its last write.
    "slots-written-many-times-keep-the-last-write": ([0, 200], [-1], list(range(1, 201)), list(range(200)),
                                                     [1 + k % 10 for k in range(200)]),
    # All three at once: a slot outside in request 0, a range outside in request 1, backwards offsets after.
    "every-write-status-bit-at-once": ([0, 2, 5, 4], [-1, -1, -1], [11, 12, 13], [0, 1, 2], [1, 16, 3]),
}


@pytest.mark.parametrize("name", list(CASES), ids=list(CASES))
def test_the_numpy_write_matches_the_oracle(name):
    offsets, seeds, ids, positions, locs = (np.asarray(x, np.int64) for x in CASES[name])
    canary = _canary()
    ctx = context(num_slots=NUM_SLOTS, ring_capacity=64, enable_chain_position_assert=True)
    ctx.canary_buf[...] = canary
    wp = kc.WritePlan.from_tensors(write_offsets=offsets.copy(), write_seed_slot_indices=seeds.copy(),
                                   write_num_valid_reqs=np.array([seeds.shape[0]], np.int32))
    kc.launch_canary_write_kernel(context=ctx, plan=wp, input_ids=ids, positions=positions, out_cache_loc=locs,
                                  enable_write_input_assert=False, on_invalid="flag", backend="numpy")
    state = oracle.CanaryState.from_arrays(canary, np.zeros((64, 8), np.int64))
    oracle.write_oracle(state, kernel_kind=int(kc.CanaryLaunchTag.HEAD_K_FULL), write_offsets=offsets,
                        write_seed_slot_indices=seeds, write_num_valid_reqs=seeds.shape[0], input_ids=ids,
                        positions=positions, out_cache_loc=locs, enable_write_input_assert=False,
                        expected_input_tokens=None, expected_input_positions=None, sources=[], mode=0,
                        enable_chain_position_assert=1)
    np.testing.assert_array_equal(ctx.canary_buf, state.to_canary_array())
    assert int(ctx.violation_write_index[0]) == state.write_index
    np.testing.assert_array_equal(ctx.violation_ring, state.to_ring_array())
    assert int(ctx.status[0]) == state.status == STATUS[name]


S = kc.CanaryStatus
# The status bits worked out by hand for each case.
STATUS = {"seed-is-the-largest-slot-an-earlier-request-writes": 0, "seed-is-slot-zero-written-by-an-earlier-request": 0,
          "a-request-seeds-from-a-slot-it-writes-itself": 0,
          "offsets-running-backwards-skip-the-rest": int(S.WRITE_OFFSETS_OUT_OF_ORDER),
          "an-empty-request-with-negative-offsets": 0,
          "a-token-range-beyond-input-ids": int(S.TOKEN_RANGE_OUT_OF_BOUNDS),
          "a-token-range-starting-below-zero": int(S.TOKEN_RANGE_OUT_OF_BOUNDS),
          "a-seed-outside-the-buffer": int(S.SLOT_OUT_OF_RANGE), "a-slot-at-the-buffer-end": int(S.SLOT_OUT_OF_RANGE),
          "seed-is-slot-zero": 0, "seed-slot-followed-by-a-larger-slot-of-the-same-writer": 0,
          "slots-written-many-times-keep-the-last-write": 0,
          "every-write-status-bit-at-once": int(S.SLOT_OUT_OF_RANGE | S.TOKEN_RANGE_OUT_OF_BOUNDS
                                                | S.WRITE_OFFSETS_OUT_OF_ORDER)}


def test_a_seed_written_earlier_in_the_launch_continues_that_write():
    # Hand-worked for the first case: slot 3 (request 1) chains from slot 6 as request 0 wrote it.
    offsets, seeds, ids, positions, locs = (np.asarray(x, np.int64) for x in CASES[
        "seed-is-the-largest-slot-an-earlier-request-writes"])
    ctx = context(num_slots=NUM_SLOTS, ring_capacity=64, enable_chain_position_assert=True)
    ctx.canary_buf[...] = _canary()
    wp = kc.WritePlan.from_tensors(write_offsets=offsets, write_seed_slot_indices=seeds,
                                   write_num_valid_reqs=np.array([2], np.int32))
    kc.launch_canary_write_kernel(context=ctx, plan=wp, input_ids=ids, positions=positions, out_cache_loc=locs,
                                  enable_write_input_assert=False, on_invalid="flag", backend="numpy")
    f = ctx.canary_buf.view(np.int64)
    h5 = oracle.mix3(oracle.anchor_hash(), 11, 0)  # the running hash after slot 5 (token 11, position 0)
    assert oracle.to_u64(int(f[6, 2])) == h5
    assert oracle.to_u64(int(f[3, 2])) == oracle.mix3(h5, 12, 1)  # slot 6 (token 12, position 1) before it
    assert int(ctx.violation_write_index[0]) == 0  # position 2 follows slot 6's position 1: no violation


def test_input_assert_and_chain_position_rows_interleave_in_entry_order():
    """One request of 5 tokens seeded from slot 2 (position 42), with the input assert on: entry 0 has a wrong
    token (an input-assert row), entries 1 and 3 break the position chain (chain-position rows), entry 4 has both
    (its input-assert row before its chain row). The ring holds the rows in that entry order, as the oracle
    emits them; a row order sorted by kind instead of by entry would put both input rows first."""
    ids = np.array([11, 12, 13, 14, 15], np.int64)
    positions = np.array([43, 50, 51, 60, 70], np.int64)
    expected_ids = np.array([99, 12, 13, 14, 98], np.int64)
    expected_pos = positions.copy()
    locs = np.array([5, 6, 7, 8, 9], np.int64)
    offsets, seeds = np.array([0, 5], np.int64), np.array([2], np.int64)
    canary = _canary()
    ctx = context(num_slots=NUM_SLOTS, ring_capacity=64, enable_chain_position_assert=True)
    ctx.canary_buf[...] = canary
    wp = kc.WritePlan.from_tensors(write_offsets=offsets.copy(), write_seed_slot_indices=seeds.copy(),
                                   write_num_valid_reqs=np.array([1], np.int32))
    kc.launch_canary_write_kernel(context=ctx, plan=wp, input_ids=ids, positions=positions, out_cache_loc=locs,
                                  enable_write_input_assert=True, expected_input_tokens=expected_ids,
                                  expected_input_positions=expected_pos, on_invalid="flag", backend="numpy")
    state = oracle.CanaryState.from_arrays(canary, np.zeros((64, 8), np.int64))
    oracle.write_oracle(state, kernel_kind=int(kc.CanaryLaunchTag.HEAD_K_FULL), write_offsets=offsets,
                        write_seed_slot_indices=seeds, write_num_valid_reqs=1, input_ids=ids, positions=positions,
                        out_cache_loc=locs, enable_write_input_assert=True, expected_input_tokens=expected_ids,
                        expected_input_positions=expected_pos, sources=[], mode=0, enable_chain_position_assert=1)
    token_row, chain_row = int(kc.FailReason.WRITE_TOKEN_MISMATCH), int(kc.FailReason.WRITE_POSITION_MISMATCH)
    rows = ctx.violation_ring[: int(ctx.violation_write_index[0])]
    # (slot, reasons) worked out by hand: entry 0 input, entry 1 chain, entry 3 chain, entry 4 input then chain
    assert [(int(r[1]), int(r[7])) for r in rows] == [(5, token_row), (6, chain_row), (8, chain_row),
                                                      (9, token_row), (9, chain_row)]
    np.testing.assert_array_equal(ctx.violation_ring, state.to_ring_array())
