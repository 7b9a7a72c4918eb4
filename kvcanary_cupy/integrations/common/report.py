"""The report of ``kvcanary simulate --engine <engine>`` for an engine the canary is installed in: one JSON-ready
dict built from the simulation's records (:mod:`.records`), and its rendering -- the synthetic engine's fault table
(:mod:`kvcanary_cupy.sim.report`) with the engine's own headline and per-workload lines, the verdict, and the JSON
and HTML files.

The engine's report module supplies what differs: its schema id, fault vocabulary, ``config`` and per-workload
rows, headline and per-workload summary lines, and the HTML page's title; everything else (how violations are
attributed to faults, the per-kind summary, the outcome and exit status, the cost figures, the timeline, the
verdict) is the same for every engine and lives here.

Attribution: in a fault run, violations from launches before the fault took effect are false positives; those
from its step on are attributed to it, the first one read is its detection (one step after its launch) and its
latency is counted from the step the fault took effect. Outcomes and exit statuses are the synthetic engine's:
passed 0, failed 1, inconclusive 4 (nothing failed but a requested kind found no target in any workload).
"""

from __future__ import annotations

import html
import json
import statistics
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from ...constants import reason_names

if TYPE_CHECKING:
    from .records import EngineSimulation, RunRecord
    from .state import StepViolation

OUTCOMES = {"passed": 0, "failed": 1, "inconclusive": 4}  # the synthetic engine's exit statuses
PHASES = ("batch", "stage", "scatter", "plan", "verify", "write", "sweep", "read")
MAX_FALSE_POSITIVE_ROWS = 200


def violation_row(v: StepViolation, run: RunRecord) -> dict[str, Any]:
    """One violation as a row of the report's ``false_positives`` (steps numbered globally across runs)."""
    x = v.violation
    return {"read_step": run.step_offset + v.step + 1, "launch_step": run.step_offset + v.step, "group": v.group,
            "launch_tag": x.launch_tag, "slot": x.slot, "position": x.position, "stored_token": x.stored_token,
            "expected_token": x.expected_token, "reasons": list(x.reasons), "workload": run.workload}


