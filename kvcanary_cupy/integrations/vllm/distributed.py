"""The canary in vLLM's distributed engine: which worker a canary runs in, the CPU build's thread binding for
more than one worker, and the per-worker side of ``kvcanary simulate --engine vllm --tensor-parallel N``.

Every worker process of a tensor-parallel engine builds its own model runner over its own KV-head shard; the
plugin (or :func:`rpc_install`, through ``LLM.collective_rpc``) installs one canary in each, and each checks its
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


# -- the worker side of a tensor-parallel simulation (each function runs in every worker, via collective_rpc) -----


def rpc_install(worker: Any, options: Any, kind: str | None, inject_at: int, seed: int,
                fault_rank: int) -> tuple[int, str | None, list[str]]:
    """Install a canary (``options``, a ``CanaryOptions``) in ``worker``'s model runner, with the run's statistics
    observer and, on ``fault_rank`` only, an injector of ``kind``. Returns the worker's rank, why the canary is
    disabled there (None: it checks), and its install-time lines."""
    import logging

    from .hooks import VllmCanary
    from .simulate import WorkloadStats

    # the simulation's report carries every finding (as the in-process run's does): the worker's per-step
    # lines are held back
    logging.getLogger(options.logger).setLevel(logging.ERROR)
    runner = worker.model_runner
    canary = VllmCanary(runner, options)
    rank, _ = worker_rank(runner)
    canary.observers.append(WorkloadStats())
    if kind is not None and rank == fault_rank:
        from .faults import injector

        canary.observers.append(injector(kind, inject_at, seed=seed, rank=fault_rank))
    return rank, canary.disabled, canary.support.unchecked(options.real_kv_hash)


def rpc_collect(worker: Any) -> dict[str, Any]:
    """Read what the last step appended, remove the canary from ``worker``'s runner and return what it saw (plain
    data: it travels back to the engine's process)."""
    from .faults import Injector
    from .simulate import WorkloadStats

    runner = worker.model_runner
    canary = runner._kvcanary
    try:
        canary.finish()
    finally:
        canary.remove()
    st = canary.state
    stats = next(o for o in canary.observers if isinstance(o, WorkloadStats))
    fault = next((o.fault for o in canary.observers if isinstance(o, Injector)), None)
    rank, world = worker_rank(runner)
    return {"rank": rank, "world": world, "steps": canary.steps, "violations": canary.violations, "fault": fault,
            "stats": stats, "seconds": dict(st.seconds) if st else {}, "counters": st.counters() if st else {},
            "status_bits": st.status_bits if st else 0, "dropped": st.dropped if st else 0,
            "health_problems": list(st.health_problems) if st else [], "preemptions": canary.preemptions}


def rpc_zero_kv(worker: Any) -> int:
    """Zero every KV cache tensor of ``worker``'s model runner (between simulation runs, no request running): a
    fault that wrote raw bytes (a half-size element copy can make NaN patterns) would otherwise leave them in
    blocks a later run's requests get but never write in full, and vLLM's CPU attention reads a block's unwritten
    rows too (masked, but NaN survives the mask), so the later run's tokens would depend on the fault before it.
    Returns the number of tensors zeroed."""
    zeroed = 0
    pending = list(worker.model_runner.kv_caches)
    while pending:
        item = pending.pop()
        if isinstance(item, (list, tuple)):
            pending.extend(item)
        elif hasattr(item, "zero_"):
            item.zero_()
            zeroed += 1
    return zeroed
