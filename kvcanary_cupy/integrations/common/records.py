"""What ``kvcanary simulate --engine <engine>`` records for an engine the canary is installed in: the run's
configuration (:class:`EngineSimConfig`, with the checks every engine makes, and :func:`parse_inject` for its
``--inject``), one :class:`RunRecord` per engine run and the whole simulation's outcome (:class:`EngineSimulation`),
filled by :func:`run_workloads` in the same order for every engine: per workload a reference run without the
canary, a clean run with it, then one run per requested fault kind, steps numbered globally across the runs (for
the timeline). The engine's ``simulate`` module supplies its runs (:class:`WorkloadRuns`); its ``report`` module
reads the records.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from ..._errors import fail
from .state import StepViolation


@dataclass(frozen=True)
class EngineSimConfig:
    """The options of an engine simulation (each engine sets its own defaults for ``model_size`` and
    ``inject_at``)."""

    model_size: str
    inject: tuple[str, ...] = ()
    seed: int = 0
    backend: str = "auto"
    real_kv_hash: str = "partial"
    with_v: bool = True
    inject_at: int = 4
    sweep_interval: int = 8
    ring_capacity: int = 4096  # violation ring rows per canary group
    workloads: tuple[str, ...] = ()  # empty: all

    def check_choices(self, engine: str, *, fault_kinds: Iterable[str], workloads: Iterable[str],
                      backend_note: str = "") -> None:
        """The checks every engine makes: known fault kinds, a backend a CPU engine runs, the ring's size, known
        workloads (``backend_note`` is added to the backend's message after the engine's name)."""
        from ...sim.config import MAX_RING_CAPACITY

        kinds, known = list(fault_kinds), list(workloads)
        if not 1 <= self.ring_capacity <= MAX_RING_CAPACITY:
            fail(f"--ring-capacity must lie in [1, {MAX_RING_CAPACITY}], got {self.ring_capacity}")
        for kind in self.inject:
            if kind not in kinds:
                fail(f"unknown fault kind {kind!r} for --engine {engine}; choose from {', '.join(kinds)}")
        if self.backend not in ("auto", "numpy", "host"):
            fail(f"--backend {self.backend} is not available with --engine {engine}{backend_note} "
                 "(use auto, numpy or host)")
        for name in self.workloads:
            if name not in known:
                fail(f"unknown workload {name!r}; choose from {', '.join(known)}")


def parse_inject(items: Iterable[str], fault_kinds: Iterable[str]) -> tuple[str, ...]:
    """``--inject`` values (comma lists, ``all``, a ``:count`` suffix ignored) as kinds in order, each once."""
    inject: list[str] = []
    for item in items:
        for name in item.split(","):
            name = name.split(":", 1)[0].strip()
            if name == "all":
                inject.extend(k for k in fault_kinds if k not in inject)
            elif name and name not in inject:
                inject.append(name)
    return tuple(inject)


@dataclass
class RunRecord:
    """One engine run with the canary installed (``kind`` None: the clean run)."""

    workload: str
    kind: str | None
    steps: int
    step_offset: int  # the global number of the run's first step
    violations: list[StepViolation]
    fault: Any  # the engine's InjectedFault, None when nothing was injected
    stats: Any  # the engine's WorkloadStats
    seconds: dict[str, float]  # wall time per canary phase
    wall: float
    counters: dict[str, int]
    status_bits: int
    dropped: int
    health_problems: list[tuple[int, str]]


ConfigT = TypeVar("ConfigT", bound=EngineSimConfig)
RunT = TypeVar("RunT", bound=RunRecord)


@dataclass
class EngineSimulation(Generic[ConfigT, RunT]):
    """The outcome of a simulation; ``wall`` and ``total_steps`` are set when the run finishes."""

    cfg: ConfigT
    runs: list[RunT] = field(default_factory=list)
    token_exact: dict[str, bool] = field(default_factory=dict)
    reference_wall: dict[str, float] = field(default_factory=dict)
    model_params: int = 0
    wall: float = 0.0
    total_steps: int = 0


@dataclass(frozen=True)
class WorkloadRuns(Generic[RunT]):
    """One workload's runs in an engine, for :func:`run_workloads`."""

    reference: Callable[[], Any]  # the workload without the canary: what a clean run must reproduce
    run: Callable[[str | None, int, int], RunT]  # (kind or None for clean, global first step, kind's index)
    token_exact: Callable[[RunT, Any], bool]  # (clean run, reference): the same output, nothing failed


def run_workloads(sim: EngineSimulation[Any, RunT], names: list[str], workload: Callable[[str], WorkloadRuns[RunT]],
                  progress: Callable[[int, int, str], None] | None) -> None:
    """Record every named workload's runs in ``sim`` (``workload(name)`` readies the engine for it) and set
    ``total_steps``; ``progress(done, total, what)`` after each run with the canary."""
    offset = 0
    total = len(names) * (2 + len(sim.cfg.inject))
    done = 0
    for name in names:
        runs = workload(name)
        t = time.perf_counter()
        reference = runs.reference()
        sim.reference_wall[name] = time.perf_counter() - t
        done += 1
        clean = runs.run(None, offset, 0)
        offset += clean.steps + 1
        sim.runs.append(clean)
        sim.token_exact[name] = runs.token_exact(clean, reference)
        done += 1
        if progress is not None:
            progress(done, total, f"{name}: clean run, {len(clean.violations)} violation(s)")
        for i, kind in enumerate(sim.cfg.inject):
            result = runs.run(kind, offset, i)
            offset += result.steps + 1
            sim.runs.append(result)
            done += 1
            if progress is not None:
                progress(done, total, f"{name}: {kind}")
    sim.total_steps = offset


def run_with_canary(canary: Any, observers: Iterable[Any], workload: Callable[[], Any],
                    close: Callable[[], None] | None = None) -> tuple[Any, float]:
    """Run ``workload()`` with ``canary`` installed and ``observers`` watching its steps (the workload's stats,
    an injector): its result and wall time. The canary reads what the last step appended, then is removed
    whatever happens (and ``close()`` undoes what an injector still patches)."""
    canary.observers.extend(observers)
    start = time.perf_counter()
    try:
        out = workload()
        wall = time.perf_counter() - start
        canary.finish()
    finally:
        canary.remove()
        if close is not None:
            close()
    return out, wall
