"""What every part of :class:`~kvcanary_cupy.runtime.CanaryRuntime` shares: :class:`RuntimeBase` (the state the
parts read and how one of them runs a bound launch: the observer and timer hooks around it, the storage checks of
a phase before its first launch, the refusal of host-only calls under CUDA-graph capture), :class:`LaunchEvent`
(what the observer hook is given) and :class:`Totals` (the run's tallies, read by ``stats()``)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .._errors import fail
from .._validate import GuardSet
from ..bind import BoundLaunch, distinct_guards
from .batch import StagedBatch
from .config import CanaryConfig, Capacities
from .groups import Endpoint, GroupState
from .pools import KvPools
from .scalars import Scalars
from .space import ArraySpace


@dataclass(frozen=True)
class LaunchEvent:
    """Passed to the ``observer`` hook around every launch (debugging and recording tools only)."""

    when: str  # "before" or "after"
    kind: str  # "scatter", "plan", "verify", "write"
    model: str
    group: GroupState | None = None
    endpoint: Endpoint | None = None
    stage: StagedBatch | None = None


@dataclass
class Totals:
    """What the run has counted so far (host side, one step late for the device's part)."""

    violations: int = 0
    by_group: dict[str, int] = field(default_factory=dict)
    dropped: int = 0
    status_bits: int = 0
    overflows: dict[str, int] = field(default_factory=dict)
    health_failures: int = 0
    sweeps: int = 0
    swept_slots: int = 0
    counters: dict[str, int] = field(default_factory=dict)  # last snapshot's run counters
    live_max: dict[str, int] = field(default_factory=dict)  # bounded verify: most live entries of a group's plan
    step_tokens_max: int = 0  # bounded verify: most new tokens of one forward (entries a step adds to the lists)


class RuntimeBase:
    """The state the runtime's parts share (set by ``CanaryRuntime.__init__`` and its creation) and the launch
    helpers every part uses. Not used on its own."""

    config: CanaryConfig
    pools: KvPools
    capacities: Capacities
    space: ArraySpace
    scalars: Scalars
    log: logging.Logger
    models: tuple[str, ...]
    step: int
    forwards: dict[str, int]  # prepare() calls per model
    groups: dict[str, GroupState]
    stages: dict[str, StagedBatch]
    _by_model: dict[str, list[GroupState]]
    _sweep_launches: dict[str, int]  # SWEEP launches per group (the sweep and the verify of restored slots)
    _totals: Totals
    _observer: Callable[[LaunchEvent], None] | None
    _timer: Callable[[str], contextlib.AbstractContextManager] | None
    # A phase's launches (held, so their ids stay theirs) and their distinct storage checks, by launch ids.
    _phase_guards: dict[tuple[int, ...], tuple[tuple[Any, ...], GuardSet]]

    @property
    def enabled(self) -> bool:
        return self.config.enabled

    def _timed(self, phase: str) -> contextlib.AbstractContextManager:
        return self._timer(phase) if self._timer is not None else contextlib.nullcontext()

    def _launch(self, launch: BoundLaunch, kind: str, model: str, group: GroupState | None = None,
                endpoint: Endpoint | None = None, timer_phase: str | None = None, *, checked: bool = False) -> None:
        """Run one bound launch; ``checked``: its storage checks ran just before (:meth:`_check_launches`)."""
        observer = self._observer
        if observer is not None:
            observer(LaunchEvent("before", kind, model, group, endpoint, self.stages.get(model)))
        with self._timed(timer_phase or kind):
            if checked:
                launch.run_checked()
            else:
                launch()
        if observer is not None:
            observer(LaunchEvent("after", kind, model, group, endpoint, self.stages.get(model)))

    def _outside_capture(self, call: str) -> None:
        # These calls wait on events, read host memory or validate on the host: inside a capture they would
        # fail deep in CUDA or bake one step's batch into the graph, so refuse them with a clear error.
        if self.space.capturing():
            fail(f"{call}() runs outside CUDA-graph capture; only pre_forward() and post_forward() may be captured")

    def _groups_of(self, model: str) -> list[GroupState]:
        groups = self._by_model.get(model) if isinstance(model, str) else None
        if groups is None:
            fail(f"model must be one of {', '.join(self.models)}, got {model!r}")
        return groups

    def _check_launches(self, groups: list[GroupState], role: str, *, with_plan: bool = False) -> None:
        """Every host-side check of the launches a phase is about to run, for every group, before the first
        of them runs: a group whose engine tensor moved refuses the phase with nothing launched for any group.
        The phase then runs them with ``checked=True`` (each storage check once per phase, not per launch).
        Which checks are distinct is worked out once per set of launches, not every step."""
        launches = tuple([state.plan for state in groups if with_plan and state.plan is not None]
                         + [launch for state in groups for ep in state.endpoints[role]
                            for launch in (ep.verify, ep.write)])
        key = tuple(map(id, launches))
        known = self._phase_guards.get(key)
        if known is None:
            if len(self._phase_guards) >= 64:
                self._phase_guards.clear()
            known = self._phase_guards[key] = (launches, GuardSet(distinct_guards(launches)))
        known[1].check()
