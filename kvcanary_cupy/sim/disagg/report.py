"""The disaggregated run's report: the ``kvcanary simulate`` report merged over every process, plus where
each transfer fault was caught and the per-worker transfer figures.

JSON (``schema: "kvcanary-disagg-report/1"``, :data:`SCHEMA`): the fields of
:mod:`kvcanary_cupy.sim.report` (``kinds`` and ``faults`` over the transfer fault kinds; counts, violations,
false positives, costs and timelines summed over the processes), and in addition:

* ``kinds[].caught_at``: {where: faults}, where "transfer verify" (before the request's first decode step)
  or "decode step (TAG)"; a kind's ``status`` is "detected" only when every one of its faults was caught by
  the transfer verify ("late" otherwise);
* ``faults[]``: ``worker``, ``side`` ("sender"/"receiver"), ``caught_at``;
* ``disaggregated``: ``decode_workers``, ``transfer_timeout_s``, ``startup_s`` (spawn + rendezvous),
  ``prefill`` {``requests``, ``kv_bytes``, ``canary_bytes``, ``gather_ms``, ``send_ms``} and ``workers``: per
  decode worker ``worker``, ``requests``, ``pages``, ``kv_bytes``, ``canary_bytes``, ``canary_share`` (canary
  bytes / KV bytes), ``accepted``, ``rejected`` (new requests), ``rejected_residents``, ``verify_entries``,
  ``recv_ms``, ``land_ms``, ``verify_ms``, ``finished`` (requests decoded to the end), ``violations``;
  ``health_problems``: what the runtimes' health checks reported (per process).
"""

from __future__ import annotations

import copy
import html
import json
import statistics
from collections import Counter
from pathlib import Path
from typing import Any, TextIO

from ...constants import FailReason
from .. import report as base
from .config import DisaggConfig
from .faults import TRANSFER_KINDS

SCHEMA_ID = "kvcanary-disagg-report/1"
TRANSFER_VERIFY = "transfer verify"


def _schema() -> dict[str, Any]:
    schema = copy.deepcopy(base.SCHEMA)
    props = schema["properties"]
    props["schema"] = {"type": "string", "const": SCHEMA_ID}
    names = {"type": "string", "enum": list(TRANSFER_KINDS)}
    kind = props["kinds"]["items"]
    kind["properties"]["kind"] = names
    kind["properties"]["status"] = {"type": "string", "enum": ["detected", "late", "missed", "not injected"]}
    kind["properties"]["caught_at"] = base._COUNTS
    kind["required"].append("caught_at")
    fault = props["faults"]["items"]
    fault["properties"].update(kind=names, worker=base._INT, side={"type": "string", "enum": ["sender", "receiver"]},
                               caught_at=base._STR_OR_NULL)
    fault["required"] += ["worker", "side", "caught_at"]
    props["config"] = base._obj({k: {} for k in DisaggConfig().as_dict()} | {"engine": {"type": "object"}})
    figures = base._obj({k: base._NUM for k in (
        "worker", "requests", "pages", "kv_bytes", "canary_bytes", "canary_share", "accepted", "rejected",
        "rejected_residents", "verify_entries", "recv_ms", "land_ms", "verify_ms", "finished", "violations")})
    props["disaggregated"] = base._obj({
        "decode_workers": base._INT, "transfer_timeout_s": base._NUM, "startup_s": base._NUM,
        "prefill": base._obj({k: base._NUM for k in ("requests", "kv_bytes", "canary_bytes", "gather_ms",
                                                      "send_ms")}),
        "workers": {"type": "array", "items": figures}, "health_problems": base._STR_LIST,
    })
    schema["required"].append("disaggregated")
    return schema


SCHEMA = _schema()


def validate(report: Any) -> list[str]:
    return base.validate(report, SCHEMA)


def _sum_counts(dicts: list[dict[str, int]]) -> dict[str, int]:
    total: Counter[str] = Counter()
    for d in dicts:
        total.update(d)
    return dict(sorted(total.items()))


def _sum_lists(lists: list[list[int]]) -> list[int]:
    out = [0] * max(len(x) for x in lists)
    for x in lists:
        for i, v in enumerate(x):
            out[i] += v
    return out


