"""One attention group's canary state (SGLang's ``CanaryBufferGroup`` with its endpoints): HEAD and TAIL
canary buffers per K/V, the group's violation ring, its plans, and every launch bound once.

Endpoints: HEAD (HEAD buffer, no real-KV sources), TAIL and SWEEP (TAIL buffer, real-KV sources), per K and,
when the group has V sources, per V. HEAD and TAIL verify and write with the group's forward plan; SWEEP
verifies the sweep plan. Each verify and each write has its own run counters. HEAD V's verify has HEAD K's
buffer as its twin (kernels/verify.cu): the records both hold are checked once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..bind import BoundLaunch, bind_plan, bind_verify, bind_write
from ..constants import CANARY_SLOT_BYTES, VIOLATION_FIELDS, CanaryLaunchTag, RealKvHashMode
from ..context import VerifyOrWriteContext
from ..dlpack import as_array
from ..plan import VerifyPlan, WritePlan
from .batch import Buffer, StagedBatch
from .pools import KvGroup, row_less
from .scalars import Scalars
from .space import ArraySpace

ROLES = ("HEAD", "TAIL", "SWEEP")
VERIFY_ENTRY_FIELDS = ("verify_slot_indices", "verify_expected_tokens", "verify_expected_positions",
                       "verify_prev_slot_indices")


@dataclass
class Endpoint:
    """One (role, K/V) pair of a group: its contexts (sharing the group's ring) and bound launches."""

    role: str
    kv: str
    tag: CanaryLaunchTag
    verify_ctx: VerifyOrWriteContext
    write_ctx: VerifyOrWriteContext | None
    verify: BoundLaunch | None = None
    write: BoundLaunch | None = None


@dataclass
class GroupState:
    """Everything the runtime keeps for one :class:`~kvcanary_cupy.runtime.KvGroup`."""

    spec: KvGroup
    ring: VerifyOrWriteContext  # the group's ring, write index, status and chain flag (HEAD K context)
    verify_plan: VerifyPlan
    write_plan: WritePlan
    sweep_plan: VerifyPlan
    endpoints: dict[str, list[Endpoint]]
    ring_view: Any
    ring_scratch: Any
    lut_view: Any = None
    swa_out_cache_loc: Buffer | None = None
    # leading entries of ``swa_out_cache_loc`` gathered from staged tokens (past them: padding, -1 in both)
    swa_gathered: int = 0
    temp: Any = None  # int64 scratch for LUT gathers
    mask: Any = None  # bool scratch for LUT gathers
    plan: BoundLaunch | None = None
    sweep_views: dict[str, Any] = field(default_factory=dict)
    # a group that shares its plan (KvGroup.plan_of): that group's state, whose plan launch fills the plans
    leader: GroupState | None = None
    # bounded verify (CanaryConfig.max_verify_entries_per_step): the window of the forward plan the HEAD and
    # TAIL verify read, its views, the full plan's views it is gathered from, and int64/bool scratch
    window_plan: VerifyPlan | None = None
    window_views: dict[str, Any] = field(default_factory=dict)
    plan_views: dict[str, Any] = field(default_factory=dict)
    window_scratch: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def model(self) -> str:
        return self.spec.model

    @property
    def plan_name(self) -> str:
        """The group whose plan words (num_valid, enable, status) this group's launches read."""
        return self.leader.name if self.leader is not None else self.name

    def all_endpoints(self) -> list[Endpoint]:
        return [ep for role in ROLES for ep in self.endpoints[role]]


def reserve_scalars(scalars: Scalars, group: KvGroup) -> None:
    """Name every 1-element word the group needs (allocated later in one block per dtype)."""
    g = group.name
    for what, fill in (("write_index", 0), ("status", 0), ("chain_assert", 0), ("plan.num_valid", 0),
                       ("plan.enable", 1), ("plan.status", 0), ("write.num_valid", 0), ("sweep.num_valid", 0),
                       ("sweep.enable", 1), ("sweep.status", 0), ("window.num_valid", 0)):
        scalars.reserve(f"{g}.{what}", np.int32, fill)
    scalars.reserve(f"{g}.lost", np.int64, 0)
    scalars.reserve(f"{g}.drain_temp", np.int64, 0)
    for what in ("window.cursor", "window.live", "window.temp", "window.flag"):
        scalars.reserve(f"{g}.{what}", np.int64, 0)
    for role, kv in _endpoint_keys(group):
        tag = _tag(role, kv, group)
        for op in ("verify", "write") if role != "SWEEP" else ("verify",):
            for what in ("slots", "kernels"):
                scalars.reserve(_counter_key(g, tag, op, what), np.int64, 0)


def _endpoint_keys(group: KvGroup) -> list[tuple[str, str]]:
    kvs = ("K", "V") if group.v_sources is not None else ("K",)
    roles = ROLES if group.has_head else ("TAIL", "SWEEP")  # plan_of: HEAD records are the leader's
    return [(role, kv) for role in roles for kv in kvs]


def _tag(role: str, kv: str, group: KvGroup) -> CanaryLaunchTag:
    return CanaryLaunchTag[f"{role}_{kv}_{group.regime}"]


def _counter_key(group_name: str, tag: CanaryLaunchTag, op: str, what: str) -> str:
    return f"{group_name}:{tag.name}.{op}.{what}"


def counter_name(group: GroupState | KvGroup, ep: Endpoint, op: str, what: str) -> str:
    """Scalar name of one of ``ep``'s run counters: ``op`` verify/write, ``what`` slots/kernels."""
    return _counter_key(group.name, ep.tag, op, what)


def build_group(group: KvGroup, space: ArraySpace, scalars: Scalars, *, ring_capacity: int, verify_capacity: int,
                max_batch_size: int, sweep_capacity: int, max_tokens: int, mode: RealKvHashMode,
                window: int = 0, leader: GroupState | None = None) -> GroupState:
    """Allocate the group's buffers and plans; launches are bound later (:func:`bind_group`). ``leader``: the
    state of the group named by ``group.plan_of``, whose forward plans (and window) this group reads."""
    g = group.name

    def alloc(shape: Any, dtype: Any, fill: int = 0, *, name: str) -> Any:
        return space.alloc(shape, dtype, fill, name=name)

    ring_owner, ring_view = alloc((ring_capacity, VIOLATION_FIELDS), np.int64, name="CanaryConfig.ring_capacity")
    _, scratch = alloc((ring_capacity, VIOLATION_FIELDS), np.int64, name="CanaryConfig.ring_capacity")
    ring = VerifyOrWriteContext(
        canary_buf=None, kernel_kind=0, violation_ring=ring_owner,
        violation_write_index=scalars.owner(f"{g}.write_index"), slot_run_counter=None, kernel_run_counter=None,
        enable_chain_position_assert=scalars.owner(f"{g}.chain_assert"), status=scalars.owner(f"{g}.status"))
    buffers: dict[tuple[str, str], Any] = {}
    endpoints: dict[str, list[Endpoint]] = {role: [] for role in ROLES}
    for role, kv in _endpoint_keys(group):
        tag = _tag(role, kv, group)
        buf_role = "HEAD" if role == "HEAD" else "TAIL"
        if (buf_role, kv) not in buffers:
            buffers[(buf_role, kv)] = alloc((group.num_slots, CANARY_SLOT_BYTES), np.uint8,
                                            name=f"KvGroup {g!r} num_slots")[0]
        sources = () if role == "HEAD" else (group.k_sources if kv == "K" else group.v_sources or ())
        hash_mode = RealKvHashMode.NONE if role == "HEAD" else mode

        def ctx(op: str, tag: CanaryLaunchTag = tag, kv: str = kv, sources: Any = sources,
                hash_mode: RealKvHashMode = hash_mode, buf_role: str = buf_role) -> VerifyOrWriteContext:
            return ring.for_endpoint(
                canary_buf=buffers[(buf_role, kv)], kernel_kind=int(tag), real_kv_sources=tuple(sources),
                real_kv_hash_mode=hash_mode, slot_run_counter=scalars.owner(_counter_key(g, tag, op, "slots")),
                kernel_run_counter=scalars.owner(_counter_key(g, tag, op, "kernels")))

        endpoints[role].append(Endpoint(role, kv, tag, ctx("verify"), None if role == "SWEEP" else ctx("write")))

    def verify_plan(capacity: int, prefix: str, sized_by: str,
                    flags: str | None = None) -> tuple[VerifyPlan, dict[str, Any]]:
        views: dict[str, Any] = {}
        owners: dict[str, Any] = {}
        for name in VERIFY_ENTRY_FIELDS:
            owners[name], views[name] = alloc(capacity, np.int64, -1 if name == "verify_expected_tokens" else 0,
                                              name=sized_by)
        flags = flags or prefix  # the window shares the forward plan's enable and status words
        plan = VerifyPlan(**owners, verify_num_valid=scalars.owner(f"{g}.{prefix}.num_valid"),
                          enable=scalars.owner(f"{g}.{flags}.enable"), status=scalars.owner(f"{g}.{flags}.status"))
        views["verify_num_valid"] = scalars.view(f"{g}.{prefix}.num_valid")
        views["enable"] = scalars.view(f"{g}.{flags}.enable")
        return plan, views

    sweep_plan, sweep_views = verify_plan(sweep_capacity, "sweep", "Capacities.max_sweep_slots")
    if leader is not None:
        state = GroupState(spec=group, ring=ring, verify_plan=leader.verify_plan, write_plan=leader.write_plan,
                           sweep_plan=sweep_plan, endpoints=endpoints, ring_view=ring_view, ring_scratch=scratch,
                           sweep_views=sweep_views, plan_views=leader.plan_views, leader=leader,
                           window_plan=leader.window_plan, window_views=leader.window_views,
                           window_scratch=leader.window_scratch)
        window = 0  # the leader's window plan, moved by the leader's select_window
    else:
        vp, plan_views = verify_plan(verify_capacity, "plan", "Capacities.verify_capacity")
        rows = "Capacities.max_batch_size"
        write_plan = WritePlan(write_offsets=alloc(max_batch_size + 1, np.int64, name=rows)[0],
                               write_seed_slot_indices=alloc(max_batch_size, np.int64, name=rows)[0],
                               write_num_valid_reqs=scalars.owner(f"{g}.write.num_valid"),
                               verify_offsets=alloc(max_batch_size + 1, np.int64, name=rows)[0])
        state = GroupState(spec=group, ring=ring, verify_plan=vp, write_plan=write_plan, sweep_plan=sweep_plan,
                           endpoints=endpoints, ring_view=ring_view, ring_scratch=scratch, sweep_views=sweep_views,
                           plan_views=plan_views)
    if window:
        sized_by = "CanaryConfig.max_verify_entries_per_step"
        state.window_plan, state.window_views = verify_plan(window, "window", sized_by, flags="plan")
        arange = alloc(window, np.int64, name=sized_by)[1]
        with space.scope():
            space.upload(arange, np.arange(window, dtype=np.int64))
        state.window_scratch = {
            "arange": arange, "index": alloc(window, np.int64, name=sized_by)[1],
            "cursor": scalars.view(f"{g}.window.cursor"),
            "live": scalars.view(f"{g}.window.live"), "temp": scalars.view(f"{g}.window.temp"),
            "flag": scalars.view(f"{g}.window.flag")}
    if group.is_swa:
        state.lut_view = as_array(group.full_to_swa_index_mapping, f"KvGroup {g!r}.full_to_swa_index_mapping")
        state.swa_out_cache_loc = Buffer(*alloc(max_tokens, np.int64, -1, name="Capacities.max_tokens"))
        scratch_len = max(max_tokens, sweep_capacity)
        sized_by = "Capacities.max_tokens" if max_tokens >= sweep_capacity else "Capacities.max_sweep_slots"
        state.temp = alloc(scratch_len, np.int64, name=sized_by)[1]
        state.mask = alloc(scratch_len, np.bool_, name=sized_by)[1]
    return state


def bind_group(state: GroupState, stage: StagedBatch, *, layout: tuple[str, Any], expected_pool: Any,
               check_tokens: bool, backend: str) -> None:
    """Bind the group's plan, HEAD/TAIL verify and write, and SWEEP verify launches (validates everything)."""
    if state.leader is None:
        state.plan = _bind_forward_plan(state, stage, layout=layout, expected_pool=expected_pool,
                                        check_tokens=check_tokens, backend=backend)
    loc = state.swa_out_cache_loc.owner if state.swa_out_cache_loc is not None else stage.owner("out_cache_loc")
    oracle = stage.with_oracle
    for ep in state.all_endpoints():
        if ep.role == "SWEEP":
            ep.verify = bind_verify(context=ep.verify_ctx, plan=state.sweep_plan, check_verify_expected_token=False,
                                    backend=backend, on_invalid="flag")
            continue
        plan = state.window_plan if state.window_plan is not None else state.verify_plan
        # HEAD V holds the same records as HEAD K (no real-KV fingerprints): where the words are the same, HEAD
        # K's verify, which runs just before, gave the verdict, so HEAD V checks only the records that differ.
        twin = state.endpoints["HEAD"][0].verify_ctx.canary_buf if ep.role == "HEAD" and ep.kv == "V" else None
        ep.verify = bind_verify(context=ep.verify_ctx, plan=plan, check_verify_expected_token=check_tokens,
                                twin_canary_buf=twin, backend=backend, on_invalid="flag")
        assert ep.write_ctx is not None
        ep.write = bind_write(
            context=ep.write_ctx, plan=state.write_plan, input_ids=stage.owner("input_ids"),
            positions=stage.owner("positions"), out_cache_loc=loc, enable_write_input_assert=oracle,
            expected_input_tokens=stage.owner("expected_input_ids") if oracle else None,
            expected_input_positions=stage.owner("expected_positions") if oracle else None,
            backend=backend, on_invalid="flag")


def _bind_forward_plan(state: GroupState, stage: StagedBatch, *, layout: tuple[str, Any], expected_pool: Any,
                       check_tokens: bool, backend: str) -> BoundLaunch:
    spec = state.spec
    return bind_plan(
        verify_plan_out=state.verify_plan, write_plan_out=state.write_plan,
        req_pool_indices=None if row_less(layout[1]) else stage.owner("req_pool_indices"),
        prefix_lens=stage.owner("prefix_lens"),
        extend_seq_lens=stage.owner("extend_seq_lens"), **{layout[0]: layout[1]},
        swa_window_size=spec.swa_window, full_to_swa_index_mapping=spec.full_to_swa_index_mapping,
        verify_capacity=int(state.verify_plan.verify_slot_indices.shape[0]),
        req_to_verify_expected_tokens=expected_pool if check_tokens else None,
        req_to_verify_expected_tokens_valid_lens=stage.owner("valid_lens") if check_tokens else None,
        kv_token_id_vs_position_offset=spec.kv_token_id_vs_position_offset, backend=backend, on_invalid="flag")


def gather_lut(state: GroupState, xp: Any, src: Any, dst: Any) -> None:
    """``dst = lut[src]`` for the group's LUT, in place with preallocated scratch: negative entries pass
    through, entries outside the LUT become ``num_slots`` (outside the canary, so the kernels flag them)."""
    n = int(src.shape[0])
    lut = state.lut_view
    temp, mask = state.temp[:n], state.mask[:n]
    xp.clip(src, 0, int(lut.shape[0]) - 1, out=temp)
    xp.take(lut, temp, out=dst)
    xp.less(src, 0, out=mask)
    xp.copyto(dst, src, where=mask)
    xp.greater_equal(src, int(lut.shape[0]), out=mask)
    xp.copyto(dst, xp.int64(state.spec.num_slots), where=mask)


def gather_staged_slots(state: GroupState, xp: Any, staged: Any, tokens: int) -> None:
    """The group's ``swa_out_cache_loc``: :func:`gather_lut` of the staged write slots (``staged``, padded with -1
    past the step's ``tokens``), over the entries this step or the one before staged only: past them both buffers
    hold the padding's -1 already (the staged buffer is padded back behind a shorter step, and -1 gathers to
    -1), so the gather's cost follows the step, not the capacity."""
    assert state.swa_out_cache_loc is not None
    m = max(tokens, state.swa_gathered)
    gather_lut(state, xp, staged[:m], state.swa_out_cache_loc.view[:m])
    state.swa_gathered = tokens


def select_window(state: GroupState, xp: Any) -> None:
    """The bounded verify's entries of this step: the next ``N`` entries of the forward plan's verify list from
    the group's cursor (fewer at the end of the list), copied into the window plan; then the cursor moves ``N``
    on, back to 0 once it has passed the last live entry. Device operations only (no host read, capture-safe):
    a cursor beyond a list that shrank starts again at 0. An overflowed plan (enable 0) leaves the window
    disabled too (it shares the plan's enable word)."""
    plan, win, sc = state.plan_views, state.window_views, state.window_scratch
    capacity = int(plan["verify_slot_indices"].shape[0])
    n = int(win["verify_slot_indices"].shape[0])
    cursor, live, temp, flag, index = sc["cursor"], sc["live"], sc["temp"], sc["flag"], sc["index"]
    xp.copyto(live, plan["verify_num_valid"], casting="unsafe")
    xp.clip(live, 0, capacity, out=live)
    xp.less(cursor, live, out=flag)
    xp.multiply(cursor, flag, out=cursor)  # a list that shrank below the cursor: start again
    xp.add(sc["arange"], cursor, out=index)
    xp.minimum(index, capacity - 1, out=index)  # entries past the window's count are never read
    for name in VERIFY_ENTRY_FIELDS:
        xp.take(plan[name], index, out=win[name])
    xp.subtract(live, cursor, out=temp)
    xp.clip(temp, 0, n, out=temp)
    xp.copyto(win["verify_num_valid"], temp, casting="unsafe")
    cursor += n
    xp.less(cursor, live, out=flag)
    xp.multiply(cursor, flag, out=cursor)
