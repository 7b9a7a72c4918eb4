"""Hostile use of the launchers (SPEC §0.8, §0.9): overlapping buffers, misaligned arrays, torch storage moved
under a wrapper, offsets that would amplify the reference's memory, in-launch aliasing, concurrent threads.

Every refusal is a ``kv-canary: `` ValueError with every buffer unchanged byte for byte, on the NumPy
reference and on the host backend (the CUDA kernels on the CPU); the last test reruns the memory-safety part
of this file with the host backend under AddressSanitizer + UBSan in a child process.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import threading
import tracemalloc
from pathlib import Path

import numpy as np
import oracle
import pytest
from chain_helpers import context, verify_plan, write_plan
from hypothesis import given, settings
from hypothesis import strategies as st
from plan_helpers import fresh_plans, linear_rtt

import kvcanary_cupy as kc
from kvcanary_cupy._validate import GuardSet, StorageGuard, storage_guards
from kvcanary_cupy.backends import unavailable_reason
from kvcanary_cupy.bind import bind_plan, bind_verify, bind_write

HOST = unavailable_reason("host")
CPU_BACKENDS = ["numpy", pytest.param("host", marks=pytest.mark.skipif(HOST is not None, reason=f"host: {HOST}"))]


def rejects(fragment: str):
    return pytest.raises(kc.CanaryArgumentError, match=r"^kv-canary: .*" + fragment)


def arrays_of(*objects) -> list[np.ndarray]:
    """Every NumPy array among the objects and their dataclass fields."""
    out = []
    for obj in objects:
        if dataclasses.is_dataclass(obj):
            out += arrays_of(*(getattr(obj, f.name) for f in dataclasses.fields(obj)))
        elif isinstance(obj, (tuple, list)):
            out += arrays_of(*obj)
        elif isinstance(obj, np.ndarray):
            out.append(obj)
    return out


class Unchanged:
    """``with Unchanged(a, b, ...):`` asserts that every byte of every array in a, b, ... is as before."""

    def __init__(self, *objects) -> None:
        self.arrays = arrays_of(*objects)

    def __enter__(self) -> Unchanged:
        self.before = [a.tobytes() for a in self.arrays]
        return self

    def __exit__(self, *exc) -> None:
        assert [a.tobytes() for a in self.arrays] == self.before, "a refused call changed a buffer"


def misaligned(values, dtype, offset: int = 1) -> np.ndarray:
    """``values`` as ``dtype`` starting ``offset`` bytes past an aligned address (a legal NumPy view)."""
    values = np.asarray(values, dtype)
    raw = np.zeros(values.nbytes + 64, np.uint8)
    start = (-raw.ctypes.data) % 64 + offset
    out = raw[start:start + values.nbytes].view(dtype).reshape(values.shape)
    out[...] = values
    assert out.ctypes.data % np.dtype(dtype).itemsize != 0
    return out


def plan_kwargs(**changes):
    kwargs = {"req_pool_indices": np.array([1, 2], np.int64), "prefix_lens": np.array([3, 2], np.int64),
              "extend_seq_lens": np.array([1, 1], np.int64), "req_to_token": linear_rtt(4, 8),
              "swa_window_size": 0, "full_to_swa_index_mapping": None, "verify_capacity": 16}
    kwargs.update(changes)
    return kwargs


def launch_plan(vp, wp, backend, **changes):
    kc.launch_canary_plan_kernels(verify_plan_out=vp, write_plan_out=wp, backend=backend, **plan_kwargs(**changes))


def write_args(**changes):
    args = {"input_ids": np.array([5, 6, 7], np.int64), "positions": np.array([0, 1, 2], np.int64),
            "out_cache_loc": np.array([3, 4, 5], np.int64), "enable_write_input_assert": False}
    args.update(changes)
    return args


# ---- 1. overlapping buffers --------------------------------------------------------------------------------

def _shared_plans(share: str):
    """Plans in which two outputs share memory, as the review's case (and siblings) had them."""
    vp, wp = fresh_plans(16, 4)
    words = np.zeros(64, np.int64)
    if share == "verify_offsets=verify_slot_indices":  # the review's case: negative positions, heap reads
        vp = dataclasses.replace(vp, verify_slot_indices=words[:16])
        wp = dataclasses.replace(wp, verify_offsets=words[:5])
    elif share == "write_offsets=verify_offsets+1":  # a partial overlap, one element apart
        wp = dataclasses.replace(wp, write_offsets=words[:5], verify_offsets=words[1:6])
    elif share == "status=verify_num_valid":
        one = np.zeros(1, np.int32)
        vp = dataclasses.replace(vp, status=one, verify_num_valid=one)
    elif share == "prev_slots=expected_tokens":
        vp = dataclasses.replace(vp, verify_prev_slot_indices=words[:16], verify_expected_tokens=words[:16])
    return vp, wp


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("share", ["verify_offsets=verify_slot_indices", "write_offsets=verify_offsets+1",
                                   "status=verify_num_valid", "prev_slots=expected_tokens"])
