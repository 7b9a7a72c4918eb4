"""The paged-layout plan kernels, executed by the host backend, against the NumPy reference: bit for bit.

Block tables (request-pool rows and batch rows) and CSR page lists, valid and hostile, on odd launch shapes.
The last test reruns this file under AddressSanitizer and UBSan in a child process and requires zero reports.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from differential import host_threads, run_plan
from hypothesis import given, settings
from hypothesis import strategies as st
from layout_strategies import layout_cases
from test_host_vs_reference import ODD_SHAPES, THREADS, assert_same_plan, host_backend

from kvcanary_cupy.backends import unavailable_reason

pytestmark = pytest.mark.skipif(unavailable_reason("host") is not None,
                                reason=f"host backend: {unavailable_reason('host')}")

SCALE = float(os.environ.get("KVCANARY_DIFFERENTIAL_SCALE", "1"))


def examples(n: int) -> int:
    return max(5, int(n * SCALE))


shapes = st.sampled_from(ODD_SHAPES)
threads = st.sampled_from(THREADS)


@settings(max_examples=examples(500))
@given(layout_cases(), shapes, threads)
def test_paged_plan_matches_reference(case, shape, n_threads):
    with host_threads(n_threads):
        got = run_plan(host_backend(shape), case)
    assert_same_plan(got, run_plan("numpy", case), case.bs)


@settings(max_examples=examples(600))
@given(layout_cases(hostile=True), shapes, threads)
def test_paged_plan_flags_hostile_values_like_the_reference(case, shape, n_threads):
    with host_threads(n_threads):
        got = run_plan(host_backend(shape), case)
    assert_same_plan(got, run_plan("numpy", case), case.bs)


def test_sanitized_paged_run_has_zero_reports():
    """This file under ASan + UBSan (each a hard error): the child must pass and print no report."""
    from kvcanary_cupy.hostcuda import sanitizer_preload

    preload = sanitizer_preload()
    if not Path(preload).is_file():
        pytest.skip(f"g++ has no AddressSanitizer runtime ({preload})")
    env = {
        **os.environ,
        "LD_PRELOAD": preload,
        "ASAN_OPTIONS": "detect_leaks=0:abort_on_error=1",
        "UBSAN_OPTIONS": "print_stacktrace=1:halt_on_error=1",
        "KVCANARY_HOST_SANITIZE": "1",
        "KVCANARY_DIFFERENTIAL_SCALE": "0.3",
        "PYTHONFAULTHANDLER": "1",
        "KVCANARY_HOST_THREADS": "4",
    }
    tests_dir = Path(__file__).parent
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:benchmark",
         str(Path(__file__)), "-k", "not sanitized", "--rootdir", str(tests_dir.parent)],
        env=env, cwd=tests_dir.parent, capture_output=True, text=True, timeout=1500,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    assert "AddressSanitizer" not in output and "runtime error" not in output, output[-6000:]
    assert "3 passed" in output, output[-2000:]


def test_host_module_instrumentation_follows_the_request():
    """In the child above this proves the paged kernels really ran instrumented; here, that they did not."""
    from kvcanary_cupy.backends import host_sanitize_requested, resolve_backend
    from kvcanary_cupy.dlpack import CPU

    assert resolve_backend("host", CPU)._load_module("plan.cu").sanitize is host_sanitize_requested()
