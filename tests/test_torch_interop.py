"""torch CPU tensors through every public launcher: same bits as NumPy inputs, results in the caller's tensors.

The randomized cases are the suite's own strategies (tests/strategies.py); the NumPy side runs them through
tests/differential.py, so "bit-identical" means every buffer, including the parts a launch must leave alone.
Refusals leave every torch output byte-for-byte as it was.
"""

from __future__ import annotations

import numpy as np
import pytest
import strategies
from chain_helpers import ANCHOR_HASH_SIGNED
from differential import SENTINEL, chain_results_equal, run_chain, run_plan, run_scatter
from hypothesis import given, settings
from plan_helpers import linear_rtt

import kvcanary_cupy as kc
from kvcanary_cupy.context import RealKvSource

torch = pytest.importorskip("torch")


def tensor(arr):
    """A torch tensor owning a copy of ``arr`` (so the NumPy case stays intact)."""
    return None if arr is None else torch.from_numpy(np.array(arr, copy=True))


def torch_plans(capacity: int, write_capacity: int, fill: int = SENTINEL) -> tuple[kc.VerifyPlan, kc.WritePlan]:
    def full(n, dtype):
        return torch.full((n,), fill, dtype=dtype)

    vp = kc.VerifyPlan.from_tensors(
        verify_slot_indices=full(capacity, torch.int64), verify_expected_tokens=full(capacity, torch.int64),
        verify_expected_positions=full(capacity, torch.int64), verify_prev_slot_indices=full(capacity, torch.int64),
        verify_num_valid=full(1, torch.int32), enable=full(1, torch.int32), status=full(1, torch.int32))
    wp = kc.WritePlan.from_tensors(
        write_offsets=full(write_capacity + 1, torch.int64), write_seed_slot_indices=full(write_capacity, torch.int64),
        write_num_valid_reqs=full(1, torch.int32), verify_offsets=full(write_capacity + 1, torch.int64))
    return vp, wp


def plan_dict(vp, wp) -> dict[str, np.ndarray]:
    return {**{f"verify.{k}": v.numpy().copy() for k, v in vars(vp).items()},
            **{f"write.{k}": v.numpy().copy() for k, v in vars(wp).items()}}


def snapshot(*objs) -> list[bytes]:
    """Bytes of every torch tensor inside the given plans/contexts/tensors."""
    out = []
    for obj in objs:
        values = vars(obj).values() if hasattr(obj, "__dataclass_fields__") else [obj]
        out += [v.numpy().tobytes() for v in values if isinstance(v, torch.Tensor)]
    return out


# --- plan --------------------------------------------------------------------------------------------------

@settings(max_examples=60, deadline=None)
@given(strategies.plan_cases(max_bs=10, hostile=True))
def test_plan_from_torch_tensors_is_bit_identical_to_numpy_inputs(case):
    vp, wp = torch_plans(case.kwargs["verify_capacity"], case.write_req_capacity)
    kwargs = {k: tensor(v) if isinstance(v, np.ndarray) else v for k, v in case.kwargs.items()}
    kc.launch_canary_plan_kernels(verify_plan_out=vp, write_plan_out=wp, **kwargs, on_invalid="flag")
    want = run_plan("numpy", case)
    got = plan_dict(vp, wp)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def small_plan_kwargs(vp, wp) -> dict:
    return {
        "verify_plan_out": vp, "write_plan_out": wp,
        "req_pool_indices": torch.tensor([1, 0, 2]), "prefix_lens": torch.tensor([3, 9, 2]),
        "extend_seq_lens": torch.tensor([1, 5, 2]), "req_to_token": torch.from_numpy(linear_rtt(4, 8)),
        "swa_window_size": 0, "full_to_swa_index_mapping": None, "verify_capacity": 8,
        "req_to_verify_expected_tokens": torch.arange(32, dtype=torch.int32).reshape(4, 8) + 500,
        "req_to_verify_expected_tokens_valid_lens": torch.tensor([2, 0, 8]),
    }


