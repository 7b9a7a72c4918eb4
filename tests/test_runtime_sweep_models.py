"""The sweep's per-model answer: a sweep source may answer ``model name -> (slots, positions, prev_slots)`` (an
engine whose models have slots of their own, like vLLM's KV cache groups), and each model's entries are verified
on that model's groups only; the plain triple still means every group. Expectations are hand-derived from which
group's bytes the test corrupted at which slot (the toy engine's target model is group FULL, its draft model
group DRAFT, both holding the same cached slots); a bad answer is refused by name before anything is launched."""

from __future__ import annotations

import re

import numpy as np
import pytest
import runtime_scenario as sc
from test_runtime import BACKENDS, LOGGER, drive

from kvcanary_cupy import CanaryArgumentError, FailReason
from kvcanary_cupy.runtime import CanaryConfig, CanaryRuntime, Capacities


def driven(backend: str, answer: list) -> tuple[sc.ToyEngine, CanaryRuntime, list]:
    """A target + draft engine driven through its schedule (sweeping every step an empty answer), then asked to
    sweep whatever ``answer[0]`` holds; the launch events of everything after the schedule are collected."""
    engine = sc.ToyEngine(draft=True)
    events: list = []
    answer[0] = {}
    rt = CanaryRuntime.create(CanaryConfig(backend=backend, logger=LOGGER, sweep_interval=1), engine.pools(),
                              Capacities(max_batch_size=sc.MAX_BS, max_tokens=sc.MAX_TOKENS),
                              sweep_source=lambda: answer[0], observer=events.append)
    drive(engine, rt)
    assert rt.flush().new_violations == []
    events.clear()
    return engine, rt, events


def entries(engine: sc.ToyEngine, *slots: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The prefix cache's own (slot, position, prev) entries of ``slots``, in that order."""
    held, positions, prevs = engine.held()
    at = [int(np.flatnonzero(held == s)[0]) for s in slots]
    return held[at], positions[at], prevs[at]


def swept_rows(rt: CanaryRuntime) -> set[tuple[str, str, int, tuple[str, ...]]]:
    return {(g, v.launch_tag, v.slot, v.reasons) for g, v in rt.flush().new_violations}


REAL_KV = (FailReason.VERIFY_REAL_KV_HASH_MISMATCH.name,)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_per_model_answer_verifies_each_models_slots_on_that_models_groups_only(backend):
    """FULL's bytes are corrupted at slot ``a``, DRAFT's at slot ``b`` (both slots held by the prefix cache
    alone). Each model asked for its own corrupted slot: both found, each in its own group. Each model asked for
    the other's slot: nothing (a verify of every group, the plain triple's meaning, would report both). One model
    left out: its corruption waits."""
    answer: list = [None]
    engine, rt, events = driven(backend, answer)
    a, b = engine.cached[0][1], engine.cached[1][2]
    engine.flip_kv_bit("FULL", a)
    engine.flip_kv_bit("DRAFT", b)

    answer[0] = {"target": entries(engine, a), "draft": entries(engine, b)}
    assert rt.sweep() == 2
    assert swept_rows(rt) == {("FULL", "SWEEP_K_FULL", a, REAL_KV), ("DRAFT", "SWEEP_K_FULL", b, REAL_KV)}
    assert [(e.when, e.group.name) for e in events] == [("before", "FULL"), ("after", "FULL"),
                                                        ("before", "DRAFT"), ("after", "DRAFT")]

    answer[0] = {"target": entries(engine, b), "draft": entries(engine, a)}
    assert rt.sweep() == 2
    assert swept_rows(rt) == set()

    answer[0] = {"draft": entries(engine, b, a)}  # the target left out: its slot a is not looked at
    events.clear()
    assert rt.sweep() == 2
    assert swept_rows(rt) == {("DRAFT", "SWEEP_K_FULL", b, REAL_KV)}
    assert {e.group.name for e in events} == {"DRAFT"}

    assert rt.stats()["sweeps"] == 3 and rt.stats()["swept_slots"] == 6


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_plain_triple_still_verifies_every_group(backend):
    """The triple ``(b, a)``: every group verifies both slots, so FULL finds ``a`` and DRAFT finds ``b``; the
    answer the per-model test above found nothing with (each model the other's slot) now finds both."""
    answer: list = [None]
    engine, rt, _ = driven(backend, answer)
    a, b = engine.cached[0][1], engine.cached[1][2]
    engine.flip_kv_bit("FULL", a)
    engine.flip_kv_bit("DRAFT", b)
    answer[0] = entries(engine, b, a)
    assert rt.sweep() == 2
    assert swept_rows(rt) == {("FULL", "SWEEP_K_FULL", a, REAL_KV), ("DRAFT", "SWEEP_K_FULL", b, REAL_KV)}


def test_an_empty_per_model_answer_sweeps_nothing():
    answer: list = [None]
    engine, rt, events = driven("numpy", answer)
    engine.flip_kv_bit("FULL", engine.cached[0][1])
    assert rt.sweep() == 0
    answer[0] = {"target": (np.zeros(0, np.int64),) * 3}
    assert rt.sweep() == 0
    assert events == [] and swept_rows(rt) == set() and rt.stats()["sweeps"] == 0


def _good(engine: sc.ToyEngine) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return entries(engine, engine.cached[0][1])


BAD_ANSWERS = {
    "unknown-model": (lambda e: {"target": _good(e), "verifier": _good(e)},
                      "sweep_source returned entries for 'verifier', not a model of this runtime (models: target, "
                      "draft)"),
    "non-str-key": (lambda e: {0: _good(e)}, "sweep_source returned entries for 0, not a model of this runtime"),
    "not-a-triple": (lambda e: {"target": _good(e), "draft": [1, 2]},
                     "sweep_source must return (slots, positions, prev_slots) of model 'draft', got list"),
    "float-slots": (lambda e: {"target": _good(e), "draft": (np.array([1.5]), np.array([0]), np.array([-1]))},
                    "sweep_source's slots of model 'draft' must be a 1-D integer host array"),
    "2d-prevs": (lambda e: {"draft": _good(e), "target": (np.array([1]), np.array([0]), np.array([[-1]]))},
                 "sweep_source's prev_slots of model 'target' must be a 1-D integer host array"),
    "lengths": (lambda e: {"target": (np.array([1, 2]), np.array([0, 1]), np.array([-1]))},
                "sweep_source returned 2 slots of model 'target' but 2 positions and 1 prev slots"),
}


@pytest.mark.parametrize("case", list(BAD_ANSWERS))
def test_a_bad_per_model_answer_is_refused_by_name_before_anything_is_swept(case):
    """The whole answer is validated first: a valid model's entries next to a bad one are not verified either,
    by ``sweep()`` or by the sweep of ``finish_step`` (which then reads no ring and does not advance)."""
    answer: list = [None]
    engine, rt, events = driven("numpy", answer)
    engine.flip_kv_bit("FULL", engine.cached[0][1])  # what the valid part would find if it were verified
    make, message = BAD_ANSWERS[case]
    answer[0] = make(engine)
    with pytest.raises(CanaryArgumentError, match="^" + re.escape(f"kv-canary: {message}")):
        rt.sweep()
    stats, step = rt.stats(), rt.step
    with pytest.raises(CanaryArgumentError, match="^" + re.escape(f"kv-canary: {message}")):
        rt.finish_step()
    assert events == [] and rt.step == step and rt.stats() == stats and stats["sweeps"] == 0
    assert swept_rows(rt) == set()
