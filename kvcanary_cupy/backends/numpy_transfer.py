"""The vectorized NumPy references of the canary record gather and scatter (kernels/transfer.cu).

Like the other references, each function checks the device values first and writes the caller's buffers
last: with ``on_invalid="raise"`` a slot outside the canary buffer raises before anything is written; with
``"flag"`` the output matches the kernels (zero record / skipped slot, SLOT_OUT_OF_RANGE in ``status``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._errors import fail
from ..constants import CANARY_FIELDS_PER_SLOT, CanaryStatus


def _outside(launch: Any, on_invalid: str, what: str) -> np.ndarray:
    num_slots = int(launch.canary.shape[0])
    slots = launch.slots
    outside = (slots < 0) | (slots >= num_slots)
    if on_invalid == "raise" and outside.any():
        i = int(np.argmax(outside))
        fail(f"slots[{i}]={int(slots[i])} is outside the {num_slots} slots of canary_buf ({what})")
    return outside


def _flag(launch: Any, outside: np.ndarray) -> None:
    if launch.status is not None and outside.any():
        launch.status[0] |= int(CanaryStatus.SLOT_OUT_OF_RANGE)


def _fields(launch: Any) -> Any:
    canary = launch.canary
    return canary if canary.shape[1] == CANARY_FIELDS_PER_SLOT else canary[:, :CANARY_FIELDS_PER_SLOT]


def gather_records_reference(launch: Any, on_invalid: str) -> None:
    outside = _outside(launch, on_invalid, "gather")
    if not outside.any():  # the common case: one gather straight into the caller's buffer
        np.take(_fields(launch), launch.slots, axis=0, out=launch.records, mode="clip")
        return
    np.take(_fields(launch), np.where(outside, 0, launch.slots), axis=0, out=launch.records, mode="clip")
    launch.records[outside] = 0
    _flag(launch, outside)


def scatter_records_reference(launch: Any, on_invalid: str) -> None:
    outside = _outside(launch, on_invalid, "scatter")
    # Fancy assignment applies duplicates in order (the last record wins); the kernels require distinct slots.
    if not outside.any():
        _fields(launch)[launch.slots] = launch.records
        return
    keep = ~outside
    _fields(launch)[launch.slots[keep]] = launch.records[keep]
    _flag(launch, outside)
