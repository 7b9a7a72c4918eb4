"""``CanaryRuntime.flush`` reports two reads in one: the last step's snapshot and the launches after the last
``finish_step``. Each of dropped rows, health problems and plan overflows found in either read is in the one
report (and logged, or raised in ``raise`` mode); a hook that fails part way propagates as itself; ``off`` mode
answers with the step counter; the timer sees ``read`` and, for written slots handed to ``post_forward``, ``stage``."""

from __future__ import annotations

import contextlib
import logging
import re

import numpy as np
import pytest
import runtime_scenario as sc
from test_runtime import BACKENDS, LOGGER, drive, make

from kvcanary_cupy import CanaryArgumentError
from kvcanary_cupy.runtime import CanaryConfig, CanaryRuntime, CanaryViolationError, Capacities

TAIL_BEHIND = ("group FULL: TAIL_K_FULL verify kernel ran (count) vs one per prepare() call of model 'target': 4, "
               "expected 5")


def _runtime(engine: sc.ToyEngine, backend: str = "numpy", *, timer=None, verify_capacity=None, **config):
    config.setdefault("logger", LOGGER)
    return CanaryRuntime.create(CanaryConfig(backend=backend, **config), engine.pools(),
                                Capacities(max_batch_size=sc.MAX_BS, max_tokens=sc.MAX_TOKENS,
                                           verify_capacity=verify_capacity), timer=timer)


def _step(engine, rt, t: int, *, wrong=(), post: bool = True, finish: bool = True) -> None:
    """One step of the toy engine; ``wrong``: indices of input tokens the batch gets wrong (write-assert rows)."""
    batch = engine.schedule(t)
    sb = engine.step_batch(batch, oracle=rt.config.write_input_assert)
    if wrong:
        sb.input_ids = sb.input_ids.copy()
        sb.input_ids[list(wrong)] += 5
    rt.prepare(sb)
    rt.pre_forward()
    engine.forward(batch, "FULL", ids=sb.input_ids)
    if post:
        rt.post_forward()
    engine.finish_step(t)
    if finish:
        rt.finish_step()


def _phase_recorder():
    """A runtime timer that records the phase of every block it times, and the list it records into."""
    phases: list[str] = []

    @contextlib.contextmanager
    def timer(phase):
        phases.append(phase)
        yield

    return phases, timer


class TimerBroke(RuntimeError):
    pass


class _ReadBreakingTimer:
    """A runtime timer that records every phase it times and, once ``armed``, fails as a ``read`` block ends (an
    exporter that goes down)."""

    def __init__(self) -> None:
        self.phases: list[str] = []
        self.armed = False

    @contextlib.contextmanager
    def __call__(self, phase):
        self.phases.append(phase)
        yield
        if phase == "read" and self.armed:
            raise TimerBroke("the timer's exporter is down")