def test_plan_results_land_in_the_callers_tensors_in_place():
    vp, wp = torch_plans(8, 4, fill=-3)
    pointers = [t.data_ptr() for t in (*vars(vp).values(), *vars(wp).values())]
    kc.launch_canary_plan_kernels(**small_plan_kwargs(vp, wp))
    assert [t.data_ptr() for t in (*vars(vp).values(), *vars(wp).values())] == pointers
    # rp 1 verifies positions 0..2 (row 1 = 1008..), rp 2 positions 0..1 (row 2 = 1016..); row 0 is padding
    assert vp.verify_slot_indices.tolist() == [1008, 1009, 1010, 1016, 1017, -3, -3, -3]
    assert vp.verify_prev_slot_indices[:5].tolist() == [-1, 1008, 1009, -1, 1016]
    assert vp.verify_expected_positions[:5].tolist() == [0, 1, 2, 0, 1]
    assert vp.verify_expected_tokens[:5].tolist() == [508, 509, -1, 516, 517]  # valid_lens [2, 0, 8]
    assert (int(vp.verify_num_valid), int(vp.enable), int(vp.status)) == (5, 1, 0)
    assert wp.write_offsets.tolist() == [0, 1, 1, 3, 0]
    assert wp.write_seed_slot_indices.tolist() == [1010, -1, 1017, -3]
    assert int(wp.write_num_valid_reqs) == 3


def test_from_tensors_keeps_the_callers_tensors_and_adds_status_next_to_them():
    fields = {
        "verify_slot_indices": torch.zeros(4, dtype=torch.int64),
        "verify_expected_tokens": torch.zeros(4, dtype=torch.int64),
        "verify_expected_positions": torch.zeros(4, dtype=torch.int64),
        "verify_prev_slot_indices": torch.zeros(4, dtype=torch.int64),
        "verify_num_valid": torch.zeros(1, dtype=torch.int32),
        "enable": torch.ones(1, dtype=torch.int32),
    }
    vp = kc.VerifyPlan.from_tensors(**fields)
    for name, t in fields.items():
        assert getattr(vp, name) is t
    assert isinstance(vp.status, torch.Tensor)
    assert vp.status.dtype == torch.int32 and vp.status.tolist() == [0]
    offsets = torch.zeros(5, dtype=torch.int64)
    wp = kc.WritePlan.from_tensors(write_offsets=offsets, write_seed_slot_indices=torch.zeros(4, dtype=torch.int64),
                                   write_num_valid_reqs=torch.zeros(1, dtype=torch.int32))
    assert wp.write_offsets is offsets
    assert isinstance(wp.verify_offsets, torch.Tensor) and wp.verify_offsets.shape == (5,)


# --- refusals: ValueError and nothing written ----------------------------------------------------------------

def assert_refused(kwargs, *fragments):
    vp, wp = kwargs["verify_plan_out"], kwargs["write_plan_out"]
    before = snapshot(vp, wp)
    with pytest.raises(ValueError) as info:
        kc.launch_canary_plan_kernels(**kwargs)
    message = str(info.value)
    assert message.startswith("kv-canary: ")
    for fragment in fragments:
        assert fragment in message
    assert snapshot(vp, wp) == before


def test_non_contiguous_tensor_is_refused():
    kwargs = small_plan_kwargs(*torch_plans(8, 4))
    kwargs["prefix_lens"] = torch.tensor([3, 0, 9, 0, 2, 0])[::2]
    assert_refused(kwargs, "prefix_lens must be contiguous")


def test_non_contiguous_output_is_refused():
    vp, wp = torch_plans(8, 4)
    strided = torch.zeros(16, dtype=torch.int64)[::2]
    vp = kc.VerifyPlan(**{**vars(vp), "verify_expected_tokens": strided})
    assert_refused(small_plan_kwargs(vp, wp), "verify_plan_out.verify_expected_tokens must be contiguous")


def test_int32_input_is_refused_not_converted():
    kwargs = small_plan_kwargs(*torch_plans(8, 4))
    kwargs["extend_seq_lens"] = kwargs["extend_seq_lens"].to(torch.int32)
    assert_refused(kwargs, "extend_seq_lens must have dtype int64, got int32")


def test_int64_req_to_token_is_refused():
    kwargs = small_plan_kwargs(*torch_plans(8, 4))
    kwargs["req_to_token"] = kwargs["req_to_token"].to(torch.int64)
    assert_refused(kwargs, "req_to_token must have dtype int32, got int64")


