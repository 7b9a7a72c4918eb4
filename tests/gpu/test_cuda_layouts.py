"""The paged-layout plan kernels on a real GPU against the NumPy reference, plus a captured block-table plan.

Every test is marked ``gpu``; the suite's conftest skips them with a reason where no CUDA device is visible.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from differential import SENTINEL, run_plan
from hypothesis import given, settings
from layout_strategies import layout_cases

import kvcanary_cupy as kc

pytestmark = pytest.mark.gpu
cp = pytest.importorskip("cupy")


def _on_gpu(value):
    if isinstance(value, np.ndarray):
        return cp.asarray(value)
    if isinstance(value, (kc.BlockTable, kc.PageList)):
        return dataclasses.replace(value, **{f.name: _on_gpu(getattr(value, f.name))
                                             for f in dataclasses.fields(value)})
    return value


def plan_on_gpu(case) -> dict[str, np.ndarray]:
    vp = kc.VerifyPlan.allocate(verify_capacity=case.kwargs["verify_capacity"], device="cuda")
    wp = kc.WritePlan.allocate(write_req_capacity=case.write_req_capacity, device="cuda")
    for arr in (*vars(vp).values(), *vars(wp).values()):
        arr.fill(SENTINEL)
    kc.launch_canary_plan_kernels(verify_plan_out=vp, write_plan_out=wp,
                                  **{k: _on_gpu(v) for k, v in case.kwargs.items()})
    cp.cuda.Device().synchronize()
    return {**{f"verify.{k}": v.get() for k, v in vars(vp).items()},
            **{f"write.{k}": v.get() for k, v in vars(wp).items()}}


def assert_same_plan(got: dict[str, np.ndarray], want: dict[str, np.ndarray], bs: int) -> None:
    for name in want:
        g, w = got[name], want[name]
        if name == "write.verify_offsets":  # scratch: only [0, bs] is defined by the contract
            g, w = g[: bs + 1], w[: bs + 1]
        np.testing.assert_array_equal(g, w, err_msg=name)


@settings(max_examples=300, deadline=None)
@given(layout_cases(max_bs=16))
def test_paged_plan_matches_reference(case):
    assert_same_plan(plan_on_gpu(case), run_plan("numpy", case), case.bs)


@settings(max_examples=300, deadline=None)
@given(layout_cases(max_bs=12, hostile=True))
def test_paged_plan_flags_hostile_values_like_the_reference(case):
    assert_same_plan(plan_on_gpu(case), run_plan("numpy", case), case.bs)


def test_block_table_plan_captures_and_replays_in_a_cuda_graph():
    bs, blocks, size = 64, 8, 16
    rng = np.random.default_rng(3)
    table = cp.asarray(rng.permutation(bs * blocks).reshape(bs, blocks).astype(np.int32))
    prefix = cp.asarray(rng.integers(0, blocks * size + 1, size=bs).astype(np.int64))
    extend = cp.ones(bs, cp.int64)
    capacity = bs * blocks * size
    vp = kc.VerifyPlan.allocate(verify_capacity=capacity, device="cuda")
    wp = kc.WritePlan.allocate(write_req_capacity=bs, device="cuda")
    bound = kc.bind_plan(verify_plan_out=vp, write_plan_out=wp, prefix_lens=prefix, extend_seq_lens=extend,
                         layout=kc.BlockTable(table, size, batch_rows=True, num_slots=bs * blocks * size),
                         swa_window_size=0, full_to_swa_index_mapping=None, verify_capacity=capacity)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        bound()  # warm-up: compiles the module before capture
        stream.begin_capture()
        bound()
        graph = stream.end_capture()
        prefix[:] = cp.asarray(rng.integers(0, blocks * size + 1, size=bs).astype(np.int64))
        graph.launch(stream)
    stream.synchronize()
    host = {k: cp.asnumpy(v) for k, v in (("prefix", prefix), ("table", table))}
    n = int(vp.verify_num_valid.get()[0])
    assert n == int(host["prefix"].sum())
    want = [int(host["table"][r, p // size]) * size + p % size for r in range(bs) for p in range(host["prefix"][r])]
    assert vp.verify_slot_indices.get()[:n].tolist() == want
