"""CPU benchmarks: what the NumPy references cost, against the scalar oracle and the memory floor.

One group per (step, batch); its rows run on the same inputs in the same process:

* ``NumPy reference`` — the public launcher with ``backend="numpy"`` (validation included), the figure a
  user pays; ``backend call only`` — the same launch already validated (``prepare_*_launch`` once, then the
  backend object), which isolates the reference's own cost;
* ``host backend`` — the CUDA kernels compiled for the CPU (for information);
* ``array-op baseline`` — bench/workloads.py's generic array-op version, the code the GPU suite runs with
  CuPy, here with NumPy (checked equal to the reference once per group);
* ``floor`` (plan only) — filling the plan's output bytes, 4 preallocated int64 arrays of the entry count;
* ``scalar oracle`` — tests/oracle.py, one request / entry / slot at a time in Python integers; timed over
  3 rounds, and only on batches where one call stays under a second (the skipped rows say which).

Batches: (bs, prefix) ∈ {(8, 512), (32, 1024), (256, 2048)} with an expected-token pool, plus an SWA case
(bs 32, prefix 4096, window 1024, permuted LUT); verify with and without 2 real-KV sources of 256 bytes (ALL
mode); write as a decode step (256 requests × 1 token) and as extends (8 × 512, 32 × 1024 tokens).
Nothing here fails on a time; run ``make bench`` for the JSON and bench/RESULTS.md.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import numpy as np
import oracle
import pytest
import workloads as wl
from workloads import Batch

import kvcanary_cupy as kc
from kvcanary_cupy.backends import resolve_backend, unavailable_reason
from kvcanary_cupy.dlpack import CPU
from kvcanary_cupy.plan import prepare_plan_launch
from kvcanary_cupy.verify import prepare_verify_launch
from kvcanary_cupy.write import prepare_write_launch

PLAN_BATCHES = [Batch(8, 512), Batch(32, 1024), Batch(256, 2048), Batch(32, 4096, window=1024)]
VERIFY_BATCHES = [wl.with_sources(b, n) for b in PLAN_BATCHES[:3] for n in (0, 2)]
WRITE_BATCHES = [
    Batch(256, 2048, tokens=False),  # decode step: one token per request
    Batch(8, 512, extend=512, tokens=False),
    Batch(32, 1024, extend=1024, tokens=False),
    Batch(256, 2048, tokens=False, sources=2),
    Batch(8, 512, extend=512, tokens=False, sources=2),
]

ORACLE_MAX_ENTRIES = 32_768  # verify / write oracle: above this one call takes seconds
ORACLE_MAX_ENTRIES_WITH_SOURCES = 4_096  # real-KV hashing in Python costs ~15 µs per source per slot

HOST_REASON = unavailable_reason("host")
needs_host = pytest.mark.skipif(HOST_REASON is not None, reason=f"host backend: {HOST_REASON}")

LABELS = {
    "numpy": "NumPy reference",
    "numpy-backend": "NumPy reference, backend call only",
    "host": "host backend (kernels on CPU fibers)",
    "baseline": "array-op baseline (NumPy)",
    "floor": "floor: fill 4 × int64 per entry",
    "oracle": "scalar oracle",
}


def ids(batches: list[Batch]) -> list[str]:
    return [b.id for b in batches]


ORACLE_ROUNDS = 3


def oracle_sources(sources: list[np.ndarray]) -> list[tuple[np.ndarray, int, int, int]]:
    return [(s, 1, wl.REAL_KV_BYTES, wl.REAL_KV_BYTES) for s in sources]


def oracle_fits(batch: Batch, entries: int) -> bool:
    return entries <= (ORACLE_MAX_ENTRIES_WITH_SOURCES if batch.sources else ORACLE_MAX_ENTRIES)


# ----------------------------------------------------------------------------------------------------------
# plan
# ----------------------------------------------------------------------------------------------------------
@dataclass
class PlanSetup:
    inputs: wl.PlanInputs
    verify: kc.VerifyPlan
    write: kc.WritePlan

    def launch_kwargs(self) -> dict[str, Any]:
        return {"verify_plan_out": self.verify, "write_plan_out": self.write, **self.inputs.kwargs()}


@functools.cache
def plan_setup(batch: Batch) -> PlanSetup:
    inputs = wl.plan_inputs(batch)
    setup = PlanSetup(inputs, kc.VerifyPlan.allocate(verify_capacity=inputs.verify_capacity),
                      kc.WritePlan.allocate(write_req_capacity=inputs.write_req_capacity))
    kc.launch_canary_plan_kernels(**setup.launch_kwargs(), backend="numpy")
    assert int(setup.verify.enable[0]) == 1 and int(setup.verify.verify_num_valid[0]) == batch.verify_entries
    return setup


def plan_group(batch: Batch) -> str:
    return f"plan · {batch.describe()}"


def plan_measure(measure, batch: Batch, impl: str, fn, **kwargs) -> None:
    measure(fn, group=plan_group(batch), label=LABELS[impl], entries=batch.verify_entries,
            key=f"cpu.plan.{impl}.{batch.id}", **kwargs)


@pytest.mark.parametrize("batch", PLAN_BATCHES, ids=ids(PLAN_BATCHES))
def test_plan_numpy(measure, batch):
    kwargs = plan_setup(batch).launch_kwargs()
    plan_measure(measure, batch, "numpy", lambda: kc.launch_canary_plan_kernels(**kwargs, backend="numpy"),
                 role="subject")


@pytest.mark.parametrize("batch", PLAN_BATCHES, ids=ids(PLAN_BATCHES))
def test_plan_numpy_backend_only(measure, batch):
    launch = prepare_plan_launch(**plan_setup(batch).launch_kwargs(), function="launch_canary_plan_kernels")
    backend = resolve_backend("numpy", CPU)
    plan_measure(measure, batch, "numpy-backend", lambda: backend.plan(launch), role="subject")


@needs_host
@pytest.mark.parametrize("batch", PLAN_BATCHES, ids=ids(PLAN_BATCHES))
def test_plan_host(measure, batch):
    kwargs = plan_setup(batch).launch_kwargs()
    plan_measure(measure, batch, "host", lambda: kc.launch_canary_plan_kernels(**kwargs, backend="host"),
                 role="info")


@pytest.mark.parametrize("batch", PLAN_BATCHES, ids=ids(PLAN_BATCHES))
def test_plan_array_op_baseline(measure, batch):
    setup = plan_setup(batch)
    args = {**setup.inputs.kwargs(), "write_req_capacity": setup.inputs.write_req_capacity}
    got = wl.plan_baseline(np, wl.numpy_add_at, args)
    for name, value in got.items():
        want = getattr(setup.verify, name, None)
        want = getattr(setup.write, name) if want is None else want
        np.testing.assert_array_equal(value, want[: value.shape[0]], err_msg=name)
    plan_measure(measure, batch, "baseline", lambda: wl.plan_baseline(np, wl.numpy_add_at, args), role="baseline")


@pytest.mark.parametrize("batch", PLAN_BATCHES, ids=ids(PLAN_BATCHES))
def test_plan_fill_floor(measure, batch):
    outputs = [np.empty(batch.verify_entries, np.int64) for _ in range(4)]

    def fill() -> None:
        for value, out in enumerate(outputs):
            out.fill(value)

    plan_measure(measure, batch, "floor", fill, role="floor")


@pytest.mark.parametrize("batch", PLAN_BATCHES, ids=ids(PLAN_BATCHES))
def test_plan_oracle(measure, batch):
    inputs = plan_setup(batch).inputs
    kwargs = {**inputs.kwargs(), "write_req_capacity": inputs.write_req_capacity}
    plan_measure(measure, batch, "oracle", lambda: oracle.plan_oracle(**kwargs), role="oracle",
                 rounds=ORACLE_ROUNDS, warmup=False)


# ----------------------------------------------------------------------------------------------------------
# verify
# ----------------------------------------------------------------------------------------------------------
@dataclass
class VerifySetup:
    context: kc.VerifyOrWriteContext
    plan: kc.VerifyPlan
    sources: list[np.ndarray]

    def launch_kwargs(self, batch: Batch) -> dict[str, Any]:
        return {"context": self.context, "plan": self.plan, "check_verify_expected_token": batch.tokens}

    @functools.cached_property
    def oracle_state(self) -> oracle.CanaryState:
        return oracle.CanaryState.from_arrays(self.context.canary_buf, self.context.violation_ring)


@functools.cache
def verify_setup(batch: Batch) -> VerifySetup:
    """A canary holding every request's prefix (written by the reference) and the plan verifying it."""
    sources = [wl.source_bytes(batch.num_slots, k) for k in range(batch.sources)]
    context = kc.VerifyOrWriteContext.allocate(num_slots=batch.num_slots, ring_capacity=1024,
                                               real_kv_sources=wl.real_kv_sources(sources),
                                               real_kv_hash_mode=wl.hash_mode(batch))
    wl.populate_prefix(context, batch, lambda a: a, "cpu", backend="numpy")
    plan = plan_setup(Batch(batch.bs, batch.prefix, batch.extend, batch.window, batch.tokens)).verify
    setup = VerifySetup(context, plan, sources)
    kc.launch_canary_verify_kernel(**setup.launch_kwargs(batch), backend="numpy")
    assert int(context.violation_write_index[0]) == 0, "the verify workload must be clean"
    return setup