def build_engine_report(sim: EngineSimulation[Any, Any], *, schema: str, fault_kinds: dict[str, str],
                        config: dict[str, Any], workload_row: Callable[[str, bool, Any], dict[str, Any]],
                        fault_group: Callable[[Any], str | None]) -> dict[str, Any]:
    """The report of a finished simulation. ``config`` is the report's ``config``; ``workload_row(name,
    token_exact, clean_run)`` gives each workload's row; ``fault_group(fault)`` the group an injected fault is
    reported in."""
    cfg = sim.cfg
    tl = {k: [0] * (sim.total_steps + 1) for k in ("violations", "explained", "false_positives", "detected",
                                                    "injected")}
    false_positives: list[dict[str, Any]] = []
    by_tag: Counter[str] = Counter()
    by_reason: Counter[str] = Counter()
    faults: list[dict[str, Any]] = []
    fp_total = explained = status_bits = dropped = 0
    for run in sim.runs:
        status_bits |= run.status_bits
        dropped += run.dropped
        fault = run.fault
        mine = []
        for v in run.violations:
            read = run.step_offset + v.step + 1
            tl["violations"][read] += 1
            by_tag[v.violation.launch_tag] += 1
            for r in v.violation.reasons:
                by_reason[r] += 1
            if fault is not None and v.step >= fault.step:
                mine.append(v)
                tl["explained"][read] += 1
                explained += 1
            else:
                tl["false_positives"][read] += 1
                fp_total += 1
                if len(false_positives) < MAX_FALSE_POSITIVE_ROWS:
                    false_positives.append(violation_row(v, run))
        # violations no fault of the run can explain (a distributed engine: those of a worker the fault was not
        # injected in) are false positives whatever their step
        for v in getattr(run, "unexplained", ()):
            read = run.step_offset + v.step + 1
            tl["violations"][read] += 1
            tl["false_positives"][read] += 1
            by_tag[v.violation.launch_tag] += 1
            for r in v.violation.reasons:
                by_reason[r] += 1
            fp_total += 1
            if len(false_positives) < MAX_FALSE_POSITIVE_ROWS:
                false_positives.append(violation_row(v, run))
        if run.kind is None:
            continue
        if fault is None:
            faults.append({"id": len(faults), "kind": run.kind, "workload": run.workload, "injected": False,
                           "step": None, "group": None, "request": None, "position": None, "slot": None,
                           "detail": "no target found", "detected": False, "detection_step": None,
                           "latency_steps": None, "detected_by": None, "reasons": [], "violations": 0})
            continue
        step = run.step_offset + fault.step
        tl["injected"][step] += 1
        bits = 0
        for v in mine:
            bits |= v.violation.reason_bits
        first = mine[0] if mine else None
        detection = None if first is None else run.step_offset + first.step + 1
        if detection is not None:
            tl["detected"][detection] += 1
        faults.append({
            "id": len(faults), "kind": run.kind, "workload": run.workload, "injected": True, "step": step,
            "group": fault_group(fault), "request": fault.request, "position": fault.position, "slot": fault.slot,
            "detail": fault.detail, "detected": first is not None, "detection_step": detection,
            "latency_steps": None if detection is None else detection - step,
            "detected_by": None if first is None else first.violation.launch_tag, "reasons": reason_names(bits),
            "violations": len(mine)})
    kinds = [_kind_summary(kind, fault_kinds[kind], faults) for kind in cfg.inject]
    token_exact = all(sim.token_exact.values())
    # A health problem (counters that disagree) in a clean run is a false alarm; in a fault run it is one
    # more sign of the fault (a write that did not land where the batch said makes TAIL count fewer slots).
    health_clean = sum(len(r.health_problems) for r in sim.runs if r.kind is None)
    health_faults = sum(len(r.health_problems) for r in sim.runs if r.kind is not None)
    failed = (not token_exact or fp_total or status_bits or dropped or health_clean
              or any(k["status"] == "missed" for k in kinds))
    # The synthetic engine's outcomes and exit statuses: a kind that found no target anywhere is inconclusive.
    outcome = "failed" if failed else "inconclusive" if any(k["status"] == "not injected" for k in kinds) \
        else "passed"
    per_workload = []
    for name, exact in sim.token_exact.items():
        clean = next(r for r in sim.runs if r.workload == name and r.kind is None)
        per_workload.append(workload_row(name, exact, clean))
    return {
        "schema": schema,
        "passed": outcome == "passed",
        "outcome": outcome,
        "exit_code": OUTCOMES[outcome],
        "config": config,
        "workloads": per_workload,
        "kinds": kinds,
        "faults": faults,
        "violations": {"total": explained + fp_total, "explained": explained, "false_positives": fp_total,
                       "dropped": dropped, "status": _status_names(status_bits), "by_tag": dict(sorted(by_tag.items())),
                       "by_reason": dict(sorted(by_reason.items())),
                       "health_problems_clean": health_clean, "health_problems_faulted": health_faults},
        "false_positives": false_positives,
        "cost": _cost(sim),
        "timeline": tl,
    }


def _kind_summary(kind: str, title: str, faults: list[dict[str, Any]]) -> dict[str, Any]:
    """One fault kind over every run that armed it: injected, detected, latency and the reasons that fired."""
    struck = [f for f in faults if f["kind"] == kind and f["injected"]]
    caught = [f for f in struck if f["detected"]]
    lat = sorted(int(f["latency_steps"]) for f in caught)
    bits = 0
    for f in struck:
        for r in f["reasons"]:
            bits |= _reason_bit(r)
    return {
        "kind": kind, "title": title, "injected": len(struck), "detected": len(caught),
        "missed": len(struck) - len(caught),
        "status": "not injected" if not struck else ("detected" if len(caught) == len(struck) else "missed"),
        "latency_steps": {"min": lat[0], "median": float(statistics.median(lat)), "max": lat[-1]} if lat else None,
        "reasons": reason_names(bits), "violations": sum(f["violations"] for f in struck)}


