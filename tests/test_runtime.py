"""The engine runtime (kvcanary_cupy.runtime) on CPU backends: every ring row of the four-phase protocol
against the scalar protocol oracle, one-step-late log and raise, status bits, off mode, capacity errors that
leave every buffer untouched, the health check, the sweep, warm-up and stats."""

from __future__ import annotations

import itertools
import logging
import re

import numpy as np
import pytest
import runtime_scenario as sc
from runtime_oracle import OracleGroup, ProtocolOracle

import kvcanary_cupy.bind as bind_module
from kvcanary_cupy import CanaryArgumentError, CanaryLaunchTag, CanaryStatus, FailReason, RealKvSource
from kvcanary_cupy.backends import unavailable_reason
from kvcanary_cupy.layouts import BlockTable
from kvcanary_cupy.runtime import (
    CanaryConfig,
    CanaryHealthError,
    CanaryRuntime,
    CanaryViolationError,
    Capacities,
    KvPools,
    StepBatch,
)
from kvcanary_cupy.runtime.space import ArraySpace

BACKENDS = ["numpy", pytest.param("host", marks=pytest.mark.skipif(unavailable_reason("host") is not None,
                                                                   reason=str(unavailable_reason("host"))))]
LOGGER = "kvcanary_cupy.runtime.test"


def make(engine: sc.ToyEngine, backend: str = "numpy", **config) -> CanaryRuntime:
    config.setdefault("logger", LOGGER)
    return CanaryRuntime.create(CanaryConfig(backend=backend, **config), engine.pools(),
                                Capacities(max_batch_size=sc.MAX_BS, max_tokens=sc.MAX_TOKENS),
                                sweep_source=engine.held)