def verify_measure(measure, batch: Batch, impl: str, fn, **kwargs) -> None:
    measure(fn, group=f"verify · {batch.describe()}", label=LABELS[impl], entries=batch.verify_entries,
            key=f"cpu.verify.{impl}.{batch.id}", **kwargs)


@pytest.mark.parametrize("batch", VERIFY_BATCHES, ids=ids(VERIFY_BATCHES))
def test_verify_numpy(measure, batch):
    kwargs = verify_setup(batch).launch_kwargs(batch)
    verify_measure(measure, batch, "numpy", lambda: kc.launch_canary_verify_kernel(**kwargs, backend="numpy"),
                   role="subject")


@pytest.mark.parametrize("batch", VERIFY_BATCHES, ids=ids(VERIFY_BATCHES))
def test_verify_numpy_backend_only(measure, batch):
    launch = prepare_verify_launch(**verify_setup(batch).launch_kwargs(batch))
    backend = resolve_backend("numpy", CPU)
    verify_measure(measure, batch, "numpy-backend", lambda: backend.verify(launch), role="subject")


@needs_host
@pytest.mark.parametrize("batch", VERIFY_BATCHES, ids=ids(VERIFY_BATCHES))
def test_verify_host(measure, batch):
    setup = verify_setup(batch)
    kwargs = setup.launch_kwargs(batch)
    verify_measure(measure, batch, "host", lambda: kc.launch_canary_verify_kernel(**kwargs, backend="host"),
                   role="info")
    assert int(setup.context.violation_write_index[0]) == 0


