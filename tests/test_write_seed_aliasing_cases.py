"""The NumPy write when a request seeds from a slot written in the same launch, on hand-picked cases the
random aliasing test reaches rarely, against the scalar oracle (``tests/oracle.py``): requests run in batch
order, so a seed written by an earlier request is read as that request left it."""

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
                                  enable_write_input_assert=False, on_invalid="flag")
    state = oracle.CanaryState.from_arrays(canary, np.zeros((64, 8), np.int64))
    oracle.write_oracle(state, kernel_kind=int(kc.CanaryLaunchTag.HEAD_K_FULL), write_offsets=offsets,
                        write_seed_slot_indices=seeds, write_num_valid_reqs=seeds.shape[0], input_ids=ids,
                        positions=positions, out_cache_loc=locs, enable_write_input_assert=False,
                        expected_input_tokens=None, expected_input_positions=None, sources=[], mode=0,
                        enable_chain_position_assert=1)
    np.testing.assert_array_equal(ctx.canary_buf, state.to_canary_array())
    assert int(ctx.violation_write_index[0]) == state.write_index
    np.testing.assert_array_equal(ctx.violation_ring, state.to_ring_array())


def test_a_seed_written_earlier_in_the_launch_continues_that_write():
    # Hand-worked for the first case: slot 3 (request 1) chains from slot 6 as request 0 wrote it.
    offsets, seeds, ids, positions, locs = (np.asarray(x, np.int64) for x in CASES[
        "seed-is-the-largest-slot-an-earlier-request-writes"])
    ctx = context(num_slots=NUM_SLOTS, ring_capacity=64, enable_chain_position_assert=True)
    ctx.canary_buf[...] = _canary()
    wp = kc.WritePlan.from_tensors(write_offsets=offsets, write_seed_slot_indices=seeds,
                                   write_num_valid_reqs=np.array([2], np.int32))
    kc.launch_canary_write_kernel(context=ctx, plan=wp, input_ids=ids, positions=positions, out_cache_loc=locs,
                                  enable_write_input_assert=False, on_invalid="flag")
    f = ctx.canary_buf.view(np.int64)
    h5 = oracle.mix3(oracle.anchor_hash(), 11, 0)  # the running hash after slot 5 (token 11, position 0)
    assert oracle.to_u64(int(f[6, 2])) == h5
    assert oracle.to_u64(int(f[3, 2])) == oracle.mix3(h5, 12, 1)  # slot 6 (token 12, position 1) before it
    assert int(ctx.violation_write_index[0]) == 0  # position 2 follows slot 6's position 1: no violation
