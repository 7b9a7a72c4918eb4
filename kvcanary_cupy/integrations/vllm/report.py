"""The report of ``kvcanary simulate --engine vllm``: one JSON-ready dict (schema ``kvcanary-vllm-report/1``,
the fields of the transformers engine's report with ``preemptions`` per workload and ``vllm_version`` in the
config), rendered with the shared fault table (:mod:`kvcanary_cupy.sim.report`) and this engine's headline,
per-workload lines and verdict. Exit statuses as for the other engines: 0 passed, 1 failed, 4 inconclusive."""

from __future__ import annotations

import html
import json
import statistics
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from ...constants import reason_names
from ..transformers.report import _backend_used, _reason_bit, _status_names
from ..transformers.report import verdict as _verdict
from .faults import FAULT_KINDS

if TYPE_CHECKING:
    from .simulate import VllmSimulation

SCHEMA_ID = "kvcanary-vllm-report/1"
OUTCOMES = {"passed": 0, "failed": 1, "inconclusive": 4}
PHASES = ("batch", "stage", "scatter", "plan", "verify", "write", "sweep", "read")


def build_report(sim: VllmSimulation) -> dict[str, Any]:
    import vllm

    from .workloads import MODEL_SIZES, workloads

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
                if len(false_positives) < 200:
                    x = v.violation
                    false_positives.append({
                        "read_step": read, "launch_step": read - 1, "group": v.group, "launch_tag": x.launch_tag,
                        "slot": x.slot, "position": x.position, "stored_token": x.stored_token,
                        "expected_token": x.expected_token, "reasons": list(x.reasons), "workload": run.workload})
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
            "group": "G0", "request": fault.request, "position": fault.position, "slot": fault.slot,
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
    health_clean = sum(len(r.health_problems) for r in sim.runs if r.kind is None)
    health_faults = sum(len(r.health_problems) for r in sim.runs if r.kind is not None)
    failed = (not token_exact or fp_total or status_bits or dropped or health_clean
              or any(k["status"] == "missed" for k in kinds))
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
    chosen = workloads(vocab=MODEL_SIZES[cfg.model_size]["vocab_size"], seed=cfg.seed)
    per_workload = []
    for name, exact in sim.token_exact.items():
        clean = next(r for r in sim.runs if r.workload == name and r.kind is None)
        w = chosen[name]
        per_workload.append({
            "name": name, "description": w.description, "arch": "llama",
            "requests": len(w.prompts) * int(w.sampling.get("n", 1)), "max_new_tokens": w.max_new_tokens,
            "steps": clean.steps, "token_exact": exact, "violations": len(clean.violations),
            "prefill_tokens": clean.stats.prefill_tokens, "decode_tokens": clean.stats.decode_tokens,
            "prefix_tokens_reused": clean.stats.prefix_tokens_reused, "preemptions": clean.preemptions,
            "peak_batch": clean.stats.peak_batch, "wall_s": round(clean.wall, 4),
            "reference_wall_s": round(sim.reference_wall[name], 4)})
    return {
        "schema": SCHEMA_ID, "passed": outcome == "passed", "outcome": outcome, "exit_code": OUTCOMES[outcome],
        "config": {"engine": "vllm", "vllm_version": vllm.__version__, "model_size": cfg.model_size,
                   "model_params": sim.model_params, "seed": cfg.seed, "backend": cfg.backend,
                   "inject": {k: 1 for k in cfg.inject}, "inject_at": cfg.inject_at, "real_kv_hash": cfg.real_kv_hash,
                   "with_v": cfg.with_v, "sweep_interval": cfg.sweep_interval},
        "workloads": per_workload, "kinds": kinds, "faults": faults,
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


def headline(report: dict[str, Any]) -> str:
    c = report["config"]
    return (f"kv-canary in vLLM {c['vllm_version']} (CPU, V1 runner): model {c['model_size']} "
            f"({c['model_params'] / 1e6:.1f}M params, random weights), {len(report['workloads'])} workloads, "
            f"seed {c['seed']}, backend {report['cost']['backend']}, real-KV hash {c['real_kv_hash']}")


def summary_lines(report: dict[str, Any]) -> list[str]:
    v, cost = report["violations"], report["cost"]
    ms = cost["ms_per_step"]
    lines = [f"{w['name']:<17} {'token-exact' if w['token_exact'] else 'TOKENS DIFFER'}, {w['violations']} "
             f"violations clean; {w['requests']} requests, {w['steps']} steps, {w['prefill_tokens']} prefill + "
             f"{w['decode_tokens']} decode tokens, {w['prefix_tokens_reused']} prefix tokens reused, "
             f"{w['preemptions']} preemptions" for w in report["workloads"]]
    lines.append(
        f"false positives: {v['false_positives']} (of {v['total']} violations read, {v['explained']} explained by "
        f"injected faults" + (f", {v['dropped']} dropped by a full ring" if v["dropped"] else "") + ")")
    lines.append(
        f"canary cost per step ({cost['backend']}): {cost['canary_ms_per_step']:.2f} ms (verify {ms['verify']:.2f}, "
        f"write {ms['write']:.2f}, engine {ms['engine']:.2f} ms); {100 * cost['canary_share_of_generate']:.1f} % of "
        "LLM.generate wall time")
    return lines


def verdict(report: dict[str, Any]) -> str:
    return _verdict(report).replace("soft resets", "preemptions")


def _fp_lines(report: dict[str, Any]) -> list[str]:
    from ...sim.report import _fp_lines as fp_lines

    return fp_lines(report, where=lambda fp: f"{fp['workload']} step {fp['launch_step']} {fp['launch_tag']}")


def _lines(report: dict[str, Any]) -> list[str]:
    return summary_lines(report) + _fp_lines(report)


def print_report(report: dict[str, Any], stream: TextIO | None = None, *, plain: bool = False,
                 width: int | None = None) -> None:
    """The shared fault table with this engine's headline, per-workload lines and verdict."""
    from ...sim.report import HEADERS, ReportView, table_rows
    from ...sim.report import print_report as print_table

    print_table(report, stream, plain=plain, width=width, view=ReportView(headline, HEADERS, table_rows, _lines,
                                                                          verdict))


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
        ["kind", "workload", "step", "request", "detail", "detected at", "latency", "first tag", "reasons"],
        [[f["kind"], f["workload"], f["step"], f["request"], f["detail"], f["detection_step"], f["latency_steps"],
          f["detected_by"], [short_reason(r) for r in f["reasons"]]] for f in report["faults"]])
    colour = {"passed": "#2e7d32", "failed": "#c62828", "inconclusive": "#b26a00"}[report["outcome"]]
    summary = "".join(f"<li>{html.escape(line)}</li>" for line in _lines(report))
    page = f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>kv-canary in vLLM</title>
<style>body {{ font-family: system-ui, sans-serif; margin: 2em; max-width: 1200px; }}
table {{ border-collapse: collapse; margin: 0.5em 0 1.5em; font-size: 0.9em; }}
th, td {{ border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: left; }} th {{ background: #f3f3f3; }}
.verdict {{ font-weight: bold; color: {colour}; }}</style></head><body>
<h1>kv-canary in vLLM</h1>
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
