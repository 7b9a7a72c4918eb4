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
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from .._errors import fail
from .._limits import check_allocation
from .._validate import StorageGuard, array_arg, host_int_vector
from ..bind import BoundLaunch, bind_scatter, distinct_guards
from ..constants import CANARY_FIELDS_PER_SLOT, CanaryStatus
from ..dlpack import device_of, first_torch_cuda_tensor
from ..tiers import (
    check_offloaded_records,
    offload_canary_records,
    restore_canary_records,
    select_offloaded_records,
)
from ..transfer import gather_canary_records, scatter_canary_records
from ..violations import ViolationReport, decode_row
from .batch import Buffer, StagedBatch, StagedHistory, StepBatch
from .config import CanaryConfig, Capacities, verify_latency_bound
from .footprint import runtime_footprint
from .groups import (
    Endpoint,
    GroupState,
    bind_group,
    build_group,
    counter_name,
    gather_lut,
    reserve_scalars,
    select_window,
)
from .pools import KvPools, row_less
from .reporting import StepReport, publish
from .scalars import Scalars
from .space import ArraySpace


class SweepSource(Protocol):
    """What the sweep asks the engine: every slot its prefix cache holds, as ``(slots, positions, prev_slots)``
    int64 host arrays in the full pool's slot space (``prev`` -1 at a chain head; SGLang walks its radix tree)."""

    def __call__(self) -> tuple[Any, Any, Any]: ...


