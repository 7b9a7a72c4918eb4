"""Creations add up their buffers before allocating any: above the allocation limit (``max_allocation_bytes=``,
``KVCANARY_MAX_ALLOCATION_BYTES``, else half the physical memory on the CPU) they are refused with the argument
and the byte count, and nothing was allocated. The runtime's computed total is checked against what a creation
really allocates (every buffer recorded as it is made)."""

from __future__ import annotations

import re
import tracemalloc

import numpy as np
import pytest
import runtime_scenario as sc

import kvcanary_cupy as kc
import kvcanary_cupy.context as context_module
import kvcanary_cupy.plan as plan_module
from kvcanary_cupy import CanaryArgumentError
from kvcanary_cupy._limits import HOST_MEMORY_FRACTION, physical_memory_bytes
from kvcanary_cupy.runtime import CanaryConfig, CanaryRuntime, Capacities
from kvcanary_cupy.runtime.footprint import runtime_footprint
from kvcanary_cupy.runtime.space import ArraySpace

LIMIT_ENV = "KVCANARY_MAX_ALLOCATION_BYTES"


@pytest.fixture(autouse=True)
def _no_limit_from_the_environment(monkeypatch):
    monkeypatch.delenv(LIMIT_ENV, raising=False)


@pytest.fixture
def allocations(monkeypatch):
    """Bytes of every buffer the runtime's space and the plan/context constructors allocate, in order."""
    made: list[int] = []
    real_alloc, real_host, real_allocate = ArraySpace.alloc, ArraySpace.host, plan_module._allocate

    def alloc(self, shape, dtype, fill=0, **named):
        made.append(int(np.prod(shape)) * np.dtype(dtype).itemsize)
        return real_alloc(self, shape, dtype, fill, **named)

    def host(self, shape, dtype, **named):
        made.append(int(np.prod(shape)) * np.dtype(dtype).itemsize)
        return real_host(self, shape, dtype, **named)

    def allocate(device, shape, dtype, fill=None, **named):
        made.append(int(np.prod(shape)) * np.dtype(dtype).itemsize)
        return real_allocate(device, shape, dtype, fill, **named)

    monkeypatch.setattr(ArraySpace, "alloc", alloc)
    monkeypatch.setattr(ArraySpace, "host", host)
    monkeypatch.setattr(context_module, "_allocate", allocate)
    monkeypatch.setattr(plan_module, "_allocate", allocate)
    return made


def _refused(call) -> tuple[str, int]:
    """The message of the refusal and the peak bytes Python and NumPy allocated while it was made."""
    tracemalloc.start()
    try:
        with pytest.raises(CanaryArgumentError) as info:
            call()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    message = str(info.value)
    assert message.startswith("kv-canary: ")
    return message, peak


def _needed(message: str) -> int:
    return int(re.search(r" need (\d+) bytes", message)[1])


@pytest.mark.parametrize("engine", [dict(), dict(swa=True), dict(draft=True, with_v=True), dict(paged=True)])
@pytest.mark.parametrize("asserts", [False, True])
def test_the_runtimes_computed_total_is_what_its_creation_allocates(engine, asserts, allocations):
    toy = sc.ToyEngine(**engine)
    config = CanaryConfig(backend="numpy", write_input_assert=asserts, verify_token_assert=asserts,
                          ring_capacity=300)
    caps = Capacities(max_batch_size=7, max_tokens=1000, max_sweep_slots=500 if asserts else None)
    pools = toy.pools()
    CanaryRuntime.create(config, pools, caps, sweep_source=toy.held)
    pool_shape = (sc.ROWS, sc.WIDTH) if asserts else None
    computed = sum(runtime_footprint(config, pools, caps, pool_shape).values())
    made = sum(allocations)
    # left out of the total: only the 1-element words (two device blocks and two host snapshots of them)
    assert 0 <= made - computed <= 4096 * len(pools.groups), (made, computed)


def test_a_runtime_too_large_for_the_limit_is_refused_with_nothing_allocated(allocations):
    toy = sc.ToyEngine(swa=True)
    caps = Capacities(max_batch_size=4, max_tokens=2**31)

    def create():
        CanaryRuntime.create(CanaryConfig(backend="numpy"), toy.pools(), caps, sweep_source=toy.held)

    message, peak = _refused(create)
    assert allocations == [] and peak < 1 << 20
    assert message.startswith("kv-canary: Capacities.max_tokens=2147483648 makes CanaryRuntime.create need ")
    assert _needed(message) >= 2**31 * 8 * 10  # staging, copy_slots and SWA buffers of max_tokens entries each
    memory = physical_memory_bytes()
    if memory is not None:
        assert f"above the allocation limit of {int(memory * HOST_MEMORY_FRACTION)} bytes" in message


