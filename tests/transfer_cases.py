"""Random canary record transfers for the transfer tests (CPU and GPU): a canary buffer, a slot map and records."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from hypothesis import strategies as st

HOSTILE_SLOTS = (-1, -(1 << 40), -(1 << 63))


@dataclass(frozen=True)
class TransferCase:
    canary: np.ndarray  # uint8 [num_slots, stride]
    slots: np.ndarray  # int64 [n]
    records: np.ndarray  # int64 [n, 4] (scatter input; gather output starts as a copy)


@st.composite
def transfer_cases(draw: st.DrawFn, *, hostile: bool, distinct: bool) -> TransferCase:
    """Random slot maps over a random canary buffer (strides 32..64); ``hostile`` mixes in slots outside it."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    num_slots = draw(st.integers(1, 80))
    stride = draw(st.sampled_from([32, 40, 64]))
    n = draw(st.integers(0, min(num_slots, 40) if distinct else 60))
    slots = rng.permutation(num_slots)[:n] if distinct else rng.integers(0, num_slots, size=n)
    slots = slots.astype(np.int64)
    if hostile and n:
        for i in np.flatnonzero(rng.random(n) < 0.3):
            slots[i] = draw(st.sampled_from([num_slots, num_slots + 7, (1 << 63) - 1, *HOSTILE_SLOTS]))
    canary = rng.integers(0, 256, size=(num_slots, stride), dtype=np.uint8)
    records = rng.integers(-(1 << 63), (1 << 63) - 1, size=(n, 4), dtype=np.int64, endpoint=True)
    return TransferCase(canary, slots, records)
