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
