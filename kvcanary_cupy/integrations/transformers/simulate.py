"""``kvcanary simulate --engine transformers``: the canary inside Hugging Face transformers' continuous batching,
clean runs and runs with faults injected into the real KV cache, reported like the synthetic engine's runs.

For every workload (see :mod:`.workloads`): one ``generate_batch`` without the canary (the reference tokens),
one with it (the tokens must be identical and no violation may be read: any is a false positive), then one run
per requested fault kind with that single fault armed at ``inject_at`` (it fires at the first step from there
that has a target). In a fault run, violations from launches before the fault took effect are false positives;
those from its step on are attributed to it. The first one read is its detection (the canary reads its ring one
step after the launch, as an engine must), and its latency is counted from the step the fault took effect.
Steps are numbered globally across runs for the timeline. Exit status as for the synthetic engine: 0 when every
run is token-exact without faults, every requested kind was injected and detected in every run that injected it,
and nothing else was flagged; 1 when anything failed; 4 (inconclusive) when nothing failed but a requested kind
found no target in any workload.
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

from ..common.records import WorkloadRuns, parse_inject, run_with_canary, run_workloads
from .canary import CanaryOptions
from .faults import FAULT_KINDS, Injector, make_injector
from .hooks import TransformersCanary, install
from .report import build_report
from .results import RunResult, SimulationRecord, TransformersSimConfig, WorkloadStats
from .workloads import Workload, build_model, workloads

__all__ = ["RunResult", "TransformersSimConfig", "TransformersSimulation", "WorkloadStats", "config_from_args",
           "run_quietly"]


@dataclass
class TransformersSimulation(SimulationRecord):
    """Runs the configured workloads (reference, clean, one per fault kind) and records them."""

    def _run(self, model: Any, w: Workload, kind: str | None, offset: int, injector: Injector | None) -> RunResult:
        opts = CanaryOptions(mode="log", real_kv_hash=self.cfg.real_kv_hash, with_v=self.cfg.with_v,
                             backend=self.cfg.backend, sweep_interval=self.cfg.sweep_interval,
                             ring_capacity=self.cfg.ring_capacity,
                             max_verify_entries_per_step=self.cfg.max_verify_entries)
        canary: TransformersCanary = install(model, opts)
        stats = WorkloadStats()
        out, wall = run_with_canary(canary, [stats] if injector is None else [stats, injector], lambda: w.run(model),
                                    None if injector is None else injector.close)
        seconds: Counter[str] = Counter()
        counters: Counter[str] = Counter()
        status = dropped = 0
        health: list[tuple[int, str]] = []
        for st in canary.states.values():
            health += st.health_problems
            seconds.update(st.seconds)
            counters.update(st.counters())
            status |= st.status_bits
            dropped += st.dropped
        return RunResult(workload=w.name, kind=kind, steps=canary.steps, step_offset=offset,
                         violations=canary.violations, fault=None if injector is None else injector.fault,
                         stats=stats, seconds=dict(seconds), wall=wall, counters=dict(counters), status_bits=status,
                         dropped=dropped, health_problems=health,
                         tokens={rid: list(r.generated_tokens) for rid, r in out.items()},
                         errors={rid: str(r.error) for rid, r in out.items() if r.error is not None})

    def run(self, progress: Any = None) -> dict[str, Any]:
        self.cfg.validate()
        start = time.perf_counter()
        chosen = workloads(seed=self.cfg.seed)
        names = list(self.cfg.workloads) or list(chosen)
        models: dict[str, Any] = {}

        def workload(name: str) -> WorkloadRuns[RunResult]:
            w = chosen[name]
            if w.arch not in models:
                models[w.arch] = build_model(w.arch, self.cfg.model_size, self.cfg.seed)
            model = models[w.arch]
            self.model_params = max(self.model_params, sum(p.numel() for p in model.parameters()))

            def run(kind: str | None, offset: int, i: int) -> RunResult:
                injector = None if kind is None else make_injector(
                    kind, self.cfg.inject_at, seed=self.cfg.seed * 100 + i, vocab_size=int(model.config.vocab_size))
                return self._run(model, w, kind, offset, injector)

            return WorkloadRuns(
                reference=lambda: w.run(model), run=run,
                token_exact=lambda clean, reference: clean.tokens == {
                    rid: list(r.generated_tokens) for rid, r in reference.items()} and not clean.errors)

        run_workloads(self, names, workload, progress)
        self.wall = time.perf_counter() - start
        return build_report(self)


def config_from_args(args: Any) -> TransformersSimConfig:
    """The run's configuration from ``kvcanary simulate --engine transformers`` arguments (ValueError if bad)."""
    cfg = TransformersSimConfig(model_size=args.model_size, inject=parse_inject(args.inject, FAULT_KINDS),
                                seed=args.seed, backend=args.backend, real_kv_hash=args.real_kv_hash, with_v=True,
                                sweep_interval=args.sweep_interval, ring_capacity=args.ring_capacity,
                                max_verify_entries=args.max_verify_entries)
    cfg.validate()
    return cfg


def run_quietly(cfg: TransformersSimConfig, *, progress: bool = True) -> dict[str, Any]:
    """Run and return the report; one progress line per ``generate_batch`` on standard error when asked."""
    import logging

    import transformers

    def show(done: int, total: int, what: str) -> None:
        if progress:
            print(f"run {done}/{total}: {what}", file=sys.stderr, flush=True)

    # The report carries every violation; one log record per row would bury the table (the engine's own
    # CPU-sizing notices too).
    canary_logger = logging.getLogger("kvcanary_cupy.transformers")
    level, tf_level = canary_logger.level, transformers.logging.get_verbosity()
    canary_logger.setLevel(logging.ERROR)
    transformers.logging.set_verbosity_error()
    try:
        return TransformersSimulation(cfg).run(show)
    finally:
        canary_logger.setLevel(level)
        transformers.logging.set_verbosity(tf_level)
