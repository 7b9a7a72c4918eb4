"""Offload / restore of canary records in pages (kernels/transfer.cu) on a real GPU against the NumPy reference,
hostile page ids included (ids past the buffer, ids whose slot arithmetic would overflow).

Every test is marked ``gpu``; the suite's conftest skips them with a reason where no CUDA device is visible.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from transfer_cases import page_cases

import kvcanary_cupy as kc

pytestmark = pytest.mark.gpu
cp = pytest.importorskip("cupy")


@settings(max_examples=200, deadline=None)
@given(page_cases(hostile=True, distinct=False))
def test_offload_of_pages_matches_reference(case):
    want, want_status = case.records.copy(), np.zeros(1, np.int32)
    kc.offload_canary_records(canary_buf=case.canary, pages=case.pages, page_size=case.page_size,
                              page_stride=case.page_stride, records_out=want, status=want_status, backend="numpy",
                              on_invalid="flag")
    got, status = cp.asarray(case.records), cp.zeros(1, cp.int32)
    kc.offload_canary_records(canary_buf=cp.asarray(case.canary), pages=cp.asarray(case.pages),
                              page_size=case.page_size, page_stride=case.page_stride, records_out=got, status=status)
    np.testing.assert_array_equal(got.get(), want)
    assert int(status.get()[0]) == int(want_status[0])


@settings(max_examples=200, deadline=None)
@given(page_cases(hostile=True, distinct=True))
def test_restore_of_pages_matches_reference(case):
    want, want_status = case.canary.copy(), np.zeros(1, np.int32)
    kc.restore_canary_records(records=case.records, pages=case.pages, page_size=case.page_size,
                              page_stride=case.page_stride, canary_buf=want, status=want_status, backend="numpy",
                              on_invalid="flag")
    got, status = cp.asarray(case.canary), cp.zeros(1, cp.int32)
    kc.restore_canary_records(records=cp.asarray(case.records), pages=cp.asarray(case.pages),
                              page_size=case.page_size, page_stride=case.page_stride, canary_buf=got, status=status)
    np.testing.assert_array_equal(got.get(), want)
    assert int(status.get()[0]) == int(want_status[0])
