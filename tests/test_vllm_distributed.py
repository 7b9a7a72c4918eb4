"""The tensor-parallel helpers of the vLLM integration that need no vLLM: each rank's cores for
``VLLM_CPU_OMP_THREADS_BIND`` (vLLM's CPU docs: ranks separated by ``|``, each a list of CPU ids and ranges), the
worker's rank read from the runner's copy of vLLM's parallel configuration, and the cores a lone worker leaves to
vLLM's engine core."""

from __future__ import annotations

import types

import pytest

from kvcanary_cupy.integrations.vllm import distributed
from kvcanary_cupy.integrations.vllm.distributed import idle_cores, thread_binding, worker_rank


@pytest.mark.parametrize(("workers", "cpus", "binding"), [
    (2, [0, 1], "0|1"),
    (2, list(range(8)), "0-3|4-7"),
    (2, [5, 0, 3, 2], "0,2|3,5"),  # sorted, then split; gaps written as lists
    (3, list(range(7)), "0-1|2-3|4-5"),  # an even share each; the CPU left over is not used
    (1, [4, 5, 6, 9], "4-6,9"),
])
def test_thread_binding_splits_the_allowed_cpus_evenly_between_the_workers(workers, cpus, binding):
    assert thread_binding(workers, cpus) == binding


def test_thread_binding_of_this_process_uses_only_cpus_it_may_run_on():
    import os

    allowed = sorted(os.sched_getaffinity(0))
    parts = thread_binding(1).split(",")
    ids = [i for part in parts for i in (range(int(part.split("-")[0]), int(part.split("-")[-1]) + 1))]
    assert ids == allowed


@pytest.mark.parametrize(("workers", "cpus", "message"), [
    (2, [0], "2 workers need at least 2 CPUs to bind their threads to, this process may use 1"),
    (0, [0, 1], "workers must be at least 1, got 0"),
])
def test_thread_binding_refuses_what_cannot_be_split(workers, cpus, message):
    with pytest.raises(ValueError, match=r"^kv-canary: " + message):
        thread_binding(workers, cpus)


def test_worker_rank_reads_the_runners_parallel_config():
    parallel = types.SimpleNamespace(rank=1, world_size=2)
    runner = types.SimpleNamespace(vllm_config=types.SimpleNamespace(parallel_config=parallel))
    assert worker_rank(runner) == (1, 2)
    assert worker_rank(types.SimpleNamespace()) == (0, 1)  # a runner without one: a single worker


def _runner(world_size: int = 1, data_parallel_size: int = 1) -> types.SimpleNamespace:
    parallel = types.SimpleNamespace(rank=0, world_size=world_size, data_parallel_size=data_parallel_size)
    return types.SimpleNamespace(vllm_config=types.SimpleNamespace(parallel_config=parallel))


@pytest.mark.parametrize(("mine", "cpus", "runner", "idle"), [
    ({0}, 2, _runner(), {1}),  # vLLM's CPU worker on core 0, its engine core on core 1
    ({0, 1}, 4, _runner(), {2, 3}),
    ({2}, 4, types.SimpleNamespace(), {0, 1, 3}),  # a runner without a parallel config: one worker
    ({0, 1}, 2, _runner(), None),  # the worker may use every core: none is idle
    ({0}, 2, _runner(world_size=2), None),  # tensor parallel: the other core is the other worker's
    ({0}, 4, _runner(data_parallel_size=2), None),  # data parallel: another engine's worker is out there
])
def test_idle_cores_are_those_a_lone_worker_leaves_to_the_engine_core(monkeypatch, mine, cpus, runner, idle):
    monkeypatch.setattr(distributed.os, "sched_getaffinity", own_affinity(mine))
    monkeypatch.setattr(distributed.os, "cpu_count", lambda: cpus)
    assert idle_cores(runner) == (None if idle is None else frozenset(idle))


def own_affinity(mine: set[int]):
    """``os.sched_getaffinity`` of a process whose calling thread may run on ``mine``, and another process (pid 1)
    on every other CPU: only pid 0 (the caller) answers ``mine``."""
    def affinity(pid: int) -> set[int]:
        return set(mine) if pid == 0 else set(range(64)) - set(mine)

    return affinity


@pytest.mark.parametrize("mine", [{0}, {1}, {2, 3}])
def test_idle_cores_are_none_where_the_cpu_count_is_unknown(monkeypatch, mine):
    monkeypatch.setattr(distributed.os, "sched_getaffinity", own_affinity(mine))
    monkeypatch.setattr(distributed.os, "cpu_count", lambda: None)
    assert idle_cores(_runner()) is None


def test_idle_cores_are_none_where_the_platform_cannot_tell(monkeypatch):
    def refuse(pid):
        raise OSError("not here")

    monkeypatch.setattr(distributed.os, "sched_getaffinity", refuse)
    assert idle_cores(_runner()) is None
