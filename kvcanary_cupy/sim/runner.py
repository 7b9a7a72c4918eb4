"""The step loop: the synthetic engine driven the way a serving engine drives the canary (SPEC §7).

Per step (one target forward, plus one draft forward with EAGLE):

1. read the violation rings filled by the previous step (an engine learns about them one step late, from an
   asynchronous copy of the write index) and attribute every row to an injected fault or call it a false
   positive; the ring is then drained;
2. schedule the batch (admit, chunk prefill, decode, pad), give every new token a slot;
3. scatter the requests' true token histories into the expected-token pool;
4. per target group (FULL, and SWA when present): **plan** → **HEAD verify** (prefix) → **HEAD write** (new
   tokens, with the input assert against the engine's token/position oracle);
5. the forward writes real KV for every new token;
6. per target group: **TAIL verify** (same plan; re-hashes real KV) → **TAIL write** (stores the new KV's
   fingerprint);
7. sampling; then, with EAGLE, the same plan → HEAD → forward → TAIL sequence for the draft group (its own
   ring, ``kv_token_id_vs_position_offset = +1``);
8. retire finished requests into the prefix cache, slide SWA windows;
9. every ``sweep_interval`` steps, a verify-only **sweep** over every slot the prefix cache holds.

Endpoints: HEAD (no real-KV sources), TAIL and SWEEP (real-KV sources, hash mode ALL or PARTIAL) × K (and V
with ``with_v``) × FULL/SWA tags. The chain-position assert is switched on after the warm-up steps. Faults are
injected between the warm-up and the cool-down (the last steps, which leave time to detect what was injected).
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..backends import BACKEND_NAMES, available_backends, unavailable_reason
from ..constants import CanaryLaunchTag, RealKvHashMode
from ..context import VerifyOrWriteContext
from ..plan import VerifyPlan, WritePlan, launch_canary_plan_kernels
from ..scatter import launch_scatter_req_token_ids
from ..verify import launch_canary_verify_kernel
from ..violations import read_violations, to_host
from ..write import launch_canary_write_kernel
from .engine import Batch, Engine, KvStore, WorkloadShape, make_workload, size_engine
from .faults import FAULT_KINDS, FaultInjector, FaultTracker

# ---- presets -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Preset:
    name: str
    description: str
    shape: WorkloadShape
    max_running: int
    chunk_size: int
    swa_window: int = 0
    eagle: bool = False
    page_size: int = 16


PRESETS: dict[str, Preset] = {
    "decode": Preset(
        "decode", "short prompts, long generations; decode batches padded to CUDA-graph sizes",
        WorkloadShape(system_len=(16, 48), suffix_len=(4, 32), output_len=(48, 128), p_system=0.6,
                      p_followup=0.25, max_total_len=640),
        max_running=16, chunk_size=256),
    "prefill": Preset(
        "prefill", "long prompts in chunked prefill, short generations",
        WorkloadShape(system_prompts=3, system_len=(64, 192), suffix_len=(96, 384), output_len=(2, 8),
                      p_system=0.7, p_followup=0.1, max_total_len=768),
        max_running=8, chunk_size=128),
    "swa": Preset(
        "swa", "a sliding-window (SWA) group next to the full one: LUT, eviction outside the window",
        WorkloadShape(system_len=(16, 64), suffix_len=(16, 96), output_len=(24, 96), p_followup=0.25,
                      max_total_len=640),
        max_running=16, chunk_size=64, swa_window=32),
    "eagle": Preset(
        "eagle", "an EAGLE draft pool (offset +1) next to the target",
        WorkloadShape(system_len=(16, 64), suffix_len=(8, 96), output_len=(16, 96), p_followup=0.25,
                      max_total_len=640),
        max_running=16, chunk_size=96, eagle=True),
    "mixed": Preset(
        "mixed", "everything at once: chunked prefill and decode in one batch, prefix sharing, SWA and EAGLE",
        WorkloadShape(system_len=(16, 96), suffix_len=(8, 160), output_len=(4, 96), p_system=0.55,
                      p_followup=0.25, max_total_len=640),
        max_running=16, chunk_size=96, swa_window=48, eagle=True),
}


MAX_STEPS = 100_000
MAX_REQUESTS = 100_000
MAX_RING_CAPACITY = 1 << 24
MIN_RATE = 1e-6


@dataclass(frozen=True)
class SimConfig:
    """Everything a run depends on; the report is a deterministic function of it (timings aside)."""

    preset: str = "mixed"
    steps: int = 200
    requests: int = 48
    seed: int = 0
    backend: str = "auto"
    inject: dict[str, float] = field(default_factory=dict)
    sweep_interval: int = 8
    with_v: bool = False
    real_kv_hash: str = "all"
    warmup_steps: int = 4
    cooldown_steps: int | None = None  # default: min(16, steps // 5)
    ring_capacity: int = 16384
    dump_dir: str | None = None

    @property
    def cooldown(self) -> int:
        return min(16, self.steps // 5) if self.cooldown_steps is None else self.cooldown_steps

    def validate(self) -> None:
        """Raise ValueError with a message naming the option for anything that cannot run."""
        if self.preset not in PRESETS:
            raise ValueError(f"--preset {self.preset!r} is unknown; choose from {', '.join(PRESETS)}")
        # Upper limits: far above any useful run, and below what would exhaust memory or run for days.
        if not 1 <= self.steps <= MAX_STEPS:
            raise ValueError(f"--steps must lie in [1, {MAX_STEPS}], got {self.steps}")
        if not 1 <= self.requests <= MAX_REQUESTS:
            raise ValueError(f"--requests must lie in [1, {MAX_REQUESTS}], got {self.requests}")
        for kind, rate in self.inject.items():
            if not MIN_RATE <= rate <= 1:  # NaN fails too
                raise ValueError(f"--inject {kind}:{rate}: the rate must lie in [{MIN_RATE}, 1] (expected "
                                 "injections per step)")
        if self.sweep_interval < 0:
            raise ValueError(f"--sweep-interval must be >= 0 (0 disables the sweep), got {self.sweep_interval}")
        if self.real_kv_hash not in ("all", "partial"):
            raise ValueError(f"--real-kv-hash must be 'all' or 'partial', got {self.real_kv_hash!r}")
        if self.warmup_steps < 0 or self.cooldown < 0:
            raise ValueError("--warmup and --cooldown must be >= 0")
        if not 1 <= self.ring_capacity <= MAX_RING_CAPACITY:
            raise ValueError(f"--ring-capacity must lie in [1, {MAX_RING_CAPACITY}], got {self.ring_capacity}")
        if self.warmup_steps > self.steps or self.cooldown > self.steps:
            raise ValueError(f"--warmup and --cooldown must not exceed --steps {self.steps}")
        if self.backend not in ("auto", *BACKEND_NAMES):
            raise ValueError(f"--backend {self.backend!r} is unknown; choose from auto, {', '.join(BACKEND_NAMES)}")
        preset = PRESETS[self.preset]
        for kind in self.inject:
            if kind not in FAULT_KINDS:
                raise ValueError(f"unknown fault kind {kind!r}; choose from {', '.join(FAULT_KINDS)}")
            if FAULT_KINDS[kind].needs == "swa" and not preset.swa_window:
                swa_presets = [p.name for p in PRESETS.values() if p.swa_window]
                raise ValueError(f"--inject {kind} needs an SWA group; preset {self.preset!r} has none "
                                 f"(use --preset {' or '.join(swa_presets)})")
        if self.inject and self.warmup_steps >= self.steps - self.cooldown:
            raise ValueError(f"no step is left to inject faults: --steps {self.steps} with a warm-up of "
                             f"{self.warmup_steps} and a cool-down of {self.cooldown} steps")


def applicable_kinds(preset: str) -> list[str]:
    """Fault kinds that the preset's engine can host (``--inject all`` means these)."""
    has_swa = bool(PRESETS[preset].swa_window)
    return [k for k, kind in FAULT_KINDS.items() if kind.needs != "swa" or has_swa]


