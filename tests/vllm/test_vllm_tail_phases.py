"""Where and when a step's four phases run with the TAIL thread, driven without an engine (the stand-in runner of
``test_vllm_step.py``): work held after the forward waits for the runner's sampling (``release_tail``) and then
runs on the TAIL thread; on cores of its own the thread stages the step beside the forward, under a one-thread cap
on its host launches, and its TAIL work is never held; a step run inline in log mode (a connector that carries
the records) stages before the forward and runs its TAIL work on the caller's thread. Whichever way, a step
verifies and writes exactly the hand-worked counts and flags the one prefix position whose token changed, at the
step that reads it.

Each test fixes the TAIL thread's cores itself (``idle_cores``): what the process's CPU affinity leaves idle
decides where the work runs, and that differs between machines (and in a process forked after a vLLM engine bound
its threads)."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from test_vllm_step import LAYER, Row, Runner, canary_state, endpoint_counts, no_idle_cores, tokens

from kvcanary_cupy import hostcuda
from kvcanary_cupy.integrations.vllm import canary as canary_module


def own_core(monkeypatch: pytest.MonkeyPatch) -> int:
    """The TAIL thread given a core of its own (one this process may run on), as a lone worker's on vLLM's CPU
    build."""
    cpu = max(os.sched_getaffinity(0))
    monkeypatch.setattr(canary_module, "idle_cores", lambda runner: frozenset({cpu}))
    return cpu


def rows_of(seed: int) -> tuple[list[Row], list[Row], int]:
    """Step 0: A writes an 8-token prompt into blocks 1, 2. Step 1: B, whose prompt is A's with the token at
    position 5 changed, hits blocks 1, 2 (prefix 8) and computes 3 tokens into block 3. B's verify reads A's
    records at positions 0..7; only position 5 (block 2, offset 1: slot 9) holds another token than B's."""
    q = tokens(seed, 11)
    b_tokens = list(q)
    b_tokens[5] = q[5] + 1
    return [Row("A", q[:8], 0, 8, [1, 2])], [Row("B", b_tokens, 8, 3, [1, 2, 3])], 2 * 4 + 1


def forward(runner: Runner, md: dict, seed: int, step: int) -> dict[int, np.ndarray]:
    """The forward: random K/V where the slot mapping says; what attention wrote (the hooks' ``written``)."""
    gen = torch.Generator().manual_seed(seed * 1000 + step)
    for slot in md[LAYER].slot_mapping.tolist():
        runner.cache[slot // 4, :, slot % 4, :] = torch.rand(runner.cache.shape[1], runner.cache.shape[3],
                                                             generator=gen) + 1
    return {0: md[LAYER].slot_mapping.numpy().astype(np.int64)}


def read_steps(runner: Runner, state, seed: int) -> Iterator[tuple[int, object, dict]]:
    """The two steps of :func:`rows_of`, each as the state reads it: its index, the step read and the metadata."""
    first, second, _ = rows_of(seed)
    for step, rows in enumerate((first, second)):
        kwargs, md = runner.inputs(rows)
        yield step, state.read_step(kwargs, md), md


def spy_tail_work(state) -> list[str]:
    """The names of the threads that run the state's TAIL work, in order."""
    threads: list[str] = []
    work = state._tail_work
    state._tail_work = lambda *args: threads.append(threading.current_thread().name) or work(*args)
    return threads


def spy_handovers(state) -> list[str]:
    """The TAIL thread's ``hold`` and ``submit`` calls, in order."""
    calls: list[str] = []
    for name in ("submit", "hold"):
        method = getattr(state.tail, name)
        setattr(state.tail, name, lambda *args, _name=name, _method=method: calls.append(_name) or _method(*args))
    return calls


def expect_the_steps_results(state, slot: int) -> None:
    """Step 0 writes A's 8 tokens; step 1 verifies B's 8 prefix positions and writes its 3: per endpoint, 8 + 3
    entries written and 8 verified, one launch of each per step; one violation, B's changed token at step 1."""
    state.flush()
    assert endpoint_counts(state) == {"verify": (8, 2), "write": (8 + 3, 2)}
    assert {(v.step, v.violation.slot) for v in state.violations} == {(1, slot)}
    assert state.health_problems == [] and state.dropped == 0


