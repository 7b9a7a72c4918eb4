"""The host backend on a pool of OS threads: the same launches with 1 and with 2 OS threads.

Four groups, each on the same inputs in the same process: a 32,768-entry verify (32 requests × 1,024 cached
tokens, an expected-token pool) and a 32-request × 1,024-token write, each called two ways:

* ``bound``: the launch as the engine runtime runs it every step (``backend.prepare``: kernel arguments
  built and packed once, at bind time), so the figure is the kernels' and the pool's alone;
* ``call``: ``backend.verify`` / ``backend.write`` on an already validated launch, which also builds the
  kernel arguments in Python at every call (work that stays on the calling thread).

Rows: ``threads=1`` (the baseline) and ``threads=2``, and, where the process may use more than 2 cores,
all of them. ``speedup_vs_baseline`` of the 2-thread rows is the figure docs/costs.md quotes
(target: >= 1.7x on a quiet 2-core machine).

Rows run one after another, so a change in the machine's load between them lands in the ratio. Each
multi-thread row therefore also records ``alternating_speedup``: the median over 31 pairs of back-to-back
1-thread and N-thread calls of their time ratio; ``cpu_per_wall``: the process's CPU seconds per wall
second during the N-thread calls of those pairs (close to N when the cores were free for it, below 1 when
other work took them); and the 1-minute load average while it was measured.
Before any timing, each group checks that the outputs are bit-identical with 1 and with N threads.
"""

from __future__ import annotations

import os
import resource
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import pytest
from bench_cpu import verify_setup, write_setup
from workloads import Batch

from kvcanary_cupy.backends import unavailable_reason
from kvcanary_cupy.backends.host import make_host_backend
from kvcanary_cupy.verify import prepare_verify_launch
from kvcanary_cupy.write import prepare_write_launch

HOST_REASON = unavailable_reason("host")
pytestmark = pytest.mark.skipif(HOST_REASON is not None, reason=f"host backend: {HOST_REASON}")

VERIFY = Batch(32, 1024)  # 32,768 verify entries
WRITE = Batch(32, 1024, extend=1024, tokens=False)  # 32 requests × 1,024 new tokens
CORES = len(os.sched_getaffinity(0))
THREAD_COUNTS = sorted({1, 2, CORES})
PAIRS = 31


def _backends() -> dict[int, Any]:
    return {n: make_host_backend(threads=n) for n in THREAD_COUNTS}


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _alternating_speedup(one: Callable[[], Any], many: Callable[[], Any]) -> tuple[float, float]:
    """Median time ratio of back-to-back (one, many) calls, and CPU seconds per wall second of ``many``."""
    ratios = []
    wall = cpu = 0.0
    for _ in range(PAIRS):
        start = time.perf_counter()
        one()
        mid = time.perf_counter()
        cpu_start = _cpu_seconds()
        many()
        end = time.perf_counter()
        cpu += _cpu_seconds() - cpu_start
        wall += end - mid
        ratios.append((mid - start) / (end - mid))
    return float(np.median(ratios)), cpu / wall


def _label(threads: int) -> str:
    return f"host backend, {threads} OS thread{'s' if threads > 1 else ''}"


def _rows(measure, group: str, entries: int, key: str, calls: Mapping[int, Callable[[], Any]], threads: int) -> None:
    info: dict[str, Any] = {"threads": threads, "cores": CORES}
    if threads > 1:
        calls[1]()
        calls[threads]()
        info["alternating_speedup"], info["cpu_per_wall"] = _alternating_speedup(calls[1], calls[threads])
        info["load_avg_1min"] = os.getloadavg()[0]
    measure(calls[threads], group=group, label=_label(threads), entries=entries, key=f"{key}.t{threads}",
            role="baseline" if threads == 1 else "subject", **info)


def _verify_outputs(backend: Any) -> list[np.ndarray]:
    setup = verify_setup(VERIFY)
    ctx = setup.context
    ctx.violation_write_index[0] = 0
    ctx.status[0] = 0
    backend.verify(prepare_verify_launch(**setup.launch_kwargs(VERIFY)))
    return [ctx.violation_ring.copy(), ctx.violation_write_index.copy(), ctx.status.copy()]


def _write_outputs(backend: Any) -> list[np.ndarray]:
    setup = write_setup(WRITE)
    ctx = setup.context
    ctx.canary_buf.fill(0)
    ctx.violation_write_index[0] = 0
    ctx.status[0] = 0
    backend.write(prepare_write_launch(**setup.launch_kwargs(), expected_input_tokens=None,
                                       expected_input_positions=None))
    return [ctx.canary_buf.copy(), ctx.violation_ring.copy(), ctx.violation_write_index.copy(), ctx.status.copy()]


def _calls(backends: Mapping[int, Any], step: str, launch: Any, path: str) -> dict[int, Callable[[], Any]]:
    if path == "bound":
        return {n: b.prepare(step, launch) for n, b in backends.items()}
    return {n: (lambda b=b: getattr(b, step)(launch)) for n, b in backends.items()}


@pytest.mark.parametrize("path", ["bound", "call"])
@pytest.mark.parametrize("threads", THREAD_COUNTS)
def test_verify_host_threads(measure, threads, path):
    backends = _backends()
    want = _verify_outputs(backends[1])
    assert int(want[1][0]) == 0, "the verify workload must be clean"
    for got, expected in zip(_verify_outputs(backends[threads]), want, strict=True):
        np.testing.assert_array_equal(got, expected)
    launch = prepare_verify_launch(**verify_setup(VERIFY).launch_kwargs(VERIFY))
    _rows(measure, f"host threads · {path} verify · {VERIFY.describe()}", VERIFY.verify_entries,
          f"cpu.threads.{path}.verify", _calls(backends, "verify", launch, path), threads)


@pytest.mark.parametrize("path", ["bound", "call"])
@pytest.mark.parametrize("threads", THREAD_COUNTS)
def test_write_host_threads(measure, threads, path):
    backends = _backends()
    want = _write_outputs(backends[1])
    for got, expected in zip(_write_outputs(backends[threads]), want, strict=True):
        np.testing.assert_array_equal(got, expected)
    setup = write_setup(WRITE)
    launch = prepare_write_launch(**setup.launch_kwargs(), expected_input_tokens=None, expected_input_positions=None)
    _rows(measure, f"host threads · {path} write · {WRITE.describe('write')}", WRITE.write_tokens,
          f"cpu.threads.{path}.write", _calls(backends, "write", launch, path), threads)
