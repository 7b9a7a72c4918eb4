"""The runtime's reading side by exact counts: ``stats()`` and ``run_counters()`` after the toy engine's scripted
run, worked out from its schedule (every prefix token verified once per verify endpoint and step, every new
token written once per write endpoint); a full ring whose later rows are lost twice, counted as dropped each
time; rows of consecutive steps read with nothing counted as dropped; ``check_health`` leaving the status
words for the next report and adding to the failure count."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import runtime_scenario as sc
from test_runtime import BACKENDS, LOGGER, drive, make, oracle_for

from kvcanary_cupy import CanaryStatus
from kvcanary_cupy.runtime import CanaryConfig, CanaryRuntime, Capacities

ENDPOINTS = ("HEAD_K_FULL", "HEAD_V_FULL", "TAIL_K_FULL", "TAIL_V_FULL")


def _schedule_totals() -> tuple[int, int, int]:
    """(prefix tokens, new tokens, forwards) of the scripted schedule, from a fresh engine's batches."""
    engine = sc.ToyEngine()
    prefix = new = 0
    for t in range(len(sc.SCHEDULE)):
        batch = engine.schedule(t)
        prefix += int(batch["prefix_lens"].sum())
        new += int(batch["extend_seq_lens"].sum())
        engine.finish_step(t)  # finished rows leave; a row that comes back starts a new request at position 0
    return prefix, new, len(sc.SCHEDULE)


def test_stats_and_run_counters_count_every_verified_and_written_token_exactly():
    prefix, new, forwards = _schedule_totals()
    assert (prefix, new, forwards) == (44, 24, 6)  # by hand: prefixes 0, 8, 6, 11, 8, 11; new 8, 2, 6, 2, 4, 2
    engine = sc.ToyEngine(with_v=True)
    rt = make(engine)
    fresh = rt.stats()
    assert fresh["protected_tokens"] == 0 and fresh["verified_entries"] == 0  # nothing read yet
    drive(engine, rt)
    stats = rt.stats()
    assert set(stats) == {"mode", "steps", "forwards", "protected_tokens", "verified_entries", "sweeps",
                          "swept_slots", "violations", "violations_by_group", "dropped", "status_bits", "overflows",
                          "health_failures", "init_finished", "verify_entries_per_step", "verify_live_max",
                          "verify_growth_max", "verify_bound_steps", "verify_bound_steps_growing"}
    assert stats["mode"] == "log" and stats["steps"] == forwards and stats["forwards"] == {"target": forwards}
    assert stats["protected_tokens"] == new  # HEAD K's writes only, not HEAD V's nor TAIL's
    assert stats["verified_entries"] == 4 * prefix  # HEAD K, HEAD V, TAIL K, TAIL V
    assert (stats["violations"], stats["violations_by_group"], stats["dropped"], stats["status_bits"],
            stats["overflows"], stats["health_failures"]) == (0, {}, 0, 0, {}, 0)
    counters = rt.run_counters()
    want = {("FULL", tag, op): ((prefix if op == "verify" else new), forwards)
            for tag in ENDPOINTS for op in ("verify", "write")}
    want.update({("FULL", "SWEEP_K_FULL", "verify"): (0, 0), ("FULL", "SWEEP_V_FULL", "verify"): (0, 0)})
    assert counters == want
    rt.sweep()  # the prefix cache holds 4 + 5 slots: one SWEEP launch per K and V
    assert rt.run_counters()[("FULL", "SWEEP_V_FULL", "verify")] == (9, 1)


def _wrong(*indices):
    def hook(sb):
        sb.input_ids = sb.input_ids.copy()
        sb.input_ids[list(indices)] += 5
    return {"batch": hook}