def oracle_for(engine: sc.ToyEngine, rt: CanaryRuntime) -> ProtocolOracle:
    groups = []
    for g in engine.groups():
        kvs = ("K", "V") if g.v_sources is not None else ("K",)
        sources = {kv: [(engine.kv[g.name][kv].reshape(sc.NUM_SLOTS // sc.PAGE, -1), sc.PAGE, sc.TOKEN_BYTES,
                         sc.TOKEN_BYTES)] for kv in kvs}
        groups.append(OracleGroup(g.name, g.num_slots, kvs, sources, window=g.swa_window,
                                  lut=engine.lut if g.is_swa else None, offset=g.kv_token_id_vs_position_offset,
                                  model=g.model))
    cfg = rt.config
    return ProtocolOracle(groups, mode=int(cfg.real_kv_hash_mode), check_tokens=cfg.verify_token_assert,
                          write_assert=cfg.write_input_assert, req_to_token=engine.req_to_token,
                          pool_shape=engine.req_to_token.shape)


def as_dict(batch: StepBatch) -> dict[str, np.ndarray]:
    return {k: v for k, v in vars(batch).items() if v is not None}


def drive(engine, rt, oracle=None, *, steps=None, hooks=None, skip=(), init_after=0, tell_written=True):
    """Run the protocol for ``steps`` steps (plus a flush); ``hooks[(step, phase)](batch)`` injects faults,
    ``skip`` names (step, phase) pairs the engine forgets. ``hooks[(step, "written")](batch)`` returns the
    slots the target's forward really writes that step, which ``post_forward(out_cache_loc=...)`` hands over
    when ``tell_written``. Returns the StepReports."""
    hooks = hooks or {}
    steps = len(sc.SCHEDULE) if steps is None else steps
    cfg = rt.config
    reports = []
    for t in range(steps):
        if t == init_after:
            rt.mark_init_finished()
            if oracle is not None:
                oracle.chain_assert = 1
        batch = engine.schedule(t)
        sb = engine.step_batch(batch, oracle=cfg.write_input_assert, tokens=cfg.verify_token_assert)
        if (t, "batch") in hooks:
            hooks[(t, "batch")](sb)
        rt.prepare(sb)
        if (t, "pre") not in skip:
            rt.pre_forward()
        written = hooks[(t, "written")](batch) if (t, "written") in hooks else None
        wrote = batch if written is None else {**batch, "out_cache_loc": written}
        engine.forward(wrote, "FULL", ids=sb.input_ids)
        if engine.swa:
            engine.forward(wrote, "SWA", ids=sb.input_ids)
        if (t, "after_forward") in hooks:
            hooks[(t, "after_forward")](batch)
        told = written if tell_written else None
        if (t, "post") not in skip:
            rt.post_forward(out_cache_loc=told)
        if oracle is not None:
            oracle.prepare(as_dict(sb))
            oracle.pre_forward(t)
            oracle.post_forward(t, out_cache_loc=told)
        if engine.draft:
            db = engine.step_batch(batch, oracle=cfg.write_input_assert, tokens=cfg.verify_token_assert, draft=True)
            rt.prepare(db, model="draft")
            rt.pre_forward(model="draft")
            engine.forward(batch, "DRAFT", ids=db.input_ids)
            rt.post_forward(model="draft")
            if oracle is not None:
                oracle.prepare(as_dict(db), "draft")
                oracle.pre_forward(t, "draft")
                oracle.post_forward(t, "draft")
        engine.finish_step(t)
        if (t, "after_step") in hooks:
            hooks[(t, "after_step")](batch)
        if oracle is not None and cfg.sweep_interval and t % cfg.sweep_interval == 0:
            oracle.sweep(t, engine.held())
        reports.append(rt.finish_step())
    reports.append(rt.flush())
    return reports


def rows_by_launch(reports) -> dict[tuple[str, int], list[tuple[int, ...]]]:
    out: dict[tuple[str, int], list[tuple[int, ...]]] = {}
    for rep in reports:
        for group, v in rep.new_violations:
            out.setdefault((group, rep.launch_step), []).append(tuple(v.raw))
    return out


def wrong_token(step: int, index: int = 0):
    def hook(sb: StepBatch) -> None:
        sb.input_ids = sb.input_ids.copy()
        sb.input_ids[index] += 5
    return {(step, "batch"): hook}


def faults(engine: sc.ToyEngine) -> dict:
    """A wrong input token, a KV bit flip on a live slot, a bit flip on a slot only the prefix cache holds, a
    req_to_token entry pointing at another request's slot."""
    hooks = dict(wrong_token(3, index=1))
    hooks[(2, "after_forward")] = lambda batch: engine.flip_kv_bit("FULL", engine.slots[1][2])
    hooks[(1, "after_step")] = lambda batch: engine.flip_kv_bit("FULL", engine.cached[0][1])

    def misroute(batch):
        engine.req_to_token[3, 1] = engine.slots[1][0]
    hooks[(4, "after_step")] = misroute
    return hooks


CONFIGS = {
    "full": dict(engine=dict(), config=dict()),
    "swa-draft-v-tokens": dict(engine=dict(swa=True, draft=True, with_v=True),
                               config=dict(write_input_assert=True, verify_token_assert=True, sweep_interval=2)),
    "swa-partial": dict(engine=dict(swa=True), config=dict(real_kv_hash_mode="partial", sweep_interval=1)),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("inject", [False, True], ids=["clean", "faults"])
def test_every_ring_row_matches_the_scalar_protocol_oracle(backend, name, inject):
    engine = sc.ToyEngine(**CONFIGS[name]["engine"])
    rt = make(engine, backend, **CONFIGS[name]["config"])
    oracle = oracle_for(engine, rt)
    reports = drive(engine, rt, oracle, hooks=faults(engine) if inject else None)
    got = rows_by_launch(reports)
    want = {k: sorted(tuple(r) for r in v) for k, v in oracle.rows.items() if v}
    assert {k: sorted(v) for k, v in got.items()} == want
    if inject:
        assert sum(map(len, want.values())) >= 4
    else:
        assert not want
    for rep in reports:
        assert rep.launch_step == rep.step - 1
        assert rep.health_problems == [] and rep.status_bits == 0 and not rep.plan_status and not rep.overflowed


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_block_table_layout_gives_the_rows_of_the_token_table_it_describes(backend):
    engine = sc.ToyEngine(swa=True, paged=True)
    pools = KvPools(engine.groups(), layout=BlockTable(engine.block_table, sc.PAGE, num_slots=sc.NUM_SLOTS))
    rt = CanaryRuntime.create(CanaryConfig(backend=backend, sweep_interval=2, logger=LOGGER), pools,
                              Capacities(max_batch_size=sc.MAX_BS, max_tokens=sc.MAX_TOKENS), sweep_source=engine.held)
    oracle = oracle_for(engine, rt)  # the oracle plans from req_to_token, which the engine keeps in step
    reports = drive(engine, rt, oracle, hooks=faults(engine))
    want = {k: sorted(tuple(r) for r in v) for k, v in oracle.rows.items() if v}
    assert {k: sorted(v) for k, v in rows_by_launch(reports).items()} == want and want
    assert not any(r.health_problems or r.status_bits or r.plan_status for r in reports)


@pytest.mark.parametrize("backend", BACKENDS)
def test_raise_mode_raises_one_step_after_the_launch_with_the_decoded_rows(backend):
    engine = sc.ToyEngine(swa=True)
    rt = make(engine, backend, mode="raise", write_input_assert=True)
    oracle = oracle_for(engine, rt)
    with pytest.raises(CanaryViolationError) as info:
        drive(engine, rt, oracle, hooks=wrong_token(3))
    err = info.value
    assert isinstance(err, RuntimeError)
    assert (err.step_report.step, err.step_report.launch_step) == (4, 3)
    assert rt.step == 5  # finish_step(4) did its bookkeeping before raising
    want = sorted(tuple(r) for g in ("FULL", "SWA") for r in oracle.step_rows(g, 3))
    assert sorted(tuple(v.raw) for _, v in err.violations) == want
    assert err.report is not None and err.report.rows
    bits = {v.reason_bits for v in err.report.rows}
    assert bits == {int(FailReason.WRITE_TOKEN_MISMATCH)}
    assert "kv-canary violation" in str(err)


def test_log_mode_logs_one_line_per_step_and_group_and_a_summary_per_step(caplog):
    engine = sc.ToyEngine()
    rt = make(engine, write_input_assert=True)
    oracle = oracle_for(engine, rt)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        reports = drive(engine, rt, oracle, hooks=faults(engine))
    records = [r for r in caplog.records if r.name == LOGGER]
    lines = [r for r in records if " violation row(s) (" in r.getMessage()]
    summaries = [r for r in records if "new violation(s)" in r.getMessage()]
    # one line per step and group with rows, in the order the rows were read
    want = [(rep.launch_step, g) for rep in reports for g in dict.fromkeys(g for g, _ in rep.new_violations)]
    assert [(r.kv_canary["step"], r.kv_canary["group"]) for r in lines] == want
    rows = {(rep.launch_step, g): [v for gg, v in rep.new_violations if gg == g] for rep in reports
            for g, _ in rep.new_violations}
    assert sum(len(v) for v in rows.values()) == sum(len(v) for v in oracle.rows.values()) > 0
    for r in lines:
        got = rows[(r.kv_canary["step"], r.kv_canary["group"])]
        assert r.levelno == logging.WARNING and r.kv_canary["rows"] == len(got)
        shown = got[:5]
        assert [(f["slot"], f["position"], f["reasons"]) for f in r.kv_canary["first_rows"]] == [
            (v.slot, v.position, v.labels) for v in shown]
        assert r.kv_canary["unlogged_rows"] == len(got) - len(shown)
        for v in shown:
            assert f"slot={v.slot} position={v.position} [{','.join(v.labels)}]" in r.getMessage()
    steps_with_rows = sorted({rep.launch_step for rep in reports if rep.new_violations})
    assert [int(r.getMessage().split("step ")[1].split(":")[0]) for r in summaries] == steps_with_rows


@pytest.mark.parametrize("mode", ["log", "raise"])
def test_status_bits_are_reported_like_violations(mode, caplog):
    engine = sc.ToyEngine()
    rt = make(engine, mode=mode)

    def outside(sb):
        sb.out_cache_loc = sb.out_cache_loc.copy()
        sb.out_cache_loc[0] = sc.NUM_SLOTS + 7  # beyond the canary: the write kernel skips and flags it
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        if mode == "raise":
            with pytest.raises(CanaryViolationError) as info:
                drive(engine, rt, hooks={(2, "batch"): outside})
            rep = info.value.step_report
            assert rep.launch_step == 2 and info.value.report.status == int(CanaryStatus.SLOT_OUT_OF_RANGE)
        else:
            reports = drive(engine, rt, hooks={(2, "batch"): outside})
            flagged = [r for r in reports if r.status_bits]
            assert [r.launch_step for r in flagged] == [2]
            assert any("SLOT_OUT_OF_RANGE" in r.getMessage() for r in caplog.records)


def test_off_mode_allocates_and_launches_nothing(monkeypatch):
    calls = []
    monkeypatch.setattr(bind_module.BoundLaunch, "__call__", lambda self: calls.append(self.step))
    monkeypatch.setattr(bind_module.BoundLaunch, "run_checked", lambda self: calls.append(self.step))
    engine = sc.ToyEngine(swa=True)
    rt = make(engine, mode="off", sweep_interval=1)
    reports = drive(engine, rt)
    assert calls == [] and rt.groups == {} and rt.stages == {}
    assert all(r.clean for r in reports) and rt.stats()["forwards"] == {"target": 0}
    engine = sc.ToyEngine(swa=True)
    drive(engine, make(engine, sweep_interval=1), steps=1)
    assert calls  # the same loop in log mode does launch


def runtime_arrays(rt: CanaryRuntime) -> dict[str, np.ndarray]:
    """A copy of every array the runtime owns."""
    out = {f"scalars{i}": np.array(v, copy=True) for i, v in enumerate(rt.scalars._views)}
    for name, g in rt.groups.items():
        out[f"{name}.ring"] = g.ring_view.copy()
        for ep in g.all_endpoints():
            out[f"{name}.{ep.tag.name}.canary"] = np.array(ep.verify_ctx.canary_buf, copy=True)
        for plan_name, plan in (("plan", g.verify_plan), ("write", g.write_plan), ("sweep", g.sweep_plan)):
            for field, value in vars(plan).items():
                out[f"{name}.{plan_name}.{field}"] = np.array(value, copy=True)
        if g.swa_out_cache_loc is not None:
            out[f"{name}.swa_loc"] = g.swa_out_cache_loc.view.copy()
    for model, stage in rt.stages.items():
        for field, buf in stage.buffers.items():
            out[f"{model}.{field}"] = buf.view.copy()
    if rt.expected_token_pool is not None:
        out["pool"] = np.array(rt.expected_token_pool, copy=True)
    return out


def _too_many_rows(engine, sb):
    n = sc.MAX_BS + 1
    return StepBatch(np.zeros(n, np.int64), np.zeros(n, np.int64), np.zeros(n, np.int64), sb.input_ids,
                     sb.positions, sb.out_cache_loc, sb.expected_input_ids, sb.expected_positions,
                     np.zeros(n, np.int64), sb.history_ids, sb.history_offsets, sb.history_req_pool_indices)


BAD_BATCHES = {
    "rows": (_too_many_rows, "Capacities.max_batch_size"),
    "tokens": (lambda e, sb: StepBatch(sb.req_pool_indices, sb.prefix_lens, sb.extend_seq_lens,
                                       *(np.zeros(sc.MAX_TOKENS + 1, np.int64) for _ in range(5)), sb.valid_lens,
                                       sb.history_ids, sb.history_offsets, sb.history_req_pool_indices),
               "Capacities.max_tokens"),
    "dtype": (lambda e, sb: StepBatch(**{**vars(sb), "positions": sb.positions.astype(np.int32)}),
              "batch.positions must have dtype int64"),
    "oracle": (lambda e, sb: StepBatch(**{**vars(sb), "expected_positions": None}), "write_input_assert"),
    "history": (lambda e, sb: StepBatch(**{**vars(sb), "history_offsets": sb.history_offsets[:-1]}),
                "batch.history_offsets"),
    "lengths": (lambda e, sb: StepBatch(**{**vars(sb), "out_cache_loc": sb.out_cache_loc[:-1]}),
                "batch.out_cache_loc has"),
}


@pytest.mark.parametrize("case", list(BAD_BATCHES))
def test_a_batch_that_breaks_a_capacity_raises_before_anything_is_written(case):
    engine = sc.ToyEngine(swa=True)
    rt = make(engine, write_input_assert=True, verify_token_assert=True)
    drive(engine, rt, steps=2)
    before = runtime_arrays(rt)
    forwards = dict(rt.forwards)
    build, message = BAD_BATCHES[case]
    sb = engine.step_batch(engine.schedule(2), oracle=True, tokens=True)
    with pytest.raises(CanaryArgumentError, match=re.escape(message)) as info:
        rt.prepare(build(engine, sb))
    assert str(info.value).startswith("kv-canary: ")
    after = runtime_arrays(rt)
    assert before.keys() == after.keys()
    assert all(np.array_equal(before[k], after[k]) for k in before), [k for k in before
                                                                       if not np.array_equal(before[k], after[k])]
    assert rt.forwards == forwards


@pytest.mark.parametrize("mode", ["log", "raise"])
def test_a_skipped_launch_fails_the_health_check_once(mode, caplog):
    engine = sc.ToyEngine(swa=True)
    rt = make(engine, mode=mode)
    if mode == "raise":
        with pytest.raises(CanaryHealthError) as info:
            drive(engine, rt, skip={(2, "post")})
        assert info.value.step_report.launch_step == 2
        assert any("TAIL_K_FULL verify" in p for p in info.value.problems)
        return
    with caplog.at_level(logging.ERROR, logger=LOGGER):
        reports = drive(engine, rt, skip={(2, "post")})
    failing = [r for r in reports if r.health_problems]
    assert [r.launch_step for r in failing] == [2]
    problems = failing[0].health_problems
    # both groups' TAIL verify and write kernels fell one launch behind
    for tag in ("TAIL_K_FULL", "TAIL_K_SWA"):
        assert any(tag in p and "verify kernel" in p for p in problems)
        assert any(tag in p and "write kernel" in p for p in problems)
    assert len([r for r in caplog.records if r.levelno == logging.ERROR]) == len(problems)
    assert rt.stats()["health_failures"] == len(problems)


def test_check_health_passes_on_a_complete_step_and_fails_on_a_half_one():
    engine = sc.ToyEngine()
    rt = make(engine)
    drive(engine, rt, steps=2)
    assert rt.check_health() == []
    rt.prepare(engine.step_batch(engine.schedule(2)))
    rt.pre_forward()
    problems = rt.check_health()
    assert problems and all("TAIL" in p for p in problems)


def test_the_snapshot_events_are_created_once_and_the_pending_one_is_never_recorded_over(monkeypatch):
    """On CUDA each snapshot records an event that the next step waits on; the CPU space has none, so stand-in
    events pin what a GPU run does with them: two created with the runtime, none in a step, and a snapshot never
    re-records the event of the snapshot still waiting to be read."""
    created: list[_StandInEvent] = []

    def event(space):
        created.append(_StandInEvent(lambda: rt._pending))
        return created[-1]

    monkeypatch.setattr(ArraySpace, "event", event)
    engine = sc.ToyEngine()
    rt = make(engine)
    assert len(created) == 2
    # a health check mid-step snapshots while step 0's snapshot is still pending
    drive(engine, rt, steps=4, hooks={(1, "after_step"): lambda batch: rt.check_health()})
    assert len(created) == 2
    # 4 finish_step snapshots, the health check's and the flush's; each event used in turn
    assert sum(e.records for e in created) == 6 and min(e.records for e in created) >= 2
    # every consume of a pending snapshot: finish_step of steps 1-3 and the flush's two reads
    assert sum(e.waits for e in created) == 5


class _StandInEvent:
    """Counts records and waits; recording it while the pending snapshot still holds it would lose that step."""

    def __init__(self, pending) -> None:
        self.pending, self.records, self.waits = pending, 0, 0

    def record(self) -> None:
        snap = self.pending()
        assert snap is None or snap.event is not self, "re-recorded the event of the snapshot still to be read"
        self.records += 1

    def synchronize(self) -> None:
        assert self.records, "waited on an event never recorded"
        self.waits += 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_sweep_finds_a_corruption_only_the_prefix_cache_holds(backend):
    def flip(engine):
        # request 2 finished at step 1: its slots are held by the prefix cache alone
        return {(2, "after_step"): lambda batch: engine.flip_kv_bit("FULL", engine.cached[0][1])}

    quiet = sc.ToyEngine()
    assert not rows_by_launch(drive(quiet, make(quiet, backend), hooks=flip(quiet)))
    engine = sc.ToyEngine()
    rt = make(engine, backend, sweep_interval=2)
    reports = drive(engine, rt, hooks=flip(engine))
    got = rows_by_launch(reports)
    slot = engine.cached[0][1]
    assert set(got) == {("FULL", 2), ("FULL", 4)}  # the sweeps of steps 2 and 4
    for rows in got.values():
        assert [(r[0], r[1], r[7]) for r in rows] == [(int(CanaryLaunchTag.SWEEP_K_FULL), slot,
                                                        int(FailReason.VERIFY_REAL_KV_HASH_MISMATCH))]
    # step 0 found an empty cache; step 2 swept request 2's 4 slots, step 4 those and request 3's 5
    assert rt.stats()["sweeps"] == 2 and rt.stats()["swept_slots"] == 4 + (4 + 5)


@pytest.mark.parametrize("call", ["prepare", "finish_step", "flush", "check_health", "sweep", "run_counters"])
def test_the_outside_graph_calls_refuse_to_run_under_capture(call, monkeypatch):
    engine = sc.ToyEngine()
    rt = make(engine, sweep_interval=1)
    batch = engine.step_batch(engine.schedule(0))
    monkeypatch.setattr(rt.space, "capturing", lambda: True)  # what torch reports during a capture
    args = (batch,) if call == "prepare" else ()
    with pytest.raises(CanaryArgumentError, match=re.escape(f"{call}() runs outside CUDA-graph capture")):
        getattr(rt, call)(*args)
    assert rt.step == 0 and rt.forwards == {"target": 0}


@pytest.mark.parametrize(("answer", "message"), [
    (None, "must return (slots, positions, prev_slots)"),
    ((np.array([1, 2]),) * 2, "must return (slots, positions, prev_slots)"),
    ((np.array([1.7]), np.array([0]), np.array([-1])), "slots must be a 1-D integer host array"),
    ((np.array([1]), np.array([[0]]), np.array([-1])), "positions must be a 1-D integer host array"),
    ((np.array([1, 2]), np.array([0, 1]), np.array([-1])), "2 slots but 2 positions and 1 prev slots"),
])
def test_a_sweep_source_answer_that_names_no_slots_is_refused_before_any_launch(answer, message):
    engine = sc.ToyEngine()
    rt = CanaryRuntime.create(CanaryConfig(sweep_interval=1, logger=LOGGER), engine.pools(),
                              Capacities(max_batch_size=sc.MAX_BS, max_tokens=sc.MAX_TOKENS),
                              sweep_source=lambda: answer)
    with pytest.raises(CanaryArgumentError, match=re.escape(message)):
        rt.sweep()
    assert rt.stats()["sweeps"] == 0


def test_the_chain_position_assert_waits_for_mark_init_finished():
    def shift(step):
        def hook(sb):
            sb.positions = sb.positions.copy()
            sb.positions[0] += 1  # row 1's decode token claims the position after its true one
        return {(step, "batch"): hook}

    def write_position_rows(init_after):
        engine = sc.ToyEngine()
        rt = make(engine)
        oracle = oracle_for(engine, rt)
        reports = drive(engine, rt, oracle, hooks=shift(2), init_after=init_after)
        assert {k: sorted(v) for k, v in rows_by_launch(reports).items()} == {
            k: sorted(map(tuple, v)) for k, v in oracle.rows.items() if v}
        return [v for r in reports if r.launch_step == 2 for _, v in r.new_violations
                if v.reason_bits & int(FailReason.WRITE_POSITION_MISMATCH)]

    assert write_position_rows(init_after=99) == []
    assert {v.launch_tag for v in write_position_rows(init_after=0)} == {"HEAD_K_FULL", "TAIL_K_FULL"}


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_full_ring_counts_what_it_dropped_and_later_rows_read_correctly(backend):
    engine = sc.ToyEngine()
    rt = CanaryRuntime.create(CanaryConfig(backend=backend, ring_capacity=2, write_input_assert=True,
                                           logger=LOGGER), engine.pools(),
                              Capacities(max_batch_size=sc.MAX_BS, max_tokens=sc.MAX_TOKENS))
    oracle = oracle_for(engine, rt)

    def wrong(*indices):
        def hook(sb):
            sb.input_ids = sb.input_ids.copy()
            sb.input_ids[list(indices)] += 5
        return hook
    # step 1: two wrong tokens -> four write-assert rows (HEAD and TAIL) for a ring of two; step 3: one
    reports = drive(engine, rt, oracle, hooks={(1, "batch"): wrong(0, 1), (3, "batch"): wrong(1)})
    by_step = {r.launch_step: r for r in reports}
    want1 = [tuple(r) for r in oracle.step_rows("FULL", 1)]
    got1 = [tuple(v.raw) for _, v in by_step[1].new_violations]
    assert len(want1) == 4 and len(got1) == 2 and set(got1) <= set(want1)
    assert by_step[1].dropped == 2 and by_step[1].reports["FULL"].total == 4
    want3 = sorted(tuple(r) for r in oracle.step_rows("FULL", 3))
    assert len(want3) == 2 and sorted(tuple(v.raw) for _, v in by_step[3].new_violations) == want3
    assert by_step[3].dropped == 0
    assert rt.stats()["dropped"] == 2 and rt.stats()["violations"] == 4


def test_stats_count_protected_tokens_and_are_logged_every_n_steps(caplog):
    engine = sc.ToyEngine(swa=True)
    rt = make(engine, stats_interval=2, sweep_interval=3)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        drive(engine, rt)
    stats = rt.stats()
    tokens = sum(n for step in sc.SCHEDULE for _, n in step)
    assert stats["protected_tokens"] == 2 * tokens  # FULL and SWA HEAD K writes
    assert stats["forwards"] == {"target": len(sc.SCHEDULE)} and stats["steps"] == len(sc.SCHEDULE)
    assert stats["violations"] == 0 and stats["sweeps"] == 1 and stats["health_failures"] == 0
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO and r.name == LOGGER]
    assert len(lines) == len(sc.SCHEDULE) // 2
    assert all(line.startswith("kv-canary: protected ") and line.endswith(" sweep passes, 0 violations")
               for line in lines)


def test_creation_validates_the_description():
    engine = sc.ToyEngine()
    with pytest.raises(CanaryArgumentError, match=re.escape("CanaryConfig.mode")):
        CanaryConfig(mode="loud")
    for not_a_mode in (True, 1.5, "most"):
        with pytest.raises(CanaryArgumentError, match=re.escape("CanaryConfig.real_kv_hash_mode")):
            CanaryConfig(real_kv_hash_mode=not_a_mode)
    with pytest.raises(CanaryArgumentError, match=re.escape("Capacities.max_tokens")):
        Capacities(max_batch_size=1, max_tokens=0)
    with pytest.raises(CanaryArgumentError, match="req_to_token or layout"):
        type(engine.pools())(engine.groups())
    pools = engine.pools()
    with pytest.raises(CanaryArgumentError, match="model must be one of target"):
        make(engine).prepare(engine.step_batch(engine.schedule(0)), model="draft")
    with pytest.raises(CanaryArgumentError, match="needs a sweep_source"):
        CanaryRuntime.create(CanaryConfig(sweep_interval=4), pools, Capacities(max_batch_size=2, max_tokens=2))
    with pytest.raises(CanaryArgumentError, match="covers"):
        CanaryRuntime.create(CanaryConfig(), type(pools)(
            (type(pools.groups[0])("FULL", sc.NUM_SLOTS * 2, pools.groups[0].k_sources),),
            req_to_token=engine.req_to_token), Capacities(max_batch_size=2, max_tokens=2))


def lost_and_misdirected_writes(engine: sc.ToyEngine, step: int = 2) -> tuple[dict, dict[str, int]]:
    """At ``step`` row 3's prefill (tokens 2..5) loses the write of token 3 and sends token 4 to a slot nobody
    scheduled. Returns the hooks and, once the step ran, the scheduled slots of tokens 3, 4 and 5 and the stray
    one."""
    stray = sc.NUM_SLOTS - 2
    seen: dict[str, int] = {}

    def written(batch):
        loc = batch["out_cache_loc"].copy()
        seen.update(lost=int(loc[3]), moved=int(loc[4]), next=int(loc[5]), stray=stray)
        loc[3], loc[4] = -1, stray
        engine.lut[stray] = stray  # an SWA slot no request holds
        return loc
    return {(step, "written"): written}, seen


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["full", "swa-draft-v-tokens"])
def test_the_tail_write_stamps_the_slots_the_forward_says_it_wrote(backend, name):
    """post_forward(out_cache_loc=...): the TAIL records follow the forward's real writes, so a lost and a
    misdirected write are found by the next TAIL verify of their scheduled slots; told nothing, the runtime
    fingerprints the untouched scheduled slots and the next verify agrees with them."""
    found = {}
    for tell in (True, False):
        engine = sc.ToyEngine(**CONFIGS[name]["engine"])
        rt = make(engine, backend, **CONFIGS[name]["config"])
        oracle = oracle_for(engine, rt)
        hooks, seen = lost_and_misdirected_writes(engine)
        reports = drive(engine, rt, oracle, hooks=hooks, tell_written=tell)
        want = {k: sorted(tuple(r) for r in v) for k, v in oracle.rows.items() if v}
        assert {k: sorted(v) for k, v in rows_by_launch(reports).items()} == want
        found[tell] = [(r.launch_step, v) for r in reports for g, v in r.new_violations
                       if g == "FULL" and v.launch_tag.startswith("TAIL_")]
        health = {r.launch_step: r.health_problems for r in reports if r.health_problems}
        if tell:  # one TAIL write stamped one slot fewer than HEAD_K's: reported once, for that step
            assert list(health) == [2]
            assert health[2] and all("TAIL_" in p and "write slot count vs HEAD_K" in p for p in health[2])
        else:
            assert health == {}
    assert found[False] == []
    # row 3's next step verifies its prefix: the lost and the moved token's slots hold no TAIL record, and the
    # token after them was chained (by the TAIL write) onto the stray slot's record
    assert {step for step, _ in found[True]} == {3}
    assert {v.slot for _, v in found[True]} == {seen["lost"], seen["moved"], seen["next"]}


