"""What the runtime does past its capacities and across groups, against the scalar protocol oracle: a sweep of
more slots than ``Capacities.max_sweep_slots`` and a ``copy_slots`` of more slots than ``max_tokens`` run in
chunks that together cover every slot exactly once; ``StepReport.new_violations`` lists the HEAD rows of every
group, then the TAIL rows of every group (the order the launches ran)."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import runtime_scenario as sc
from runtime_oracle import ROLES_TAGS
from test_runtime import BACKENDS, LOGGER, canary_records, drive, oracle_for

from kvcanary_cupy import CanaryArgumentError, CanaryLaunchTag, CanaryStatus, FailReason
from kvcanary_cupy.runtime import CanaryConfig, CanaryRuntime, Capacities


def make_capped(engine: sc.ToyEngine, backend: str, **caps) -> CanaryRuntime:
    return CanaryRuntime.create(CanaryConfig(backend=backend, logger=LOGGER), engine.pools(),
                                Capacities(max_batch_size=sc.MAX_BS, max_tokens=sc.MAX_TOKENS, **caps),
                                sweep_source=engine.held)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cap", [1, 4, 8])
def test_a_sweep_larger_than_its_capacity_verifies_every_held_slot_once(backend, cap):
    """The prefix cache holds 4 + 5 = 9 slots after the scripted run; with a capacity of 1, 4 or 8 the sweep
    runs in 9, 3 or 2 chunks. Every held slot gets a flipped K bit, so each must be reported exactly once (a
    chunk that skips or repeats a slot changes the multiset of reported slots)."""
    engine = sc.ToyEngine()
    rt = make_capped(engine, backend, max_sweep_slots=cap)
    drive(engine, rt)
    held, positions, _ = engine.held()
    assert held.shape[0] == 9 > cap
    for slot in held.tolist():
        engine.flip_kv_bit("FULL", slot)
    assert rt.sweep() == 9
    report = rt.flush()
    rows = [(g, v.launch_tag, v.slot, v.position, v.reason_bits) for g, v in report.new_violations]
    want = [("FULL", CanaryLaunchTag.SWEEP_K_FULL.name, s, p, int(FailReason.VERIFY_REAL_KV_HASH_MISMATCH))
            for s, p in zip(held.tolist(), positions.tolist(), strict=True)]
    assert sorted(rows) == sorted(want)
    assert rt.stats()["swept_slots"] == 9 and report.status_bits == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_sweep_in_chunks_finds_only_the_corrupted_slot_wherever_it_falls(backend):
    """One corrupted slot at each index of the sweep's list in turn (first, chunk edges, last), capacity 4."""
    engine = sc.ToyEngine()
    rt = make_capped(engine, backend, max_sweep_slots=4)
    drive(engine, rt)
    held = engine.held()[0].tolist()
    for i in (0, 3, 4, 7, 8):
        engine.flip_kv_bit("FULL", held[i])
        rt.sweep()
        report = rt.flush()
        engine.flip_kv_bit("FULL", held[i])  # flipped back: the next round starts clean
        assert [v.slot for _, v in report.new_violations] == [held[i]], i


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_copy_of_more_slots_than_max_tokens_carries_every_record(backend):
    """copy_slots of 21 slots with max_tokens 16 (chunks of 16 and 5), SWA through its LUT, K and V: every
    HEAD and TAIL buffer of every group equals the scalar oracle's after the same copy."""
    engine = sc.ToyEngine(swa=True, with_v=True)
    rt = make_capped(engine, backend)
    oracle = oracle_for(engine, rt)
    drive(engine, rt, oracle)
    src = list(range(1, 22))  # the 24 slots the schedule wrote are 1..24
    dst = list(range(sc.NUM_SLOTS - 22, sc.NUM_SLOTS - 1))
    for d in dst:
        engine.lut[d] = d  # SWA slots of the copies: unused by the schedule
    assert len(src) == len(dst) > sc.MAX_TOKENS
    engine.copy_kv(src, dst)
    rt.copy_slots(np.array(src), np.array(dst))
    oracle.copy_slots(src, dst)
    checked = 0
    for name, got, want in canary_records(rt, oracle):
        assert np.array_equal(got, want), name
        full = name.startswith("FULL")
        written = [d if full else int(engine.lut[d]) for d in dst]
        checked += int(np.count_nonzero(want[written].any(axis=1)))
    assert checked > 2 * len(dst)  # the copies carry real records, not zeros on both sides
    assert rt.flush().status_bits == 0