@pytest.mark.parametrize("backend", BACKENDS)
def test_rows_lost_behind_a_full_ring_are_counted_as_dropped_each_time_it_fills(backend):
    """A ring of 2 rows, the write-input assert giving two rows (HEAD and TAIL) per wrong token: step 1 has two
    wrong tokens (4 rows: 2 kept, 2 dropped), and step 2's one (2 rows) arrives while the ring still holds step 1's
    rows, so both are lost; steps 4 and 5 do the same again. Each report counts its own losses; the totals add up."""
    engine = sc.ToyEngine()
    rt = CanaryRuntime.create(CanaryConfig(backend=backend, ring_capacity=2, write_input_assert=True,
                                           logger=LOGGER), engine.pools(),
                              Capacities(max_batch_size=sc.MAX_BS, max_tokens=sc.MAX_TOKENS))
    oracle = oracle_for(engine, rt)
    hooks = {(1, "batch"): _wrong(0, 1)["batch"], (2, "batch"): _wrong(1)["batch"],
             (4, "batch"): _wrong(0, 2)["batch"], (5, "batch"): _wrong(0)["batch"]}
    reports = drive(engine, rt, oracle, hooks=hooks)
    by_step = {r.launch_step: r for r in reports}
    for step, total in ((1, 4), (4, 4)):
        want = {tuple(r) for r in oracle.step_rows("FULL", step)}
        got = [tuple(v.raw) for _, v in by_step[step].new_violations]
        assert len(want) == total and len(got) == 2 and set(got) <= want, step
        assert by_step[step].dropped == 2 and by_step[step].reports["FULL"].total == total, step
    for step in (2, 5):
        assert len(oracle.step_rows("FULL", step)) == 2
        assert by_step[step].new_violations == [] and by_step[step].dropped == 2, step
    assert by_step[3].clean
    assert rt.stats()["dropped"] == 8 and rt.stats()["violations"] == 4


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("ring", [4, 16])
def test_rows_of_consecutive_steps_are_all_read_and_none_counted_as_dropped(backend, ring):
    """Wrong tokens at steps 1, 2 and 3 (2 rows each; a ring of 4 holds two steps' rows): the rows one step
    appends while the previous step's are still in the ring stay there for the next report; nothing is dropped."""
    engine = sc.ToyEngine()
    rt = CanaryRuntime.create(CanaryConfig(backend=backend, ring_capacity=ring, write_input_assert=True,
                                           logger=LOGGER), engine.pools(),
                              Capacities(max_batch_size=sc.MAX_BS, max_tokens=sc.MAX_TOKENS))
    oracle = oracle_for(engine, rt)
    hooks = {(t, "batch"): _wrong(1)["batch"] for t in (1, 2, 3)}
    reports = drive(engine, rt, oracle, hooks=hooks)
    by_step = {r.launch_step: r for r in reports}
    for step in (1, 2, 3):
        want = sorted(tuple(r) for r in oracle.step_rows("FULL", step))
        assert len(want) == 2 and sorted(tuple(v.raw) for _, v in by_step[step].new_violations) == want, step
    assert all(r.dropped == 0 for r in reports)
    assert rt.stats()["dropped"] == 0 and rt.stats()["violations"] == 6
    assert rt.stats()["violations_by_group"] == {"FULL": 6}  # added up over the three reads


def test_check_health_leaves_the_status_words_for_the_next_report():
    engine = sc.ToyEngine()
    rt = make(engine)
    drive(engine, rt, steps=2)
    rt.copy_slots([1], [sc.NUM_SLOTS + 3])  # sets SLOT_OUT_OF_RANGE in FULL's status word
    assert rt.check_health() == []
    assert rt.flush().status_bits == int(CanaryStatus.SLOT_OUT_OF_RANGE)


