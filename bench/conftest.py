"""Shared setup of the benchmark suites (see bench/README.md).

* ``tests/`` goes on ``sys.path`` so the suites can time the scalar oracle (``tests/oracle.py``).
* Items marked ``gpu`` are skipped with a reason where no CUDA device is visible (as in ``tests/``).
* The ``measure`` fixture runs one benchmark row and labels it (group, role, entries) in ``extra_info``.
* When a JSON report is written, ``ns_per_entry`` and the ratios between rows of the same group
  (floor, baseline, oracle) are added to each row's ``extra_info`` by :func:`render.add_ratios`, from the
  timings of this very run, and the machine (CPU model, GPU name, library versions) to ``machine_info``.
"""

from __future__ import annotations

import functools
import gc
import importlib.util
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

# bench_vllm.py runs in vLLM's own environment (`make bench-vllm`); one without vLLM does not collect it.
# (the real package: tests/vllm itself would pass for a namespace package named vllm when tests/ is on sys.path)
_VLLM = importlib.util.find_spec("vllm")
collect_ignore = [] if _VLLM is not None and _VLLM.origin not in (None, "namespace") else ["bench_vllm.py"]

BENCH_DIR = Path(__file__).resolve().parent
ROOT = BENCH_DIR.parent
for _path in (BENCH_DIR, ROOT / "tests"):
    if str(_path) not in sys.path:
        sys.path.append(str(_path))

import render  # noqa: E402  (bench/ is on sys.path from here on)

from kvcanary_cupy.backends import unavailable_reason  # noqa: E402

# A row whose warm-up call takes longer than this is timed over a fixed, small number of rounds instead
# of pytest-benchmark's calibrated loop (keeps `make bench` to a few minutes on a 2-core machine).
SLOW_CALL_S = 0.2
SLOW_ROUNDS = 3
SETUP_ROUNDS = 60  # rounds of a row whose every call has an untimed setup


_LOAD_AT_START: list[float] = []


def _load_average() -> float | None:
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def pytest_configure(config: pytest.Config) -> None:
    path = config.getoption("benchmark_json", None)
    if isinstance(path, (str, os.PathLike)):  # older pytest-benchmark versions hand over an open file
        Path(path).parent.mkdir(parents=True, exist_ok=True)
    load = _load_average()
    if load is not None:
        _LOAD_AT_START.append(load)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reason = None
    for item in items:
        # This hook sees the whole session (tests/ too): only label the benchmarks of this folder.
        if not Path(item.path).is_relative_to(BENCH_DIR):
            continue
        if "gpu" in item.keywords and not any(m.name == "skip" for m in item.iter_markers()):
            if reason is None:
                reason = unavailable_reason("cuda") or ""
            if reason:
                item.add_marker(pytest.mark.skip(reason=f"GPU benchmark: {reason}"))


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def gpu_info() -> dict[str, Any]:
    """Name and versions of the first CUDA device, or {} where none is visible."""
    if unavailable_reason("cuda") is not None:
        return {}
    import cupy

    props = cupy.cuda.runtime.getDeviceProperties(0)
    name = props["name"]
    return {
        "gpu_name": name.decode() if isinstance(name, bytes) else str(name),
        "gpu_count": int(cupy.cuda.runtime.getDeviceCount()),
        "gpu_sm_count": int(props["multiProcessorCount"]),
        "cuda_runtime_version": int(cupy.cuda.runtime.runtimeGetVersion()),
        "cuda_driver_version": int(cupy.cuda.runtime.driverGetVersion()),
        "cupy_version": cupy.__version__,
    }


def pytest_benchmark_update_machine_info(config: pytest.Config, machine_info: dict[str, Any]) -> None:
    machine_info["cpu_model"] = cpu_model()
    machine_info["cpu_count"] = os.cpu_count()
    machine_info["numpy_version"] = np.__version__
    if _LOAD_AT_START:
        machine_info["load_avg_start"] = _LOAD_AT_START[0]
        machine_info["load_avg_end"] = _load_average()
    machine_info.update(gpu_info())


def pytest_benchmark_update_json(config: pytest.Config, benchmarks: Any, output_json: dict[str, Any]) -> None:
    render.add_ratios(output_json["benchmarks"])


def _without_gc(fn: Callable[[], Any]) -> Callable[[], Any]:
    """``fn`` with the cyclic garbage collector paused during the call, as ``timeit`` does: a collection
    triggered by the oracle's millions of Python ints would otherwise land in whichever round it falls."""
    def run() -> Any:
        enabled = gc.isenabled()
        gc.disable()
        try:
            return fn()
        finally:
            if enabled:
                gc.enable()

    return run


def _measure(benchmark: Any, fn: Callable[[], Any], *, group: str, label: str, role: str, entries: int,
            key: str, rounds: int | None = None, warmup: bool = True, setup: Callable[[], Any] | None = None,
            **info: Any) -> None:
    """Time ``fn`` as one row of ``group``.

    ``role``: "subject" (an implementation under test), "info" (another implementation, for comparison),
    "floor", "baseline" or "oracle" (the rows ratios are taken against). ``entries``: work items of one
    call (verify entries, written tokens), for ns per entry. ``key``: stable id used by render.py's target
    table. ``rounds``: fixed rounds (no warm-up unless asked) instead of pytest-benchmark's calibration.
    ``setup``: run before every call, untimed (e.g. evicting the caches); the row then takes ``rounds`` rounds
    (SETUP_ROUNDS by default) of one call each.
    Each row starts after a full garbage collection and runs with the collector paused during its calls.
    With ``--benchmark-disable`` the function runs exactly once.
    """
    benchmark.group = group
    benchmark.extra_info.update(label=label, role=role, entries=int(entries), key=key, **info)
    fn = _without_gc(fn)
    gc.collect()
    if benchmark.disabled:
        if setup is not None:
            setup()
        benchmark(fn)
        return
    if setup is not None:
        benchmark.pedantic(fn, setup=setup, rounds=rounds or SETUP_ROUNDS, iterations=1,
                           warmup_rounds=1 if warmup else 0)
        return
    if rounds is not None:
        benchmark.pedantic(fn, rounds=rounds, iterations=1, warmup_rounds=1 if warmup else 0)
        return
    start = time.perf_counter()
    fn()  # warm-up: first-touch page faults, caches, compiled kernels
    if time.perf_counter() - start > SLOW_CALL_S:
        benchmark.pedantic(fn, rounds=SLOW_ROUNDS, iterations=1)
    else:
        benchmark(fn)


@pytest.fixture
def measure(benchmark: Any) -> Callable[..., None]:
    """``measure(fn, group=..., label=..., role=..., entries=..., key=...)``: see :func:`_measure`."""
    return functools.partial(_measure, benchmark)
