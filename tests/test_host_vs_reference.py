"""The CUDA kernels, executed by the host backend, against the NumPy reference: bit for bit.

Thousands of random batches per run (padding, SWA, LUTs, expected tokens, overflow, bs up to 70,000, and
hostile device values compared with the reference's ``on_invalid="flag"`` output and status bits). Launch
shapes are drawn too: the kernels must be correct for any grid; so is the number of OS threads the blocks
run on (1, 2 or 4), and the pool's results must equal one thread's. The last tests rerun a slice of this
file with the host backend built under AddressSanitizer and UBSan, and under ThreadSanitizer, in child
processes, and require zero reports.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import strategies
from differential import chain_results_equal, host_threads, run_chain, run_plan, run_scatter
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
    # Many small blocks: the most interleaving between the OS threads of the pool.
    LaunchShape(plan_offsets_block=64, plan_entries_grid=16, plan_entries_block=32, verify_grid=16,
                verify_block=32, write_grid_max=16, write_block=32, scatter_grid_max=16, scatter_block=32,
                transfer_grid_max=16, transfer_block=32),
)
MANY_BLOCKS = ODD_SHAPES[-1]
#: OS threads a host launch runs on; more than this machine's cores is fine (and interleaves more).
THREADS = (1, 2, 4)


def host_backend(shape: LaunchShape) -> KernelBackend:
    default = resolve_backend("host", CPU)
    return default if shape == HOST_SHAPE else KernelBackend("host", default._load_module, shape)


shapes = st.sampled_from(ODD_SHAPES)
threads = st.sampled_from(THREADS)


def assert_same_plan(got: dict[str, np.ndarray], want: dict[str, np.ndarray], bs: int) -> None:
    for name in want:
        g, w = got[name], want[name]
        if name == "write.verify_offsets":  # scratch: only [0, bs] is defined by the contract
            g, w = g[: bs + 1], w[: bs + 1]
        np.testing.assert_array_equal(g, w, err_msg=name)


@settings(max_examples=examples(700))
@given(strategies.plan_cases(max_bs=16), shapes, threads)
def test_plan_matches_reference(case, shape, n_threads):
    with host_threads(n_threads):
        got = run_plan(host_backend(shape), case)
    assert_same_plan(got, run_plan("numpy", case), case.bs)


@settings(max_examples=examples(400))
@given(strategies.plan_cases(max_bs=12, hostile=True), shapes, threads)
def test_plan_flags_hostile_values_like_the_reference(case, shape, n_threads):
    with host_threads(n_threads):
        got = run_plan(host_backend(shape), case)
    assert_same_plan(got, run_plan("numpy", case), case.bs)


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
@given(strategies.chain_cases(), shapes, threads)
def test_write_and_verify_match_reference(case, shape, n_threads):
    with host_threads(n_threads):
        results = run_chain(host_backend(shape), case)
    for got, want in zip(results, run_chain("numpy", case), strict=True):
        chain_results_equal(got, want)


@settings(max_examples=examples(300))
@given(strategies.chain_cases(hostile=True), shapes, threads)
def test_write_and_verify_flag_hostile_values_like_the_reference(case, shape, n_threads):
    with host_threads(n_threads):
        results = run_chain(host_backend(shape), case)
    for got, want in zip(results, run_chain("numpy", case), strict=True):
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
@given(strategies.scatter_cases(hostile=True), shapes, threads)
def test_scatter_matches_reference(case, shape, n_threads):
    with host_threads(n_threads):
        got_pool, got_status = run_scatter(host_backend(shape), case)
    want_pool, want_status = run_scatter("numpy", case)
    np.testing.assert_array_equal(got_pool, want_pool)
    assert got_status == want_status


@settings(max_examples=examples(150))
@given(strategies.chain_cases(hostile=True), strategies.plan_cases(max_bs=12, hostile=True),
       st.sampled_from(THREADS[1:]), st.sampled_from((HOST_SHAPE, MANY_BLOCKS)))
def test_thread_pool_results_equal_one_thread(chain_case, plan_case, n_threads, shape):
    """Everything bit for bit, except the order of the violation rows a launch appends (atomics)."""
    backend = host_backend(shape)
    with host_threads(1):
        want_chain, want_plan = run_chain(backend, chain_case), run_plan(backend, plan_case)
    with host_threads(n_threads):
        got_chain, got_plan = run_chain(backend, chain_case), run_plan(backend, plan_case)
    for got, want in zip(got_chain, want_chain, strict=True):
        chain_results_equal(got, want)
    for name in want_plan:
        np.testing.assert_array_equal(got_plan[name], want_plan[name], err_msg=name)


@settings(max_examples=examples(12), deadline=None)
@given(strategies.chain_cases(hostile=True, max_reqs=64, max_tokens=200), st.sampled_from(THREADS[1:]))
def test_thread_pool_grids_of_large_launches_equal_one_thread(case, n_threads):
    """Launches of thousands of entries: the default host shape gives them one block per 1,024 on the pool."""
    backend = host_backend(HOST_SHAPE)
    with host_threads(1):
        want = run_chain(backend, case)
    with host_threads(n_threads):
        got = run_chain(backend, case)
    for g, w in zip(got, want, strict=True):
        chain_results_equal(g, w)


def test_host_modules_match_the_sanitize_request():
    """In the sanitized child below this proves the kernels really ran instrumented; here, that they did not."""
    from kvcanary_cupy.backends import host_sanitize_requested, host_sanitizer_requested

    module = resolve_backend("host", CPU)._load_module("plan.cu")
    assert module.sanitize is host_sanitize_requested()
    assert module.sanitizer == host_sanitizer_requested()


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
        "KVCANARY_HOST_THREADS": "4",
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


@pytest.mark.parametrize("shape", ODD_SHAPES)
@pytest.mark.parametrize("seed", range(4))
def test_write_offsets_out_of_order_flag_and_skip_like_the_reference(shape, seed):
    """Sorted offsets with a few moved anywhere in the token range (a backward step, sometimes late in the
    batch): the host kernels skip exactly the requests the reference skips, set WRITE_OFFSETS_OUT_OF_ORDER,
    and write every other byte the same; the scalar oracle agrees."""
    import oracle

    import kvcanary_cupy as kc
    from kvcanary_cupy.write import prepare_write_launch

    rng = np.random.default_rng(seed)
    tokens, requests, num_slots = 40, 30, 64
    offsets = np.sort(rng.integers(0, tokens + 1, requests + 1))
    moved = rng.choice(np.arange(1, requests), size=6, replace=False)
    offsets[moved] = rng.integers(0, tokens + 1, moved.shape[0])  # out of order
    slots = rng.permutation(num_slots)
    # distinct write slots, and seeds the launch does not write: the requests written never race (SPEC §4)
    locs = slots[:tokens]
    seeds = rng.choice(np.append(slots[tokens:], -1), requests)
    ids, positions = rng.integers(0, 1 << 20, tokens), rng.integers(0, 50, tokens)
    canary = rng.integers(0, 256, (num_slots, 32), np.uint8)
    results = []
    for backend in (host_backend(shape), resolve_backend("numpy", CPU, "flag")):
        ctx = kc.VerifyOrWriteContext.allocate(num_slots=num_slots, ring_capacity=64,
                                               enable_chain_position_assert=True)
        ctx.canary_buf[...] = canary
        wp = kc.WritePlan.from_tensors(write_offsets=offsets.copy(), write_seed_slot_indices=seeds.copy(),
                                       write_num_valid_reqs=np.array([requests], np.int32))
        backend.write(prepare_write_launch(context=ctx, plan=wp, input_ids=ids, positions=positions,
                                           out_cache_loc=locs, enable_write_input_assert=False,
                                           expected_input_tokens=None, expected_input_positions=None))
        results.append(ctx)
    got, want = results
    assert int(want.status[0]) & int(kc.CanaryStatus.WRITE_OFFSETS_OUT_OF_ORDER)
    for name in ("canary_buf", "violation_write_index", "slot_run_counter", "kernel_run_counter", "status"):
        np.testing.assert_array_equal(getattr(got, name), getattr(want, name), err_msg=name)
    rows = int(want.violation_write_index[0])
    assert sorted(map(tuple, got.violation_ring[:rows])) == sorted(map(tuple, want.violation_ring[:rows]))

    state = oracle.CanaryState.from_arrays(canary, np.zeros((64, 8), np.int64))
    oracle.write_oracle(state, kernel_kind=int(kc.CanaryLaunchTag.HEAD_K_FULL), write_offsets=offsets,
                        write_seed_slot_indices=seeds, write_num_valid_reqs=requests, input_ids=ids,
                        positions=positions, out_cache_loc=locs, enable_write_input_assert=False,
                        expected_input_tokens=None, expected_input_positions=None, sources=[], mode=0,
                        enable_chain_position_assert=1)
    assert state.status == int(want.status[0]) and state.slot_run_counter == int(want.slot_run_counter[0])
    np.testing.assert_array_equal(np.array(state.fields, np.int64), want.canary_buf.view(np.int64)[:, :4])

def test_thread_sanitized_differential_run_has_zero_reports(tmp_path: Path):
    """A smaller slice under ThreadSanitizer, blocks on 4 OS threads: the child must pass with no report."""
    from kvcanary_cupy.hostcuda import sanitizer_preload

    preload = sanitizer_preload("thread")
    if not Path(preload).is_file():
        pytest.skip(f"g++ has no ThreadSanitizer runtime ({preload})")
    env = {
        **os.environ,
        "LD_PRELOAD": preload,
        "TSAN_OPTIONS": "halt_on_error=1:report_signal_unsafe=0",
        "KVCANARY_HOST_SANITIZE": "thread",
        "KVCANARY_DIFFERENTIAL_SCALE": "0.03",
        "KVCANARY_HOST_THREADS": "4",
        "PYTHONFAULTHANDLER": "1",
    }
    tests_dir = Path(__file__).parent
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-p", "no:benchmark",
         str(Path(__file__)), "-k", "not sanitized and not 70000 and not boundaries", "--rootdir",
         str(tests_dir.parent)],
        env=env, cwd=tests_dir.parent, capture_output=True, text=True, timeout=1500,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    assert "ThreadSanitizer" not in output, output[-6000:]
    assert " passed" in output and "skipped" not in output.split(" passed")[-1], output[-2000:]