def resolve_backend(name: str) -> tuple[str, Any, str]:
    """(backend name, array module, device) for a ``--backend`` value; ValueError when unavailable."""
    if name == "auto":
        name = "cuda" if unavailable_reason("cuda") is None else "numpy"
    reason = unavailable_reason(name)
    if reason is not None:
        raise ValueError(f"--backend {name} is not available here: {reason} "
                         f"(available: {', '.join(available_backends())})")
    if name == "cuda":
        import cupy

        return name, cupy, "cuda"
    return name, np, "cpu"


# ---- timing ------------------------------------------------------------------------------------------------

CANARY_PHASES = ("scatter", "plan", "verify", "write", "sweep", "read")


class PhaseTimer:
    """Wall-clock time per phase; with CuPy also CUDA-event device time, resolved once at the end."""

    def __init__(self, cupy: Any | None) -> None:
        self._cupy = cupy
        self.wall: dict[str, float] = defaultdict(float)
        self.calls: Counter[str] = Counter()
        self._events: list[tuple[str, Any, Any]] = []

    @contextlib.contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
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


# ---- canary wiring -----------------------------------------------------------------------------------------


@dataclass
class Endpoint:
    role: str  # HEAD, TAIL, SWEEP
    kv: str  # K or V
    tag: CanaryLaunchTag
    verify_ctx: VerifyOrWriteContext
    write_ctx: VerifyOrWriteContext | None