def test_written_slots_that_do_not_fit_the_staged_batch_are_refused_before_anything_is_written(monkeypatch):
    engine = sc.ToyEngine(swa=True)
    rt = make(engine)
    drive(engine, rt, steps=2)
    sb = engine.step_batch(engine.schedule(2))
    rt.prepare(sb)
    rt.pre_forward()
    before = runtime_arrays(rt)
    loc = sb.out_cache_loc
    bad = [(loc[:-1], "out_cache_loc has 5 entries but this step's prepare() staged 6 tokens for model 'target'"),
           (loc.astype(np.int32), "out_cache_loc must have dtype int64"),
           (loc.reshape(2, 3), "out_cache_loc must be 1-D")]
    for arr, message in bad:
        with pytest.raises(CanaryArgumentError, match=re.escape(message)) as info:
            rt.post_forward(out_cache_loc=arr)
        assert str(info.value).startswith("kv-canary: ")
    monkeypatch.setattr(rt.space, "capturing", lambda: True)
    with pytest.raises(CanaryArgumentError, match=re.escape("post_forward(out_cache_loc=...) runs outside")):
        rt.post_forward(out_cache_loc=loc)
    after = runtime_arrays(rt)
    assert [k for k in before if not np.array_equal(before[k], after[k])] == []