def merge(cfg: DisaggConfig, results: dict[int, dict[str, Any]], wall_s: float) -> dict[str, Any]:
    """One report from the per-process results (rank 0 = prefill, then the decode workers)."""
    prefill = results[0]
    workers = [results[r] for r in sorted(results) if r > 0]
    faults = sorted((f for w in workers for f in w["faults"]), key=lambda f: (f["step"], f["worker"], f["id"]))
    for i, f in enumerate(faults):
        f["id"] = i
    kinds = []
    for name, kind in TRANSFER_KINDS.items():
        if name not in cfg.inject:
            continue
        mine = [f for f in faults if f["kind"] == name]
        caught = [f for f in mine if f["detected"]]
        latencies = sorted(f["latency_steps"] for f in caught)
        early = [f for f in caught if f["caught_at"] == TRANSFER_VERIFY]
        fired = {r for f in mine for r in f["reasons"]}
        status = ("not injected" if not mine else "missed" if not caught else
                  "detected" if len(early) == len(mine) else "late")
        kinds.append({
            "kind": name, "title": kind.title, "injected": len(mine), "detected": len(caught),
            "missed": len(mine) - len(caught), "status": status,
            "latency_steps": {"min": latencies[0], "median": float(statistics.median(latencies)),
                              "max": latencies[-1]} if latencies else None,
            "reasons": [m.name for m in FailReason if m.name in fired],
            "violations": sum(f["violations"] for f in mine),
            "caught_at": dict(Counter(f["caught_at"] or "missed" for f in mine)),
        })
    everyone = [prefill, *workers]
    v = [r["violations"] for r in everyone]
    violations = {
        "total": sum(x["total"] for x in v), "explained": sum(x["explained"] for x in v),
        "false_positives": sum(x["false_positives"] for x in v), "dropped": sum(x["dropped"] for x in v),
        "status": sorted({s for x in v for s in x["status"]}),
        "by_tag": _sum_counts([x["by_tag"] for x in v]), "by_reason": _sum_counts([x["by_reason"] for x in v]),
    }
    fps = [dict(fp, process=("prefill" if rank == 0 else f"decode {rank}")) for rank in sorted(results)
           for fp in results[rank]["false_positives"]][:200]
    w = [r["workload"] for r in workers]
    pw = prefill["workload"]
    workload = {
        "steps_run": max(r["workload"]["steps_run"] for r in everyone),
        "requests_admitted": pw["requests_admitted"], "requests_finished": sum(x["requests_finished"] for x in w),
        "prefill_tokens": pw["prefill_tokens"], "decode_tokens": sum(x["decode_tokens"] for x in w),
        "prefix_tokens_reused": pw["prefix_tokens_reused"],
        **{k: sum(r["workload"][k] for r in everyone) for k in ("rows_recycled", "padding_rows", "tree_evicted_slots",
                                                                "swa_evicted_slots", "sweeps")},
        "peak_running": max(x["peak_running"] for x in w), "peak_slots_used": max(x["peak_slots_used"] for x in w),
    }
    steps = sum(max(1, r["workload"]["steps_run"]) for r in everyone)
    phases = ("scatter", "plan", "verify", "write", "sweep", "read", "engine")
    ms = {p: 1000.0 * sum(r["timers"]["wall"].get(p, 0.0) for r in everyone) / steps for p in phases}
    totals = {k: sum(r["cost"][k] for r in everyone) for k in ("verify_entries", "write_entries", "launches")}
    verify_s = sum(r["timers"]["wall"].get("verify", 0.0) + r["timers"]["wall"].get("sweep", 0.0) for r in everyone)
    cost = {
        "backend": prefill["cost"]["backend"], "device": prefill["cost"]["device"], "wall_s": round(wall_s, 3),
        "compile_s": max(r["cost"]["compile_s"] for r in everyone),  # the processes compile side by side
        "ms_per_step": {k: round(x, 4) for k, x in ms.items()},
        "canary_ms_per_step": round(sum(x for k, x in ms.items() if k != "engine"), 4),
        "device_ms_per_step": None, **totals,
        "verify_entries_per_s": round(totals["verify_entries"] / verify_s, 1) if verify_s > 0 else 0.0,
    }
    pt = prefill["transfer"]
    figures = []
    for rank, r in zip(sorted(results)[1:], workers, strict=True):
        t = r["transfer"]
        figures.append({
            "worker": rank, "requests": t["requests"], "pages": t["pages"], "kv_bytes": t["kv_bytes"],
            "canary_bytes": t["canary_bytes"],
            "canary_share": round(t["canary_bytes"] / t["kv_bytes"], 6) if t["kv_bytes"] else 0.0,
            "accepted": t["accepted"], "rejected": t["rejected"], "rejected_residents": t["rejected_residents"],
            "verify_entries": t["verify_entries"], "recv_ms": round(1000 * t["recv_s"], 3),
            "land_ms": round(1000 * t["land_s"], 3), "verify_ms": round(1000 * t["verify_s"], 3),
            "finished": r["workload"]["requests_finished"], "violations": r["violations"]["total"],
        })
    health = [f"{'prefill' if rank == 0 else f'decode {rank}'}: {problem}" for rank in sorted(results)
              for problem in results[rank]["health_problems"]]
    failed = (any(k["status"] in ("missed", "late") for k in kinds) or violations["false_positives"] > 0
              or bool(violations["status"]) or violations["dropped"] > 0 or bool(health))
    outcome = "failed" if failed else "inconclusive" if any(k["status"] == "not injected" for k in kinds) \
        else "passed"
    return {
        "schema": SCHEMA_ID, "passed": outcome == "passed", "outcome": outcome, "exit_code": base.OUTCOMES[outcome],
        "generated": prefill["generated"],
        "config": {**cfg.as_dict(), "engine": {"prefill": prefill["config"]["engine"],
                                               "decode": workers[0]["config"]["engine"]}},
        "workload": workload, "kinds": kinds, "faults": faults, "violations": violations, "false_positives": fps,
        "cost": cost, "timeline": {k: _sum_lists([r["timeline"][k] for r in everyone]) for k in prefill["timeline"]},
        "disaggregated": {
            "decode_workers": cfg.decode_workers, "transfer_timeout_s": cfg.transfer_timeout_s,
            "startup_s": round(max(0.0, wall_s - max(r["cost"]["wall_s"] for r in everyone)), 3),
            "prefill": {"requests": pt["requests"], "kv_bytes": pt["kv_bytes"], "canary_bytes": pt["canary_bytes"],
                        "gather_ms": round(1000 * pt["gather_s"], 3), "send_ms": round(1000 * pt["send_s"], 3)},
            "workers": figures,
            "health_problems": health,
        },
    }