class CanaryGroup:
    """One attention regime's canary (SGLang's CanaryBufferGroup): HEAD and TAIL buffers per K/V, real-KV
    sources, plans, and the ring of the model it belongs to."""

    def __init__(self, name: str, model: str, state: VerifyOrWriteContext, num_slots: int, kv: KvStore, *,
                 window: int, lut: Any, offset: int, with_v: bool, mode: RealKvHashMode, xp: Any, device: str,
                 verify_capacity: int, write_capacity: int) -> None:
        self.name, self.model, self.state = name, model, state
        self.window, self.lut, self.offset = window, lut, offset
        self.xp, self.device = xp, device
        self.verify_capacity = verify_capacity
        regime = "SWA" if name == "SWA" else "FULL"
        self.endpoints: dict[str, list[Endpoint]] = {"HEAD": [], "TAIL": [], "SWEEP": []}

        def counter() -> Any:
            return xp.zeros(1, np.int64)

        for k in ("K", "V") if with_v else ("K",):
            head_buf = xp.zeros((num_slots, 32), np.uint8)
            tail_buf = xp.zeros((num_slots, 32), np.uint8)
            for role, buf in (("HEAD", head_buf), ("TAIL", tail_buf), ("SWEEP", tail_buf)):
                tag = CanaryLaunchTag[f"{role}_{k}_{regime}"]
                sources = () if role == "HEAD" else kv.sources(k)
                hash_mode = RealKvHashMode.NONE if role == "HEAD" else mode
                base = state.for_endpoint(canary_buf=buf, kernel_kind=int(tag), real_kv_sources=sources,
                                          real_kv_hash_mode=hash_mode, slot_run_counter=counter(),
                                          kernel_run_counter=counter())
                writer = None if role == "SWEEP" else base.for_endpoint(slot_run_counter=counter(),
                                                                       kernel_run_counter=counter())
                self.endpoints[role].append(Endpoint(role, k, tag, base, writer))
        self.verify_plan = VerifyPlan.allocate(verify_capacity=verify_capacity, device=device)
        self.write_plan = WritePlan.allocate(write_req_capacity=write_capacity, device=device)
        self._sweep_plan: VerifyPlan | None = None

    def sweep_plan(self, n: int) -> VerifyPlan:
        if self._sweep_plan is None or self._sweep_plan.verify_slot_indices.shape[0] < n:
            self._sweep_plan = VerifyPlan.allocate(verify_capacity=max(1, 2 * n), device=self.device)
        return self._sweep_plan

    def translate(self, slots: Any) -> Any:
        """Full-pool slots in this group's index space (SWA: through the LUT; negatives pass through)."""
        if self.lut is None:
            return slots
        xp = self.xp
        return xp.where(slots < 0, slots, xp.take(self.lut, xp.maximum(slots, 0)))

    def counters(self) -> dict[str, int]:
        verify = sum(int(to_host(ep.verify_ctx.slot_run_counter)[0]) for eps in self.endpoints.values() for ep in eps)
        write = sum(int(to_host(ep.write_ctx.slot_run_counter)[0]) for eps in self.endpoints.values() for ep in eps
                    if ep.write_ctx is not None)
        launches = sum(int(to_host(ep.verify_ctx.kernel_run_counter)[0])
                       + (int(to_host(ep.write_ctx.kernel_run_counter)[0]) if ep.write_ctx is not None else 0)
                       for eps in self.endpoints.values() for ep in eps)
        return {"verify_entries": verify, "write_entries": write, "launches": launches}