class ReadOnly:
    """A DLPack producer exporting read-only memory (NumPy marks its export read-only)."""

    def __init__(self, arr):
        self.arr = arr.copy()
        self.arr.flags.writeable = False

    def __dlpack__(self, **kwargs):
        return self.arr.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self.arr.__dlpack_device__()


def test_read_only_output_is_refused():
    vp, wp = torch_plans(8, 4)
    vp = kc.VerifyPlan(**{**vars(vp), "enable": ReadOnly(np.ones(1, np.int32))})
    assert_refused(small_plan_kwargs(vp, wp), "verify_plan_out.enable is read-only")


def cuda_metadata_array(shape, dtype):
    """A genuine cupy.ndarray on cuda:0 over host memory it never reads (validation fails first)."""
    cupy = pytest.importorskip("cupy")
    from cupy.cuda import memory

    host = np.zeros(int(np.prod(shape)) or 1, dtype)
    return cupy.ndarray(shape, dtype, memory.MemoryPointer(
        memory.UnownedMemory(host.ctypes.data, host.nbytes, host, device_id=0), 0))


def test_mixed_device_input_is_refused_naming_both():
    kwargs = small_plan_kwargs(*torch_plans(8, 4))
    kwargs["req_to_verify_expected_tokens_valid_lens"] = cuda_metadata_array((3,), np.int64)
    assert_refused(kwargs, "req_to_verify_expected_tokens_valid_lens is on cuda:0",
                   "req_pool_indices is on cpu")


def test_wrong_device_for_the_backend_is_refused():
    kwargs = small_plan_kwargs(*torch_plans(8, 4))
    kwargs["backend"] = "cuda"
    assert_refused(kwargs, "backend='cuda' needs CUDA arrays")


def test_missing_valid_lens_names_the_launcher():
    kwargs = small_plan_kwargs(*torch_plans(8, 4))
    kwargs["req_to_verify_expected_tokens_valid_lens"] = None
    assert_refused(kwargs, "launch_canary_plan_kernels requires req_to_verify_expected_tokens_valid_lens when "
                           "req_to_verify_expected_tokens is set")


# --- write + verify ------------------------------------------------------------------------------------------

def torch_context(case, canary: torch.Tensor, sources: list[torch.Tensor]) -> kc.VerifyOrWriteContext:
    return kc.VerifyOrWriteContext(
        canary_buf=canary, kernel_kind=case.tag, violation_ring=tensor(case.ring),
        violation_write_index=torch.tensor([case.write_index], dtype=torch.int32),
        slot_run_counter=torch.tensor([case.slot_run_counter], dtype=torch.int64),
        kernel_run_counter=torch.tensor([case.kernel_run_counter], dtype=torch.int64),
        real_kv_sources=tuple(RealKvSource(t, page_size=p, num_bytes_per_token=n, read_bytes=r)
                              for t, (_, p, n, r) in zip(sources, case.sources, strict=True)),
        real_kv_hash_mode=kc.RealKvHashMode(case.mode),
        enable_chain_position_assert=torch.tensor([case.enable_chain_position_assert], dtype=torch.int32),
        status=torch.tensor([case.status], dtype=torch.int32),
    )


def chain_snapshot(ctx, ring_start: int):
    from differential import ChainResult

    index = int(ctx.violation_write_index[0])
    end = min(max(index, 0), ctx.violation_ring.shape[0])
    ring = ctx.violation_ring.numpy().copy()
    return ChainResult(canary=ctx.canary_buf.numpy().copy(), ring=ring, rows=ring[max(ring_start, 0):end].tolist(),
                       landed=(max(ring_start, 0), max(end, 0)), write_index=index,
                       slot_run_counter=int(ctx.slot_run_counter[0]),
                       kernel_run_counter=int(ctx.kernel_run_counter[0]), status=int(ctx.status[0]))


