"""``kvcanary simulate --engine vllm``: the canary inside vLLM's V1 engine (CPU build, in-process), clean runs
and runs with faults injected into vLLM's real structures, reported like the other engines' runs.

One engine (vLLM keeps process-wide state) over a random-weight model saved to a temporary folder, of the model
kind, dtype, speculative decoding and tensor-parallel size asked for (``--model-arch``, ``--dtype``,
``--speculative``, ``--tensor-parallel``). What the canary does not check in that engine (a group kind it skips, a
feature that disables it) is decided at install and named in the report. For every
workload (:mod:`.workloads`): one ``LLM.generate`` without the canary (the reference completions), one with it
(the completions must be identical and no violation may be read), then one run per requested fault kind with that
single fault armed at ``inject_at`` (it fires at the first step from there that has a target). The prefix cache
is reset before every run, so every run starts from the same engine state. Attribution, detection latency and exit
statuses as for the transformers engine (0 passed, 1 failed, 4 inconclusive).

With ``--tensor-parallel 2`` the workers are processes of their own: a canary is installed in each worker through
``LLM.collective_rpc`` (:mod:`.distributed`), each fault is armed on one rank only (the ranks take turns), and each
rank's findings come back with its rank: the faulted rank's are attributed to the fault, any other rank's are
false positives.
"""

from __future__ import annotations

import sys
import tempfile
import time
from dataclasses import dataclass, field
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
from .distributed import worker_rank
from .faults import Injector, fault_kinds, injector
from .hooks import VllmCanary, install
from .report import build_report
from .workloads import (
    DRAFT_NOISE,
    DTYPES,
    MODEL_ARCHS,
    MODEL_SIZES,
    SPECULATIVE,
    SPECULATIVE_SAMPLING_BUG,
    SPECULATIVE_UNSUPPORTED,
    TENSOR_PARALLEL,
    Workload,
    arch_dtype,
    num_params,
    save_arch,
    save_draft,
    save_llama,
    sim_engine_args,
    workloads,
)

ARCHS = ("llama", *MODEL_ARCHS)


