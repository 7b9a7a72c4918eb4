"""The CUDA kernels, executed by the host backend, against the NumPy reference: bit for bit.

Thousands of random batches per run (padding, SWA, LUTs, expected tokens, overflow, bs up to 70,000, and
hostile device values compared with the reference's ``on_invalid="flag"`` output and status bits). Launch
shapes are drawn too: the kernels must be correct for any grid. The last test reruns a slice of this file
with the host backend built under AddressSanitizer and UBSan, in a child process, and requires zero reports.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import strategies
from differential import chain_results_equal, run_chain, run_plan, run_scatter
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcanary_cupy.backends import resolve_backend, unavailable_reason
from kvcanary_cupy.backends.host import HOST_SHAPE
from kvcanary_cupy.backends.kernel_backend import KernelBackend, LaunchShape
from kvcanary_cupy.dlpack import CPU

pytestmark = pytest.mark.skipif(unavailable_reason("host") is not None,
                                reason=f"host backend: {unavailable_reason('host')}")

# Smaller example counts in the sanitized child, where every launch is several times slower.
SCALE = float(os.environ.get("KVCANARY_DIFFERENTIAL_SCALE", "1"))


def examples(n: int) -> int:
    return max(5, int(n * SCALE))


ODD_SHAPES = (
    HOST_SHAPE,
    LaunchShape(plan_offsets_block=32, plan_entries_grid=3, plan_entries_block=32, verify_grid=1, verify_block=32,
                write_grid_max=1, write_block=32, scatter_grid_max=1, scatter_block=32),
    LaunchShape(plan_offsets_block=1024, plan_entries_grid=5, plan_entries_block=96, verify_grid=3,
                verify_block=160, write_grid_max=3, write_block=64, scatter_grid_max=3, scatter_block=128),
)


def host_backend(shape: LaunchShape) -> KernelBackend:
    default = resolve_backend("host", CPU)
    return default if shape == HOST_SHAPE else KernelBackend("host", default._load_module, shape)


shapes = st.sampled_from(ODD_SHAPES)


def assert_same_plan(got: dict[str, np.ndarray], want: dict[str, np.ndarray], bs: int) -> None:
    for name in want:
        g, w = got[name], want[name]
        if name == "write.verify_offsets":  # scratch: only [0, bs] is defined by the contract
            g, w = g[: bs + 1], w[: bs + 1]
        np.testing.assert_array_equal(g, w, err_msg=name)


@settings(max_examples=examples(700))
@given(strategies.plan_cases(max_bs=16), shapes)
def test_plan_matches_reference(case, shape):
    assert_same_plan(run_plan(host_backend(shape), case), run_plan("numpy", case), case.bs)


@settings(max_examples=examples(400))
@given(strategies.plan_cases(max_bs=12, hostile=True), shapes)
def test_plan_flags_hostile_values_like_the_reference(case, shape):
    assert_same_plan(run_plan(host_backend(shape), case), run_plan("numpy", case), case.bs)


@settings(max_examples=examples(25))
@given(strategies.plan_cases(allow_large_bs=True, hostile=True))
def test_plan_matches_reference_up_to_70000_requests(case):
    assert_same_plan(run_plan("host", case), run_plan("numpy", case), case.bs)


@pytest.mark.parametrize("bs", [0, 1, 4095, 4096, 4097, 65_536, 70_000])
def test_plan_batch_size_boundaries(bs):
    rng = np.random.default_rng(bs)
    rows, width = 512, 8
    rpi = rng.integers(0, rows, size=bs).astype(np.int64)
    prefix = rng.integers(0, width + 1, size=bs).astype(np.int64)
    case = strategies.PlanCase(kwargs={
        "req_pool_indices": rpi, "prefix_lens": prefix, "extend_seq_lens": np.ones(bs, np.int64),
        "req_to_token": rng.integers(1, 1 << 20, size=(rows, width)).astype(np.int32), "swa_window_size": 0,
        "full_to_swa_index_mapping": None, "verify_capacity": max(1, int(prefix[rpi != 0].sum())),
        "req_to_verify_expected_tokens": None, "req_to_verify_expected_tokens_valid_lens": None,
        "kv_token_id_vs_position_offset": 0,
    }, write_req_capacity=max(1, bs))
    assert_same_plan(run_plan("host", case), run_plan("numpy", case), bs)


@settings(max_examples=examples(500))
@given(strategies.chain_cases(), shapes)
def test_write_and_verify_match_reference(case, shape):
    for got, want in zip(run_chain(host_backend(shape), case), run_chain("numpy", case), strict=True):
        chain_results_equal(got, want)


@settings(max_examples=examples(300))
@given(strategies.chain_cases(hostile=True), shapes)
def test_write_and_verify_flag_hostile_values_like_the_reference(case, shape):
    for got, want in zip(run_chain(host_backend(shape), case), run_chain("numpy", case), strict=True):
        chain_results_equal(got, want)


@settings(max_examples=examples(300))
@given(strategies.strided_chain_cases(), shapes)
def test_write_and_verify_over_strided_kv_layouts_match_reference(case, shape):
    for got, want in zip(run_chain(host_backend(shape), case), run_chain("numpy", case), strict=True):
        chain_results_equal(got, want)


@settings(max_examples=examples(150))
@given(strategies.strided_chain_cases(hostile=True), shapes)
def test_strided_kv_layouts_with_hostile_values_match_reference(case, shape):
    for got, want in zip(run_chain(host_backend(shape), case), run_chain("numpy", case), strict=True):
        chain_results_equal(got, want)


@settings(max_examples=examples(200))
@given(strategies.scatter_cases(hostile=True), shapes)
def test_scatter_matches_reference(case, shape):
    got_pool, got_status = run_scatter(host_backend(shape), case)
    want_pool, want_status = run_scatter("numpy", case)
    np.testing.assert_array_equal(got_pool, want_pool)
    assert got_status == want_status


def test_host_modules_match_the_sanitize_request():
    """In the sanitized child below this proves the kernels really ran instrumented; here, that they did not."""
    from kvcanary_cupy.backends import host_sanitize_requested

    module = resolve_backend("host", CPU)._load_module("plan.cu")
    assert module.sanitize is host_sanitize_requested()


def test_sanitized_differential_run_has_zero_reports(tmp_path: Path):
    """A slice of this file under ASan + UBSan (each a hard error): the child must pass and print no report."""
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
        "KVCANARY_DIFFERENTIAL_SCALE": "0.15",
        "PYTHONFAULTHANDLER": "1",
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
    assert " passed" in output and "skipped" not in output.split(" passed")[-1], output[-2000:]
