"""The TAIL thread in a real engine: in log mode a step's TAIL launches and ring read start once the runner has
sampled and run while vLLM sends its output and schedules the next step (or, on cores a lone worker leaves idle,
the step's staging during its forward and its TAIL work from the forward's end), and they report exactly what the
same work run inline reports, at the same step."""

from __future__ import annotations

import os
import threading
import time

import pytest
from test_vllm_integration import wipe_kv
from vllm import SamplingParams

from kvcanary_cupy.integrations import vllm as kv
from kvcanary_cupy.integrations.vllm import canary as canary_module


class Watcher:
    """An observer that changes nothing (the hooks wait for the TAIL work before they call an observer)."""

    def before_forward(self, canary, step, kwargs, metadata) -> None:
        pass

    def after_forward(self, canary, step, batch) -> None:
        pass


def corrupted_prefix_rows(llm, prompt: list[int], *, inline: bool, watched: bool = True, monkeypatch=None
                          ) -> tuple[set[tuple], int, set[str]]:
    """Run ``prompt``, add 1.0 to every element of the first layer's KV cache (the prompt's complete blocks stay
    in the prefix cache), then run ``prompt`` plus 8 tokens, which hits those blocks: the rows the canary reports
    (step, group, slot, position, reasons), the step at which the second request started, and the names of the
    threads that ran the TAIL work. ``watched``: with an observer, which the hooks wait for the TAIL work before
    they call; without one the TAIL work starts when the runner has sampled. ``monkeypatch``: the TAIL thread is
    given a core of its own (as a lone worker's on vLLM's CPU build)."""
    if monkeypatch is not None:
        monkeypatch.setattr(canary_module, "idle_cores", lambda runner: frozenset({max(os.sched_getaffinity(0))}))
    assert llm.reset_prefix_cache()
    canary = kv.install(llm, backend="host", sweep_interval=0)
    threads: set[str] = set()
    state = canary.state
    work = state._tail_work

    def tail_work(*args):
        threads.add(threading.current_thread().name)
        return work(*args)

    state._tail_work = tail_work
    if watched:
        canary.observers.append(Watcher())  # waits for the TAIL work after each step: changes nothing here
    if inline:  # as in raise mode
        state.tail.close()
        state.tail = None
    try:
        params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
        llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        assert canary.finish() == [] and canary.violations == []
        kv.find_runner(llm).kv_caches[0].add_(1.0)
        start = canary.steps
        llm.generate([{"prompt_token_ids": prompt + list(range(100, 108))}], params, use_tqdm=False)
        canary.finish()
        rows = {(v.step, v.group, v.violation.slot, v.violation.position, v.violation.reasons)
                for v in canary.violations}
        return rows, start, threads
    finally:
        canary.remove()
        wipe_kv(llm)


@pytest.mark.parametrize(("seed", "watched", "own_core"), [(0, True, False), (1, False, False), (2, True, False),
                                                          (3, False, False), (4, False, True), (5, True, True)])
