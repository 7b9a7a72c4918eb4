"""Scalar oracle of the canary record transfer (kernels/transfer.cu): one record, one field at a time.

Written from the contract alone and importing nothing from ``kvcanary_cupy``: a record is the 4 leading
int64 fields of a slot; a slot outside ``[0, num_slots)`` is never followed (gather: zero record,
scatter: skipped) and raises status bit 1 (SLOT_OUT_OF_RANGE). Scatter applies records in order.
"""

from __future__ import annotations

import numpy as np

FIELDS = 4
STATUS_SLOT_OUT_OF_RANGE = 1


def _field(buf: np.ndarray, slot: int, f: int) -> int:
    return int.from_bytes(bytes(buf[slot, 8 * f : 8 * f + 8]), "little", signed=True)


def gather_records_oracle(canary_buf: np.ndarray, slots: np.ndarray) -> tuple[list[list[int]], int]:
    """The records (as Python ints) and the status bits of gathering ``slots`` from ``canary_buf`` (uint8 2-D)."""
    num_slots = int(canary_buf.shape[0])
    records, status = [], 0
    for slot in (int(s) for s in slots):
        if 0 <= slot < num_slots:
            records.append([_field(canary_buf, slot, f) for f in range(FIELDS)])
        else:
            records.append([0] * FIELDS)
            status |= STATUS_SLOT_OUT_OF_RANGE
    return records, status


def scatter_records_oracle(records: np.ndarray, slots: np.ndarray, canary_buf: np.ndarray) -> int:
    """Write ``records`` (int64 [n, 4]) into ``canary_buf`` (uint8 2-D, in place); returns the status bits."""
    num_slots = int(canary_buf.shape[0])
    status = 0
    for i, slot in enumerate(int(s) for s in slots):
        if not 0 <= slot < num_slots:
            status |= STATUS_SLOT_OUT_OF_RANGE
            continue
        for f in range(FIELDS):
            canary_buf[slot, 8 * f : 8 * f + 8] = np.frombuffer(
                int(records[i, f]).to_bytes(8, "little", signed=True), np.uint8)
    return status


# ---- pages (offload / restore down a cache hierarchy) --------------------------------------------------------
# Entry k of ``pages`` names page pages[k]: slots pages[k] * page_stride + j for j in [0, page_size). The page
# is in the buffer iff pages[k] >= 0 and its last slot pages[k] * page_stride + page_size - 1 < num_slots (Python
# integers: no overflow to worry about). Records are numbered k * page_size + j.


def _page_slots(page: int, page_size: int, page_stride: int, num_slots: int) -> list[int] | None:
    if page < 0 or page * page_stride + page_size > num_slots:
        return None
    return [page * page_stride + j for j in range(page_size)]


def offload_pages_oracle(canary_buf: np.ndarray, pages: np.ndarray, page_size: int,
                         page_stride: int) -> tuple[list[list[int]], int]:
    """The records (Python ints) and status bits of offloading ``pages`` of ``canary_buf`` (uint8 2-D)."""
    num_slots = int(canary_buf.shape[0])
    records, status = [], 0
    for page in (int(p) for p in pages):
        slots = _page_slots(page, page_size, page_stride, num_slots)
        if slots is None:
            records.extend([0] * FIELDS for _ in range(page_size))
            status |= STATUS_SLOT_OUT_OF_RANGE
            continue
        records.extend([_field(canary_buf, s, f) for f in range(FIELDS)] for s in slots)
    return records, status


def restore_pages_oracle(records: np.ndarray, pages: np.ndarray, page_size: int, page_stride: int,
                         canary_buf: np.ndarray) -> int:
    """Write ``records`` into the slots of ``pages`` of ``canary_buf`` (in place, in order); the status bits."""
    num_slots = int(canary_buf.shape[0])
    status = 0
    for k, page in enumerate(int(p) for p in pages):
        slots = _page_slots(page, page_size, page_stride, num_slots)
        if slots is None:
            status |= STATUS_SLOT_OUT_OF_RANGE
            continue
        for j, slot in enumerate(slots):
            for f in range(FIELDS):
                canary_buf[slot, 8 * f : 8 * f + 8] = np.frombuffer(
                    int(records[k * page_size + j, f]).to_bytes(8, "little", signed=True), np.uint8)
    return status