def canary_records(rt: CanaryRuntime, oracle: ProtocolOracle) -> list[tuple[str, np.ndarray, np.ndarray]]:
    """(buffer, runtime records, oracle records) for every HEAD and TAIL buffer, as uint64 [num_slots, 4]."""
    out = []
    for g in oracle.groups:
        state = rt.groups[g.name]
        for ep in state.endpoints["HEAD"] + state.endpoints["TAIL"]:
            kv = ep.kv
            fields = (g.head if ep.role == "HEAD" else g.tail)[kv].fields
            want = np.array([[x & (2**64 - 1) for x in f] for f in fields], np.uint64)
            got = np.asarray(ep.verify_ctx.canary_buf).view(np.uint64)[:, :4]
            out.append((f"{g.name}.{ep.tag.name}", got, want))
    return out


@pytest.mark.parametrize("backend", BACKENDS)
def test_copied_slots_carry_their_records_and_verify_like_their_source(backend):
    """copy_slots after the engine copied KV (a fork): every HEAD and TAIL buffer of every group equals the
    oracle's with the same copy (SWA through the LUT); the sweep then verifies the copies clean, and finds
    them when only the KV was copied."""
    def fork(copy_records):
        engine = sc.ToyEngine(swa=True, with_v=True)
        rt = make(engine, backend)
        oracle = oracle_for(engine, rt)
        drive(engine, rt, oracle)
        src = engine.cached[0]  # request 2's four slots, held by the prefix cache
        dst = [sc.NUM_SLOTS - 8 + i for i in range(len(src))]
        for i, d in enumerate(dst):
            engine.lut[d] = sc.NUM_SLOTS - 8 + i
        engine.copy_kv(src, dst)
        if copy_records:
            rt.copy_slots(np.array(src), np.array(dst))
            oracle.copy_slots(src, dst)
        engine.cached.append(dst)
        return rt, oracle, dst

    rt, oracle, dst = fork(copy_records=True)
    for name, got, want in canary_records(rt, oracle):
        assert np.array_equal(got, want), name
    assert rt.sweep() == 4 + 5 + 4
    report = rt.flush()
    assert report.new_violations == [] and report.status_bits == 0

    rt, _, dst = fork(copy_records=False)
    rt.sweep()
    report = rt.flush()
    assert {v.slot for g, v in report.new_violations if g == "FULL"} == set(dst)


