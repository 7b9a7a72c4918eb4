"""The SGLang-compatible layer (kvcanary_cupy.compat.sglang) on torch CPU tensors.

Results are compared with the core launchers on NumPy inputs (tests/differential.py); the torch reference is
fed the dtypes and layouts SGLang's reference accepted. Capture refusals are exercised by making torch report
an active capture, since a CPU-only torch cannot capture.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import strategies
from differential import SENTINEL, run_plan
from hypothesis import given, settings
from hypothesis import strategies as st
from plan_helpers import linear_rtt

import kvcanary_cupy as kc

torch = pytest.importorskip("torch")
sg = pytest.importorskip("kvcanary_cupy.compat.sglang")

REPO = Path(__file__).resolve().parents[1]
MISSING_LENS = ("kv-canary: launch_canary_plan_kernels_torch_reference requires "
                "req_to_verify_expected_tokens_valid_lens when req_to_verify_expected_tokens is set")
PLAN_PARAMETERS = [
    "verify_plan_out", "write_plan_out", "req_pool_indices", "prefix_lens", "extend_seq_lens", "req_to_token",
    "swa_window_size", "full_to_swa_index_mapping", "verify_capacity", "req_to_verify_expected_tokens",
    "req_to_verify_expected_tokens_valid_lens", "kv_token_id_vs_position_offset",
]


def tensor(arr):
    return None if arr is None else torch.from_numpy(np.array(arr, copy=True))


def sentinel_plans(capacity: int, write_capacity: int):
    vp = sg.VerifyPlan.allocate(verify_capacity=capacity, device="cpu")
    wp = sg.WritePlan.allocate(write_req_capacity=write_capacity, device=torch.device("cpu"))
    for t in (*vars(vp).values(), *vars(wp).values()):
        t.fill_(SENTINEL)
    return vp, wp


def plan_dict(vp, wp) -> dict[str, np.ndarray]:
    return {**{f"verify.{k}": v.numpy().copy() for k, v in vars(vp).items()},
            **{f"write.{k}": v.numpy().copy() for k, v in vars(wp).items()}}


def assert_same_plan(got, want, skip=()):
    for name in want:
        if name not in skip:
            np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def plan_bytes(vp, wp) -> list[bytes]:
    return [t.numpy().tobytes() for t in (*vars(vp).values(), *vars(wp).values())]


# --- import and names ----------------------------------------------------------------------------------------

def run_without_torch(code: str) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter in which ``import torch`` fails."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    prelude = "import sys; sys.modules['torch'] = None\n"
    return subprocess.run([sys.executable, "-c", prelude + code], capture_output=True, text=True, env=env,
                          cwd=REPO, timeout=120)


def test_importing_without_torch_is_an_import_error_that_names_the_extra():
    result = run_without_torch(
        "try:\n"
        "    import kvcanary_cupy.compat.sglang\n"
        "except ImportError as exc:\n"
        "    print('IMPORT-ERROR:', exc)\n")
    assert result.returncode == 0, result.stderr
    assert "IMPORT-ERROR:" in result.stdout
    assert "pip install kvcanary-cupy[torch]" in result.stdout


def test_the_package_and_the_compat_package_import_without_torch():
    result = run_without_torch("import kvcanary_cupy, kvcanary_cupy.compat, kvcanary_cupy.bind; print('ok')")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_every_exported_name_exists_and_the_classes_extend_the_core():
    for name in sg.__all__:
        assert hasattr(sg, name), name
    assert issubclass(sg.VerifyPlan, kc.VerifyPlan)
    assert issubclass(sg.WritePlan, kc.WritePlan)
    assert issubclass(sg.VerifyOrWriteContext, kc.VerifyOrWriteContext)
    assert sg.RealKvSource is kc.RealKvSource
    assert sg.CanaryLaunchTag is kc.CanaryLaunchTag and sg.FailReason is kc.FailReason
    assert sg.launch_scatter_req_token_ids is sg.launch_scatter_req_token_ids_kernel


@pytest.mark.parametrize(("function", "parameters"), [
    ("launch_canary_plan_kernels", PLAN_PARAMETERS),
    ("launch_canary_plan_kernels_torch_reference", PLAN_PARAMETERS),
    ("launch_canary_verify_kernel", ["context", "plan", "check_verify_expected_token"]),
    ("launch_canary_write_kernel", ["context", "plan", "input_ids", "positions", "out_cache_loc",
                                    "enable_write_input_assert", "expected_input_tokens",
                                    "expected_input_positions"]),
    ("launch_scatter_req_token_ids_kernel", ["flat_in", "offsets", "req_pool_indices", "pool_out"]),
])
def test_launchers_have_sglangs_keyword_only_signature(function, parameters):
    """SGLang's keywords, in order and keyword-only. The plan launchers add ``layout`` (slot layouts beyond
    SGLang's table), which makes ``req_to_token`` optional, and ``req_pool_indices`` for layouts that read
    batch rows; every other SGLang argument stays required."""
    signature = inspect.signature(getattr(sg, function))
    optional = {"layout", "req_to_token", "req_pool_indices"} if parameters is PLAN_PARAMETERS else set()
    assert list(signature.parameters) == parameters + (["layout"] if optional else [])
    for p in signature.parameters.values():
        assert p.kind is inspect.Parameter.KEYWORD_ONLY, p.name
        assert (p.default is None) if p.name in optional else (p.default is inspect.Parameter.empty), p.name


# --- data model --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("device", ["cpu", torch.device("cpu")])
def test_allocate_returns_torch_tensors_with_sglangs_dtypes(device):
    vp = sg.VerifyPlan.allocate(verify_capacity=5, device=device)
    assert isinstance(vp, sg.VerifyPlan)
    shapes = {k: (tuple(v.shape), v.dtype) for k, v in vars(vp).items()}
    assert shapes == {
        "verify_slot_indices": ((5,), torch.int64), "verify_expected_tokens": ((5,), torch.int64),
        "verify_expected_positions": ((5,), torch.int64), "verify_prev_slot_indices": ((5,), torch.int64),
        "verify_num_valid": ((1,), torch.int32), "enable": ((1,), torch.int32), "status": ((1,), torch.int32),
    }
    assert vp.enable.tolist() == [1] and vp.status.tolist() == [0]
    wp = sg.WritePlan.allocate(write_req_capacity=3, device=device)
    shapes = {k: (tuple(v.shape), v.dtype) for k, v in vars(wp).items()}
    assert shapes == {
        "write_offsets": ((4,), torch.int64), "write_seed_slot_indices": ((3,), torch.int64),
        "write_num_valid_reqs": ((1,), torch.int32), "verify_offsets": ((4,), torch.int64),
    }
    assert all(t.device.type == "cpu" for t in (*vars(vp).values(), *vars(wp).values()))


def test_allocate_refuses_a_non_positive_capacity_with_sglangs_words():
    with pytest.raises(ValueError, match=r"^kv-canary: VerifyPlan verify_capacity must be positive, got 0$"):
        sg.VerifyPlan.allocate(verify_capacity=0, device="cpu")
    with pytest.raises(ValueError, match=r"^kv-canary: WritePlan write_req_capacity must be positive, got -1$"):
        sg.WritePlan.allocate(write_req_capacity=-1, device="cpu")


def test_sglangs_six_field_verify_plan_gets_a_status_next_to_its_fields():
    fields = {name: torch.zeros(4 if "indices" in name or "expected" in name else 1,
                                dtype=torch.int64 if "verify_" in name and name != "verify_num_valid" else torch.int32)
              for name in ("verify_slot_indices", "verify_expected_tokens", "verify_expected_positions",
                           "verify_prev_slot_indices", "verify_num_valid", "enable")}
    vp = sg.VerifyPlan(**fields)
    assert all(getattr(vp, k) is v for k, v in fields.items())
    assert isinstance(vp.status, torch.Tensor) and vp.status.dtype == torch.int32 and vp.status.tolist() == [0]


def test_sglangs_three_field_write_plan_gets_scratch_like_its_offsets():
    offsets = torch.zeros(6, dtype=torch.int64)
    wp = sg.WritePlan(write_offsets=offsets, write_seed_slot_indices=torch.zeros(5, dtype=torch.int64),
                      write_num_valid_reqs=torch.zeros(1, dtype=torch.int32))
    assert wp.write_offsets is offsets
    assert wp.verify_offsets.dtype == torch.int64 and wp.verify_offsets.shape == (6,)


def test_numpy_fields_get_numpy_companions():
    wp = sg.WritePlan(write_offsets=np.zeros(3, np.int64), write_seed_slot_indices=np.zeros(2, np.int64),
                      write_num_valid_reqs=np.zeros(1, np.int32))
    assert isinstance(wp.verify_offsets, np.ndarray) and wp.verify_offsets.dtype == np.int64


def test_zero_for_testing_resets_like_sglang():
    vp, wp = sentinel_plans(3, 2)
    vp.zero_for_testing_()
    wp.zero_for_testing_()
    assert vp.verify_expected_tokens.tolist() == [-1, -1, -1]
    assert vp.verify_slot_indices.tolist() == [0, 0, 0] and vp.enable.tolist() == [0]
    assert wp.write_offsets.tolist() == [0, 0, 0] and wp.write_num_valid_reqs.tolist() == [0]


def sglang_context(**overrides):
    """A context built the way SGLang code builds one: every SGLang field, no ``status``."""
    kwargs = {
        "canary_buf": torch.zeros(16, 32, dtype=torch.uint8), "kernel_kind": sg.CanaryLaunchTag.TAIL_V_SWA,
        "violation_ring": torch.zeros(8, 8, dtype=torch.int64),
        "violation_write_index": torch.zeros(1, dtype=torch.int32),
        "slot_run_counter": torch.zeros(1, dtype=torch.int64), "kernel_run_counter": torch.zeros(1, dtype=torch.int64),
        "real_kv_sources": (), "real_kv_hash_mode": sg.RealKvHashMode.NONE,
        "enable_chain_position_assert": torch.ones(1, dtype=torch.int32),
    }
    kwargs.update(overrides)
    return sg.VerifyOrWriteContext(**kwargs)


def test_sglangs_context_gets_a_status_and_keeps_it_per_endpoint():
    ctx = sglang_context()
    assert isinstance(ctx.status, torch.Tensor) and ctx.status.dtype == torch.int32
    other = ctx.for_endpoint(kernel_kind=sg.CanaryLaunchTag.HEAD_K_FULL)
    assert isinstance(other, sg.VerifyOrWriteContext)
    assert other.status is ctx.status and other.violation_ring is ctx.violation_ring


def test_context_allocate_returns_torch_tensors():
    ctx = sg.VerifyOrWriteContext.allocate(num_slots=10, ring_capacity=3, enable_chain_position_assert=True,
                                           device="cpu")
    assert ctx.canary_buf.shape == (10, 32) and ctx.canary_buf.dtype == torch.uint8
    assert ctx.violation_ring.shape == (3, 8) and ctx.violation_ring.dtype == torch.int64
    assert ctx.enable_chain_position_assert.tolist() == [1]
    assert all(isinstance(getattr(ctx, f.name), torch.Tensor) for f in dataclasses.fields(ctx)
               if f.name not in ("kernel_kind", "real_kv_sources", "real_kv_hash_mode"))


@pytest.mark.parametrize(("argument", "message"), [
    ({"num_slots": 0}, "num_slots must be positive, got 0"),
    ({"num_slots": 2.0}, "num_slots must be an int, got float"),
    ({"ring_capacity": -3}, "ring_capacity must be positive, got -3"),
    ({"slot_stride_bytes": 0}, "slot_stride_bytes must be positive, got 0"),
    ({"slot_stride_bytes": 36}, "slot_stride_bytes must be a multiple of 8 and >= 32, got 36"),
    ({"slot_stride_bytes": 24}, "slot_stride_bytes must be a multiple of 8 and >= 32, got 24"),
    ({"kernel_kind": "HEAD"}, "kernel_kind must be an int, got str"),
    ({"kernel_kind": 1 << 64}, "kernel_kind must be <= 9223372036854775807, got 18446744073709551616"),
    ({"real_kv_hash_mode": 9}, "real_kv_hash_mode must be a RealKvHashMode (NONE, PARTIAL, ALL), got 9"),
    ({"real_kv_sources": None}, "real_kv_sources must be a tuple of RealKvSource, got NoneType"),
    ({"real_kv_sources": ("k",)}, "real_kv_sources[0] must be a RealKvSource, got str"),
    ({"enable_chain_position_assert": 1}, "enable_chain_position_assert must be a bool, got int"),
], ids=["num_slots-0", "num_slots-float", "ring_capacity", "stride-0", "stride-not-multiple-of-8", "stride-below-32",
        "kernel_kind-str", "kernel_kind-past-int64", "hash_mode", "sources-none", "sources-entry", "chain-flag"])
def test_context_allocate_refuses_each_bad_argument_by_its_name(argument, message):
    with pytest.raises(kc.CanaryArgumentError, match="^" + re.escape("kv-canary: " + message) + "$"):
        sg.VerifyOrWriteContext.allocate(**{"num_slots": 4, **argument}, device="cpu")


def test_context_allocate_takes_any_slot_stride_that_is_a_multiple_of_8_from_32():
    for stride in (32, 40, 56):
        assert sg.VerifyOrWriteContext.allocate(num_slots=3, slot_stride_bytes=stride).canary_buf.shape == (3, stride)


# --- plan launcher -----------------------------------------------------------------------------------------

@settings(max_examples=50, deadline=None)
@given(strategies.plan_cases(max_bs=10))
def test_plan_launcher_on_torch_tensors_matches_the_core_on_numpy(case):
    vp, wp = sentinel_plans(case.kwargs["verify_capacity"], case.write_req_capacity)
    sg.launch_canary_plan_kernels(verify_plan_out=vp, write_plan_out=wp,
                                  **{k: tensor(v) if isinstance(v, np.ndarray) else v for k, v in case.kwargs.items()})
    assert_same_plan(plan_dict(vp, wp), run_plan("numpy", case))


def small_inputs(**overrides):
    kwargs = {
        "req_pool_indices": torch.tensor([2, 1]), "prefix_lens": torch.tensor([3, 0]),
        "extend_seq_lens": torch.tensor([1, 4]), "req_to_token": torch.from_numpy(linear_rtt(4, 8)),
        "swa_window_size": 0, "full_to_swa_index_mapping": None, "verify_capacity": 6,
        "req_to_verify_expected_tokens": torch.arange(32, dtype=torch.int32).reshape(4, 8) + 700,
        "req_to_verify_expected_tokens_valid_lens": torch.tensor([2, 5]), "kv_token_id_vs_position_offset": 0,
    }
    kwargs.update(overrides)
    return kwargs


def test_plan_launcher_refuses_wrong_dtypes_unlike_the_reference():
    vp, wp = sentinel_plans(6, 2)
    before = plan_bytes(vp, wp)
    with pytest.raises(ValueError, match=r"kv-canary: prefix_lens must have dtype int64, got int32"):
        sg.launch_canary_plan_kernels(verify_plan_out=vp, write_plan_out=wp,
                                      **small_inputs(prefix_lens=torch.tensor([3, 0], dtype=torch.int32)))
    assert plan_bytes(vp, wp) == before


# --- torch reference -----------------------------------------------------------------------------------------

def test_torch_reference_missing_valid_lens_message_is_sglangs_word_for_word():
    vp, wp = sentinel_plans(6, 2)
    before = plan_bytes(vp, wp)
    with pytest.raises(ValueError) as info:
        sg.launch_canary_plan_kernels_torch_reference(
            verify_plan_out=vp, write_plan_out=wp, **small_inputs(req_to_verify_expected_tokens_valid_lens=None))
    assert str(info.value) == MISSING_LENS
    assert plan_bytes(vp, wp) == before


@pytest.mark.parametrize("name", ["req_pool_indices", "prefix_lens", "extend_seq_lens", "req_to_token",
                                  "req_to_verify_expected_tokens", "req_to_verify_expected_tokens_valid_lens"])
def test_torch_reference_refuses_an_input_that_is_no_array_by_its_name_and_writes_nothing(name):
    vp, wp = sentinel_plans(6, 2)
    before = plan_bytes(vp, wp)
    with pytest.raises(kc.CanaryArgumentError, match="^" + re.escape(
            f"kv-canary: {name} must be an array (NumPy, CuPy, or any DLPack producer such as a torch tensor), "
            "got str") + "$"):
        sg.launch_canary_plan_kernels_torch_reference(verify_plan_out=vp, write_plan_out=wp,
                                                      **small_inputs(**{name: "3, 0"}))
    assert plan_bytes(vp, wp) == before


def test_torch_reference_checks_valid_lens_before_anything_else():
    # Even with other problems present (no LUT for an SWA window), SGLang's message comes first.
    with pytest.raises(ValueError) as info:
        sg.launch_canary_plan_kernels_torch_reference(
            verify_plan_out=object(), write_plan_out=object(),
            **small_inputs(req_to_verify_expected_tokens_valid_lens=None, swa_window_size=4))
    assert str(info.value) == MISSING_LENS


@pytest.mark.parametrize("field", ["verify_expected_tokens", "verify_slot_indices", "write_seed_slot_indices"])
def test_torch_reference_refuses_an_expanded_output_before_writing_anything(field):
    """A stride-0 output cannot take a result; the refusal comes before any field is copied back."""
    vp, wp = sentinel_plans(6, 2)
    plan = vp if field.startswith("verify") else wp
    length = getattr(plan, field).shape[0]
    expanded = torch.full((1,), SENTINEL, dtype=torch.int64).expand(length)
    if plan is vp:
        vp = dataclasses.replace(vp, **{field: expanded})
    else:
        wp = dataclasses.replace(wp, **{field: expanded})
    before = plan_bytes(vp, wp)
    with pytest.raises(kc.CanaryArgumentError, match=f"^kv-canary: .*{field} has elements sharing memory"):
        sg.launch_canary_plan_kernels_torch_reference(verify_plan_out=vp, write_plan_out=wp, **small_inputs())
    assert plan_bytes(vp, wp) == before


def test_torch_reference_refuses_outputs_that_share_memory():
    vp, wp = sentinel_plans(6, 2)
    vp = dataclasses.replace(vp, verify_expected_positions=vp.verify_slot_indices)
    before = plan_bytes(vp, wp)
    with pytest.raises(kc.CanaryArgumentError, match=r"^kv-canary: .* overlaps .* in memory"):
        sg.launch_canary_plan_kernels_torch_reference(verify_plan_out=vp, write_plan_out=wp, **small_inputs())
    assert plan_bytes(vp, wp) == before


def test_compat_allocate_on_a_missing_cuda_device_is_an_argument_error():
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    for cls, key in ((sg.VerifyPlan, "verify_capacity"), (sg.WritePlan, "write_req_capacity"),
                     (sg.VerifyOrWriteContext, "num_slots")):
        with pytest.raises(kc.CanaryArgumentError, match=r"^kv-canary: .*cannot be allocated on device='cuda'"):
            cls.allocate(**{key: 4}, device="cuda")
    with pytest.raises(kc.CanaryArgumentError, match=r"^kv-canary: device='gpu' is not a torch device"):
        sg.VerifyPlan.allocate(verify_capacity=4, device="gpu")


def test_torch_reference_on_core_dtypes_matches_the_core():
    vp, wp = sentinel_plans(6, 2)
    sg.launch_canary_plan_kernels_torch_reference(verify_plan_out=vp, write_plan_out=wp, **small_inputs())
    assert vp.verify_slot_indices.tolist()[:3] == [1016, 1017, 1018]
    assert vp.verify_expected_tokens.tolist()[:3] == [716, 717, -1]  # valid_lens[0] = 2
    assert vp.verify_prev_slot_indices.tolist()[:3] == [-1, 1016, 1017]
    assert vp.verify_slot_indices.tolist()[3:] == [SENTINEL] * 3
    assert (int(vp.verify_num_valid), int(vp.enable), int(vp.status)) == (3, 1, 0)
    assert wp.write_offsets.tolist() == [0, 1, 5]
    assert wp.write_seed_slot_indices.tolist() == [1018, -1]
    assert int(wp.write_num_valid_reqs) == 2


dtype_choices = st.fixed_dictionaries({
    "per_request": st.sampled_from([torch.int32, torch.int64, torch.float64]),
    "req_to_token": st.sampled_from([torch.int32, torch.int64]),
    "lut": st.sampled_from([torch.int32, torch.int64]),
    "pool": st.sampled_from([torch.int32, torch.int64]),
    "lens": st.sampled_from([torch.int32, torch.int64]),
    "strided": st.booleans(),
})


def converted(arr, dtype, strided: bool):
    """``arr`` as a tensor of ``dtype``, optionally as a non-contiguous view with the same values."""
    if arr is None:
        return None
    t = torch.from_numpy(np.array(arr, copy=True)).to(dtype)
    if not strided or t.ndim != 1:
        return t
    wide = torch.zeros(2 * t.shape[0], dtype=dtype)
    wide[::2] = t
    return wide[::2]


@settings(max_examples=60, deadline=None)
@given(strategies.plan_cases(max_bs=10), dtype_choices)
def test_torch_reference_converts_input_dtypes_like_sglang(case, dtypes):
    k = case.kwargs
    strided = dtypes["strided"]
    inputs = {
        **k,
        "req_pool_indices": converted(k["req_pool_indices"], dtypes["per_request"], strided),
        "prefix_lens": converted(k["prefix_lens"], dtypes["per_request"], strided),
        "extend_seq_lens": converted(k["extend_seq_lens"], dtypes["per_request"], strided),
        "req_to_token": converted(k["req_to_token"], dtypes["req_to_token"], strided),
        "full_to_swa_index_mapping": converted(k["full_to_swa_index_mapping"], dtypes["lut"], strided),
        "req_to_verify_expected_tokens": converted(k["req_to_verify_expected_tokens"], dtypes["pool"], strided),
        "req_to_verify_expected_tokens_valid_lens": converted(k["req_to_verify_expected_tokens_valid_lens"],
                                                              dtypes["lens"], strided),
    }
    vp, wp = sentinel_plans(k["verify_capacity"], case.write_req_capacity)
    sg.launch_canary_plan_kernels_torch_reference(verify_plan_out=vp, write_plan_out=wp, **inputs)
    assert_same_plan(plan_dict(vp, wp), run_plan("numpy", case))


def test_torch_reference_writes_back_into_strided_and_differently_typed_fields():
    parent = torch.full((12,), -5, dtype=torch.int64)
    vp, wp = sentinel_plans(6, 2)
    vp = sg.VerifyPlan(**{**vars(vp), "verify_slot_indices": parent[::2],
                          "verify_num_valid": torch.zeros(1, dtype=torch.int64)})
    wp = sg.WritePlan(**{**vars(wp), "write_seed_slot_indices": torch.zeros(2, dtype=torch.int32)})
    sg.launch_canary_plan_kernels_torch_reference(verify_plan_out=vp, write_plan_out=wp, **small_inputs())
    assert parent[::2].tolist() == [1016, 1017, 1018, -5, -5, -5]
    assert parent[1::2].tolist() == [-5] * 6  # the gaps of the strided view are not touched
    assert vp.verify_num_valid.dtype == torch.int64 and vp.verify_num_valid.tolist() == [3]
    assert wp.write_seed_slot_indices.tolist() == [1018, -1]


def test_torch_reference_writes_in_place_when_no_conversion_is_needed():
    vp, wp = sentinel_plans(6, 2)
    pointers = [t.data_ptr() for t in (*vars(vp).values(), *vars(wp).values())]
    sg.launch_canary_plan_kernels_torch_reference(verify_plan_out=vp, write_plan_out=wp, **small_inputs())
    assert [t.data_ptr() for t in (*vars(vp).values(), *vars(wp).values())] == pointers


def test_torch_reference_refuses_req_to_token_values_beyond_int32():
    rtt = torch.from_numpy(linear_rtt(4, 8)).to(torch.int64)
    rtt[3, 7] = 1 << 40
    vp, wp = sentinel_plans(6, 2)
    before = plan_bytes(vp, wp)
    with pytest.raises(ValueError, match=r"kv-canary: req_to_token holds values outside int32"):
        sg.launch_canary_plan_kernels_torch_reference(verify_plan_out=vp, write_plan_out=wp,
                                                      **small_inputs(req_to_token=rtt))
    assert plan_bytes(vp, wp) == before


def test_torch_reference_refuses_more_requests_than_write_capacity():
    # SGLang's reference truncated silently; this project refuses (SPEC §0.3), still writing nothing.
    vp, wp = sentinel_plans(6, 1)
    before = plan_bytes(vp, wp)
    with pytest.raises(ValueError, match=r"write_req_capacity 1"):
        sg.launch_canary_plan_kernels_torch_reference(verify_plan_out=vp, write_plan_out=wp, **small_inputs())
    assert plan_bytes(vp, wp) == before


def test_torch_reference_refuses_an_out_of_range_request_row_and_writes_nothing():
    vp, wp = sentinel_plans(6, 2)
    before = plan_bytes(vp, wp)
    with pytest.raises(ValueError, match=r"req_pool_indices\[0\]=9 is outside req_to_token's 4 rows"):
        sg.launch_canary_plan_kernels_torch_reference(verify_plan_out=vp, write_plan_out=wp,
                                                      **small_inputs(req_pool_indices=torch.tensor([9, 1])))
    assert plan_bytes(vp, wp) == before


# --- capture refusals ----------------------------------------------------------------------------------------

@pytest.fixture
def capturing(monkeypatch):
    """Make torch report an active CUDA-graph capture on the current stream."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)


