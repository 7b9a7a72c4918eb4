"""Bind once, launch many (kvcanary_cupy.bind) on CPU: bound launches equal unbound ones across refills, and a
bound call performs no DLPack conversion and no validation.

The engine-like scenario keeps every shape fixed (padding rows, padded token arrays with ``out_cache_loc = -1``)
and refills contents in place between steps, as a serving engine does around a captured CUDA graph.
"""

from __future__ import annotations

import numpy as np
import pytest
from engine_scenario import BS, RTT, STEPS, TOKENS, Engine

import kvcanary_cupy as kc
import kvcanary_cupy._validate
import kvcanary_cupy.bind
import kvcanary_cupy.dlpack
from kvcanary_cupy.backends import unavailable_reason
from kvcanary_cupy.bind import BoundLaunch, bind_plan, bind_scatter, bind_verify, bind_write

torch = pytest.importorskip("torch")

def numpy_engine() -> Engine:
    return Engine(lambda a: np.array(a, copy=True))


def torch_engine() -> Engine:
    return Engine(lambda a: torch.from_numpy(np.array(a, copy=True)))


def run_unbound(engine: Engine, step: int) -> None:
    engine.refill(step)
    kc.launch_canary_plan_kernels(**engine.plan_kwargs())
    kc.launch_canary_verify_kernel(**engine.verify_kwargs())
    kc.launch_canary_write_kernel(**engine.write_kwargs())


def assert_same_state(a: dict, b: dict, step: int) -> None:
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=f"step {step}: {name}")


CPU_BACKENDS = [
    "numpy",
    pytest.param("host", marks=pytest.mark.skipif(unavailable_reason("host") is not None,
                                                  reason=f"host backend: {unavailable_reason('host')}")),
]


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_bound_steps_on_torch_tensors_equal_unbound_steps_on_numpy(backend):
    bound, reference = torch_engine(), numpy_engine()
    on_invalid = None if backend == "numpy" else "flag"
    plan = bind_plan(**bound.plan_kwargs(), backend=backend, on_invalid=on_invalid)
    verify = bind_verify(**bound.verify_kwargs(), backend=backend, on_invalid=on_invalid)
    write = bind_write(**bound.write_kwargs(), backend=backend, on_invalid=on_invalid)
    for step in range(len(STEPS)):
        if step == 3:  # a corrupted token of request 1 must be reported the same way by both
            for engine in (bound, reference):
                np.asarray(engine.ctx.canary_buf).view(np.int64)[RTT[1, 2], 0] = -12345
        bound.refill(step)
        plan()
        verify()
        write()
        run_unbound(reference, step)
        assert_same_state(bound.state(), reference.state(), step)
    report = kc.read_violations(bound.ctx)
    assert sorted((v.slot, v.reason_bits) for v in report.rows) == [
        (int(RTT[1, 2]), int(kc.FailReason.VERIFY_TOKEN_MISMATCH)),
        (int(RTT[1, 3]), int(kc.FailReason.VERIFY_CHAIN_HASH_MISMATCH)),
    ]


def test_bound_steps_on_numpy_arrays_equal_unbound_steps():
    bound, reference = numpy_engine(), numpy_engine()
    launches = [bind_plan(**bound.plan_kwargs()), bind_verify(**bound.verify_kwargs()),
                bind_write(**bound.write_kwargs())]
    for step in range(len(STEPS)):
        bound.refill(step)
        for launch in launches:
            launch()
        run_unbound(reference, step)
        assert_same_state(bound.state(), reference.state(), step)