def test_plan_refuses_outputs_that_share_memory(backend, share):
    vp, wp = _shared_plans(share)
    with Unchanged(vp, wp), rejects("overlaps .*another output"):
        launch_plan(vp, wp, backend)
    with Unchanged(vp, wp), rejects("overlaps .*another output"):
        bind_plan(verify_plan_out=vp, write_plan_out=wp, backend=backend, **plan_kwargs())


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_plan_refuses_an_output_over_an_input(backend):
    words = np.zeros(64, np.int64)
    rtt = words.view(np.int32).reshape(4, 32)  # req_to_token shares bytes with the verify entries
    rtt[:] = linear_rtt(4, 32)
    vp, wp = fresh_plans(16, 4)
    vp = dataclasses.replace(vp, verify_slot_indices=words[8:24])
    with Unchanged(vp, wp, rtt), rejects("verify_plan_out.verify_slot_indices overlaps req_to_token"):
        launch_plan(vp, wp, backend, req_to_token=rtt)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_inputs_may_share_memory(backend):
    """Only writes race: one array passed as two read-only inputs is fine (and gives the same plan)."""
    same = np.array([2, 2], np.int64)
    vp, wp = fresh_plans(16, 4)
    launch_plan(vp, wp, backend, prefix_lens=same, extend_seq_lens=same)
    assert int(vp.verify_num_valid[0]) == 4 and wp.write_offsets[:3].tolist() == [0, 2, 4]


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_verify_refuses_a_ring_over_the_canary_buffer(backend):
    raw = np.zeros(64 * 32 + 16 * 64, np.uint8)
    ctx = dataclasses.replace(context(num_slots=64), canary_buf=raw[:64 * 32].reshape(64, 32),
                              violation_ring=raw[32 * 32:32 * 32 + 16 * 64].view(np.int64).reshape(16, 8))
    vp = verify_plan([1, 2], [0, 1], [-1, 1])
    with Unchanged(ctx, vp), rejects("violation_ring overlaps context.canary_buf"):
        kc.launch_canary_verify_kernel(context=ctx, plan=vp, check_verify_expected_token=False, backend=backend)
    with Unchanged(ctx, vp), rejects("violation_ring overlaps context.canary_buf"):
        bind_verify(context=ctx, plan=vp, check_verify_expected_token=False, backend=backend)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("alias", ["status=write_index", "slot_counter=kernel_counter", "ring=plan_slots"])
def test_verify_refuses_context_outputs_that_share_memory(backend, alias):
    ctx = context()
    vp = verify_plan([1, 2], [0, 1], [-1, 1])
    if alias == "status=write_index":
        ctx = dataclasses.replace(ctx, status=ctx.violation_write_index)
    elif alias == "slot_counter=kernel_counter":
        ctx = dataclasses.replace(ctx, slot_run_counter=ctx.kernel_run_counter)
    else:
        vp = dataclasses.replace(vp, verify_slot_indices=ctx.violation_ring.reshape(-1)[:2])
    with Unchanged(ctx, vp), rejects("overlaps"):
        kc.launch_canary_verify_kernel(context=ctx, plan=vp, check_verify_expected_token=False, backend=backend)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_write_refuses_token_arrays_inside_the_canary_buffer(backend):
    ctx = context(num_slots=64)
    ids = ctx.canary_buf.reshape(-1)[64:88].view(np.int64)  # the canary is written: a reader would race
    wp = write_plan([3], [-1])
    with Unchanged(ctx, wp), rejects("context.canary_buf overlaps input_ids"):
        kc.launch_canary_write_kernel(context=ctx, plan=wp, backend=backend, **write_args(input_ids=ids))
    with Unchanged(ctx, wp), rejects("context.canary_buf overlaps input_ids"):
        bind_write(context=ctx, plan=wp, backend=backend, **write_args(input_ids=ids))


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_write_refuses_a_real_kv_source_inside_the_canary_buffer(backend):
    ctx = context(num_slots=64)
    source = kc.RealKvSource(ctx.canary_buf[:, :16], page_size=1, num_bytes_per_token=16, read_bytes=16)
    ctx = ctx.for_endpoint(real_kv_sources=(source,), real_kv_hash_mode=kc.RealKvHashMode.ALL)
    wp = write_plan([3], [-1])
    with Unchanged(ctx, wp), rejects("overlaps"):
        kc.launch_canary_write_kernel(context=ctx, plan=wp, backend=backend, **write_args())
    # A verify only reads both: the same source is fine there.
    vp = verify_plan([1], [0], [0])
    kc.launch_canary_verify_kernel(context=ctx, plan=vp, check_verify_expected_token=False, backend=backend)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_scatter_refuses_a_pool_over_its_input(backend):
    words = np.zeros(32, np.int64)
    pool = words.view(np.int32).reshape(4, 16)
    flat = words[:8]
    with Unchanged(words), rejects("pool_out overlaps flat_in"):
        kc.launch_scatter_req_token_ids(flat_in=flat, offsets=np.array([0, 8], np.int64),
                                        req_pool_indices=np.array([1], np.int64), pool_out=pool, backend=backend)


