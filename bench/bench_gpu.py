"""GPU benchmarks: the CUDA kernels against a CuPy array-op baseline and the device-copy floor.

Every test is marked ``gpu`` (skipped with a reason where no CUDA device is visible). CuPy is imported only
when a test runs. One group per (step, batch); each group holds:

* ``kernels, eager`` — the public launcher (validation and launch from Python, then the kernels);
* ``kernels, CUDA graph`` — the same launches captured once and replayed with ``graph.launch``;
* ``array-op baseline`` (eager, and graph-replayed where it can be captured) — bench/workloads.py's generic
  cumsum / repeat / take / elementwise version run with CuPy, checked equal to the kernels' output once;
* ``floor: D2D copy`` — ``cudaMemcpyAsync`` device-to-device of the bytes the step must move: 32 bytes per
  verify entry (one plan entry, one canary record) plus the real-KV bytes hashed, 32 per written token.

Timing, because launches are asynchronous:

* device time (``extra_info["device_s"]``, the figure ratios use): CUDA events around ``inner`` back-to-back
  calls, median of 5 rounds. Before each round a one-thread kernel spins on the GPU's global timer until
  the host has queued every call, so the events time the GPU's work and not Python's launch rate (a
  round where the queue still ran dry is retried with a longer spin, and flagged ``starved`` if it stays
  so); ``host_issue_us`` is the host time to issue one call;
* wall time (pytest-benchmark's stats): one call followed by ``stream.synchronize()``, the launch→result
  latency a caller sees.

The floor row also carries ``launch_s``, the device time of an empty kernel, for "copy floor + one launch".
Batches: plan with bs up to 65,536 and up to 4M entries; verify up to 4M entries with and without 2 × 256 B
real-KV sources; write as decode steps (up to 65,536 requests) and a 32 × 1024-token extend; and the
end-to-end decode step (plan + verify + write) of 256 requests. Nothing here fails on a time.
"""

from __future__ import annotations

import contextlib
import functools
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import workloads as wl
from workloads import Batch

import kvcanary_cupy as kc

pytestmark = pytest.mark.gpu

PLAN_BATCHES = [
    Batch(32, 1024),
    Batch(256, 4096),  # 1M entries
    Batch(65536, 16),  # 1M entries over 65,536 requests
    Batch(256, 16384, window=4096),  # SWA, 1M entries
    Batch(65536, 64),  # 4M entries
]
VERIFY_BATCHES = [wl.with_sources(b, n) for b in (Batch(32, 1024), Batch(256, 4096), Batch(65536, 64))
                  for n in (0, 2)]
WRITE_BATCHES = [
    Batch(256, 2048, tokens=False),  # decode steps
    Batch(4096, 1024, tokens=False),
    Batch(65536, 64, tokens=False),
    Batch(4096, 1024, tokens=False, sources=2),
    Batch(32, 1024, extend=1024, tokens=False),  # extend: 1024 serial tokens per request
]
STEP_BATCHES = [Batch(256, 512), Batch(256, 2048), Batch(256, 2048, sources=2)]

ROUNDS = 5  # CUDA-event rounds per row
WALL_BUDGET_S = 0.3  # synchronised wall-time sampling per row
MAX_SPIN_S = 1.0
ROUND_BUDGET_S = 0.05  # inner calls per event round are capped to about this much work
GRAPH_BASELINE_MAX_STEPS = 16  # array-op write baselines with more serial steps are not captured

SPIN_SOURCE = r"""
extern "C" __global__ void kvc_bench_spin(unsigned long long ns) {
  unsigned long long start, now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  do {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  } while (now - start < ns);
}
extern "C" __global__ void kvc_bench_noop() {}
"""


def ids(batches: list[Batch]) -> list[str]:
    return [b.id for b in batches]