@pytest.mark.parametrize("batch", VERIFY_BATCHES, ids=ids(VERIFY_BATCHES))
def test_verify_array_op_baseline(measure, batch):
    setup = verify_setup(batch)
    fields = setup.context.canary_buf.view(np.int64)
    plan = {name: getattr(setup.plan, name) for name in ("verify_slot_indices", "verify_expected_tokens",
                                                           "verify_expected_positions", "verify_prev_slot_indices")}

    def run():
        return wl.verify_baseline(np, fields, plan, setup.sources, batch.tokens)

    assert not run().any(), "the baseline must find the workload clean, as the reference does"
    verify_measure(measure, batch, "baseline", run, role="baseline")


# The scalar oracle is timed only where one call stays around a second (see oracle_fits).
VERIFY_ORACLE_BATCHES = [b for b in VERIFY_BATCHES if oracle_fits(b, b.verify_entries)]


@pytest.mark.parametrize("batch", VERIFY_ORACLE_BATCHES, ids=ids(VERIFY_ORACLE_BATCHES))
def test_verify_oracle(measure, batch):
    setup = verify_setup(batch)
    plan, state = setup.plan, setup.oracle_state
    sources = oracle_sources(setup.sources)

    def run() -> None:
        oracle.verify_oracle(
            state, kernel_kind=setup.context.kernel_kind, verify_slot_indices=plan.verify_slot_indices,
            verify_expected_tokens=plan.verify_expected_tokens,
            verify_expected_positions=plan.verify_expected_positions,
            verify_prev_slot_indices=plan.verify_prev_slot_indices, verify_num_valid=plan.verify_num_valid,
            enable=plan.enable, check_verify_expected_token=batch.tokens, sources=sources,
            mode=int(setup.context.real_kv_hash_mode))

    verify_measure(measure, batch, "oracle", run, role="oracle", rounds=ORACLE_ROUNDS,
                   warmup=False)
    assert state.write_index == 0


# ----------------------------------------------------------------------------------------------------------
# write
# ----------------------------------------------------------------------------------------------------------
@dataclass
class WriteSetup:
    context: kc.VerifyOrWriteContext
    plan: kc.WritePlan
    tokens: wl.WriteInputs
    sources: list[np.ndarray]

    def launch_kwargs(self) -> dict[str, Any]:
        return {"context": self.context, "plan": self.plan, "input_ids": self.tokens.input_ids,
                "positions": self.tokens.positions, "out_cache_loc": self.tokens.out_cache_loc,
                "enable_write_input_assert": False}


