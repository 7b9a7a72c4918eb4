#!/usr/bin/env python3
"""Render pytest-benchmark JSON reports of the kv-canary suites into Markdown (and a PNG plot).

    python bench/render.py bench/results/cpu.json [more.json ...] --out bench/RESULTS.md [--plot PATH | --no-plot]

Every row's time is its ``extra_info["device_s"]`` when present (GPU rows: median CUDA-event time of
the work on the device) and otherwise its fastest round of wall time (pytest-benchmark's ``min``).
:func:`add_ratios` derives ``ns_per_entry`` and the ratios to the floor / baseline / oracle rows of the
same group from those times; conftest.py calls it when the JSON is written, and this script calls it again
so that older reports render the same way.
Needs only the standard library; the plot needs matplotlib and is skipped, with a note, without it.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import sys
import textwrap
from collections import defaultdict
from pathlib import Path
from typing import Any

ROLE_ORDER = {"subject": 0, "info": 1, "baseline": 2, "floor": 3, "oracle": 4}
MODE_ORDER = {"eager": 0, "graph": 1}

# (description, goal text, row key, extra_info field, comparison, goal value)
TARGETS: list[tuple[str, str, str, str, str, float]] = [
    ("NumPy plan, bs=32 prefix=1024 +tokens", "≤ 20 ns/entry",
     "cpu.plan.numpy.bs32-p1024-tok", "ns_per_entry", "<=", 20.0),
    ("NumPy plan vs scalar oracle (same size)", "≥ 500× faster",
     "cpu.plan.numpy.bs32-p1024-tok", "speedup_vs_oracle", ">=", 500.0),
    ("NumPy plan vs output-fill floor", "≤ 8× the floor",
     "cpu.plan.numpy.bs32-p1024-tok", "ratio_to_floor", "<=", 8.0),
    ("NumPy verify, bs=8 prefix=512, no real-KV", "≤ 100 ns/entry",
     "cpu.verify.numpy.bs8-p512-tok", "ns_per_entry", "<=", 100.0),
    ("NumPy verify, bs=32 prefix=1024, no real-KV", "≤ 100 ns/entry",
     "cpu.verify.numpy.bs32-p1024-tok", "ns_per_entry", "<=", 100.0),
    ("NumPy verify, bs=256 prefix=2048, no real-KV", "≤ 100 ns/entry",
     "cpu.verify.numpy.bs256-p2048-tok", "ns_per_entry", "<=", 100.0),
    ("GPU plan, 1M entries (eager, device time) vs D2D copy + one launch", "≤ 1.5×",
     "gpu.plan.kernels-eager.bs256-p4096-tok", "ratio_to_floor_plus_launch", "<=", 1.5),
    ("GPU plan, 1M entries vs CuPy array-op baseline (eager)", "≥ 5× faster",
     "gpu.plan.kernels-eager.bs256-p4096-tok", "speedup_vs_baseline", ">=", 5.0),
    ("GPU decode step, 256 req × prefix 2048: plan+verify+write, graph replay, launch→sync", "≤ 30 µs",
     "gpu.step.kernels-graph.bs256-p2048-tok", "wall_us", "<=", 30.0),
    ("GPU decode step, 256 req × prefix 2048, graph replay, device time", "≤ 30 µs",
     "gpu.step.kernels-graph.bs256-p2048-tok", "device_us", "<=", 30.0),
    ("GPU decode step, 256 req × prefix 512, graph replay, launch→sync", "≤ 30 µs",
     "gpu.step.kernels-graph.bs256-p512-tok", "wall_us", "<=", 30.0),
]


# ----------------------------------------------------------------------------------------------------------
# ratios
# ----------------------------------------------------------------------------------------------------------
def row_seconds(bench: dict[str, Any]) -> float | None:
    """The time a row stands for: its device time where measured (GPU rows), else its fastest round.

    The fastest round is the code's own cost with the least interference from whatever else shares the
    machine; since floors run many rounds and oracles one to three, it also makes every ratio to a floor or
    an oracle conservative (a floor's best round is its most flattering one).
    """
    info = bench.get("extra_info") or {}
    if info.get("device_s"):
        return float(info["device_s"])
    stats = bench.get("stats") or {}
    return float(stats["min"]) if stats.get("min") else None


def add_ratios(benchmarks: list[dict[str, Any]]) -> None:
    """Add ``ns_per_entry`` and same-group ratios to each row's ``extra_info``, in place.

    Per entry (so an oracle timed on the same batch or a smaller one compares fairly):
    ``ratio_to_floor`` = row / floor, ``ratio_to_floor_plus_launch`` = row / (floor + one empty kernel
    launch, GPU), ``ratio_to_baseline`` = row / baseline (the baseline of the same mode, eager or graph,
    when the group has one) and ``speedup_vs_baseline`` its inverse, ``ratio_to_oracle`` = row / oracle
    and ``speedup_vs_oracle`` its inverse. Rows are not compared with themselves.
    """
    groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for bench in benchmarks:
        info = bench.setdefault("extra_info", {})
        seconds = row_seconds(bench)
        entries = info.get("entries") or 0
        if seconds is not None:
            info["time_basis"] = "device median (CUDA events)" if info.get("device_s") else "min wall"
            info["wall_us"] = float((bench.get("stats") or {}).get("median", math.nan)) * 1e6
            if info.get("device_s"):
                info["device_us"] = float(info["device_s"]) * 1e6
            if entries:
                info["ns_per_entry"] = seconds / entries * 1e9
        groups[bench.get("group") or ""].append(bench)

    def per_entry(bench):
        return (bench.get("extra_info") or {}).get("ns_per_entry")

    for rows in groups.values():
        by_role: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for bench in rows:
            by_role[bench["extra_info"].get("role", "")].append(bench)
        floor = next((b for b in by_role["floor"] if per_entry(b)), None)
        oracle = next((b for b in by_role["oracle"] if per_entry(b)), None)
        for bench in rows:
            info = bench["extra_info"]
            mine = per_entry(bench)
            if not mine:
                continue
            if floor is not None and floor is not bench:
                info["ratio_to_floor"] = mine / per_entry(floor)
                launch_s = floor["extra_info"].get("launch_s")
                if launch_s:
                    floor_s = per_entry(floor) * 1e-9 * info["entries"] + float(launch_s)
                    info["ratio_to_floor_plus_launch"] = row_seconds(bench) / floor_s
            baselines = [b for b in by_role["baseline"] if per_entry(b) and b is not bench]
            same_mode = [b for b in baselines if b["extra_info"].get("mode") == info.get("mode")]
            baseline = (same_mode or baselines or [None])[0]
            if baseline is not None and info.get("role") != "baseline":
                info["ratio_to_baseline"] = mine / per_entry(baseline)
                info["speedup_vs_baseline"] = per_entry(baseline) / mine
                info["baseline_label"] = baseline["extra_info"].get("label", baseline.get("name"))
            if oracle is not None and oracle is not bench:
                info["ratio_to_oracle"] = mine / per_entry(oracle)
                info["speedup_vs_oracle"] = per_entry(oracle) / mine


# ----------------------------------------------------------------------------------------------------------
# formatting
# ----------------------------------------------------------------------------------------------------------
def fmt_time(seconds: float | None) -> str:
    if seconds is None or not math.isfinite(seconds):
        return "–"
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if seconds >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds / 1e-9:.3g} ns"


def fmt_num(value: float | None, suffix: str = "") -> str:
    if value is None or not math.isfinite(value):
        return ""
    if value >= 1000:
        return f"{value:,.0f}{suffix}"
    return f"{value:.3g}{suffix}"


def fmt_entries(n: int) -> str:
    if n >= 1 << 20 and n % (1 << 20) == 0:
        return f"{n >> 20}Mi"
    return f"{n:,}"


def machine_line(report: dict[str, Any]) -> str:
    m = report.get("machine_info") or {}
    cpu = m.get("cpu_model") or (m.get("cpu") or {}).get("brand_raw") or m.get("processor") or "unknown CPU"
    cores = m.get("cpu_count") or (m.get("cpu") or {}).get("count")
    parts = [f"**{cpu}**" + (f" ({cores} logical CPUs)" if cores else "")]
    if m.get("gpu_name"):
        parts.append(f"GPU **{m['gpu_name']}** (CuPy {m.get('cupy_version', '?')}, CUDA runtime "
                     f"{m.get('cuda_runtime_version', '?')}, driver {m.get('cuda_driver_version', '?')})")
    else:
        parts.append("no GPU")
    parts.append(f"{m.get('system', '')} {m.get('release', '')} {m.get('machine', '')}".strip())
    parts.append(f"Python {m.get('python_version', '?')}, NumPy {m.get('numpy_version', '?')}")
    load = [m.get(k) for k in ("load_avg_start", "load_avg_end")]
    if all(v is not None for v in load):
        parts.append(f"1-min load average {load[0]:.1f} at start and {load[1]:.1f} at end"
                     + (" (the machine was shared; expect noise)" if max(load) > 0.5 * (cores or 1) else ""))
    return "; ".join(p for p in parts if p)


def report_date(report: dict[str, Any]) -> str:
    stamp = report.get("datetime")
    if not stamp:
        return "unknown date"
    try:
        when = dt.datetime.fromisoformat(stamp.replace("Z", "+00:00"))
    except ValueError:
        return stamp
    if when.tzinfo is not None:
        when = when.astimezone(dt.timezone.utc)
    return when.strftime("%Y-%m-%d %H:%M UTC")


def ordered_groups(benchmarks: list[dict[str, Any]]) -> list[tuple[str, list[dict[str, Any]]]]:
    groups: dict[str, list[dict[str, Any]]] = {}
    for bench in benchmarks:
        groups.setdefault(bench.get("group") or "", []).append(bench)
    def order(bench):
        info = bench["extra_info"]
        return (ROLE_ORDER.get(info.get("role"), 9), MODE_ORDER.get(info.get("mode"), 0), info.get("label", ""))

    return [(name, sorted(rows, key=order)) for name, rows in groups.items()]


def table(benchmarks: list[dict[str, Any]]) -> list[str]:
    gpu = any((b.get("extra_info") or {}).get("device_s") for b in benchmarks)
    head = ["group", "implementation", "entries", "time", "ns/entry",
            "× floor", "× baseline", "oracle ÷ row"]
    if gpu:
        head.insert(4, "launch→sync (median)")
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] * 2 + ["--:"] * (len(head) - 2)) + "|"]
    for name, rows in ordered_groups(benchmarks):
        for k, bench in enumerate(rows):
            info = bench["extra_info"]
            label = info.get("label", bench["name"])
            if info.get("role") in ("floor", "baseline", "oracle"):
                label = f"*{label}*"
            if info.get("starved"):
                label += " †"
            cells = [f"**{name}**" if k == 0 else "", label, fmt_entries(int(info.get("entries", 0))),
                     fmt_time(row_seconds(bench)), fmt_num(info.get("ns_per_entry")),
                     fmt_num(info.get("ratio_to_floor"), "×"), fmt_num(info.get("ratio_to_baseline"), "×"),
                     fmt_num(info.get("speedup_vs_oracle"), "×")]
            if gpu:
                cells.insert(4, fmt_time(info.get("wall_us", math.nan) * 1e-6))
            lines.append("| " + " | ".join(cells) + " |")
    return lines


def targets(benchmarks: list[dict[str, Any]]) -> list[str]:
    by_key = {(b.get("extra_info") or {}).get("key"): b for b in benchmarks}
    lines = ["| target | goal | measured | status |", "|---|---|--:|---|"]
    for text, goal, key, field, op, value in TARGETS:
        bench = by_key.get(key)
        got = None if bench is None else bench["extra_info"].get(field)
        if got is None or not math.isfinite(got):
            continue
        ok = got <= value if op == "<=" else got >= value
        unit = {"ns_per_entry": " ns/entry", "wall_us": " µs", "device_us": " µs"}.get(field, "×")
        lines.append(f"| {text} | {goal} | {fmt_num(got, unit)} | {'met' if ok else 'not met'} |")
    return lines if len(lines) > 2 else []


def plot(benchmarks: list[dict[str, Any]], path: Path) -> str | None:
    """ns per entry, log scale: one panel per step (group name before " · "), one cluster of bars per batch,
    one bar per implementation. Returns why the plot was skipped, or None once written."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "plot skipped: matplotlib is not installed (pip install '.[report]')"
    panels: dict[str, list[tuple[str, list[dict[str, Any]]]]] = {}
    labels: list[str] = []
    for name, rows in ordered_groups(benchmarks):
        rows = [b for b in rows if b["extra_info"].get("ns_per_entry")]
        if not rows:
            continue
        step, _, batch = name.partition(" · ")
        panels.setdefault(step, []).append((batch or step, rows))
        labels += [b["extra_info"].get("label", b["name"]) for b in rows if
                   b["extra_info"].get("label", b["name"]) not in labels]
    if not panels:
        return "plot skipped: no timed rows"
    palette = plt.get_cmap("tab10")
    color = {label: palette(k % 10) for k, label in enumerate(labels)}
    fig, axes = plt.subplots(len(panels), 1, figsize=(13, 3.2 * len(panels)), squeeze=False)
    for ax, (step, groups) in zip(axes[:, 0], panels.items(), strict=True):
        impls = [lb for lb in labels if any(b["extra_info"].get("label", b["name"]) == lb
                                            for _, rows in groups for b in rows)]
        width = 0.8 / len(impls)
        for k, impl in enumerate(impls):
            xs, ys = [], []
            for g, (_, rows) in enumerate(groups):
                for bench in rows:
                    if bench["extra_info"].get("label", bench["name"]) == impl:
                        xs.append(g + (k - (len(impls) - 1) / 2) * width)
                        ys.append(bench["extra_info"]["ns_per_entry"])
            ax.bar(xs, ys, width, label=impl, color=color[impl])
        ax.set_yscale("log")
        ax.set_xticks(range(len(groups)), [textwrap.fill(batch, 26) for batch, _ in groups], fontsize=7)
        ax.set_ylabel("ns per entry (log)")
        ax.set_title(step, fontsize=10, loc="left")
        ax.grid(axis="y", which="major", color="#dddddd", linewidth=0.6)
        ax.set_axisbelow(True)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.005, 1.0), frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return None