# ---- 3. alignment ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("name", ["req_pool_indices", "prefix_lens", "req_to_token"])
def test_plan_refuses_misaligned_inputs(backend, name):
    kwargs = plan_kwargs()
    kwargs[name] = misaligned(kwargs[name], kwargs[name].dtype, offset=2)
    vp, wp = fresh_plans(16, 4)
    with Unchanged(vp, wp), rejects(f"{name} is not aligned to its"):
        kc.launch_canary_plan_kernels(verify_plan_out=vp, write_plan_out=wp, backend=backend, **kwargs)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("field", ["verify_slot_indices", "verify_num_valid", "status"])
def test_plan_refuses_misaligned_outputs(backend, field):
    vp, wp = fresh_plans(16, 4)
    vp = dataclasses.replace(vp, **{field: misaligned(getattr(vp, field), getattr(vp, field).dtype)})
    with Unchanged(vp, wp), rejects(f"verify_plan_out.{field} is not aligned"):
        launch_plan(vp, wp, backend)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("name", ["out_cache_loc", "plan.write_seed_slot_indices", "context.violation_write_index",
                                  "context.slot_run_counter", "context.enable_chain_position_assert"])
def test_write_refuses_misaligned_arrays(backend, name):
    ctx, wp, args = context(), write_plan([3], [-1]), write_args()
    if name == "out_cache_loc":
        args["out_cache_loc"] = misaligned(args["out_cache_loc"], np.int64, offset=4)
    elif name.startswith("plan."):
        field = name.removeprefix("plan.")
        wp = dataclasses.replace(wp, **{field: misaligned(getattr(wp, field), np.int64)})
    else:
        field = name.removeprefix("context.")
        ctx = dataclasses.replace(ctx, **{field: misaligned(getattr(ctx, field), getattr(ctx, field).dtype)})
    with Unchanged(ctx, wp, args), rejects(f"{name} is not aligned"):
        kc.launch_canary_write_kernel(context=ctx, plan=wp, backend=backend, **args)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_verify_and_scatter_refuse_misaligned_arrays(backend):
    ctx = context()
    vp = verify_plan([1, 2], [0, 1], [-1, 1])
    bad = dataclasses.replace(vp, verify_prev_slot_indices=misaligned(vp.verify_prev_slot_indices, np.int64))
    with Unchanged(ctx, bad), rejects("plan.verify_prev_slot_indices is not aligned"):
        kc.launch_canary_verify_kernel(context=ctx, plan=bad, check_verify_expected_token=False, backend=backend)
    ring = misaligned(ctx.violation_ring, np.int64, offset=4)
    bad_ctx = dataclasses.replace(ctx, violation_ring=ring)
    with Unchanged(bad_ctx, vp), rejects("context.violation_ring is not aligned"):
        kc.launch_canary_verify_kernel(context=bad_ctx, plan=vp, check_verify_expected_token=False, backend=backend)
    pool = misaligned(np.zeros((4, 8), np.int32), np.int32, offset=2)
    with Unchanged(pool), rejects("pool_out is not aligned"):
        kc.launch_scatter_req_token_ids(flat_in=np.arange(4, dtype=np.int64), offsets=np.array([0, 4], np.int64),
                                        req_pool_indices=np.array([1], np.int64), pool_out=pool, backend=backend)


# ---- 2. torch storage moved under a wrapper ----------------------------------------------------------------

try:
    import torch
except ImportError:  # torch is an optional dependency
    torch = None
needs_torch = pytest.mark.skipif(torch is None, reason="torch is not installed")


@needs_torch
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_a_real_kv_source_whose_tensor_grew_with_resize_is_refused(backend):
    pool = torch.zeros(64, 32, dtype=torch.uint8)
    source = kc.RealKvSource(pool, page_size=1, num_bytes_per_token=32, read_bytes=32)
    ctx = context(num_slots=64, real_kv_sources=(source,), real_kv_hash_mode=kc.RealKvHashMode.ALL)
    vp = verify_plan([1, 2], [0, 1], [-1, 1])
    kc.launch_canary_verify_kernel(context=ctx, plan=vp, check_verify_expected_token=False, backend=backend)
    pool.resize_(4096, 32)  # the engine grows its pool: the storage is reallocated, the old bytes freed
    with Unchanged(ctx, vp), rejects("RealKvSource.tensor: the torch tensor's storage moved or shrank"):
        kc.launch_canary_verify_kernel(context=ctx, plan=vp, check_verify_expected_token=False, backend=backend)
    with Unchanged(ctx), rejects("storage moved or shrank"):
        kc.launch_canary_write_kernel(context=ctx, plan=write_plan([3], [-1]), backend=backend, **write_args())
    # A new source over the grown tensor is fine.
    fresh = ctx.for_endpoint(real_kv_sources=(kc.RealKvSource(pool, page_size=1, num_bytes_per_token=32,
                                                              read_bytes=32),))
    kc.launch_canary_verify_kernel(context=fresh, plan=vp, check_verify_expected_token=False, backend=backend)


