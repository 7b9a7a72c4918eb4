"""The report of ``kvcanary simulate --engine transformers``: one JSON-ready dict (schema
``kvcanary-transformers-report/1``), rendered like the synthetic engine's (its table, plot and HTML pieces from
:mod:`kvcanary_cupy.sim.report`) with this engine's headline, per-workload lines and verdict.

Fields: ``schema``, ``passed``, ``outcome`` (passed / failed / inconclusive), ``exit_code`` (0 / 1 / 4, as for the
synthetic engine); ``config`` (engine, transformers version, model size and parameters, seed, backend, injected
kinds, real-KV hash mode, sweep interval); ``workloads`` (per workload: requests, steps, token-exact, clean-run
violations, prefill/decode tokens, prefix tokens reused, soft resets, peak batch, requests failed, walls);
``kinds`` and ``faults`` (as the synthetic report, plus each fault's ``workload`` and ``injected``); ``violations``
(totals, false positives, health problems in clean and in faulted runs); ``false_positives``; ``cost`` (ms per step
per canary phase and for the engine, the canary's share of ``generate_batch`` wall time, kernel counters);
``timeline`` (per global step).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..common.report import (
    OUTCOMES,
    PHASES,
    EngineReportView,
    build_engine_report,
    false_positive_line,
    verdict,
    write_json,
)
from .faults import FAULT_KINDS

if TYPE_CHECKING:
    from .results import SimulationRecord

__all__ = ["OUTCOMES", "PHASES", "SCHEMA_ID", "build_report", "headline", "print_report", "summary_lines",
           "verdict", "write_html", "write_json"]

SCHEMA_ID = "kvcanary-transformers-report/1"


def build_report(sim: SimulationRecord) -> dict[str, Any]:
    import transformers

    from .workloads import workloads

    cfg = sim.cfg
    chosen = workloads(seed=cfg.seed)

    def workload_row(name: str, exact: bool, clean: Any) -> dict[str, Any]:
        w = chosen[name]
        return {
            "name": name, "description": w.description, "arch": w.arch, "requests": w.num_results,
            "max_new_tokens": w.max_new_tokens, "steps": clean.steps, "token_exact": exact,
            "violations": len(clean.violations), "prefill_tokens": clean.stats.prefill_tokens,
            "decode_tokens": clean.stats.decode_tokens, "prefix_tokens_reused": clean.stats.prefix_tokens_reused,
            "soft_resets": clean.stats.soft_resets, "peak_batch": clean.stats.peak_batch,
            "requests_failed": len(clean.errors), "wall_s": round(clean.wall, 4),
            "reference_wall_s": round(sim.reference_wall[name], 4)}

    config = {"engine": "transformers", "transformers_version": transformers.__version__,
              "model_size": cfg.model_size, "model_params": sim.model_params, "seed": cfg.seed,
              "backend": cfg.backend, "inject": {k: 1 for k in cfg.inject}, "inject_at": cfg.inject_at,
              "real_kv_hash": cfg.real_kv_hash, "with_v": cfg.with_v, "sweep_interval": cfg.sweep_interval}
    return build_engine_report(sim, schema=SCHEMA_ID, fault_kinds=FAULT_KINDS, config=config,
                               workload_row=workload_row, fault_group=lambda fault: fault.group)


# ---- rendering (the synthetic engine's table and plot, with this engine's headline and summary) ---------------


def headline(report: dict[str, Any]) -> str:
    c = report["config"]
    return (f"kv-canary in transformers {c['transformers_version']} continuous batching: model {c['model_size']} "
            f"({c['model_params'] / 1e6:.1f}M params, random weights), {len(report['workloads'])} workloads, "
            f"seed {c['seed']}, backend {report['cost']['backend']}, real-KV hash {c['real_kv_hash']}")


def summary_lines(report: dict[str, Any]) -> list[str]:
    cost = report["cost"]
    ms = cost["ms_per_step"]
    lines = []
    for w in report["workloads"]:
        lines.append(
            f"{w['name']:<15} {'token-exact' if w['token_exact'] else 'TOKENS DIFFER'}, {w['violations']} "
            f"violations clean; {w['requests']} requests, {w['steps']} steps, {w['prefill_tokens']} prefill + "
            f"{w['decode_tokens']} decode tokens, {w['prefix_tokens_reused']} prefix tokens reused, "
            f"{w['soft_resets']} soft resets")
    lines.append(false_positive_line(report))
    lines.append(
        f"canary cost per step ({cost['backend']}): batch {ms['batch']:.2f} ms, stage {ms['stage'] + ms['scatter']:.2f}"
        f" ms, plan {ms['plan']:.2f} ms, verify {ms['verify']:.2f} ms, write {ms['write']:.2f} ms, sweep "
        f"{ms['sweep']:.2f} ms, read {ms['read']:.2f} ms = "
        f"{cost['canary_ms_per_step']:.2f} ms (engine {ms['engine']:.2f} ms); "
        f"{100 * cost['canary_share_of_generate']:.1f} % of generate_batch wall time")
    return lines


VIEW = EngineReportView(headline, summary_lines, title="kv-canary in transformers",
                        heading="kv-canary in transformers continuous batching",
                        fault_columns=("step", "group", "request", "detail", "detected at", "latency", "first tag"),
                        html_style=" img { max-width: 100%; }")
print_report = VIEW.print_report
write_html = VIEW.write_html
