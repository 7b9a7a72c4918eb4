"""Slot layouts: how the plan turns (request, position) into a KV slot.

Owns the three layout values a plan launch accepts (exactly one per launch) and their host-visible
validation:

* :class:`TokenTable` — SGLang's per-token table ``req_to_token[row, pos]`` (the ``req_to_token=`` argument);
* :class:`BlockTable` — one row of block ids per request (vLLM, transformers' continuous batching,
  TensorRT-LLM): ``slot = block_table[row, pos // block_size] * block_stride + pos % block_size``;
* :class:`PageList` — CSR page lists in batch order (FlashInfer's ``plan`` inputs): the pages of batch row
  ``r`` are ``kv_page_indices[kv_page_indptr[r]:kv_page_indptr[r+1]]``, ``slot = page * page_size + pos %
  page_size`` with ``page = pages[pos // page_size]``.

Everything else of the plan (SWA LUT, window, expected tokens, EAGLE offset, overflow, seeds, write offsets)
is the same for every layout. Block and page ids are device values: the kernels bounds-check them against
the row's blocks and the slot space (``num_slots``) and report :class:`~kvcanary_cupy.constants.PlanStatus`
bits, never reading outside a buffer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Union

import numpy as np

from ._errors import fail
from ._validate import array_arg, bool_arg, int_arg
from .dlpack import as_array

_INT32_MAX = (1 << 31) - 1
# With no num_slots every non-negative int32 id is in the slot space; id * stride stays below 2**62.
_UNBOUNDED_BLOCKS = 1 << 31


@dataclass(frozen=True)
class TokenTable:
    """SGLang's slot table: ``req_to_token`` int32 ``[max_reqs, max_seq_len]``, rows chosen by
    ``req_pool_indices`` (0 = padding row). ``req_to_token=X`` is the same as ``layout=TokenTable(X)``."""

    req_to_token: Any


@dataclass(frozen=True)
class BlockTable:
    """A block table: int32 ``[rows, max_blocks]`` of block ids.

    ``block_size``: tokens per block (> 0). ``block_stride``: slots between consecutive block ids (None means
    ``block_size``; transformers' ``block_physical_stride`` is larger). ``batch_rows``: False selects table
    rows with ``req_pool_indices`` like SGLang's table; True makes batch row ``r`` read table row ``r``
    (vLLM's persistent batch, no padding sentinel: ``req_pool_indices`` may then be None). ``num_slots``:
    the slot-space size; a block id ``b`` is valid iff ``b >= 0`` and ``b * block_stride + block_size <=
    num_slots`` (None: only negative ids are refused).
    """

    block_table: Any
    block_size: int
    block_stride: int | None = None
    batch_rows: bool = False
    num_slots: int | None = None


@dataclass(frozen=True)
class PageList:
    """CSR page lists in batch order: ``kv_page_indptr`` int32/int64 ``[bs+1]``, ``kv_page_indices`` int32
    ``[nnz]``, ``page_size`` tokens per page (> 0). ``req_pool_indices`` is optional with this layout.
    ``num_slots`` bounds the page ids as for :class:`BlockTable`."""

    kv_page_indptr: Any
    kv_page_indices: Any
    page_size: int
    num_slots: int | None = None


SlotLayout = Union[TokenTable, BlockTable, PageList]  # noqa: UP007 (a runtime alias, also for isinstance)


@dataclass(frozen=True)
class PagedSlots:
    """A validated :class:`BlockTable` or :class:`PageList`, in the one form the backends read.

    ``ids`` is the block table (2-D) or the page indices (1-D); ``indptr`` is None for a block table.
    Block ids in ``[0, num_blocks)`` are in the slot space.
    """

    ids: Any
    indptr: Any | None
    block_size: int
    block_stride: int
    num_blocks: int
    batch_rows: bool

    @property
    def is_page_list(self) -> bool:
        return self.indptr is not None


def layout_arrays(req_to_token: Any, layout: Any) -> tuple[Any, ...]:
    """The array arguments a launch reads for its layout (for stream scopes); tolerant of bad input, which
    :func:`prepare_layout` reports."""
    if isinstance(layout, TokenTable):
        return (req_to_token, layout.req_to_token)
    if isinstance(layout, BlockTable):
        return (req_to_token, layout.block_table)
    if isinstance(layout, PageList):
        return (req_to_token, layout.kv_page_indptr, layout.kv_page_indices)
    return (req_to_token,)


def _num_blocks(num_slots: Any, block_size: int, block_stride: int, name: str) -> int:
    if num_slots is None:
        return _UNBOUNDED_BLOCKS
    slots = int_arg(num_slots, f"{name}.num_slots", minimum=0)
    if slots < block_size:
        return 0
    return min((slots - block_size) // block_stride + 1, _UNBOUNDED_BLOCKS)


def prepare_layout(
    *, req_to_token: Any, layout: Any, bs: int, has_req_pool_indices: bool
) -> tuple[str, Any, list[tuple[str, Any]]]:
    """Validate the launch's layout. Returns ``(kind, value, named arrays)``: kind "token" with the
    ``req_to_token`` array, or kind "paged" with a :class:`PagedSlots`."""
    if req_to_token is not None and layout is not None:
        fail("req_to_token and layout are both given; pass exactly one (req_to_token=X is layout=TokenTable(X))")
    if req_to_token is None and layout is None:
        fail("one of req_to_token or layout is required (TokenTable, BlockTable or PageList)")
    if req_to_token is not None:
        layout = TokenTable(req_to_token)
    if isinstance(layout, TokenTable):
        rtt = array_arg(layout.req_to_token, "req_to_token", dtype=np.int32, ndim=2)
        if not has_req_pool_indices:
            fail("req_pool_indices is required with the token table (it selects req_to_token rows)")
        return "token", rtt, [("req_to_token", rtt)]
    if isinstance(layout, BlockTable):
        size = int_arg(layout.block_size, "layout.block_size", minimum=1, maximum=_INT32_MAX)
        stride = size if layout.block_stride is None else int_arg(
            layout.block_stride, "layout.block_stride", minimum=size, maximum=_INT32_MAX)
        batch_rows = bool_arg(layout.batch_rows, "layout.batch_rows")
        table = array_arg(layout.block_table, "layout.block_table", dtype=np.int32, ndim=2)
        if batch_rows and table.shape[0] < bs:
            fail(f"layout.block_table has {table.shape[0]} rows but the batch has {bs} (batch_rows=True reads "
                 "row r for batch row r)")
        if not batch_rows and not has_req_pool_indices:
            fail("req_pool_indices is required with BlockTable(batch_rows=False) (it selects block_table rows)")
        value = PagedSlots(table, None, size, stride, _num_blocks(layout.num_slots, size, stride, "layout"),
                           batch_rows)
        return "paged", value, [("layout.block_table", table)]
    if isinstance(layout, PageList):
        size = int_arg(layout.page_size, "layout.page_size", minimum=1, maximum=_INT32_MAX)
        indptr = as_array(layout.kv_page_indptr, "layout.kv_page_indptr")
        # int32 or int64 (FlashInfer takes either); anything else is named as not int32.
        indptr = array_arg(indptr, "layout.kv_page_indptr", dtype=np.int64 if indptr.dtype == np.int64 else np.int32,
                           ndim=1, shape=(bs + 1,))
        indices = array_arg(layout.kv_page_indices, "layout.kv_page_indices", dtype=np.int32, ndim=1)
        value = PagedSlots(indices, indptr, size, size, _num_blocks(layout.num_slots, size, size, "layout"), False)
        return "paged", value, [("layout.kv_page_indptr", indptr), ("layout.kv_page_indices", indices)]
    fail(f"layout must be a TokenTable, BlockTable or PageList, got {type(layout).__name__}")


__all__ = ["BlockTable", "PageList", "PagedSlots", "SlotLayout", "TokenTable", "layout_arrays", "prepare_layout"]
