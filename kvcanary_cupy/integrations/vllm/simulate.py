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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .canary import CanaryOptions, StepViolation
from .faults import FAULT_KINDS, injector
from .hooks import install
from .workloads import MODEL_SIZES, Workload, engine, num_params, save_llama, workloads


@dataclass(frozen=True)
class VllmSimConfig:
    model_size: str = "tiny"
    inject: tuple[str, ...] = ()
    seed: int = 0
    backend: str = "auto"
    real_kv_hash: str = "partial"
    with_v: bool = True
    inject_at: int = 1
    sweep_interval: int = 8
    workloads: tuple[str, ...] = ()  # empty: all

    def validate(self) -> None:
        from ..._errors import fail
        from ._version import check_version

        check_version()
        if self.model_size not in MODEL_SIZES:
            fail(f"--model-size must be one of {', '.join(MODEL_SIZES)} for --engine vllm, got {self.model_size!r}")
        for kind in self.inject:
            if kind not in FAULT_KINDS:
                fail(f"unknown fault kind {kind!r} for --engine vllm; choose from {', '.join(FAULT_KINDS)}")
        if self.backend not in ("auto", "numpy", "host"):
            fail(f"--backend {self.backend} is not available with --engine vllm (use auto, numpy or host)")
        for name in self.workloads:
            if name not in workloads():
                fail(f"unknown workload {name!r}; choose from {', '.join(workloads())}")


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
class RunResult:
    workload: str
    kind: str | None
    steps: int
    step_offset: int
    tokens: list[list[int]]
    violations: list[StepViolation]
    fault: Any
    stats: WorkloadStats
    seconds: dict[str, float]
    wall: float
    counters: dict[str, int]
    status_bits: int
    dropped: int
    health_problems: list[tuple[int, str]]
    preemptions: int


@dataclass
class VllmSimulation:
    cfg: VllmSimConfig
    runs: list[RunResult] = field(default_factory=list)
    token_exact: dict[str, bool] = field(default_factory=dict)
    reference_wall: dict[str, float] = field(default_factory=dict)
    model_params: int = 0
    wall: float = 0.0
    total_steps: int = 0

    def _run(self, llm: Any, w: Workload, kind: str | None, offset: int, fault: Any) -> RunResult:
        opts = CanaryOptions(mode="log", real_kv_hash=self.cfg.real_kv_hash, with_v=self.cfg.with_v,
                             backend=self.cfg.backend, sweep_interval=self.cfg.sweep_interval)
        canary = install(llm, opts)
        stats = WorkloadStats()
        canary.observers.append(stats)
        if fault is not None:
            canary.observers.append(fault)
        start = time.perf_counter()
        try:
            tokens = w.run(llm)
            wall = time.perf_counter() - start
            canary.finish()
        finally:
            canary.remove()
        st = canary.state
        return RunResult(w.name, kind, canary.steps, offset, tokens, canary.violations,
                         None if fault is None else fault.fault, stats, dict(st.seconds) if st else {}, wall,
                         st.counters() if st else {}, st.status_bits if st else 0, st.dropped if st else 0,
                         list(st.health_problems) if st else [], canary.preemptions)

    def run(self, progress: Any = None) -> dict[str, Any]:
        self.cfg.validate()
        start = time.perf_counter()
        chosen = workloads(vocab=MODEL_SIZES[self.cfg.model_size]["vocab_size"], seed=self.cfg.seed)
        names = list(self.cfg.workloads) or list(chosen)
        folder = Path(tempfile.gettempdir()) / f"kvcanary-vllm-{self.cfg.model_size}-seed{self.cfg.seed}"
        llm = engine(save_llama(folder, self.cfg.model_size, seed=self.cfg.seed), self.cfg.model_size)
        self.model_params = num_params(self.cfg.model_size)
        offset = 0
        total = len(names) * (2 + len(self.cfg.inject))
        done = 0
        for name in names:
            w = chosen[name]
            llm.reset_prefix_cache()
            t = time.perf_counter()
            reference = w.run(llm)
            self.reference_wall[name] = time.perf_counter() - t
            done += 1
            clean = self._run(llm, w, None, offset, None)
            offset += clean.steps + 1
            self.runs.append(clean)
            self.token_exact[name] = clean.tokens == reference
            done += 1
            if progress is not None:
                progress(done, total, f"{name}: clean run, {len(clean.violations)} violation(s)")
            for i, kind in enumerate(self.cfg.inject):
                result = self._run(llm, w, kind, offset, injector(kind, self.cfg.inject_at,
                                                                   seed=self.cfg.seed * 100 + i))
                offset += result.steps + 1
                self.runs.append(result)
                done += 1
                if progress is not None:
                    progress(done, total, f"{name}: {kind}")
        self.wall = time.perf_counter() - start
        self.total_steps = offset
        from .report import build_report

        return build_report(self)


def config_from_args(args: Any) -> VllmSimConfig:
    """The run's configuration from ``kvcanary simulate --engine vllm`` arguments (ValueError if bad)."""
    inject: list[str] = []
    for item in args.inject:
        for name in item.split(","):
            name = name.split(":", 1)[0].strip()
            if name == "all":
                inject.extend(k for k in FAULT_KINDS if k not in inject)
            elif name and name not in inject:
                inject.append(name)
    size = {"small": "tiny", "medium": "bench"}.get(args.model_size, args.model_size)
    cfg = VllmSimConfig(model_size=size, inject=tuple(inject), seed=args.seed, backend=args.backend,
                        real_kv_hash=args.real_kv_hash, sweep_interval=args.sweep_interval)
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