def test_new_violations_list_the_head_rows_of_every_group_before_the_tail_rows():
    """A misrouted req_to_token entry at a position both groups verify (the SWA window covers it) gives HEAD
    and TAIL rows in FULL and SWA in one step; the report lists HEAD of FULL, HEAD of SWA, TAIL of FULL, TAIL
    of SWA (launch order), each part in ring order, exactly as the scalar oracle produced them."""
    engine = sc.ToyEngine(swa=True)
    rt = make_capped(engine, "numpy")
    oracle = oracle_for(engine, rt)

    def misroute(batch):
        engine.req_to_token[1, 8] = engine.slots[4][0]  # request 1 (10 tokens) at step 5: SWA verifies 7..9

    reports = drive(engine, rt, oracle, hooks={(4, "after_step"): misroute})
    got = [(g, tuple(v.raw)) for rep in reports if rep.launch_step == 5 for g, v in rep.new_violations]
    role = {tag: r for kinds in ROLES_TAGS.values() for r, tags in kinds.items() for tag in tags.values()}
    parts = {(r, g): [(g, tuple(row)) for row in oracle.step_rows(g, 5) if role[row[0]] == r]
             for r in ("HEAD", "TAIL") for g in ("FULL", "SWA")}
    assert all(parts.values()), {k: len(v) for k, v in parts.items()}
    want = parts["HEAD", "FULL"] + parts["HEAD", "SWA"] + parts["TAIL", "FULL"] + parts["TAIL", "SWA"]
    assert got == want


# -- edges of the sweep and copy paths (survivors of the mutation run, docs/mutation.md) ---------------------

def test_a_sweep_with_no_source_or_an_empty_cache_verifies_nothing():
    engine = sc.ToyEngine()
    no_source = CanaryRuntime.create(CanaryConfig(logger=LOGGER), engine.pools(),
                                     Capacities(max_batch_size=sc.MAX_BS, max_tokens=sc.MAX_TOKENS))
    assert no_source.sweep() == 0 and no_source.stats()["sweeps"] == 0
    rt = make_capped(engine, "numpy")
    assert engine.held()[0].shape[0] == 0
    assert rt.sweep() == 0 and rt.stats()["sweeps"] == 0 and rt.stats()["swept_slots"] == 0


@pytest.mark.parametrize(("answer", "message"), [
    ([1, 2], "sweep_source must return (slots, positions, prev_slots), got list"),
    ("abc", "sweep_source must return (slots, positions, prev_slots), got str"),
    ((np.array([1.5]), np.array([0]), np.array([-1])), "sweep_source's slots must be a 1-D integer host array"),
    ((np.array([1]), np.array([[0]]), np.array([-1])), "sweep_source's positions must be a 1-D integer host array"),
    ((np.array([1]), np.array([0]), np.array([True])), "sweep_source's prev_slots must be a 1-D integer host array"),
], ids=["list", "str", "float-slots", "2d-positions", "bool-prevs"])  # plain ids: mutmut selects tests by id
def test_a_refused_sweep_answer_names_what_is_wrong(answer, message):
    engine = sc.ToyEngine()
    rt = CanaryRuntime.create(CanaryConfig(logger=LOGGER), engine.pools(),
                              Capacities(max_batch_size=sc.MAX_BS, max_tokens=sc.MAX_TOKENS),
                              sweep_source=lambda: answer)
    with pytest.raises(CanaryArgumentError) as info:
        rt.sweep()
    assert str(info.value).startswith(f"kv-canary: {message}"), str(info.value)