@needs_torch
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_a_bound_launch_refuses_tensors_whose_storage_moved_or_shrank(backend):
    ctx = context(num_slots=64)
    ids = torch.tensor([5, 6, 7])
    bound = bind_write(context=ctx, plan=write_plan([3], [-1]), backend=backend,
                       **write_args(input_ids=ids))
    ids.copy_(torch.tensor([8, 9, 10]))  # refilling in place is what a bound launch is for
    bound()
    assert ctx.canary_buf.view(np.int64)[3:6, 0].tolist() == [8, 9, 10]
    ids.resize_(1 << 16)
    with Unchanged(ctx), rejects("input_ids: the torch tensor's storage moved or shrank"):
        bound()

    canary = torch.zeros(64, 32, dtype=torch.uint8)
    ctx = dataclasses.replace(context(num_slots=64), canary_buf=canary)
    verify = bind_verify(context=ctx, plan=verify_plan([1], [0], [0]), check_verify_expected_token=False,
                         backend=backend)
    verify()
    canary.untyped_storage().resize_(0)  # freed in place: the bound view would read freed memory
    with rejects("context.canary_buf: the torch tensor's storage moved or shrank"):
        verify()


@needs_torch
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_a_bound_plan_keeps_working_after_a_shrinking_resize_that_keeps_the_storage(backend):
    """resize_ to fewer elements keeps torch's storage: the bound memory stays valid and is still used."""
    rpi = torch.tensor([1, 2])
    vp, wp = fresh_plans(16, 4)
    bound = bind_plan(verify_plan_out=vp, write_plan_out=wp, backend=backend, **plan_kwargs(req_pool_indices=rpi))
    rpi.resize_(1)
    bound()
    assert int(vp.verify_num_valid[0]) == 5


@needs_torch
def test_one_check_of_views_sharing_a_storage_refuses_a_moved_view_or_a_freed_storage_by_the_views_name():
    """A runtime phase checks its launches' storage guards as one GuardSet: the KV cache's views pass while
    untouched, a view moved with set_ is refused by its own name, and a storage freed under them by the first
    view's name."""
    cache = torch.zeros(8, 64, dtype=torch.uint8)
    k, v = cache[:, :32], cache[:, 32:]
    checks = GuardSet(storage_guards([("k", k), ("v", v)]))
    checks.check()
    v.set_(torch.zeros(8, 32, dtype=torch.uint8))  # v now addresses other memory; k is as it was
    with rejects("v: the torch tensor's storage moved or shrank"):
        checks.check()
    k2, v2 = cache[:, :32], cache[:, 32:]
    checks = GuardSet(storage_guards([("k2", k2), ("v2", v2)]))
    checks.check()
    cache.untyped_storage().resize_(0)  # freed in place under both views
    with rejects("k2: the torch tensor's storage moved or shrank"):
        checks.check()


def test_a_storage_shared_by_several_guards_has_its_size_read_once_against_the_most_any_of_them_needs():
    class Storage:
        def __init__(self, nbytes: int) -> None:
            self.size, self.reads = nbytes, 0

        def nbytes(self) -> int:
            self.reads += 1
            return self.size

    class Tensor:
        def __init__(self, pointer: int) -> None:
            self.pointer = pointer

        def data_ptr(self) -> int:
            return self.pointer

    shared, other = Storage(100), Storage(50)
    guards = [StorageGuard("a", Tensor(1), 1, 40, shared), StorageGuard("b", Tensor(2), 2, 100, shared),
              StorageGuard("c", Tensor(3), 3, 50, other)]
    checks = GuardSet(guards)
    checks.check()
    assert (shared.reads, other.reads) == (1, 1)
    shared.size = 99  # enough for a, not for b: b is named
    with rejects("b: the torch tensor's storage moved or shrank"):
        checks.check()


# ---- 4. memory of the reference under overlapping ranges ---------------------------------------------------