@settings(max_examples=40, deadline=None)
@given(strategies.chain_cases(hostile=True))
def test_write_then_verify_on_torch_tensors_is_bit_identical_to_numpy(case):
    # Real-KV sources as bfloat16 tensors: the bridge must fingerprint their bytes exactly like uint8 rows.
    sources = [tensor(arr).view(torch.bfloat16) for arr, *_ in case.sources]
    ctx = torch_context(case, tensor(case.canary_buf), sources)
    wp = kc.WritePlan.from_tensors(write_offsets=tensor(case.write_offsets),
                                   write_seed_slot_indices=tensor(case.write_seed_slot_indices),
                                   write_num_valid_reqs=torch.tensor([case.write_num_valid_reqs], dtype=torch.int32))
    kc.launch_canary_write_kernel(
        context=ctx, plan=wp, input_ids=tensor(case.input_ids), positions=tensor(case.positions),
        out_cache_loc=tensor(case.out_cache_loc), enable_write_input_assert=case.enable_write_input_assert,
        expected_input_tokens=tensor(case.expected_input_tokens),
        expected_input_positions=tensor(case.expected_input_positions), on_invalid="flag")
    after_write = chain_snapshot(ctx, case.write_index)
    case.apply_corruptions(ctx.canary_buf.numpy(), [(s.view(torch.uint8).numpy(), *rest)
                                                    for s, (_, *rest) in zip(sources, case.sources, strict=True)])
    vp = kc.VerifyPlan.from_tensors(
        verify_slot_indices=tensor(case.verify_slot_indices),
        verify_expected_tokens=tensor(case.verify_expected_tokens),
        verify_expected_positions=tensor(case.verify_expected_positions),
        verify_prev_slot_indices=tensor(case.verify_prev_slot_indices),
        verify_num_valid=torch.tensor([case.verify_num_valid], dtype=torch.int32),
        enable=torch.tensor([case.enable], dtype=torch.int32))
    kc.launch_canary_verify_kernel(context=ctx, plan=vp, check_verify_expected_token=case.check_verify_expected_token,
                                   on_invalid="flag")
    after_verify = chain_snapshot(ctx, after_write.write_index)
    want_write, want_verify = run_chain("numpy", case)
    chain_results_equal(after_write, want_write)
    chain_results_equal(after_verify, want_verify)


def one_request_write(ctx, **overrides):
    plan = kc.WritePlan.from_tensors(write_offsets=torch.tensor([0, 3]), write_seed_slot_indices=torch.tensor([-1]),
                                     write_num_valid_reqs=torch.tensor([1], dtype=torch.int32))
    kwargs = {"context": ctx, "plan": plan, "input_ids": torch.tensor([11, 12, 13]),
              "positions": torch.tensor([0, 1, 2]), "out_cache_loc": torch.tensor([3, 4, 5]),
              "enable_write_input_assert": False}
    kwargs.update(overrides)
    return kwargs


def test_write_lands_in_a_torch_canary_buffer_and_verify_finds_it_clean():
    ctx = kc.VerifyOrWriteContext(
        canary_buf=torch.zeros(8, 32, dtype=torch.uint8), kernel_kind=kc.CanaryLaunchTag.HEAD_K_FULL,
        violation_ring=torch.zeros(4, 8, dtype=torch.int64), violation_write_index=torch.zeros(1, dtype=torch.int32),
        slot_run_counter=torch.zeros(1, dtype=torch.int64), kernel_run_counter=torch.zeros(1, dtype=torch.int64),
        enable_chain_position_assert=torch.ones(1, dtype=torch.int32), status=torch.zeros(1, dtype=torch.int32))
    kc.launch_canary_write_kernel(**one_request_write(ctx))
    fields = ctx.canary_buf.view(torch.int64)  # [slots, 4]: token, position, prev_hash, real_kv_hash
    assert fields[3:6, 0].tolist() == [11, 12, 13]
    assert fields[3:6, 1].tolist() == [0, 1, 2]
    assert int(fields[3, 2]) == ANCHOR_HASH_SIGNED  # the chain head hangs off the anchor
    assert (int(ctx.slot_run_counter), int(ctx.kernel_run_counter)) == (3, 1)
    vp = kc.VerifyPlan.from_tensors(
        verify_slot_indices=torch.tensor([3, 4, 5]), verify_expected_tokens=torch.tensor([11, 12, 13]),
        verify_expected_positions=torch.tensor([0, 1, 2]), verify_prev_slot_indices=torch.tensor([-1, 3, 4]),
        verify_num_valid=torch.tensor([3], dtype=torch.int32), enable=torch.ones(1, dtype=torch.int32))
    kc.launch_canary_verify_kernel(context=ctx, plan=vp, check_verify_expected_token=True)
    assert int(ctx.violation_write_index) == 0
    fields[4, 0] = 99  # corrupt a token: TOKEN on slot 4 and CHAIN on its successor
    kc.launch_canary_verify_kernel(context=ctx, plan=vp, check_verify_expected_token=True)
    report = kc.read_violations(ctx)
    assert sorted((v.slot, v.reason_bits) for v in report.rows) == [
        (4, kc.FailReason.VERIFY_TOKEN_MISMATCH), (5, kc.FailReason.VERIFY_CHAIN_HASH_MISMATCH)]