def test_host_paths_refuse_to_run_under_capture(capturing):
    vp, wp = sentinel_plans(6, 2)
    ctx = sglang_context()
    before = [*plan_bytes(vp, wp), ctx.canary_buf.numpy().tobytes()]
    calls = {
        "launch_canary_plan_kernels_torch_reference": lambda: sg.launch_canary_plan_kernels_torch_reference(
            verify_plan_out=vp, write_plan_out=wp, **small_inputs()),
        "launch_canary_plan_kernels": lambda: sg.launch_canary_plan_kernels(
            verify_plan_out=vp, write_plan_out=wp, **small_inputs()),
        "launch_canary_verify_kernel": lambda: sg.launch_canary_verify_kernel(
            context=ctx, plan=vp, check_verify_expected_token=False),
        "launch_canary_write_kernel": lambda: sg.launch_canary_write_kernel(
            context=ctx, plan=wp, input_ids=torch.zeros(1, dtype=torch.int64),
            positions=torch.zeros(1, dtype=torch.int64), out_cache_loc=torch.zeros(1, dtype=torch.int64),
            enable_write_input_assert=False, expected_input_tokens=None, expected_input_positions=None),
        "launch_scatter_req_token_ids_kernel": lambda: sg.launch_scatter_req_token_ids_kernel(
            flat_in=torch.zeros(1, dtype=torch.int64), offsets=torch.tensor([0, 1]),
            req_pool_indices=torch.tensor([1]), pool_out=torch.zeros(2, 2, dtype=torch.int32)),
    }
    for name, call in calls.items():
        with pytest.raises(RuntimeError, match=rf"^kv-canary: {name} works on the host and must not run under "
                                               "CUDA-graph capture"):
            call()
    assert [*plan_bytes(vp, wp), ctx.canary_buf.numpy().tobytes()] == before