def _peak_bytes(run) -> int:
    tracemalloc.start()
    try:
        run()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def _overlapping_writes(requests: int, tokens: int):
    """offsets [0, T, 0, T, ...]: ``requests`` requests each claiming all ``tokens`` tokens."""
    ctx = context(num_slots=tokens + 8, ring_capacity=64)
    wp = kc.WritePlan.allocate(write_req_capacity=requests)
    wp.write_offsets[:] = np.where(np.arange(requests + 1) % 2 == 0, 0, tokens)
    wp.write_seed_slot_indices[:] = -1
    wp.write_num_valid_reqs[0] = requests
    args = write_args(input_ids=np.arange(tokens, dtype=np.int64), positions=np.arange(tokens, dtype=np.int64),
                      out_cache_loc=np.arange(1, tokens + 1, dtype=np.int64))
    return ctx, wp, args


@pytest.mark.parametrize("backend", ["numpy", pytest.param("host", marks=pytest.mark.skipif(HOST is not None,
                                                                                           reason=str(HOST)))])
def test_overlapping_write_offsets_are_flagged_and_written_once(backend):
    """50,001 offsets (0.4 MB) describing 25,000 x 4,000 = 10^8 token writes: the first request writes its 4,000
    tokens; the second runs backwards, so it and every later one are skipped, with the status bit; the memory
    stays that of the buffers (the work is that of the 4,000 tokens)."""
    requests, tokens = 50_000, 4000
    ctx, wp, args = _overlapping_writes(requests, tokens)
    on_invalid = "flag" if backend == "numpy" else None
    peak = _peak_bytes(lambda: kc.launch_canary_write_kernel(context=ctx, plan=wp, backend=backend,
                                                             on_invalid=on_invalid, **args))
    assert peak < 8 << 20, f"peak {peak / 2**20:.1f} MiB"
    assert int(ctx.status[0]) == int(kc.CanaryStatus.WRITE_OFFSETS_OUT_OF_ORDER)
    assert int(ctx.slot_run_counter[0]) == tokens and int(ctx.kernel_run_counter[0]) == 1
    # The first request's chain from the anchor: slot 1 + k holds token k at position k.
    f = ctx.canary_buf.view(np.int64)
    assert f[1:tokens + 1, 0].tolist() == list(range(tokens)) and f[1:tokens + 1, 1].tolist() == list(range(tokens))
    assert not f[tokens + 1:].any() and not f[0].any()


@pytest.mark.parametrize(("offsets", "message"), [
    ([0, 3, 1, 4], r"plan.write_offsets\[1:3\]=\(3, 1\) runs backwards"),
    ([0, 3, 3, 1, 4], r"plan.write_offsets\[2:4\]=\(3, 1\) runs backwards"),
    ([2, 4, 0, 0, 1], r"plan.write_offsets\[1:3\]=\(4, 0\) runs backwards"),
])
def test_write_offsets_out_of_order_are_refused_in_raise_mode_with_nothing_written(offsets, message):
    ctx = context(num_slots=16, ring_capacity=8)
    wp = kc.WritePlan.from_tensors(write_offsets=np.array(offsets, np.int64),
                                   write_seed_slot_indices=np.full(len(offsets) - 1, -1, np.int64),
                                   write_num_valid_reqs=np.array([len(offsets) - 1], np.int32))
    args = write_args(input_ids=np.arange(4, dtype=np.int64), positions=np.arange(4, dtype=np.int64),
                      out_cache_loc=np.arange(1, 5, dtype=np.int64))
    with Unchanged(ctx, wp), rejects(message):
        kc.launch_canary_write_kernel(context=ctx, plan=wp, **args)


def test_the_requests_from_the_first_backward_step_on_are_skipped():
    """[0, 3, 3, 1, 4]: request 2 runs backwards, request 3 = [1, 4) would overlap request 0 = [0, 3)."""
    ctx = context(num_slots=16, ring_capacity=8)
    wp = kc.WritePlan.from_tensors(write_offsets=np.array([0, 3, 3, 1, 4], np.int64),
                                   write_seed_slot_indices=np.full(4, -1, np.int64),
                                   write_num_valid_reqs=np.array([4], np.int32))
    ids = np.array([10, 11, 12, 13], np.int64)
    kc.launch_canary_write_kernel(context=ctx, plan=wp, on_invalid="flag", **write_args(
        input_ids=ids, positions=np.arange(4, dtype=np.int64), out_cache_loc=np.arange(1, 5, dtype=np.int64)))
    f = ctx.canary_buf.view(np.int64)
    assert f[1:5, 0].tolist() == [10, 11, 12, 0]  # request 0 only; request 3 = [1, 4) overlapped it
    assert int(ctx.slot_run_counter[0]) == 3
    assert int(ctx.status[0]) == int(kc.CanaryStatus.WRITE_OFFSETS_OUT_OF_ORDER)


