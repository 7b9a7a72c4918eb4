"""The plan launcher's ValueError contract (SPEC §0): one test per class of bad input.

Each test checks the message (``kv-canary: `` first, the offending argument named) and that every output
buffer is byte-for-byte what it was before the call.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from plan_helpers import fresh_plans, linear_rtt

import kvcanary_cupy as kc
from kvcanary_cupy.backends import unavailable_reason

RTT = linear_rtt(4, 32)

CPU_BACKENDS = [
    "numpy",
    pytest.param("host", marks=pytest.mark.skipif(unavailable_reason("host") is not None,
                                                  reason=f"host backend: {unavailable_reason('host')}")),
]


def good_kwargs(**overrides):
    vp, wp = fresh_plans(capacity=16, write_capacity=4)
    kwargs = {
        "verify_plan_out": vp,
        "write_plan_out": wp,
        "req_pool_indices": np.array([1, 2], np.int64),
        "prefix_lens": np.array([3, 4], np.int64),
        "extend_seq_lens": np.array([1, 1], np.int64),
        "req_to_token": RTT,
        "swa_window_size": 0,
        "full_to_swa_index_mapping": None,
        "verify_capacity": 16,
        "req_to_verify_expected_tokens": None,
        "req_to_verify_expected_tokens_valid_lens": None,
        "kv_token_id_vs_position_offset": 0,
    }
    kwargs.update(overrides)
    return kwargs


def snapshot(kwargs) -> list[bytes]:
    out = []
    for plan in (kwargs["verify_plan_out"], kwargs["write_plan_out"]):
        if not dataclasses.is_dataclass(plan):
            continue
        for f in dataclasses.fields(plan):
            arr = getattr(plan, f.name)
            if isinstance(arr, np.ndarray):
                out.append(arr.tobytes())
    return out


def assert_rejected(kwargs, *fragments, backend="numpy", **launch):
    before = snapshot(kwargs)
    with pytest.raises(ValueError) as info:
        kc.launch_canary_plan_kernels(**kwargs, backend=backend, **launch)
    message = str(info.value)
    assert message.startswith("kv-canary: "), message
    for fragment in fragments:
        assert fragment in message, message
    assert snapshot(kwargs) == before, "a call that raised changed an output buffer"
    return message


def test_good_call_succeeds():
    kwargs = good_kwargs()
    kc.launch_canary_plan_kernels(**kwargs)
    assert int(kwargs["verify_plan_out"].verify_num_valid[0]) == 7


@pytest.mark.parametrize("backend", CPU_BACKENDS)
class TestHostVisibleChecks:
    def test_wrong_dtype(self, backend):
        assert_rejected(good_kwargs(req_pool_indices=np.array([1, 2], np.int32)), "req_pool_indices",
                        "int64", backend=backend)
        assert_rejected(good_kwargs(req_to_token=RTT.astype(np.int64)), "req_to_token", "int32", backend=backend)

    def test_wrong_output_dtype(self, backend):
        kwargs = good_kwargs()
        vp = dataclasses.replace(kwargs["verify_plan_out"], enable=np.ones(1, np.int64))
        assert_rejected({**kwargs, "verify_plan_out": vp}, "verify_plan_out.enable", "int32", backend=backend)

    def test_wrong_rank(self, backend):
        assert_rejected(good_kwargs(prefix_lens=np.array([[3, 4]], np.int64)), "prefix_lens", "1-D",
                        backend=backend)
        assert_rejected(good_kwargs(req_to_token=RTT.reshape(-1)), "req_to_token", "2-D", backend=backend)

    def test_wrong_length(self, backend):
        assert_rejected(good_kwargs(extend_seq_lens=np.array([1, 1, 1], np.int64)), "extend_seq_lens",
                        backend=backend)

    def test_non_contiguous(self, backend):
        strided = np.array([1, 9, 2, 9], np.int64)[::2]
        assert_rejected(good_kwargs(req_pool_indices=strided), "req_pool_indices", "contiguous", backend=backend)

    def test_capacity_mismatch(self, backend):
        assert_rejected(good_kwargs(verify_capacity=15), "verify_capacity=15", backend=backend)

    def test_batch_larger_than_write_capacity(self, backend):
        kwargs = good_kwargs(req_pool_indices=np.arange(1, 6, dtype=np.int64),
                             prefix_lens=np.ones(5, np.int64), extend_seq_lens=np.ones(5, np.int64))
        assert_rejected(kwargs, "write_req_capacity 4", backend=backend)

    def test_swa_window_without_lut(self, backend):
        assert_rejected(good_kwargs(swa_window_size=8), "swa_window_size=8", "full_to_swa_index_mapping",
                        backend=backend)

    def test_empty_lut(self, backend):
        assert_rejected(good_kwargs(swa_window_size=8, full_to_swa_index_mapping=np.zeros(0, np.int64)),
                        "full_to_swa_index_mapping", "empty", backend=backend)

    def test_pool_without_valid_lens_has_the_exact_message(self, backend):
        message = assert_rejected(good_kwargs(req_to_verify_expected_tokens=np.zeros((4, 8), np.int32)),
                                  backend=backend)
        assert message == ("kv-canary: launch_canary_plan_kernels requires "
                           "req_to_verify_expected_tokens_valid_lens when req_to_verify_expected_tokens is set")

    def test_read_only_output(self, backend):
        kwargs = good_kwargs()
        kwargs["write_plan_out"].write_offsets.flags.writeable = False
        assert_rejected(kwargs, "write_plan_out.write_offsets", "read-only", backend=backend)

    def test_negative_window_and_offset_out_of_int32(self, backend):
        assert_rejected(good_kwargs(swa_window_size=-1), "swa_window_size", backend=backend)
        assert_rejected(good_kwargs(kv_token_id_vs_position_offset=1 << 31), "kv_token_id_vs_position_offset",
                        backend=backend)

    def test_scalar_that_is_not_an_int(self, backend):
        assert_rejected(good_kwargs(verify_capacity=16.0), "verify_capacity", "int", backend=backend)
        assert_rejected(good_kwargs(swa_window_size=True), "swa_window_size", backend=backend)

    def test_not_an_array(self, backend):
        assert_rejected(good_kwargs(prefix_lens=[3, 4]), "prefix_lens", "must be an array", backend=backend)

    def test_wrong_plan_type(self, backend):
        assert_rejected(good_kwargs(verify_plan_out=object()), "verify_plan_out", "VerifyPlan", backend=backend)


def test_batch_above_the_supported_maximum(monkeypatch):
    monkeypatch.setattr(kc.plan, "MAX_PLAN_BATCH_SIZE", 1)
    assert_rejected(good_kwargs(), "at most 1")


def test_unknown_backend_lists_what_is_available():
    message = assert_rejected(good_kwargs(), "backend='tpu'", "numpy", backend="tpu")
    assert "available here" in message


@pytest.mark.skipif(unavailable_reason("cuda") is None, reason="a CUDA device is present")
def test_unavailable_backend_says_why():
    assert_rejected(good_kwargs(), "backend='cuda'", backend="cuda")


def test_on_invalid_raise_needs_the_numpy_backend():
    if unavailable_reason("host") is not None:
        pytest.skip(f"host backend: {unavailable_reason('host')}")
    assert_rejected(good_kwargs(), "on_invalid='raise'", backend="host", on_invalid="raise")


def test_bad_on_invalid_value():
    assert_rejected(good_kwargs(), "on_invalid", on_invalid="ignore")


def test_allocate_rejects_non_positive_capacity():
    with pytest.raises(ValueError, match=r"^kv-canary: VerifyPlan verify_capacity must be positive"):
        kc.VerifyPlan.allocate(verify_capacity=0)
    with pytest.raises(ValueError, match=r"^kv-canary: WritePlan write_req_capacity must be positive"):
        kc.WritePlan.allocate(write_req_capacity=-3)
    with pytest.raises(ValueError, match=r"^kv-canary: device must be"):
        kc.VerifyPlan.allocate(verify_capacity=4, device="tpu")


@pytest.mark.parametrize("plan, argument", [(kc.VerifyPlan, "verify_capacity"), (kc.WritePlan, "write_req_capacity")])
def test_allocate_rejects_a_capacity_of_zero_the_boundary(plan, argument):
    with pytest.raises(ValueError, match=rf"^kv-canary: {plan.__name__} {argument} must be positive, got 0$"):
        plan.allocate(**{argument: 0})
    assert plan.allocate(**{argument: 1}) is not None


def test_allocation_bytes_matches_allocate():
    vp = kc.VerifyPlan.allocate(verify_capacity=100)
    wp = kc.WritePlan.allocate(write_req_capacity=10)
    assert kc.VerifyPlan.allocation_bytes(100) == sum(
        getattr(vp, f.name).nbytes for f in dataclasses.fields(vp))
    assert kc.WritePlan.allocation_bytes(10) == sum(getattr(wp, f.name).nbytes for f in dataclasses.fields(wp))


class TestDeviceValuesRaiseInTheReference:
    """Values a kernel could only flag are refused by the NumPy reference by default."""

    def test_request_row_outside_req_to_token(self):
        assert_rejected(good_kwargs(req_pool_indices=np.array([1, 9], np.int64)), "req_pool_indices[1]=9",
                        "4 rows")

    def test_negative_request_row(self):
        assert_rejected(good_kwargs(req_pool_indices=np.array([-2, 1], np.int64)), "req_pool_indices[0]=-2")

    def test_prefix_longer_than_the_row(self):
        assert_rejected(good_kwargs(prefix_lens=np.array([3, 33], np.int64)), "prefix_lens[1]=33", "32")

    def test_prefix_longer_than_the_row_without_a_seed(self):
        vp, wp = fresh_plans(capacity=64, write_capacity=4)
        assert_rejected(good_kwargs(prefix_lens=np.array([3, 40], np.int64), verify_plan_out=vp,
                                    write_plan_out=wp, verify_capacity=64,
                                    extend_seq_lens=np.array([1, 0], np.int64)), "prefix_lens[1]=40")

    def test_entry_checks_are_skipped_on_overflow(self):
        kwargs = good_kwargs(prefix_lens=np.array([3, 40], np.int64), extend_seq_lens=np.array([1, 0], np.int64))
        kc.launch_canary_plan_kernels(**kwargs)  # 43 entries > capacity 16: nothing gathered, nothing to refuse
        assert int(kwargs["verify_plan_out"].enable[0]) == 0

    def test_swa_slot_outside_the_lut(self):
        lut = np.arange(1040, dtype=np.int64)  # RTT values reach 1127
        assert_rejected(good_kwargs(swa_window_size=8, full_to_swa_index_mapping=lut), "req_to_token[",
                        "full_to_swa_index_mapping (length 1040)")

    def test_valid_length_beyond_the_pool_row(self):
        pool = np.zeros((4, 2), np.int32)
        assert_rejected(good_kwargs(req_to_verify_expected_tokens=pool,
                                    req_to_verify_expected_tokens_valid_lens=np.array([2, 9], np.int64)),
                        "req_to_verify_expected_tokens_valid_lens[1]=9")

    def test_pool_with_fewer_rows_than_the_request_row(self):
        pool = np.zeros((2, 8), np.int32)
        assert_rejected(good_kwargs(req_to_verify_expected_tokens=pool,
                                    req_to_verify_expected_tokens_valid_lens=np.array([8, 8], np.int64)),
                        "req_to_verify_expected_tokens[2,")

    def test_flag_mode_reports_instead(self):
        kwargs = good_kwargs(req_pool_indices=np.array([1, 9], np.int64))
        kc.launch_canary_plan_kernels(**kwargs, on_invalid="flag", backend="numpy")
        vp = kwargs["verify_plan_out"]
        assert int(vp.status[0]) == kc.PlanStatus.REQ_POOL_INDEX_OUT_OF_RANGE
        n = int(vp.verify_num_valid[0])
        assert vp.verify_slot_indices[:n].tolist() == [1032, 1033, 1034, 0, 0, 0, 0]
        assert vp.verify_prev_slot_indices[:n].tolist() == [-1, 1032, 1033, 0, 0, 0, 0]
        assert vp.verify_expected_positions[:n].tolist() == [0, 1, 2, 0, 1, 2, 3]
        assert kwargs["write_plan_out"].write_seed_slot_indices[:2].tolist() == [1034, -1]