def test_the_tail_thread_reports_a_corrupted_prefix_at_the_step_and_slots_the_inline_tail_reports(
        llm, monkeypatch, seed, watched, own_core):
    import numpy as np

    prompt = np.random.default_rng(seed).integers(3, 500, 40 + 7 * seed).tolist()
    threaded, start, names = corrupted_prefix_rows(llm, prompt, inline=False, watched=watched,
                                                   monkeypatch=monkeypatch if own_core else None)
    inline, start_inline, inline_names = corrupted_prefix_rows(llm, prompt, inline=True)
    assert names and all(n.startswith("kvcanary-tail") for n in names)
    assert inline_names == {threading.current_thread().name}
    assert start == start_inline
    # the second request's first step verifies the hit blocks and finds them changed, and so does each later step
    # of it (the bytes stay wrong): real KV only, every position of the complete blocks, first at its first step
    assert threaded and min(r[0] for r in threaded) == start
    assert all(r[4] == ("VERIFY_REAL_KV_HASH_MISMATCH",) for r in threaded)
    block = kv.find_runner(llm).cache_config.block_size
    assert {r[3] for r in threaded if r[0] == start} == set(range(len(prompt) // block * block))
    # the blocks the engine hands out differ between the two runs (its free list moved on): slots may differ
    assert {r[:2] + r[3:] for r in threaded} == {r[:2] + r[3:] for r in inline}


def slow_sampling(monkeypatch, runner, events: list[str]) -> None:
    """The runner's sampling made 20 ms slower, each return logged as ``"sampled"`` in ``events``."""
    sample = type(runner).sample_tokens

    def slow_sample(self, *args, **kwargs):
        out = sample(self, *args, **kwargs)
        time.sleep(0.02)
        events.append("sampled")
        return out

    monkeypatch.setattr(type(runner), "sample_tokens", slow_sample)


@pytest.mark.parametrize("seed", range(3))
def test_a_steps_tail_work_starts_once_the_runner_has_sampled(llm, monkeypatch, seed):
    # sampling made slow: TAIL work started at the forward's end would run inside it
    runner = kv.find_runner(llm)
    events: list[str] = []
    slow_sampling(monkeypatch, runner, events)
    assert llm.reset_prefix_cache()
    canary = kv.install(llm, backend="host", sweep_interval=0)
    work = canary.state._tail_work

    def tail_work(*args):
        events.append("tail")
        return work(*args)

    canary.state._tail_work = tail_work
    try:
        new = 3 + seed
        params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
        llm.generate([{"prompt_token_ids": list(range(3, 40 + 9 * seed))}], params, use_tqdm=False)
        assert canary.finish() == []
        assert canary.steps == new
    finally:
        canary.remove()
    assert events == ["sampled", "tail"] * new


@pytest.mark.parametrize("mode", ["log", "raise"])
def test_the_step_is_staged_and_planned_on_the_tail_thread_in_log_mode_and_before_the_forward_in_raise_mode(
        llm, monkeypatch, mode):
    runner = kv.find_runner(llm)
    events: list[tuple[str, str]] = []

    def timed(name, fn):
        def call(*args, **kwargs):
            events.append((name, threading.current_thread().name))
            return fn(*args, **kwargs)
        return call

    # vLLM's own forward (the hook calls it): its start is recorded
    monkeypatch.setattr(type(runner), "_model_forward", timed("forward", type(runner)._model_forward))
    assert llm.reset_prefix_cache()
    canary = kv.install(llm, backend="host", mode=mode, sweep_interval=0)
    st = canary.state
    for name in ("_fill_table", "_step_batches"):
        setattr(st, name, timed(name, getattr(st, name)))
    for name in ("prepare", "pre_forward", "post_forward"):
        setattr(st.rt, name, timed(name, getattr(st.rt, name)))
    try:
        params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
        llm.generate([{"prompt_token_ids": list(range(3, 45))}], params, use_tqdm=False)
        assert canary.finish() == []
    finally:
        canary.remove()
    staged = ["_step_batches", "_fill_table", "prepare", "pre_forward"]
    expected = ["forward", *staged, "post_forward"] if mode == "log" else [*staged, "forward", "post_forward"]
    assert [name for name, _ in events] == expected * 3
    engine = threading.current_thread().name
    threads = {thread for name, thread in events if name != "forward"}
    if mode == "raise":
        assert threads == {engine}
    else:
        assert len(threads) == 1 and threads.pop().startswith("kvcanary-tail")


def test_raise_mode_runs_the_tail_inline_so_a_violation_fails_the_step_whose_read_found_it(llm):
    canary = kv.install(llm, backend="numpy", mode="raise")
    try:
        assert canary.state.tail is None
    finally:
        canary.remove()
    canary = kv.install(llm, backend="numpy")
    try:
        assert canary.state.tail is not None
    finally:
        canary.remove()


@pytest.mark.parametrize("seed", range(3))
def test_on_a_core_of_its_own_the_tail_thread_stages_during_the_forward_and_starts_the_tail_before_sampling_ends(
        llm, monkeypatch, seed):
    """A lone worker pinned to its cores leaves the others to vLLM's engine core (idle while the worker
    computes): the TAIL thread runs there, the step's staging and HEAD beside the forward (slowed here, 30 ms),
    its TAIL work from the forward's end (before the slowed sampling returns), and the engine thread waits for
    none of it before the forward starts."""
    cpu = max(os.sched_getaffinity(0))
    monkeypatch.setattr(canary_module, "idle_cores", lambda runner: frozenset({cpu}))
    runner = kv.find_runner(llm)
    events: list[str] = []
    forward = type(runner)._model_forward

    def slow_forward(self, *args, **kwargs):
        events.append("forward")
        out = forward(self, *args, **kwargs)
        time.sleep(0.03)
        events.append("forward returns")
        return out

    monkeypatch.setattr(type(runner), "_model_forward", slow_forward)
    slow_sampling(monkeypatch, runner, events)
    assert llm.reset_prefix_cache()
    canary = kv.install(llm, backend="host", sweep_interval=0)
    st = canary.state
    cores: set[frozenset[int]] = set()
    staged, work = st._stage_and_plan, st._tail_work

    def stage_and_plan(batch):
        events.append("staged")
        cores.add(frozenset(os.sched_getaffinity(0)))
        return staged(batch)

    def tail_work(*args):
        events.append("tail")
        cores.add(frozenset(os.sched_getaffinity(0)))
        return work(*args)

    st._stage_and_plan, st._tail_work = stage_and_plan, tail_work
    try:
        assert st.beside_forward and st.tail.cores == {cpu}
        new = 2 + seed
        params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
        llm.generate([{"prompt_token_ids": list(range(3, 40 + 9 * seed))}], params, use_tqdm=False)
        assert canary.finish() == []
        assert canary.steps == new
    finally:
        canary.remove()
    # per step: the staging starts beside the forward (either may log first) and is done before the slowed
    # forward returns; the TAIL work starts before the slowed sampling returns
    steps = [events[i:i + 5] for i in range(0, len(events), 5)]
    assert len(steps) == new and all(len(step) == 5 for step in steps)
    for step in steps:
        assert sorted(step[:2]) == ["forward", "staged"]
        assert step[2:] == ["forward returns", "tail", "sampled"]
    assert cores == {frozenset({cpu})}
