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


@dataclass(frozen=True)
class PageCase:
    canary: np.ndarray  # uint8 [num_slots, stride]
    pages: np.ndarray  # int64 [p]
    page_size: int
    page_stride: int
    records: np.ndarray  # int64 [p * page_size, 4]


@st.composite
def page_cases(draw: st.DrawFn, *, hostile: bool, distinct: bool) -> PageCase:
    """Random page lists (page sizes 1..8, strides up to twice that) over a random canary buffer; ``hostile``
    mixes in pages outside it, among them ids whose slot arithmetic would overflow int64."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    size = draw(st.integers(1, 8))
    step = draw(st.integers(size, 2 * size))
    num_slots = draw(st.integers(1, 120))
    stride = draw(st.sampled_from([32, 40, 64]))
    in_buffer = 0 if num_slots < size else (num_slots - size) // step + 1
    p = draw(st.integers(0, min(in_buffer, 12) if distinct else 12))
    pages = rng.permutation(in_buffer)[:p] if distinct else rng.integers(0, max(in_buffer, 1), size=p)
    pages = pages.astype(np.int64)
    if (hostile or in_buffer == 0) and p:
        for i in np.flatnonzero(rng.random(p) < (1.0 if in_buffer == 0 else 0.3)):
            pages[i] = draw(st.sampled_from([in_buffer, in_buffer + 3, (1 << 62) // step, (1 << 63) - 1,
                                             *HOSTILE_SLOTS]))
    canary = rng.integers(0, 256, size=(num_slots, stride), dtype=np.uint8)
    records = rng.integers(-(1 << 63), (1 << 63) - 1, size=(p * size, 4), dtype=np.int64, endpoint=True)
    return PageCase(canary, pages, size, step, records)
