"""SPEC §0.8 on a real GPU: aliased outputs, misaligned arrays and torch storage moved under a wrapper are refused
before any kernel runs (each would otherwise take the CUDA context down), and the refused call leaves every
device buffer as it was. The context stays usable afterwards: a valid launch follows each refusal.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import kvcanary_cupy as kc
from kvcanary_cupy.bind import bind_plan, bind_verify, bind_write

pytestmark = pytest.mark.gpu
cp = pytest.importorskip("cupy")


def rejects(fragment: str):
    return pytest.raises(kc.CanaryArgumentError, match=r"^kv-canary: .*" + fragment)


def host_copies(*objects) -> list[np.ndarray]:
    out = []
    for obj in objects:
        values = [getattr(obj, f.name) for f in dataclasses.fields(obj)] if dataclasses.is_dataclass(obj) else [obj]
        out += [cp.asnumpy(v) for v in values if isinstance(v, cp.ndarray)]
    return out


def assert_same(before: list[np.ndarray], after: list[np.ndarray]) -> None:
    assert len(before) == len(after) and all(np.array_equal(a, b) for a, b in zip(before, after, strict=True))


def plan_inputs():
    return {"req_pool_indices": cp.array([1, 2], cp.int64), "prefix_lens": cp.array([3, 2], cp.int64),
            "extend_seq_lens": cp.array([1, 1], cp.int64),
            "req_to_token": cp.arange(4 * 8, dtype=cp.int32).reshape(4, 8) + 1, "swa_window_size": 0,
            "full_to_swa_index_mapping": None, "verify_capacity": 16}


def gpu_plans():
    return (kc.VerifyPlan.allocate(verify_capacity=16, device="cuda"),
            kc.WritePlan.allocate(write_req_capacity=4, device="cuda"))


def misaligned(arr, offset: int = 4):
    """``arr``'s values in a view ``offset`` bytes past an aligned address. The bytes are copied as uint8: an
    element-wise copy into the misaligned view would itself fault on the GPU (and poison the context)."""
    raw = cp.zeros(arr.nbytes + 256, cp.uint8)
    raw[offset:offset + arr.nbytes] = cp.ascontiguousarray(arr).view(cp.uint8).ravel()
    return raw[offset:offset + arr.nbytes].view(arr.dtype).reshape(arr.shape)


def test_aliased_plan_outputs_are_refused_and_the_gpu_stays_usable():
    vp, wp = gpu_plans()
    shared = cp.zeros(64, cp.int64)
    bad_vp = dataclasses.replace(vp, verify_slot_indices=shared[:16])
    bad_wp = dataclasses.replace(wp, verify_offsets=shared[:5])
    before = host_copies(bad_vp, bad_wp)
    with rejects("overlaps"):
        kc.launch_canary_plan_kernels(verify_plan_out=bad_vp, write_plan_out=bad_wp, **plan_inputs())
    with rejects("overlaps"):
        bind_plan(verify_plan_out=bad_vp, write_plan_out=bad_wp, **plan_inputs())
    cp.cuda.Device().synchronize()
    assert_same(before, host_copies(bad_vp, bad_wp))
    kc.launch_canary_plan_kernels(verify_plan_out=vp, write_plan_out=wp, **plan_inputs())
    assert int(vp.verify_num_valid.get()[0]) == 5


def test_an_output_over_an_input_is_refused():
    vp, wp = gpu_plans()
    words = cp.zeros(64, cp.int64)
    rtt = words.view(cp.int32).reshape(4, 32)
    bad_vp = dataclasses.replace(vp, verify_slot_indices=words[8:24])
    with rejects("overlaps req_to_token"):
        kc.launch_canary_plan_kernels(verify_plan_out=bad_vp, write_plan_out=wp, **{**plan_inputs(),
                                                                                    "req_to_token": rtt})


def test_misaligned_device_arrays_are_refused():
    vp, wp = gpu_plans()
    inputs = plan_inputs()
    inputs["prefix_lens"] = misaligned(inputs["prefix_lens"])
    with rejects("prefix_lens is not aligned"):
        kc.launch_canary_plan_kernels(verify_plan_out=vp, write_plan_out=wp, **inputs)
    ctx = kc.VerifyOrWriteContext.allocate(num_slots=32, ring_capacity=8, device="cuda")
    wplan = kc.WritePlan.allocate(write_req_capacity=1, device="cuda")
    wplan.write_offsets[:] = cp.array([0, 2])
    wplan.write_seed_slot_indices[:] = -1
    wplan.write_num_valid_reqs[:] = 1
    args = {"input_ids": cp.array([5, 6], cp.int64), "positions": cp.array([0, 1], cp.int64),
            "out_cache_loc": misaligned(cp.array([1, 2], cp.int64)), "enable_write_input_assert": False}
    before = host_copies(ctx)
    with rejects("out_cache_loc is not aligned"):
        kc.launch_canary_write_kernel(context=ctx, plan=wplan, **args)
    with rejects("out_cache_loc is not aligned"):
        bind_write(context=ctx, plan=wplan, **args)
    bad_ctx = dataclasses.replace(ctx, slot_run_counter=misaligned(ctx.slot_run_counter))
    with rejects("slot_run_counter is not aligned"):
        kc.launch_canary_write_kernel(context=bad_ctx, plan=wplan, **{**args, "out_cache_loc": cp.array([1, 2])})
    cp.cuda.Device().synchronize()
    assert_same(before, host_copies(ctx))


def test_a_torch_cuda_pool_grown_with_resize_is_refused_by_sources_and_bound_launches():
    torch = pytest.importorskip("torch")
    pool = torch.zeros(32, 32, dtype=torch.uint8, device="cuda")
    source = kc.RealKvSource(pool, page_size=1, num_bytes_per_token=32, read_bytes=32)
    ctx = kc.VerifyOrWriteContext.allocate(num_slots=32, ring_capacity=8, real_kv_sources=(source,),
                                           real_kv_hash_mode=kc.RealKvHashMode.ALL, device="cuda")
    vp = kc.VerifyPlan.allocate(verify_capacity=2, device="cuda")
    vp.verify_slot_indices[:] = cp.array([1, 2])
    vp.verify_num_valid[:] = 2
    bound = bind_verify(context=ctx, plan=vp, check_verify_expected_token=False)
    bound()
    pool.resize_(1 << 16, 32)  # reallocated: the views taken at construction now address freed memory
    with rejects("storage moved or shrank"):
        kc.launch_canary_verify_kernel(context=ctx, plan=vp, check_verify_expected_token=False)
    with rejects("storage moved or shrank"):
        bound()
    ids = torch.tensor([5, 6], device="cuda")
    wplan = kc.WritePlan.allocate(write_req_capacity=1, device="cuda")
    wplan.write_offsets[:] = cp.array([0, 2])
    wplan.write_seed_slot_indices[:] = -1
    wplan.write_num_valid_reqs[:] = 1
    plain = ctx.for_endpoint(real_kv_sources=(), real_kv_hash_mode=kc.RealKvHashMode.NONE)
    write = bind_write(context=plain, plan=wplan, input_ids=ids, positions=torch.tensor([0, 1], device="cuda"),
                       out_cache_loc=torch.tensor([1, 2], device="cuda"), enable_write_input_assert=False)
    write()
    ids.resize_(1 << 20)
    with rejects("input_ids: the torch tensor's storage moved or shrank"):
        write()
    torch.cuda.synchronize()


def test_bind_plan_refuses_aliased_torch_outputs():
    torch = pytest.importorskip("torch")
    vp, wp = gpu_plans()
    slots = torch.zeros(16, dtype=torch.int64, device="cuda")
    bad_vp = dataclasses.replace(vp, verify_slot_indices=slots, verify_prev_slot_indices=slots)
    with rejects("overlaps"):
        bind_plan(verify_plan_out=bad_vp, write_plan_out=wp, **plan_inputs())
