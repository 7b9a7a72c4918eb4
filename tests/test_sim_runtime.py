"""The simulator as the runtime's first client: clean runs of every preset read nothing and keep the run
counters healthy; every fault kind is logged in ``log`` mode (one record per row) and raised in ``raise`` mode
one step after the launch that found it, with the decoded rows the log mode reported for that launch."""

from __future__ import annotations

import logging

import pytest

from kvcanary_cupy.backends import unavailable_reason
from kvcanary_cupy.runtime import CanaryViolationError
from kvcanary_cupy.sim import FAULT_KINDS, PRESETS, SimConfig, Simulation
from kvcanary_cupy.sim.runner import CANARY_LOGGER

BACKENDS = ["numpy", pytest.param("host", marks=pytest.mark.skipif(unavailable_reason("host") is not None,
                                                                   reason=str(unavailable_reason("host"))))]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("preset", list(PRESETS))
def test_a_clean_run_of_every_preset_reads_no_violation_and_stays_healthy(preset, backend, caplog):
    sim = Simulation(SimConfig(preset=preset, steps=60, requests=16, seed=11, backend=backend, sweep_interval=4))
    with caplog.at_level(logging.WARNING, logger=CANARY_LOGGER):
        report = sim.run()
    assert report["passed"] and report["violations"]["total"] == 0 and report["violations"]["status"] == []
    assert sim.health_problems == [] and sim.runtime.check_health() == []
    stats = sim.runtime.stats()
    assert 0 < stats["forwards"]["target"] <= 60
    if PRESETS[preset].eagle:
        assert stats["forwards"]["draft"] == stats["forwards"]["target"]
    assert stats["protected_tokens"] >= report["workload"]["prefill_tokens"] + report["workload"]["decode_tokens"]
    assert stats["sweeps"] == report["workload"]["sweeps"] > 0
    assert not [r for r in caplog.records if r.name == CANARY_LOGGER]


def kind_config(kind: str, **kw) -> SimConfig:
    preset = "swa" if FAULT_KINDS[kind].needs == "swa" else "eagle"
    return SimConfig(preset=preset, steps=30, requests=10, seed=5, inject={kind: 0.3}, warmup_steps=4,
                     cooldown_steps=6, **kw)


def first_alarm(kind: str) -> tuple[int, list[tuple[str, tuple[int, ...]]]]:
    """The log-mode run: the first step whose launches found something, and the rows read for it."""
    sim = Simulation(kind_config(kind))
    reports = []
    original = sim._attribute

    def keep(report, read_step):
        reports.append(report)
        original(report, read_step)
    sim._attribute = keep
    sim.run()
    first = next(r for r in reports if r.new_violations)
    return first.launch_step, [(g, tuple(v.raw)) for g, v in first.new_violations]


@pytest.mark.parametrize("kind", list(FAULT_KINDS))
def test_every_fault_kind_is_logged_one_line_per_step_and_group_counting_every_row(kind, caplog):
    with caplog.at_level(logging.WARNING, logger=CANARY_LOGGER):
        sim = Simulation(kind_config(kind))
        report = sim.run()
    assert report["passed"], report["kinds"]
    assert report["kinds"][0]["detected"] == report["kinds"][0]["injected"] > 0
    records = [r for r in caplog.records if r.name == CANARY_LOGGER]
    lines = [r for r in records if " violation row(s) (" in r.getMessage()]
    assert sum(r.kv_canary["rows"] for r in lines) == report["violations"]["total"] > 0
    assert len({(r.kv_canary["step"], r.kv_canary["group"]) for r in lines}) == len(lines)  # one per step, group
    shown = [f for r in lines for f in r.kv_canary["first_rows"]]
    assert {f["tag"] for f in shown} <= {t.removesuffix("/draft") for t in report["violations"]["by_tag"]}
    summaries = [r for r in records if "new violation(s)" in r.getMessage()]
    assert len(summaries) == sum(1 for n in report["timeline"]["violations"] if n)


@pytest.mark.parametrize("kind", list(FAULT_KINDS))
def test_every_fault_kind_is_raised_one_step_after_its_launch(kind):
    launch_step, logged_rows = first_alarm(kind)
    sim = Simulation(kind_config(kind, canary_mode="raise"))
    with pytest.raises(CanaryViolationError) as info:
        sim.run()
    rep = info.value.step_report
    assert (rep.launch_step, rep.step) == (launch_step, launch_step + 1)
    assert sim.steps_run == launch_step + 1  # finish_step of the next step raised
    assert [(g, tuple(v.raw)) for g, v in info.value.violations] == logged_rows
    assert info.value.report is not None and info.value.report.rows
    for group, v in info.value.violations:  # every row is explained by an injected fault of this kind
        faults = sim.tracker.explain(group, v.slot, v.reason_bits, rep.launch_step)
        assert faults and {f.kind for f, _ in faults} == {kind}
