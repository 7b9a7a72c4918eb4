"""What the host learns each step, and what it does with it: :class:`StepReport`, the two exceptions of
``raise`` mode, and :func:`publish` (the ``log`` / ``raise`` policy: a bounded number of :mod:`logging` records
per step, each pointing at its runbook section)."""

from __future__ import annotations

import enum
import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from ..constants import CanaryStatus, FailReason, PlanStatus
from ..violations import Violation, ViolationReport

#: Rows of a group whose slot, position and reasons a step's log line spells out (the rest are counted).
DEFAULT_LOG_ROWS = 5

#: The runbook page, relative to the project's root (one section per reason and status flag).
RUNBOOK = "docs/violations.md"


def reason_anchor(name: str) -> str:
    """The runbook section of a :class:`~kvcanary_cupy.FailReason` name (``WRITE_TOKEN_MISMATCH`` ->
    ``docs/violations.md#reason-write-token-mismatch``)."""
    return f"{RUNBOOK}#reason-{name.lower().replace('_', '-')}"


def status_anchor(name: str) -> str:
    """The runbook section of a :class:`~kvcanary_cupy.CanaryStatus` or :class:`~kvcanary_cupy.PlanStatus` flag
    name (``SLOT_OUT_OF_RANGE`` -> ``docs/violations.md#status-slot-out-of-range``)."""
    return f"{RUNBOOK}#status-{name.lower().replace('_', '-')}"


def _flag_names(flag: type[enum.IntFlag], bits: int) -> str:
    names = [str(m.name) for m in flag if bits & m.value]
    rest = bits & ~sum(m.value for m in flag)
    return ", ".join(names + ([f"0x{rest:x}"] if rest else []))


@dataclass
class StepReport:
    """One ``finish_step()``: what the launches of ``launch_step`` (the step before) left behind.

    Attributes:
        step: the step this report was produced in (0-based count of ``finish_step`` calls).
        launch_step: the step whose launches it reports (``step - 1``; -1 when there was none).
        reports: per group with news, the decoded ring rows read this time (``rows``), the count of rows the
            kernels appended (``total``), the ring's ``status`` bits and the run counters.
        new_violations: ``(group, Violation)`` for every row read, in ring order.
        plan_status: per group, nonzero :class:`~kvcanary_cupy.PlanStatus` bits of its last plan.
        scatter_status: :class:`~kvcanary_cupy.CanaryStatus` bits of the expected-token scatter.
        overflowed: groups whose plan overflowed its verify capacity (prefix verify skipped).
        dropped: rows the kernels counted but a full ring could not hold.
        health_problems: counter checks that failed.
        swept_slots: slots the sweep of this step verified (0 when no sweep ran).
    """

    step: int
    launch_step: int
    reports: dict[str, ViolationReport] = field(default_factory=dict)
    new_violations: list[tuple[str, Violation]] = field(default_factory=list)
    plan_status: dict[str, int] = field(default_factory=dict)
    scatter_status: int = 0
    overflowed: list[str] = field(default_factory=list)
    dropped: int = 0
    health_problems: list[str] = field(default_factory=list)
    swept_slots: int = 0

    @property
    def status_bits(self) -> int:
        bits = self.scatter_status
        for report in self.reports.values():
            bits |= report.status
        return bits

    @property
    def alarming(self) -> bool:
        """Violations or status bits: what ``raise`` mode raises for."""
        return bool(self.new_violations or self.status_bits or self.plan_status or self.dropped)

    @property
    def clean(self) -> bool:
        return not (self.alarming or self.health_problems or self.overflowed)

    def summary(self) -> str:
        per_group = ", ".join(f"{g}: {len(r.rows)}" for g, r in self.reports.items() if r.rows)
        text = f"kv-canary: step {self.launch_step}: {len(self.new_violations)} new violation(s)"
        if per_group:
            text += f" ({per_group})"
        if self.dropped:
            text += f", {self.dropped} dropped by a full ring"
        for group, report in self.reports.items():
            if report.status:
                text += f"; {group} status: {_flag_names(CanaryStatus, report.status)}"
        for group, bits in self.plan_status.items():
            text += f"; {group} plan status: {_flag_names(PlanStatus, bits)}"
        if self.scatter_status:
            text += f"; scatter status: {_flag_names(CanaryStatus, self.scatter_status)}"
        return text


class CanaryViolationError(RuntimeError):
    """Raised in ``raise`` mode by ``finish_step()`` of the step after a launch that found violations or
    reported status bits.

    Attributes:
        step_report: the whole :class:`StepReport`.
        report: the :class:`~kvcanary_cupy.ViolationReport` of the first group with news (decoded rows in
            ``report.rows``); None when only plan or scatter status bits were reported.
        violations: ``(group, Violation)`` for every row read.
    """

    def __init__(self, step_report: StepReport) -> None:
        self.step_report = step_report
        self.violations = list(step_report.new_violations)
        self.report: ViolationReport | None = next(
            (r for r in step_report.reports.values() if r.rows or r.status), None)
        lines = [step_report.summary()]
        lines += [f"{v.log_line()} group={g}" for g, v in self.violations[:20]]
        if len(self.violations) > 20:
            lines.append(f"... {len(self.violations) - 20} more")
        super().__init__("\n".join(lines))