@pytest.mark.parametrize("backend", BACKENDS)
def test_flush_adds_the_drops_and_health_problems_of_the_last_step_and_of_the_launches_after_it(backend):
    """A ring of 2. Step 4 (TAIL skipped) gets 3 wrong tokens: 3 HEAD rows, 2 kept, 1 dropped, the TAIL counters
    one behind. Step 5's HEAD phase (no TAIL, no finish_step) gets 1 wrong token while the ring is still full:
    lost, and the TAIL counters one behind again. flush reads both: 2 rows, 2 dropped, each TAIL counter
    behind twice (once per read, against the baseline the first one set)."""
    engine = sc.ToyEngine()
    rt = _runtime(engine, backend, ring_capacity=2, write_input_assert=True)
    for t in range(4):
        _step(engine, rt, t)
    _step(engine, rt, 4, wrong=(0, 1, 2), post=False)
    _step(engine, rt, 5, wrong=(0,), post=False, finish=False)
    report = rt.flush()
    assert len(report.new_violations) == 2 and all(v.launch_tag == "HEAD_K_FULL" for _, v in report.new_violations)
    assert report.dropped == 2 and rt.stats()["dropped"] == 2
    assert report.health_problems.count(TAIL_BEHIND) == 2
    assert len(report.health_problems) == rt.stats()["health_failures"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_flush_reports_a_plan_overflow_of_the_last_step_and_one_after_it(backend, caplog):
    """A verify capacity of 7 entries: the prefixes of steps 1, 3, 4 and 5 (8, 11, 8, 11 entries) overflow it,
    step 2's (6) fits. flush reads step 4's snapshot and step 5's launches: FULL overflowed in both, each logged
    with the count so far (4)."""
    engine = sc.ToyEngine()
    rt = _runtime(engine, backend, verify_capacity=7)
    for t in range(5):
        _step(engine, rt, t)
    assert rt.stats()["overflows"] == {"FULL": 2}  # steps 1 and 3; step 4's is read one step late
    _step(engine, rt, 5, finish=False)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        report = rt.flush()
    assert report.overflowed == ["FULL", "FULL"] and rt.stats()["overflows"] == {"FULL": 4}
    lines = [r.getMessage() for r in caplog.records if "overflowed its verify capacity" in r.getMessage()]
    assert len(lines) == 2 and all(line.endswith("(4 overflow(s) so far)") for line in lines)


def test_flush_raises_in_raise_mode_for_rows_it_reads():
    engine = sc.ToyEngine()
    rt = _runtime(engine, mode="raise", write_input_assert=True)
    _step(engine, rt, 0)
    _step(engine, rt, 1, wrong=(1,), finish=False)
    with pytest.raises(CanaryViolationError) as info:
        rt.flush()
    assert [v.launch_tag for _, v in info.value.violations] == ["HEAD_K_FULL", "TAIL_K_FULL"]


def test_flush_logs_as_many_rows_per_line_as_log_rows_says(caplog):
    engine = sc.ToyEngine()
    rt = _runtime(engine, write_input_assert=True, log_rows=1)
    _step(engine, rt, 0)
    _step(engine, rt, 1, wrong=(0, 1), finish=False)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        report = rt.flush()
    assert len(report.new_violations) == 4
    lines = [r.getMessage() for r in caplog.records if " group FULL: " in r.getMessage()]
    assert len(lines) == 1 and "; 3 more row(s) counted, not logged" in lines[0]


@pytest.mark.parametrize("rows_in", ["last step", "after it"])
def test_a_timer_failing_as_flush_reads_propagates_as_itself_and_the_rows_read_are_logged(rows_in, caplog):
    timer = _ReadBreakingTimer()
    engine = sc.ToyEngine()
    rt = _runtime(engine, write_input_assert=True, timer=timer)
    _step(engine, rt, 0)
    _step(engine, rt, 1, wrong=(1,), finish=rows_in == "last step")
    timer.armed = True
    with caplog.at_level(logging.WARNING, logger=LOGGER), pytest.raises(TimerBroke):
        rt.flush()
    assert any("2 violation row(s)" in r.getMessage() for r in caplog.records)
    assert rt.stats()["violations"] == 2


def test_flush_reads_under_the_read_phase_and_written_slots_are_staged_under_stage():
    phases, timer = _phase_recorder()
    engine = sc.ToyEngine()
    rt = _runtime(engine, timer=timer)
    _step(engine, rt, 0)
    phases.clear()
    rt.flush()
    assert phases == ["read"]
    batch = engine.schedule(1)
    sb = engine.step_batch(batch)
    rt.prepare(sb)
    rt.pre_forward()
    phases.clear()
    rt.post_forward(out_cache_loc=sb.out_cache_loc)
    assert phases == ["stage", "verify", "write"]


def test_off_mode_flush_answers_with_the_step_counter():
    engine = sc.ToyEngine()
    rt = make(engine, mode="off")
    reports = drive(engine, rt, steps=3)
    assert [(r.step, r.launch_step) for r in reports] == [(0, -1), (1, 0), (2, 1), (3, 2)]
    assert rt.flush().clean


def test_written_slots_under_capture_are_refused_with_the_whole_reason(monkeypatch):
    engine = sc.ToyEngine()
    rt = make(engine)
    sb = engine.step_batch(engine.schedule(0))
    rt.prepare(sb)
    rt.pre_forward()
    monkeypatch.setattr(rt.space, "capturing", lambda: True)
    message = ("kv-canary: post_forward(out_cache_loc=...) runs outside CUDA-graph capture (the written slots are "
               "validated on the host); capture post_forward() without it")
    with pytest.raises(CanaryArgumentError, match="^" + re.escape(message) + "$"):
        rt.post_forward(out_cache_loc=np.asarray(sb.out_cache_loc))


def test_a_timer_failing_as_finish_step_reads_propagates_as_itself_and_the_rows_read_are_logged(caplog):
    timer = _ReadBreakingTimer()
    engine = sc.ToyEngine()
    rt = _runtime(engine, write_input_assert=True, timer=timer)
    _step(engine, rt, 0)
    _step(engine, rt, 1, wrong=(1,))
    _step(engine, rt, 2, finish=False)
    timer.phases.clear()
    timer.armed = True
    with caplog.at_level(logging.WARNING, logger=LOGGER), pytest.raises(TimerBroke):
        rt.finish_step()
    assert timer.phases == ["read"]
    assert any("2 violation row(s)" in r.getMessage() for r in caplog.records)
    assert rt.stats()["violations"] == 2


def test_a_slot_table_moved_after_some_steps_refuses_the_head_phase_with_nothing_written():
    """The plan reads the engine's req_to_token in place: a torch table the engine re-allocates after some steps
    stops the next HEAD phase (plan, HEAD verify, HEAD write) before any of its launches; the phases that read
    no table (TAIL, the step's end) are not refused for it."""
    from test_runtime import runtime_arrays

    torch = pytest.importorskip("torch")
    engine = sc.ToyEngine()
    table = torch.from_numpy(engine.req_to_token)
    rt = CanaryRuntime.create(CanaryConfig(logger=LOGGER), type(engine.pools())(engine.groups(), req_to_token=table),
                              Capacities(max_batch_size=sc.MAX_BS, max_tokens=sc.MAX_TOKENS))
    for t in range(2):
        _step(engine, rt, t)
    # moved after step 2's HEAD phase: its TAIL phase and a sweep read no slot table and go on
    batch = engine.schedule(2)
    rt.prepare(engine.step_batch(batch))
    rt.pre_forward()
    engine.forward(batch, "FULL")
    table.set_(torch.zeros_like(table))  # the engine re-allocated its slot table
    rt.post_forward()
    engine.finish_step(2)
    rt.finish_step()
    rt.prepare(engine.step_batch(engine.schedule(3)))
    before = runtime_arrays(rt)
    with pytest.raises(CanaryArgumentError, match="storage moved or shrank") as info:
        rt.pre_forward()
    assert str(info.value).startswith("kv-canary: ") and "req_to_token" in str(info.value)
    after = runtime_arrays(rt)
    assert [k for k in before if not np.array_equal(before[k], after[k])] == []


def test_a_model_that_is_not_one_of_the_runtimes_is_refused_naming_every_model():
    engine = sc.ToyEngine(draft=True)
    rt = make(engine)
    sb = engine.step_batch(engine.schedule(0))
    for model in ("verifier", ["target"], None):
        with pytest.raises(CanaryArgumentError) as info:
            rt.prepare(sb, model=model)
        assert str(info.value) == f"kv-canary: model must be one of target, draft, got {model!r}"
    assert rt.forwards == {"target": 0, "draft": 0}


def test_prepare_stages_under_stage_and_scatters_the_histories_as_a_launch_of_its_model():
    phases, timer = _phase_recorder()
    events = []
    engine = sc.ToyEngine()
    rt = CanaryRuntime.create(CanaryConfig(logger=LOGGER, verify_token_assert=True), engine.pools(),
                              Capacities(max_batch_size=sc.MAX_BS, max_tokens=sc.MAX_TOKENS), timer=timer,
                              observer=events.append)
    rt.prepare(engine.step_batch(engine.schedule(0), tokens=True))
    assert phases == ["stage", "scatter"]
    assert [(e.when, e.kind, e.model, e.group, e.endpoint) for e in events] == [
        ("before", "scatter", "target", None, None), ("after", "scatter", "target", None, None)]


def test_histories_given_with_the_token_check_off_are_refused_by_the_switch_name():
    engine = sc.ToyEngine()
    rt = make(engine)
    sb = engine.step_batch(engine.schedule(0), tokens=True)
    sb.valid_lens = None  # the check's other input, refused on its own
    with pytest.raises(CanaryArgumentError) as info:
        rt.prepare(sb)
    assert str(info.value) == "kv-canary: batch.history_* is given but CanaryConfig.verify_token_assert is off"
    assert rt.forwards == {"target": 0}


def test_finish_step_logs_as_many_rows_per_line_as_log_rows_says(caplog):
    engine = sc.ToyEngine()
    rt = _runtime(engine, write_input_assert=True, log_rows=1)
    _step(engine, rt, 0)
    _step(engine, rt, 1, wrong=(0, 1))
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        _step(engine, rt, 2)
    lines = [r.getMessage() for r in caplog.records if " group FULL: " in r.getMessage()]
    assert len(lines) == 1 and "; 3 more row(s) counted, not logged" in lines[0]


def test_a_bounded_verify_selects_its_window_under_the_window_phase():
    phases, timer = _phase_recorder()
    engine = sc.ToyEngine()
    rt = _runtime(engine, timer=timer, max_verify_entries_per_step=4)
    _step(engine, rt, 0)
    batch = engine.schedule(1)
    rt.prepare(engine.step_batch(batch))
    phases.clear()
    rt.pre_forward()
    assert phases == ["plan", "window", "verify", "write"]