# ----------------------------------------------------------------------------------------------------------
# device harness
# ----------------------------------------------------------------------------------------------------------
@dataclass
class Gpu:
    """One non-blocking stream that runs everything (setup included), event timing and graph capture."""

    cp: Any
    stream: Any
    spin_kernel: Any
    noop_kernel: Any
    graph_pools: list[Any] = field(default_factory=list)  # keeps memory captured by baseline graphs alive

    def spin(self, seconds: float) -> None:
        self.spin_kernel((1,), (1,), (np.uint64(int(seconds * 1e9)),))

    def noop(self) -> None:
        self.noop_kernel((1,), (1,), ())

    def asarray(self, a: np.ndarray) -> Any:
        with self.stream:
            out = self.cp.asarray(a)
        self.stream.synchronize()
        return out

    def synced(self, op: Callable[[], Any]) -> Callable[[], None]:
        def run() -> None:
            with self.stream:
                op()
            self.stream.synchronize()

        return run

    def device_seconds(self, op: Callable[[], Any], inner: int) -> tuple[float, bool, float]:
        """(median device seconds per call, starved, host seconds to issue one call)."""
        cp, stream = self.cp, self.stream
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        with stream:
            begin = time.perf_counter()
            for _ in range(inner):
                op()
            issue = time.perf_counter() - begin
            stream.synchronize()
            spin = min(max(3 * issue, 1e-4), MAX_SPIN_S)
            samples, starved = [], False
            for _ in range(ROUNDS):
                for _attempt in range(2):
                    self.spin(spin)
                    start.record(stream)
                    for _ in range(inner):
                        op()
                    early = start.done  # the timed region began before every call was queued
                    stop.record(stream)
                    stop.synchronize()
                    if not early:
                        break
                    spin = min(4 * spin, MAX_SPIN_S)
                starved |= early
                samples.append(cp.cuda.get_elapsed_time(start, stop) * 1e-3 / inner)
        return statistics.median(samples), starved, issue / inner

    def capture(self, op: Callable[[], Any], *, private_pool: bool = False) -> Any:
        """A CUDA graph of ``op``. ``private_pool``: ops that allocate (the array-op baselines) get a memory
        pool of their own, warmed up by one eager call and kept alive with the graph, so the addresses baked
        into the graph are never handed to anyone else."""
        cp, stream = self.cp, self.stream
        allocator = contextlib.nullcontext()
        if private_pool:
            pool = cp.cuda.MemoryPool()
            self.graph_pools.append(pool)
            allocator = cp.cuda.using_allocator(pool.malloc)
        with stream, allocator:
            op()  # warm-up on the capture stream: compiles kernels, fills the pool
            stream.synchronize()
            stream.begin_capture()
            try:
                op()
            finally:
                graph = stream.end_capture()
        return graph

    def replay(self, graph: Any) -> Callable[[], None]:
        return lambda: graph.launch(self.stream)

    def copy_op(self, nbytes: int) -> Callable[[], None]:
        with self.stream:
            src = self.cp.empty(nbytes, self.cp.uint8)
            dst = self.cp.empty(nbytes, self.cp.uint8)
        return lambda: dst.data.copy_from_device_async(src.data, nbytes, self.stream)

    @functools.cached_property
    def launch_seconds(self) -> float:
        """Device time of one empty kernel among back-to-back ones."""
        return self.device_seconds(self.noop, inner=200)[0]


@functools.cache
def gpu() -> Gpu:
    import cupy as cp

    module = cp.RawModule(code=SPIN_SOURCE)
    return Gpu(cp=cp, stream=cp.cuda.Stream(non_blocking=True), spin_kernel=module.get_function("kvc_bench_spin"),
               noop_kernel=module.get_function("kvc_bench_noop"))


def scatter_add(target: Any, index: Any, value: int) -> None:
    import cupyx

    cupyx.scatter_add(target, index, value)


@pytest.fixture
def gpu_measure(benchmark):
    """``gpu_measure(op, inner=..., group=..., label=..., role=..., mode=..., entries=..., key=...)``:
    one row, timed by synchronised wall clock (pytest-benchmark) and by CUDA events (extra_info)."""

    def run(op: Callable[[], Any], *, inner: int, group: str, label: str, role: str, mode: str, entries: int,
            key: str, **info: Any) -> None:
        g = gpu()
        benchmark.group = group
        benchmark.extra_info.update(label=label, role=role, mode=mode, entries=int(entries), key=key, **info)
        call = g.synced(op)
        if benchmark.disabled:
            benchmark(call)
            return
        call()
        begin = time.perf_counter()
        call()
        probe = time.perf_counter() - begin
        rounds = int(min(200, max(5, WALL_BUDGET_S / max(probe, 1e-6))))
        inner = max(1, min(inner, int(ROUND_BUDGET_S / max(probe, 1e-6))))
        benchmark.pedantic(call, rounds=rounds, iterations=1, warmup_rounds=1)
        device_s, starved, issue_s = g.device_seconds(op, inner)
        benchmark.extra_info.update(device_s=device_s, starved=starved, host_issue_us=issue_s * 1e6)
        if role == "floor":
            benchmark.extra_info["launch_s"] = g.launch_seconds

    return run


