"""The record gather / scatter kernels (kernels/transfer.cu) on a real GPU against the NumPy reference, hostile
slots included, and the receiver's whole-prefix verify on CUDA arrays.

Every test is marked ``gpu``; the suite's conftest skips them with a reason where no CUDA device is visible.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from transfer_cases import transfer_cases

import kvcanary_cupy as kc

pytestmark = pytest.mark.gpu
cp = pytest.importorskip("cupy")


def _reference(fn, **arrays):
    status = np.zeros(1, np.int32)
    fn(**arrays, status=status, backend="numpy", on_invalid="flag")
    return status


@settings(max_examples=200, deadline=None)
@given(transfer_cases(hostile=True, distinct=False))
def test_gather_matches_reference(case):
    want = case.records.copy()
    want_status = _reference(kc.gather_canary_records, canary_buf=case.canary, slots=case.slots, records_out=want)
    got = cp.asarray(case.records)
    status = cp.zeros(1, cp.int32)
    kc.gather_canary_records(canary_buf=cp.asarray(case.canary), slots=cp.asarray(case.slots), records_out=got,
                             status=status)
    np.testing.assert_array_equal(got.get(), want)
    assert int(status.get()[0]) == int(want_status[0])


@settings(max_examples=200, deadline=None)
@given(transfer_cases(hostile=True, distinct=True))
def test_scatter_matches_reference(case):
    want = case.canary.copy()
    want_status = _reference(kc.scatter_canary_records, records=case.records, slots=case.slots, canary_buf=want)
    got = cp.asarray(case.canary)
    status = cp.zeros(1, cp.int32)
    kc.scatter_canary_records(records=cp.asarray(case.records), slots=cp.asarray(case.slots), canary_buf=got,
                              status=status)
    np.testing.assert_array_equal(got.get(), want)
    assert int(status.get()[0]) == int(want_status[0])


def test_records_move_between_gpu_buffers_and_verify_under_other_slot_numbers():
    n = 40
    tokens = cp.arange(1, n + 1, dtype=cp.int64) * 7
    src = kc.VerifyOrWriteContext.allocate(num_slots=64, device="cuda")
    wp = kc.WritePlan.allocate(write_req_capacity=1, device="cuda")
    wp.write_offsets[:2] = cp.asarray([0, n])
    wp.write_seed_slot_indices[0] = -1
    wp.write_num_valid_reqs[0] = 1
    src_slots = cp.asarray(np.random.default_rng(0).permutation(63)[:n] + 1)
    kc.launch_canary_write_kernel(context=src, plan=wp, input_ids=tokens, positions=cp.arange(n, dtype=cp.int64),
                                  out_cache_loc=src_slots, enable_write_input_assert=False)
    records = cp.empty((n, 4), cp.int64)
    kc.gather_canary_records(canary_buf=src.canary_buf, slots=src_slots, records_out=records)
    dst = kc.VerifyOrWriteContext.allocate(num_slots=128, device="cuda")
    dst_slots = cp.asarray(np.random.default_rng(1).permutation(127)[:n] + 1)
    records[17, 1] += 1  # one damaged position field
    kc.scatter_canary_records(records=records, slots=dst_slots, canary_buf=dst.canary_buf)
    req_to_token = cp.zeros((2, 64), cp.int32)
    req_to_token[1, :n] = dst_slots.astype(cp.int32)
    pool = cp.zeros((2, 64), cp.int32)
    pool[1, :n] = tokens.astype(cp.int32)
    verifier = kc.ReceivedPrefixVerifier(verify_capacity=256, max_requests=2, device="cuda")
    verifier.verify(context=dst, req_pool_indices=cp.asarray([1], cp.int64), received_lens=cp.asarray([n], cp.int64),
                    req_to_token=req_to_token, req_to_verify_expected_tokens=pool,
                    req_to_verify_expected_tokens_valid_lens=cp.asarray([n], cp.int64))
    # Rows carry the stored position: the damaged record (position 17 stored as 18) fails its position check,
    # and its successor (position 18) its chain check.
    rows = sorted((v.position, v.reason_bits) for v in kc.read_violations(dst).rows)
    assert rows == sorted([(18, int(kc.FailReason.VERIFY_POSITION_MISMATCH)),
                           (18, int(kc.FailReason.VERIFY_CHAIN_HASH_MISMATCH))])
