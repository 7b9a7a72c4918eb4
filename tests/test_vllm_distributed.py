"""The tensor-parallel helpers of the vLLM integration that need no vLLM: each rank's cores for
``VLLM_CPU_OMP_THREADS_BIND`` (vLLM's CPU docs: ranks separated by ``|``, each a list of CPU ids and ranges) and the
worker's rank read from the runner's copy of vLLM's parallel configuration."""

from __future__ import annotations

import types

import pytest

from kvcanary_cupy.integrations.vllm.distributed import thread_binding, worker_rank


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
