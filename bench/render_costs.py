#!/usr/bin/env python3
"""Render the measured engine costs of ``bench/engine_cost.json`` into ``docs/costs.md``.

    python bench/render_costs.py            # rewrite the page's rendered part
    python bench/render_costs.py --check    # exit status 1 when the page differs from what the JSON renders

The page keeps its own prose; only the text between the two marker comments (:data:`BEGIN`, :data:`END`) is
written here, so a figure of the page can only change by re-measuring (``python bench/bench_engine_cost.py``
writes the JSON) and re-rendering. ``tests/test_docs_reference.py`` renders again and compares with the page.
Needs only the standard library.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
JSON_PATH = ROOT / "bench" / "engine_cost.json"
PAGE_PATH = ROOT / "docs" / "costs.md"
BEGIN = "<!-- BEGIN figures rendered by bench/render_costs.py from bench/engine_cost.json: do not edit -->"
END = "<!-- END figures rendered by bench/render_costs.py -->"
BACKENDS = ("host", "numpy")


def _pct(value: float) -> str:
    return f"{100 * value:.1f} %"


def _span(low: float, high: float) -> str:
    return f"{100 * low:.1f} .. {100 * high:.1f} %"


def _share_table(rows: list[dict[str, Any]]) -> list[str]:
    lines = ["| backend | rounds | share, median of rounds | middle half of the rounds | spread (min..max) | "
             "canary timers, median | run without the canary, median |",
             "|---|--:|--:|--:|--:|--:|--:|"]
    for r in rows:
        middle = _span(r["share_q1"], r["share_q3"]) if "share_q1" in r else "n/a"
        lines.append(f"| {r['backend']} | {r['rounds']} | {_pct(r['share_median'])} | {middle} | "
                     f"{_span(r['share_min'], r['share_max'])} | {_pct(r['timer_share_median'])} | "
                     f"{statistics.median(r['without_s']):.1f} s |")
    return lines


def _long_context_table(rows: list[dict[str, Any]]) -> list[str]:
    lines = ["| backend | context + new tokens | rounds | run without, median | full verify: share (spread), "
             "timers | bounded verify (N): share (spread), timers | verify time per run, full → bounded |",
             "|---|--:|--:|--:|--:|--:|--:|"]
    for r in rows:
        cells = [f"{_pct(r[k]['share_median'])} ({_span(r[k]['share_min'], r[k]['share_max'])}), "
                 f"{_pct(r[k]['timer_share_median'])}" for k in ("full", "bounded")]
        lines.append(f"| {r['backend']} | {r['context']:,} + {r['new_tokens']} | {r['rounds']} | "
                     f"{statistics.median(r['without_s']):.1f} s | {cells[0]} | (N = {r['bounded_n']:,}) "
                     f"{cells[1]} | {r['full']['verify_s_median']:.3f} s → {r['bounded']['verify_s_median']:.3f} s |")
    return lines


def _scaling_table(rows: list[dict[str, Any]]) -> list[str]:
    backends = [b for b in BACKENDS if rows and f"{b}_ms" in rows[0]]
    head = "| B × L | engine step |" + "".join(f" {b}, full | {b}, bounded |" for b in backends)
    lines = [head, "|---|--:|" + "--:|--:|" * len(backends)]
    for r in rows:
        cells = [f"{r['batch']} × {r['context']:,}", f"{r['engine_ms']:,.1f} ms"]
        for b in backends:
            for key in (f"{b}_ms", f"{b}_bounded_ms"):
                cells.append(f"{r[key]:.2f} ms ({_pct(r[key] / r['engine_ms'])})")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def render(data: dict[str, Any]) -> str:
    """The rendered part of the page (markers excluded) for one JSON written by bench_engine_cost.py."""
    out: list[str] = []
    if data.get("share"):
        out += ["### The share of transformers' `generate_batch`", "",
                f"torch on {data.get('torch_threads', '?')} thread(s); 1-minute load average "
                f"{data['load_1min_start']:.1f} at the start, {data['share_load_after']:.1f} after these rounds.",
                "", *_share_table(data["share"]), ""]
    if data.get("long_context"):
        out += ["### A real long context", "", *_long_context_table(data["long_context"]), ""]
    if data.get("scaling"):
        bounded = {r["bounded_n"] for r in data.get("long_context", [])}
        note = f" (bounded: N = {min(bounded):,})" if len(bounded) == 1 else ""
        out += ["### One decode step against context length and batch size", "",
                f"Fastest of the runs; the model's step on {data.get('scaling_torch_threads', '?')} torch "
                f"thread(s); percentages are of the engine step in the same row{note}. 1-minute load average "
                f"{data['load_1min_end']:.1f} at the end of the bench.", "",
                *_scaling_table(data["scaling"]), ""]
    return "\n".join(out).rstrip("\n") + "\n"


def splice(page: str, rendered: str) -> str:
    """``page`` with the text between the markers replaced by ``rendered``."""
    start, end = page.find(BEGIN), page.find(END)
    if start < 0 or end < start:
        raise ValueError(f"the page lacks the markers {BEGIN!r} ... {END!r}")
    return page[:start + len(BEGIN)] + "\n" + rendered + page[end:]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, default=JSON_PATH)
    parser.add_argument("--page", type=Path, default=PAGE_PATH)
    parser.add_argument("--check", action="store_true", help="only compare; exit status 1 when they differ")
    args = parser.parse_args(argv)
    page = args.page.read_text()
    new = splice(page, render(json.loads(args.json.read_text())))
    if args.check:
        if new != page:
            print(f"{args.page} differs from what {args.json} renders: run bench/render_costs.py", file=sys.stderr)
            return 1
        return 0
    if new != page:
        args.page.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