def test_check_health_adds_its_problems_to_the_failures_counted_so_far():
    engine = sc.ToyEngine()
    rt = make(engine)
    drive(engine, rt, steps=3, skip={(1, "post")})  # step 1's TAIL launches skipped: found by finish_step
    earlier = rt.stats()["health_failures"]
    assert earlier > 0
    batch = engine.step_batch(engine.schedule(3))
    rt.prepare(batch)
    rt.pre_forward()  # no post_forward: the TAIL counters fall one behind again
    problems = rt.check_health()
    assert problems and rt.stats()["health_failures"] == earlier + len(problems)
    assert all(isinstance(p, str) for p in problems) and np.all([p.startswith("group FULL: ") for p in problems])


@pytest.mark.parametrize(("n", "tail"), [
    (0, ""),  # the full verify states no bound
    # the toy run: at most 11 live entries, at most 8 new tokens in one forward (step 0's prefills)
    (10, "; bounded verify of 10 entries/step/group: every live slot verified within 2 steps (11 live entries), "
         "within 12 while 8 entries are added per step"),  # ceil(11 / 10); 2 * ceil(11 / (10 - 8))
    (2, "; bounded verify of 2 entries/step/group: every live slot verified within 6 steps (11 live entries), "
        "no bound while 8 entries are added per step"),  # ceil(11 / 2); N <= G
])
def test_the_stats_line_states_the_counts_and_the_bound_in_words(n, tail):
    engine = sc.ToyEngine()
    rt = make(engine, max_verify_entries_per_step=n)
    drive(engine, rt)
    assert rt.stats_line() == "kv-canary: protected 24 tokens, 0 sweep passes, 0 violations" + tail
    bound = rt.verify_bound()
    assert bound == {"verify_entries_per_step": n, "verify_live_max": 11 if n else 0,
                     "verify_growth_max": 8 if n else 0, "verify_bound_steps": {0: 1, 10: 2, 2: 6}[n],
                     "verify_bound_steps_growing": {0: 1, 10: 12, 2: -1}[n]}


@pytest.mark.parametrize("backend", BACKENDS)
def test_each_groups_report_carries_its_ring_capacity_and_run_counters_and_drops_add_up_over_groups(backend):
    """FULL and SWA, a ring of 2, step 3 with two wrong tokens: each group's write-assert rows (HEAD and TAIL per
    token: 4) overflow its ring by 2, so the step drops 4 in all. Each group's report carries the ring's capacity
    and its HEAD K verify counters as of that step: the prefixes of steps 0 to 3 (0 + 8 + 6 + 11 for FULL; SWA
    verifies only the last 3 positions of a prefix: 0 + 6 + 3 + 6), in 4 launches."""
    engine = sc.ToyEngine(swa=True)
    rt = CanaryRuntime.create(CanaryConfig(backend=backend, ring_capacity=2, write_input_assert=True,
                                           logger=LOGGER), engine.pools(),
                              Capacities(max_batch_size=sc.MAX_BS, max_tokens=sc.MAX_TOKENS))
    reports = drive(engine, rt, hooks={(3, "batch"): _wrong(0, 1)["batch"]})
    step3 = next(r for r in reports if r.launch_step == 3)
    assert step3.dropped == 4 and rt.stats()["dropped"] == 4
    for name, verified in (("FULL", 25), ("SWA", 15)):
        rep = step3.reports[name]
        assert (rep.total, rep.capacity, len(rep.rows)) == (4, 2, 2), name
        assert (rep.slot_run_counter, rep.kernel_run_counter) == (verified, 4), name
    assert rt.stats()["violations_by_group"] == {"FULL": 2, "SWA": 2} and rt.stats()["violations"] == 4


def test_rows_of_one_launch_keep_their_ring_order():
    """Two wrong tokens of one step: HEAD K's rows are the first two of the ring, in token order, then TAIL K's."""
    engine = sc.ToyEngine()
    rt = make(engine, write_input_assert=True)
    reports = drive(engine, rt, hooks={(2, "batch"): _wrong(1, 3)["batch"]})
    rows = next(r for r in reports if r.launch_step == 2).new_violations
    # slots go out in order: step 0 gives 1-5 and 6-8, step 1 gives 9 and 10, step 2 gives row 1 slot 11, row 2
    # (a new request) slot 12 at position 0, row 3 slots 13-16 at positions 0-3; tokens 1 and 3 are 12 and 14
    assert [(v.index, v.launch_tag, v.slot, v.position) for _, v in rows] == [
        (0, "HEAD_K_FULL", 12, 0), (1, "HEAD_K_FULL", 14, 1), (2, "TAIL_K_FULL", 12, 0), (3, "TAIL_K_FULL", 14, 1)]