# ---- rendering ---------------------------------------------------------------------------------------------

# The simulate table with "caught at" where the latency was: a transfer fault is either caught by the transfer
# verify (latency 0) or too late, which is what matters here (the latency stays in the JSON).
HEADERS = (*base.HEADERS[:4], "caught at", base.HEADERS[5])
_STYLES = {**base._STYLES, "late": "bold red"}


def _place(where: str) -> str:
    return "transfer" if where == TRANSFER_VERIFY else "decode" if where.startswith("decode") else where


def table_rows(report: dict[str, Any]) -> list[tuple[str, ...]]:
    rows = []
    for row, kind in zip(base.table_rows(report), report["kinds"], strict=True):
        where = ", ".join(f"{_place(place)} {n}" for place, n in sorted(kind["caught_at"].items()))
        rows.append((*row[:4], where or "-", row[5]))
    return rows


def headline(report: dict[str, Any]) -> str:
    c = report["config"]
    return (f"kv-canary disaggregated: preset {c['preset']}, 1 prefill process + {c['decode_workers']} decode "
            f"worker(s), {c['requests']} requests, seed {c['seed']}, backend {report['cost']['backend']}")


def transfer_lines(report: dict[str, Any]) -> list[str]:
    d = report["disaggregated"]
    p = d["prefill"]
    lines = [f"prefill: {p['requests']} requests shipped, {p['kv_bytes']:,} KV bytes + {p['canary_bytes']:,} canary "
             f"bytes (gather {p['gather_ms']:.1f} ms, send and acks {p['send_ms']:.1f} ms); start-up "
             f"{d['startup_s']:.1f} s"]
    for w in d["workers"]:
        lines.append(
            f"decode worker {w['worker']}: {w['requests']} requests, {w['pages']} pages, {w['kv_bytes']:,} KV bytes, "
            f"{w['canary_bytes']:,} canary bytes ({100 * w['canary_share']:.2f} % of KV); accepted {w['accepted']}, "
            f"rejected {w['rejected']} (+{w['rejected_residents']} residents); {w['finished']} decoded to the end; "
            f"transfer verify {w['verify_entries']:,} entries in {w['verify_ms']:.1f} ms")
    return lines


