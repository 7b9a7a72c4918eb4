"""The simulation report: one JSON-ready dict, rendered as a terminal table, a JSON file or an HTML page.

JSON schema (``schema: "kvcanary-sim-report/1"``; :data:`SCHEMA` is the same thing as a JSON Schema, and
:func:`validate` checks a report against it). Every field except those under ``cost`` and ``generated`` is a
deterministic function of the run's arguments (same seed, same report).

* ``schema`` (str), ``passed`` (bool), ``outcome`` ("passed"; "failed": a kind missed, a false positive, a
  kernel status flag or a full ring; "inconclusive": nothing failed, but a requested kind found no target to
  inject in this workload), ``exit_code`` (int: 0 passed, 1 failed, 4 inconclusive).
* ``generated``: ``tool`` ("kvcanary-cupy"), ``version``, ``timestamp`` (UTC, ISO 8601), ``host``, ``python``.
* ``config``: ``preset``, ``steps``, ``requests``, ``seed``, ``backend`` (requested), ``inject`` ({kind: rate
  per step}), ``sweep_interval``, ``warmup_steps``, ``cooldown_steps``, ``with_v``, ``real_kv_hash``
  ("all"/"partial"), ``ring_capacity``, ``engine`` (pool and model sizes: ``num_slots``, ``max_reqs``,
  ``max_seq_len``, ``max_running``, ``chunk_size``, ``page_size``, ``kv_bytes_per_token``, ``num_layers``,
  ``with_v``, ``swa_window``, ``swa_slots``, ``eagle``, ``layout``: the slot layout the plan read, token / block
  / csr, ``block_size`` and ``block_stride``: the engine's KV blocks, 1 and 1 in the token layout).
* ``workload``: what the engine did — ``steps_run``, ``requests_admitted``, ``requests_finished``,
  ``prefill_tokens``, ``decode_tokens``, ``prefix_tokens_reused``, ``rows_recycled``, ``padding_rows``,
  ``tree_evicted_slots``, ``swa_evicted_slots``, ``peak_running``, ``peak_slots_used``, ``sweeps``.
* ``kinds``: one entry per requested fault kind — ``kind``, ``title``, ``injected``, ``detected``, ``missed``
  (counts of faults), ``status`` ("detected": at least one of its faults was caught, "missed": none was, "not
  injected": no target was found for it), ``latency_steps`` ({``min``, ``median``, ``max``} steps from injection
  to the host reading the first violation, over detected faults; null when none), ``reasons`` (FailReason names
  that fired on its violations), ``violations`` (rows attributed to it).
* ``faults``: every injected fault — ``id``, ``kind``, ``step``, ``group`` (FULL/SWA/DRAFT), ``request``,
  ``position``, ``slot``, ``detail``, ``detected``, ``detection_step`` (read step), ``latency_steps``,
  ``detected_by`` (launch tag of the first violation), ``reasons``, ``violations``.
* ``violations``: ``total`` rows read, ``explained``, ``false_positives``, ``dropped`` (rows lost to a full
  ring), ``status`` (CanaryStatus names the kernels reported), ``by_tag`` ({launch tag: rows}; "/draft" marks
  the EAGLE draft's ring), ``by_reason`` ({FailReason name: rows}).
* ``false_positives``: the first 200 unexplained rows — ``read_step``, ``launch_step``, ``group``,
  ``launch_tag``, ``slot``, ``position``, ``stored_token``, ``expected_token``, ``reasons``.
* ``cost``: ``backend`` (the one used), ``device``, ``wall_s``, ``compile_s`` (compiling or loading the kernels,
  done before the timed run and excluded from every other cost figure), ``ms_per_step`` ({phase: wall-clock ms per
  step} for ``scatter``, ``plan``, ``verify``, ``write``, ``sweep``, ``read`` and the engine's own ``engine``),
  ``canary_ms_per_step`` (sum of the canary phases), ``device_ms_per_step`` (CUDA-event times on the cuda backend,
  else null), ``verify_entries``, ``write_entries``, ``launches`` (kernel counters), ``verify_entries_per_s``
  (entries / verify and sweep time).
* ``timeline``: per step ``0..steps`` (index = step), lists ``violations``, ``explained``,
  ``false_positives`` and ``detected`` (counted at the step they were read) and ``injected``.
* ``verify_bound`` (synthetic runs; optional in the schema): the bounded verify (``--max-verify-entries``) —
  ``entries_per_step`` (0: full verify), ``live_max`` (most live prefix entries of a group's plan), ``growth_max``
  (most new tokens of one forward), ``bound_steps`` (every live slot of an unchanging set of prefixes is verified
  within it), ``bound_steps_growing`` (the bound while ``growth_max`` entries a step are added; -1: none holds),
  ``slowest_steps`` (the longest detection latency of the run; null when nothing was detected).

``rich`` (terminal table, progress bar) and ``matplotlib`` (the HTML plot) are optional: without them the
table is plain text and the HTML page has no plot.
"""

from __future__ import annotations

import datetime
import html
import io
import json
import platform
import shutil
import socket
import statistics
import sys
import textwrap
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from .. import __version__
from ..constants import FailReason, reason_names
from .faults import ALL_FAULT_KINDS

