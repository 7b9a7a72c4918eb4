"""Host-visible checks of the slot layouts: every bad layout argument is a ``kv-canary: `` ValueError naming
it, raised before any output is written, in every CPU backend, for the launcher and for ``bind_plan``."""

from __future__ import annotations

import numpy as np
import pytest
from test_plan_validation import CPU_BACKENDS, RTT, assert_rejected, good_kwargs, snapshot

import kvcanary_cupy as kc

TABLE = np.array([[0, 0], [3, 4], [1, 2]], np.int32)
INDPTR = np.array([0, 1, 3], np.int32)
PAGES = np.array([5, 6, 7], np.int32)


def paged(layout, **overrides):
    kwargs = good_kwargs(req_to_token=None, layout=layout)
    kwargs.update(overrides)
    return kwargs


def test_block_table_and_page_list_calls_succeed():
    for layout in (kc.BlockTable(TABLE, 4), kc.BlockTable(TABLE, 4, batch_rows=True), kc.PageList(INDPTR, PAGES, 4)):
        kwargs = paged(layout)
        kc.launch_canary_plan_kernels(**kwargs)
        assert int(kwargs["verify_plan_out"].verify_num_valid[0]) == 7


@pytest.mark.parametrize("backend", CPU_BACKENDS)
class TestLayoutChecks:
    def test_both_layouts_or_none(self, backend):
        assert_rejected(paged(kc.BlockTable(TABLE, 4), req_to_token=RTT), "req_to_token and layout",
                        backend=backend)
        assert_rejected(paged(None), "one of req_to_token or layout", backend=backend)
        assert_rejected(paged(RTT), "layout must be a TokenTable, BlockTable or PageList", backend=backend)

    def test_block_table_dtype_rank_contiguity(self, backend):
        assert_rejected(paged(kc.BlockTable(TABLE.astype(np.int64), 4)), "layout.block_table", "int32",
                        backend=backend)
        assert_rejected(paged(kc.BlockTable(TABLE.reshape(-1), 4)), "layout.block_table", "2-D", backend=backend)
        assert_rejected(paged(kc.BlockTable(np.asfortranarray(TABLE), 4)), "layout.block_table", "contiguous",
                        backend=backend)

    @pytest.mark.parametrize("size", [0, -4, 1 << 31, 4.0, True, np.array([4])])
    def test_block_size(self, backend, size):
        assert_rejected(paged(kc.BlockTable(TABLE, size)), "layout.block_size", backend=backend)
        assert_rejected(paged(kc.PageList(INDPTR, PAGES, size)), "layout.page_size", backend=backend)

    @pytest.mark.parametrize(("stride", "words"), [(3, ">= 4"), (1 << 31, "<="), (0, ">= 4"), ("8", "int")])
    def test_block_stride_at_least_block_size(self, backend, stride, words):
        assert_rejected(paged(kc.BlockTable(TABLE, 4, block_stride=stride)), "layout.block_stride", words,
                        backend=backend)

    def test_batch_rows_is_a_bool_and_covers_the_batch(self, backend):
        assert_rejected(paged(kc.BlockTable(TABLE, 4, batch_rows=1)), "layout.batch_rows", "bool", backend=backend)
        assert_rejected(paged(kc.BlockTable(TABLE[:1], 4, batch_rows=True)), "layout.block_table has 1 rows",
                        backend=backend)

    def test_num_slots(self, backend):
        assert_rejected(paged(kc.BlockTable(TABLE, 4, num_slots=-1)), "layout.num_slots", ">= 0", backend=backend)
        assert_rejected(paged(kc.PageList(INDPTR, PAGES, 4, num_slots=3.5)), "layout.num_slots", "int",
                        backend=backend)

    def test_req_pool_indices_required_where_it_selects_rows(self, backend):
        assert_rejected(paged(kc.BlockTable(TABLE, 4), req_pool_indices=None), "req_pool_indices is required",
                        backend=backend)
        assert_rejected(paged(kc.TokenTable(RTT), req_pool_indices=None), "req_pool_indices is required",
                        backend=backend)
        assert_rejected(good_kwargs(req_pool_indices=None), "req_pool_indices is required", backend=backend)

    def test_indptr_length_dtype_rank(self, backend):
        assert_rejected(paged(kc.PageList(INDPTR[:2], PAGES, 4)), "layout.kv_page_indptr", "(3,)", backend=backend)
        assert_rejected(paged(kc.PageList(INDPTR.astype(np.int16), PAGES, 4)), "layout.kv_page_indptr", "int32",
                        backend=backend)
        assert_rejected(paged(kc.PageList(INDPTR.astype(np.float64), PAGES, 4)), "layout.kv_page_indptr",
                        backend=backend)
        assert_rejected(paged(kc.PageList(INDPTR.reshape(1, -1), PAGES, 4)), "layout.kv_page_indptr", "1-D",
                        backend=backend)

    def test_page_indices_dtype_rank(self, backend):
        assert_rejected(paged(kc.PageList(INDPTR, PAGES.astype(np.int64), 4)), "layout.kv_page_indices", "int32",
                        backend=backend)
        assert_rejected(paged(kc.PageList(INDPTR, PAGES.reshape(1, -1), 4)), "layout.kv_page_indices", "1-D",
                        backend=backend)

    def test_batch_length_without_req_pool_indices(self, backend):
        kwargs = paged(kc.PageList(INDPTR, PAGES, 4), req_pool_indices=None,
                       extend_seq_lens=np.array([1, 1, 1], np.int64))
        assert_rejected(kwargs, "extend_seq_lens", backend=backend)


def test_bind_plan_validates_layouts_the_same_way():
    kwargs = paged(kc.BlockTable(TABLE, 4, block_stride=2))
    before = snapshot(kwargs)
    with pytest.raises(kc.CanaryArgumentError, match=r"^kv-canary: layout.block_stride must be >= 4"):
        kc.bind_plan(**kwargs)
    assert snapshot(kwargs) == before


def test_bound_block_table_plan_reads_refilled_tables():
    kwargs = paged(kc.BlockTable(TABLE.copy(), 4, batch_rows=True), req_pool_indices=None)
    bound = kc.bind_plan(**kwargs)
    bound()
    vp = kwargs["verify_plan_out"]
    first = vp.verify_slot_indices[:7].tolist()
    kwargs["layout"].block_table[1, 0] = 9
    bound()
    assert first == [0, 1, 2, 12, 13, 14, 15]
    assert vp.verify_slot_indices[:7].tolist() == [0, 1, 2, 36, 37, 38, 39]
