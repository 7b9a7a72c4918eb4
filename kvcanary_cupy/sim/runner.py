"""The step loop: the synthetic engine with the canary installed through :mod:`kvcanary_cupy.runtime`, exactly
as a serving engine installs it, plus the attribution of every violation read to an injected fault.

Per step (one target forward, plus one draft forward with EAGLE):

1. schedule the batch (admit, chunk prefill, decode, pad), give every new token a slot; inject "batch" faults;
2. ``prepare`` (runtime phase 1): stage the batch and scatter the requests' true token histories into the
   expected-token pool;
3. ``pre_forward`` (phase 2): per target group (FULL, and SWA when present) plan, HEAD verify, HEAD write (with
   the input assert against the engine's token/position oracle);
4. the forward writes real KV for every new token; then ``post_forward`` (phase 3): TAIL verify (re-hashing real
   KV), TAIL write (fingerprinting the new KV);
5. sampling; then, with EAGLE, phases 1-3 again for the draft model (its own group and ring,
   ``kv_token_id_vs_position_offset = +1``, input ids rotated by one);
6. retire finished requests into the prefix cache, slide SWA windows;
7. ``finish_step`` (phase 4): the runtime reads what the previous step's launches found (one step late),
   sweeps every slot the prefix cache holds every ``sweep_interval`` steps, checks its run counters; the rows
   it returns are attributed to injected faults here, anything unexplained is a false positive.

The chain-position assert is switched on after the warm-up steps (``mark_init_finished``). Faults are injected
between the warm-up and the cool-down (the last steps, which leave time to detect what was injected).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from ..backends import prepare_backend
from ..runtime import CanaryConfig, CanaryRuntime, Capacities, KvGroup, KvPools, StepBatch, StepReport
from .config import PRESETS, Preset, SimConfig, applicable_kinds, resolve_backend
from .engine import Engine, size_engine
from .faults import FaultInjector, FaultTracker
from .replay import LaunchRecorder
from .report import build_report
from .requests import Batch
from .tiers import TieredStore
from .workload import make_workload

__all__ = ["PRESETS", "PhaseTimer", "Preset", "SimConfig", "Simulation", "applicable_kinds", "run_simulation"]

CANARY_LOGGER = "kvcanary_cupy.sim.canary"
TIERED_FOLLOWUP = 0.8  # --tiers: the share of requests continuing an earlier conversation
# --tiers: a follow-up continues a conversation at least this many steps old (by then it has finished and left
# the device's small prefix cache for host memory or disk), so load-backs from both tiers happen on every seed
TIERED_FOLLOWUP_AGE = 20
# Every violation row becomes a WARNING record of this logger (the runtime's log mode); the simulation reports
# them itself, so by default they go nowhere (a handler configured by the caller still sees them).
logging.getLogger(CANARY_LOGGER).addHandler(logging.NullHandler())

# ---- timing ------------------------------------------------------------------------------------------------

CANARY_PHASES = ("scatter", "plan", "verify", "write", "sweep", "read")
_RUNTIME_PHASES = {"stage": "scatter"}  # staging the batch is reported with the expected-token scatter


class PhaseTimer:
    """Wall-clock time per phase; with CuPy also CUDA-event device time, resolved once at the end."""

    def __init__(self, cupy: Any | None) -> None:
        self._cupy = cupy
        self.wall: dict[str, float] = defaultdict(float)
        self.calls: Counter[str] = Counter()
        self._events: list[tuple[str, Any, Any]] = []

    @contextlib.contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        phase = _RUNTIME_PHASES.get(phase, phase)
        start = time.perf_counter()
        if self._cupy is not None:
            begin = self._cupy.cuda.Event()
            begin.record()
        try:
            yield
        finally:
            if self._cupy is not None:
                end = self._cupy.cuda.Event()
                end.record()
                self._events.append((phase, begin, end))
            self.wall[phase] += time.perf_counter() - start
            self.calls[phase] += 1

    def device_seconds(self) -> dict[str, float] | None:
        if self._cupy is None:
            return None
        out: dict[str, float] = defaultdict(float)
        for phase, begin, end in self._events:
            end.synchronize()
            out[phase] += self._cupy.cuda.get_elapsed_time(begin, end) / 1000.0
        return dict(out)


# ---- the simulation ----------------------------------------------------------------------------------------

ProgressCallback = Callable[[int, dict[str, int]], None]


class Simulation:
    """One run: build the engine, install the canary runtime, step, attribute, and produce the report."""

    def __init__(self, cfg: SimConfig) -> None:
        cfg.validate()
        self.cfg = cfg
        self.preset = PRESETS[cfg.preset]
        self.backend, self.xp, self.device = resolve_backend(cfg.backend)
        shape = self.preset.shape
        if cfg.tiers:  # KV hierarchies exist for multi-turn reuse: conversations come back after being evicted
            shape = dataclasses.replace(shape, p_followup=max(shape.p_followup, TIERED_FOLLOWUP),
                                        followup_age=TIERED_FOLLOWUP_AGE)
        self.workload = make_workload(shape, cfg.requests, cfg.steps, np.random.default_rng([cfg.seed, 0]))
        self.engine_cfg = size_engine(self.workload, max_running=self.preset.max_running,
                                      chunk_size=self.preset.chunk_size, page_size=self.preset.page_size,
                                      swa_window=self.preset.swa_window, eagle=self.preset.eagle, with_v=cfg.with_v,
                                      layout=cfg.layout, block_size=cfg.blocks[0], block_stride=cfg.blocks[1])
        self.engine = Engine(self.engine_cfg, self.workload, self.xp)
        self.tracker = FaultTracker(self.engine)
        self.engine.on_assign = self.tracker.on_assign
        self.engine.on_splice = self.tracker.on_splice
        kv_groups = ["FULL"] + (["SWA"] if self.engine.swa else []) + (["DRAFT"] if self.preset.eagle else [])
        self.injector = FaultInjector(cfg.inject, self.engine, self.tracker, np.random.default_rng([cfg.seed, 1]),
                                      start=cfg.warmup_steps, stop=cfg.steps - cfg.cooldown,
                                      partial_hash=cfg.real_kv_hash == "partial", kv_groups=kv_groups)
        self.timer = PhaseTimer(self.xp if self.backend == "cuda" else None)
        self.recorder = None
        if cfg.dump_dir:
            self.recorder = LaunchRecorder(cfg.dump_dir, preset=cfg.preset, seed=cfg.seed, backend=self.backend)
        self.runtime = self._install_canary()
        self.tiers: TieredStore | None = None
        if cfg.tiers:
            self.tiers = TieredStore(cfg.tiers, self.engine, self.runtime, self.tracker, self.injector,
                                     np.random.default_rng([cfg.seed, 2]), tier_dir=cfg.tier_dir)
        if self.recorder is not None:
            self.recorder.attach(req_to_token=self.engine.req_to_token, layout=self.engine.slot_layout(),
                                 expected_pool=self.runtime.expected_token_pool,
                                 check_tokens=self.runtime.config.verify_token_assert)
        self._clear_findings(cfg.steps)

    def _clear_findings(self, max_steps: int) -> None:
        """What a run has found so far: nothing yet (timelines of ``max_steps + 1`` read steps)."""
        self.timeline = {k: [0] * (max_steps + 1) for k in ("violations", "explained", "false_positives",
                                                            "injected", "detected")}
        self.false_positives: list[dict[str, Any]] = []
        self.by_tag: Counter[str] = Counter()
        self.by_reason: Counter[str] = Counter()
        self._kinds_detected: set[str] = set()
        self.status_bits = 0
        self.dropped = 0
        self.health_problems: list[str] = []
        self.steps_run = 0
        self.wall = 0.0

    def _install_canary(self) -> CanaryRuntime:
        """The engine's pools, as any engine describes them to the runtime."""
        cfg, eng, ecfg = self.cfg, self.engine, self.engine_cfg
        groups = [KvGroup.full("FULL", ecfg.num_slots, eng.kv["FULL"].sources("K"), self._v(eng.kv["FULL"]))]
        if eng.swa:
            groups.append(KvGroup.swa("SWA", ecfg.swa_slots, window=ecfg.swa_window, lut=eng.lut,
                                      k_sources=eng.kv["SWA"].sources("K"), v_sources=self._v(eng.kv["SWA"])))
        if ecfg.eagle:
            groups.append(KvGroup.draft("DRAFT", ecfg.num_slots, eng.kv["DRAFT"].sources("K"),
                                        self._v(eng.kv["DRAFT"])))
        config = CanaryConfig(mode=cfg.canary_mode, ring_capacity=cfg.ring_capacity,
                              sweep_interval=cfg.sweep_interval, real_kv_hash_mode=cfg.real_kv_hash,
                              write_input_assert=True, verify_token_assert=True, backend=self.backend,
                              logger=CANARY_LOGGER, max_verify_entries_per_step=cfg.max_verify_entries)
        capacities = Capacities(
            max_batch_size=ecfg.max_batch_rows,
            max_tokens=ecfg.chunk_size + ecfg.max_padded_batch,  # a prefill budget plus one token per decode row
            verify_capacity=3 * ecfg.num_slots,  # radix sharing can make the sum of prefixes exceed the pool
            max_sweep_slots=ecfg.num_slots, pool_rows=self.engine.pool_host.shape[0],
            max_context_len=ecfg.max_seq_len)
        layout = eng.slot_layout()
        pools = (KvPools(tuple(groups), req_to_token=eng.req_to_token) if layout is None
                 else KvPools(tuple(groups), layout=layout))
        return CanaryRuntime.create(config, pools, capacities,
                                    device=self.device, sweep_source=eng.tree.walk,
                                    observer=None if self.recorder is None else self.recorder.observe,
                                    timer=self.timer)

    def _v(self, store: Any) -> Any:
        return store.sources("V") if self.cfg.with_v else None

    # -- batches as the runtime takes them -----------------------------------------------------------------

    def _target_batch(self, batch: Batch) -> StepBatch:
        with self.timer("engine"):
            self.engine.fill_layout(batch)  # after the step's "batch" faults, right before the plan reads it
        with self.timer("scatter"):
            flat, offsets, rows = self.engine.expected_token_inputs(batch)
        return StepBatch(
            req_pool_indices=None if self.engine.row_less else batch.req_pool_indices, prefix_lens=batch.prefix_lens,
            extend_seq_lens=batch.extend_seq_lens, input_ids=batch.input_ids, positions=batch.positions,
            out_cache_loc=batch.out_cache_loc, expected_input_ids=batch.expected_tokens,
            expected_positions=batch.expected_positions, valid_lens=batch.valid_lens, history_ids=flat,
            history_offsets=offsets, history_req_pool_indices=rows)

    def _draft_batch(self, batch: Batch) -> StepBatch:
        # the input rotation: the draft's slot at position p takes token p + 1 (it is also the oracle)
        with self.timer("engine"):
            self.engine.fill_layout(batch)
        return StepBatch(
            req_pool_indices=None if self.engine.row_less else batch.req_pool_indices, prefix_lens=batch.prefix_lens,
            extend_seq_lens=batch.extend_seq_lens, input_ids=batch.draft_input_ids,
            positions=batch.expected_positions, out_cache_loc=batch.out_cache_loc,
            expected_input_ids=batch.draft_input_ids, expected_positions=batch.expected_positions,
            valid_lens=batch.valid_lens)

    # -- violations ----------------------------------------------------------------------------------------

    def _attribute(self, report: StepReport, read_step: int) -> None:
        """Attribute every row the runtime read (launched at ``report.launch_step``) to injected faults."""
        launch_step = report.launch_step
        self.status_bits |= report.status_bits
        self.dropped += report.dropped
        self.health_problems += report.health_problems
        first_hits = []
        for group, v in report.new_violations:
            self.timeline["violations"][read_step] += 1
            self.by_tag[f"{v.launch_tag}" + ("/draft" if group == "DRAFT" else "")] += 1
            for name in v.reasons:
                self.by_reason[name] += 1
            faults = self.tracker.explain(group, v.slot, v.reason_bits, launch_step)
            if not faults:
                self.timeline["false_positives"][read_step] += 1
                if len(self.false_positives) < 200:
                    self.false_positives.append({
                        "read_step": read_step, "launch_step": launch_step, "group": group,
                        "launch_tag": v.launch_tag, "slot": v.slot, "position": v.position,
                        "stored_token": v.stored_token, "expected_token": v.expected_token,
                        "reasons": list(v.reasons)})
                continue
            self.timeline["explained"][read_step] += 1
            for fault, bits in faults:
                if self.tracker.record(fault, read_step, launch_step, v.launch_tag, bits):
                    self.timeline["detected"][read_step] += 1
                    if fault.kind not in self._kinds_detected:
                        self._kinds_detected.add(fault.kind)
                        first_hits.append((fault.kind, group, v, report.reports[group].rows))
        if self.recorder is not None:
            for kind, group, violation, rows in first_hits:
                model = self.runtime.groups[group].model
                self.recorder.dump(kind, launch_step, model, group, violation, rows)

    # -- the loop ------------------------------------------------------------------------------------------

    def _step(self, t: int) -> None:
        eng, inj, timer, rt = self.engine, self.injector, self.timer, self.runtime
        if self.recorder is not None:
            self.recorder.begin_step(t)
        if t == self.cfg.warmup_steps:
            rt.mark_init_finished()  # warm-up positions are over
        before = len(self.tracker.faults)
        if self.tiers is not None:
            self.tiers.complete(t)  # load-backs due now: restored and verified before this step's forward
        with timer("engine"):
            batch = eng.schedule(t)
        inj.begin_step(t)
        inj.run("batch", t, batch)
        targets = ["FULL"] + (["SWA"] if eng.swa else [])
        if batch.reqs:
            rt.prepare(self._target_batch(batch))
            rt.pre_forward()
            redirect: dict[str, tuple[int, int]] = {}
            for group in targets:
                redirect.update(inj.run("forward", t, batch, group) or {})
            with timer("engine"):
                eng.forward(batch, redirect)
            for group in targets:
                inj.run("after_forward", t, batch, group)
            rt.post_forward()
            with timer("engine"):
                eng.sample(batch)
            if self.engine_cfg.eagle:
                rt.prepare(self._draft_batch(batch), model="draft")
                rt.pre_forward(model="draft")
                redirect = inj.run("forward", t, batch, "DRAFT") or {}
                with timer("engine"):
                    eng.forward_draft(batch, redirect)
                inj.run("after_forward", t, batch, "DRAFT")
                rt.post_forward(model="draft")
        with timer("engine"):
            eng.finish_step(batch)
        inj.run("after_step", t, batch)
        self.timeline["injected"][t] += len(self.tracker.faults) - before
        self._attribute(rt.finish_step(), read_step=t)

    def run(self, progress: ProgressCallback | None = None) -> dict[str, Any]:
        self.compile_s = prepare_backend(self.backend)  # before the clock starts: per-step costs exclude it
        start = time.perf_counter()
        try:
            for t in range(self.cfg.steps):
                self._step(t)
                self.steps_run = t + 1
                if progress is not None:
                    progress(t + 1, self.live_counts())
            self._attribute(self.runtime.flush(), read_step=self.cfg.steps)
        finally:
            if self.tiers is not None:
                self.tiers.close()  # the L3 files go, whatever happened
        self.wall = time.perf_counter() - start
        return self.report()

    def live_counts(self) -> dict[str, int]:
        faults = self.tracker.faults
        return {"injected": len(faults), "detected": sum(f.detected for f in faults),
                "false_positives": sum(self.timeline["false_positives"]),
                "violations": sum(self.timeline["violations"]), "running": len(self.engine.running)}

    @property
    def sweeps(self) -> int:
        return int(self.runtime.stats()["sweeps"])

    def canary_counters(self) -> dict[str, int]:
        """Entries verified and written and kernels launched, from the runtime's run counters."""
        totals = {"verify_entries": 0, "write_entries": 0, "launches": 0}
        for (_, _, op), (slots, kernels) in self.runtime.run_counters().items():
            totals[f"{op}_entries"] += slots
            totals["launches"] += kernels
        return totals

    # -- the report ----------------------------------------------------------------------------------------

    def report(self) -> dict[str, Any]:
        return build_report(self)


def run_simulation(cfg: SimConfig, progress: ProgressCallback | None = None) -> dict[str, Any]:
    """Run one simulation and return its report (see :data:`kvcanary_cupy.sim.report.SCHEMA`)."""
    return Simulation(cfg).run(progress)