def test_bound_scatter_equals_unbound_scatter_across_refills():
    flat, offsets, rpi = torch.zeros(6, dtype=torch.int64), torch.zeros(3, dtype=torch.int64), torch.zeros(
        2, dtype=torch.int64)
    pool, status = torch.full((4, 5), -1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    bound = bind_scatter(flat_in=flat, offsets=offsets, req_pool_indices=rpi, pool_out=pool, status=status)
    want = np.full((4, 5), -1, np.int32)
    refills = [([1, 2, 3, 4, 5, 6], [0, 2, 6], [1, 3]), ([9, 8, 7, 6, 5, 4], [0, 6, 6], [2, 1]),
               ([5, 5, 5, 5, 5, 5], [0, 0, 3], [3, 0])]
    for values, offs, rows in refills:
        flat.copy_(torch.tensor(values))
        offsets.copy_(torch.tensor(offs))
        rpi.copy_(torch.tensor(rows))
        bound()
        kc.launch_scatter_req_token_ids(flat_in=np.array(values, np.int64), offsets=np.array(offs, np.int64),
                                        req_pool_indices=np.array(rows, np.int64), pool_out=want)
        np.testing.assert_array_equal(pool.numpy(), want)
    assert int(status) == 0


FORBIDDEN_DURING_A_BOUND_CALL = (
    "kvcanary_cupy.dlpack.as_array", "kvcanary_cupy._validate.as_array", "kvcanary_cupy.context.as_byte_rows",
    "kvcanary_cupy.bind.prepare_plan_launch", "kvcanary_cupy.bind.prepare_verify_launch",
    "kvcanary_cupy.bind.prepare_write_launch", "kvcanary_cupy.bind.resolve_backend",
    "kvcanary_cupy.bind.stream_scope",
)


def test_bound_calls_do_no_conversion_and_no_validation(monkeypatch):
    bound, reference = torch_engine(), numpy_engine()
    launches = [bind_plan(**bound.plan_kwargs()), bind_verify(**bound.verify_kwargs()),
                bind_write(**bound.write_kwargs())]

    def forbidden(*args, **kwargs):
        raise AssertionError("converted or validated during a bound call")

    def forbid() -> None:
        for target in FORBIDDEN_DURING_A_BOUND_CALL:
            monkeypatch.setattr(target, forbidden)

    forbid()
    with pytest.raises(AssertionError, match="converted or validated"):  # the patches do bite unbound calls
        kc.launch_canary_plan_kernels(**bound.plan_kwargs())
    for step in range(len(STEPS)):
        forbid()
        bound.refill(step)
        for launch in launches:
            launch()
        monkeypatch.undo()  # the unbound reference needs the bridge
        run_unbound(reference, step)
        assert_same_state(bound.state(), reference.state(), step)


def test_binding_validates_once_and_writes_nothing_when_it_refuses():
    engine = torch_engine()
    before = engine.state()
    kwargs = engine.plan_kwargs()
    kwargs["prefix_lens"] = kwargs["prefix_lens"].to(torch.int32)
    with pytest.raises(ValueError, match=r"^kv-canary: prefix_lens must have dtype int64, got int32"):
        bind_plan(**kwargs)
    kwargs = engine.plan_kwargs()
    kwargs["req_to_verify_expected_tokens_valid_lens"] = None
    with pytest.raises(ValueError, match=r"^kv-canary: bind_plan requires req_to_verify_expected_tokens_valid_lens"):
        bind_plan(**kwargs)
    with pytest.raises(ValueError, match=r"kv-canary: backend='cuda' needs CUDA arrays"):
        bind_verify(**engine.verify_kwargs(), backend="cuda")
    with pytest.raises(ValueError, match=r"kv-canary: input_ids must be contiguous"):
        bind_write(**{**engine.write_kwargs(), "input_ids": torch.zeros(2 * TOKENS, dtype=torch.int64)[::2]})
    with pytest.raises(ValueError, match=r"kv-canary: offsets must have shape \(3,\)"):
        bind_scatter(flat_in=torch.zeros(2, dtype=torch.int64), offsets=torch.zeros(2, dtype=torch.int64),
                     req_pool_indices=torch.zeros(2, dtype=torch.int64), pool_out=torch.zeros(2, 2, dtype=torch.int32))
    assert_same_state(engine.state(), before, -1)


def test_a_bound_launch_describes_itself():
    engine = torch_engine()
    launch = bind_plan(**engine.plan_kwargs())
    assert isinstance(launch, BoundLaunch)
    assert (launch.step, launch.backend_name, str(launch.device), launch.follows_torch_stream) == (
        "plan", "numpy", "cpu", False)
    assert repr(launch) == "BoundLaunch(plan, backend=numpy, device=cpu, inline)"


def test_a_replaced_tensor_is_not_seen_until_bound_again():
    # Binding fixes the buffers: refill contents in place, never rebind a name to a new tensor.
    engine = torch_engine()
    plan = bind_plan(**engine.plan_kwargs())
    engine.refill(1)
    engine.inputs["prefix_lens"] = torch.zeros(BS, dtype=torch.int64)  # a new tensor, invisible to `plan`
    plan()
    assert int(engine.vp.verify_num_valid) == 5  # prefixes 3 + 2 of the step-1 refill, not zeros
    plan = bind_plan(**engine.plan_kwargs())
    plan()
    assert int(engine.vp.verify_num_valid) == 0


def test_bind_is_importable_from_the_package_module():
    """One set of objects, reached from the package and from its module; a binder reached from the package
    hands back a BoundLaunch; every function a bound call must not reach exists under the name it is
    forbidden by (a rename would silently void the test above)."""
    names = ["BoundLaunch", "bind_plan", "bind_scatter", "bind_verify", "bind_write"]
    assert kvcanary_cupy.bind.__all__ == names
    for name in names:
        assert name in kc.__all__ and getattr(kc, name) is getattr(kvcanary_cupy.bind, name), name
    assert isinstance(kc.bind_plan(**numpy_engine().plan_kwargs()), kc.BoundLaunch)
    modules = {"kvcanary_cupy._validate": kvcanary_cupy._validate, "kvcanary_cupy.dlpack": kvcanary_cupy.dlpack,
               "kvcanary_cupy.bind": kvcanary_cupy.bind, "kvcanary_cupy.context": kc.context}
    for target in FORBIDDEN_DURING_A_BOUND_CALL:
        module, attr = target.rsplit(".", 1)
        assert callable(getattr(modules[module], attr, None)), target


@pytest.mark.skipif(unavailable_reason("host") is not None, reason=f"host backend: {unavailable_reason('host')}")
def test_host_bound_calls_pack_their_kernel_arguments_once(monkeypatch):
    from kvcanary_cupy.backends.kernel_backend import KernelBackend
    from kvcanary_cupy.hostcuda import HostKernel

    bound, reference = numpy_engine(), numpy_engine()
    launches = [bind_plan(**bound.plan_kwargs(), backend="host", on_invalid="flag"),
                bind_verify(**bound.verify_kwargs(), backend="host", on_invalid="flag"),
                bind_write(**bound.write_kwargs(), backend="host", on_invalid="flag")]
    assert all(launch.runner is not None for launch in launches)

    def forbidden(*args, **kwargs):
        raise AssertionError("kernel arguments built or packed during a bound call")

    for step in range(len(STEPS)):
        for target in (HostKernel, KernelBackend):
            for name in ("_marshal", "plan", "verify", "write", "__call__"):
                if hasattr(target, name) and (target, name) != (KernelBackend, "__call__"):
                    monkeypatch.setattr(target, name, forbidden)
        bound.refill(step)
        for launch in launches:
            launch()
        monkeypatch.undo()
        run_unbound(reference, step)
        assert_same_state(bound.state(), reference.state(), step)


@pytest.mark.skipif(unavailable_reason("host") is not None, reason=f"host backend: {unavailable_reason('host')}")
def test_host_bound_verify_wakes_the_pool_only_for_a_call_with_enough_entries(monkeypatch):
    # The grid is sized at bind time by the plan's capacity; the thread count of each call follows the entries
    # the call really verifies: a step that fills a small share of a large plan runs on the calling thread.
    from chain_helpers import context, verify_plan

    from kvcanary_cupy.backends.host import HOST_MIN_WORK_PER_BLOCK
    from kvcanary_cupy.hostcuda import set_host_threads

    capacity = 8 * HOST_MIN_WORK_PER_BLOCK
    ctx = context(num_slots=capacity + 1)
    plan = verify_plan(list(range(1, capacity + 1)), [0] * capacity, [0] * capacity, capacity=capacity)
    set_host_threads(2)
    try:
        launch = bind_verify(context=ctx, plan=plan, check_verify_expected_token=False, backend="host",
                             on_invalid="flag")
        lib = launch.backend._load_module("verify.cu")._lib
        real = lib.kvc_host_abi_launch
        asked: list[int] = []

        def spy(index, grid, block, shared, argv, threads, err, errlen):
            asked.append(threads)
            return real(index, grid, block, shared, argv, threads, err, errlen)

        monkeypatch.setattr(lib, "kvc_host_abi_launch", spy)
        launch = bind_verify(context=ctx, plan=plan, check_verify_expected_token=False, backend="host",
                             on_invalid="flag")
        for entries in (0, 16, 2 * HOST_MIN_WORK_PER_BLOCK - 1, 2 * HOST_MIN_WORK_PER_BLOCK, capacity, -5):
            plan.verify_num_valid[0] = entries
            launch()
        assert asked == [1, 1, 1, 2, 2, 1]
        # every call verified its entries (empty records at position 0: nothing to report), whatever its threads
        assert int(ctx.slot_run_counter[0]) == 16 + 4 * HOST_MIN_WORK_PER_BLOCK - 1 + capacity
        assert int(ctx.violation_write_index[0]) == 0
    finally:
        set_host_threads(None)