# --- write, verify, scatter ----------------------------------------------------------------------------------

VERIFY_FIELDS = {"verify_slot_indices": [5, 6, 7, 9], "verify_expected_tokens": [40, 41, 42, -1],
                 "verify_expected_positions": [0, 1, 2, 0], "verify_prev_slot_indices": [-1, 5, 6, -1],
                 "verify_num_valid": [4], "enable": [1], "status": [0]}
WRITE_FIELDS = {"write_offsets": [0, 3, 4], "write_seed_slot_indices": [-1, -1], "write_num_valid_reqs": [2],
                "verify_offsets": [0, 0, 0]}
INT32_FIELDS = ("verify_num_valid", "enable", "status", "write_num_valid_reqs")
TOKENS = {"input_ids": [40, 41, 43, 77], "positions": [0, 1, 2, 0], "out_cache_loc": [5, 6, 7, 9]}


def as_np(name, values):
    return np.array(values, np.int32 if name in INT32_FIELDS else np.int64)


def test_write_and_verify_through_the_compat_names_match_the_core_on_numpy():
    ctx_t = sglang_context()
    sg.launch_canary_write_kernel(
        context=ctx_t, plan=sg.WritePlan(**{k: tensor(as_np(k, v)) for k, v in WRITE_FIELDS.items()}),
        **{k: torch.tensor(v) for k, v in TOKENS.items()}, enable_write_input_assert=False,
        expected_input_tokens=None, expected_input_positions=None)
    sg.launch_canary_verify_kernel(
        context=ctx_t, plan=sg.VerifyPlan(**{k: tensor(as_np(k, v)) for k, v in VERIFY_FIELDS.items()}),
        check_verify_expected_token=True)

    ctx_n = kc.VerifyOrWriteContext.allocate(num_slots=16, ring_capacity=8, kernel_kind=sg.CanaryLaunchTag.TAIL_V_SWA,
                                             enable_chain_position_assert=True)
    kc.launch_canary_write_kernel(
        context=ctx_n, plan=kc.WritePlan(**{k: as_np(k, v) for k, v in WRITE_FIELDS.items()}),
        **{k: np.array(v) for k, v in TOKENS.items()}, enable_write_input_assert=False)
    kc.launch_canary_verify_kernel(
        context=ctx_n, plan=kc.VerifyPlan(**{k: as_np(k, v) for k, v in VERIFY_FIELDS.items()}),
        check_verify_expected_token=True)

    for f in ("canary_buf", "violation_ring", "violation_write_index", "slot_run_counter", "kernel_run_counter",
              "status"):
        np.testing.assert_array_equal(getattr(ctx_t, f).numpy(), getattr(ctx_n, f), err_msg=f)
    assert int(ctx_t.violation_write_index) == 1  # token 43 written where 42 was expected
    assert ctx_t.violation_ring[0, 0].item() == int(sg.CanaryLaunchTag.TAIL_V_SWA)
    assert ctx_t.violation_ring[0, 1].item() == 7


