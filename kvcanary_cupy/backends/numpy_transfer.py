"""The vectorized NumPy references of the canary record gather and scatter (kernels/transfer.cu).

Like the other references, each function checks the device values first and writes the caller's buffers
last: with ``on_invalid="raise"`` a slot (or page) outside the canary buffer raises before anything is
written; with ``"flag"`` the output matches the kernels (zero records / skipped slots, SLOT_OUT_OF_RANGE in
``status``). Records move per page: entry ``k`` names page ``slots[k]`` of ``page_size`` slots starting at
``slots[k] * page_stride`` (a slot list is ``page_size = page_stride = 1``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._errors import fail
from ..constants import CANARY_FIELDS_PER_SLOT, CanaryStatus


def _outside(launch: Any, on_invalid: str, what: str) -> np.ndarray:
    """Per record: whether its page lies outside the canary buffer."""
    num_slots = int(launch.canary.shape[0])
    size, step = launch.page_size, launch.page_stride
    in_buffer = 0 if num_slots < size else (num_slots - size) // step + 1
    pages = launch.slots
    outside = (pages < 0) | (pages >= in_buffer)
    if on_invalid == "raise" and outside.any():
        i = int(np.argmax(outside))
        if size == 1:
            fail(f"slots[{i}]={int(pages[i])} is outside the {num_slots} slots of canary_buf ({what})")
        fail(f"pages[{i}]={int(pages[i])} is outside the {num_slots} slots of canary_buf (pages of {size} slots, "
             f"{step} apart; {what})")
    return np.repeat(outside, size) if size > 1 else outside


def _record_slots(launch: Any, outside: np.ndarray) -> np.ndarray:
    """The slot of every record (0 where its page is outside the buffer, never followed)."""
    size = launch.page_size
    pages = np.repeat(launch.slots, size) if size > 1 else launch.slots
    if outside.any():
        pages = np.where(outside, 0, pages)
    if size == 1:
        return pages if launch.page_stride == 1 else pages * launch.page_stride
    return pages * launch.page_stride + np.tile(np.arange(size, dtype=np.int64), launch.slots.shape[0])


def _flag(launch: Any, outside: np.ndarray) -> None:
    if launch.status is not None and outside.any():
        launch.status[0] |= int(CanaryStatus.SLOT_OUT_OF_RANGE)


def _fields(launch: Any) -> Any:
    canary = launch.canary
    return canary if canary.shape[1] == CANARY_FIELDS_PER_SLOT else canary[:, :CANARY_FIELDS_PER_SLOT]


def gather_records_reference(launch: Any, on_invalid: str) -> None:
    outside = _outside(launch, on_invalid, "gather")
    slots = _record_slots(launch, outside)
    np.take(_fields(launch), slots, axis=0, out=launch.records, mode="clip")
    if outside.any():
        launch.records[outside] = 0
        _flag(launch, outside)


def scatter_records_reference(launch: Any, on_invalid: str) -> None:
    outside = _outside(launch, on_invalid, "scatter")
    slots = _record_slots(launch, outside)
    # Fancy assignment applies duplicates in order (the last record wins); the kernels require distinct slots.
    if not outside.any():
        _fields(launch)[slots] = launch.records
        return
    keep = ~outside
    _fields(launch)[slots[keep]] = launch.records[keep]
    _flag(launch, outside)
