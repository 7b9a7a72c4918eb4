"""A synthetic serving engine that drives the canary, injects the faults real engines have, and reports.

``kvcanary simulate`` (see :mod:`kvcanary_cupy.cli`) runs it; from Python::

    from kvcanary_cupy.sim import SimConfig, run_simulation, parse_inject

    report = run_simulation(SimConfig(preset="mixed", steps=200, requests=48, seed=7,
                                      inject=parse_inject(["all"])))
    assert report["passed"]

Modules: :mod:`.workload` (the requests of a run), :mod:`.allocator` (slot free list), :mod:`.radix` (prefix
cache), :mod:`.kvstore` (real KV), :mod:`.requests` (requests and batches), :mod:`.engine` (scheduling,
req_to_token, SWA, EAGLE draft), :mod:`.faults` (one injector per fault kind, attribution), :mod:`.config`
(presets and options), :mod:`.runner` (the step loop; the canary is installed through
:mod:`kvcanary_cupy.runtime`, like in any engine), :mod:`.report` (JSON schema, terminal table, HTML) and
:mod:`.replay` (dumping a failing launch and running it again on another backend). :mod:`.disagg` runs
prefill and decode in separate processes and checks the KV transfers between them (``kvcanary simulate
--disaggregated``).
"""

from __future__ import annotations

from .faults import DEFAULT_RATE, FAULT_KINDS, TIER_FAULT_KINDS, Fault, parse_inject
from .replay import load_case, replay_case, run_replay
from .report import SCHEMA, deterministic_view, print_report, render_html, render_text, validate
from .runner import PRESETS, SimConfig, Simulation, applicable_kinds, run_simulation

__all__ = [
    "DEFAULT_RATE",
    "FAULT_KINDS",
    "PRESETS",
    "SCHEMA",
    "TIER_FAULT_KINDS",
    "Fault",
    "SimConfig",
    "Simulation",
    "applicable_kinds",
    "deterministic_view",
    "load_case",
    "parse_inject",
    "print_report",
    "render_html",
    "render_text",
    "replay_case",
    "run_replay",
    "run_simulation",
    "validate",
]