def test_a_refused_sweep_answer_offers_the_per_model_form_only_when_the_answer_was_not_one():
    """The whole message, to its end: a plain answer that is no triple is told about the per-model dict; an
    answer that is a dict, about the model whose entries are no triple, and nothing else."""
    engine = sc.ToyEngine()
    answers = {"plain": None, "per model": {"target": 7}}
    rt = CanaryRuntime.create(CanaryConfig(logger=LOGGER), engine.pools(),
                              Capacities(max_batch_size=sc.MAX_BS, max_tokens=sc.MAX_TOKENS),
                              sweep_source=lambda: answers[which])
    for which, message in [
        ("plain", "sweep_source must return (slots, positions, prev_slots), got NoneType (or a dict: model name -> "
                  "(slots, positions, prev_slots))"),
        ("per model", "sweep_source must return (slots, positions, prev_slots) of model 'target', got int"),
    ]:
        with pytest.raises(CanaryArgumentError) as info:
            rt.sweep()
        assert str(info.value) == "kv-canary: " + message, which


def test_copy_slots_refusals_name_the_rule_and_copy_slots_refuses_capture(monkeypatch):
    engine = sc.ToyEngine()
    rt = make_capped(engine, "numpy")
    for src, dst, message in [([1, 2], [40, 40], "dst must name distinct slots (two copies into one slot)"),
                              ([1, 2], [2, 40], "src and dst must be disjoint (a slot both copied and overwritten)")]:
        with pytest.raises(CanaryArgumentError) as info:
            rt.copy_slots(src, dst)
        assert str(info.value) == f"kv-canary: {message}"
    monkeypatch.setattr(rt.space, "capturing", lambda: True)
    with pytest.raises(CanaryArgumentError) as info:
        rt.copy_slots([1], [40])
    assert str(info.value).startswith("kv-canary: copy_slots() runs outside CUDA-graph capture")


def test_a_copy_from_beyond_the_canary_is_skipped_and_reported_as_a_status_bit():
    """A source slot outside the buffer: its destination gets a zero record and the group's status word says
    SLOT_OUT_OF_RANGE (the gather's own bounds check, not only the scatter's)."""
    engine = sc.ToyEngine()
    rt = make_capped(engine, "numpy")
    drive(engine, rt, steps=2)
    head = np.asarray(rt.groups["FULL"].endpoints["HEAD"][0].verify_ctx.canary_buf)
    head[40] = 7  # stale bytes the zero record must replace
    rt.copy_slots([1, sc.NUM_SLOTS + 3], [40, 41])
    assert rt.flush().status_bits == int(CanaryStatus.SLOT_OUT_OF_RANGE)
    assert np.array_equal(head[40], head[1]) and not head[41, :32].any()


def test_copies_and_sweeps_are_timed_under_their_own_phase():
    engine = sc.ToyEngine()
    phases: list[str] = []

    @contextlib.contextmanager
    def timer(phase):
        phases.append(phase)
        yield

    rt = CanaryRuntime.create(CanaryConfig(logger=LOGGER), engine.pools(),
                              Capacities(max_batch_size=sc.MAX_BS, max_tokens=sc.MAX_TOKENS),
                              sweep_source=engine.held, timer=timer)
    drive(engine, rt)
    phases.clear()
    rt.copy_slots([1], [40])
    assert phases == ["copy"]
    phases.clear()
    rt.sweep()
    assert phases[0] == "sweep" and set(phases) == {"sweep"}