def test_copy_slots_refuses_what_names_no_copy_before_anything_is_written():
    engine = sc.ToyEngine(swa=True)
    rt = make(engine)
    drive(engine, rt, steps=2)
    before = runtime_arrays(rt)
    for src, dst, message in [([1, 2], [40], "src has 2 slots but dst has 1"),
                              ([1, 2], [40, 40], "dst must name distinct slots"),
                              ([1, 2], [2, 40], "src and dst must be disjoint"),
                              (np.array([1.0]), [40], "src must be a 1-D integer host array"),
                              ([1], [[40]], "dst must be a 1-D integer host array")]:
        with pytest.raises(CanaryArgumentError, match=re.escape(message)):
            rt.copy_slots(src, dst)
    with pytest.raises(CanaryArgumentError, match="model must be one of target"):
        rt.copy_slots([1], [40], model="draft")
    after = runtime_arrays(rt)
    assert [k for k in before if not np.array_equal(before[k], after[k])] == []


def test_a_copy_beyond_the_canary_is_skipped_and_reported_as_a_status_bit():
    engine = sc.ToyEngine()
    rt = make(engine)
    drive(engine, rt, steps=2)
    rt.copy_slots([1, 2], [40, sc.NUM_SLOTS + 3])
    report = rt.flush()
    assert report.status_bits == int(CanaryStatus.SLOT_OUT_OF_RANGE)
    state = rt.groups["FULL"]
    head = np.asarray(state.endpoints["HEAD"][0].verify_ctx.canary_buf)
    assert np.array_equal(head[40], head[1])  # the in-range pair was copied


