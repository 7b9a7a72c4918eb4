"""The canary an engine installs: :class:`CanaryRuntime`, created once from the config, the KV pools and the
capacities, then driven by four calls per step (SPEC §7.2).

1. :meth:`CanaryRuntime.prepare` — before the forward, outside any graph: check the batch against the
   capacities, copy it into the runtime's fixed-size buffers, gather SWA slots through their LUTs, scatter the
   token histories into the expected-token pool.
2. :meth:`CanaryRuntime.pre_forward` — may be captured: per group plan, HEAD verify (K, then V with HEAD K's
   buffer as its twin), HEAD write.
3. :meth:`CanaryRuntime.post_forward` — may be captured: per group TAIL verify (real KV re-hashed), TAIL write.
4. :meth:`CanaryRuntime.finish_step` — once per step, outside any graph: consume the previous step's snapshot
   of the device words (one step late: an event recorded then, never a wait on the current step), read and
   drain the rings, log or raise, check health, log stats, sweep when due, snapshot this step.

Between steps, :meth:`CanaryRuntime.copy_slots` follows a KV copy of the engine (fork, copy-on-write) with the
canary records of the copied slots; :meth:`CanaryRuntime.offload` takes the records of KV pages the engine copies
down to a lower tier (host memory, disk), and :meth:`CanaryRuntime.restore` puts them back when the pages are
loaded into (possibly other) slots and verifies the restored slots before a forward reads them.

Everything is allocated and every launch bound (:mod:`kvcanary_cupy.bind`) at creation; a step allocates no
device memory and never synchronises with the work it enqueued.

This module holds the creation and the step protocol; the runtime's other parts are classes it is built from, one
concern each: :mod:`.moves` (copy_slots, offload, restore), :mod:`.sweep` (the sweep and the verify of restored
slots), :mod:`.monitor` (snapshots, ring reads, health, stats) and :mod:`.base` (their shared state and launch
helpers).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Any

import numpy as np

from .._errors import fail
from .._limits import check_allocation
from .._validate import array_arg
from ..bind import BoundLaunch, bind_scatter
from ..dlpack import device_of, first_torch_cuda_tensor
from .base import LaunchEvent, Totals
from .batch import StagedBatch, StagedHistory, StepBatch
from .config import CanaryConfig, Capacities
from .footprint import runtime_footprint
from .groups import GroupState, bind_group, build_group, gather_staged_slots, reserve_scalars, select_window
from .monitor import Monitoring
from .moves import OffloadedRecords, RecordMoves
from .pools import KvPools, row_less
from .reporting import StepReport, publish
from .scalars import Scalars
from .space import ArraySpace
from .sweep import Sweeping, SweepSource, sweep_entries

__all__ = ["CanaryRuntime", "LaunchEvent", "OffloadedRecords", "SweepSource"]


class CanaryRuntime(RecordMoves, Sweeping, Monitoring):
    """The whole canary of one engine: buffers, plans, rings, counters, bound launches and the step protocol.

    Create it with :meth:`create`; read the public attributes, never replace them: ``config``, ``pools``,
    ``capacities``, ``space`` (device and framework), ``groups`` (name -> :class:`GroupState`), ``models``,
    ``stages`` (model -> :class:`StagedBatch`), ``expected_token_pool`` (owner or None) and ``step``.

    This class holds the creation and the step protocol; :class:`RecordMoves` (copy_slots, offload, restore),
    :class:`Sweeping` (sweep) and :class:`Monitoring` (check_health, run_counters, stats) bring the rest, each
    allocating its own buffers when the runtime is built.
    """

    def __init__(self, config: CanaryConfig, pools: KvPools, capacities: Capacities, *, device: Any = "cpu",
                 framework: str = "numpy", sweep_source: SweepSource | Callable[[], Any] | None = None,
                 observer: Callable[[LaunchEvent], None] | None = None,
                 timer: Callable[[str], contextlib.AbstractContextManager] | None = None,
                 max_allocation_bytes: int | None = None) -> None:
        if not isinstance(config, CanaryConfig):
            fail(f"config must be a CanaryConfig, got {type(config).__name__}")
        if not isinstance(pools, KvPools):
            fail(f"pools must be a KvPools, got {type(pools).__name__}")
        if not isinstance(capacities, Capacities):
            fail(f"capacities must be a Capacities, got {type(capacities).__name__}")
        for hook, value in (("sweep_source", sweep_source), ("observer", observer), ("timer", timer)):
            if value is not None and not callable(value):
                fail(f"{hook} must be callable, got {type(value).__name__}")
        if config.sweep_interval and sweep_source is None:
            fail(f"CanaryConfig.sweep_interval={config.sweep_interval} needs a sweep_source (the slots the prefix "
                 "cache holds)")
        self.config, self.pools, self.capacities = config, pools, capacities
        self.space = ArraySpace(device, framework)
        self.sweep_source = sweep_source
        self._observer = observer
        self._timer = timer
        self.log = logging.getLogger(config.logger)
        self.models = pools.models
        self.step = 0
        self.forwards = {m: 0 for m in self.models}
        self.groups = {}
        self.stages = {}
        self.expected_token_pool: Any = None
        self._by_model = {m: [] for m in self.models}
        self._sweep_launches = {g.name: 0 for g in pools.groups}
        self._totals = Totals()
        self._phase_guards = {}
        self._pending = None
        self._health_offsets: dict[str, int] = {}
        self._init_finished = False
        self._max_allocation_bytes = max_allocation_bytes
        if config.enabled:
            self._build()

    @classmethod
    def create(cls, config: CanaryConfig, pools: KvPools, capacities: Capacities, *, device: Any = "cpu",
               framework: str = "numpy", sweep_source: SweepSource | Callable[[], Any] | None = None,
               observer: Callable[[LaunchEvent], None] | None = None,
               timer: Callable[[str], contextlib.AbstractContextManager] | None = None,
               max_allocation_bytes: int | None = None) -> CanaryRuntime:
        """Validate everything host-visible, allocate every buffer and bind every launch.

        ``device``: "cpu" or "cuda[:N]". ``framework``: "numpy" (NumPy/CuPy buffers) or "torch" (torch
        tensors: on CUDA every runtime copy and launch then runs on ``torch.cuda.current_stream()``).
        ``sweep_source``: see :class:`SweepSource`. ``observer`` and ``timer`` are debugging hooks (a
        :class:`LaunchEvent` before and after every launch; a context manager per phase name); they run host
        code, so leave them None in an engine that captures CUDA graphs. ``max_allocation_bytes``: the most
        every buffer together may take (default: ``KVCANARY_MAX_ALLOCATION_BYTES``, else half the physical
        memory on the CPU, the GPU's memory on CUDA); a creation above it is refused before anything is
        allocated, naming the argument that asked for most.
        """
        return cls(config, pools, capacities, device=device, framework=framework, sweep_source=sweep_source,
                   observer=observer, timer=timer, max_allocation_bytes=max_allocation_bytes)

    # -- creation ------------------------------------------------------------------------------------------

    def _build(self) -> None:
        cfg, caps, space, pools = self.config, self.capacities, self.space, self.pools
        if space.is_cuda and space.framework != "torch" and first_torch_cuda_tensor(pools.engine_arrays()) is not None:
            # the runtime's copies would run on CuPy's stream and the launches on torch's: no ordering between them
            fail("the KV pools hold torch CUDA tensors: create the runtime with framework='torch'")
        # validated like the plan will (bind_group), but before its shape sizes the expected-token pool
        table = None if pools.req_to_token is None else array_arg(pools.req_to_token, "KvPools.req_to_token",
                                                                  dtype=np.int32, ndim=2)
        pool_shape = None
        if cfg.verify_token_assert:
            rows = caps.pool_rows if caps.pool_rows is not None else (None if table is None else int(table.shape[0]))
            width = (caps.max_context_len if caps.max_context_len is not None
                     else (None if table is None else int(table.shape[1])))
            if rows is None or width is None:
                fail("Capacities.pool_rows and Capacities.max_context_len are required with verify_token_assert "
                     "when the pools have no req_to_token")
            pool_shape = (rows, width)
        footprint = runtime_footprint(cfg, pools, caps, pool_shape)
        check_allocation(sum(footprint.values()), argument=max(footprint, key=lambda k: footprint[k]),
                         what="CanaryRuntime.create", device=str(space.device),
                         max_allocation_bytes=self._max_allocation_bytes)
        self.scalars = Scalars()
        for group in pools.groups:
            reserve_scalars(self.scalars, group)
        self.scalars.reserve("scatter.status", np.int32, 0)
        self.scalars.allocate(space)
        sweep_cap = caps.max_sweep_slots or max(g.num_slots for g in pools.groups)
        for model in self.models:
            needs_rows = any(not row_less(pools.layout_of(g)[1]) for g in pools.groups if g.model == model)
            self.stages[model] = StagedBatch(space, model=model, max_batch_size=caps.max_batch_size,
                                             max_tokens=caps.max_tokens, with_oracle=cfg.write_input_assert,
                                             with_valid_lens=cfg.verify_token_assert, needs_rows=needs_rows)
        self._history: StagedHistory | None = None
        self._scatter: BoundLaunch | None = None
        if pool_shape is not None:
            self.expected_token_pool, _ = space.alloc(pool_shape, np.int32, 0,
                                                      name="Capacities.pool_rows x Capacities.max_context_len")
            self._history = StagedHistory(space, max_rows=caps.max_batch_size,
                                          max_tokens=caps.max_history_tokens or pool_shape[0] * pool_shape[1])
            self._scatter = bind_scatter(flat_in=self._history.flat.owner, offsets=self._history.offsets.owner,
                                         req_pool_indices=self._history.rows.owner, pool_out=self.expected_token_pool,
                                         status=self.scalars.owner("scatter.status"), backend=cfg.backend,
                                         on_invalid="flag")
        for group in pools.groups:
            state = build_group(group, space, self.scalars, ring_capacity=cfg.ring_capacity,
                                verify_capacity=caps.verify_capacity or 3 * group.num_slots,
                                max_batch_size=caps.max_batch_size, sweep_capacity=sweep_cap,
                                max_tokens=caps.max_tokens, mode=cfg.real_kv_hash_mode,
                                window=cfg.max_verify_entries_per_step,
                                leader=None if group.plan_of is None else self.groups[group.plan_of])
            bind_group(state, self.stages[group.model], layout=pools.layout_of(group),
                       expected_pool=self.expected_token_pool, check_tokens=cfg.verify_token_assert,
                       backend=cfg.backend)
            self.groups[group.name] = state
            self._by_model[group.model].append(state)
        self._allocate_sweep(sweep_cap)
        self._allocate_moves()
        self._allocate_monitoring()

    def mark_init_finished(self, *, groups: Any = None) -> None:
        """Warm-up and graph capture are over: switch the write's chain-position assert on (a device flag,
        read by every later launch and replay). Synthetic warm-up positions would trip it before.

        ``groups``: a list of the names of the groups whose assert goes on (default: every group), for an engine in
        which some group's write legitimately breaks the "+1 after the seed" rule (see docs/transformers.md:
        a sliding-window ring that overwrites a chunk's own predecessor)."""
        names = list(self.groups) if groups is None else groups
        if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
            fail(f"groups must be a list of group names, got {groups!r}")
        if self.enabled:
            unknown = [n for n in names if n not in self.groups]
            if unknown:
                fail(f"groups must name groups of this runtime ({', '.join(self.groups)}), got {unknown}")
        self._init_finished = True
        if not self.enabled:
            return
        with self.space.scope():
            for name in names:
                self.scalars.view(f"{name}.chain_assert").fill(1)

    # -- phase 1 -------------------------------------------------------------------------------------------

    def prepare(self, batch: StepBatch, *, model: str = "target") -> None:
        """Phase 1 (outside any graph, before the forward): validate ``batch`` and stage it for ``model``.

        Raises the ``kv-canary: `` ValueError before anything is written when the batch does not fit the
        capacities or breaks a host-visible rule; the runtime's buffers are then untouched."""
        if not self.enabled:
            return
        self._outside_capture("prepare")
        groups = self._groups_of(model)
        stage = self.stages[model]
        views = stage.validate(batch)
        if self.config.bounded_verify:
            self._totals.step_tokens_max = max(self._totals.step_tokens_max, int(views["input_ids"].shape[0]))
        history = None
        if self._history is not None:
            history = self._history.validate(batch)
        elif any(getattr(batch, n) is not None for n in ("history_ids", "history_offsets",
                                                          "history_req_pool_indices")):
            fail("batch.history_* is given but CanaryConfig.verify_token_assert is off")
        if history is not None and self._scatter is not None:
            self._scatter.check()
        with self.space.scope():
            with self._timed("stage"):
                stage.stage(views)
                staged = stage.staged_tokens("out_cache_loc")
                for state in groups:
                    if state.swa_out_cache_loc is not None:
                        gather_staged_slots(state, self.space.xp, stage.view("out_cache_loc"), staged)
            if self._history is not None and self._history.stage(history):
                assert self._scatter is not None
                self._launch(self._scatter, "scatter", model)
        self.forwards[model] += 1

    # -- phases 2 and 3 ------------------------------------------------------------------------------------

    def pre_forward(self, *, model: str = "target") -> None:
        """Phase 2 (before the forward; capture-safe): per group of ``model``, plan, HEAD verify, HEAD write."""
        if not self.enabled:
            return
        groups = self._groups_of(model)
        self._check_launches(groups, "HEAD", with_plan=True)
        for state in groups:
            if state.leader is not None:  # KvGroup.plan_of: the leader's plan (and window) serve this group
                continue
            assert state.plan is not None
            self._launch(state.plan, "plan", model, state, checked=True)
            if state.window_plan is not None:
                with self._timed("window"), self.space.scope():
                    select_window(state, self.space.xp)
            self._run_endpoints(state, "HEAD", model)

    def post_forward(self, *, model: str = "target", out_cache_loc: Any = None) -> None:
        """Phase 3 (after the forward; capture-safe): per group of ``model``, TAIL verify (re-hashing the real
        KV of the prefix) and TAIL write (fingerprinting the KV the forward just wrote).

        ``out_cache_loc``: where the forward really wrote each token, when the engine observed it (its
        attention layers' write indices): int64 ``[T]`` on the runtime's device, ``T`` the tokens this step's
        :meth:`prepare` staged for ``model``, in the full pool's slot space (< 0: the token was not written;
        SWA groups gather it through their LUT, as :meth:`prepare` does). The TAIL write then stamps those
        slots instead of the scheduled ones, so a write that went elsewhere or nowhere leaves the scheduled
        slot's stale TAIL record for the next verify to flag (the HEAD records keep the schedule). Eager
        engines only: it is validated on the host and refused under CUDA-graph capture. No device allocation; a
        refused array leaves every buffer as it was."""
        if not self.enabled:
            return
        groups = self._groups_of(model)
        self._check_launches(groups, "TAIL")
        if out_cache_loc is not None:
            self._restage_written_slots(model, groups, out_cache_loc)
        for state in groups:
            self._run_endpoints(state, "TAIL", model)

    def _restage_written_slots(self, model: str, groups: list[GroupState], out_cache_loc: Any) -> None:
        if self.space.capturing():
            fail("post_forward(out_cache_loc=...) runs outside CUDA-graph capture (the written slots are "
                 "validated on the host); capture post_forward() without it")
        stage = self.stages[model]
        loc = array_arg(out_cache_loc, "out_cache_loc", dtype=np.int64, ndim=1)
        if device_of(loc) != self.space.device:
            fail(f"out_cache_loc is on {device_of(loc)} but the runtime is on {self.space.device}")
        n = stage.staged_tokens("out_cache_loc")
        if int(loc.shape[0]) != n:
            fail(f"out_cache_loc has {loc.shape[0]} entries but this step's prepare() staged {n} tokens for "
                 f"model {model!r}")
        with self.space.scope(), self._timed("stage"):
            if n:
                stage.view("out_cache_loc")[:n] = loc
            for state in groups:
                if state.swa_out_cache_loc is not None:
                    gather_staged_slots(state, self.space.xp, stage.view("out_cache_loc"), n)

    def _run_endpoints(self, state: GroupState, role: str, model: str) -> None:
        endpoints = state.endpoints[role]
        if role == "HEAD":
            # Both HEAD verifies before either HEAD write: HEAD V's verify compares its records with HEAD K's
            # as HEAD K's verify saw them (docs/contract.md, "Twin buffers").
            for ep in endpoints:
                assert ep.verify is not None
                self._launch(ep.verify, "verify", model, state, ep, checked=True)
            for ep in endpoints:
                assert ep.write is not None
                self._launch(ep.write, "write", model, state, ep, checked=True)
            return
        for ep in endpoints:
            assert ep.verify is not None and ep.write is not None
            self._launch(ep.verify, "verify", model, state, ep, checked=True)
            self._launch(ep.write, "write", model, state, ep, checked=True)

    # -- phase 4 -------------------------------------------------------------------------------------------

    def finish_step(self) -> StepReport:
        """Phase 4 (once per step, after every forward, outside any graph).

        Reports what the previous step's launches found (logged, or raised as
        :class:`~kvcanary_cupy.runtime.CanaryViolationError` / ``CanaryHealthError`` in ``raise`` mode, after
        this step's own bookkeeping is done), sweeps when due, and snapshots this step's device words."""
        step = self.step
        if not self.enabled:
            self.step += 1
            return StepReport(step, step - 1)
        self._outside_capture("finish_step")
        # The sweep source is asked (and its answer validated) before any ring is read: a source that raises
        # or answers badly refuses the call with nothing read, drained or counted (the rows wait for the next
        # finish_step, and the step does not advance).
        entries = None
        if self.config.sweep_interval and step % self.config.sweep_interval == 0 and self.sweep_source is not None:
            entries = sweep_entries(self.sweep_source(), self.models)
        report = StepReport(step, -1)
        with self._nothing_lost(report):
            with self._timed("read"):
                self._consume(step, report)
            if entries is not None:
                report.swept_slots = self._run_sweep(entries)
            self._take_snapshot(step)
            self.step += 1
            interval = self.config.stats_interval
            if interval and self.step % interval == 0:
                self.log.info("%s", self.stats_line(), extra={"kv_canary": {"stats": self.stats()}})
        publish(report, self.config.mode, self.log, overflow_counts=self._totals.overflows,
                log_rows=self.config.log_rows)
        return report

    def flush(self) -> StepReport:
        """Wait for the device and report everything not reported yet (the last step's launches, and any
        launch after the last :meth:`finish_step`), through the same log/raise path. For shutdown and tests."""
        if not self.enabled:
            return StepReport(self.step, self.step - 1)
        self._outside_capture("flush")
        report, later = StepReport(self.step, -1), StepReport(self.step, -1)
        with self._nothing_lost(report), self._nothing_lost(later), self._timed("read"):
            self._consume(self.step, report)
            self._take_snapshot(self.step)
            self.space.synchronize()
            self._consume(self.step, later)
        report.reports.update(later.reports)
        report.new_violations += later.new_violations
        report.plan_status.update(later.plan_status)
        report.scatter_status |= later.scatter_status
        report.overflowed += later.overflowed
        report.dropped += later.dropped
        report.health_problems += later.health_problems
        publish(report, self.config.mode, self.log, overflow_counts=self._totals.overflows,
                log_rows=self.config.log_rows)
        return report
