"""The ``cuda`` backend on a real GPU: the same differential suite as the host backend, plus CUDA graphs.

Every test is marked ``gpu``; the suite's conftest skips them with a reason where no CUDA device is visible.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import strategies
from differential import SENTINEL, chain_results_equal, run_chain, run_plan, run_scatter
from hypothesis import given, settings

import kvcanary_cupy as kc

pytestmark = pytest.mark.gpu
cp = pytest.importorskip("cupy")


def _cuda_backend():
    from kvcanary_cupy.backends import resolve_backend
    from kvcanary_cupy.dlpack import Device

    return resolve_backend("cuda", Device("cuda", 0))


def plan_on_gpu(case) -> dict[str, np.ndarray]:
    vp = kc.VerifyPlan.allocate(verify_capacity=case.kwargs["verify_capacity"], device="cuda")
    wp = kc.WritePlan.allocate(write_req_capacity=case.write_req_capacity, device="cuda")
    for arr in (*vars(vp).values(), *vars(wp).values()):
        arr.fill(SENTINEL)
    kwargs = {k: cp.asarray(v) if isinstance(v, np.ndarray) else v for k, v in case.kwargs.items()}
    kc.launch_canary_plan_kernels(verify_plan_out=vp, write_plan_out=wp, **kwargs)
    cp.cuda.Device().synchronize()
    return {**{f"verify.{k}": v.get() for k, v in vars(vp).items()},
            **{f"write.{k}": v.get() for k, v in vars(wp).items()}}


def assert_same_plan(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    for name in want:
        if name == "write.verify_offsets":  # scratch: only [0, bs] is defined by the contract
            continue
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


@settings(max_examples=300, deadline=None)
@given(strategies.plan_cases(max_bs=16, allow_large_bs=True))
def test_plan_matches_reference(case):
    assert_same_plan(plan_on_gpu(case), run_plan("numpy", case))


@settings(max_examples=200, deadline=None)
@given(strategies.plan_cases(max_bs=12, hostile=True))
def test_plan_flags_hostile_values_like_the_reference(case):
    assert_same_plan(plan_on_gpu(case), run_plan("numpy", case))


class _OnGpu:
    """Runs a backend's launches on CuPy copies of the NumPy launch arrays and copies the outputs back."""

    # The arrays each launch kind writes; everything else is only read.
    WRITTEN = ("canary_bytes", "ring", "write_index", "slot_run_counter", "kernel_run_counter", "status",
               "pool_out")

    def __init__(self) -> None:
        self.backend = _cuda_backend()

    @staticmethod
    def _to_device(obj):
        if isinstance(obj, np.ndarray):
            return cp.asarray(obj)
        if isinstance(obj, tuple):
            values = [_OnGpu._to_device(v) for v in obj]
            return type(obj)(*values) if hasattr(obj, "_fields") else tuple(values)  # NamedTuples keep their type
        if dataclasses.is_dataclass(obj):
            fields = {f.name: _OnGpu._to_device(getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.init}
            if "canary_bytes" in fields:  # the int64 view must alias the device bytes, as on the host
                fields["canary"] = fields["canary_bytes"].view(cp.int64)
            return dataclasses.replace(obj, **fields)
        return obj

    @staticmethod
    def _copy_back(host, device) -> None:
        for name in _OnGpu.WRITTEN:
            if isinstance(getattr(host, name, None), np.ndarray):
                getattr(host, name)[...] = getattr(device, name).get()
        for f in dataclasses.fields(host):
            value = getattr(host, f.name)
            if dataclasses.is_dataclass(value):
                _OnGpu._copy_back(value, getattr(device, f.name))

    def _run(self, method: str, launch) -> None:
        on_device = self._to_device(launch)
        getattr(self.backend, method)(on_device)
        cp.cuda.Device().synchronize()
        self._copy_back(launch, on_device)

    def write(self, launch) -> None:
        self._run("write", launch)

    def verify(self, launch) -> None:
        self._run("verify", launch)

    def scatter(self, launch) -> None:
        self._run("scatter", launch)


@settings(max_examples=300, deadline=None)
@given(strategies.chain_cases())
def test_write_and_verify_match_reference(case):
    for got, want in zip(run_chain(_OnGpu(), case), run_chain("numpy", case), strict=True):
        chain_results_equal(got, want)


@settings(max_examples=200, deadline=None)
@given(strategies.chain_cases(hostile=True))
def test_write_and_verify_flag_hostile_values_like_the_reference(case):
    for got, want in zip(run_chain(_OnGpu(), case), run_chain("numpy", case), strict=True):
        chain_results_equal(got, want)


@settings(max_examples=200, deadline=None)
@given(strategies.strided_chain_cases())
def test_write_and_verify_over_strided_kv_layouts_match_reference(case):
    for got, want in zip(run_chain(_OnGpu(), case), run_chain("numpy", case), strict=True):
        chain_results_equal(got, want)


@settings(max_examples=100, deadline=None)
@given(strategies.strided_chain_cases(hostile=True))
def test_strided_kv_layouts_with_hostile_values_match_reference(case):
    for got, want in zip(run_chain(_OnGpu(), case), run_chain("numpy", case), strict=True):
        chain_results_equal(got, want)


@settings(max_examples=100, deadline=None)
@given(strategies.scatter_cases(hostile=True))
def test_scatter_matches_reference(case):
    got_pool, got_status = run_scatter(_OnGpu(), case)
    want_pool, want_status = run_scatter("numpy", case)
    np.testing.assert_array_equal(got_pool, want_pool)
    assert got_status == want_status


def test_plan_handles_70000_requests_in_one_launch():
    bs, width = 70_000, 8
    rng = np.random.default_rng(0)
    rtt = cp.asarray(rng.integers(1, 1 << 20, size=(bs + 1, width)).astype(np.int32))
    rpi = cp.arange(1, bs + 1, dtype=cp.int64)
    prefix = cp.asarray(rng.integers(0, width + 1, size=bs).astype(np.int64))
    extend = cp.ones(bs, cp.int64)
    total = int(prefix.sum())
    vp = kc.VerifyPlan.allocate(verify_capacity=total, device="cuda")
    wp = kc.WritePlan.allocate(write_req_capacity=bs, device="cuda")
    kc.launch_canary_plan_kernels(verify_plan_out=vp, write_plan_out=wp, req_pool_indices=rpi, prefix_lens=prefix,
                                  extend_seq_lens=extend, req_to_token=rtt, swa_window_size=0,
                                  full_to_swa_index_mapping=None, verify_capacity=total)
    vp_ref = kc.VerifyPlan.allocate(verify_capacity=total)
    wp_ref = kc.WritePlan.allocate(write_req_capacity=bs)
    kc.launch_canary_plan_kernels(verify_plan_out=vp_ref, write_plan_out=wp_ref, req_pool_indices=rpi.get(),
                                  prefix_lens=prefix.get(), extend_seq_lens=extend.get(), req_to_token=rtt.get(),
                                  swa_window_size=0, full_to_swa_index_mapping=None, verify_capacity=total)
    for name in ("verify_slot_indices", "verify_expected_positions", "verify_prev_slot_indices"):
        np.testing.assert_array_equal(getattr(vp, name).get(), getattr(vp_ref, name), err_msg=name)
    np.testing.assert_array_equal(wp.write_offsets.get(), wp_ref.write_offsets)
    np.testing.assert_array_equal(wp.write_seed_slot_indices.get(), wp_ref.write_seed_slot_indices)


class _Step:
    """One engine step's persistent device buffers, refilled in place between graph replays."""

    def __init__(self, bs: int, width: int, num_slots: int) -> None:
        self.bs, self.width = bs, width
        self.rtt = cp.zeros((bs + 1, width), cp.int32)
        self.rpi = cp.arange(1, bs + 1, dtype=cp.int64)
        self.prefix = cp.zeros(bs, cp.int64)
        self.extend = cp.ones(bs, cp.int64)
        self.input_ids = cp.zeros(bs, cp.int64)
        self.positions = cp.zeros(bs, cp.int64)
        self.out_cache_loc = cp.zeros(bs, cp.int64)
        self.capacity = bs * width
        self.vp = kc.VerifyPlan.allocate(verify_capacity=self.capacity, device="cuda")
        self.wp = kc.WritePlan.allocate(write_req_capacity=bs, device="cuda")
        self.ctx = kc.VerifyOrWriteContext.allocate(num_slots=num_slots, ring_capacity=64, device="cuda")

    def fill(self, step: int) -> None:
        """Decode step `step`: request r owns slots 1 + r * width + p; position `step` is written."""
        base = 1 + cp.arange(self.bs, dtype=cp.int64)[:, None] * self.width + cp.arange(self.width)[None, :]
        self.rtt[1:] = base.astype(cp.int32)
        self.prefix.fill(step)
        self.positions.fill(step)
        self.input_ids[:] = cp.arange(self.bs, dtype=cp.int64) * 1000 + step
        self.out_cache_loc[:] = base[:, step]

    def launch(self) -> None:
        kc.launch_canary_plan_kernels(
            verify_plan_out=self.vp, write_plan_out=self.wp, req_pool_indices=self.rpi, prefix_lens=self.prefix,
            extend_seq_lens=self.extend, req_to_token=self.rtt, swa_window_size=0, full_to_swa_index_mapping=None,
            verify_capacity=self.capacity)
        kc.launch_canary_verify_kernel(context=self.ctx, plan=self.vp, check_verify_expected_token=False)
        kc.launch_canary_write_kernel(context=self.ctx, plan=self.wp, input_ids=self.input_ids,
                                      positions=self.positions, out_cache_loc=self.out_cache_loc,
                                      enable_write_input_assert=False)


def test_plan_verify_write_capture_and_replay_in_a_cuda_graph():
    bs, width = 32, 8
    eager = _Step(bs, width, num_slots=1 + bs * width)
    graphed = _Step(bs, width, num_slots=1 + bs * width)
    graphed.fill(0)
    graphed.launch()  # warm-up: compiles every module before capture
    graphed.ctx.canary_buf.fill(0)
    graphed.ctx.kernel_run_counter.fill(0)
    graphed.ctx.slot_run_counter.fill(0)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        graphed.launch()
        graph = stream.end_capture()
    for step in range(width):
        eager.fill(step)
        eager.launch()
        graphed.fill(step)
        cp.cuda.Device().synchronize()
        graph.launch(stream)
        stream.synchronize()
    np.testing.assert_array_equal(graphed.ctx.canary_buf.get(), eager.ctx.canary_buf.get())
    assert int(graphed.ctx.violation_write_index.get()[0]) == 0 == int(eager.ctx.violation_write_index.get()[0])
    assert int(graphed.ctx.kernel_run_counter.get()[0]) == 2 * width
    assert int(graphed.ctx.slot_run_counter.get()[0]) == int(eager.ctx.slot_run_counter.get()[0])
    # a corrupted token is caught by the replayed graph's verify
    graphed.ctx.canary_buf.view(cp.int64)[1, 0] += 1
    graphed.fill(width - 1)
    cp.cuda.Device().synchronize()  # the corruption and refill ran on another stream than the graph
    graph.launch(stream)
    stream.synchronize()
    assert int(graphed.ctx.violation_write_index.get()[0]) >= 1


def test_a_call_that_raises_leaves_every_device_buffer_unchanged():
    vp = kc.VerifyPlan.allocate(verify_capacity=8, device="cuda")
    wp = kc.WritePlan.allocate(write_req_capacity=2, device="cuda")
    for arr in (*vars(vp).values(), *vars(wp).values()):
        arr.fill(SENTINEL)
    before = [arr.get() for arr in (*vars(vp).values(), *vars(wp).values())]
    good = {"req_pool_indices": cp.array([1], cp.int64), "prefix_lens": cp.array([2], cp.int64),
            "extend_seq_lens": cp.array([1], cp.int64), "req_to_token": cp.zeros((2, 4), cp.int32),
            "swa_window_size": 0, "full_to_swa_index_mapping": None, "verify_capacity": 8}
    for bad, fragment in (({"prefix_lens": cp.array([2], cp.int32)}, "prefix_lens must have dtype int64"),
                          ({"req_to_token": np.zeros((2, 4), np.int32)}, "req_to_token is on cpu"),
                          ({"verify_capacity": 7}, "verify_capacity=7"),
                          ({"req_to_verify_expected_tokens": cp.zeros((2, 4), cp.int32)},
                           "requires req_to_verify_expected_tokens_valid_lens")):
        with pytest.raises(ValueError, match=r"^kv-canary: .*" + fragment):
            kc.launch_canary_plan_kernels(verify_plan_out=vp, write_plan_out=wp, **{**good, **bad})
    after = [arr.get() for arr in (*vars(vp).values(), *vars(wp).values())]
    assert all(np.array_equal(a, b) for a, b in zip(before, after, strict=True))