def render(reports: list[dict[str, Any]], plot_path: Path | None, out_dir: Path) -> str:
    lines = ["# kv-canary benchmark results", ""]
    all_benchmarks = []
    for report in reports:
        benchmarks = report.get("benchmarks") or []
        add_ratios(benchmarks)
        all_benchmarks += benchmarks
        version = report.get("version", "?")
        lines += [f"Measured {report_date(report)} with pytest-benchmark {version} on {machine_line(report)}.", ""]
    lines += [
        "Each row is one implementation on one batch; the rows of a group ran on the same inputs in the same",
        "run. *time*: the fastest round of wall time for CPU rows; for GPU rows the device time measured with",
        "CUDA events (median of 5 rounds), next to the median launch→sync wall time of one call. Ratios are",
        "per entry against rows of the same group: *× floor* = row ÷ floor (filling or copying the same",
        "bytes), *× baseline* = row ÷ array-op baseline, *oracle ÷ row* = how many times faster than the",
        "scalar oracle. Details: `bench/README.md`.",
        "",
    ]
    target_lines = targets(all_benchmarks)
    if target_lines:
        lines += ["## Targets (goals, not assertions)", "", *target_lines, ""]
    lines += ["## Results", "", *table(all_benchmarks), ""]
    if any(b["extra_info"].get("starved") for b in all_benchmarks):
        lines += ["† the GPU ran out of queued work during this row's event timing (the host could not issue",
                  "launches fast enough), so its device time includes idle gaps.", ""]
    if plot_path is not None:
        note = plot(all_benchmarks, plot_path)
        if note is None:
            rel = Path(plot_path).resolve()
            try:
                rel = rel.relative_to(out_dir.resolve())
            except ValueError:
                pass
            lines += [f"![ns per entry, per group]({rel.as_posix()})", ""]
        else:
            lines += [f"_{note}_", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("reports", nargs="+", type=Path, help="pytest-benchmark JSON files")
    parser.add_argument("--out", type=Path, help="Markdown file to write (default: stdout)")
    parser.add_argument("--plot", type=Path, help="PNG to write (default: next to --out, same stem)")
    parser.add_argument("--no-plot", action="store_true")
    args = parser.parse_args(argv)
    reports = [json.loads(path.read_text()) for path in args.reports]
    plot_path = None
    if not args.no_plot:
        plot_path = args.plot or (args.out.with_suffix(".png") if args.out else None)
    out_dir = args.out.parent if args.out else Path.cwd()
    text = render(reports, plot_path, out_dir)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
        print(f"wrote {args.out}" + (f" and {plot_path}" if plot_path and plot_path.exists() else ""))
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
