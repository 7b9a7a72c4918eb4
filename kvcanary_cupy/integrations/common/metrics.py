"""The Prometheus metrics every engine integration exports (where ``prometheus_client`` is installed).

:data:`METRICS` is the one list of them (name, type, labels, meaning): the exporter registers exactly these,
``docs/observability.md`` tabulates them, and the tests check the shipped Grafana dashboard and alerting rules
(:mod:`kvcanary_cupy.observability`) against it. Names follow Prometheus' conventions: a ``kvcanary_`` prefix,
snake_case, base units (``_seconds``), ``_total`` on counters. Every series carries the ``engine`` label
(``transformers``, ``vllm``); label values are the names the code defines (:class:`~kvcanary_cupy.FailReason`,
:class:`~kvcanary_cupy.CanaryStatus`, :class:`~kvcanary_cupy.PlanStatus`, the canary's KV group names).

:class:`StepMetrics` is fed by :class:`~.state.EngineCanaryState` after every read of the rings, so each engine
exports the same series with no code of its own. In a multi-process server (vLLM's API server and engine core)
set ``PROMETHEUS_MULTIPROC_DIR`` before the server starts, as for the engine's own metrics.
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ...runtime.reporting import status_flag_names

if TYPE_CHECKING:
    from ...runtime import StepReport


@dataclass(frozen=True)
class MetricSpec:
    """One exported metric: its full sample name, Prometheus type, label names and meaning."""

    name: str
    kind: str
    labels: tuple[str, ...]
    help: str


METRICS: tuple[MetricSpec, ...] = (
    MetricSpec("kvcanary_steps_total", "counter", ("engine",),
               "Engine steps whose KV-cache writes and reads the kv-canary checked"),
    MetricSpec("kvcanary_violations_total", "counter", ("engine", "group", "reason"),
               "KV-cache integrity violations the kv-canary read, per KV group and FailReason (a row with two "
               "reasons counts once for each)"),
    MetricSpec("kvcanary_violation_rows_total", "counter", ("engine", "group"),
               "Violation rows the kv-canary read from its rings, per KV group"),
    MetricSpec("kvcanary_status_flags_total", "counter", ("engine", "flag"),
               "Ring reads that reported a CanaryStatus or PlanStatus flag (device values the kernels refused)"),
    MetricSpec("kvcanary_ring_dropped_rows_total", "counter", ("engine",),
               "Violation rows the kernels counted but a full ring could not hold"),
    MetricSpec("kvcanary_health_problems_total", "counter", ("engine",),
               "Failed health checks: canary launches that did not run as the run counters expect"),
    MetricSpec("kvcanary_swept_slots_total", "counter", ("engine",),
               "Prefix-cache slots the periodic sweep verified"),
    MetricSpec("kvcanary_phase_seconds_total", "counter", ("engine", "phase"),
               "Host wall time the kv-canary spent, per phase of its step"),
)


def metric_names() -> set[str]:
    """Every sample name the exporter writes (the ``_total`` series of each counter)."""
    return {m.name for m in METRICS}


_lock = threading.Lock()
_registered: dict[str, Any] | None = None


def _counters() -> dict[str, Any] | None:
    """The process's counters, registered once in prometheus_client's default registry (None without it)."""
    global _registered
    with _lock:
        if _registered is None:
            try:
                from prometheus_client import Counter as PromCounter
            except ImportError:
                _registered = {}
            else:
                _registered = {m.name: PromCounter(m.name.removesuffix("_total"), m.help, list(m.labels))
                               for m in METRICS}
        return _registered or None


class StepMetrics:
    """Feeds one engine canary's findings into the counters of :data:`METRICS` (a no-op without
    prometheus_client). Phase seconds are exported as the growth of the state's cumulative timers."""

    def __init__(self, engine: str) -> None:
        self.engine = engine
        self.counters = _counters()
        self._seconds_seen: dict[str, float] = {}
        self._phase_children: dict[str, Any] = {}  # labelled children looked up once, not every step
        self._steps_child: Any = None

    def report(self, report: StepReport) -> None:
        """What one read of the rings found (violations, status flags, drops, health, sweep)."""
        c = self.counters
        if c is None:
            return
        engine = self.engine
        if report.new_violations:
            rows = Counter(group for group, _ in report.new_violations)
            reasons = Counter((group, name) for group, v in report.new_violations for name in v.reasons)
            for group, n in rows.items():
                c["kvcanary_violation_rows_total"].labels(engine=engine, group=group).inc(n)
            for (group, name), n in reasons.items():
                c["kvcanary_violations_total"].labels(engine=engine, group=group, reason=name).inc(n)
        if report.status_bits or report.plan_status:
            for name in status_flag_names(report):
                c["kvcanary_status_flags_total"].labels(engine=engine, flag=name).inc()
        if report.dropped:
            c["kvcanary_ring_dropped_rows_total"].labels(engine=engine).inc(report.dropped)
        if report.health_problems:
            c["kvcanary_health_problems_total"].labels(engine=engine).inc(len(report.health_problems))
        if report.swept_slots:
            c["kvcanary_swept_slots_total"].labels(engine=engine).inc(report.swept_slots)

    def step(self, seconds: dict[str, float]) -> None:
        """One engine step finished; ``seconds``: the state's cumulative wall time per canary phase."""
        c = self.counters
        if c is None:
            return
        if self._steps_child is None:
            self._steps_child = c["kvcanary_steps_total"].labels(engine=self.engine)
        self._steps_child.inc()
        seen, children = self._seconds_seen, self._phase_children
        for phase, total in seconds.items():
            grown = total - seen.get(phase, 0.0)
            if grown > 0:
                child = children.get(phase)
                if child is None:
                    child = children[phase] = c["kvcanary_phase_seconds_total"].labels(engine=self.engine,
                                                                                        phase=phase)
                child.inc(grown)
                seen[phase] = total
