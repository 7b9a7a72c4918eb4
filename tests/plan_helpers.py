"""Small builders shared by the plan tests: run one plan launch and read its outputs back as lists."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

import kvcanary_cupy as kc


@dataclass
class PlanOut:
    slots: list[int]
    tokens: list[int]
    positions: list[int]
    prevs: list[int]
    num_valid: int
    enable: int
    write_offsets: list[int]
    seeds: list[int]
    write_num_valid_reqs: int
    status: int


def fresh_plans(capacity: int, write_capacity: int, fill: int = 0x5A5A) -> tuple[kc.VerifyPlan, kc.WritePlan]:
    """Plans filled with a sentinel so that "left untouched" is observable."""
    vp = kc.VerifyPlan.allocate(verify_capacity=capacity)
    wp = kc.WritePlan.allocate(write_req_capacity=write_capacity)
    for arr in (vp.verify_slot_indices, vp.verify_expected_tokens, vp.verify_expected_positions,
                vp.verify_prev_slot_indices, wp.write_offsets, wp.write_seed_slot_indices, wp.verify_offsets):
        arr.fill(fill)
    vp.verify_num_valid.fill(-7)
    wp.write_num_valid_reqs.fill(-7)
    return vp, wp


def run_plan(
    backend: str,
    *,
    rpi,
    prefix,
    extend,
    rtt,
    window: int = 0,
    lut=None,
    capacity: int = 64,
    pool=None,
    lens=None,
    offset: int = 0,
    write_capacity: int | None = None,
    plans: tuple[kc.VerifyPlan, kc.WritePlan] | None = None,
    on_invalid: str | None = None,
) -> PlanOut:
    rpi = np.asarray(rpi, np.int64)
    if plans is None:
        plans = fresh_plans(capacity, write_capacity or max(1, rpi.shape[0]))
    vp, wp = plans
    kc.launch_canary_plan_kernels(
        verify_plan_out=vp, write_plan_out=wp, req_pool_indices=rpi,
        prefix_lens=np.asarray(prefix, np.int64), extend_seq_lens=np.asarray(extend, np.int64),
        req_to_token=np.asarray(rtt, np.int32), swa_window_size=window,
        full_to_swa_index_mapping=None if lut is None else np.asarray(lut, np.int64),
        verify_capacity=capacity,
        req_to_verify_expected_tokens=None if pool is None else np.asarray(pool, np.int32),
        req_to_verify_expected_tokens_valid_lens=None if lens is None else np.asarray(lens, np.int64),
        kv_token_id_vs_position_offset=offset, backend=backend, on_invalid=on_invalid,
    )
    n = int(vp.verify_num_valid[0]) if int(vp.enable[0]) else 0
    bs = rpi.shape[0]
    return PlanOut(
        slots=vp.verify_slot_indices[:n].tolist(), tokens=vp.verify_expected_tokens[:n].tolist(),
        positions=vp.verify_expected_positions[:n].tolist(), prevs=vp.verify_prev_slot_indices[:n].tolist(),
        num_valid=int(vp.verify_num_valid[0]), enable=int(vp.enable[0]),
        write_offsets=wp.write_offsets.tolist(), seeds=wp.write_seed_slot_indices[:bs].tolist(),
        write_num_valid_reqs=int(wp.write_num_valid_reqs[0]), status=int(vp.status[0]),
    )


def linear_rtt(rows: int, width: int, base: int = 1000) -> np.ndarray:
    """req_to_token with distinct slots: row r, column c -> base + r * width + c."""
    return (np.arange(rows * width, dtype=np.int32) + base).reshape(rows, width)