def test_the_status_bits_seen_stay_in_the_stats_after_clean_reads():
    engine = sc.ToyEngine()
    rt = make(engine)
    drive(engine, rt, steps=2)
    rt.copy_slots([1], [sc.NUM_SLOTS + 3])
    assert rt.flush().status_bits == int(CanaryStatus.SLOT_OUT_OF_RANGE)
    assert rt.flush().status_bits == 0
    assert rt.stats()["status_bits"] == int(CanaryStatus.SLOT_OUT_OF_RANGE)


def test_a_plan_status_is_reported_once_by_the_group_whose_plan_it_is():
    """A request row outside req_to_token's rows: the shared plan flags REQ_POOL_INDEX_OUT_OF_RANGE; only A, whose
    plan it is, reports it (B shares A's plan)."""
    from test_runtime_shared_plan import TwoGroupEngine
    from test_runtime_shared_plan import make as make_shared

    from kvcanary_cupy.constants import PlanStatus

    engine = TwoGroupEngine(shared=True)
    rt = make_shared(engine, "numpy")

    def outside(sb):
        sb.req_pool_indices = sb.req_pool_indices.copy()
        sb.req_pool_indices[0] = sc.ROWS + 2
    reports = drive(engine, rt, hooks={(2, "batch"): outside})
    flagged = [(r.launch_step, r.plan_status) for r in reports if r.plan_status]
    assert flagged == [(2, {"A": int(PlanStatus.REQ_POOL_INDEX_OUT_OF_RANGE)})]


def test_a_bounded_verify_that_never_saw_a_prefix_states_zero_live_entries():
    engine = sc.ToyEngine()
    rt = make(engine, max_verify_entries_per_step=4)
    drive(engine, rt, steps=1)  # step 0: prefills only, empty verify lists
    assert rt.verify_bound()["verify_live_max"] == 0 and rt.verify_bound()["verify_bound_steps"] == 1


@pytest.mark.parametrize("steps", [1, 2])
def test_launches_after_a_flush_and_a_health_check_are_reported_by_the_step_after_the_next(steps):
    """flush, then a health check while flush's snapshot is still to be read (both of the step counter's parity),
    then a step with a wrong token: finish_step reads flush's snapshot (nothing), the next read finds the rows."""
    engine = sc.ToyEngine()
    rt = make(engine, write_input_assert=True)
    drive(engine, rt, steps=steps)  # ends with flush
    assert rt.check_health() == []
    batch = engine.schedule(steps)
    sb = engine.step_batch(batch, oracle=True)
    sb.input_ids = sb.input_ids.copy()
    sb.input_ids[0] += 5
    rt.prepare(sb)
    rt.pre_forward()
    engine.forward(batch, "FULL", ids=sb.input_ids)
    rt.post_forward()
    assert rt.check_health() == []
    assert rt.finish_step().new_violations == []
    later = rt.flush()
    assert later.launch_step == steps
    assert [v.launch_tag for _, v in later.new_violations] == ["HEAD_K_FULL", "TAIL_K_FULL"]


def _health_step(engine, rt, t: int, *, posts: int) -> list[str]:
    """Step ``t`` with its TAIL phase run ``posts`` times; the health problems of the read it returns."""
    batch = engine.schedule(t)
    rt.prepare(engine.step_batch(batch))
    rt.pre_forward()
    engine.forward(batch, "FULL")
    for _ in range(posts):
        rt.post_forward()
    engine.finish_step(t)
    return rt.finish_step().health_problems