def test_scatter_reference_memory_stays_bounded_with_repeated_segments():
    """20,000 requests rewriting the same 4,096-token segment into one row: 82M element copies before."""
    requests, width = 20_000, 4096
    pool = np.full((4, width), -1, np.int32)
    flat = np.arange(width, dtype=np.int64) + 7
    offsets = np.where(np.arange(requests + 1) % 2 == 0, 0, width).astype(np.int64)
    rpi = np.ones(requests, np.int64)
    peak = _peak_bytes(lambda: kc.launch_scatter_req_token_ids(flat_in=flat, offsets=offsets,
                                                               req_pool_indices=rpi, pool_out=pool))
    assert peak < 8 << 20, f"peak {peak / 2**20:.1f} MiB"
    assert pool[1].tolist() == list(range(7, width + 7)) and (pool[[0, 2, 3]] == -1).all()


@settings(max_examples=150)
@given(st.data())
def test_scatter_with_shared_rows_and_repeated_segments_matches_the_oracle(data):
    rows, width = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 6))
    total = data.draw(st.integers(0, 10))
    bs = data.draw(st.integers(0, 8))
    flat = np.array(data.draw(st.lists(st.integers(-(1 << 40), 1 << 40), min_size=total, max_size=total)), np.int64)
    offsets = np.array(data.draw(st.lists(st.integers(0, total), min_size=bs + 1, max_size=bs + 1)), np.int64)
    rpi = np.array(data.draw(st.lists(st.integers(0, rows - 1), min_size=bs, max_size=bs)), np.int64)
    pool = np.array(data.draw(st.lists(st.integers(-9, 9), min_size=rows * width, max_size=rows * width)),
                    np.int32).reshape(rows, width)
    want = pool.copy()
    oracle.scatter_oracle(flat_in=flat, offsets=offsets, req_pool_indices=rpi, pool_out=want)
    for backend in ["numpy"] + ([] if HOST else ["host"]):
        got = pool.copy()
        kc.launch_scatter_req_token_ids(flat_in=flat, offsets=offsets, req_pool_indices=rpi, pool_out=got,
                                        backend=backend)
        np.testing.assert_array_equal(got, want, err_msg=backend)


# ---- 6. in-launch aliasing: the reference processes requests in batch order --------------------------------

@st.composite
def aliased_writes(draw, *, for_host: bool = False):
    """A write launch on a small canary buffer where requests seed from slots that earlier requests of the
    same launch write (a double allocation), and write slots repeat across requests. ``for_host``: at most 8
    requests (the host backend then runs one block per request, in batch order) and no request writing its
    own seed or one slot twice (the kernel's parallel stores have no order within a request); otherwise
    token ranges may also overlap and repeat (offsets need not be monotone)."""
    num_slots = draw(st.integers(4, 12))
    reqs = draw(st.integers(1, 8 if for_host else 10))
    tokens = draw(st.integers(1, 12))
    if for_host:
        cuts = sorted(draw(st.lists(st.integers(0, tokens), min_size=reqs - 1, max_size=reqs - 1)))
        offsets = [0, *cuts, tokens]
    else:
        offsets = draw(st.lists(st.integers(0, tokens), min_size=reqs + 1, max_size=reqs + 1))
    slot = st.integers(-1, num_slots - 1)
    locs = draw(st.lists(slot, min_size=tokens, max_size=tokens))
    seeds = draw(st.lists(st.integers(-1, num_slots - 1), min_size=reqs, max_size=reqs))
    if for_host:
        for r in range(reqs):
            own = [locs[i] for i in range(offsets[r], offsets[r + 1]) if locs[i] >= 0]
            if len(set(own)) != len(own) or seeds[r] in own:
                return draw(aliased_writes(for_host=True))
    ids = draw(st.lists(st.integers(0, 1 << 20), min_size=tokens, max_size=tokens))
    positions = draw(st.lists(st.integers(0, 40), min_size=tokens, max_size=tokens))
    chain_assert = draw(st.booleans())
    canary = np.random.default_rng(draw(st.integers(0, 1 << 30))).integers(0, 256, (num_slots, 32), np.uint8)
    return (np.array(offsets, np.int64), np.array(seeds, np.int64), np.array(ids, np.int64),
            np.array(positions, np.int64), np.array(locs, np.int64), chain_assert, canary)


def _run_aliased(case, backend):
    offsets, seeds, ids, positions, locs, chain_assert, canary = case
    ctx = context(num_slots=canary.shape[0], ring_capacity=64, enable_chain_position_assert=chain_assert)
    ctx.canary_buf[...] = canary
    wp = kc.WritePlan.from_tensors(write_offsets=offsets.copy(), write_seed_slot_indices=seeds.copy(),
                                   write_num_valid_reqs=np.array([seeds.shape[0]], np.int32))
    kc.launch_canary_write_kernel(context=ctx, plan=wp, input_ids=ids, positions=positions, out_cache_loc=locs,
                                  enable_write_input_assert=False, backend=backend,
                                  on_invalid="flag" if backend == "numpy" else None)
    return ctx


