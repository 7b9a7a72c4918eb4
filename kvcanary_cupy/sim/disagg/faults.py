"""Transfer faults: the ways a KV transfer between a prefill and a decode process goes wrong.

Sender-side kinds damage what leaves the prefill process (the payload in flight); receiver-side kinds damage
how it lands in the decode process's pool. The prefill process decides which transfer carries which fault
(one schedule for the whole run) and applies the sender-side ones; the transfer's header tells the decode
worker what was done, so that its :class:`~kvcanary_cupy.sim.faults.FaultTracker` can attribute violations
(sim bookkeeping only: the canary itself never looks at it). Every fault is checked to change something
(identical bytes would be a fault nobody can or needs to see); one that cannot be placed on this transfer
goes back to the schedule.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from ...constants import FailReason
from ..faults import VERIFY_ANY

R = FailReason


@dataclass(frozen=True)
class TransferKind:
    """One transfer fault kind (``name`` and ``allowed_bits`` as the engine fault kinds have them)."""

    name: str
    title: str
    summary: str
    side: str  # "sender" or "receiver"
    allowed_bits: int


_KINDS = (
    TransferKind("page-drop", "KV page dropped, destination keeps old contents",
                 "One page of the request's KV never lands; its destination slots keep their old bytes and the "
                 "received prefix's real-KV fingerprints do not match them.", "receiver",
                 int(R.VERIFY_REAL_KV_HASH_MISMATCH)),
    TransferKind("page-swap", "two KV pages swapped",
                 "Two pages of the request's KV arrive in each other's place; every slot of both holds bytes "
                 "whose fingerprint belongs to another position.", "sender", int(R.VERIFY_REAL_KV_HASH_MISMATCH)),
    TransferKind("short-transfer", "transfer completed short",
                 "The transfer reports success after its first pages; the tail of the prefix keeps old KV and old "
                 "canary records, which fail position, token, chain and fingerprint checks.", "receiver",
                 VERIFY_ANY),
    TransferKind("slot-owned", "destination slot still owned by another request",
                 "The receiver's allocator hands out a slot that a resident request still holds; the transfer "
                 "overwrites it and the resident's prefix no longer verifies.", "receiver", VERIFY_ANY),
    TransferKind("kv-bitflip-wire", "bit flipped in the KV payload in flight",
                 "One bit of the KV payload flips between the two processes; the received slot's fingerprint no "
                 "longer matches its record.", "sender", int(R.VERIFY_REAL_KV_HASH_MISMATCH)),
    TransferKind("record-bitflip-wire", "bit flipped in the canary payload in flight",
                 "One bit of a canary record flips in flight; its token, position, chain or fingerprint field no "
                 "longer fits (and the successor's chain breaks).", "sender", VERIFY_ANY),
    TransferKind("wrong-request", "records sent for the wrong request",
                 "The sender ships another request's canary records with this request's pages; tokens, chain "
                 "and fingerprints disagree with the receiver's request.", "sender", VERIFY_ANY),
)
TRANSFER_KINDS: dict[str, TransferKind] = {k.name: k for k in _KINDS}
KIND_INDEX = {name: i for i, name in enumerate(TRANSFER_KINDS)}
NO_FAULT = -1
DEFAULT_TRANSFER_RATE = 0.03  # probability that one transfer carries the kind


def kind_of(index: int) -> TransferKind | None:
    return None if index == NO_FAULT else _KINDS[index]


class FaultSchedule:
    """Which transfer carries which fault: after ``warmup`` transfers every requested kind once (in order),
    then each transfer draws at most one kind, kind ``k`` with probability ``rates[k]``. A kind that could not
    be placed goes back to the end of the queue of kinds still to place, so it does not hold up the others."""

    def __init__(self, rates: dict[str, float], warmup: int, rng: np.random.Generator) -> None:
        self.rates = dict(rates)
        self.warmup = warmup
        self.rng = rng
        self.pending: deque[str] = deque(k for k in TRANSFER_KINDS if k in rates)
        self.transfers = 0

    def next(self) -> str | None:
        self.transfers += 1
        if not self.rates or self.transfers <= self.warmup:
            return None
        if self.pending:
            return self.pending.popleft()
        for kind in TRANSFER_KINDS:
            if kind in self.rates and self.rng.random() < self.rates[kind]:
                return kind
        return None

    def retry(self, kind: str) -> None:
        self.pending.append(kind)


# ---- sender side: damage the payload ------------------------------------------------------------------------


def swap_pages(kv: np.ndarray, page_size: int, rng: np.random.Generator) -> tuple[int, int] | None:
    """Swap two whole KV pages of the payload in place (rows of ``page_size`` positions; equal lengths)."""
    full = kv.shape[0] // page_size
    if full < 2:
        return None
    i, j = (int(x) for x in rng.choice(full, size=2, replace=False))
    a, b = slice(i * page_size, (i + 1) * page_size), slice(j * page_size, (j + 1) * page_size)
    kv[a], kv[b] = kv[b].copy(), kv[a].copy()
    return i, j


def flip_kv_bit(kv: np.ndarray, words_per_source: int, partial: bool, rng: np.random.Generator) -> tuple[int, int, int]:
    """Flip one bit of the KV payload (int64 [n, row_words]) where the fingerprint reads it: any byte of a
    source's row, or its first 16 bytes in PARTIAL mode. Returns (position, word, bit)."""
    position = int(rng.integers(kv.shape[0]))
    source = int(rng.integers(kv.shape[1] // words_per_source))
    word = source * words_per_source + int(rng.integers(2 if partial else words_per_source))
    bit = int(rng.integers(64))
    kv.view(np.uint64)[position, word] ^= np.uint64(1 << bit)
    return position, word, bit


def flip_record_bit(records: np.ndarray, rng: np.random.Generator) -> tuple[int, int, int, int]:
    """Flip one bit of one record field (records int64 [buffers, n, 4]). Returns (buffer, position, field, bit)."""
    buffer, position = int(rng.integers(records.shape[0])), int(rng.integers(records.shape[1]))
    field, bit = int(rng.integers(4)), int(rng.integers(64))
    records.view(np.uint64)[buffer, position, field] ^= np.uint64(1 << bit)
    return buffer, position, field, bit


def differing_positions(a: np.ndarray, b: np.ndarray, axis: int = 0) -> np.ndarray:
    """Indices along ``axis`` where two equally shaped arrays differ anywhere."""
    diff = np.moveaxis(np.asarray(a) != np.asarray(b), axis, 0)
    return np.flatnonzero(diff.reshape(diff.shape[0], -1).any(axis=1))