def test_new_violations_list_each_model_in_turn_and_the_sweep_last():
    """One step whose target and draft launches both find the misrouted entry and whose sweep finds a flipped
    cached slot: target HEAD, target TAIL, draft HEAD, draft TAIL, then the sweep's rows."""
    engine = sc.ToyEngine(draft=True)
    rt = CanaryRuntime.create(CanaryConfig(logger=LOGGER, sweep_interval=1), engine.pools(),
                              Capacities(max_batch_size=sc.MAX_BS, max_tokens=sc.MAX_TOKENS),
                              sweep_source=engine.held)
    oracle = oracle_for(engine, rt)

    def corrupt(batch):
        engine.req_to_token[1, 8] = engine.slots[4][0]
        engine.flip_kv_bit("FULL", engine.cached[1][2])  # request 3's slots, held by the prefix cache only

    reports = drive(engine, rt, oracle, hooks={(4, "after_step"): corrupt})
    got = [(g, tuple(v.raw)) for rep in reports if rep.launch_step == 5 for g, v in rep.new_violations]
    role = {tag: r for r, tags in ROLES_TAGS["FULL"].items() for tag in tags.values()}
    parts = {(g, r): [(g, tuple(row)) for row in oracle.step_rows(g, 5) if role[row[0]] == r]
             for g in ("FULL", "DRAFT") for r in ("HEAD", "TAIL", "SWEEP")}
    for key in [("FULL", "HEAD"), ("FULL", "TAIL"), ("DRAFT", "HEAD"), ("DRAFT", "TAIL"), ("FULL", "SWEEP")]:
        assert parts[key], key
    want = (parts["FULL", "HEAD"] + parts["FULL", "TAIL"] + parts["DRAFT", "HEAD"] + parts["DRAFT", "TAIL"]
            + parts["FULL", "SWEEP"] + parts["DRAFT", "SWEEP"])
    assert got == want


def test_sweep_launches_are_announced_to_the_observer_as_verifies_of_the_sweep_endpoints():
    engine = sc.ToyEngine(with_v=True)
    events = []
    rt = CanaryRuntime.create(CanaryConfig(logger=LOGGER), engine.pools(),
                              Capacities(max_batch_size=sc.MAX_BS, max_tokens=sc.MAX_TOKENS),
                              sweep_source=engine.held, observer=events.append)
    drive(engine, rt)
    events.clear()
    rt.sweep()
    state = rt.groups["FULL"]
    want = [(when, "verify", "target", state, ep) for ep in state.endpoints["SWEEP"] for when in ("before", "after")]
    assert [(e.when, e.kind, e.model, e.group, e.endpoint) for e in events] == want
    assert [ep.tag.name for ep in state.endpoints["SWEEP"]] == ["SWEEP_K_FULL", "SWEEP_V_FULL"]


def test_the_observer_sees_both_head_verifies_before_either_head_write_and_each_tail_verify_before_its_write():
    """The launch order of a step with K and V (docs/contract.md, "Twin buffers"): the plan; HEAD K and HEAD V
    verify, then HEAD K and HEAD V write; then per TAIL endpoint its verify and its write. Every event names
    the launch, the model, the group, the endpoint and the staged batch."""
    engine = sc.ToyEngine(with_v=True)
    events = []
    rt = CanaryRuntime.create(CanaryConfig(logger=LOGGER), engine.pools(),
                              Capacities(max_batch_size=sc.MAX_BS, max_tokens=sc.MAX_TOKENS), observer=events.append)
    drive(engine, rt, steps=1)
    events.clear()
    batch = engine.schedule(1)
    rt.prepare(engine.step_batch(batch))
    rt.pre_forward()
    engine.forward(batch, "FULL")
    rt.post_forward()
    got = [(e.kind, e.endpoint.tag.name if e.endpoint else None) for e in events if e.when == "before"]
    assert got == [("plan", None), ("verify", "HEAD_K_FULL"), ("verify", "HEAD_V_FULL"), ("write", "HEAD_K_FULL"),
                   ("write", "HEAD_V_FULL"), ("verify", "TAIL_K_FULL"), ("write", "TAIL_K_FULL"),
                   ("verify", "TAIL_V_FULL"), ("write", "TAIL_V_FULL")]
    assert [(e.when, e.kind, e.endpoint) for e in events][-2:] == [("before", "write", events[-1].endpoint),
                                                                   ("after", "write", events[-1].endpoint)]
    state, stage = rt.groups["FULL"], rt.stages["target"]
    assert all(e.model == "target" and e.group is state and e.stage is stage for e in events)
    assert len(events) == 2 * len(got)