def _oracle_aliased(case):
    offsets, seeds, ids, positions, locs, chain_assert, canary = case
    state = oracle.CanaryState.from_arrays(canary, np.zeros((64, 8), np.int64))
    oracle.write_oracle(state, kernel_kind=int(kc.CanaryLaunchTag.HEAD_K_FULL), write_offsets=offsets,
                        write_seed_slot_indices=seeds, write_num_valid_reqs=seeds.shape[0], input_ids=ids,
                        positions=positions, out_cache_loc=locs, enable_write_input_assert=False,
                        expected_input_tokens=None, expected_input_positions=None, sources=[], mode=0,
                        enable_chain_position_assert=int(chain_assert))
    return state


def _same_as_oracle(ctx, state, *, ordered_rows: bool):
    np.testing.assert_array_equal(ctx.canary_buf, state.to_canary_array())
    assert int(ctx.violation_write_index[0]) == state.write_index
    assert int(ctx.slot_run_counter[0]) == state.slot_run_counter
    got, want = ctx.violation_ring, state.to_ring_array()
    if ordered_rows:
        np.testing.assert_array_equal(got, want)
    else:  # the kernels append rows in atomic order
        assert sorted(map(tuple, got.tolist())) == sorted(map(tuple, want.tolist()))


@settings(max_examples=300)
@given(aliased_writes())
def test_reference_write_under_aliasing_is_sglangs_in_order_result(case):
    _same_as_oracle(_run_aliased(case, "numpy"), _oracle_aliased(case), ordered_rows=True)


@pytest.mark.skipif(HOST is not None, reason=f"host: {HOST}")
@settings(max_examples=150)
@given(aliased_writes(for_host=True))
def test_host_kernels_under_cross_request_aliasing_match_the_reference(case):
    _same_as_oracle(_run_aliased(case, "host"), _oracle_aliased(case), ordered_rows=False)
    np.testing.assert_array_equal(_run_aliased(case, "host").canary_buf, _run_aliased(case, "numpy").canary_buf)


def test_a_double_allocation_seeds_the_victim_from_the_intruders_write():
    """Request 0 writes slot 5 (a double allocation); request 1 seeds from slot 5 in the same launch."""
    canary = np.zeros((8, 32), np.uint8)
    canary.view(np.int64)[5] = [70, 9, 1234, 0]  # what slot 5 held before the launch
    case = (np.array([0, 1, 2], np.int64), np.array([-1, 5], np.int64), np.array([11, 12], np.int64),
            np.array([0, 10], np.int64), np.array([5, 6], np.int64), False, canary)
    state = _oracle_aliased(case)
    ctx = _run_aliased(case, "numpy")
    _same_as_oracle(ctx, state, ordered_rows=True)
    # Slot 6's stored hash is the hash of slot 5 as request 0 left it: (prev = anchor, token 11, position 0).
    assert int(ctx.canary_buf.view(np.int64)[6, 2]) == oracle.to_i64(oracle.mix3(oracle.anchor_hash(), 11, 0))


# ---- 7. threads ----------------------------------------------------------------------------------------------

