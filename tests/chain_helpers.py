"""Builders shared by the write/verify tests: contexts, write plans and verify plans from plain lists."""

from __future__ import annotations

import numpy as np

import kvcanary_cupy as kc

ANCHOR_HASH = 0xDE7FAE23A9A1B716
ANCHOR_HASH_SIGNED = ANCHOR_HASH - (1 << 64)


def context(num_slots: int = 64, ring_capacity: int = 16, **kwargs) -> kc.VerifyOrWriteContext:
    return kc.VerifyOrWriteContext.allocate(num_slots=num_slots, ring_capacity=ring_capacity, **kwargs)


def fields(ctx: kc.VerifyOrWriteContext) -> np.ndarray:
    """The canary buffer as int64 [num_slots, stride // 8] (a view)."""
    return ctx.canary_buf.view(np.int64)


def write_plan(counts: list[int], seeds: list[int], capacity: int | None = None) -> kc.WritePlan:
    capacity = capacity or max(1, len(counts))
    wp = kc.WritePlan.allocate(write_req_capacity=capacity)
    wp.write_offsets[:] = 0
    wp.write_offsets[1 : len(counts) + 1] = np.cumsum(counts)
    wp.write_seed_slot_indices[:] = -1
    wp.write_seed_slot_indices[: len(seeds)] = seeds
    wp.write_num_valid_reqs[0] = len(counts)
    return wp


def write(ctx, counts, seeds, slots, tokens, positions, *, backend="numpy", expected=None, **kwargs):
    """One write launch; ``expected`` = (tokens, positions) turns the input assert on."""
    wp = write_plan(counts, seeds, kwargs.pop("capacity", None))
    kc.launch_canary_write_kernel(
        context=ctx, plan=wp, input_ids=np.asarray(tokens, np.int64), positions=np.asarray(positions, np.int64),
        out_cache_loc=np.asarray(slots, np.int64), enable_write_input_assert=expected is not None,
        expected_input_tokens=None if expected is None else np.asarray(expected[0], np.int64),
        expected_input_positions=None if expected is None else np.asarray(expected[1], np.int64),
        backend=backend, **kwargs,
    )


def verify_plan(slots, positions, prevs, tokens=None, *, capacity: int | None = None,
                num_valid: int | None = None, enable: int = 1) -> kc.VerifyPlan:
    n = len(slots)
    vp = kc.VerifyPlan.allocate(verify_capacity=capacity or max(1, n))
    vp.verify_slot_indices[:n] = slots
    vp.verify_expected_positions[:n] = positions
    vp.verify_prev_slot_indices[:n] = prevs
    vp.verify_expected_tokens[:n] = [-1] * n if tokens is None else tokens
    vp.verify_num_valid[0] = n if num_valid is None else num_valid
    vp.enable[0] = enable
    return vp


def verify(ctx, slots, positions, prevs, tokens=None, *, backend="numpy", check=False, **plan_kwargs):
    vp = verify_plan(slots, positions, prevs, tokens, **plan_kwargs)
    kc.launch_canary_verify_kernel(context=ctx, plan=vp, check_verify_expected_token=check, backend=backend)


def rows(ctx) -> list[list[int]]:
    """Landed ring rows, in ring order."""
    n = min(int(ctx.violation_write_index[0]), ctx.violation_ring.shape[0])
    return ctx.violation_ring[:n].tolist()


def sorted_rows(ctx) -> list[list[int]]:
    """Landed rows as a sorted list: the kernels append in atomic order, the reference in entry order."""
    return sorted(rows(ctx))