def test_write_refusals_leave_the_torch_context_untouched():
    ctx = kc.VerifyOrWriteContext(
        canary_buf=torch.zeros(8, 32, dtype=torch.uint8), kernel_kind=0,
        violation_ring=torch.zeros(4, 8, dtype=torch.int64), violation_write_index=torch.zeros(1, dtype=torch.int32),
        slot_run_counter=torch.zeros(1, dtype=torch.int64), kernel_run_counter=torch.zeros(1, dtype=torch.int64),
        enable_chain_position_assert=torch.zeros(1, dtype=torch.int32), status=torch.zeros(1, dtype=torch.int32))
    bad = [
        ({"input_ids": torch.tensor([11, 12, 13], dtype=torch.int32)}, "input_ids must have dtype int64"),
        ({"positions": torch.tensor([0, 9, 1, 9, 2, 9])[::2]}, "positions must be contiguous"),
        ({"out_cache_loc": cuda_metadata_array((3,), np.int64)}, "out_cache_loc is on cuda:0"),
        ({"positions": torch.tensor([0, 1])}, "positions must have shape (3,)"),
        ({"enable_write_input_assert": True}, "expected_input_tokens and expected_input_positions are required"),
    ]
    for overrides, fragment in bad:
        before = snapshot(ctx)
        with pytest.raises(ValueError, match=r"^kv-canary: ") as info:
            kc.launch_canary_write_kernel(**one_request_write(ctx, **overrides))
        assert fragment in str(info.value)
        assert snapshot(ctx) == before


def test_read_only_canary_buffer_is_refused():
    ctx = kc.VerifyOrWriteContext(
        canary_buf=ReadOnly(np.zeros((8, 32), np.uint8)), kernel_kind=0,
        violation_ring=torch.zeros(4, 8, dtype=torch.int64), violation_write_index=torch.zeros(1, dtype=torch.int32),
        slot_run_counter=torch.zeros(1, dtype=torch.int64), kernel_run_counter=torch.zeros(1, dtype=torch.int64),
        enable_chain_position_assert=torch.zeros(1, dtype=torch.int32), status=torch.zeros(1, dtype=torch.int32))
    before = snapshot(ctx)
    with pytest.raises(ValueError, match=r"kv-canary: context.canary_buf is read-only"):
        kc.launch_canary_write_kernel(**one_request_write(ctx))
    assert snapshot(ctx) == before


# --- scatter -----------------------------------------------------------------------------------------------

@settings(max_examples=40, deadline=None)
@given(strategies.scatter_cases(hostile=True))
def test_scatter_into_a_torch_pool_is_bit_identical_to_numpy(case):
    pool = tensor(case.pool_out)
    status = torch.zeros(1, dtype=torch.int32)
    kc.launch_scatter_req_token_ids(flat_in=tensor(case.flat_in), offsets=tensor(case.offsets),
                                    req_pool_indices=tensor(case.req_pool_indices), pool_out=pool, status=status,
                                    on_invalid="flag")
    want_pool, want_status = run_scatter("numpy", case)
    np.testing.assert_array_equal(pool.numpy(), want_pool)
    assert int(status) == want_status


def test_scatter_refuses_an_int64_pool_and_writes_nothing():
    pool = torch.full((2, 4), 7, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"kv-canary: pool_out must have dtype int32, got int64"):
        kc.launch_scatter_req_token_ids(flat_in=torch.tensor([1, 2]), offsets=torch.tensor([0, 2]),
                                        req_pool_indices=torch.tensor([1]), pool_out=pool)
    assert (pool == 7).all()