def kernels_and_baseline(gpu_measure, *, kind: str, batch: Batch, group: str, entries: int,
                         kernels: Callable[[], Any], baseline: Callable[[], Any] | None, floor_bytes: int,
                         which: str, graph_baseline: bool = True) -> None:
    """One row of a group, chosen by ``which``; every row of every group goes through here."""
    g = gpu()
    common = {"group": group, "entries": entries, "floor_bytes": floor_bytes}
    key = f"gpu.{kind}.{which}.{batch.id}"
    if which == "kernels-eager":
        gpu_measure(kernels, inner=20, label="kernels, eager", role="subject", mode="eager", key=key, **common)
    elif which == "kernels-graph":
        gpu_measure(g.replay(g.capture(kernels)), inner=50, label="kernels, CUDA graph", role="subject",
                    mode="graph", key=key, **common)
    elif which == "baseline-eager":
        gpu_measure(baseline, inner=3, label="array-op baseline (CuPy), eager", role="baseline", mode="eager",
                    key=key, **common)
    elif which == "baseline-graph":
        if not graph_baseline:
            pytest.skip("this array-op baseline launches thousands of kernels per call; captured only eager")
        try:
            graph = g.capture(baseline, private_pool=True)
        except Exception as exc:  # a CuPy op that cannot be captured is the baseline's limit, not a failure
            pytest.skip(f"array-op baseline cannot be captured in a CUDA graph: {type(exc).__name__}: {exc}")
        gpu_measure(g.replay(graph), inner=10, label="array-op baseline (CuPy), CUDA graph", role="baseline",
                    mode="graph", key=key, **common)
    elif which == "floor":
        gpu_measure(g.copy_op(floor_bytes), inner=50, label=f"floor: D2D copy of {floor_bytes:,} B",
                    role="floor", mode="eager", key=key, **common)
    else:
        raise AssertionError(which)


ROWS = ["kernels-eager", "kernels-graph", "baseline-eager", "baseline-graph", "floor"]


# ----------------------------------------------------------------------------------------------------------
# setups (built once per session, on the harness stream)
# ----------------------------------------------------------------------------------------------------------
@dataclass
class PlanSetup:
    kwargs: dict[str, Any]  # launch_canary_plan_kernels keyword arguments, on the device
    baseline_args: dict[str, Any]
    verify: Any
    write: Any


@functools.cache
def plan_setup(batch: Batch) -> PlanSetup:
    g = gpu()
    inputs = wl.plan_inputs(batch)
    args = inputs.kwargs(g.asarray)
    with g.stream:
        vp = kc.VerifyPlan.allocate(verify_capacity=inputs.verify_capacity, device="cuda")
        wp = kc.WritePlan.allocate(write_req_capacity=inputs.write_req_capacity, device="cuda")
        kwargs = {"verify_plan_out": vp, "write_plan_out": wp, **args}
        kc.launch_canary_plan_kernels(**kwargs)
    g.stream.synchronize()
    assert int(vp.enable.get()[0]) == 1 and int(vp.verify_num_valid.get()[0]) == batch.verify_entries
    return PlanSetup(kwargs, {**args, "write_req_capacity": inputs.write_req_capacity}, vp, wp)


def plan_fields(vp: Any) -> dict[str, Any]:
    return {name: getattr(vp, name) for name in ("verify_slot_indices", "verify_expected_tokens",
                                                 "verify_expected_positions", "verify_prev_slot_indices")}


@dataclass
class ChainSetup:
    """A device canary holding every request's prefix, its sources, and the step's write inputs."""

    context: Any
    sources: list[Any]
    tokens: dict[str, Any]  # input_ids / positions / out_cache_loc of the step's new tokens


