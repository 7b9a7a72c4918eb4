"""``kvcanary simulate --engine vllm``: the canary inside vLLM's V1 engine (CPU build, in-process), clean runs
and runs with faults injected into vLLM's real structures, reported like the other engines' runs.

One engine (vLLM keeps process-wide state) over a random-weight model saved to a temporary folder. For every
workload (:mod:`.workloads`): one ``LLM.generate`` without the canary (the reference completions), one with it
(the completions must be identical and no violation may be read), then one run per requested fault kind with that
single fault armed at ``inject_at`` (it fires at the first step from there that has a target). The prefix cache
is reset before every run, so every run starts from the same engine state. Attribution, detection latency and exit
statuses as for the transformers engine (0 passed, 1 failed, 4 inconclusive).
"""

from __future__ import annotations

import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..common.records import (
    EngineSimConfig,
    EngineSimulation,
    RunRecord,
    WorkloadRuns,
    parse_inject,
    run_with_canary,
    run_workloads,
)
from .canary import CanaryOptions
from .faults import FAULT_KINDS, injector
from .hooks import install
from .report import build_report
from .workloads import MODEL_SIZES, Workload, engine, num_params, save_llama, workloads


@dataclass(frozen=True)
class VllmSimConfig(EngineSimConfig):
    model_size: str = "small"
    inject_at: int = 1

    def validate(self) -> None:
        from ..._errors import fail
        from ._version import check_version

        check_version()
        if self.model_size not in MODEL_SIZES:
            fail(f"--model-size must be one of {', '.join(MODEL_SIZES)} for --engine vllm, got {self.model_size!r}")
        self.check_choices("vllm", fault_kinds=FAULT_KINDS, workloads=workloads())


class WorkloadStats:
    """What the engine did in a run, from the canary's forward hook."""

    def __init__(self) -> None:
        self.prefill_tokens = 0
        self.decode_tokens = 0
        self.prefix_tokens_reused = 0
        self.peak_batch = 0
        self._seen: set[str] = set()

    def before_forward(self, canary: Any, step: int, kwargs: dict[str, Any], metadata: dict[str, Any]) -> None:
        return None

    def after_forward(self, canary: Any, step: int, batch: Any) -> None:
        self.peak_batch = max(self.peak_batch, batch.size)
        for i, rid in enumerate(batch.request_ids):
            past, q = int(batch.prefix_lens[i]), int(batch.extend_lens[i])
            if rid not in self._seen:
                self._seen.add(rid)
                self.prefix_tokens_reused += past
            prompt = len(canary.runner.requests[rid].prompt_token_ids)
            in_prompt = max(0, min(past + q, prompt) - past)
            self.prefill_tokens += in_prompt
            self.decode_tokens += q - in_prompt


@dataclass
class RunResult(RunRecord):
    tokens: list[list[int]]  # per prompt, its completions' token ids
    preemptions: int  # requests vLLM preempted during the run


@dataclass
class VllmSimulation(EngineSimulation[VllmSimConfig, RunResult]):
    """Runs the configured workloads (reference, clean, one per fault kind) in one engine and records them."""

    def _run(self, llm: Any, w: Workload, kind: str | None, offset: int, fault: Any) -> RunResult:
        opts = CanaryOptions(mode="log", real_kv_hash=self.cfg.real_kv_hash, with_v=self.cfg.with_v,
                             backend=self.cfg.backend, sweep_interval=self.cfg.sweep_interval,
                             ring_capacity=self.cfg.ring_capacity)
        canary = install(llm, opts)
        stats = WorkloadStats()
        tokens, wall = run_with_canary(canary, [stats] if fault is None else [stats, fault], lambda: w.run(llm))
        st = canary.state
        return RunResult(workload=w.name, kind=kind, steps=canary.steps, step_offset=offset,
                         violations=canary.violations, fault=None if fault is None else fault.fault, stats=stats,
                         seconds=dict(st.seconds) if st else {}, wall=wall, counters=st.counters() if st else {},
                         status_bits=st.status_bits if st else 0, dropped=st.dropped if st else 0,
                         health_problems=list(st.health_problems) if st else [], tokens=tokens,
                         preemptions=canary.preemptions)

    def run(self, progress: Any = None) -> dict[str, Any]:
        self.cfg.validate()
        start = time.perf_counter()
        chosen = workloads(vocab=MODEL_SIZES[self.cfg.model_size]["vocab_size"], seed=self.cfg.seed)
        names = list(self.cfg.workloads) or list(chosen)
        folder = Path(tempfile.gettempdir()) / f"kvcanary-vllm-{self.cfg.model_size}-seed{self.cfg.seed}"
        llm = engine(save_llama(folder, self.cfg.model_size, seed=self.cfg.seed), self.cfg.model_size)
        self.model_params = num_params(self.cfg.model_size)

        def workload(name: str) -> WorkloadRuns[RunResult]:
            w = chosen[name]
            llm.reset_prefix_cache()  # every run starts from the same engine state
            return WorkloadRuns(
                reference=lambda: w.run(llm),
                run=lambda kind, offset, i: self._run(llm, w, kind, offset, None if kind is None else injector(
                    kind, self.cfg.inject_at, seed=self.cfg.seed * 100 + i)),
                token_exact=lambda clean, reference: clean.tokens == reference)

        run_workloads(self, names, workload, progress)
        self.wall = time.perf_counter() - start
        return build_report(self)


def config_from_args(args: Any) -> VllmSimConfig:
    """The run's configuration from ``kvcanary simulate --engine vllm`` arguments (ValueError if bad)."""
    cfg = VllmSimConfig(model_size=args.model_size, inject=parse_inject(args.inject, FAULT_KINDS), seed=args.seed,
                        backend=args.backend, real_kv_hash=args.real_kv_hash, sweep_interval=args.sweep_interval,
                        ring_capacity=args.ring_capacity)
    cfg.validate()
    return cfg


def run_quietly(cfg: VllmSimConfig, *, progress: bool = True) -> dict[str, Any]:
    """Run and return the report; one progress line per run on standard error when asked. vLLM's and the
    canary's own log records are held back (the report carries every violation)."""
    import logging
    import os

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)

    def show(done: int, total: int, what: str) -> None:
        if progress:
            print(f"run {done}/{total}: {what}", file=sys.stderr, flush=True)

    canary_logger = logging.getLogger("kvcanary_cupy.vllm")
    level = canary_logger.level
    canary_logger.setLevel(logging.ERROR)
    try:
        return VllmSimulation(cfg).run(show)
    finally:
        canary_logger.setLevel(level)