SCHEMA_ID = "kvcanary-sim-report/1"

EXIT_PASSED, EXIT_FAILED, EXIT_INCONCLUSIVE = 0, 1, 4
OUTCOMES = {"passed": EXIT_PASSED, "failed": EXIT_FAILED, "inconclusive": EXIT_INCONCLUSIVE}

_INT = {"type": "integer"}
_NUM = {"type": "number"}
_STR = {"type": "string"}
_BOOL = {"type": "boolean"}
_INT_OR_NULL = {"type": ["integer", "null"]}
_STR_OR_NULL = {"type": ["string", "null"]}
_STR_LIST = {"type": "array", "items": _STR}
_INT_LIST = {"type": "array", "items": _INT}
_COUNTS = {"type": "object", "additionalProperties": _INT}


def _obj(props: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    return {"type": "object", "properties": props, "required": list(props) if required is None else required}


SCHEMA: dict[str, Any] = _obj({
    "schema": {"type": "string", "const": SCHEMA_ID},
    "passed": _BOOL,
    "outcome": {"type": "string", "enum": list(OUTCOMES)},
    "exit_code": _INT,
    "generated": _obj({"tool": _STR, "version": _STR, "timestamp": _STR, "host": _STR, "python": _STR}),
    "config": _obj({
        "preset": _STR, "steps": _INT, "requests": _INT, "seed": _INT, "backend": _STR,
        "inject": {"type": "object", "additionalProperties": _NUM}, "sweep_interval": _INT,
        "warmup_steps": _INT, "cooldown_steps": _INT, "with_v": _BOOL,
        "real_kv_hash": {"type": "string", "enum": ["all", "partial"]}, "ring_capacity": _INT,
        "engine": _obj({
            "num_slots": _INT, "max_reqs": _INT, "max_seq_len": _INT, "max_running": _INT, "chunk_size": _INT,
            "page_size": _INT, "kv_bytes_per_token": _INT, "num_layers": _INT, "with_v": _BOOL,
            "swa_window": _INT, "swa_slots": _INT, "eagle": _BOOL,
            "layout": {"type": "string", "enum": ["token", "block", "csr"]}, "block_size": _INT,
            "block_stride": _INT,
        }),
    }),
    "workload": _obj({k: _INT for k in (
        "steps_run", "requests_admitted", "requests_finished", "prefill_tokens", "decode_tokens",
        "prefix_tokens_reused", "rows_recycled", "padding_rows", "tree_evicted_slots", "swa_evicted_slots",
        "peak_running", "peak_slots_used", "sweeps")}),
    "kinds": {"type": "array", "items": _obj({
        "kind": {"type": "string", "enum": list(ALL_FAULT_KINDS)}, "title": _STR, "injected": _INT,
        "detected": _INT,
        "missed": _INT, "status": {"type": "string", "enum": ["detected", "missed", "not injected"]},
        "latency_steps": {"type": ["object", "null"], "properties": {"min": _INT, "median": _NUM, "max": _INT},
                          "required": ["min", "median", "max"]},
        "reasons": _STR_LIST, "violations": _INT,
    })},
    "faults": {"type": "array", "items": _obj({
        "id": _INT, "kind": {"type": "string", "enum": list(ALL_FAULT_KINDS)}, "step": _INT,
        "group": {"type": "string", "enum": ["FULL", "SWA", "DRAFT"]}, "request": _INT_OR_NULL,
        "position": _INT_OR_NULL, "slot": _INT_OR_NULL, "detail": _STR, "detected": _BOOL,
        "detection_step": _INT_OR_NULL, "latency_steps": _INT_OR_NULL, "detected_by": _STR_OR_NULL,
        "reasons": _STR_LIST, "violations": _INT,
    })},
    "violations": _obj({
        "total": _INT, "explained": _INT, "false_positives": _INT, "dropped": _INT, "status": _STR_LIST,
        "by_tag": _COUNTS, "by_reason": _COUNTS,
    }),
    "false_positives": {"type": "array", "items": _obj({
        "read_step": _INT, "launch_step": _INT, "group": _STR, "launch_tag": _STR, "slot": _INT, "position": _INT,
        "stored_token": _INT, "expected_token": _INT, "reasons": _STR_LIST,
    })},
    "cost": _obj({
        "backend": _STR, "device": _STR, "wall_s": _NUM, "compile_s": _NUM,
        "ms_per_step": {"type": "object", "additionalProperties": _NUM,
                        "required": ["scatter", "plan", "verify", "write", "sweep", "read", "engine"]},
        "canary_ms_per_step": _NUM,
        "device_ms_per_step": {"type": ["object", "null"], "additionalProperties": _NUM},
        "verify_entries": _INT, "write_entries": _INT, "launches": _INT, "verify_entries_per_s": _NUM,
    }),
    "timeline": _obj({k: _INT_LIST for k in ("violations", "explained", "false_positives", "detected", "injected")}),
})

# The bounded verify (--max-verify-entries): present in every synthetic report, optional in the schema (the
# disaggregated and transformers reports have none). ``entries_per_step`` N (0: full verify), ``live_max`` (most
# live prefix entries of a group's plan), ``growth_max`` (most new tokens of one forward), ``bound_steps``
# (ceil(live_max / N): every live slot of an unchanging set of prefixes is verified within it),
# ``bound_steps_growing`` (the bound while growth_max entries a step are added; -1: none holds), ``slowest_steps``
# (the longest detection latency of any fault, null when none was detected).
SCHEMA["properties"]["verify_bound"] = _obj({
    "entries_per_step": _INT, "live_max": _INT, "growth_max": _INT, "bound_steps": _INT,
    "bound_steps_growing": _INT, "slowest_steps": _INT_OR_NULL})

NONDETERMINISTIC = ("cost", "generated")  # everything else is reproducible from the arguments


# ---- validation ------------------------------------------------------------------------------------------


def _type_ok(value: Any, kind: str) -> bool:
    if kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return {"string": str, "boolean": bool, "object": dict, "array": list, "null": type(None)}[kind] is type(value) \
        or (kind == "object" and isinstance(value, dict))


def validate(report: Any, schema: dict[str, Any] = SCHEMA, path: str = "$") -> list[str]:
    """Errors of ``report`` against ``schema`` (the subset of JSON Schema that :data:`SCHEMA` uses)."""
    errors: list[str] = []
    kinds = schema.get("type")
    if kinds is not None:
        allowed = kinds if isinstance(kinds, list) else [kinds]
        if not any(_type_ok(report, k) for k in allowed):
            return [f"{path}: expected {' or '.join(allowed)}, got {type(report).__name__}"]
    if "const" in schema and report != schema["const"]:
        errors.append(f"{path}: expected {schema['const']!r}, got {report!r}")
    if "enum" in schema and report not in schema["enum"]:
        errors.append(f"{path}: {report!r} is not one of {schema['enum']}")
    if isinstance(report, dict):
        for key in schema.get("required", []):
            if key not in report:
                errors.append(f"{path}: missing {key!r}")
        props = schema.get("properties", {})
        extra = schema.get("additionalProperties")
        for key, value in report.items():
            if key in props:
                errors.extend(validate(value, props[key], f"{path}.{key}"))
            elif isinstance(extra, dict):
                errors.extend(validate(value, extra, f"{path}.{key}"))
    if isinstance(report, list) and "items" in schema:
        for i, item in enumerate(report):
            errors.extend(validate(item, schema["items"], f"{path}[{i}]"))
    return errors


# ---- building ----------------------------------------------------------------------------------------------


def short_reason(name: str) -> str:
    """``VERIFY_CHAIN_HASH_MISMATCH`` -> ``chain``, ``WRITE_POSITION_MISMATCH`` -> ``write-position``."""
    label = name.removeprefix("VERIFY_").removesuffix("_MISMATCH").removesuffix("_HASH")
    return label.lower().replace("_", "-")


def build_report(sim: Any) -> dict[str, Any]:
    """The report of a finished :class:`~kvcanary_cupy.sim.runner.Simulation` (passed in, not imported: the
    runner imports this module)."""
    cfg, eng = sim.cfg, sim.engine
    faults = sim.tracker.faults
    kinds = []
    for name, kind in ALL_FAULT_KINDS.items():
        if name not in cfg.inject:
            continue
        mine = [f for f in faults if f.kind == name]
        caught = [f for f in mine if f.detected]
        latencies = sorted(int(f.latency) for f in caught if f.latency is not None)
        bits = 0
        for f in mine:
            bits |= f.reason_bits
        kinds.append({
            "kind": name, "title": kind.title, "injected": len(mine), "detected": len(caught),
            "missed": len(mine) - len(caught),
            "status": "not injected" if not mine else ("detected" if caught else "missed"),
            "latency_steps": {"min": latencies[0], "median": float(statistics.median(latencies)),
                              "max": latencies[-1]} if latencies else None,
            "reasons": reason_names(bits), "violations": sum(f.violations for f in mine),
        })
    fault_rows = [{
        "id": f.fid, "kind": f.kind, "step": f.step, "group": f.group, "request": f.request, "position": f.position,
        "slot": f.slot, "detail": f.detail, "detected": f.detected, "detection_step": f.detection_read_step,
        "latency_steps": f.latency, "detected_by": f.detected_by, "reasons": reason_names(f.reason_bits),
        "violations": f.violations,
    } for f in faults]
    tl = sim.timeline
    fp_total = sum(tl["false_positives"])
    status_names = _status_names(sim.status_bits)
    failed = (any(k["status"] == "missed" for k in kinds) or fp_total > 0 or bool(sim.status_bits)
              or sim.dropped > 0 or bool(sim.health_problems))
    outcome = "failed" if failed else "inconclusive" if any(k["status"] == "not injected" for k in kinds) \
        else "passed"

    steps = max(1, sim.steps_run)
    ms = {phase: 1000.0 * sim.timer.wall.get(phase, 0.0) / steps
          for phase in ("scatter", "plan", "verify", "write", "sweep", "read", "engine")}
    device = sim.timer.device_seconds()
    totals = sim.canary_counters()
    verify_time = sim.timer.wall.get("verify", 0.0) + sim.timer.wall.get("sweep", 0.0)
    stats = dict(eng.stats)
    stats.update(steps_run=sim.steps_run, sweeps=sim.sweeps)
    return {
        "schema": SCHEMA_ID,
        "passed": outcome == "passed",
        "outcome": outcome,
        "exit_code": OUTCOMES[outcome],
        "generated": {
            "tool": "kvcanary-cupy", "version": __version__,
            "timestamp": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "host": socket.gethostname(), "python": platform.python_version(),
        },
        "config": {
            "preset": cfg.preset, "steps": cfg.steps, "requests": cfg.requests, "seed": cfg.seed,
            "backend": cfg.backend, "inject": dict(cfg.inject), "sweep_interval": cfg.sweep_interval,
            "warmup_steps": cfg.warmup_steps, "cooldown_steps": cfg.cooldown, "with_v": cfg.with_v,
            "real_kv_hash": cfg.real_kv_hash, "ring_capacity": cfg.ring_capacity,
            "engine": sim.engine_cfg.as_dict(),
        },
        "workload": {k: int(v) for k, v in stats.items()},
        "kinds": kinds,
        "faults": fault_rows,
        "violations": {
            "total": sum(tl["violations"]), "explained": sum(tl["explained"]), "false_positives": fp_total,
            "dropped": sim.dropped, "status": status_names, "by_tag": dict(sorted(sim.by_tag.items())),
            "by_reason": dict(sorted(sim.by_reason.items())),
        },
        "false_positives": sim.false_positives,
        "cost": {
            "backend": sim.backend, "device": sim.device, "wall_s": round(sim.wall, 4),
            "compile_s": round(getattr(sim, "compile_s", 0.0), 4),
            "ms_per_step": {k: round(v, 4) for k, v in ms.items()},
            "canary_ms_per_step": round(sum(v for k, v in ms.items() if k != "engine"), 4),
            "device_ms_per_step": None if device is None else {k: round(1000 * v / steps, 4)
                                                                for k, v in device.items()},
            **totals,
            "verify_entries_per_s": round(totals["verify_entries"] / verify_time, 1) if verify_time > 0 else 0.0,
        },
        "timeline": {k: list(v) for k, v in tl.items()},
        **({"tiers": sim.tiers.summary()} if getattr(sim, "tiers", None) is not None else {}),
        "verify_bound": _verify_bound(sim.runtime.verify_bound(), faults),
    }


def _verify_bound(bound: dict[str, Any], faults: list[Any]) -> dict[str, Any]:
    latencies = [int(f.latency) for f in faults if f.detected and f.latency is not None]
    return {"entries_per_step": bound["verify_entries_per_step"], "live_max": bound["verify_live_max"],
            "growth_max": bound["verify_growth_max"], "bound_steps": bound["verify_bound_steps"],
            "bound_steps_growing": bound["verify_bound_steps_growing"],
            "slowest_steps": max(latencies) if latencies else None}


def _status_names(bits: int) -> list[str]:
    from ..constants import CanaryStatus

    return [str(m.name) for m in CanaryStatus if bits & m.value]


def deterministic_view(report: dict[str, Any]) -> dict[str, Any]:
    """The report without its timing fields: equal for equal arguments."""
    return {k: v for k, v in report.items() if k not in NONDETERMINISTIC}


# ---- terminal ----------------------------------------------------------------------------------------------

HEADERS = ("fault kind", "injected", "detected", "missed", "steps to detect (min/med/max)", "reasons fired")
_NUMERIC = (1, 2, 3)
_WRAPPED = (4, 5)  # the columns that wrap when the terminal is narrow
DEFAULT_WIDTH = 80


def table_rows(report: dict[str, Any]) -> list[tuple[str, ...]]:
    rows: list[tuple[str, ...]] = []
    for k in report["kinds"]:
        lat = k["latency_steps"]
        latency = "-" if lat is None else f"{lat['min']} / {lat['median']:g} / {lat['max']}"
        reasons = ", ".join(short_reason(r) for r in k["reasons"]) or "-"
        rows.append((k["kind"], str(k["injected"]), str(k["detected"]), str(k["missed"]), latency, reasons))
    return rows


def headline(report: dict[str, Any]) -> str:
    c = report["config"]
    engine = c["engine"]
    layout = engine.get("layout", "token")  # reports that embed this one (disaggregated) nest their engines
    blocks = ""
    if layout != "token":
        size, stride = engine["block_size"], engine["block_stride"]
        blocks = f", {size}-token blocks" + ("" if stride == size else f" {stride} slots apart")
    tiers = report.get("tiers")
    return (f"kv-canary: preset {c['preset']}, {report['workload']['steps_run']} steps, "
            f"{c['requests']} requests, seed {c['seed']}, backend {report['cost']['backend']}"
            + ("" if layout == "token" else f", {layout} layout{blocks}")
            + ("" if not tiers else f", tiers {','.join(tiers['tiers'])}"))


def summary_lines(report: dict[str, Any]) -> list[str]:
    v, cost, w = report["violations"], report["cost"], report["workload"]
    ms = cost["ms_per_step"]
    phases = " + ".join(f"{phase} {ms[phase]:.2f}" for phase in ("plan", "verify", "write", "scatter", "sweep", "read"))
    lines = [
        f"false positives: {v['false_positives']} ({v['total']} violations read, {v['explained']} explained by "
        f"injected faults" + (f", {v['dropped']} dropped by a full ring" if v["dropped"] else "") + ")",
        f"workload: {w['requests_finished']}/{w['requests_admitted']} requests finished, {w['prefill_tokens']} "
        f"prefill + {w['decode_tokens']} decode tokens, {w['prefix_tokens_reused']} prefix tokens reused, "
        f"{w['rows_recycled']} rows recycled, {w['sweeps']} sweeps",
        f"canary cost per step ({cost['backend']}): {cost['canary_ms_per_step']:.2f} ms = {phases} ms "
        f"(engine {ms['engine']:.2f} ms); {cost['verify_entries_per_s']:,.0f} entries verified/s",
    ]
    vb = report.get("verify_bound")
    if vb and vb["entries_per_step"]:
        grow = vb["bound_steps_growing"]
        slowest = "no fault detected" if vb["slowest_steps"] is None else \
            f"slowest detection {vb['slowest_steps']} steps"
        lines.append(f"bounded verify: {vb['entries_per_step']} entries/step/group; every live slot verified within "
                     f"{vb['bound_steps']} steps ({vb['live_max']} live entries), "
                     + (f"within {grow} while {vb['growth_max']} entries are added per step" if grow > 0 else
                        f"no bound while {vb['growth_max']} entries are added per step") + f"; {slowest}")
    if cost["backend"] != "numpy":
        lines.append(f"kernel compile/load before the run: {cost['compile_s']:.2f} s (not in the costs above)")
    if v["status"]:
        lines.append(f"kernel status flags: {', '.join(v['status'])}")
    return lines


def warnings(report: dict[str, Any]) -> list[str]:
    """What the user should know although it is no failure: requested kinds the workload gave no target."""
    absent = [k["kind"] for k in report["kinds"] if k["status"] == "not injected"]
    if not absent:
        return []
    return [f"warning: the workload is too small to inject {', '.join(absent)} (no target was found for "
            f"{'it' if len(absent) == 1 else 'them'}); run more --steps or --requests"]


def verdict(report: dict[str, Any]) -> str:
    outcome = report["outcome"]
    if outcome == "passed":
        if report["kinds"]:
            return "PASS: every injected fault kind was detected, no false positive"
        return "PASS: no violation in a clean run"
    absent = [k["kind"] for k in report["kinds"] if k["status"] == "not injected"]
    if outcome == "inconclusive":
        return (f"INCONCLUSIVE: could not inject {', '.join(absent)} (no target in this workload); every fault "
                "that was injected was detected, no false positive")
    problems = []
    missed = [k["kind"] for k in report["kinds"] if k["status"] == "missed"]
    if missed:
        problems.append(f"missed {', '.join(missed)}")
    if report["violations"]["false_positives"]:
        problems.append(f"{report['violations']['false_positives']} false positive(s)")
    if report["violations"]["dropped"]:
        problems.append(f"{report['violations']['dropped']} violation(s) dropped by a full ring")
    if report["violations"]["status"]:
        problems.append(f"kernel status {', '.join(report['violations']['status'])}")
    if absent:
        problems.append(f"could not inject {', '.join(absent)}")
    return "FAIL: " + "; ".join(problems)


def _wrap(line: str, width: int) -> list[str]:
    """A long summary line as lines of at most ``width`` columns, continuation lines indented."""
    return textwrap.wrap(line, width=width, subsequent_indent="  ", break_on_hyphens=False) or [""]


def _wrap_cells(row: tuple[str, ...], widths: list[int]) -> list[tuple[str, ...]]:
    cells = [textwrap.wrap(c, width=w, break_on_hyphens=False) or [""] if i in _WRAPPED else [c]
             for i, (c, w) in enumerate(zip(row, widths, strict=True))]
    height = max(len(c) for c in cells)
    return [tuple(c[j] if j < len(c) else "" for c in cells) for j in range(height)]


def _fp_where(fp: dict[str, Any]) -> str:
    return f"step {fp['launch_step']} {fp['launch_tag']} ({fp['group']})"


def _fp_lines(report: dict[str, Any], limit: int = 10,
              where: Callable[[dict[str, Any]], str] = _fp_where) -> list[str]:
    """The first false positives, one line each; ``where`` names the launch (runs differ only there)."""
    fps = report["false_positives"]
    if not fps:
        return []
    lines = [f"first false positives (of {report['violations']['false_positives']}):"]
    for fp in fps[:limit]:
        lines.append(f"  {where(fp)} slot {fp['slot']} position {fp['position']} token {fp['stored_token']} "
                     f"expected {fp['expected_token']}: {', '.join(short_reason(r) for r in fp['reasons'])}")
    return lines


def _rich() -> Any | None:
    try:
        import rich.box
        import rich.console
        import rich.table
    except ImportError:
        return None
    return rich


_STYLES = {"detected": "green", "missed": "bold red", "not injected": "yellow"}
_VERDICT_STYLES = {"passed": "bold green", "failed": "bold red", "inconclusive": "bold yellow"}


@dataclass(frozen=True)
class ReportView:
    """What a run's text report puts around the shared fault table, each a function of the report dict: the
    synthetic engine's (:data:`SIMULATE_VIEW`), the disaggregated run's and the transformers run's differ
    only here, so the table layout, the 80-column fit and the wrapping are written once."""

    headline: Callable[[dict[str, Any]], str]
    headers: tuple[str, ...]
    rows: Callable[[dict[str, Any]], list[tuple[str, ...]]]
    lines: Callable[[dict[str, Any]], list[str]]  # summary, figures, false positives, warnings
    verdict: Callable[[dict[str, Any]], str]
    styles: dict[str, str] = field(default_factory=lambda: dict(_STYLES))
    empty: str = "(clean run: no fault injected)"


def tier_lines(report: dict[str, Any]) -> list[str]:
    """The KV hierarchy's figures (``--tiers``): what went down, what came back, what the records cost."""
    t = report.get("tiers")
    if not t:
        return []
    lines = [f"tiers: {t['written_back']} pages ({t['written_back_slots']} tokens) written back to L2; "
             f"{t['l2_hits']} load-backs from L2, {t['l3_hits']} from L3; {t['restored_slots']} restored slots "
             "verified before a forward read them"]
    if "disk" in t["tiers"]:
        lines.append(f"L3: {t['l3_files_written']} files written ({t['l3_bytes_written']} bytes), "
                     f"{t['l3_bytes_read']} bytes read back, {t['l3_evicted']} deleted by the "
                     f"{t['l3_capacity_bytes']}-byte cap")
    lines.append(f"records carried: {t['record_bytes']} bytes with {t['kv_bytes']} bytes of KV "
                 f"({100 * t['record_bytes_per_kv_byte']:.2f}% more bytes moved)")
    return lines


def _simulate_lines(report: dict[str, Any]) -> list[str]:
    return summary_lines(report) + tier_lines(report) + _fp_lines(report) + warnings(report)


def render_text(report: dict[str, Any], width: int = DEFAULT_WIDTH, view: ReportView | None = None) -> str:
    """The plain-text rendering (no optional dependency), at most ``width`` columns wide where the words allow."""
    view = view or SIMULATE_VIEW
    out = [*_wrap(view.headline(report), width), ""]
    rows = view.rows(report)
    if rows:
        headers = view.headers
        widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
        # Narrow the wrapping columns (the longest first) until the table fits, but not below 12 columns.
        while sum(widths) + 2 * (len(widths) - 1) > width:
            i = max(_WRAPPED, key=lambda c: widths[c])
            if widths[i] <= 12:
                break
            widths[i] -= 1
        fmt = "  ".join(f"{{:>{w}}}" if i in _NUMERIC else f"{{:<{w}}}" for i, w in enumerate(widths))
        for cells in _wrap_cells(headers, widths):
            out.append(fmt.format(*cells).rstrip())
        out.append("  ".join("-" * w for w in widths))
        for row in rows:
            out.extend(fmt.format(*cells).rstrip() for cells in _wrap_cells(row, widths))
    else:
        out.append(view.empty)
    out.append("")
    for line in [*view.lines(report), view.verdict(report)]:
        out.extend(_wrap(line, width))
    return "\n".join(out)


def print_report(report: dict[str, Any], stream: TextIO | None = None, *, plain: bool = False,
                 width: int | None = None, view: ReportView | None = None) -> None:
    """Print the table and summary: with rich when installed (and ``plain`` is False), else plain text. The
    width is ``width``, else the terminal's when ``stream`` is one, else 80 columns."""
    view = view or SIMULATE_VIEW
    stream = stream or sys.stdout
    rich = None if plain else _rich()
    if rich is None:
        if width is None:
            width = shutil.get_terminal_size((DEFAULT_WIDTH, 24)).columns if stream.isatty() else DEFAULT_WIDTH
        print(render_text(report, width, view), file=stream)
        return
    from rich.console import Console
    from rich.table import Table

    console = Console(file=stream, highlight=False, width=width)
    columns = console.width
    for line in _wrap(view.headline(report), columns):
        console.print(line, markup=False)
    table = Table(box=rich.box.SIMPLE_HEAD, show_edge=False, pad_edge=False, padding=(0, 1, 0, 0))
    for i, head in enumerate(view.headers):
        # A long latency header is stacked so that its column is no wider than its values; reasons take the rest.
        table.add_column(head.replace(" (", "\n(") if i == 4 else head, justify="right" if i in _NUMERIC else "left",
                         no_wrap=i != 5, overflow="fold")
    for row, kind in zip(view.rows(report), report["kinds"], strict=True):
        table.add_row(*row, style=view.styles[kind["status"]])
    if report["kinds"]:
        console.print(table)
    else:
        console.print(view.empty)
    for line in view.lines(report):
        for part in _wrap(line, columns):
            console.print(part, markup=False, style="yellow" if line.startswith("warning:") else None)
    for part in _wrap(view.verdict(report), columns):
        console.print(part, style=_VERDICT_STYLES[report["outcome"]], markup=False)


SIMULATE_VIEW = ReportView(headline, HEADERS, table_rows, _simulate_lines, verdict)


# ---- files -------------------------------------------------------------------------------------------------


def write_json(report: dict[str, Any], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    return path


#: What each reason label of the tables means (the FailReason bit it stands for).
REASON_MEANINGS = {
    FailReason.VERIFY_CHAIN_HASH_MISMATCH: "verify: the slot's chain hash does not follow from its predecessor",
    FailReason.VERIFY_POSITION_MISMATCH: "verify: the slot stores another position than the plan expects",
    FailReason.VERIFY_REAL_KV_HASH_MISMATCH: "verify: the real K/V bytes no longer match their fingerprint",
    FailReason.WRITE_TOKEN_MISMATCH: "write: the new token differs from the engine's token oracle",
    FailReason.WRITE_POSITION_MISMATCH: "write: the new token's position differs from the oracle's",
    FailReason.VERIFY_TOKEN_MISMATCH: "verify: the slot stores another token than the expected-token pool",
}


def plot_svg(report: dict[str, Any]) -> str | None:
    """An SVG of violations, injections and detections over the steps, or None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig = plot_figure(report)
    buf = io.StringIO()
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": "kvcanary"}):  # text stays text
        fig.savefig(buf, format="svg")
    plt.close(fig)
    svg = buf.getvalue()
    return svg[svg.index("<svg"):]  # inline: no XML prologue or DOCTYPE inside the HTML


def plot_figure(report: dict[str, Any]) -> Any:
    """The matplotlib figure behind :func:`plot_svg` (needs matplotlib)."""
    import matplotlib.pyplot as plt

    tl = report["timeline"]
    steps = list(range(len(tl["violations"])))
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 5.5), sharex=True, height_ratios=(3, 1.3))
    top.bar(steps, tl["explained"], width=0.9, color="#4c78a8", label="violations explained by a fault")
    top.bar(steps, tl["false_positives"], bottom=tl["explained"], width=0.9, color="#e45756", label="false positives")
    top.set_yscale("symlog", linthresh=10)
    peak = max((e + f for e, f in zip(tl["explained"], tl["false_positives"], strict=True)), default=0)
    top.set_ylim(0, max(20, peak * 3))  # headroom on the log scale: the tallest bar stays clear of the frame
    top.set_xlim(-1.5, len(steps) + 0.5)  # and the first and last bars clear of the sides
    top.set_ylabel("violations read")
    top.legend(loc="upper left", fontsize=8)
    by_kind: dict[str, list[tuple[int, int | None]]] = {k["kind"]: [] for k in reversed(report["kinds"])}
    for f in report["faults"]:
        by_kind.setdefault(f["kind"], []).append((f["step"], f["detection_step"]))
    names = list(by_kind)  # the table's order, top to bottom
    for y, name in enumerate(names):
        inj = [s for s, _ in by_kind[name]]
        det = [d for _, d in by_kind[name] if d is not None]
        bottom.scatter(inj, [y] * len(inj), marker="v", color="#f58518", s=22, zorder=3)
        bottom.scatter(det, [y] * len(det), marker="o", facecolors="none", edgecolors="#54a24b", s=30, zorder=3)
        for s, d in by_kind[name]:
            if d is not None:
                bottom.plot([s, d], [y, y], color="#54a24b", linewidth=1)
    bottom.set_yticks(range(len(names)), names, fontsize=7)
    bottom.set_ylim(-0.7, max(0.7, len(names) - 0.3))
    bottom.set_xlabel("step (orange ▼ injected, green ○ first detection read)")
    fig.tight_layout()
    return fig


def _html_table(headers: list[str], rows: list[list[Any]], *, numeric: tuple[int, ...] = (),
                names: tuple[int, ...] = ()) -> str:
    """A table whose ``numeric`` columns are right-aligned and whose ``names`` columns never wrap; a list cell
    (reason labels) wraps between its items only, never at a hyphen inside one."""

    def cls(i: int) -> str:
        return ' class="num"' if i in numeric else ' class="name"' if i in names else ""

    def cell(value: Any) -> str:
        if isinstance(value, list):
            return ", ".join(f'<span class="name">{html.escape(str(v))}</span>' for v in value)
        return html.escape("" if value is None else str(value))

    head = "".join(f"<th{cls(i)}>{html.escape(str(h))}</th>" for i, h in enumerate(headers))
    body = "".join("<tr>" + "".join(f"<td{cls(i)}>{cell(c)}</td>" for i, c in enumerate(row)) + "</tr>"
                   for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _legend() -> str:
    items = "".join(f"<dt>{html.escape(short_reason(str(bit.name)))}</dt><dd>{html.escape(meaning)} "
                    f"(<code>{bit.name}</code>)</dd>" for bit, meaning in REASON_MEANINGS.items())
    return f'<dl class="legend">{items}</dl>'


def render_html(report: dict[str, Any]) -> str:
    svg = plot_svg(report)
    plot = (f'<figure role="img" aria-label="violations and detections over steps">{svg}</figure>' if svg else
            "<p><em>No plot: install matplotlib (the <code>report</code> extra) to get one.</em></p>")
    kinds = _html_table(list(HEADERS), [[*r[:5], [short_reason(x) for x in k["reasons"]] or "-"]
                                        for r, k in zip(table_rows(report), report["kinds"], strict=True)],
                        numeric=_NUMERIC, names=(0, 4))
    faults = _html_table(
        ["id", "kind", "step", "group", "request", "detail", "detected at", "latency", "first tag", "reasons",
         "violations"],
        [[f["id"], f["kind"], f["step"], f["group"], f["request"], f["detail"], f["detection_step"],
          f["latency_steps"], f["detected_by"], [short_reason(r) for r in f["reasons"]], f["violations"]]
         for f in report["faults"]], numeric=(0, 2, 4, 6, 7, 10), names=(1, 8))
    fps = _html_table(["read step", "tag", "group", "slot", "position", "stored token", "expected token", "reasons"],
                      [[f["read_step"], f["launch_tag"], f["group"], f["slot"], f["position"], f["stored_token"],
                        f["expected_token"], [short_reason(r) for r in f["reasons"]]]
                       for f in report["false_positives"]], numeric=(0, 3, 4, 5, 6), names=(1,))
    cost = report["cost"]
    cost_rows = [[phase, f"{ms:.3f}"] for phase, ms in cost["ms_per_step"].items()]
    colour = {"passed": "#2e7d32", "failed": "#c62828", "inconclusive": "#b26a00"}[report["outcome"]]
    summary = "".join(f"<li>{html.escape(line)}</li>" for line in summary_lines(report) + warnings(report))
    config = html.escape(json.dumps(report["config"], indent=2))
    gen = report["generated"]
    made = (f"{gen['tool']} {gen['version']}, generated {gen['timestamp']} on host {gen['host']} "
            f"(Python {gen['python']})")
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>kv-canary simulation report</title>
<meta name="generator" content="{html.escape(gen['tool'])} {html.escape(gen['version'])}">
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em; color: #222; max-width: 1200px; }}
table {{ border-collapse: collapse; margin: 0.5em 0 1.5em; font-size: 0.9em; }}
th, td {{ border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: left; vertical-align: top; }}
th {{ background: #f3f3f3; }}
.num {{ text-align: right; font-variant-numeric: tabular-nums; }}
.name {{ white-space: nowrap; }}
.verdict {{ font-weight: bold; color: {colour}; font-size: 1.2em; }}
.generated {{ color: #666; font-size: 0.85em; }}
figure {{ margin: 0; }}
figure svg {{ max-width: 100%; height: auto; }}
dl.legend {{ display: grid; grid-template-columns: max-content auto; gap: 0.2em 1em; font-size: 0.9em; }}
dl.legend dt {{ font-weight: bold; white-space: nowrap; }}
dl.legend dd {{ margin: 0; }}
pre {{ background: #f7f7f7; padding: 1em; font-size: 0.85em; }}
</style></head><body>
<h1>kv-canary simulation report</h1>
<p class="generated">{html.escape(made)}</p>
<p>{html.escape(headline(report))}</p>
<p class="verdict">{html.escape(verdict(report))}</p>
<h2>Detection by fault kind</h2>{kinds}
<h3>Reason labels</h3>{_legend()}
<h2>Violations and detections over the run</h2>{plot}
<h2>Summary</h2><ul>{summary}</ul>
<h2>Canary cost (ms per step, {html.escape(cost['backend'])})</h2>{_html_table(["phase", "ms/step"], cost_rows,
                                                                                numeric=(1,))}
<h2>Injected faults</h2>{faults}
<h2>False positives</h2>{fps if report["false_positives"] else "<p>None.</p>"}
<h2>Configuration</h2><pre>{config}</pre>
</body></html>
"""


def write_html(report: dict[str, Any], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_html(report))
    return path


# ---- progress ----------------------------------------------------------------------------------------------


class ProgressDisplay:
    """A live progress bar on a terminal (rich), plain progress lines otherwise, or nothing (``enabled=False``)."""

    def __init__(self, total: int, *, enabled: bool = True, stream: TextIO | None = None) -> None:
        self.total = total
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self._rich_progress: Any = None
        self._task: Any = None
        self._every = max(1, total // 10)

    def __enter__(self) -> ProgressDisplay:
        if self.enabled and self.stream.isatty() and _rich() is not None:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self._rich_progress = Progress(
                TextColumn("[bold]simulating"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
                TimeElapsedColumn(), console=Console(file=self.stream), transient=True)
            self._rich_progress.__enter__()
            self._task = self._rich_progress.add_task("steps", total=self.total, info="")
        return self

    def __exit__(self, *exc: object) -> None:
        if self._rich_progress is not None:
            self._rich_progress.__exit__(*exc)

    def __call__(self, step: int, counts: dict[str, int]) -> None:
        if not self.enabled:
            return
        info = (f"faults {counts['detected']}/{counts['injected']} detected, "
                f"{counts['false_positives']} false positives, {counts['running']} running")
        if self._rich_progress is not None:
            self._rich_progress.update(self._task, completed=step, info=info)
        elif step % self._every == 0 or step == self.total:
            print(f"step {step}/{self.total}: {info}", file=self.stream, flush=True)