def test_the_runtime_names_the_argument_that_asks_for_most(allocations):
    toy = sc.ToyEngine()
    config = CanaryConfig(backend="numpy", ring_capacity=2**24)
    caps = Capacities(max_batch_size=4, max_tokens=16)
    message, _ = _refused(lambda: CanaryRuntime.create(config, toy.pools(), caps, sweep_source=toy.held,
                                                       max_allocation_bytes=2**30))
    assert message.startswith("kv-canary: CanaryConfig.ring_capacity=16777216 makes CanaryRuntime.create need ")
    assert "max_allocation_bytes" in message and allocations == []
    # the same runtime under a limit it fits in is created
    CanaryRuntime.create(CanaryConfig(backend="numpy"), toy.pools(), caps, sweep_source=toy.held,
                         max_allocation_bytes=2**30)
    assert allocations


def test_a_huge_slot_stride_is_refused_before_the_canary_buffer_is_made(allocations):
    message, peak = _refused(lambda: kc.VerifyOrWriteContext.allocate(num_slots=16, slot_stride_bytes=2**31))
    assert allocations == [] and peak < 1 << 20
    assert message.startswith("kv-canary: slot_stride_bytes=2147483648 (x num_slots=16) makes "
                              "VerifyOrWriteContext.allocate need ")
    assert _needed(message) == 16 * 2**31 + 1024 * 64 + 28


@pytest.mark.parametrize(("call", "starts"), [
    (lambda: kc.VerifyPlan.allocate(verify_capacity=2**31 - 1), "verify_capacity=2147483647"),
    (lambda: kc.WritePlan.allocate(write_req_capacity=2**40), "write_req_capacity=1099511627776"),
    (lambda: kc.VerifyOrWriteContext.allocate(num_slots=2**36), "num_slots=68719476736 (x slot_stride_bytes=32)"),
    (lambda: kc.VerifyOrWriteContext.allocate(num_slots=1, ring_capacity=2**32), "ring_capacity=4294967296"),
])
def test_plans_and_contexts_beyond_the_limit_are_refused(call, starts, allocations):
    if physical_memory_bytes() is None:
        pytest.skip("this OS does not report its physical memory: no default limit")
    message, _ = _refused(call)
    assert message.startswith(f"kv-canary: {starts} makes ") and allocations == []


def test_the_environment_variable_and_the_argument_set_the_limit(monkeypatch, allocations):
    needed = 1000 * 32 + 1024 * 64 + 28
    monkeypatch.setenv(LIMIT_ENV, str(needed - 1))
    message, _ = _refused(lambda: kc.VerifyOrWriteContext.allocate(num_slots=1000))
    assert f"need {needed} bytes" in message and f"limit of {needed - 1} bytes" in message and LIMIT_ENV in message
    assert allocations == []
    kc.VerifyOrWriteContext.allocate(num_slots=1000, max_allocation_bytes=needed)  # the argument wins
    assert sum(allocations) == needed  # and the computed total is what was allocated
    monkeypatch.setenv(LIMIT_ENV, str(needed))
    kc.VerifyOrWriteContext.allocate(num_slots=1000)
    monkeypatch.setenv(LIMIT_ENV, "lots")
    message, _ = _refused(lambda: kc.VerifyOrWriteContext.allocate(num_slots=1))
    assert message.startswith(f"kv-canary: {LIMIT_ENV} must be a positive integer")
    message, _ = _refused(lambda: kc.VerifyPlan.allocate(verify_capacity=4, max_allocation_bytes=-1))
    assert message.startswith("kv-canary: max_allocation_bytes must be a positive int")


def test_the_plans_computed_totals_are_what_they_allocate(allocations):
    kc.VerifyPlan.allocate(verify_capacity=123)
    assert sum(allocations) == kc.VerifyPlan.allocation_bytes(123)
    allocations.clear()
    kc.WritePlan.allocate(write_req_capacity=45)
    assert sum(allocations) == kc.WritePlan.allocation_bytes(45)