def device_sources(batch: Batch) -> list[Any]:
    """Pseudo-random real-KV bytes made on the device (splitmix64 of a counter), uint8 [slots, 256] each."""
    g = gpu()
    cp = g.cp
    out = []
    with g.stream:
        for k in range(batch.sources):
            words = cp.arange(batch.num_slots * wl.REAL_KV_BYTES // 8, dtype=cp.uint64)
            words += np.uint64((k + 1) << 40)
            wl.splitmix64_(cp, words)
            out.append(words.view(cp.uint8).reshape(batch.num_slots, wl.REAL_KV_BYTES))
    return out


@functools.cache
def chain_setup(batch: Batch, populate: bool = True) -> ChainSetup:
    g = gpu()
    sources = device_sources(batch)
    with g.stream:
        context = kc.VerifyOrWriteContext.allocate(
            num_slots=batch.num_slots, ring_capacity=1024, real_kv_sources=wl.real_kv_sources(sources),
            real_kv_hash_mode=wl.hash_mode(batch), device="cuda")
        if populate:
            wl.populate_prefix(context, batch, g.cp.asarray, "cuda")
    g.stream.synchronize()
    step = wl.write_inputs(batch, batch.prefix, batch.extend)
    tokens = {name: g.asarray(getattr(step, name)) for name in ("input_ids", "positions", "out_cache_loc")}
    return ChainSetup(context, sources, tokens)


def plan_batch(batch: Batch) -> Batch:
    """The plan's batch for a verify / write batch (sources do not change the plan)."""
    return Batch(batch.bs, batch.prefix, batch.extend, batch.window, batch.tokens)


# ----------------------------------------------------------------------------------------------------------
# plan
# ----------------------------------------------------------------------------------------------------------
@functools.cache
def check_plan_baseline(batch: Batch) -> None:
    g = gpu()
    setup = plan_setup(batch)
    with g.stream:
        got = wl.plan_baseline(g.cp, scatter_add, setup.baseline_args)
    g.stream.synchronize()
    for name, value in got.items():
        want = getattr(setup.verify, name, None)
        want = getattr(setup.write, name) if want is None else want
        np.testing.assert_array_equal(value.get(), want.get()[: value.shape[0]], err_msg=name)


@pytest.mark.parametrize("which", ROWS)
@pytest.mark.parametrize("batch", PLAN_BATCHES, ids=ids(PLAN_BATCHES))
def test_plan(gpu_measure, batch, which):
    g = gpu()
    setup = plan_setup(batch)
    check_plan_baseline(batch)
    kernels_and_baseline(
        gpu_measure, kind="plan", batch=batch, group=f"GPU plan · {batch.describe()}",
        entries=batch.verify_entries, which=which, floor_bytes=wl.ENTRY_BYTES * batch.verify_entries,
        kernels=lambda: kc.launch_canary_plan_kernels(**setup.kwargs),
        baseline=lambda: wl.plan_baseline(g.cp, scatter_add, setup.baseline_args))


LAYOUT_LABELS = {"token": "token table (req_to_token)", "block": "block table (16 tokens / block)",
                 "csr": "CSR page lists (16 tokens / page)"}


@functools.cache
def layout_plan_setup(batch: Batch, kind: str) -> dict[str, Any]:
    """A launch of ``batch``'s entries through one slot layout (bench/workloads.py), run and checked once."""
    g = gpu()
    with g.stream:
        vp = kc.VerifyPlan.allocate(verify_capacity=batch.verify_entries, device="cuda")
        wp = kc.WritePlan.allocate(write_req_capacity=batch.bs, device="cuda")
        kwargs = {"verify_plan_out": vp, "write_plan_out": wp, **wl.layout_plan_kwargs(batch, kind, g.asarray)}
        kc.launch_canary_plan_kernels(**kwargs)
    g.stream.synchronize()
    assert int(vp.enable.get()[0]) == 1 and int(vp.verify_num_valid.get()[0]) == batch.verify_entries
    return kwargs


@pytest.mark.parametrize("kind", wl.LAYOUT_KINDS)
@pytest.mark.parametrize("batch", PLAN_BATCHES, ids=ids(PLAN_BATCHES))
def test_plan_layouts(gpu_measure, batch, kind):
    """The token table, the block table and CSR page lists planning the same entries (eager launches); the
    token table is the group's baseline."""
    kwargs = layout_plan_setup(batch, kind)
    if kind != "token":
        want = layout_plan_setup(batch, "token")["verify_plan_out"]
        for name, value in plan_fields(kwargs["verify_plan_out"]).items():
            assert bool((value == getattr(want, name)).all()), f"{kind}: {name}"
    gpu_measure(lambda: kc.launch_canary_plan_kernels(**kwargs), inner=20, group=f"GPU plan layouts · "
                f"{batch.describe()}", label=f"kernels, eager: {LAYOUT_LABELS[kind]}",
                role="baseline" if kind == "token" else "subject", mode="eager", entries=batch.verify_entries,
                key=f"gpu.plan-layout.{kind}.{batch.id}")


# ----------------------------------------------------------------------------------------------------------
# verify
# ----------------------------------------------------------------------------------------------------------
def ring_rows(context: Any) -> list[tuple[int, int]]:
    n = min(int(context.violation_write_index.get()[0]), context.violation_ring.shape[0])
    return sorted((int(r[1]), int(r[7])) for r in context.violation_ring[:n].get())


def reset_ring(context: Any) -> None:
    context.violation_ring.fill(0)
    context.violation_write_index.fill(0)


@functools.cache
def check_verify(batch: Batch) -> None:
    """The workload verifies clean in both implementations, and three injected corruptions (token,
    position, real-KV byte) are reported identically; the canary and ring are restored afterwards."""
    g = gpu()
    cp = g.cp
    chain = chain_setup(batch)
    vp = plan_setup(plan_batch(batch)).verify
    ctx = chain.context
    fields = ctx.canary_buf.view(cp.int64)
    launch = functools.partial(kc.launch_canary_verify_kernel, context=ctx, plan=vp, check_verify_expected_token=True)
    with g.stream:
        launch()
        bits = wl.verify_baseline(cp, fields, plan_fields(vp), chain.sources, True)
    g.stream.synchronize()
    assert ring_rows(ctx) == [], "the verify workload must be clean"
    assert not bool(bits.any())
    slots = vp.verify_slot_indices.get()
    with g.stream:  # every device operation goes to the harness stream, which does not sync with stream 0
        saved = ctx.canary_buf.copy()
        fields[int(slots[3]), 0] += 1  # token -> TOKEN here, CHAIN on the successor
        fields[int(slots[7]), 1] += 1  # position
        for s in chain.sources:
            s[int(slots[9]), 5] ^= 1  # real-KV byte
        launch()
        bits = wl.verify_baseline(cp, fields, plan_fields(vp), chain.sources, True)
    g.stream.synchronize()
    bits = bits.get()
    flagged = np.flatnonzero(bits)
    assert ring_rows(ctx) == sorted(zip(slots[flagged].tolist(), bits[flagged].tolist(), strict=True))
    with g.stream:
        ctx.canary_buf[...] = saved
        for s in chain.sources:
            s[int(slots[9]), 5] ^= 1
        reset_ring(ctx)
    g.stream.synchronize()


@pytest.mark.parametrize("which", ROWS)
@pytest.mark.parametrize("batch", VERIFY_BATCHES, ids=ids(VERIFY_BATCHES))
def test_verify(gpu_measure, batch, which):
    g = gpu()
    chain = chain_setup(batch)
    vp = plan_setup(plan_batch(batch)).verify
    check_verify(batch)
    fields = chain.context.canary_buf.view(g.cp.int64)
    per_entry = wl.ENTRY_BYTES + batch.sources * wl.REAL_KV_BYTES
    kernels_and_baseline(
        gpu_measure, kind="verify", batch=batch, group=f"GPU verify · {batch.describe()}",
        entries=batch.verify_entries, which=which, floor_bytes=per_entry * batch.verify_entries,
        kernels=lambda: kc.launch_canary_verify_kernel(context=chain.context, plan=vp,
                                                       check_verify_expected_token=True),
        baseline=lambda: wl.verify_baseline(g.cp, fields, plan_fields(vp), chain.sources, True))
    assert int(chain.context.violation_write_index.get()[0]) == 0


# ----------------------------------------------------------------------------------------------------------
# write
# ----------------------------------------------------------------------------------------------------------
@functools.cache
def write_baseline_fields(batch: Batch) -> Any:
    """The baseline's own canary, checked equal to the kernels' after one write each."""
    g = gpu()
    chain = chain_setup(batch, populate=False)
    wp = plan_setup(plan_batch(batch)).write
    with g.stream:
        kc.launch_canary_write_kernel(context=chain.context, plan=wp, enable_write_input_assert=False,
                                      **chain.tokens)
        fields = g.cp.zeros_like(chain.context.canary_buf).view(g.cp.int64)
        wl.write_baseline(g.cp, fields, wp.write_offsets, wp.write_seed_slot_indices, chain.tokens, batch.bs,
                          batch.extend, chain.sources)
    g.stream.synchronize()
    np.testing.assert_array_equal(fields.get(), chain.context.canary_buf.view(g.cp.int64).get())
    return fields


@pytest.mark.parametrize("which", ROWS)
@pytest.mark.parametrize("batch", WRITE_BATCHES, ids=ids(WRITE_BATCHES))
def test_write(gpu_measure, batch, which):
    g = gpu()
    chain = chain_setup(batch, populate=False)
    wp = plan_setup(plan_batch(batch)).write
    fields = write_baseline_fields(batch)
    per_token = wl.ENTRY_BYTES + batch.sources * wl.REAL_KV_BYTES
    kernels_and_baseline(
        gpu_measure, kind="write", batch=batch, group=f"GPU write · {batch.describe('write')}",
        entries=batch.write_tokens, which=which, floor_bytes=per_token * batch.write_tokens,
        kernels=lambda: kc.launch_canary_write_kernel(context=chain.context, plan=wp,
                                                      enable_write_input_assert=False, **chain.tokens),
        baseline=lambda: wl.write_baseline(g.cp, fields, wp.write_offsets, wp.write_seed_slot_indices,
                                           chain.tokens, batch.bs, batch.extend, chain.sources),
        graph_baseline=batch.extend <= GRAPH_BASELINE_MAX_STEPS)


# ----------------------------------------------------------------------------------------------------------
# decode step: plan + verify + write
# ----------------------------------------------------------------------------------------------------------
@dataclass
class StepSetup:
    kernels: Callable[[], None]
    baseline: Callable[[], None]


@functools.cache
def step_setup(batch: Batch) -> StepSetup:
    """One decode step of ``batch``: plan, verify the prefix, write the new token; the baseline does the
    same on its own copy of the canary (every replay rewrites identical values, so both stay clean)."""
    g = gpu()
    cp = g.cp
    chain = chain_setup(batch)
    plans = plan_setup(plan_batch(batch))
    ctx = chain.context

    def kernels() -> None:
        kc.launch_canary_plan_kernels(**plans.kwargs)
        kc.launch_canary_verify_kernel(context=ctx, plan=plans.verify, check_verify_expected_token=True)
        kc.launch_canary_write_kernel(context=ctx, plan=plans.write, enable_write_input_assert=False,
                                      **chain.tokens)

    with g.stream:
        fields = ctx.canary_buf.copy().view(cp.int64)

    def baseline() -> Any:
        plan = wl.plan_baseline(cp, scatter_add, plans.baseline_args)
        bits = wl.verify_baseline(cp, fields, plan, chain.sources, True)
        wl.write_baseline(cp, fields, plan["write_offsets"], plan["write_seed_slot_indices"], chain.tokens,
                          batch.bs, batch.extend, chain.sources)
        return bits

    with g.stream:
        kernels()
        bits = baseline()
    g.stream.synchronize()
    assert int(ctx.violation_write_index.get()[0]) == 0 and not bool(bits.any())
    np.testing.assert_array_equal(fields.get(), ctx.canary_buf.view(cp.int64).get())
    return StepSetup(kernels, baseline)


@pytest.mark.parametrize("which", ROWS)
@pytest.mark.parametrize("batch", STEP_BATCHES, ids=ids(STEP_BATCHES))
def test_decode_step(gpu_measure, batch, which):
    setup = step_setup(batch)
    per_entry = wl.ENTRY_BYTES + batch.sources * wl.REAL_KV_BYTES
    floor_bytes = per_entry * (batch.verify_entries + batch.write_tokens)
    kernels_and_baseline(
        gpu_measure, kind="step", batch=batch,
        group=f"GPU decode step (plan+verify+write) · {batch.describe()}",
        entries=batch.verify_entries, which=which, floor_bytes=floor_bytes,
        kernels=setup.kernels, baseline=setup.baseline)