def verdict(report: dict[str, Any]) -> str:
    kinds = report["kinds"]
    absent = [k["kind"] for k in kinds if k["status"] == "not injected"]
    if report["outcome"] == "passed":
        if kinds:
            return "PASS: every injected transfer fault was caught before its request's first decode step, no false " \
                "positive"
        return "PASS: no violation in a clean run"
    if report["outcome"] == "inconclusive":
        return (f"INCONCLUSIVE: could not inject {', '.join(absent)} (no target in this workload); every transfer "
                "fault that was injected was caught before its request's first decode step, no false positive")
    problems = []
    for status, wording in (("missed", "missed"), ("late", "caught only after the first decode step:")):
        names = [k["kind"] for k in kinds if k["status"] == status]
        if names:
            problems.append(f"{wording} {', '.join(names)}")
    v = report["violations"]
    if v["false_positives"]:
        problems.append(f"{v['false_positives']} false positive(s)")
    if v["dropped"]:
        problems.append(f"{v['dropped']} violation(s) dropped by a full ring")
    if v["status"]:
        problems.append(f"kernel status {', '.join(v['status'])}")
    if report["disaggregated"]["health_problems"]:
        problems.append("canary health: " + "; ".join(report["disaggregated"]["health_problems"]))
    if absent:
        problems.append(f"could not inject {', '.join(absent)}")
    return "FAIL: " + "; ".join(problems)


def _lines(report: dict[str, Any]) -> list[str]:
    return base.summary_lines(report) + transfer_lines(report) + base._fp_lines(report) + base.warnings(report)


VIEW = base.ReportView(headline, HEADERS, table_rows, _lines, verdict, styles=_STYLES,
                       empty="(clean run: no transfer fault injected)")


def render_text(report: dict[str, Any], width: int = base.DEFAULT_WIDTH) -> str:
    """The plain-text rendering, at most ``width`` columns wide where the words allow (as the simulate table)."""
    return base.render_text(report, width, VIEW)


def print_report(report: dict[str, Any], stream: TextIO | None = None, *, plain: bool = False,
                 width: int | None = None) -> None:
    """The table and summary: with rich when installed (and ``plain`` is False), else plain text."""
    base.print_report(report, stream, plain=plain, width=width, view=VIEW)


def render_html(report: dict[str, Any]) -> str:
    """The simulate HTML page with the transfer faults' table ("caught at"), the per-worker transfer figures
    and the transfer fault list in place of the engine fault sections."""
    page = base.render_html(report)
    kinds = base._html_table(list(HEADERS), [[*r[:5], [base.short_reason(x) for x in k["reasons"]] or "-"]
                                             for r, k in zip(table_rows(report), report["kinds"], strict=True)],
                             numeric=base._NUMERIC, names=(0, 4))
    workers = base._html_table(
        ["worker", "requests", "pages", "KV bytes", "canary bytes", "canary / KV", "accepted", "rejected",
         "rejected residents", "transfer-verify entries", "verify ms", "decoded"],
        [[w["worker"], w["requests"], w["pages"], w["kv_bytes"], w["canary_bytes"], f"{100 * w['canary_share']:.2f} %",
          w["accepted"], w["rejected"], w["rejected_residents"], w["verify_entries"], w["verify_ms"], w["finished"]]
         for w in report["disaggregated"]["workers"]], numeric=tuple(range(12)))
    faults = base._html_table(
        ["id", "kind", "side", "worker", "step", "request", "detail", "caught at", "reasons", "violations"],
        [[f["id"], f["kind"], f["side"], f["worker"], f["step"], f["request"], f["detail"], f["caught_at"],
          [base.short_reason(r) for r in f["reasons"]], f["violations"]] for f in report["faults"]],
        numeric=(0, 3, 4, 5, 9), names=(1,))
    lines = "".join(f"<li>{html.escape(line)}</li>" for line in transfer_lines(report))

    def swap(text: str, begin: str, end: str, new: str) -> str:
        a, b = text.index(begin), text.index(end)
        return text[:a] + new + text[b:]

    page = swap(page, "<h2>Detection by fault kind</h2>", "<h3>Reason labels</h3>",
                f"<h2>Detection by transfer fault kind</h2>{kinds}")
    page = swap(page, "<h2>Violations and detections", "<h2>Violations and detections",
                f"<h2>Transfers per decode worker</h2>{workers}<ul>{lines}</ul>")
    page = swap(page, "<h2>Injected faults</h2>", "<h2>False positives</h2>",
                f"<h2>Injected transfer faults</h2>{faults}")
    page = page.replace("<title>kv-canary simulation report</title>",
                        "<title>kv-canary disaggregated simulation report</title>")
    page = page.replace("<h1>kv-canary simulation report</h1>", "<h1>kv-canary disaggregated simulation report</h1>")
    page = page.replace(f"<p>{html.escape(base.headline(report))}</p>", f"<p>{html.escape(headline(report))}</p>")
    return page.replace(html.escape(base.verdict(report)), html.escape(verdict(report)))


def write_json(report: dict[str, Any], path: str | Path) -> Path:
    return base.write_json(report, path)


def write_html(report: dict[str, Any], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_html(report))
    return path


def dumps(report: dict[str, Any]) -> str:
    return json.dumps(report, indent=2)
