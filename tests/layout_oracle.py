"""Scalar oracle of the plan step for the paged layouts (block tables and CSR page lists).

Written request by request, position by position, from the layout rules (docs/slot-layouts.md, the
docstrings of kvcanary_cupy/layouts.py): no vectorisation and nothing shared with the package but its layout
dataclasses, used as plain containers. Returns :class:`oracle.PlanExpect`, so the same comparison helpers apply.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import oracle

import kvcanary_cupy as kc

ROW_OUT_OF_RANGE = 1
PREFIX_BEYOND_ROW = 2
SLOT_OUTSIDE_LUT = 4
EXPECTED_BEYOND_POOL = 8
BLOCK_ID_OUTSIDE_SLOTS = 16
POSITION_BEYOND_BLOCKS = 32
PAGE_INDPTR_INVALID = 64


class _Rows:
    """(row, position) -> (status bit or 0, raw slot) for one paged layout."""

    def __init__(self, layout: Any, rps: list[int] | None, bs: int) -> None:
        self.rps = rps
        if isinstance(layout, kc.BlockTable):
            self.table = np.asarray(layout.block_table).tolist()
            self.table_rows = len(self.table)
            self.width = int(np.asarray(layout.block_table).shape[1])
            self.size = int(layout.block_size)
            self.stride = self.size if layout.block_stride is None else int(layout.block_stride)
            self.batch_rows = bool(layout.batch_rows)
            self.indptr = None
        else:
            self.indptr = [int(v) for v in np.asarray(layout.kv_page_indptr).tolist()]
            self.pages = [int(v) for v in np.asarray(layout.kv_page_indices).tolist()]
            self.size = self.stride = int(layout.page_size)
            if len(self.indptr) != bs + 1:
                raise ValueError("kv_page_indptr must hold bs + 1 entries")
        self.num_slots = layout.num_slots

    def block_ids(self, r: int) -> tuple[int, list[int]]:
        """(bit, the row's block ids)."""
        if self.indptr is not None:
            a, b = self.indptr[r], self.indptr[r + 1]
            if a < 0 or b < a or b > len(self.pages):
                return PAGE_INDPTR_INVALID, []
            return 0, self.pages[a:b]
        row = r if self.batch_rows else self.rps[r]
        if not 0 <= row < self.table_rows:
            return ROW_OUT_OF_RANGE, []
        return 0, self.table[row]

    def id_ok(self, block_id: int) -> bool:
        if block_id < 0:
            return False
        return self.num_slots is None or block_id * self.stride + self.size <= self.num_slots

    def slot(self, r: int, pos: int) -> tuple[int, int]:
        bit, ids = self.block_ids(r)
        if bit:
            return bit, 0
        j = pos // self.size
        if j >= len(ids):
            return POSITION_BEYOND_BLOCKS, 0
        if not self.id_ok(ids[j]):
            return BLOCK_ID_OUTSIDE_SLOTS, 0
        return 0, ids[j] * self.stride + pos % self.size


def layout_slots(layout: Any, req_pool_indices: list[int] | None, bs: int, r: int, n: int) -> list[int]:
    """The slots of positions ``[0, n)`` of batch row ``r``, which must all be valid."""
    rows = _Rows(layout, req_pool_indices, bs)
    slots = []
    for pos in range(n):
        bit, slot = rows.slot(r, pos)
        if bit:
            raise ValueError(f"position {pos} of batch row {r} has no slot (status bit {bit})")
        slots.append(slot)
    return slots


def layout_plan_oracle(
    *,
    layout: Any,
    req_pool_indices: Any | None,
    prefix_lens: Any,
    extend_seq_lens: Any,
    swa_window_size: int,
    full_to_swa_index_mapping: Any | None,
    verify_capacity: int,
    req_to_verify_expected_tokens: Any | None,
    req_to_verify_expected_tokens_valid_lens: Any | None,
    kv_token_id_vs_position_offset: int,
    write_req_capacity: int,
) -> oracle.PlanExpect:
    prefixes = [int(v) for v in np.asarray(prefix_lens).tolist()]
    extends = [int(v) for v in np.asarray(extend_seq_lens).tolist()]
    bs = len(prefixes)
    rps = None if req_pool_indices is None else [int(v) for v in np.asarray(req_pool_indices).tolist()]
    rows = _Rows(layout, rps, bs)
    window = int(swa_window_size)
    capacity = int(verify_capacity)
    offset = int(kv_token_id_vs_position_offset)
    lut = None if full_to_swa_index_mapping is None else [int(v) for v in np.asarray(full_to_swa_index_mapping)]
    pool = None if req_to_verify_expected_tokens is None else np.asarray(req_to_verify_expected_tokens).tolist()
    pool_shape = (0, 0) if pool is None else np.asarray(req_to_verify_expected_tokens).shape
    lens = [] if pool is None else [int(v) for v in np.asarray(req_to_verify_expected_tokens_valid_lens).tolist()]
    status = 0

    def pool_row(r: int) -> int:
        return r if rps is None else rps[r]

    def active(r: int) -> bool:
        return rps is None or rps[r] != 0

    def lut_ok(raw: int) -> bool:
        return lut is None or raw < len(lut)

    def translate(raw: int) -> int:
        return raw if lut is None or raw < 0 else lut[raw]

    starts, counts, writes = [], [], []
    for r in range(bs):
        p = max(prefixes[r], 0)
        v = (min(p, window) if window > 0 else p) if active(r) else 0
        starts.append(p - v)
        counts.append(v)
        writes.append(max(extends[r], 0) if active(r) else 0)
    verify_offsets = [0]
    for v in counts:
        verify_offsets.append(verify_offsets[-1] + min(v, capacity + 1))
    total = verify_offsets[-1]
    write_offsets = [0]
    acc = 0
    for w in writes:
        acc = (acc + w) & oracle.U64_MASK
        write_offsets.append(oracle.to_i64(acc))

    entries = None
    if total <= capacity:
        entries = []
        for r in range(bs):
            for j in range(counts[r]):
                pos = starts[r] + j
                neutral = (0, -1, pos, 0)
                bit, raw = rows.slot(r, pos)
                raw_prev = -1
                if not bit and pos > 0:
                    bit, raw_prev = rows.slot(r, pos - 1)
                if not bit and not (lut_ok(raw) and lut_ok(raw_prev)):
                    bit = SLOT_OUTSIDE_LUT
                token = -1
                if not bit and pool is not None:
                    sot = pos + offset
                    if 0 <= sot < lens[r]:
                        rp = pool_row(r)
                        if not (0 <= rp < pool_shape[0] and sot < pool_shape[1]):
                            bit = EXPECTED_BEYOND_POOL
                        else:
                            token = pool[rp][sot]
                if bit:
                    status |= bit
                    entries.append(neutral)
                else:
                    entries.append((translate(raw), token, pos, translate(raw_prev)))

    seeds = []
    for r in range(bs):
        p = prefixes[r]
        if not active(r) or extends[r] <= 0 or p <= 0:
            seeds.append(-1)
            continue
        bit, raw = rows.slot(r, p - 1)
        if not bit and not lut_ok(raw):
            bit = SLOT_OUTSIDE_LUT
        status |= bit
        seeds.append(-1 if bit else translate(raw))

    return oracle.PlanExpect(
        entries=entries, verify_num_valid=min(total, capacity), enable=1 if total <= capacity else 0,
        write_offsets=write_offsets, write_offsets_tail_zeros=int(write_req_capacity) - bs, seeds=seeds,
        write_num_valid_reqs=bs, status=status, verify_offsets=verify_offsets,
    )
