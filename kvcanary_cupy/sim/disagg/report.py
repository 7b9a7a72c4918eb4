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
import sys
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
    passed = (all(k["status"] == "detected" for k in kinds) and violations["false_positives"] == 0
              and not violations["status"] and violations["dropped"] == 0 and not health)
    return {
        "schema": SCHEMA_ID, "passed": passed, "exit_code": 0 if passed else 1,
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

HEADERS = (*base.HEADERS, "caught at")


def table_rows(report: dict[str, Any]) -> list[tuple[str, ...]]:
    rows = []
    for row, kind in zip(base.table_rows(report), report["kinds"], strict=True):
        where = ", ".join(f"{place} {n}" for place, n in sorted(kind["caught_at"].items()))
        rows.append((*row, where or "-"))
    return rows


def headline(report: dict[str, Any]) -> str:
    c = report["config"]
    return (f"kv-canary disaggregated simulation: preset {c['preset']}, 1 prefill process + {c['decode_workers']} "
            f"decode worker(s), {c['requests']} requests, seed {c['seed']}, backend {report['cost']['backend']}")


def transfer_lines(report: dict[str, Any]) -> list[str]:
    d = report["disaggregated"]
    p = d["prefill"]
    lines = [f"prefill: {p['requests']} requests shipped, {p['kv_bytes']:,} KV bytes + {p['canary_bytes']:,} canary "
             f"bytes (gather {p['gather_ms']:.1f} ms, send {p['send_ms']:.1f} ms); start-up {d['startup_s']:.1f} s"]
    for w in d["workers"]:
        lines.append(
            f"decode worker {w['worker']}: {w['requests']} requests, {w['pages']} pages, {w['kv_bytes']:,} KV bytes, "
            f"{w['canary_bytes']:,} canary bytes ({100 * w['canary_share']:.2f} % of KV); accepted {w['accepted']}, "
            f"rejected {w['rejected']} (+{w['rejected_residents']} residents); {w['finished']} decoded to the end; "
            f"transfer verify {w['verify_entries']:,} entries in {w['verify_ms']:.1f} ms")
    return lines


def verdict(report: dict[str, Any]) -> str:
    text = base.verdict(report)
    problems = []
    late = [k["kind"] for k in report["kinds"] if k["status"] == "late"]
    if late:
        problems.append("caught only after the first decode step: " + ", ".join(late))
    if report["disaggregated"]["health_problems"]:
        problems.append("canary health: " + "; ".join(report["disaggregated"]["health_problems"]))
    if problems:
        text = ("FAIL: " if text.startswith("PASS") else text + "; ") + "; ".join(problems)
    return text.replace("PASS: every injected fault kind was detected",
                        "PASS: every injected transfer fault was caught before its request's first decode step")


def render_text(report: dict[str, Any]) -> str:
    out = [headline(report), ""]
    rows = table_rows(report)
    if rows:
        widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(HEADERS)]
        fmt = "  ".join(f"{{:<{w}}}" if i in (0, 4, 5, 6) else f"{{:>{w}}}" for i, w in enumerate(widths))
        out += [fmt.format(*HEADERS).rstrip(), "  ".join("-" * w for w in widths)]
        out += [fmt.format(*r).rstrip() for r in rows]
    else:
        out.append("(clean run: no transfer fault injected)")
    out.append("")
    out += base.summary_lines(report) + transfer_lines(report) + base._fp_lines(report)
    out.append(verdict(report))
    return "\n".join(out)


def print_report(report: dict[str, Any], stream: TextIO | None = None, *, plain: bool = False) -> None:
    stream = stream or sys.stdout
    if plain or base._rich() is None:
        print(render_text(report), file=stream)
        return
    from rich.console import Console
    from rich.table import Table

    console = Console(file=stream, highlight=False, width=max(180, Console(file=stream).width))
    console.print(headline(report), markup=False, soft_wrap=True)
    table = Table()
    for i, head in enumerate(HEADERS):
        table.add_column(head, justify="right" if i in (1, 2, 3) else "left", no_wrap=True)
    colours = {"detected": "green", "late": "bold red", "missed": "bold red", "not injected": "yellow"}
    for row, kind in zip(table_rows(report), report["kinds"], strict=True):
        table.add_row(*row, style=colours[kind["status"]])
    console.print(table if report["kinds"] else "(clean run: no transfer fault injected)")
    for line in base.summary_lines(report) + transfer_lines(report) + base._fp_lines(report):
        console.print(line, markup=False, soft_wrap=True)
    console.print(verdict(report), style="bold green" if report["passed"] else "bold red", markup=False,
                  soft_wrap=True)


def render_html(report: dict[str, Any]) -> str:
    page = base.render_html(report)
    kinds = base._html_table(list(HEADERS), [list(r) for r in table_rows(report)])
    workers = base._html_table(
        ["worker", "requests", "pages", "KV bytes", "canary bytes", "canary / KV", "accepted", "rejected",
         "rejected residents", "transfer-verify entries", "verify ms", "decoded"],
        [[w["worker"], w["requests"], w["pages"], w["kv_bytes"], w["canary_bytes"], f"{100 * w['canary_share']:.2f} %",
          w["accepted"], w["rejected"], w["rejected_residents"], w["verify_entries"], w["verify_ms"], w["finished"]]
         for w in report["disaggregated"]["workers"]])
    faults = base._html_table(
        ["id", "kind", "side", "worker", "step", "request", "detail", "caught at", "reasons", "violations"],
        [[f["id"], f["kind"], f["side"], f["worker"], f["step"], f["request"], f["detail"], f["caught_at"],
          ", ".join(base.short_reason(r) for r in f["reasons"]), f["violations"]] for f in report["faults"]])
    start = page.index("<h2>Detection by fault kind</h2>")
    end = page.index("<h2>Violations and detections")
    page = page[:start] + f"<h2>Detection by transfer fault kind</h2>{kinds}" \
        f"<h2>Transfers per decode worker</h2>{workers}" + page[end:]
    start = page.index("<h2>Injected faults</h2>")
    end = page.index("<h2>False positives</h2>")
    page = page[:start] + f"<h2>Injected transfer faults</h2>{faults}" + page[end:]
    page = page.replace(html.escape(base.headline(report)), html.escape(headline(report)))
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