@pytest.mark.parametrize(("posts", "made_up"), [
    # two TAIL phases at step 3: the kernel count and TAIL K's written tokens (8 + 6 + 2 x 2 = 18) catch up with
    # HEAD K's exactly, which the baseline of the deficit no longer expects
    (2, ["verify {k}4, expected 3", "verify {s}28, expected 17", "write {k}4, expected 3", "write {s}18, expected 16"]),
    # three: one kernel past HEAD K's, 6 + 3 x 11 = 39 verified, 8 + 6 + 3 x 2 = 20 written
    (3, ["verify {k}5, expected 3", "verify {s}39, expected 17", "write {k}5, expected 3", "write {s}20, expected 16"]),
])
def test_a_deficit_is_reported_once_and_a_later_change_against_the_new_baseline(posts, made_up):
    """Step 1 skips its TAIL phase: one TAIL kernel short, TAIL K's verify short of HEAD K's 8 prefix entries and
    its write short of HEAD K's 2 tokens. Those become the baseline: step 2 is quiet. Step 3 runs its TAIL phase
    ``posts`` times, and is compared with HEAD K less the baseline: 4 - 1 = 3 kernels, 25 - 8 = 17 verified
    entries (HEAD K: 8 + 6 + 11), 18 - 2 = 16 written tokens (HEAD K: 8 + 2 + 6 + 2)."""
    engine = sc.ToyEngine()
    rt = make(engine)
    problems = [_health_step(engine, rt, t, posts=p) for t, p in enumerate([1, 0, 1, posts, 1])]
    prefix = "group FULL: TAIL_K_FULL "
    kernels = "kernel ran (count) vs one per prepare() call of model 'target': "
    slots = "slot count vs HEAD_K (same plan, same batch): "
    assert problems[0] == [] and problems[1] == [] and problems[3] == []  # each read is of the step before
    assert problems[2] == [f"{prefix}verify {kernels}1, expected 2", f"{prefix}verify {slots}0, expected 8",
                           f"{prefix}write {kernels}1, expected 2", f"{prefix}write {slots}8, expected 10"]
    assert problems[4] == [prefix + p.format(k=kernels, s=slots) for p in made_up]
    assert rt.stats()["health_failures"] == 8


@pytest.mark.parametrize("dropped", ["SWEEP_K_FULL", "SWEEP_V_FULL"])
def test_a_sweep_launch_that_did_not_run_is_a_health_problem_of_its_endpoint(dropped, monkeypatch):
    from kvcanary_cupy.bind import BoundLaunch

    engine = sc.ToyEngine(with_v=True)
    rt = make(engine)
    drive(engine, rt)
    skipped = next(ep.verify for ep in rt.groups["FULL"].endpoints["SWEEP"] if ep.tag.name == dropped)
    run = BoundLaunch.run_checked
    monkeypatch.setattr(BoundLaunch, "run_checked", lambda self: None if self is skipped else run(self))
    assert rt.sweep() == 9
    assert rt.check_health() == [f"group FULL: {dropped} verify kernel ran (count) vs one per sweep launch: 0, "
                                 "expected 1"]


def test_stats_are_logged_every_stats_interval_steps_with_the_stats_as_fields(caplog):
    engine = sc.ToyEngine()
    rt = make(engine, stats_interval=4)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        drive(engine, rt)
    records = [r for r in caplog.records if r.levelno == logging.INFO and r.name == LOGGER]
    assert [r.kv_canary["stats"]["steps"] for r in records] == [4]  # 6 steps: after the 4th only
    assert set(records[0].kv_canary) == {"stats"} and records[0].kv_canary["stats"]["forwards"] == {"target": 4}
    # the counters as read one step late, up to step 2: 8 + 2 + 6 tokens
    assert records[0].getMessage() == "kv-canary: protected 16 tokens, 0 sweep passes, 0 violations"