def _cost(sim: EngineSimulation[Any, Any]) -> dict[str, Any]:
    """Milliseconds per step per canary phase and for the engine, the canary's share of the runs' wall time and
    the endpoint counters."""
    canary_s = sum(sum(r.seconds.get(p, 0.0) for p in PHASES) for r in sim.runs)
    run_wall = sum(r.wall for r in sim.runs)
    n_steps = max(1, sum(r.steps for r in sim.runs))
    ms = {p: round(1000 * sum(r.seconds.get(p, 0.0) for r in sim.runs) / n_steps, 4) for p in PHASES}
    ms["engine"] = round(1000 * (run_wall - canary_s) / n_steps, 4)
    counters: Counter[str] = Counter()
    for result in sim.runs:
        counters.update(result.counters)
    verify_s = sum(r.seconds.get("verify", 0.0) for r in sim.runs)
    return {"backend": backend_used(sim.cfg.backend), "wall_s": round(sim.wall, 4), "ms_per_step": ms,
            "canary_ms_per_step": round(sum(ms[p] for p in PHASES), 4),
            "canary_share_of_generate": round(canary_s / run_wall, 4) if run_wall else 0.0,
            "verify_entries": counters["verify_entries"], "write_entries": counters["write_entries"],
            "launches": counters["launches"],
            "verify_entries_per_s": round(counters["verify_entries"] / verify_s, 1) if verify_s else 0.0}


def _reason_bit(name: str) -> int:
    from ...constants import FailReason

    return int(FailReason[name])


def _status_names(bits: int) -> list[str]:
    from ...constants import CanaryStatus

    return [str(m.name) for m in CanaryStatus if bits & m.value]


def backend_used(requested: str) -> str:
    """The backend the canary ran on for a requested one (``auto``: what it picks for a CPU engine's arrays)."""
    if requested != "auto":
        return requested
    from ...backends import auto_choice

    return auto_choice("cpu", "flag")[0]


# ---- rendering (the synthetic engine's table and plot, with the engine's headline and summary) ----------------


def false_positive_line(report: dict[str, Any]) -> str:
    """The summary line that counts false positives among the violations read."""
    v = report["violations"]
    return (f"false positives: {v['false_positives']} (of {v['total']} violations read, {v['explained']} explained "
            f"by injected faults" + (f", {v['dropped']} dropped by a full ring" if v["dropped"] else "") + ")")


def verdict(report: dict[str, Any]) -> str:
    if report["outcome"] == "passed":
        if report["kinds"]:
            return "PASS: token-exact with the canary, every injected fault kind detected, no false positive"
        return "PASS: token-exact with the canary, no violation in clean runs"
    absent = [k["kind"] for k in report["kinds"] if k["status"] == "not injected"]
    if report["outcome"] == "inconclusive":
        return (f"INCONCLUSIVE: could not inject {', '.join(absent)} (no target in any workload); every fault "
                "that was injected was detected, no false positive")
    problems = [f"tokens differ with the canary installed on {w['name']}" for w in report["workloads"]
                if not w["token_exact"]]
    missed = [k["kind"] for k in report["kinds"] if k["status"] == "missed"]
    if missed:
        problems.append(f"missed {', '.join(missed)}")
    if absent:
        problems.append(f"could not inject {', '.join(absent)}")
    if report["violations"]["false_positives"]:
        problems.append(f"{report['violations']['false_positives']} false positive(s)")
    if report["violations"]["dropped"]:
        problems.append(f"{report['violations']['dropped']} violation(s) dropped by a full ring")
    if report["violations"]["status"]:
        problems.append(f"kernel status {', '.join(report['violations']['status'])}")
    if report["violations"]["health_problems_clean"]:
        problems.append(f"{report['violations']['health_problems_clean']} health problem(s) in clean runs")
    return "FAIL: " + "; ".join(problems)