@pytest.mark.parametrize("seed", range(4))
def test_held_tail_work_starts_only_at_the_release_and_runs_on_the_tail_thread(seed, monkeypatch):
    no_idle_cores(monkeypatch)
    runner = Runner()
    state = canary_state(runner)
    threads = spy_tail_work(state)
    calls = spy_handovers(state)
    slot = rows_of(seed)[2]
    for step, batch, md in read_steps(runner, state, seed):
        state.before_forward(batch)
        assert state.head_deferred  # the staging waits for the TAIL work
        state.after_forward(batch, forward(runner, md, seed, step), hold=True)
        assert calls[-1:] == ["hold"] and len(threads) == step and state.steps == step  # nothing runs yet
        state.release_tail()
        assert calls[-2:] == ["hold", "submit"]
        state.tail.join()
        assert len(threads) == step + 1 and state.steps == step + 1
    assert calls == ["hold", "submit"] * 2
    assert all(name.startswith("kvcanary-tail") for name in threads)
    expect_the_steps_results(state, slot)
    state.close()


@pytest.mark.parametrize("seed", range(4))
def test_on_a_core_of_its_own_the_tail_thread_stages_beside_the_forward_and_never_holds_the_tail_work(
        seed, monkeypatch):
    cpu = own_core(monkeypatch)
    runner = Runner()
    state = canary_state(runner)
    threads = spy_tail_work(state)
    calls = spy_handovers(state)
    staged: list[str] = []
    stage = state._stage_and_plan
    state._stage_and_plan = lambda batch: staged.append(threading.current_thread().name) or stage(batch)
    slot = rows_of(seed)[2]
    for step, batch, md in read_steps(runner, state, seed):
        state.before_forward(batch)
        assert not state.head_deferred
        state.tail.join()  # the staging ran on the TAIL thread before the TAIL work was even handed over
        assert len(staged) == step + 1 and len(threads) == step
        state.after_forward(batch, forward(runner, md, seed, step), hold=True)
        state.tail.join()  # not held: it runs without a release
        assert len(threads) == step + 1 and state.steps == step + 1
    assert calls == ["submit", "submit"] * 2  # the staging, then the TAIL work, of each step
    assert state.tail.pinned == {cpu}
    assert all(name.startswith("kvcanary-tail") for name in staged + threads)
    expect_the_steps_results(state, slot)
    state.close()


def test_the_staging_and_tail_work_beside_the_forward_cap_their_launches_to_the_tail_thread_alone(monkeypatch):
    # (no "host" in the name: the mutation runs' ``-k`` leaves such tests out)
    own_core(monkeypatch)
    caps: list[tuple[int, str]] = []
    cap = hostcuda.threads_on_this_thread

    @contextlib.contextmanager
    def spy(threads: int):
        caps.append((threads, threading.current_thread().name))
        with cap(threads):
            yield

    monkeypatch.setattr(hostcuda, "threads_on_this_thread", spy)
    runner = Runner()
    state = canary_state(runner)
    first, _second, _slot = rows_of(0)
    kwargs, md = runner.inputs(first)
    batch = state.read_step(kwargs, md)
    state.before_forward(batch)
    state.tail.join()
    assert len(caps) == 1 and caps[0][0] == 1 and caps[0][1].startswith("kvcanary-tail")
    state.after_forward(batch, forward(runner, md, 0, 0))
    state.settle()
    assert [c[0] for c in caps] == [1, 1] and state.steps == 1
    state.close()


@pytest.mark.parametrize("beside", [False, True])
@pytest.mark.parametrize("seed", range(3))
def test_an_inline_step_in_log_mode_stages_before_the_forward_and_runs_its_tail_on_the_callers_thread(
        seed, beside, monkeypatch):
    """As the hooks run a step whose records a connector saves with the KV: ``inline`` whatever the TAIL thread's
    cores, and ``hold`` ignored."""
    if beside:
        own_core(monkeypatch)
    else:
        no_idle_cores(monkeypatch)
    runner = Runner()
    state = canary_state(runner)
    threads = spy_tail_work(state)
    slot = rows_of(seed)[2]
    for step, batch, md in read_steps(runner, state, seed):
        before = state.rt.run_counters()
        state.before_forward(batch, inline=True)
        assert not state.head_deferred
        # the HEAD write (and at step 1 the HEAD verify) launched already, on this thread
        assert state.rt.run_counters() != before
        state.after_forward(batch, forward(runner, md, seed, step), inline=True, hold=True)
        assert threads == [threading.current_thread().name] * (step + 1) and state.steps == step + 1
    assert not state.tail.started
    expect_the_steps_results(state, slot)
    state.close()