@dataclass(frozen=True)
class VllmSimConfig(EngineSimConfig):
    model_size: str = "small"
    inject_at: int = 1
    model_arch: str = "llama"
    dtype: str | None = None  # a DTYPES key; None: the model kind's own (fp32, or the one it runs in)
    speculative: str | None = None  # a SPECULATIVE method, None: off
    tensor_parallel: int = 1

    def validate(self) -> None:
        from ..._errors import fail
        from ._version import check_version

        check_version()
        if self.model_size not in MODEL_SIZES:
            fail(f"--model-size must be one of {', '.join(MODEL_SIZES)} for --engine vllm, got {self.model_size!r}")
        if self.model_arch not in ARCHS:
            fail(f"--model-arch must be one of {', '.join(ARCHS)}, got {self.model_arch!r}")
        if self.model_arch != "llama" and self.model_size != "small":
            fail(f"--model-size {self.model_size} applies to --model-arch llama only (the other model kinds have "
                 "one tiny size)")
        if self.dtype is not None and self.dtype not in DTYPES:
            fail(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        own = arch_dtype(self.model_arch)
        if self.dtype is not None and own is not None and self.dtype != own:
            fail(f"--dtype {self.dtype} does not run --model-arch {self.model_arch}: vLLM's CPU build runs that "
                 f"model kind in {own} only")
        if self.speculative is not None and self.speculative not in SPECULATIVE:
            fail(f"--speculative must be one of {', '.join(SPECULATIVE)}, got {self.speculative!r}")
        unsupported = SPECULATIVE_UNSUPPORTED.get((self.model_arch, self.speculative or ""))
        if unsupported is not None:
            fail(f"--speculative {self.speculative} does not run --model-arch {self.model_arch} on vLLM's CPU "
                 f"build: {unsupported}")
        if self.tensor_parallel not in TENSOR_PARALLEL:
            fail(f"--tensor-parallel must be one of {', '.join(map(str, TENSOR_PARALLEL))}, got "
                 f"{self.tensor_parallel!r}")
        if self.tensor_parallel > 1:
            import os

            from .distributed import THREADS_BIND_ENV, thread_binding

            if not os.environ.get(THREADS_BIND_ENV):
                thread_binding(self.tensor_parallel)  # refused here when this process has too few CPUs
        if self.speculative is not None and "parallel-sampling" in self.workloads:
            fail(f"workload parallel-sampling does not run with --speculative: {SPECULATIVE_SAMPLING_BUG}")
        self.check_choices("vllm", fault_kinds=fault_kinds(self.model_arch, self.speculative),
                           workloads=workloads(speculative=self.speculative is not None))


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
    fault_rank: int | None = None  # the tensor-parallel rank the fault was armed on (None: a clean run)
    rank_violations: dict[int, int] = field(default_factory=dict)  # violations each rank read
    # violations no fault can explain: in a fault run, those of the ranks the fault was not armed on
    unexplained: list[Any] = field(default_factory=list)


@dataclass
class VllmSimulation(EngineSimulation[VllmSimConfig, RunResult]):
    """Runs the configured workloads (reference, clean, one per fault kind) in one engine and records them."""

    unchecked: list[str] = field(default_factory=list)  # the install's lines on what goes unchecked
    # the install's lines on what is checked but deliberately not fingerprinted (a draft model's K/V bytes)
    notes: list[str] = field(default_factory=list)
    disabled: str | None = None  # why the canary checks nothing in this engine (None: it checks)
    thread_binding: str | None = None  # VLLM_CPU_OMP_THREADS_BIND of a tensor-parallel run

    def _options(self) -> CanaryOptions:
        return CanaryOptions(mode="log", real_kv_hash=self.cfg.real_kv_hash, with_v=self.cfg.with_v,
                             backend=self.cfg.backend, sweep_interval=self.cfg.sweep_interval,
                             ring_capacity=self.cfg.ring_capacity)

    def _note_install(self, disabled: str | None, unchecked: list[str], notes: list[str]) -> None:
        if not self.unchecked and unchecked:
            self.unchecked = list(unchecked)
        if not self.notes and notes:
            self.notes = list(notes)
        self.disabled = disabled

    def _run(self, llm: Any, w: Workload, kind: str | None, offset: int, fault: Any) -> RunResult:
        opts = self._options()
        canary = install(llm, opts)
        self._note_install(canary.disabled, canary.support.unchecked(opts.real_kv_hash),
                           canary.support.notes(opts.real_kv_hash))
        stats = WorkloadStats()
        tokens, wall = run_with_canary(canary, [stats] if fault is None else [stats, fault], lambda: w.run(llm))
        st = canary.state
        return RunResult(workload=w.name, kind=kind, steps=canary.steps, step_offset=offset,
                         violations=canary.violations, fault=None if fault is None else fault.fault, stats=stats,
                         seconds=dict(st.seconds) if st else {}, wall=wall, counters=st.counters() if st else {},
                         status_bits=st.status_bits if st else 0, dropped=st.dropped if st else 0,
                         health_problems=list(st.health_problems) if st else [], tokens=tokens,
                         preemptions=canary.preemptions, rank_violations={0: len(canary.violations)})

    def _run_ranks(self, llm: Any, w: Workload, kind: str | None, offset: int, seed: int,
                   fault_rank: int) -> RunResult:
        """One run of a tensor-parallel engine: a canary in every worker, the fault (if any) on ``fault_rank``."""
        opts = self._options()
        installed = llm.collective_rpc(rpc_install, args=(opts, kind, self.cfg.inject_at, seed, fault_rank))
        self._note_install(*installed[0][1:])
        # as install() does in-process: blocks cached before the canary carry no records (a hit would read as
        # corruption), so the prefix cache starts empty
        if llm.reset_prefix_cache() is False:
            llm.collective_rpc(rpc_collect)
            from ..._errors import fail

            fail("vLLM refused to reset its prefix cache (requests still running)")
        start = time.perf_counter()
        try:
            tokens = w.run(llm)
            wall = time.perf_counter() - start
        finally:
            ranks = sorted(llm.collective_rpc(rpc_collect), key=lambda r: r["rank"])
        mine = next((r for r in ranks if r["rank"] == fault_rank), ranks[0]) if kind is not None else None
        violations = [v for r in ranks for v in r["violations"]] if mine is None else list(mine["violations"])
        others = [] if mine is None else [v for r in ranks if r is not mine for v in r["violations"]]
        lead = mine or ranks[0]
        seconds: dict[str, float] = {}
        counters: dict[str, int] = {}
        for r in ranks:  # the canary's cost summed over the ranks: each rank's canary runs on its own cores
            for phase, value in r["seconds"].items():
                seconds[phase] = seconds.get(phase, 0.0) + value
            for name, value in r["counters"].items():
                counters[name] = counters.get(name, 0) + value
        return RunResult(workload=w.name, kind=kind, steps=max(r["steps"] for r in ranks), step_offset=offset,
                         violations=violations, fault=lead["fault"] if kind is not None else None,
                         stats=lead["stats"], seconds=seconds, wall=wall, counters=counters,
                         status_bits=_bits_or(r["status_bits"] for r in ranks),
                         dropped=sum(r["dropped"] for r in ranks),
                         health_problems=[p for r in ranks for p in r["health_problems"]], tokens=tokens,
                         preemptions=lead["preemptions"], fault_rank=None if kind is None else fault_rank,
                         rank_violations={r["rank"]: len(r["violations"]) for r in ranks}, unexplained=others)

    def run(self, progress: Any = None) -> dict[str, Any]:
        self.cfg.validate()
        cfg = self.cfg
        start = time.perf_counter()
        chosen = workloads(vocab=MODEL_SIZES[cfg.model_size]["vocab_size"], seed=cfg.seed,
                       speculative=cfg.speculative is not None)
        names = list(cfg.workloads) or list(chosen)
        folder = Path(tempfile.gettempdir()) / f"kvcanary-vllm-{cfg.model_arch}-{cfg.model_size}-seed{cfg.seed}"
        model_dir = save_arch(folder, cfg.model_arch, seed=cfg.seed) if cfg.model_arch != "llama" else \
            save_llama(folder, cfg.model_size, seed=cfg.seed)
        draft_dir = None if cfg.speculative != "draft" else \
            save_draft(model_dir, folder.with_name(f"{folder.name}-draft{DRAFT_NOISE}"), seed=cfg.seed)
        from vllm import LLM

        llm = LLM(model=str(model_dir), **sim_engine_args(model_dir, cfg.model_arch, cfg.model_size, cfg.dtype,
                                                           cfg.speculative, cfg.tensor_parallel,
                                                           draft_dir=draft_dir))
        self.model_params = num_params(cfg.model_size) if cfg.model_arch == "llama" else _params_of(llm)
        tp = cfg.tensor_parallel

        def workload(name: str) -> WorkloadRuns[RunResult]:
            w = chosen[name]
            at = names.index(name)
            # every workload starts from the same engine state: an empty prefix cache, and KV caches without the
            # bytes the previous workload's faults left (rpc_zero_kv says why they would change its tokens)
            llm.reset_prefix_cache()
            llm.collective_rpc(rpc_zero_kv)

            def run(kind: str | None, offset: int, i: int) -> RunResult:
                seed = cfg.seed * 100 + i
                if tp > 1:
                    rank = tp - 1 if kind == "rank-kv-bitflip" else (i + at) % tp
                    return self._run_ranks(llm, w, kind, offset, seed, rank)
                return self._run(llm, w, kind, offset, None if kind is None else injector(kind, cfg.inject_at,
                                                                                          seed=seed))

            return WorkloadRuns(reference=lambda: w.run(llm), run=run,
                                token_exact=lambda clean, reference: clean.tokens == reference)

        run_workloads(self, names, workload, progress)
        self.wall = time.perf_counter() - start
        return build_report(self)


def _bits_or(values: Any) -> int:
    out = 0
    for v in values:
        out |= int(v)
    return out


def _params_of(llm: Any) -> int:
    """The model's parameter count, read from the model's config (hidden size, layers, vocabulary: an estimate for
    the report's headline, for the model kinds whose structure differs from Llama's)."""
    config = llm.llm_engine.model_config.hf_config
    text = getattr(config, "text_config", config)
    h, layers, v = int(text.hidden_size), int(text.num_hidden_layers), int(text.vocab_size)
    return layers * 12 * h * h + 2 * v * h


def config_from_args(args: Any) -> VllmSimConfig:
    """The run's configuration from ``kvcanary simulate --engine vllm`` arguments (ValueError if bad)."""
    kinds = fault_kinds(args.model_arch, args.speculative)
    cfg = VllmSimConfig(model_size=args.model_size, inject=parse_inject(args.inject, kinds), seed=args.seed,
                        backend=args.backend, real_kv_hash=args.real_kv_hash, sweep_interval=args.sweep_interval,
                        ring_capacity=args.ring_capacity, model_arch=args.model_arch, dtype=args.dtype,
                        speculative=args.speculative, tensor_parallel=args.tensor_parallel)
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
    binding = None
    if cfg.tensor_parallel > 1:
        # vLLM's CPU build binds each worker to a NUMA node unless told each rank's cores (its CPU docs): split
        # the CPUs this process may use between the workers, unless the operator already did
        from .distributed import THREADS_BIND_ENV, thread_binding

        binding = os.environ.setdefault(THREADS_BIND_ENV, thread_binding(cfg.tensor_parallel))

    def show(done: int, total: int, what: str) -> None:
        if progress:
            print(f"run {done}/{total}: {what}", file=sys.stderr, flush=True)

    canary_logger = logging.getLogger("kvcanary_cupy.vllm")
    level = canary_logger.level
    canary_logger.setLevel(logging.ERROR)
    try:
        sim = VllmSimulation(cfg)
        sim.thread_binding = binding
        return sim.run(show)
    finally:
        canary_logger.setLevel(level)


# -- the worker side of a tensor-parallel simulation (each function runs in every worker, via collective_rpc) -----


def rpc_install(worker: Any, options: Any, kind: str | None, inject_at: int, seed: int,
                fault_rank: int) -> tuple[int, str | None, list[str], list[str]]:
    """Install a canary (``options``, a ``CanaryOptions``) in ``worker``'s model runner, with the run's statistics
    observer and, on ``fault_rank`` only, an injector of ``kind``. Returns the worker's rank, why the canary is
    disabled there (None: it checks), its install-time lines on what goes unchecked and its notes."""
    import logging

    # the simulation's report carries every finding (as the in-process run's does): the worker's per-step
    # lines are held back
    logging.getLogger(options.logger).setLevel(logging.ERROR)
    runner = worker.model_runner
    canary = VllmCanary(runner, options)
    rank, _ = worker_rank(runner)
    canary.observers.append(WorkloadStats())
    if kind is not None and rank == fault_rank:
        canary.observers.append(injector(kind, inject_at, seed=seed, rank=fault_rank))
    return (rank, canary.disabled, canary.support.unchecked(options.real_kv_hash),
            canary.support.notes(options.real_kv_hash))


def rpc_collect(worker: Any) -> dict[str, Any]:
    """Read what the last step appended, remove the canary from ``worker``'s runner and return what it saw (plain
    data: it travels back to the engine's process)."""
    runner = worker.model_runner
    canary = runner._kvcanary
    try:
        canary.finish()
    finally:
        canary.remove()
    st = canary.state
    stats = next(o for o in canary.observers if isinstance(o, WorkloadStats))
    fault = next((o.fault for o in canary.observers if isinstance(o, Injector)), None)
    rank, world = worker_rank(runner)
    return {"rank": rank, "world": world, "steps": canary.steps, "violations": canary.violations, "fault": fault,
            "stats": stats, "seconds": dict(st.seconds) if st else {}, "counters": st.counters() if st else {},
            "status_bits": st.status_bits if st else 0, "dropped": st.dropped if st else 0,
            "health_problems": list(st.health_problems) if st else [], "preemptions": canary.preemptions}


def rpc_zero_kv(worker: Any) -> int:
    """Zero every KV cache tensor of ``worker``'s model runner (between simulation runs, no request running): a
    fault that wrote raw bytes (a half-size element copy can make NaN patterns) would otherwise leave them in
    blocks a later run's requests get but never write in full, and vLLM's CPU attention reads a block's unwritten
    rows too (masked, but NaN survives the mask), so the later run's tokens would depend on the fault before it.
    Returns the number of tensors zeroed."""
    zeroed = 0
    pending = list(worker.model_runner.kv_caches)
    while pending:
        item = pending.pop()
        if isinstance(item, (list, tuple)):
            pending.extend(item)
        elif hasattr(item, "zero_"):
            item.zero_()
            zeroed += 1
    return zeroed
