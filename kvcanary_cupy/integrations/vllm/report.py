"""The report of ``kvcanary simulate --engine vllm``: one JSON-ready dict (schema ``kvcanary-vllm-report/1``,
the fields of the transformers engine's report with ``preemptions`` per workload, ``vllm_version``, the model
kind, dtype, speculative decoding and tensor-parallel size in the config, ``unchecked`` (the install's line for
each group or feature the canary does not check, ``canary_disabled`` when it checks nothing), ``notes`` (the
install's line for what it checks without fingerprinting its bytes: a draft model's layers), and per rank: each
workload's clean violations by rank, each fault's rank), rendered with the shared fault table
(:mod:`kvcanary_cupy.sim.report`) and this engine's headline, per-workload lines and verdict. Exit statuses as for
the other engines: 0 passed, 1 failed, 4 inconclusive."""

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
from .faults import fault_kinds

if TYPE_CHECKING:
    from ..common.records import EngineSimulation

__all__ = ["OUTCOMES", "PHASES", "SCHEMA_ID", "build_report", "headline", "print_report", "summary_lines",
           "verdict", "write_html", "write_json"]

SCHEMA_ID = "kvcanary-vllm-report/1"


def build_report(sim: EngineSimulation[Any, Any]) -> dict[str, Any]:
    """The report of a finished simulation, from its record alone (``cfg`` a ``VllmSimConfig``, ``runs`` its
    ``RunResult`` records): the report never imports the module that runs the simulation."""
    import vllm

    from .workloads import MODEL_SIZES, workloads

    cfg = sim.cfg
    chosen = workloads(vocab=MODEL_SIZES[cfg.model_size]["vocab_size"], seed=cfg.seed,
                       speculative=cfg.speculative is not None)

    def workload_row(name: str, exact: bool, clean: Any) -> dict[str, Any]:
        w = chosen[name]
        return {
            "name": name, "description": w.description, "arch": cfg.model_arch,
            "requests": len(w.prompts) * int(w.sampling.get("n", 1)), "max_new_tokens": w.max_new_tokens,
            "steps": clean.steps, "token_exact": exact, "violations": len(clean.violations),
            "prefill_tokens": clean.stats.prefill_tokens, "decode_tokens": clean.stats.decode_tokens,
            "prefix_tokens_reused": clean.stats.prefix_tokens_reused, "preemptions": clean.preemptions,
            "peak_batch": clean.stats.peak_batch, "wall_s": round(clean.wall, 4),
            "reference_wall_s": round(sim.reference_wall[name], 4),
            "violations_by_rank": {str(r): n for r, n in sorted(clean.rank_violations.items())}}

    config = {"engine": "vllm", "vllm_version": vllm.__version__, "model_size": cfg.model_size,
              "model_params": sim.model_params, "seed": cfg.seed, "backend": cfg.backend,
              "inject": {k: 1 for k in cfg.inject}, "inject_at": cfg.inject_at, "real_kv_hash": cfg.real_kv_hash,
              "with_v": cfg.with_v, "sweep_interval": cfg.sweep_interval, "model_arch": cfg.model_arch,
              "dtype": cfg.dtype, "speculative": cfg.speculative, "tensor_parallel": cfg.tensor_parallel,
              "thread_binding": getattr(sim, "thread_binding", None)}
    # vLLM's injected faults name no group: each is reported in the first KV cache group the canary checks
    kinds = fault_kinds(cfg.model_arch, cfg.speculative)
    report = build_engine_report(sim, schema=SCHEMA_ID, fault_kinds=kinds, config=config, workload_row=workload_row,
                                 fault_group=lambda fault: "G0")
    faulted = [run for run in sim.runs if run.kind is not None]  # the order build_engine_report lists faults in
    for row, run in zip(report["faults"], faulted, strict=True):
        row["rank"] = run.fault_rank if run.fault is not None else None
        row["violations_by_rank"] = {str(r): n for r, n in sorted(run.rank_violations.items())}
    report["unchecked"] = list(getattr(sim, "unchecked", []))
    report["notes"] = list(getattr(sim, "notes", []))
    report["canary_disabled"] = getattr(sim, "disabled", None)
    return report


def headline(report: dict[str, Any]) -> str:
    c = report["config"]
    arch = c.get("model_arch", "llama")
    kind = f"model {c['model_size']}" if arch == "llama" else f"model {arch}"
    extras = [f"dtype {c['dtype']}"] if c.get("dtype") else []
    if c.get("speculative"):
        extras.append(f"speculative {c['speculative']}")
    if c.get("tensor_parallel", 1) > 1:
        extras.append(f"tensor parallel {c['tensor_parallel']}")
    return (f"kv-canary in vLLM {c['vllm_version']} (CPU, V1 runner): {kind} "
            f"({c['model_params'] / 1e6:.1f}M params, random weights{''.join(', ' + e for e in extras)}), "
            f"{len(report['workloads'])} workloads, seed {c['seed']}, backend {report['cost']['backend']}, "
            f"real-KV hash {c['real_kv_hash']}")


def summary_lines(report: dict[str, Any]) -> list[str]:
    cost = report["cost"]
    ms = cost["ms_per_step"]
    lines = [f"{w['name']:<17} {'token-exact' if w['token_exact'] else 'TOKENS DIFFER'}, {w['violations']} "
             f"violations clean; {w['requests']} requests, {w['steps']} steps, {w['prefill_tokens']} prefill + "
             f"{w['decode_tokens']} decode tokens, {w['prefix_tokens_reused']} prefix tokens reused, "
             f"{w['preemptions']} preemptions" for w in report["workloads"]]
    if report["config"].get("tensor_parallel", 1) > 1:
        for f in report["faults"]:
            if f["injected"]:
                lines.append(f"{f['kind']} on {f['workload']}: injected on rank {f['rank']}, violations by rank "
                             + ", ".join(f"{r}: {n}" for r, n in f["violations_by_rank"].items()))
    lines += [line.removeprefix("kv-canary: ") for line in report.get("unchecked", []) + report.get("notes", [])]
    lines.append(false_positive_line(report))
    lines.append(
        f"canary cost per step ({cost['backend']}): {cost['canary_ms_per_step']:.2f} ms (verify {ms['verify']:.2f}, "
        f"write {ms['write']:.2f}, engine {ms['engine']:.2f} ms); {100 * cost['canary_share_of_generate']:.1f} % of "
        "LLM.generate wall time")
    return lines


VIEW = EngineReportView(headline, summary_lines, title="kv-canary in vLLM", heading="kv-canary in vLLM",
                        fault_columns=("step", "request", "detail", "detected at", "latency", "first tag"))
print_report = VIEW.print_report
write_html = VIEW.write_html
