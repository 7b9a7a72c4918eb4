"""The report of ``kvcanary simulate --engine transformers``: one JSON-ready dict (schema
``kvcanary-transformers-report/1``), rendered like the synthetic engine's (its table, plot and HTML pieces from
:mod:`kvcanary_cupy.sim.report`) with this engine's headline, per-workload lines and verdict.

Fields: ``schema``, ``passed``, ``outcome`` (passed / failed / inconclusive), ``exit_code`` (0 / 1 / 4, as for the
synthetic engine); ``config`` (engine, transformers version, model size and parameters, seed, backend, injected
kinds, real-KV hash mode, sweep interval); ``workloads`` (per workload: requests, steps, token-exact, clean-run
violations, prefill/decode tokens, prefix tokens reused, soft resets, walls); ``kinds`` and ``faults`` (as the
synthetic report, plus each fault's ``workload`` and ``injected``); ``violations`` (totals, false positives,
health problems in clean and in faulted runs); ``false_positives``; ``cost`` (ms per step per canary phase and for
the engine, the canary's share of ``generate_batch`` wall time, kernel counters); ``timeline`` (per global step).
"""

from __future__ import annotations

import html
import json
import statistics
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from ...constants import reason_names
from .faults import FAULT_KINDS

if TYPE_CHECKING:
    from .canary import StepViolation
    from .results import RunResult, SimulationRecord

SCHEMA_ID = "kvcanary-transformers-report/1"
OUTCOMES = {"passed": 0, "failed": 1, "inconclusive": 4}  # the synthetic engine's exit statuses
PHASES = ("batch", "stage", "scatter", "plan", "verify", "write", "sweep", "read")


def _violation_row(v: StepViolation, run: RunResult) -> dict[str, Any]:
    x = v.violation
    return {"read_step": run.step_offset + v.step + 1, "launch_step": run.step_offset + v.step, "group": v.group,
            "launch_tag": x.launch_tag, "slot": x.slot, "position": x.position, "stored_token": x.stored_token,
            "expected_token": x.expected_token, "reasons": list(x.reasons), "workload": run.workload}