def false_positive_lines(report: dict[str, Any]) -> list[str]:
    """The first false positives, each with its workload, global launch step and launch tag."""
    from ...sim.report import _fp_lines as fp_lines

    return fp_lines(report, where=lambda fp: f"{fp['workload']} step {fp['launch_step']} {fp['launch_tag']}")


class EngineReportView:
    """How one engine's report is rendered: its ``headline`` and per-workload ``summary_lines`` (both from the
    report dict), and its HTML page's ``title``; ``html_style`` is appended to the page's style sheet and
    ``fault_columns`` names the injected-fault columns of the HTML table after ``kind`` and ``workload``."""

    def __init__(self, headline: Callable[[dict[str, Any]], str],
                 summary_lines: Callable[[dict[str, Any]], list[str]], *, title: str, heading: str,
                 fault_columns: tuple[str, ...], html_style: str = "") -> None:
        self.headline = headline
        self.summary_lines = summary_lines
        self.title = title
        self.heading = heading
        self.fault_columns = fault_columns
        self.html_style = html_style

    def lines(self, report: dict[str, Any]) -> list[str]:
        """The lines under the table: the engine's summary, then the first false positives."""
        return self.summary_lines(report) + false_positive_lines(report)

    def print_report(self, report: dict[str, Any], stream: TextIO | None = None, *, plain: bool = False,
                     width: int | None = None) -> None:
        """The synthetic engine's table (80 columns unless the terminal is wider) with this engine's headline,
        per-workload lines and verdict."""
        from ...sim.report import HEADERS, ReportView, table_rows
        from ...sim.report import print_report as print_table

        view = ReportView(self.headline, HEADERS, table_rows, self.lines, verdict)
        print_table(report, stream, plain=plain, width=width, view=view)

    def render_html(self, report: dict[str, Any]) -> str:
        from ...sim.report import HEADERS, _html_table, plot_svg, short_reason, table_rows

        svg = plot_svg({**report, "faults": [f for f in report["faults"] if f["injected"]]})
        plot = (f'<figure role="img" aria-label="violations and detections over steps">{svg}</figure>' if svg
                else "<p><em>No plot: install matplotlib (the <code>report</code> extra).</em></p>")
        cells = {"step": "step", "group": "group", "request": "request", "detail": "detail",
                 "detected at": "detection_step", "latency": "latency_steps", "first tag": "detected_by"}
        faults = _html_table(
            ["kind", "workload", *self.fault_columns, "reasons"],
            [[f["kind"], f["workload"], *(f[cells[c]] for c in self.fault_columns),
              [short_reason(r) for r in f["reasons"]]] for f in report["faults"]])
        colour = {"passed": "#2e7d32", "failed": "#c62828", "inconclusive": "#b26a00"}[report["outcome"]]
        summary = "".join(f"<li>{html.escape(line)}</li>" for line in self.lines(report))
        return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{self.title}</title>
<style>body {{ font-family: system-ui, sans-serif; margin: 2em; max-width: 1200px; }}
table {{ border-collapse: collapse; margin: 0.5em 0 1.5em; font-size: 0.9em; }}
th, td {{ border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: left; }} th {{ background: #f3f3f3; }}
.verdict {{ font-weight: bold; color: {colour}; }}{self.html_style}</style></head><body>
<h1>{self.heading}</h1>
<p>{html.escape(self.headline(report))}</p><p class="verdict">{html.escape(verdict(report))}</p>
<h2>Detection by fault kind</h2>{_html_table(list(HEADERS), [list(r) for r in table_rows(report)])}
<h2>Violations and detections over the runs</h2>{plot}
<h2>Summary</h2><ul>{summary}</ul>
<h2>Injected faults</h2>{faults}
<h2>Configuration</h2><pre>{html.escape(json.dumps(report["config"], indent=2))}</pre>
</body></html>
"""

    def write_html(self, report: dict[str, Any], path: str | Path) -> Path:
        return _write(path, self.render_html(report))


def write_json(report: dict[str, Any], path: str | Path) -> Path:
    return _write(path, json.dumps(report, indent=2) + "\n")


def _write(path: str | Path, text: str) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path