def _sweep_entries(answer: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A sweep source's answer as three int64 host vectors of one length. Refused rather than converted: a
    float or 2-D array would otherwise be truncated or flattened into slots the engine never named."""
    if not isinstance(answer, (tuple, list)) or len(answer) != 3:
        fail(f"sweep_source must return (slots, positions, prev_slots), got {type(answer).__name__}")
    slots, positions, prevs = (host_int_vector(value, f"sweep_source's {name}")
                               for name, value in zip(("slots", "positions", "prev_slots"), answer, strict=True))
    if not slots.shape[0] == positions.shape[0] == prevs.shape[0]:
        fail(f"sweep_source returned {slots.shape[0]} slots but {positions.shape[0]} positions and "
             f"{prevs.shape[0]} prev slots")
    return slots, positions, prevs


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
class _Snapshot:
    """The device words as they were at the end of one step, on their way to (pinned) host memory."""

    host: tuple[np.ndarray, np.ndarray]
    event: Any
    step: int
    forwards: dict[str, int]
    sweep_launches: dict[str, int]


@dataclass
class _Totals:
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


@dataclass
class OffloadedRecords:
    """The canary records of ``count`` slots copied down a tier, one ``int64 [count, 4]`` host array per canary
    buffer (HEAD and TAIL, K and V) of every group of ``model``, keyed ``(group, buffer index)``. Store it next
    to the pages; :meth:`CanaryRuntime.restore` takes it back. ``nbytes``: what carrying it costs."""

    model: str
    count: int
    records: dict[tuple[str, int], np.ndarray]

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in self.records.values())

    def select(self, index: Any) -> OffloadedRecords:
        """The records of the slots ``index`` (a host integer index or boolean mask into ``[0, count)``)."""
        return OffloadedRecords(*select_offloaded_records(self, index))


class CanaryRuntime:
    """The whole canary of one engine: buffers, plans, rings, counters, bound launches and the step protocol.

    Create it with :meth:`create`; read the public attributes, never replace them: ``config``, ``pools``,
    ``capacities``, ``space`` (device and framework), ``groups`` (name -> :class:`GroupState`), ``models``,
    ``stages`` (model -> :class:`StagedBatch`), ``expected_token_pool`` (owner or None) and ``step``.
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
        self.groups: dict[str, GroupState] = {}
        self.stages: dict[str, StagedBatch] = {}
        self.expected_token_pool: Any = None
        self._by_model: dict[str, list[GroupState]] = {m: [] for m in self.models}
        self._sweep_launches = {g.name: 0 for g in pools.groups}
        self._totals = _Totals()
        # A phase's launches (held, so their ids stay theirs) and their distinct storage checks, by launch ids.
        self._phase_guards: dict[tuple[int, ...], tuple[tuple[Any, ...], tuple[StorageGuard, ...]]] = {}
        self._pending: _Snapshot | None = None
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
                                window=cfg.max_verify_entries_per_step)
            bind_group(state, self.stages[group.model], layout=pools.layout_of(group),
                       expected_pool=self.expected_token_pool, check_tokens=cfg.verify_token_assert,
                       backend=cfg.backend)
            self.groups[group.name] = state
            self._by_model[group.model].append(state)
        self._group_index = {name: i for i, name in enumerate(self.groups)}
        # (endpoint, op, slot-counter name, kernel-counter name) per group, in endpoint order
        self._counters = {name: [(ep, op, counter_name(state, ep, op, "slots"), counter_name(state, ep, op, "kernels"))
                                 for ep in state.all_endpoints()
                                 for op in (("verify", "write") if ep.write_ctx is not None else ("verify",))]
                          for name, state in self.groups.items()}
        self._sweep_capacity = sweep_cap
        self._sweep_host = {k: space.host(sweep_cap, np.int64) for k in ("slots", "positions", "prevs")}
        self._sweep_in = {k: Buffer(*space.alloc(sweep_cap, np.int64, name="Capacities.max_sweep_slots"))
                          for k in ("slots", "positions", "prevs")}
        # copy_slots: host staging, the slots on the device, their LUT gathers and the records in flight, in
        # chunks of max_tokens
        self._copy_host = {k: space.host(caps.max_tokens, np.int64) for k in ("src", "dst")}
        tokens = "Capacities.max_tokens"
        self._copy_in = {k: Buffer(*space.alloc(caps.max_tokens, np.int64, name=tokens)) for k in ("src", "dst")}
        self._copy_lut = {k: Buffer(*space.alloc(caps.max_tokens, np.int64, name=tokens)) for k in ("src", "dst")}
        self._copy_records = Buffer(*space.alloc((caps.max_tokens, CANARY_FIELDS_PER_SLOT), np.int64, name=tokens))
        self._ring_host = {name: space.host((cfg.ring_capacity, 8), np.int64) for name in self.groups}
        # Two snapshot slots, each a host buffer and its event, alternated between the snapshot being read (one
        # step late) and the one being taken, so no step allocates either.
        self._snap_host = [self.scalars.host_buffers(space) for _ in range(2)]
        self._snap_events = [space.event() for _ in range(2)]
        self._side = space.side_stream()

    # -- helpers -------------------------------------------------------------------------------------------

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

    @property
    def enabled(self) -> bool:
        return self.config.enabled

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
                for state in groups:
                    if state.swa_out_cache_loc is not None:
                        gather_lut(state, self.space.xp, stage.view("out_cache_loc"), state.swa_out_cache_loc.view)
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
                    gather_lut(state, self.space.xp, stage.view("out_cache_loc"), state.swa_out_cache_loc.view)

    def _check_launches(self, groups: list[GroupState], role: str, *, with_plan: bool = False) -> None:
        """Every host-side check of the launches a phase is about to run, for every group, before the first
        of them runs: a group whose engine tensor moved refuses the phase with nothing launched for any group.
        The phase then runs them with ``checked=True`` (each storage check once per phase, not per launch).
        Which checks are distinct is worked out once per set of launches, not every step."""
        launches = tuple([state.plan for state in groups if with_plan]
                         + [launch for state in groups for ep in state.endpoints[role]
                            for launch in (ep.verify, ep.write)])
        key = tuple(map(id, launches))
        known = self._phase_guards.get(key)
        if known is None:
            if len(self._phase_guards) >= 64:
                self._phase_guards.clear()
            known = self._phase_guards[key] = (launches, distinct_guards(launches))
        for guard in known[1]:
            guard.check()

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

    # -- between steps -------------------------------------------------------------------------------------

    def copy_slots(self, src: Any, dst: Any, *, model: str = "target") -> None:
        """The engine copied the KV of slots ``src[i]`` to ``dst[i]`` (a forked request, copy-on-write): copy
        their canary records too, in every canary buffer (HEAD and TAIL, K and V) of every group of ``model``,
        so that the copies verify as what they are (the TAIL fingerprints then check the engine's byte copy).

        ``src``, ``dst``: 1-D integer host arrays of one length in the full pool's slot space (SWA groups
        gather both through their LUT); ``dst`` distinct and disjoint from ``src``. Outside any graph, between
        steps (after the engine's copy, before the next :meth:`prepare`). A slot outside a group's buffer is
        skipped (its destination gets a zero record, which never verifies) and sets SLOT_OUT_OF_RANGE in
        the group's status, reported by the next :meth:`finish_step`. No device allocation."""
        if not self.enabled:
            return
        self._outside_capture("copy_slots")
        groups = self._groups_of(model)
        src_arr, dst_arr = host_int_vector(src, "src"), host_int_vector(dst, "dst")
        n = int(src_arr.shape[0])
        if int(dst_arr.shape[0]) != n:
            fail(f"src has {n} slots but dst has {dst_arr.shape[0]}")
        if np.unique(dst_arr).shape[0] != n:
            fail("dst must name distinct slots (two copies into one slot)")
        if np.intersect1d(src_arr, dst_arr).size:
            fail("src and dst must be disjoint (a slot both copied and overwritten)")
        space, cap = self.space, self.capacities.max_tokens
        buffers = [(state, {id(ep.verify_ctx.canary_buf): ep.verify_ctx.canary_buf
                            for ep in state.all_endpoints()}) for state in groups]
        with self._timed("copy"), space.scope():
            for start in range(0, n, cap):
                m = min(cap, n - start)
                for key, arr in (("src", src_arr), ("dst", dst_arr)):
                    host = self._copy_host[key]
                    host[:m] = arr[start : start + m]
                    space.upload(self._copy_in[key].view[:m], host[:m])
                for state, bufs in buffers:
                    slots = {}
                    for key in ("src", "dst"):
                        if state.lut_view is None:
                            slots[key] = self._copy_in[key].owner[:m]
                        else:
                            gather_lut(state, space.xp, self._copy_in[key].view[:m], self._copy_lut[key].view[:m])
                            slots[key] = self._copy_lut[key].owner[:m]
                    status = self.scalars.owner(f"{state.name}.status")
                    records = self._copy_records.owner[:m]
                    for buf in bufs.values():
                        gather_canary_records(canary_buf=buf, slots=slots["src"], records_out=records,
                                              status=status, backend=self.config.backend, on_invalid="flag")
                        scatter_canary_records(records=records, slots=slots["dst"], canary_buf=buf, status=status,
                                               backend=self.config.backend, on_invalid="flag")

    def _canary_buffers(self, groups: list[GroupState]) -> list[tuple[GroupState, list[Any]]]:
        """Every distinct canary buffer of each group (SWEEP shares TAIL's), in endpoint order."""
        return [(state, list({id(ep.verify_ctx.canary_buf): ep.verify_ctx.canary_buf
                              for ep in state.all_endpoints()}.values())) for state in groups]

    def _group_slots(self, state: GroupState, key: str, m: int) -> Any:
        """The first ``m`` staged full-pool slots of ``key`` in ``state``'s slot space (through its LUT)."""
        if state.lut_view is None:
            return self._copy_in[key].owner[:m]
        gather_lut(state, self.space.xp, self._copy_in[key].view[:m], self._copy_lut[key].view[:m])
        return self._copy_lut[key].owner[:m]

    def offload(self, slots: Any, *, model: str = "target") -> OffloadedRecords:
        """The engine is copying the KV of ``slots`` down to a lower tier: return their canary records (every
        canary buffer of every group of ``model``), to be stored with the pages.

        ``slots``: a 1-D integer host array in the full pool's slot space (SWA groups gather it through their
        LUT), in position order. Outside any graph, between steps, before the engine frees the slots. A slot
        outside a group's buffer gives a zero record (which never verifies) and sets SLOT_OUT_OF_RANGE in the
        group's status. Synchronises (the records are copied to host memory)."""
        slot_arr = host_int_vector(slots, "slots")
        n = int(slot_arr.shape[0])
        if not self.enabled:
            return OffloadedRecords(model, n, {})
        self._outside_capture("offload")
        buffers = self._canary_buffers(self._groups_of(model))
        out = {(state.name, b): np.empty((n, CANARY_FIELDS_PER_SLOT), np.int64)
               for state, bufs in buffers for b in range(len(bufs))}
        space = self.space
        with self._timed("offload"), space.scope():
            for start, m, state, b, buf, src, status in self._staged_buffers(slot_arr, "src", buffers):
                offload_canary_records(canary_buf=buf, slots=src, records_out=self._copy_records.owner[:m],
                                       status=status, backend=self.config.backend, on_invalid="flag")
                space.to_host_async(self._copy_records.view[:m], out[(state.name, b)][start : start + m])
                space.synchronize()  # the staging buffer is reused by the next buffer
        return OffloadedRecords(model, n, out)

    def _staged_buffers(self, slot_arr: np.ndarray, role: str, buffers: list[tuple[GroupState, list[Any]]]
                        ) -> Iterator[tuple[int, int, GroupState, int, Any, Any, Any]]:
        """``slot_arr`` staged on the device in chunks of at most ``max_tokens`` slots (``role``: the "src" or
        "dst" staging buffer), then, per chunk, every canary buffer of ``buffers`` with that chunk's slots in the
        group's slot space: ``(start, length, group, buffer index, buffer, slots, group status)``."""
        space, cap = self.space, self.capacities.max_tokens
        n = int(slot_arr.shape[0])
        for start in range(0, n, cap):
            m = min(cap, n - start)
            host = self._copy_host[role]
            host[:m] = slot_arr[start : start + m]
            space.upload(self._copy_in[role].view[:m], host[:m])
            for state, bufs in buffers:
                group_slots = self._group_slots(state, role, m)
                status = self.scalars.owner(f"{state.name}.status")
                for b, buf in enumerate(bufs):
                    yield start, m, state, b, buf, group_slots, status

    def restore(self, records: OffloadedRecords, slots: Any, positions: Any, prev_slots: Any) -> int:
        """The engine loaded pages back from a lower tier into ``slots``: put their canary records there and
        verify the restored slots now, before any forward reads them. Returns the number of slots verified.

        ``records``: what :meth:`offload` returned for these pages (or :meth:`OffloadedRecords.select` of it), in
        the order of ``slots``; ``slots`` the device slots the pages landed in (full pool's slot space,
        distinct); ``positions`` their positions in the request; ``prev_slots`` the slot of each one's
        predecessor (``-1`` at position 0): the device slot the first restored page continues, so the chain
        across the boundary between resident and restored KV is checked too. The real KV must be in place
        (TAIL fingerprints are re-hashed from the restored bytes) and, for SWA groups, the LUT must map the
        restored slots. The verify runs on the SWEEP endpoints (chain, position, real KV); violations are
        reported by the next :meth:`finish_step` like any other. Outside any graph, between steps."""
        if not isinstance(records, OffloadedRecords):
            fail(f"records must be the OffloadedRecords of offload(), got {type(records).__name__}")
        check_offloaded_records(records, models=self.models)
        slot_arr = host_int_vector(slots, "slots")
        pos_arr, prev_arr = host_int_vector(positions, "positions"), host_int_vector(prev_slots, "prev_slots")
        n = int(slot_arr.shape[0])
        if not n == pos_arr.shape[0] == prev_arr.shape[0] == records.count:
            fail(f"slots has {n} entries, positions {pos_arr.shape[0]}, prev_slots {prev_arr.shape[0]} and records "
                 f"{records.count}; they must match")
        if np.unique(slot_arr).shape[0] != n:
            fail("slots must name distinct slots (two pages restored into one slot)")
        if not self.enabled:
            return 0
        self._outside_capture("restore")
        self._check_launches(self._groups_of(records.model), "SWEEP")  # its verify runs them after the scatter
        buffers = self._canary_buffers(self._groups_of(records.model))
        check_offloaded_records(records, keys=[(state.name, b) for state, bufs in buffers for b in range(len(bufs))])
        space = self.space
        with self._timed("restore"), space.scope():
            for start, m, state, b, buf, dst, status in self._staged_buffers(slot_arr, "dst", buffers):
                space.upload(self._copy_records.view[:m], records.records[(state.name, b)][start : start + m])
                restore_canary_records(records=self._copy_records.owner[:m], slots=dst, canary_buf=buf,
                                       status=status, backend=self.config.backend, on_invalid="flag")
                space.synchronize()  # the staging buffer is reused by the next buffer
        groups = self._groups_of(records.model)
        with self._timed("restore"):
            self._verify_entries(groups, slot_arr, pos_arr, prev_arr, phase="restore")
        return n

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
            entries = _sweep_entries(self.sweep_source())
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
        publish(report, self.config.mode, self.log, overflow_counts=self._totals.overflows)
        return report

    @contextlib.contextmanager
    def _nothing_lost(self, report: StepReport) -> Iterator[None]:
        """Whatever fails once rows have been read from a ring (a timer or observer hook, a launch), what was
        read reaches the caller: every fact of ``report`` is logged (``log`` mode's records, whatever the mode;
        ``stats()`` already counts them) and the failure, which propagates, says so in a note."""
        try:
            yield
        except BaseException as exc:
            if not report.clean:
                publish(report, "log", self.log, overflow_counts=self._totals.overflows)
                add_note = getattr(exc, "add_note", None)  # Python 3.11+
                if add_note is not None:
                    add_note(f"kv-canary: {len(report.new_violations)} violation(s) read from the rings before this "
                             f"failure were logged to {self.log.name!r} and are counted in stats()")
            raise

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
        publish(report, self.config.mode, self.log, overflow_counts=self._totals.overflows)
        return report

    def _take_snapshot(self, step: int, *, clear: bool = True) -> None:
        space = self.space
        slot = step % 2
        if self._pending is not None and self._pending.host is self._snap_host[slot]:
            slot = 1 - slot  # never the pending snapshot's buffer and event, which are still to be read
        host = self._snap_host[slot]
        with space.scope():
            self.scalars.copy_to(space, host)
            event = space.record(self._snap_events[slot])
            if clear:  # status words accumulate: clear them behind the copy (stream order), each bit is seen once
                for state in self.groups.values():
                    self.scalars.view(f"{state.name}.status").fill(0)
                self.scalars.view("scatter.status").fill(0)
        self._pending = _Snapshot(host, event, step, dict(self.forwards), dict(self._sweep_launches))

    def _consume(self, step: int, report: StepReport) -> None:
        """Read the pending snapshot (taken one step ago), the ring rows it announces, and drain them, into
        ``report`` (filled group by group, and counted in the totals as it is filled, so that a failure part way
        leaves in ``report`` and ``stats()`` exactly what was drained)."""
        snap, self._pending = self._pending, None
        report.step, report.launch_step = step, -1 if snap is None else snap.step
        if snap is None:
            return
        space, sc, totals = self.space, self.scalars, self._totals
        space.wait(snap.event)
        host = snap.host
        for name, state in self.groups.items():
            n = sc.value(host, f"{name}.write_index")
            status = sc.value(host, f"{name}.status")
            lost = sc.value(host, f"{name}.lost")
            cap = int(state.ring_view.shape[0])
            dropped = max(0, n - cap) + lost - totals.counters.get(f"{name}.lost", 0)
            totals.counters[f"{name}.lost"] = lost
            rows = []
            if n > 0:
                m = min(n, cap)
                out = self._ring_host[name]
                space.read_after(snap.event, state.ring_view[:m], out[:m], self._side)
                rows = [decode_row(i, out[i]) for i in range(m)]
            if rows or status or dropped:
                head_k = state.endpoints["HEAD"][0]
                report.reports[name] = ViolationReport(
                    total=n, capacity=cap, rows=rows, status=CanaryStatus(status),
                    slot_run_counter=sc.value(host, counter_name(state, head_k, "verify", "slots")),
                    kernel_run_counter=sc.value(host, counter_name(state, head_k, "verify", "kernels")))
                report.new_violations += [(name, v) for v in rows]
                totals.by_group[name] = totals.by_group.get(name, 0) + len(rows)
                totals.violations += len(rows)
            if n > 0:  # drained once the rows are in the report
                self._drain(state, n)
            report.dropped += dropped
            totals.dropped += dropped
            totals.status_bits |= status
            if state.window_plan is not None and sc.value(host, f"{name}.plan.enable"):
                live = sc.value(host, f"{name}.plan.num_valid")
                totals.live_max[name] = max(totals.live_max.get(name, 0), live)
            plan_status = sc.value(host, f"{name}.plan.status")
            if plan_status:
                report.plan_status[name] = plan_status
            if snap.forwards.get(state.model, 0) and sc.value(host, f"{name}.plan.enable") == 0:
                report.overflowed.append(name)
                totals.overflows[name] = totals.overflows.get(name, 0) + 1
        report.new_violations.sort(key=self._launch_order)
        report.scatter_status = sc.value(host, "scatter.status")
        totals.status_bits |= report.scatter_status
        for keys in self._counters.values():
            for _, _, slots_key, kernels_key in keys:
                totals.counters[slots_key] = sc.value(host, slots_key)
                totals.counters[kernels_key] = sc.value(host, kernels_key)
        if self.config.health_check:
            report.health_problems = self._health(snap)
            totals.health_failures += len(report.health_problems)

    def _launch_order(self, item: tuple[str, Any]) -> tuple[int, ...]:
        """Rows of one step in the order their launches ran: per model (in order of first appearance), HEAD of
        every group then TAIL of every group; the sweep last; ring order within a launch."""
        group, v = item
        role = v.launch_tag.split("_", 1)[0]
        state = self.groups[group]
        model = self.models.index(state.model)
        return (role == "SWEEP", model, role == "TAIL", self._group_index[group], v.index)

    def _drain(self, state: GroupState, n: int) -> None:
        """Drop the ``n`` rows just read (stream-ordered after every launch enqueued since): rows appended
        later move to the front, the write index and the count of rows a full ring lost follow."""
        xp, sc, name = self.space.xp, self.scalars, state.name
        ring, scratch = state.ring_view, state.ring_scratch
        cap = int(ring.shape[0])
        shift = min(n, cap)
        wi, lost, temp = sc.view(f"{name}.write_index"), sc.view(f"{name}.lost"), sc.view(f"{name}.drain_temp")
        with self.space.scope():
            # a device write index cannot be read without a sync: move the whole tail; on the CPU move only the
            # rows appended since the snapshot
            end = cap if self.space.is_cuda else min(int(wi[0]), cap)
            if shift < end:
                scratch[: end - shift] = ring[shift:end]
                ring[: end - shift] = scratch[: end - shift]
            # rows still held after the shift: r = max(0, min(w, cap) - shift); the rest of (w - n) was lost
            xp.minimum(wi, cap, out=temp)
            temp -= shift
            xp.maximum(temp, 0, out=temp)
            lost += wi
            lost -= n
            lost -= temp
            xp.copyto(wi, temp, casting="unsafe")

    # -- health --------------------------------------------------------------------------------------------

    def _health(self, snap: _Snapshot) -> list[str]:
        problems: list[str] = []
        sc, host = self.scalars, snap.host

        def check(key: str, got: int, want: int, what: str) -> None:
            # a deficit is reported once; later steps compare against the counter's new baseline
            offset = self._health_offsets.get(key, 0)
            if got != want - offset:
                problems.append(f"{what}: {got}, expected {want - offset}")
                self._health_offsets[key] = want - got

        for name, state in self.groups.items():
            forwards = snap.forwards.get(state.model, 0)
            ref: dict[str, int] = {}
            for ep, op, slots_key, kernels_key in self._counters[name]:
                want = snap.sweep_launches[name] if ep.role == "SWEEP" else forwards
                kernels = sc.value(host, kernels_key)
                if kernels != want - self._health_offsets.get(kernels_key, 0):
                    whom = f"prepare() call of model {state.model!r}" if ep.role != "SWEEP" else "sweep launch"
                    check(kernels_key, kernels, want, f"group {name}: {ep.tag.name} {op} kernel ran (count) vs one "
                                                      f"per {whom}")
                if ep.role == "SWEEP":
                    continue
                slots = sc.value(host, slots_key)
                if op not in ref:
                    ref[op] = slots
                elif slots != ref[op] - self._health_offsets.get(slots_key, 0):
                    check(slots_key, slots, ref[op],
                          f"group {name}: {ep.tag.name} {op} slot count vs HEAD_K (same plan, same batch)")
        return problems

    def check_health(self) -> list[str]:
        """Synchronise, take a snapshot now and check the run counters; the problems found (also counted and
        reported like those of :meth:`finish_step`). Outside any graph only."""
        if not self.enabled:
            return []
        self._outside_capture("check_health")
        pending = self._pending
        self.space.synchronize()
        self._take_snapshot(self.step, clear=False)
        snap = self._pending
        self._pending = pending
        assert snap is not None
        problems = self._health(snap)
        self._totals.health_failures += len(problems)
        return problems

    # -- sweep ---------------------------------------------------------------------------------------------

    def sweep(self) -> int:
        """Verify every slot the engine's prefix cache holds (``sweep_source``) on every group's SWEEP
        endpoints, in chunks of the sweep capacity; returns the number of slots. Outside any graph."""
        if not self.enabled or self.sweep_source is None:
            return 0
        self._outside_capture("sweep")
        return self._run_sweep(_sweep_entries(self.sweep_source()))

    def _run_sweep(self, entries: tuple[np.ndarray, np.ndarray, np.ndarray]) -> int:
        """Verify a validated sweep answer; every SWEEP launch is checked before the first one is filled."""
        slots, positions, prevs = entries
        self._check_launches(list(self.groups.values()), "SWEEP")
        n = int(slots.shape[0])
        if n == 0:
            return 0
        with self._timed("sweep"):
            self._verify_entries(list(self.groups.values()), slots, positions, prevs, phase="sweep")
        self._totals.sweeps += 1
        self._totals.swept_slots += n
        return n

    def _verify_entries(self, groups: list[GroupState], slots: np.ndarray, positions: np.ndarray,
                        prevs: np.ndarray, *, phase: str) -> None:
        """Verify ``(slot, position, prev slot)`` entries (full pool's slot space) on the SWEEP endpoints of
        ``groups``, in chunks of the sweep capacity (the sweep, and the verify of restored slots). The caller
        ran ``_check_launches(groups, "SWEEP")`` first."""
        n = int(slots.shape[0])
        space, xp, cap = self.space, self.space.xp, self._sweep_capacity
        with space.scope():
            for start in range(0, n, cap):
                m = min(cap, n - start)
                for key, arr in (("slots", slots), ("positions", positions), ("prevs", prevs)):
                    host = self._sweep_host[key]
                    host[:m] = arr[start : start + m]
                    space.upload(self._sweep_in[key].view[:m], host[:m])
                for state in groups:
                    views = state.sweep_views
                    src_slots, src_prevs = self._sweep_in["slots"].view[:m], self._sweep_in["prevs"].view[:m]
                    if state.lut_view is not None:
                        gather_lut(state, xp, src_slots, views["verify_slot_indices"][:m])
                        gather_lut(state, xp, src_prevs, views["verify_prev_slot_indices"][:m])
                    else:
                        views["verify_slot_indices"][:m] = src_slots
                        views["verify_prev_slot_indices"][:m] = src_prevs
                    views["verify_expected_positions"][:m] = self._sweep_in["positions"].view[:m]
                    views["verify_num_valid"].fill(m)
                    views["enable"].fill(1)
                    for ep in state.endpoints["SWEEP"]:
                        assert ep.verify is not None
                        self._launch(ep.verify, "verify", state.model, state, ep, timer_phase=phase, checked=True)
                    self._sweep_launches[state.name] += 1

    def run_counters(self) -> dict[tuple[str, str, str], tuple[int, int]]:
        """Synchronise and read every run counter now: ``{(group, tag, "verify"|"write"): (slots, kernels)}``.
        Outside any graph only (tests, reports at shutdown)."""
        if not self.enabled:
            return {}
        self._outside_capture("run_counters")
        host = self.scalars.host_buffers(self.space)
        self.space.synchronize()
        with self.space.scope():
            self.scalars.copy_to(self.space, host)
        self.space.synchronize()
        return {(name, ep.tag.name, op): (self.scalars.value(host, slots_key), self.scalars.value(host, kernels_key))
                for name, keys in self._counters.items() for ep, op, slots_key, kernels_key in keys}

    # -- stats ---------------------------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Counters for metrics exporters (device counters as of the last snapshot read, one step late)."""
        t = self._totals
        protected = verified = 0
        for name, keys in self._counters.items() if self.enabled else ():
            head_k = self.groups[name].endpoints["HEAD"][0]
            for ep, op, slots_key, _ in keys:
                if op == "verify":
                    verified += t.counters.get(slots_key, 0)
                elif ep is head_k:
                    protected += t.counters.get(slots_key, 0)
        return {
            "mode": self.config.mode, "steps": self.step, "forwards": dict(self.forwards),
            "protected_tokens": protected, "verified_entries": verified, "sweeps": t.sweeps,
            "swept_slots": t.swept_slots, "violations": t.violations, "violations_by_group": dict(t.by_group),
            "dropped": t.dropped, "status_bits": t.status_bits, "overflows": dict(t.overflows),
            "health_failures": t.health_failures, "init_finished": self._init_finished,
            **self.verify_bound(),
        }

    def verify_bound(self) -> dict[str, Any]:
        """The bounded verify's detection-latency bound, from what the run has seen so far (one step late).

        ``verify_entries_per_step``: N (0: full verify, every live slot every step). ``verify_live_max``: the
        most live prefix entries any group's plan listed. ``verify_bound_steps``: every live slot of an
        unchanging set of prefixes is verified within this many steps (``ceil(live / N)``).
        ``verify_bound_steps_growing``: the bound while every step adds up to ``verify_growth_max`` entries (the
        most new tokens of one forward) to the lists; -1 when N does not exceed that growth (see
        :func:`~kvcanary_cupy.runtime.verify_latency_bound`)."""
        n = self.config.max_verify_entries_per_step
        live = max(self._totals.live_max.values(), default=0)
        growth = self._totals.step_tokens_max
        return {"verify_entries_per_step": n, "verify_live_max": live, "verify_growth_max": growth,
                "verify_bound_steps": verify_latency_bound(live, n),
                "verify_bound_steps_growing": verify_latency_bound(live, n, growth_per_step=growth)}

    def stats_line(self) -> str:
        s = self.stats()
        line = (f"kv-canary: protected {s['protected_tokens']} tokens, {s['sweeps']} sweep passes, "
                f"{s['violations']} violations")
        if s["verify_entries_per_step"]:
            grow = s["verify_bound_steps_growing"]
            line += (f"; bounded verify of {s['verify_entries_per_step']} entries/step/group: every live slot "
                     f"verified within {s['verify_bound_steps']} steps ({s['verify_live_max']} live entries), "
                     + (f"within {grow} while {s['verify_growth_max']} entries are added per step" if grow > 0 else
                        f"no bound while {s['verify_growth_max']} entries are added per step"))
        return line