def build_report(sim: SimulationRecord) -> dict[str, Any]:
    import transformers

    from .workloads import workloads

    cfg = sim.cfg
    steps = sim.total_steps
    tl = {k: [0] * (steps + 1) for k in ("violations", "explained", "false_positives", "detected", "injected")}
    false_positives: list[dict[str, Any]] = []
    by_tag: Counter[str] = Counter()
    by_reason: Counter[str] = Counter()
    faults: list[dict[str, Any]] = []
    fp_total = explained = 0
    status_bits = dropped = 0
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
                if len(false_positives) < 200:
                    false_positives.append(_violation_row(v, run))
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
            "group": fault.group, "request": fault.request, "position": fault.position, "slot": fault.slot,
            "detail": fault.detail, "detected": first is not None, "detection_step": detection,
            "latency_steps": None if detection is None else detection - step,
            "detected_by": None if first is None else first.violation.launch_tag, "reasons": reason_names(bits),
            "violations": len(mine)})
    kinds = []
    for kind in cfg.inject:
        struck = [f for f in faults if f["kind"] == kind and f["injected"]]
        caught = [f for f in struck if f["detected"]]
        lat = sorted(int(f["latency_steps"]) for f in caught)
        bits = 0
        for f in struck:
            for r in f["reasons"]:
                bits |= _reason_bit(r)
        kinds.append({
            "kind": kind, "title": FAULT_KINDS[kind], "injected": len(struck), "detected": len(caught),
            "missed": len(struck) - len(caught),
            "status": "not injected" if not struck else ("detected" if len(caught) == len(struck) else "missed"),
            "latency_steps": {"min": lat[0], "median": float(statistics.median(lat)), "max": lat[-1]} if lat else None,
            "reasons": reason_names(bits), "violations": sum(f["violations"] for f in struck)})
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
    canary_s = sum(sum(r.seconds.get(p, 0.0) for p in PHASES) for r in sim.runs)
    run_wall = sum(r.wall for r in sim.runs)
    n_steps = max(1, sum(r.steps for r in sim.runs))
    ms = {p: round(1000 * sum(r.seconds.get(p, 0.0) for r in sim.runs) / n_steps, 4) for p in PHASES}
    ms["engine"] = round(1000 * (run_wall - canary_s) / n_steps, 4)
    counters: Counter[str] = Counter()
    for result in sim.runs:
        counters.update(result.counters)
    verify_s = sum(r.seconds.get("verify", 0.0) for r in sim.runs)
    per_workload = []
    for name, exact in sim.token_exact.items():
        clean = next(r for r in sim.runs if r.workload == name and r.kind is None)
        w = workloads(seed=cfg.seed)[name]
        per_workload.append({
            "name": name, "description": w.description, "arch": w.arch, "requests": w.num_results,
            "max_new_tokens": w.max_new_tokens, "steps": clean.steps, "token_exact": exact,
            "violations": len(clean.violations), "prefill_tokens": clean.stats.prefill_tokens,
            "decode_tokens": clean.stats.decode_tokens, "prefix_tokens_reused": clean.stats.prefix_tokens_reused,
            "soft_resets": clean.stats.soft_resets, "peak_batch": clean.stats.peak_batch,
            "requests_failed": len(clean.errors), "wall_s": round(clean.wall, 4),
            "reference_wall_s": round(sim.reference_wall[name], 4)})
    return {
        "schema": SCHEMA_ID,
        "passed": outcome == "passed",
        "outcome": outcome,
        "exit_code": OUTCOMES[outcome],
        "config": {"engine": "transformers", "transformers_version": transformers.__version__,
                   "model_size": cfg.model_size, "model_params": sim.model_params, "seed": cfg.seed,
                   "backend": cfg.backend, "inject": {k: 1 for k in cfg.inject}, "inject_at": cfg.inject_at,
                   "real_kv_hash": cfg.real_kv_hash, "with_v": cfg.with_v, "sweep_interval": cfg.sweep_interval},
        "workloads": per_workload,
        "kinds": kinds,
        "faults": faults,
        "violations": {"total": explained + fp_total, "explained": explained, "false_positives": fp_total,
                       "dropped": dropped, "status": _status_names(status_bits), "by_tag": dict(sorted(by_tag.items())),
                       "by_reason": dict(sorted(by_reason.items())),
                       "health_problems_clean": health_clean, "health_problems_faulted": health_faults},
        "false_positives": false_positives,
        "cost": {"backend": _backend_used(cfg.backend), "wall_s": round(sim.wall, 4), "ms_per_step": ms,
                 "canary_ms_per_step": round(sum(ms[p] for p in PHASES), 4),
                 "canary_share_of_generate": round(canary_s / run_wall, 4) if run_wall else 0.0,
                 "verify_entries": counters["verify_entries"], "write_entries": counters["write_entries"],
                 "launches": counters["launches"],
                 "verify_entries_per_s": round(counters["verify_entries"] / verify_s, 1) if verify_s else 0.0},
        "timeline": tl,
    }


def _reason_bit(name: str) -> int:
    from ...constants import FailReason

    return int(FailReason[name])


def _status_names(bits: int) -> list[str]:
    from ...constants import CanaryStatus

    return [str(m.name) for m in CanaryStatus if bits & m.value]


def _backend_used(requested: str) -> str:
    return "numpy" if requested == "auto" else requested


# ---- rendering (the synthetic engine's table and plot, with this engine's headline and summary) ---------------


def headline(report: dict[str, Any]) -> str:
    c = report["config"]
    return (f"kv-canary in transformers {c['transformers_version']} continuous batching: model {c['model_size']} "
            f"({c['model_params'] / 1e6:.1f}M params, random weights), {len(report['workloads'])} workloads, "
            f"seed {c['seed']}, backend {report['cost']['backend']}, real-KV hash {c['real_kv_hash']}")


