"""The synthetic engine and its canary as one side of a disaggregated run runs them.

:class:`SideSimulation` is :class:`~kvcanary_cupy.sim.runner.Simulation` (the same step loop, the canary
installed through :mod:`kvcanary_cupy.runtime`, the same attribution of every violation row) built around an
engine and a workload that the caller chooses: the prefill process's engine sees only prompts, a decode
worker's engine starts empty and is fed transferred requests. The per-process result is a JSON-ready dict
that the parent merges into the report.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from ..config import PRESETS, SimConfig, resolve_backend
from ..engine import Engine, EngineConfig
from ..faults import FaultInjector, FaultTracker
from ..report import build_report
from ..runner import PhaseTimer, Simulation
from ..workload import RequestSpec


class SideSimulation(Simulation):
    """A :class:`Simulation` over an ``engine_cls`` engine built from ``engine_cfg`` and ``workload``;
    ``max_steps`` bounds the steps it may run (the length of its timelines)."""

    def __init__(self, cfg: SimConfig, workload: list[RequestSpec], engine_cfg: EngineConfig,
                 engine_cls: type[Engine] = Engine, *, max_steps: int) -> None:
        cfg.validate()
        self.cfg = cfg
        self.preset = PRESETS[cfg.preset]
        self.backend, self.xp, self.device = resolve_backend(cfg.backend)
        self.workload = workload
        self.engine_cfg = engine_cfg
        self.engine = engine_cls(engine_cfg, workload, self.xp)
        self.tracker = FaultTracker(self.engine)
        self.engine.on_assign = self.tracker.on_assign
        self.engine.on_splice = self.tracker.on_splice
        self.injector = FaultInjector({}, self.engine, self.tracker, np.random.default_rng([cfg.seed, 1]),
                                      start=0, stop=0, partial_hash=False, kv_groups=["FULL"])
        self.timer = PhaseTimer(self.xp if self.backend == "cuda" else None)
        self.recorder = None
        self.tiers = None  # a disaggregated side keeps no lower KV tier (--tiers is refused with it)
        self.runtime = self._install_canary()
        self._clear_findings(max_steps)
        self._start = time.perf_counter()

    def finish(self, last_step: int) -> None:
        """Read what the last step's launches appended (the runtime's flush); stop the clock."""
        self._attribute(self.runtime.flush(), read_step=last_step + 1)
        self.steps_run = last_step + 1
        self.wall = time.perf_counter() - self._start

    def result(self) -> dict[str, Any]:
        """Counts, violations and costs of this process (the report's building blocks)."""
        report = build_report(self)
        n = self.steps_run + 1
        report["timeline"] = {k: v[:n] for k, v in report["timeline"].items()}
        report["timers"] = {"wall": dict(self.timer.wall), "calls": dict(self.timer.calls)}
        report["health_problems"] = list(self.health_problems)
        return report