def test_the_chain_position_assert_can_be_switched_on_per_group():
    engine = sc.ToyEngine(swa=True)
    rt = make(engine)
    rt.mark_init_finished(groups=["FULL"])
    flags = {name: int(rt.scalars.view(f"{name}.chain_assert")[0]) for name in rt.groups}
    assert flags == {"FULL": 1, "SWA": 0} and rt.stats()["init_finished"]
    for bad, message in [("FULL", "groups must be a list of group names"),
                         (["FULL", "DRAFT"], "groups must name groups of this runtime (FULL, SWA), got ['DRAFT']")]:
        with pytest.raises(CanaryArgumentError, match=re.escape(message)):
            rt.mark_init_finished(groups=bad)
    assert int(rt.scalars.view("SWA.chain_assert")[0]) == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_kv_tensor_moved_after_some_steps_refuses_the_tail_phase_with_nothing_written(backend):
    """The storage checks of a phase are worked out once per set of launches; a torch KV tensor that moves
    after the runtime has run steps with it must still stop the next TAIL phase (the one that reads the KV)
    before any of its launches."""
    torch = pytest.importorskip("torch")
    engine = sc.ToyEngine()
    tensors = {(g, kv): torch.from_numpy(engine.kv[g][kv]) for g in engine.kv for kv in ("K", "V")}

    def torch_sources(group: str, kv: str) -> tuple[RealKvSource, ...]:
        return (RealKvSource(tensors[(group, kv)], page_size=sc.PAGE, num_bytes_per_token=sc.TOKEN_BYTES,
                             read_bytes=sc.TOKEN_BYTES),)

    engine.sources = torch_sources
    rt = make(engine, backend, real_kv_hash_mode="all")
    drive(engine, rt, steps=3)  # every phase has run, and run clean, on the tensors as bound
    assert not rt.flush().new_violations
    batch = engine.schedule(3)
    rt.prepare(engine.step_batch(batch, oracle=False, tokens=False))
    rt.pre_forward()
    engine.forward(batch, "FULL")
    moved = tensors[("FULL", "K")]
    moved.set_(torch.zeros_like(moved))  # the engine re-allocated its K cache
    before = runtime_arrays(rt)
    with pytest.raises(CanaryArgumentError, match="storage moved or shrank") as info:
        rt.post_forward()
    assert str(info.value).startswith("kv-canary: ") and "sources[0]" in str(info.value)
    after = runtime_arrays(rt)
    assert [k for k in before if not np.array_equal(before[k], after[k])] == []


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_swa_groups_write_slots_are_the_lut_gather_of_the_whole_staged_buffer_after_every_call(backend):
    """prepare and post_forward gather through the LUT only the entries this step or the one before staged (the
    rest of both buffers is padding): after a long step, shorter ones and a forward that wrote elsewhere, the SWA
    group's write slots still equal the LUT gather of the whole staged buffer, computed here independently."""
    engine = sc.ToyEngine(swa=True)
    rt = make(engine, backend)
    state, stage = rt.groups["SWA"], rt.stages["target"]
    staged: list[int] = []

    def checked(call):
        def run(*args, **kwargs):
            call(*args, **kwargs)
            src = np.asarray(stage.view("out_cache_loc"))
            lut = np.asarray(state.lut_view)
            want = np.where(src < 0, src, np.where(src >= lut.size, sc.NUM_SLOTS, lut[np.clip(src, 0, lut.size - 1)]))
            assert np.array_equal(np.asarray(state.swa_out_cache_loc.view), want)
            staged.append(stage.staged_tokens("out_cache_loc"))
        return run

    rt.prepare, rt.post_forward = checked(rt.prepare), checked(rt.post_forward)
    drive(engine, rt, hooks={(2, "written"): lambda batch: np.asarray(batch["out_cache_loc"])[::-1].copy()})
    assert len(staged) == 2 * len(sc.SCHEDULE) and any(b < a for a, b in itertools.pairwise(staged))