def summary_lines(report: dict[str, Any]) -> list[str]:
    v, cost = report["violations"], report["cost"]
    ms = cost["ms_per_step"]
    lines = []
    for w in report["workloads"]:
        lines.append(
            f"{w['name']:<15} {'token-exact' if w['token_exact'] else 'TOKENS DIFFER'}, {w['violations']} "
            f"violations clean; {w['requests']} requests, {w['steps']} steps, {w['prefill_tokens']} prefill + "
            f"{w['decode_tokens']} decode tokens, {w['prefix_tokens_reused']} prefix tokens reused, "
            f"{w['soft_resets']} soft resets")
    lines.append(
        f"false positives: {v['false_positives']} (of {v['total']} violations read, {v['explained']} explained by "
        f"injected faults" + (f", {v['dropped']} dropped by a full ring" if v["dropped"] else "") + ")")
    lines.append(
        f"canary cost per step ({cost['backend']}): batch {ms['batch']:.2f} ms, stage {ms['stage'] + ms['scatter']:.2f}"
        f" ms, plan {ms['plan']:.2f} ms, verify {ms['verify']:.2f} ms, write {ms['write']:.2f} ms, sweep "
        f"{ms['sweep']:.2f} ms, read {ms['read']:.2f} ms = "
        f"{cost['canary_ms_per_step']:.2f} ms (engine {ms['engine']:.2f} ms); "
        f"{100 * cost['canary_share_of_generate']:.1f} % of generate_batch wall time")
    return lines


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


def _fp_lines(report: dict[str, Any]) -> list[str]:
    from ...sim.report import _fp_lines as fp_lines

    return fp_lines(report, where=lambda fp: f"{fp['workload']} step {fp['launch_step']} {fp['launch_tag']}")


def _lines(report: dict[str, Any]) -> list[str]:
    return summary_lines(report) + _fp_lines(report)


def print_report(report: dict[str, Any], stream: TextIO | None = None, *, plain: bool = False,
                 width: int | None = None) -> None:
    """The synthetic engine's table (80 columns unless the terminal is wider) with this engine's headline,
    per-workload lines and verdict."""
    from ...sim.report import HEADERS, ReportView, table_rows
    from ...sim.report import print_report as print_table

    view = ReportView(headline, HEADERS, table_rows, _lines, verdict)
    print_table(report, stream, plain=plain, width=width, view=view)


def write_json(report: dict[str, Any], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    return path


def write_html(report: dict[str, Any], path: str | Path) -> Path:
    from ...sim.report import HEADERS, _html_table, plot_svg, short_reason, table_rows

    svg = plot_svg({**report, "faults": [f for f in report["faults"] if f["injected"]]})
    plot = (f'<figure role="img" aria-label="violations and detections over steps">{svg}</figure>' if svg
            else "<p><em>No plot: install matplotlib (the <code>report</code> extra).</em></p>")
    faults = _html_table(
        ["kind", "workload", "step", "group", "request", "detail", "detected at", "latency", "first tag", "reasons"],
        [[f["kind"], f["workload"], f["step"], f["group"], f["request"], f["detail"], f["detection_step"],
          f["latency_steps"], f["detected_by"], [short_reason(r) for r in f["reasons"]]]
         for f in report["faults"]])
    colour = {"passed": "#2e7d32", "failed": "#c62828", "inconclusive": "#b26a00"}[report["outcome"]]
    summary = "".join(f"<li>{html.escape(line)}</li>" for line in summary_lines(report) + _fp_lines(report))
    page = f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>kv-canary in transformers</title>
<style>body {{ font-family: system-ui, sans-serif; margin: 2em; max-width: 1200px; }}
table {{ border-collapse: collapse; margin: 0.5em 0 1.5em; font-size: 0.9em; }}
th, td {{ border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: left; }} th {{ background: #f3f3f3; }}
.verdict {{ font-weight: bold; color: {colour}; }} img {{ max-width: 100%; }}</style></head><body>
<h1>kv-canary in transformers continuous batching</h1>
<p>{html.escape(headline(report))}</p><p class="verdict">{html.escape(verdict(report))}</p>
<h2>Detection by fault kind</h2>{_html_table(list(HEADERS), [list(r) for r in table_rows(report)])}
<h2>Violations and detections over the runs</h2>{plot}
<h2>Summary</h2><ul>{summary}</ul>
<h2>Injected faults</h2>{faults}
<h2>Configuration</h2><pre>{html.escape(json.dumps(report["config"], indent=2))}</pre>
</body></html>
"""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(page)
    return path