class CanaryHealthError(RuntimeError):
    """Raised in ``raise`` mode when the run counters show that canary launches did not run as expected (a
    skipped phase, a CUDA graph replayed without its canary nodes)."""

    def __init__(self, problems: list[str], step_report: StepReport | None = None) -> None:
        self.problems = list(problems)
        self.step_report = step_report
        super().__init__("kv-canary health check failed: " + "; ".join(self.problems))


def _reason_counts(rows: list[Violation]) -> dict[str, int]:
    """Rows per reason name, in :class:`FailReason` order (a row with two reasons counts for both)."""
    counts = Counter(name for v in rows for name in v.reasons)
    return {m.name: counts[m.name] for m in FailReason if m.name and counts[m.name]} | {
        name: n for name, n in counts.items() if name not in FailReason.__members__}


def status_flag_names(report: StepReport) -> list[str]:
    """The :class:`CanaryStatus` and :class:`PlanStatus` flag names a step report carries (its status bits and
    every group's plan status), each once."""
    bits = report.status_bits
    names = [str(m.name) for m in CanaryStatus if bits & m.value]
    plan = 0
    for value in report.plan_status.values():
        plan |= value
    names += [str(m.name) for m in PlanStatus if plan & m.value and m.name not in names]
    return names


def _row_fields(v: Violation) -> dict[str, Any]:
    return {"tag": v.launch_tag, "slot": v.slot, "position": v.position, "stored_token": v.stored_token,
            "expected_token": v.expected_token, "reasons": list(v.labels)}


def _group_line(step: int, group: str, rows: list[Violation], log_rows: int) -> tuple[str, dict[str, Any]]:
    """One step's rows of one group as one line: counts per reason, the first ``log_rows`` rows, the rest
    counted, and the runbook section of every reason present."""
    counts = _reason_counts(rows)
    shown = rows[:log_rows]
    anchors = [reason_anchor(name) for name in counts]
    text = (f"kv-canary: step {step} group {group}: {len(rows)} violation row(s) ("
            + ", ".join(f"{name} {n}" for name, n in counts.items()) + ")")
    if shown:
        text += "; first: " + ", ".join(f"{v.launch_tag} slot={v.slot} position={v.position} "
                                        f"[{','.join(v.labels)}]" for v in shown)
    if len(rows) > len(shown):
        text += f"; {len(rows) - len(shown)} more row(s) counted, not logged"
    text += "; runbook: " + " ".join(anchors)
    fields = {"step": step, "group": group, "rows": len(rows), "reasons": counts, "first_rows":
              [_row_fields(v) for v in shown], "unlogged_rows": len(rows) - len(shown), "runbook": anchors}
    return text, fields


def publish(report: StepReport, mode: str, logger: logging.Logger, *, overflow_counts: dict[str, int],
            log_rows: int = DEFAULT_LOG_ROWS) -> None:
    """Log every fact of ``report`` (``log``) or raise for it (``raise``); overflows only ever warn.

    ``log`` mode writes a bounded number of records per step however many rows the rings held: per group with
    rows one WARNING (counts per reason, the first ``log_rows`` rows' slot, position and reasons, how many more
    were counted; ``extra={"kv_canary": ...}`` carries the same as fields), one WARNING summary for the step
    when it raised anything, one ERROR per failed health check. Every row stays in the report (and so in the
    counters and totals the caller keeps); each line names the runbook sections of what it reports."""
    for group in report.overflowed:
        logger.warning("kv-canary: group %s: the plan overflowed its verify capacity at step %d; that step's "
                       "prefix verify was skipped (%d overflow(s) so far)", group, report.launch_step,
                       overflow_counts.get(group, 0))
    if mode == "raise":
        if report.alarming:
            raise CanaryViolationError(report)
        if report.health_problems:
            raise CanaryHealthError(report.health_problems, report)
        return
    by_group: dict[str, list[Violation]] = {}
    for group, violation in report.new_violations:
        by_group.setdefault(group, []).append(violation)
    for group, rows in by_group.items():
        text, fields = _group_line(report.launch_step, group, rows, log_rows)
        logger.warning("%s", text, extra={"kv_canary": fields})
    if report.alarming:
        flags = status_flag_names(report)
        anchors = [reason_anchor(name) for name in _reason_counts([v for _, v in report.new_violations])]
        anchors += [status_anchor(name) for name in flags]
        text = report.summary() + ("; runbook: " + " ".join(anchors) if anchors else "")
        logger.warning("%s", text, extra={"kv_canary": {"step": report.launch_step, "summary": True,
                                                        "rows": len(report.new_violations),
                                                        "dropped": report.dropped, "status": flags,
                                                        "runbook": anchors}})
    for problem in report.health_problems:
        logger.error("kv-canary health: %s", problem, extra={"kv_canary": {"step": report.launch_step,
                                                                            "health": problem}})