@functools.cache
def write_setup(batch: Batch) -> WriteSetup:
    """Tokens at positions [prefix, prefix + extend) of every request; seeds from the plan. Repeated
    launches rewrite the same values, so every round does the same work."""
    plan = plan_setup(Batch(batch.bs, batch.prefix, batch.extend, batch.window, batch.tokens)).write
    sources = [wl.source_bytes(batch.num_slots, k) for k in range(batch.sources)]
    context = kc.VerifyOrWriteContext.allocate(num_slots=batch.num_slots, ring_capacity=1024,
                                               real_kv_sources=wl.real_kv_sources(sources),
                                               real_kv_hash_mode=wl.hash_mode(batch))
    return WriteSetup(context, plan, wl.write_inputs(batch, batch.prefix, batch.extend), sources)


def write_group(batch: Batch) -> str:
    return f"write · {batch.describe('write')}"


def write_measure(measure, batch: Batch, impl: str, fn, **kwargs) -> None:
    measure(fn, group=write_group(batch), label=LABELS[impl], entries=batch.write_tokens,
            key=f"cpu.write.{impl}.{batch.id}", **kwargs)


@pytest.mark.parametrize("batch", WRITE_BATCHES, ids=ids(WRITE_BATCHES))
def test_write_numpy(measure, batch):
    kwargs = write_setup(batch).launch_kwargs()
    write_measure(measure, batch, "numpy", lambda: kc.launch_canary_write_kernel(**kwargs, backend="numpy"),
                  role="subject")


@pytest.mark.parametrize("batch", WRITE_BATCHES, ids=ids(WRITE_BATCHES))
def test_write_numpy_backend_only(measure, batch):
    launch = prepare_write_launch(**write_setup(batch).launch_kwargs(), expected_input_tokens=None,
                                  expected_input_positions=None)
    backend = resolve_backend("numpy", CPU)
    write_measure(measure, batch, "numpy-backend", lambda: backend.write(launch), role="subject")


@needs_host
@pytest.mark.parametrize("batch", WRITE_BATCHES, ids=ids(WRITE_BATCHES))
def test_write_host(measure, batch):
    kwargs = write_setup(batch).launch_kwargs()
    write_measure(measure, batch, "host", lambda: kc.launch_canary_write_kernel(**kwargs, backend="host"),
                  role="info")


@pytest.mark.parametrize("batch", WRITE_BATCHES, ids=ids(WRITE_BATCHES))
def test_write_array_op_baseline(measure, batch):
    setup = write_setup(batch)
    kc.launch_canary_write_kernel(**setup.launch_kwargs(), backend="numpy")
    fields = np.zeros_like(setup.context.canary_buf).view(np.int64)
    plan, tokens = setup.plan, vars(setup.tokens)

    def run() -> None:
        wl.write_baseline(np, fields, plan.write_offsets, plan.write_seed_slot_indices, tokens, batch.bs,
                          batch.extend, setup.sources)

    run()
    np.testing.assert_array_equal(fields, setup.context.canary_buf.view(np.int64))
    write_measure(measure, batch, "baseline", run, role="baseline")


WRITE_ORACLE_BATCHES = [b for b in WRITE_BATCHES if oracle_fits(b, b.write_tokens)]


@pytest.mark.parametrize("batch", WRITE_ORACLE_BATCHES, ids=ids(WRITE_ORACLE_BATCHES))
def test_write_oracle(measure, batch):
    setup = write_setup(batch)
    state = oracle.CanaryState.from_arrays(setup.context.canary_buf, setup.context.violation_ring)
    plan, tokens = setup.plan, setup.tokens
    sources = oracle_sources(setup.sources)

    def run() -> None:
        oracle.write_oracle(
            state, kernel_kind=setup.context.kernel_kind, write_offsets=plan.write_offsets,
            write_seed_slot_indices=plan.write_seed_slot_indices, write_num_valid_reqs=plan.write_num_valid_reqs,
            input_ids=tokens.input_ids, positions=tokens.positions, out_cache_loc=tokens.out_cache_loc,
            enable_write_input_assert=False, expected_input_tokens=None, expected_input_positions=None,
            sources=sources, mode=int(setup.context.real_kv_hash_mode),
            enable_chain_position_assert=setup.context.enable_chain_position_assert)

    write_measure(measure, batch, "oracle", run, role="oracle", rounds=ORACLE_ROUNDS,
                  warmup=False)