def test_the_torch_constructors_refuse_before_allocating(monkeypatch):
    torch = pytest.importorskip("torch")
    from kvcanary_cupy.compat import sglang

    monkeypatch.setenv(LIMIT_ENV, str(2**20))
    made = []
    monkeypatch.setattr(torch, "zeros", lambda *a, **k: made.append(a))
    monkeypatch.setattr(torch, "empty", lambda *a, **k: made.append(a))
    message, _ = _refused(lambda: sglang.VerifyOrWriteContext.allocate(num_slots=16, slot_stride_bytes=2**31))
    assert message.startswith("kv-canary: slot_stride_bytes=2147483648 (x num_slots=16) makes ")
    message, _ = _refused(lambda: sglang.VerifyPlan.allocate(verify_capacity=2**20))
    assert message.startswith("kv-canary: verify_capacity=1048576 makes ")
    message, _ = _refused(lambda: sglang.WritePlan.allocate(write_req_capacity=2**20))
    assert message.startswith("kv-canary: write_req_capacity=1048576 makes ")
    assert made == []


@pytest.mark.parametrize("which", ["verify", "write"])
def test_a_plan_array_the_allocator_cannot_make_is_refused_naming_the_capacity_that_sized_it(monkeypatch, which):
    """The allocator itself fails at each of a plan's arrays in turn (the limit let the plan through): the refusal
    names the capacity argument for every array it sized (the scratch offsets too), and the requested size for
    the one-element words. Expected names and sizes worked out by hand from the plan's fields."""
    capacity = 5
    if which == "verify":
        want = [("verify_capacity", 40, "5 x int64")] * 4 + [("the requested size", 4, "1 x int32")] * 3
    else:
        want = [("write_req_capacity", 48, "6 x int64"), ("write_req_capacity", 40, "5 x int64"),
                ("the requested size", 4, "1 x int32"), ("write_req_capacity", 48, "6 x int64")]
    calls: list[int] = []
    fail_at = [-1]

    def failing(real):
        def allocate(shape, *args):
            calls.append(1)
            if len(calls) - 1 == fail_at[0]:
                raise MemoryError("faked")
            return real(shape, *args)
        return allocate

    class FailingNumpy:
        empty, full = staticmethod(failing(np.empty)), staticmethod(failing(np.full))

        def __getattr__(self, name):
            return getattr(np, name)

    monkeypatch.setattr(plan_module, "np", FailingNumpy())
    if which == "verify":
        kc.VerifyPlan.allocate(verify_capacity=capacity)
    else:
        kc.WritePlan.allocate(write_req_capacity=capacity)
    assert len(calls) == len(want)  # every array of the plan is one allocation
    for k, (name, nbytes, shape) in enumerate(want):
        calls.clear()
        fail_at[0] = k
        with pytest.raises(CanaryArgumentError) as info:
            if which == "verify":
                kc.VerifyPlan.allocate(verify_capacity=capacity)
            else:
                kc.WritePlan.allocate(write_req_capacity=capacity)
        assert len(calls) == k + 1
        assert str(info.value) == (f"kv-canary: {name} asks for {nbytes} bytes ({shape}), which cannot be allocated "
                                   "on device='cpu' (MemoryError: faked)")


@pytest.mark.parametrize(("call", "argument", "what", "needed"), [
    (lambda: kc.VerifyOrWriteContext.allocate(num_slots=100, ring_capacity=16, device="cuda:1"),
     "num_slots=100 (x slot_stride_bytes=32)", "VerifyOrWriteContext.allocate", 100 * 32 + 16 * 64 + 28),
    (lambda: kc.VerifyPlan.allocate(verify_capacity=100, device="cuda:1"), "verify_capacity=100",
     "VerifyPlan.allocate", 4 * 8 * 100 + 3 * 4),
    (lambda: kc.WritePlan.allocate(write_req_capacity=100, device="cuda:1"), "write_req_capacity=100",
     "WritePlan.allocate", 2 * 8 * 101 + 8 * 100 + 4),
], ids=["context", "verify-plan", "write-plan"])
def test_a_creation_on_a_gpu_is_held_to_that_gpus_memory(monkeypatch, allocations, call, argument, what, needed):
    """The default limit of a CUDA creation is the memory of the device it names (faked here: 2,000 bytes for
    whichever index is asked), checked before CuPy is needed and before anything is allocated."""
    import kvcanary_cupy._limits as limits

    asked: list[int] = []
    monkeypatch.setattr(limits, "_device_memory_bytes", lambda index: asked.append(index) or 2000)
    message, _ = _refused(call)
    assert message == (f"kv-canary: {argument} makes {what} need {needed} bytes (0.0 GiB), above the allocation "
                       f"limit of 2000 bytes (0.0 GiB, the memory of cuda:1); raise it with max_allocation_bytes= or "
                       f"{LIMIT_ENV}")
    assert asked == [1] and allocations == []