# ---- the simulation ----------------------------------------------------------------------------------------

ProgressCallback = Callable[[int, dict[str, int]], None]


class Simulation:
    """One run: build the engine and the canary, step, attribute, and produce the report (a dict)."""

    def __init__(self, cfg: SimConfig) -> None:
        cfg.validate()
        self.cfg = cfg
        self.preset = PRESETS[cfg.preset]
        self.backend, self.xp, self.device = resolve_backend(cfg.backend)
        self.workload = make_workload(self.preset.shape, cfg.requests, cfg.steps,
                                      np.random.default_rng([cfg.seed, 0]))
        self.engine_cfg = size_engine(self.workload, max_running=self.preset.max_running,
                                      chunk_size=self.preset.chunk_size, page_size=self.preset.page_size,
                                      swa_window=self.preset.swa_window, eagle=self.preset.eagle, with_v=cfg.with_v)
        self.engine = Engine(self.engine_cfg, self.workload, self.xp)
        self.tracker = FaultTracker(self.engine)
        self.engine.on_assign = self.tracker.on_assign
        self.engine.on_splice = self.tracker.on_splice
        kv_groups = ["FULL"] + (["SWA"] if self.engine.swa else []) + (["DRAFT"] if self.preset.eagle else [])
        self.injector = FaultInjector(cfg.inject, self.engine, self.tracker, np.random.default_rng([cfg.seed, 1]),
                                      start=cfg.warmup_steps, stop=cfg.steps - cfg.cooldown,
                                      partial_hash=cfg.real_kv_hash == "partial", kv_groups=kv_groups)
        self.timer = PhaseTimer(self.xp if self.backend == "cuda" else None)
        self._build_canary()
        self.recorder = None
        if cfg.dump_dir:
            from .replay import LaunchRecorder

            self.recorder = LaunchRecorder(cfg.dump_dir, preset=cfg.preset, seed=cfg.seed, backend=self.backend)
        steps = cfg.steps + 1
        self.timeline = {k: [0] * steps for k in ("violations", "explained", "false_positives", "injected",
                                                   "detected")}
        self.false_positives: list[dict[str, Any]] = []
        self.by_tag: Counter[str] = Counter()
        self.by_reason: Counter[str] = Counter()
        self._kinds_detected: set[str] = set()
        self.status_bits = 0
        self.dropped = 0
        self.sweeps = 0
        self.steps_run = 0
        self.wall = 0.0

    def _build_canary(self) -> None:
        cfg, eng, xp, dev = self.cfg, self.engine, self.xp, self.device
        ecfg = self.engine_cfg
        mode = RealKvHashMode.PARTIAL if cfg.real_kv_hash == "partial" else RealKvHashMode.ALL
        common = dict(with_v=cfg.with_v, mode=mode, xp=xp, device=dev, write_capacity=max(ecfg.max_reqs,
                                                                                             ecfg.max_padded_batch))
        self.states = {"target": VerifyOrWriteContext.allocate(num_slots=1, ring_capacity=cfg.ring_capacity,
                                                               device=dev)}
        full_cap = 3 * ecfg.num_slots  # radix sharing can make the sum of prefixes exceed the pool
        self.target_groups = [CanaryGroup("FULL", "target", self.states["target"], ecfg.num_slots, eng.kv["FULL"],
                                          window=0, lut=None, offset=0, verify_capacity=full_cap, **common)]
        if eng.swa:
            self.target_groups.append(CanaryGroup(
                "SWA", "target", self.states["target"], ecfg.swa_slots, eng.kv["SWA"], window=ecfg.swa_window,
                lut=eng.lut, offset=0, verify_capacity=full_cap, **common))
        self.draft_group = None
        if ecfg.eagle:
            self.states["draft"] = VerifyOrWriteContext.allocate(num_slots=1, ring_capacity=cfg.ring_capacity,
                                                                 device=dev)
            self.draft_group = CanaryGroup("DRAFT", "draft", self.states["draft"], ecfg.num_slots, eng.kv["DRAFT"],
                                           window=0, lut=None, offset=1, verify_capacity=full_cap, **common)
        self.groups = self.target_groups + ([self.draft_group] if self.draft_group else [])

    # -- launches ------------------------------------------------------------------------------------------

    def _plan(self, group: CanaryGroup, batch: Batch) -> None:
        eng = self.engine
        with self.timer("plan"):
            launch_canary_plan_kernels(
                verify_plan_out=group.verify_plan, write_plan_out=group.write_plan,
                req_pool_indices=batch.req_pool_indices, prefix_lens=batch.prefix_lens,
                extend_seq_lens=batch.extend_seq_lens, req_to_token=eng.req_to_token, swa_window_size=group.window,
                full_to_swa_index_mapping=group.lut, verify_capacity=group.verify_capacity,
                req_to_verify_expected_tokens=eng.expected_pool,
                req_to_verify_expected_tokens_valid_lens=batch.valid_lens,
                kv_token_id_vs_position_offset=group.offset, backend=self.backend)
        if self.recorder is not None:
            self.recorder.plan(batch.step, group, batch, eng)

    def _verify(self, group: CanaryGroup, ep: Endpoint, plan: VerifyPlan, check: bool, step: int) -> None:
        if self.recorder is not None:
            self.recorder.verify(step, group, ep, plan, check)
        with self.timer("sweep" if ep.role == "SWEEP" else "verify"):
            launch_canary_verify_kernel(context=ep.verify_ctx, plan=plan, check_verify_expected_token=check,
                                        backend=self.backend)

    def _write(self, group: CanaryGroup, ep: Endpoint, batch: Batch) -> None:
        if group.name == "DRAFT":  # the input rotation: the draft's slot at position p takes token p + 1
            ids, pos, loc = batch.draft_input_ids, batch.expected_positions, batch.out_cache_loc
            want_ids, want_pos = batch.draft_input_ids, batch.expected_positions
        else:
            loc = batch.swa_out_cache_loc if group.name == "SWA" else batch.out_cache_loc
            ids, pos = batch.input_ids, batch.positions
            want_ids, want_pos = batch.expected_tokens, batch.expected_positions
        args = dict(input_ids=ids, positions=pos, out_cache_loc=loc, enable_write_input_assert=True,
                    expected_input_tokens=want_ids, expected_input_positions=want_pos)
        if self.recorder is not None:
            self.recorder.write(batch.step, group, ep, args)
        with self.timer("write"):
            launch_canary_write_kernel(context=ep.write_ctx, plan=group.write_plan, backend=self.backend, **args)

    def _endpoints(self, group: CanaryGroup, role: str, batch: Batch) -> None:
        """HEAD or TAIL of one group: per endpoint (K, then V), verify the prefix, then write the new tokens."""
        for ep in group.endpoints[role]:
            self._verify(group, ep, group.verify_plan, True, batch.step)
            self._write(group, ep, batch)

    def _scatter(self, batch: Batch) -> None:
        eng = self.engine
        with self.timer("scatter"):
            flat, offsets, rpi = eng.expected_token_inputs(batch)
            launch_scatter_req_token_ids(flat_in=flat, offsets=offsets, req_pool_indices=rpi,
                                         pool_out=eng.expected_pool, status=self.states["target"].status,
                                         backend=self.backend)

    def _sweep(self, step: int) -> None:
        slots, positions, prevs = self.engine.tree.walk()
        n = int(slots.shape[0])
        if n == 0:
            return
        self.sweeps += 1
        xp = self.xp
        for group in self.groups:
            with self.timer("sweep"):
                plan = group.sweep_plan(n)
                plan.verify_slot_indices[:n] = group.translate(xp.asarray(slots))
                plan.verify_prev_slot_indices[:n] = group.translate(xp.asarray(prevs))
                plan.verify_expected_positions[:n] = xp.asarray(positions)
                plan.verify_expected_tokens[:n] = -1
                plan.verify_num_valid.fill(n)
                plan.enable.fill(1)
            for ep in group.endpoints["SWEEP"]:
                self._verify(group, ep, plan, False, step)

    # -- violations ----------------------------------------------------------------------------------------

    def _group_of(self, model: str, tag: str) -> str:
        if model == "draft":
            return "DRAFT"
        return "SWA" if tag.endswith("_SWA") else "FULL"

    def _read(self, read_step: int) -> None:
        """Read what the previous step's launches appended, attribute it, drain the rings."""
        launch_step = read_step - 1
        first_hits: list[tuple[str, str, str, Any, list[Any]]] = []
        for model, state in self.states.items():
            if int(to_host(state.violation_write_index)[0]) == 0 and int(to_host(state.status)[0]) == 0:
                continue
            report = read_violations(state)
            state.violation_write_index.fill(0)
            if report.status:
                self.status_bits |= report.status
                state.status.fill(0)
            self.dropped += report.dropped
            for v in report.rows:
                group = self._group_of(model, v.launch_tag)
                self.timeline["violations"][read_step] += 1
                self.by_tag[f"{v.launch_tag}" + ("/draft" if model == "draft" else "")] += 1
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
                            first_hits.append((fault.kind, model, group, v, report.rows))
        if self.recorder is not None:
            for kind, model, group, violation, rows in first_hits:
                self.recorder.dump(kind, launch_step, model, group, violation, rows)

    # -- the loop ------------------------------------------------------------------------------------------

    def _step(self, t: int) -> None:
        eng, inj, timer = self.engine, self.injector, self.timer
        if self.recorder is not None:
            self.recorder.begin_step(t)
        if t > 0:
            with timer("read"):
                self._read(t)
        if t == self.cfg.warmup_steps:
            for state in self.states.values():  # mark_init_finished(): warm-up positions are over
                state.enable_chain_position_assert.fill(1)
        with timer("engine"):
            batch = eng.schedule(t)
        before = len(self.tracker.faults)
        inj.begin_step(t)
        inj.run("batch", t, batch)
        if batch.reqs:
            self._scatter(batch)
            for group in self.target_groups:
                self._plan(group, batch)
                self._endpoints(group, "HEAD", batch)
            redirect: dict[str, tuple[int, int]] = {}
            for group in self.target_groups:
                redirect.update(inj.run("forward", t, batch, group.name) or {})
            with timer("engine"):
                eng.forward(batch, redirect)
            for group in self.target_groups:
                inj.run("after_forward", t, batch, group.name)
                self._endpoints(group, "TAIL", batch)
            with timer("engine"):
                eng.sample(batch)
            if self.draft_group is not None:
                group = self.draft_group
                self._plan(group, batch)
                self._endpoints(group, "HEAD", batch)
                redirect = inj.run("forward", t, batch, "DRAFT") or {}
                with timer("engine"):
                    eng.forward_draft(batch, redirect)
                inj.run("after_forward", t, batch, "DRAFT")
                self._endpoints(group, "TAIL", batch)
        with timer("engine"):
            eng.finish_step(batch)
        inj.run("after_step", t, batch)
        self.timeline["injected"][t] += len(self.tracker.faults) - before
        if self.cfg.sweep_interval and t % self.cfg.sweep_interval == 0:
            self._sweep(t)

    def run(self, progress: ProgressCallback | None = None) -> dict[str, Any]:
        start = time.perf_counter()
        for t in range(self.cfg.steps):
            self._step(t)
            self.steps_run = t + 1
            if progress is not None:
                progress(t + 1, self.live_counts())
        with self.timer("read"):
            self._read(self.cfg.steps)
        if self.backend == "cuda":
            self.xp.cuda.Device().synchronize()
        self.wall = time.perf_counter() - start
        return self.report()

    def live_counts(self) -> dict[str, int]:
        faults = self.tracker.faults
        return {"injected": len(faults), "detected": sum(f.detected for f in faults),
                "false_positives": sum(self.timeline["false_positives"]),
                "violations": sum(self.timeline["violations"]), "running": len(self.engine.running)}

    # -- the report ----------------------------------------------------------------------------------------

    def report(self) -> dict[str, Any]:
        from .report import build_report

        return build_report(self)


def run_simulation(cfg: SimConfig, progress: ProgressCallback | None = None) -> dict[str, Any]:
    """Run one simulation and return its report (see :data:`kvcanary_cupy.sim.report.SCHEMA`)."""
    return Simulation(cfg).run(progress)
