"""Host-side reading of the violation ring: decoded rows, the true total even past capacity, a table.

Reading copies the ring to the host, which synchronises with the device: an engine does it one step later,
after an asynchronous copy of ``violation_write_index`` said there is something to read (SPEC §7.5).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ._errors import fail
from ._validate import array_arg, int_arg
from .constants import (
    VIOLATION_FIELD_EXPECTED_AUX,
    VIOLATION_FIELD_EXPECTED_TOKEN,
    VIOLATION_FIELD_FAIL_REASON_BITS,
    VIOLATION_FIELD_KERNEL_KIND,
    VIOLATION_FIELD_POSITION,
    VIOLATION_FIELD_SLOT_IDX,
    VIOLATION_FIELD_STORED_CHAIN_HASH,
    VIOLATION_FIELD_STORED_TOKEN,
    VIOLATION_FIELDS,
    CanaryLaunchTag,
    CanaryStatus,
    FailReason,
    reason_names,
)
from .context import VerifyOrWriteContext

_WRITE_BITS = int(FailReason.WRITE_TOKEN_MISMATCH | FailReason.WRITE_POSITION_MISMATCH)


def to_host(arr: Any) -> np.ndarray:
    """A NumPy copy of a NumPy/CuPy/DLPack array or slice (synchronising for device arrays)."""
    if isinstance(arr, np.ndarray):
        return arr.copy()
    get = getattr(arr, "get", None)
    if callable(get):  # CuPy
        return get()
    from .dlpack import as_array

    view = as_array(arr, "array")
    return view.copy() if isinstance(view, np.ndarray) else view.get()


def _hex(value: int) -> str:
    return f"0x{value & 0xFFFFFFFFFFFFFFFF:016x}"


def tag_name(kind: int) -> str:
    try:
        return CanaryLaunchTag(kind).name
    except ValueError:
        return f"TAG_{kind}"


@dataclass(frozen=True)
class Violation:
    """One decoded ring row (SPEC §1.2)."""

    index: int
    launch_tag: str
    slot: int
    position: int
    stored_token: int
    expected_token: int
    stored_chain_hash: str  # unsigned hex
    expected_aux: int  # verify: expected chain hash (signed int64); write: expected position
    reason_bits: int
    reasons: tuple[str, ...]
    raw: tuple[int, ...] = field(repr=False)

    @property
    def is_write(self) -> bool:
        return bool(self.reason_bits & _WRITE_BITS)

    @property
    def expected_aux_text(self) -> str:
        return str(self.expected_aux) if self.is_write else _hex(self.expected_aux)

    @property
    def labels(self) -> list[str]:
        """SGLang-style reason labels: names lowercased without the ``_mismatch`` suffix."""
        return [name.lower().removesuffix("_mismatch") for name in self.reasons]

    def log_line(self) -> str:
        aux_key = "expected_position" if self.is_write else "expected_chain_hash"
        return (f"kv-canary violation index={self.index} tag={self.launch_tag} slot={self.slot} "
                f"position={self.position} stored_token={self.stored_token} "
                f"expected_token={self.expected_token} stored_chain_hash={self.stored_chain_hash} "
                f"{aux_key}={self.expected_aux_text} reasons={','.join(self.labels)}")


@dataclass(frozen=True)
class ViolationReport:
    total: int  # violations counted by the kernels, including those the full ring dropped
    capacity: int
    rows: list[Violation]
    status: CanaryStatus  # a flag enum, so also an int: 0 when the kernels refused nothing
    slot_run_counter: int
    kernel_run_counter: int

    @property
    def errored(self) -> bool:
        return self.total > 0

    @property
    def dropped(self) -> int:
        return max(0, self.total - self.capacity)

    @property
    def status_names(self) -> list[str]:
        return [str(m.name) for m in CanaryStatus if self.status & m.value]

    def table(self) -> str:
        return format_violations(self)


def decode_row(index: int, row: np.ndarray) -> Violation:
    values = tuple(int(v) for v in row)
    bits = values[VIOLATION_FIELD_FAIL_REASON_BITS]
    return Violation(
        index=index,
        launch_tag=tag_name(values[VIOLATION_FIELD_KERNEL_KIND]),
        slot=values[VIOLATION_FIELD_SLOT_IDX],
        position=values[VIOLATION_FIELD_POSITION],
        stored_token=values[VIOLATION_FIELD_STORED_TOKEN],
        expected_token=values[VIOLATION_FIELD_EXPECTED_TOKEN],
        stored_chain_hash=_hex(values[VIOLATION_FIELD_STORED_CHAIN_HASH]),
        expected_aux=values[VIOLATION_FIELD_EXPECTED_AUX],
        reason_bits=bits,
        reasons=tuple(reason_names(bits)),
        raw=values,
    )


def read_violations(context: Any, start: int = 0) -> ViolationReport:
    """Decode ring rows ``[start, min(write_index, capacity))`` of a :class:`VerifyOrWriteContext`.

    ``total`` is the kernels' count, which keeps growing after the ring is full; ``start`` lets a logger
    continue where it stopped.
    """
    if not isinstance(context, VerifyOrWriteContext):
        fail(f"context must be a VerifyOrWriteContext, got {type(context).__name__}")
    start = int_arg(start, "start")

    def one(arr: Any, name: str, dtype: type) -> Any:
        return array_arg(arr, name, dtype=dtype, ndim=1, shape=(1,))

    ring = array_arg(context.violation_ring, "context.violation_ring", dtype=np.int64, ndim=2,
                     shape=(None, VIOLATION_FIELDS))
    write_index = one(context.violation_write_index, "context.violation_write_index", np.int32)
    slot_counter = one(context.slot_run_counter, "context.slot_run_counter", np.int64)
    kernel_counter = one(context.kernel_run_counter, "context.kernel_run_counter", np.int64)
    status_arr = None if context.status is None else one(context.status, "context.status", np.int32)
    total = int(to_host(write_index)[0])
    capacity = int(ring.shape[0])
    begin, end = max(start, 0), min(max(total, 0), capacity)
    # Only the rows asked for cross to the host: a ring is sized for bursts, a step usually fills a few rows.
    landed = to_host(ring[begin:end]) if end > begin else np.zeros((0, 8), np.int64)
    rows = [decode_row(begin + k, row) for k, row in enumerate(landed)]
    status = CanaryStatus(int(to_host(status_arr)[0]) if status_arr is not None else 0)
    return ViolationReport(
        total=total, capacity=capacity, rows=rows, status=status,
        slot_run_counter=int(to_host(slot_counter)[0]), kernel_run_counter=int(to_host(kernel_counter)[0]),
    )


def format_violations(report: ViolationReport, limit: int = 50) -> str:
    """A fixed-width text table of the report (at most ``limit`` rows) with a summary line."""
    header = ("#", "tag", "slot", "pos", "stored_tok", "exp_tok", "stored_chain", "expected_aux", "reasons")
    lines = [header]
    for v in report.rows[:limit]:
        lines.append((str(v.index), v.launch_tag, str(v.slot), str(v.position), str(v.stored_token),
                      str(v.expected_token), v.stored_chain_hash, v.expected_aux_text, "|".join(v.labels)))
    widths = [max(len(line[c]) for line in lines) for c in range(len(header))]
    out = ["  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip() for line in lines]
    summary = f"{report.total} violation(s), {len(report.rows)} shown from a ring of {report.capacity}"
    if report.dropped:
        summary += f", {report.dropped} dropped after the ring filled"
    if len(report.rows) > limit:
        summary += f", table cut at {limit}"
    if report.status:
        summary += f"; status: {', '.join(report.status_names)}"
    return "\n".join([*out, summary])