def test_a_strided_torch_kv_cache_fingerprints_through_the_compat_names_like_a_contiguous_copy():
    from kvcanary_cupy.kv_layouts import flash_attn_source

    assert sg.KvByteLayout is kc.KvByteLayout
    # vLLM's flash-attention layout [blocks, heads, block_size, 2 * head_size] (K | V in the last axis), stored
    # with tokens outside heads (LBNHC), in bf16: slot = block * 4 + offset
    storage = torch.randn(4, 4, 2, 16, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    cache = storage.transpose(1, 2)
    ctx_t = sg.VerifyOrWriteContext.allocate(num_slots=16, ring_capacity=8,
                                             real_kv_sources=(flash_attn_source(cache, which="v", read_bytes=32),),
                                             real_kv_hash_mode=sg.RealKvHashMode.ALL)
    contiguous = storage[..., 8:].reshape(16, 16).contiguous().view(torch.uint8).numpy()  # V of each slot, 32 bytes
    ctx_n = kc.VerifyOrWriteContext.allocate(
        num_slots=16, ring_capacity=8, real_kv_hash_mode=kc.RealKvHashMode.ALL,
        real_kv_sources=(kc.RealKvSource(contiguous, page_size=1, num_bytes_per_token=32, read_bytes=32),))
    for ctx, xp in ((ctx_t, torch.tensor), (ctx_n, np.array)):
        write = sg.launch_canary_write_kernel if ctx is ctx_t else kc.launch_canary_write_kernel
        plan = {k: (tensor if ctx is ctx_t else lambda a: a)(as_np(k, v)) for k, v in WRITE_FIELDS.items()}
        write(context=ctx, plan=(sg.WritePlan if ctx is ctx_t else kc.WritePlan)(**plan),
              **{k: xp(v) for k, v in TOKENS.items()}, enable_write_input_assert=False,
              expected_input_tokens=None, expected_input_positions=None)
    np.testing.assert_array_equal(ctx_t.canary_buf.numpy(), ctx_n.canary_buf)
    assert (ctx_n.canary_buf.view(np.int64)[[5, 6, 7, 9], 3] != 0).all()
    cache[1, 1, 2, 8 + 3] += 1  # V of slot 6 (block 1, offset 2), head 1, element 3: read in place
    verify_plan = sg.VerifyPlan(**{k: tensor(as_np(k, v)) for k, v in VERIFY_FIELDS.items()})
    sg.launch_canary_verify_kernel(context=ctx_t, plan=verify_plan, check_verify_expected_token=False)
    assert int(ctx_t.violation_write_index) == 1
    assert ctx_t.violation_ring[0, 1].item() == 6
    assert ctx_t.violation_ring[0, 7].item() == int(sg.FailReason.VERIFY_REAL_KV_HASH_MISMATCH)


def test_scatter_kernel_name_fills_a_torch_pool():
    pool = torch.full((3, 4), -1, dtype=torch.int32)
    sg.launch_scatter_req_token_ids_kernel(flat_in=torch.tensor([1, 2, 3, 4, 5, 6]), offsets=torch.tensor([0, 2, 6]),
                                           req_pool_indices=torch.tensor([2, 0]), pool_out=pool)
    assert pool.tolist() == [[3, 4, 5, 6], [-1, -1, -1, -1], [1, 2, -1, -1]]


def test_scatter_dtype_errors_are_value_errors():
    with pytest.raises(ValueError, match=r"kv-canary: flat_in must have dtype int64, got int32"):
        sg.launch_scatter_req_token_ids_kernel(flat_in=torch.tensor([1], dtype=torch.int32),
                                               offsets=torch.tensor([0, 1]), req_pool_indices=torch.tensor([1]),
                                               pool_out=torch.zeros(2, 2, dtype=torch.int32))
