"""The canary in vLLM's distributed engine: which worker a canary runs in, the CPU build's thread binding for
more than one worker, and the cores a lone worker leaves to vLLM's engine core.

Every worker process of a tensor-parallel engine builds its own model runner over its own KV-head shard; the
plugin (or ``kvcanary simulate --engine vllm --tensor-parallel N`` through ``LLM.collective_rpc``:
:func:`.simulate.rpc_install`) installs one canary in each, and each checks its
own shard against the request state it holds (every rank holds every request's token ids). Nothing crosses
ranks: a rank's findings are its own, logged by its own process and tagged with its rank.

vLLM's CPU build binds each worker's OpenMP threads to a NUMA node by default and refuses more workers than NUMA
nodes (``Not enough allowed NUMA nodes to bind threads``); its CPU docs have the operator list each rank's cores
in ``VLLM_CPU_OMP_THREADS_BIND`` (``0-31|32-63``). :func:`thread_binding` splits the CPUs this process may use
that way. The plugin does not set the variable: it is read by the executor before any worker exists, from a
process where the plugin cannot know the tensor-parallel size, and it decides where the engine's own threads run.
"""

from __future__ import annotations

import os
from typing import Any

from ..._errors import fail

THREADS_BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"


def worker_rank(runner: Any) -> tuple[int, int]:
    """``(rank, world_size)`` of the worker that owns ``runner``, from the runner's copy of vLLM's parallel
    configuration (``(0, 1)`` for a runner without one)."""
    parallel = getattr(getattr(runner, "vllm_config", None), "parallel_config", None)
    rank = getattr(parallel, "rank", 0)
    world = getattr(parallel, "world_size", 1)
    return (rank if isinstance(rank, int) else 0), (world if isinstance(world, int) and world > 0 else 1)


def idle_cores(runner: Any) -> frozenset[int] | None:
    """The CPUs this process may use outside the calling (worker) thread's own, when the worker is its engine's
    only one (no tensor, pipeline or data parallelism); None otherwise, or where there are none.

    vLLM's CPU build binds a worker's threads to its cores and reserves the others for the engine core's
    process (``vllm/utils/ompmultiprocessing.py``), which waits for the worker's output while the worker
    computes: the canary's TAIL thread can run there without taking a core from the forward or from sampling.
    With more than one worker the cores outside this one's are another worker's, so none is taken."""
    parallel = getattr(getattr(runner, "vllm_config", None), "parallel_config", None)
    if worker_rank(runner)[1] != 1 or getattr(parallel, "data_parallel_size", 1) != 1:
        return None
    try:
        mine = os.sched_getaffinity(0)
    except (AttributeError, OSError):  # a platform without it
        return None
    spare = frozenset(range(os.cpu_count() or 0)) - mine
    return spare or None


def thread_binding(workers: int, cpus: list[int] | None = None) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for ``workers`` local workers: the CPUs this process may run on (or
    ``cpus``), split into that many contiguous, equal lists (``"0|1"`` on two CPUs, ``"0-3|4-7"`` on eight)."""
    allowed = sorted(os.sched_getaffinity(0) if cpus is None else cpus)
    if workers < 1:
        fail(f"workers must be at least 1, got {workers}")
    if len(allowed) < workers:
        fail(f"{workers} workers need at least {workers} CPUs to bind their threads to, this process may use "
             f"{len(allowed)}")
    share = len(allowed) // workers
    parts = []
    for w in range(workers):
        mine = allowed[w * share:(w + 1) * share]
        runs: list[str] = []
        start = prev = mine[0]
        for cpu in [*mine[1:], None]:
            if cpu is not None and cpu == prev + 1:
                prev = cpu
                continue
            runs.append(str(start) if start == prev else f"{start}-{prev}")
            if cpu is not None:
                start = prev = cpu
        parts.append(",".join(runs))
    return "|".join(parts)