def test_two_threads_verifying_on_one_context_lose_no_ring_row():
    ctx = context(num_slots=64, ring_capacity=8192)
    vp = verify_plan(list(range(1, 41)), [7] * 40, [0] * 40)  # every entry fails its position check
    launches, threads = 50, 4  # 8,000 rows: all land
    barrier = threading.Barrier(threads)

    def run():
        barrier.wait()
        for _ in range(launches):
            kc.launch_canary_verify_kernel(context=ctx, plan=vp, check_verify_expected_token=False)

    workers = [threading.Thread(target=run) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    total = threads * launches
    assert int(ctx.kernel_run_counter[0]) == total
    assert int(ctx.slot_run_counter[0]) == total * 40
    assert int(ctx.violation_write_index[0]) == total * 40
    landed = ctx.violation_ring[: total * 40]
    assert sorted(landed[:, 1].tolist()) == sorted(list(range(1, 41)) * total)


def test_contexts_sharing_only_their_ring_are_serialised_on_its_write_index():
    """Two contexts that share only their violation ring and its write index (own counters, own status), each
    verified by two threads: the lock on the write index alone serialises them, so no row is lost. GIL switches
    are made very frequent to open the race a missing lock would leave."""
    base = context(num_slots=64, ring_capacity=8192)
    other = dataclasses.replace(base, **{name: np.zeros_like(getattr(base, name))
                                         for name in ("slot_run_counter", "kernel_run_counter", "status")})
    vp = verify_plan(list(range(1, 21)), [7] * 20, [0] * 20)  # every entry fails its position check
    launches, per_context = 60, 2
    barrier = threading.Barrier(2 * per_context)

    def run(ctx):
        barrier.wait()
        for _ in range(launches):
            kc.launch_canary_verify_kernel(context=ctx, plan=vp, check_verify_expected_token=False)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        workers = [threading.Thread(target=run, args=(ctx,)) for ctx in (base, other) * per_context]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
    finally:
        sys.setswitchinterval(interval)
    total = 2 * per_context * launches
    assert int(base.violation_write_index[0]) == total * 20
    assert sorted(base.violation_ring[: total * 20, 1].tolist()) == sorted(list(range(1, 21)) * total)
    assert int(base.kernel_run_counter[0]) == int(other.kernel_run_counter[0]) == per_context * launches


# ---- the memory-safety part again, under AddressSanitizer + UBSan --------------------------------------------

def test_hardening_cases_under_address_sanitizer_have_zero_reports():
    if HOST is not None:
        pytest.skip(f"host backend: {HOST}")
    from kvcanary_cupy.hostcuda import sanitizer_preload

    preload = sanitizer_preload()
    if not Path(preload).is_file():
        pytest.skip(f"g++ has no AddressSanitizer runtime ({preload})")
    env = {**os.environ, "LD_PRELOAD": preload, "ASAN_OPTIONS": "detect_leaks=0:abort_on_error=1",
           "UBSAN_OPTIONS": "print_stacktrace=1:halt_on_error=1", "KVCANARY_HOST_SANITIZE": "1",
           "PYTHONFAULTHANDLER": "1"}
    tests_dir = Path(__file__).parent
    selection = "host and (share or over or inside or misaligned or resize or moved or aliasing) and not sanitizer"
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:benchmark", str(Path(__file__)),
         "-k", selection, "--rootdir", str(tests_dir.parent)],
        env=env, cwd=tests_dir.parent, capture_output=True, text=True, timeout=900,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    assert "AddressSanitizer" not in output and "runtime error" not in output, output[-6000:]
    assert " passed" in output, output[-2000:]


# ---- a verify that reads K column-major (vLLM's CPU cache) up to the tensor's last byte --------------------------

@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_a_verify_of_column_major_k_reads_inside_its_cache_up_to_the_last_block(backend):
    """vLLM's CPU K is read element by element, each element a block's width apart, and the host verify asks for
    those elements' lines ahead of reading them. On a cache that ends exactly where its last block's last head
    ends (a view to the end of its allocation), every slot up to the cache's last one verifies clean, a changed
    K element of the last slot is reported at that slot alone, and nothing is read outside the cache (the
    AddressSanitizer run above repeats this case)."""
    from kvcanary_cupy.kv_layouts import vllm_cpu_source

    blocks, heads, block, head = 6, 2, 16, 8
    cache = np.random.default_rng(3).standard_normal((blocks, heads, block, 2 * head)).astype(np.float32)
    source = vllm_cpu_source(cache, block_size=block, num_kv_heads=heads, head_size=head, which="k", read_bytes=16,
                             isa="vec")
    num_slots = blocks * block
    slots = np.arange(block, num_slots, dtype=np.int64)  # blocks 1.., one chain, up to the cache's last slot
    n = slots.shape[0]
    ctx = kc.VerifyOrWriteContext.allocate(num_slots=num_slots, ring_capacity=16, real_kv_sources=(source,),
                                           real_kv_hash_mode=kc.RealKvHashMode.PARTIAL)
    wp = kc.WritePlan.allocate(write_req_capacity=1)
    wp.write_offsets[:] = [0, n]
    wp.write_seed_slot_indices[0] = -1
    wp.write_num_valid_reqs[0] = 1
    positions = np.arange(n, dtype=np.int64)
    kc.launch_canary_write_kernel(context=ctx, plan=wp, input_ids=positions + 5, positions=positions,
                                  out_cache_loc=slots, enable_write_input_assert=False, backend="numpy")
    vp = kc.VerifyPlan.allocate(verify_capacity=n)
    vp.verify_slot_indices[:] = slots
    vp.verify_expected_tokens[:] = -1
    vp.verify_expected_positions[:] = positions
    vp.verify_prev_slot_indices[:] = np.concatenate([[-1], slots[:-1]])
    vp.verify_num_valid[0] = n
    vp.enable[0] = 1
    kc.launch_canary_verify_kernel(context=ctx, plan=vp, check_verify_expected_token=False, backend=backend)
    assert int(ctx.violation_write_index[0]) == 0 and int(ctx.status[0]) == 0
    cache[-1, 0, 3, block - 1] += 1.0  # K element 3 of the last slot (column-major: d * block + o)
    kc.launch_canary_verify_kernel(context=ctx, plan=vp, check_verify_expected_token=False, backend=backend)
    assert int(ctx.violation_write_index[0]) == 1 and int(ctx.status[0]) == 0
    assert int(ctx.violation_ring[0, 1]) == num_slots - 1
    assert int(ctx.violation_ring[0, 7]) == 4  # the real-KV reason alone (SPEC §1.2)
