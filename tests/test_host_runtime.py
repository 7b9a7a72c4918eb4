"""Tests of the host CUDA runtime (kvcanary_cupy.hostcuda) with toy kernels.

Every expected value is computed here in Python from CUDA's documented semantics, not read back from the
runtime. The kernels live in tests/host_runtime_kernels/toy_kernels.cu; error cases use small inline sources.
"""

from __future__ import annotations

import functools
import operator
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest
from nvrtc_probe import nvrtc_or_skip

from kvcanary_cupy import hostcuda
from kvcanary_cupy.hostcuda import (
    SHARED_MEMORY_POISON_WORD,
    HostBuildError,
    HostKernel,
    HostLaunchError,
    HostModule,
    find_compiler,
    sanitizer_preload,
)

pytestmark = pytest.mark.skipif(find_compiler() is None, reason="no C++ compiler (g++) for the host backend")

REPO_ROOT = Path(__file__).resolve().parents[1]
TOY_SOURCE = Path(__file__).resolve().parent / "host_runtime_kernels" / "toy_kernels.cu"
POISON_I32 = int(np.array(SHARED_MEMORY_POISON_WORD, dtype=np.uint32).view(np.int32))
POISON_I64 = int(
    np.array((SHARED_MEMORY_POISON_WORD << 32) | SHARED_MEMORY_POISON_WORD, dtype=np.uint64).view(np.int64)
)
FULL = 0xFFFFFFFF


@pytest.fixture(scope="module", autouse=True)
def host_cache_dir(tmp_path_factory):
    """A private build cache for this module, so the tests also exercise cold builds."""
    old = os.environ.get("KVCANARY_CACHE_DIR")
    path = tmp_path_factory.mktemp("hostcuda-cache")
    os.environ["KVCANARY_CACHE_DIR"] = str(path)
    yield path
    if old is None:
        os.environ.pop("KVCANARY_CACHE_DIR", None)
    else:
        os.environ["KVCANARY_CACHE_DIR"] = old


@pytest.fixture(scope="module")
def toy(host_cache_dir) -> HostModule:
    return HostModule(TOY_SOURCE.read_text(), name="toy_kernels")


def _rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


# ---- plain execution ------------------------------------------------------------------------------------------


def test_grid_stride_axpy_multi_block(toy):
    n = 10_007
    x = _rng(1).integers(-(10**9), 10**9, n, dtype=np.int64)
    y = _rng(2).integers(-(10**9), 10**9, n, dtype=np.int64)
    out = np.zeros(n, dtype=np.int64)
    # 5 blocks of 96 threads (three warps, the grid strides 21 times over the data).
    toy.get_function("grid_stride_axpy")((5,), (96,), (x, y, out, np.int64(-3), np.int64(n)))
    np.testing.assert_array_equal(out, -3 * x + y)


def test_block_scan_1024_threads(toy):
    data = _rng(3).integers(-(10**12), 10**12, 4096, dtype=np.int64)
    out = np.zeros_like(data)
    toy.get_function("block_scan4")(1, 1024, (data, out))
    np.testing.assert_array_equal(out, np.cumsum(data))


def test_coordinates_in_3d_grid_and_block(toy):
    grid, block = (2, 3, 2), (4, 3, 2)
    threads, blocks = 24, 12
    out = np.zeros(threads * blocks, dtype=np.uint32)
    toy.get_function("coordinates")(grid, block, (out,))
    bid = np.repeat(np.arange(blocks, dtype=np.uint32), threads)
    tid = np.tile(np.arange(threads, dtype=np.uint32), blocks)
    np.testing.assert_array_equal(out, bid * 100000 + tid)


def test_struct_and_mixed_value_parameters(toy):
    kern = toy.get_function("with_struct")
    assert isinstance(kern, HostKernel)
    assert kern.name == "with_struct"
    assert kern.num_params == 5
    assert kern.param_sizes == (16, 8, 8, 8, 1)
    assert kern.param_is_pointer == (False, True, True, False, False)
    params = np.array([(3, 7, 0)], dtype=[("scale", "<i8"), ("offset", "<i4"), ("pad", "<i4")])[0]
    data = np.arange(40, dtype=np.int32)
    out = np.zeros(40, dtype=np.int64)
    kern(1, 40, (params, data, out, np.float64(2.9), np.uint8(1)))
    np.testing.assert_array_equal(out, 3 * data.astype(np.int64) + 7 + 2 + 1)


def test_kernel_without_parameters(toy):
    kern = toy.get_function("no_params")
    assert (kern.num_params, kern.param_sizes, kern.param_is_pointer) == (0, (), ())
    kern(3, 33, ())


def test_printf_reaches_stdout(toy, capfd):
    toy.get_function("hello_printf")(2, 32, (np.int32(7),))
    out = capfd.readouterr().out
    assert "hello from block 0 value 7 half 0.5\n" in out
    assert "hello from block 1 value 7 half 0.5\n" in out


def test_non_synchronising_kernel_costs_one_fiber_start_per_thread(toy):
    before = toy.runtime_stats()
    out = np.zeros(4 * 256, dtype=np.int64)
    ones = np.ones_like(out)
    toy.get_function("grid_stride_axpy")(4, 256, (ones, ones, out, np.int64(1), np.int64(out.size)))
    after = toy.runtime_stats()
    starts = after["fiber_starts"] - before["fiber_starts"]
    switches = after["switches"] - before["switches"]
    assert starts == 1024
    # Per block: scheduler -> first fiber, last fiber -> scheduler; each exiting thread hands its stack to
    # the next one without a switch.
    assert switches == 2 * 4
    np.testing.assert_array_equal(out, 2)


def test_concurrent_launches_from_python_threads(toy):
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        try:
            for k in range(5):
                data = _rng(seed * 10 + k).integers(-1000, 1000, 1024, dtype=np.int64)
                out = np.zeros_like(data)
                toy.get_function("block_scan4")(1, 256, (data, out))
                np.testing.assert_array_equal(out, np.cumsum(data))
        except BaseException as exc:  # re-raised in the main thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


# ---- warp operations ------------------------------------------------------------------------------------------


def _shuffle_model(values: np.ndarray, mode: int, arg: int, width: int) -> np.ndarray:
    """CUDA's documented __shfl_*_sync results for full warps (mode 0 idx, 1 up, 2 down, 3 xor)."""
    out = values.copy()
    for warp_start in range(0, values.size, 32):
        for lane in range(32):
            base = lane - lane % width
            if mode == 0:
                src = base + arg % width
            elif mode == 1:
                src = lane - arg if lane % width >= arg else lane
            elif mode == 2:
                src = lane + arg if lane % width + arg < width else lane
            else:
                src = lane ^ arg
                if src >= base + width:  # a later group: the caller keeps its own value
                    src = lane
            out[warp_start + lane] = values[warp_start + src]
    return out


SHUFFLE_CASES = [
    (0, 0, 32), (0, 5, 32), (0, 37, 32), (0, -1, 32), (0, 3, 8), (0, 11, 4), (0, 0, 1),
    (1, 1, 32), (1, 7, 32), (1, 3, 8), (1, 16, 16),
    (2, 1, 32), (2, 9, 32), (2, 3, 8), (2, 2, 2),
    (3, 1, 32), (3, 31, 32), (3, 5, 8), (3, 16, 8), (3, 1, 2),
]


@pytest.mark.parametrize(
    ("kernel", "dtype"),
    [
        ("shuffle_i32", np.int32),
        ("shuffle_u32", np.uint32),
        ("shuffle_i64", np.int64),
        ("shuffle_u64", np.uint64),
        ("shuffle_f32", np.float32),
        ("shuffle_f64", np.float64),
    ],
)
def test_shuffles_match_model(toy, kernel, dtype):
    rng = _rng(hash(kernel) & 0xFFFF)
    if np.dtype(dtype).kind == "f":
        values = rng.standard_normal(64).astype(dtype)
    else:
        info = np.iinfo(dtype)
        values = rng.integers(info.min, info.max, 64, dtype=dtype, endpoint=True)
    kern = toy.get_function(kernel)
    for mode, arg, width in SHUFFLE_CASES:
        out = np.zeros_like(values)
        kern(1, 64, (values, out, np.int32(mode), np.int32(arg), np.int32(width)))
        expected = _shuffle_model(values, mode, arg, width)
        assert out.tobytes() == expected.tobytes(), (mode, arg, width)


def test_warp_allreduce_and_broadcast(toy):
    data = _rng(4).integers(-1000, 1000, 96, dtype=np.int32)
    sums = np.zeros_like(data)
    firsts = np.zeros_like(data)
    toy.get_function("warp_allreduce")(1, 96, (data, sums, firsts))
    warps = data.reshape(3, 32)
    np.testing.assert_array_equal(sums, np.repeat(warps.sum(axis=1), 32))
    np.testing.assert_array_equal(firsts, np.repeat(warps[:, 0], 32))


def test_votes_match_model(toy):
    pred = np.zeros(128, dtype=np.int32)
    pred[:32] = 1  # warp 0: all true
    pred[32 + np.array([0, 5, 17, 31])] = 3  # warp 1: some
    pred[96 + np.arange(0, 32, 2)] = -1  # warp 3: even lanes; warp 2: none
    ballots = np.zeros(128, dtype=np.uint32)
    anys = np.zeros(128, dtype=np.int32)
    alls = np.zeros(128, dtype=np.int32)
    half = np.zeros(128, dtype=np.uint32)
    toy.get_function("votes")(1, 128, (pred, ballots, anys, alls, half))
    for w in range(4):
        lanes = pred[w * 32:(w + 1) * 32] != 0
        ballot = sum(1 << lane for lane in range(32) if lanes[lane])
        half_ballot = sum(1 << lane for lane in range(16) if lanes[lane])
        sl = slice(w * 32, (w + 1) * 32)
        assert (ballots[sl] == ballot).all()
        assert (anys[sl] == int(ballot != 0)).all()
        assert (alls[sl] == int(ballot == FULL)).all()
        assert (half[w * 32:w * 32 + 16] == half_ballot).all()
        assert (half[w * 32 + 16:(w + 1) * 32] == 0).all()


def test_exited_lanes_are_not_waited_for_and_read_as_poison(toy):
    data = np.arange(100, 132, dtype=np.int32)
    down16 = np.zeros(32, dtype=np.int32)
    xor1 = np.zeros(32, dtype=np.int32)
    active = np.zeros(32, dtype=np.uint32)
    toy.get_function("half_warp_exits")(1, 32, (data, down16, xor1, active))
    assert (active[:16] == 0xFFFF).all()
    np.testing.assert_array_equal(xor1[:16], data[np.arange(16) ^ 1])
    assert (down16[:16] == POISON_I32).all()  # lanes 16..31 had exited


def test_partial_last_warp_reduces_over_existing_lanes(toy):
    data = np.arange(48, dtype=np.int32)
    sums = np.zeros_like(data)
    firsts = np.zeros_like(data)
    toy.get_function("warp_allreduce")(1, 48, (data, sums, firsts))
    np.testing.assert_array_equal(sums[:32], data[:32].sum())
    # Lanes 16..31 of warp 1 do not exist: a butterfly step that reads them gets the poison word, so only
    # the lane-0 broadcast is meaningful there.
    np.testing.assert_array_equal(firsts[32:], 32)


# ---- atomics and block-wide votes -----------------------------------------------------------------------------


def test_atomics_from_many_threads_and_blocks(toy):
    grid, block = 37, 96
    total = grid * block
    i32_counter = np.zeros(1, dtype=np.int32)
    u64_counter = np.zeros(1, dtype=np.uint64)
    f32_sum = np.zeros(1, dtype=np.float32)
    f64_sum = np.zeros(1, dtype=np.float64)
    max_min = np.array([-1, 0], dtype=np.int32)
    bits = np.array([0, FULL, 0], dtype=np.uint32)
    cas_counter = np.zeros(1, dtype=np.uint32)
    wrap = np.zeros(1, dtype=np.uint32)
    sub_counter = np.array([100_000], dtype=np.uint32)
    last = np.zeros(1, dtype=np.uint64)
    toy.get_function("atomics")(
        grid,
        block,
        (i32_counter, u64_counter, f32_sum, f64_sum, max_min, bits, cas_counter, wrap, sub_counter, last),
    )
    assert i32_counter[0] == total
    assert u64_counter[0] == total * (total - 1) // 2
    assert f32_sum[0] == float(total)
    assert f64_sum[0] == total / 2
    assert max_min.tolist() == [total - 1, -(total - 1)]
    assert bits[0] == FULL
    assert bits[1] == 0x80000000
    assert bits[2] == functools.reduce(operator.xor, range(total))
    assert cas_counter[0] == 2 * total
    assert wrap[0] == total % 10
    assert sub_counter[0] == 100_000 - 3 * total
    assert last[0] == 7


def test_syncthreads_count_or_and(toy):
    kern = toy.get_function("block_votes")
    for pred in (np.arange(100) % 3 == 0, np.ones(100, bool), np.zeros(100, bool)):
        results = np.zeros(6, dtype=np.int32)
        kern(2, 100, (pred.astype(np.int32), results))
        expected = [int(pred.sum()), int(pred.any()), int(pred.all())] * 2
        assert results.tolist() == expected


# ---- shared memory ------------------------------------------------------------------------------------------


def test_dynamic_shared_memory(toy):
    block = 200
    data = _rng(5).integers(-(10**15), 10**15, 3 * block, dtype=np.int64)
    out = np.zeros_like(data)
    toy.get_function("dynamic_reverse")(3, block, (data, out), shared_mem=block * 8)
    np.testing.assert_array_equal(out, data.reshape(3, block)[:, ::-1].ravel())


def test_shared_memory_is_poisoned_before_every_block(toy):
    n = 2 * 64
    seen_static = np.zeros(n, dtype=np.int32)
    seen_float = np.zeros(n, dtype=np.float32)
    seen_template = np.zeros(n, dtype=np.int32)
    seen_dynamic = np.zeros(n, dtype=np.int32)
    kern = toy.get_function("poison_probe")
    for _ in range(2):  # the second launch must not see the first one's writes either
        kern(2, 64, (seen_static, seen_float, seen_template, seen_dynamic), shared_mem=64 * 4)
        assert (seen_static == POISON_I32).all()
        assert (seen_float.view(np.uint32) == SHARED_MEMORY_POISON_WORD).all()
        assert np.isnan(seen_float).all()
        assert (seen_template == POISON_I32).all()
        assert (seen_dynamic == POISON_I32).all()


def test_dynamic_shared_memory_limit(toy):
    kern = toy.get_function("dynamic_reverse")
    data = np.zeros(64, dtype=np.int64)
    with pytest.raises(HostLaunchError, match="max_dynamic_shared_size_bytes"):
        kern(1, 64, (data, data), shared_mem=64 * 1024)
    with pytest.raises(ValueError, match="max_dynamic_shared_size_bytes"):
        kern.max_dynamic_shared_size_bytes = 300 * 1024
    kern.max_dynamic_shared_size_bytes = 100 * 1024
    try:
        out = np.zeros(64, dtype=np.int64)
        kern(1, 64, (np.arange(64, dtype=np.int64), out), shared_mem=100 * 1024)
        np.testing.assert_array_equal(out, np.arange(64)[::-1])
    finally:
        kern.max_dynamic_shared_size_bytes = 48 * 1024


# ---- failures inside kernels --------------------------------------------------------------------------------


def test_trap_raises_and_next_launch_works(toy):
    kern = toy.get_function("maybe_trap")
    out = np.zeros(3 * 64, dtype=np.int32)
    with pytest.raises(HostLaunchError) as info:
        kern(3, 64, (out, np.int32(1), np.int32(17)))
    message = str(info.value)
    assert "kernel 'maybe_trap' block (1,0,0) thread (17,0,0)" in message
    assert "__trap()" in message
    out[:] = 0
    kern(3, 64, (out, np.int32(-1), np.int32(-1)))
    assert (out == 1).all()


def test_failed_assert_raises_and_next_launch_works(toy):
    kern = toy.get_function("maybe_assert")
    values = np.arange(32, dtype=np.int32)
    with pytest.raises(HostLaunchError) as info:
        kern(1, 32, (values, np.int32(9)))
    message = str(info.value)
    assert "thread (9,0,0)" in message
    assert "v < limit" in message
    kern(1, 32, (values, np.int32(100)))


def test_warp_skipping_syncthreads_is_a_deadlock(toy):
    out = np.zeros(64, dtype=np.int32)
    with pytest.raises(HostLaunchError, match="deadlock") as info:
        toy.get_function("skip_barrier_warp")(1, 64, (out,))
    assert "kernel 'skip_barrier_warp' block (0,0,0) thread (32,0,0)" in str(info.value)
    data = np.arange(4096, dtype=np.int64)
    scanned = np.zeros_like(data)
    toy.get_function("block_scan4")(1, 1024, (data, scanned))
    np.testing.assert_array_equal(scanned, np.cumsum(data))


def test_circular_wait_is_a_deadlock(toy):
    out = np.zeros(32, dtype=np.int32)
    with pytest.raises(HostLaunchError, match="deadlock") as info:
        toy.get_function("warp_vs_block_deadlock")(1, 32, (out,))
    message = str(info.value)
    assert "__syncwarp(mask=0x00000003)" in message
    assert "__syncthreads" in message


def test_exited_threads_do_not_hold_up_syncthreads(toy):
    out = np.zeros(128, dtype=np.int32)
    toy.get_function("early_exit_warp")(1, 128, (out,))
    expected = np.full(128, 2, dtype=np.int32)
    expected[32:64] = 0
    np.testing.assert_array_equal(out, expected)


def test_mask_without_calling_lane_is_rejected(toy):
    out = np.zeros(32, dtype=np.int32)
    with pytest.raises(HostLaunchError, match="invalid warp mask") as info:
        toy.get_function("bad_mask")(1, 32, (out,))
    assert "thread (1,0,0)" in str(info.value)


def test_invalid_launch_configuration(toy):
    kern = toy.get_function("no_params")
    with pytest.raises(HostLaunchError, match="invalid block"):
        kern(1, 1025, ())
    with pytest.raises(HostLaunchError, match="invalid block"):
        kern(1, (32, 32, 2), ())
    with pytest.raises(HostLaunchError, match="invalid grid"):
        kern((1, 0), 32, ())


# ---- argument checking ----------------------------------------------------------------------------------------


def test_argument_type_errors(toy):
    kern = toy.get_function("grid_stride_axpy")
    a = np.zeros(8, dtype=np.int64)
    with pytest.raises(TypeError, match="takes 5 arguments"):
        kern(1, 8, (a, a, a, np.int64(1)))
    with pytest.raises(TypeError, match="bare int"):
        kern(1, 8, (a, a, a, 2, np.int64(8)))
    with pytest.raises(TypeError, match="8 bytes"):
        kern(1, 8, (a, a, a, np.int32(2), np.int64(8)))
    with pytest.raises(TypeError, match="not an array"):
        kern(1, 8, (a, a, a, np.array(2, dtype=np.int64), np.int64(8)))
    with pytest.raises(TypeError, match="pointer parameter"):
        kern(1, 8, (a, np.int64(3), a, np.int64(2), np.int64(8)))
    with pytest.raises(TypeError, match="integer parameter"):
        kern(1, 8, (a, a, a, np.float64(2), np.int64(8)))
    with pytest.raises(TypeError, match="bare bool"):
        toy.get_function("with_struct")(1, 1, (np.zeros(1, "V16")[0], a, a, np.float64(1), True))


def test_unknown_kernel_name(toy):
    with pytest.raises(ValueError, match="no kernel 'nope'"):
        toy.get_function("nope")


# ---- building ---------------------------------------------------------------------------------------------


LAYOUT_KERNELS = textwrap.dedent(
    """
    // extern "C" __global__ void commented_out(int* x) {}
    /* extern "C" __global__ void also_commented(int* x) {} */
    extern "C"
    __global__ void
    __launch_bounds__(128, 4)
    spaced_kernel(int* out)
    {
        out[threadIdx.x] = 1;
    }
    extern "C" __global__ __launch_bounds__((64)) void bounds_first(int* out) { out[0] = 2; }
    """
)


def test_kernel_discovery_tolerates_layout_and_ignores_comments():
    mod = HostModule(LAYOUT_KERNELS, name="layout")
    assert mod.kernel_names == ("spaced_kernel", "bounds_first")
    out = np.zeros(4, dtype=np.int32)
    mod.get_function("spaced_kernel")(1, 4, (out,))
    mod.get_function("bounds_first")(1, 1, (out,))
    assert out.tolist() == [2, 1, 1, 1]


def test_find_compiler_honours_cxx(monkeypatch):
    gxx = find_compiler()
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    assert find_compiler() == gxx  # not there: fall back to g++ on PATH
    monkeypatch.setenv("CXX", str(gxx))
    assert find_compiler() == gxx


def test_source_without_entry_points_is_rejected():
    with pytest.raises(HostBuildError, match="no `extern \"C\" __global__"):
        HostModule('__global__ void not_extern_c(int* out) { out[0] = 1; }\n', name="noentry")


def test_compile_error_reports_kernel_line():
    code = 'extern "C" __global__ void broken(int* out) {\n    int x = 1;\n    out[0] = y;\n}\n'
    with pytest.raises(HostBuildError, match=r"errmod\.cu:3"):
        HostModule(code, name="errmod")


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("long long* p = reinterpret_cast<long long*>(out); atomicAdd(p, 1LL);", "atomicAdd"),
        ("int64_t v = 1; out[0] = (int)v;", "int64_t"),
        ("int unused_local = 3;", "unused variable"),  # warnings are errors: kernels must be clean
    ],
)
def test_rejected_kernel_code(body, message):
    """What NVRTC rejects (CUDA's overload sets, no <cstdint>) fails here too, as do warnings."""
    code = f'extern "C" __global__ void k(int* out) {{ {body} out[0] = 0; }}\n'
    with pytest.raises(HostBuildError, match=message):
        HostModule(code, name="parity")


def test_shared_initializer_is_rejected():
    code = 'extern "C" __global__ void k(int* out) {\n    __shared__ int s = 3;\n    out[0] = s;\n}\n'
    with pytest.raises(HostBuildError, match=r"init\.cu:2: __shared__ variable has an initializer"):
        HostModule(code, name="init")


def test_unsupported_option_is_rejected():
    with pytest.raises(ValueError, match="unsupported host compiler option"):
        HostModule('extern "C" __global__ void k() {}', options=["-O0"])


def test_options_define_macros():
    code = 'extern "C" __global__ void k(long long* out) { out[0] = KVC_TEST_VALUE; }\n'
    out = np.zeros(1, dtype=np.int64)
    HostModule(code, options=["-DKVC_TEST_VALUE=424242", "--std=c++17"], name="opts").get_function("k")(
        1, 1, (out,)
    )
    assert out[0] == 424242


def test_disk_cache_hit_does_not_invoke_compiler(tmp_path, monkeypatch):
    monkeypatch.setenv("KVCANARY_CACHE_DIR", str(tmp_path))
    code = 'extern "C" __global__ void inc(int* out) { out[threadIdx.x] += 1; }\n'
    first = HostModule(code, name="cached")
    assert not first.from_cache
    before = first.library_path.stat()

    def no_compiler(cmd, what):
        raise AssertionError(f"compiler invoked on a cache hit: {what}")

    monkeypatch.setattr(hostcuda, "_run_compiler", no_compiler)
    second = HostModule(code, name="cached")
    assert second.from_cache
    assert second.library_path == first.library_path
    after = second.library_path.stat()  # the same file, not rebuilt; a hit only refreshes its mtime (LRU pruning)
    assert (after.st_ino, after.st_size) == (before.st_ino, before.st_size)
    assert after.st_mtime_ns >= before.st_mtime_ns
    out = np.zeros(8, dtype=np.int32)
    second.get_function("inc")(1, 8, (out,))
    assert (out == 1).all()
    # A different -D flag is a different key.
    with pytest.raises(AssertionError, match="compiler invoked"):
        HostModule(code, name="cached", options=["-DSOMETHING"])


def test_included_header_is_part_of_the_cache_key(tmp_path):
    inc = tmp_path / "inc"
    inc.mkdir()
    (inc / "toy_helper.cuh").write_text('#include "toy_inner.cuh"\n')
    inner = inc / "toy_inner.cuh"
    inner.write_text("__device__ inline long long bump(long long x) { return x + 1; }\n")
    code = (
        '#include "toy_helper.cuh"\n'
        'extern "C" __global__ void k(long long* out) { out[threadIdx.x] = bump(out[threadIdx.x]); }\n'
    )
    out = np.zeros(4, dtype=np.int64)
    HostModule(code, include_dirs=[inc], name="headers").get_function("k")(1, 4, (out,))
    assert (out == 1).all()
    inner.write_text("__device__ inline long long bump(long long x) { return x + 10; }\n")
    mod = HostModule(code, include_dirs=[str(inc)], name="headers")
    assert not mod.from_cache
    mod.get_function("k")(1, 4, (out,))
    assert (out == 11).all()


def test_shared_memory_in_included_headers_is_rewritten(tmp_path):
    inc = tmp_path / "inc"
    (inc / "detail").mkdir(parents=True)
    (inc / "toy_top.cuh").write_text('#include "detail/toy_shared.cuh"\n')
    (inc / "detail" / "toy_shared.cuh").write_text(
        textwrap.dedent(
            """
            #include "toy_leaf.cuh"
            __device__ inline int first_look(unsigned t) {
                static __shared__ int seen[32];
                const int v = seen[t % 32];
                __syncthreads();
                seen[t % 32] = LEAF_VALUE;
                return v;
            }
            """
        )
    )
    (inc / "detail" / "toy_leaf.cuh").write_text("#define LEAF_VALUE 5\n")
    code = (
        '#include "toy_top.cuh"\n'
        'extern "C" __global__ void k(int* out) { out[threadIdx.x] = first_look(threadIdx.x) + LEAF_VALUE - 5; }\n'
    )
    out = np.zeros(64, dtype=np.int32)
    kern = HostModule(code, include_dirs=[inc], name="header_shared").get_function("k")
    for _ in range(2):
        kern(2, 64, (out,))
        assert (out == POISON_I32).all()


def test_concurrent_builds_of_one_module(tmp_path, monkeypatch):
    """Builders racing on one cache key each compile into a private directory and rename atomically."""
    monkeypatch.setenv("KVCANARY_CACHE_DIR", str(tmp_path))
    code = 'extern "C" __global__ void race(int* out) { out[threadIdx.x] = 7; }\n'
    results: list[object] = []

    def build() -> None:
        try:
            mod = HostModule(code, name="race")
            out = np.zeros(4, dtype=np.int32)
            mod.get_function("race")(1, 4, (out,))
            results.append(out.tolist())
        except BaseException as exc:  # re-raised in the main thread
            results.append(exc)

    threads = [threading.Thread(target=build) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [[7, 7, 7, 7]] * 3
    leftovers = [p.name for p in (tmp_path / "hostcuda").iterdir() if p.name.startswith(".build-")]
    assert leftovers == []


def test_ucontext_fallback_runs_the_same_kernels():
    mod = HostModule(TOY_SOURCE.read_text(), options=["-DKVC_HOST_USE_UCONTEXT"], name="toy_ucontext")
    data = _rng(6).integers(-(10**6), 10**6, 1024, dtype=np.int64)
    out = np.zeros_like(data)
    mod.get_function("block_scan4")(1, 256, (data, out))
    np.testing.assert_array_equal(out, np.cumsum(data))
    values = np.arange(64, dtype=np.int32)
    shuffled = np.zeros_like(values)
    mod.get_function("shuffle_i32")(1, 64, (values, shuffled, np.int32(3), np.int32(5), np.int32(8)))
    np.testing.assert_array_equal(shuffled, _shuffle_model(values, 3, 5, 8))
    with pytest.raises(HostLaunchError, match="deadlock"):
        mod.get_function("skip_barrier_warp")(1, 64, (np.zeros(64, dtype=np.int32),))
    mod.get_function("block_scan4")(1, 256, (data, out))
    np.testing.assert_array_equal(out, np.cumsum(data))


# ---- sanitizers ---------------------------------------------------------------------------------------------

SANITIZER_KERNELS = r"""
__device__ __noinline__ void store(int* p, unsigned i, int v) { p[i] = v; }

extern "C" __global__ void clean(const int* in, int* out) {
    __shared__ int s[256];
    s[threadIdx.x] = in[threadIdx.x];
    __syncthreads();
    int v = s[255 - threadIdx.x];
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    long long local[8];
    for (int k = 0; k < 8; ++k) local[k] = v + k;
    __syncthreads();
    out[blockIdx.x * blockDim.x + threadIdx.x] = v + static_cast<int>(local[threadIdx.x % 8] - local[0]);
    if (threadIdx.x == 0 && blockIdx.x == 0) printf("clean %.3f\n", 0.25);
}

extern "C" __global__ void trap_early(int* out) {
    if (threadIdx.x == 3) __trap();
    __syncthreads();
    out[threadIdx.x] = 1;
}

// One element past a __shared__ array, through a pointer so that ASan (not UBSan's bounds check) sees it.
extern "C" __global__ void shared_overflow(int* out) {
    __shared__ int s[64];
    __syncthreads();
    store(s, threadIdx.x + 1, 1);
    out[threadIdx.x] = 0;
}

// One element past the dynamic shared memory the launch asked for (the rest of the buffer is poisoned).
extern "C" __global__ void dynamic_overflow(int* out) {
    extern __shared__ int words[];
    store(words, threadIdx.x + 1, 1);
    __syncthreads();
    out[threadIdx.x] = words[threadIdx.x];
}

__device__ __noinline__ void store_local(long long* p, unsigned i) { p[i] = 1; }

// Thread 0 overflows a local array after it was suspended at __syncthreads: the redzones of a frame that
// survived a fiber switch must still be there.
extern "C" __global__ void stack_overflow(int* out, int extra) {
    long long local[8];
    for (int k = 0; k < 8; ++k) local[k] = k;
    __syncthreads();
    store_local(local, 7u + (threadIdx.x == 0 ? static_cast<unsigned>(extra) : 0u));
    __syncthreads();
    out[threadIdx.x] = static_cast<int>(local[threadIdx.x % 8]);
}

extern "C" __global__ void signed_overflow(int* out, int base) {
    __syncthreads();
    out[threadIdx.x] = base + static_cast<int>(threadIdx.x);
}
"""

SANITIZER_CHILD = r"""
import sys
import threading
import numpy as np
from kvcanary_cupy.hostcuda import HostLaunchError, HostModule

mod = HostModule(sys.stdin.read(), sanitize=True, name="sanitized_toy")
what = sys.argv[1]
data = np.arange(512, dtype=np.int32)
out = np.zeros(512, dtype=np.int32)
if what == "clean":
    for _ in range(2):
        try:
            mod.get_function("trap_early")(1, 64, (out,))
        except HostLaunchError:
            pass
        else:
            raise SystemExit("trap did not raise")
        mod.get_function("clean")(2, 256, (data, out))
    # A launch from another OS thread: the scheduler's stack bounds given to ASan must follow it.
    worker = threading.Thread(target=mod.get_function("clean"), args=(2, 256, (data, out)))
    worker.start()
    worker.join()
    print("done", int(out[0]), int(out[300]))
elif what == "shared_overflow":
    mod.get_function("shared_overflow")(1, 64, (out,))
elif what == "dynamic_overflow":
    mod.get_function("dynamic_overflow")(1, 64, (out,), shared_mem=65 * 4)
    assert (out[1:64] == 1).all()  # words[0] is never written
    mod.get_function("dynamic_overflow")(1, 64, (out,), shared_mem=64 * 4)
elif what == "stack_overflow":
    mod.get_function("stack_overflow")(1, 64, (out, np.int32(0)))
    assert out[7] == 1
    mod.get_function("stack_overflow")(1, 64, (out, np.int32(1)))
elif what == "signed_overflow":
    mod.get_function("signed_overflow")(1, 32, (out, np.int32(2**31 - 8)))
"""


def _sanitizer_runtime() -> str | None:
    path = sanitizer_preload()
    return path if os.path.isfile(path) else None


needs_sanitizer = pytest.mark.skipif(
    _sanitizer_runtime() is None, reason="g++ ships no AddressSanitizer runtime (libasan.so)"
)


@pytest.fixture(scope="module")
def sanitized_build(host_cache_dir):
    """Builds the sanitized module in this process (loading it here must fail), for the child processes."""
    with pytest.raises(HostBuildError, match="LD_PRELOAD=") as info:
        HostModule(SANITIZER_KERNELS, sanitize=True, name="sanitized_toy")
    return str(info.value)


def _run_sanitized_child(what: str, host_cache_dir: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["LD_PRELOAD"] = sanitizer_preload()
    env["ASAN_OPTIONS"] = "detect_leaks=0"
    env["KVCANARY_CACHE_DIR"] = str(host_cache_dir)
    env["OPENBLAS_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, "-c", SANITIZER_CHILD, what],
        input=SANITIZER_KERNELS,
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )


@needs_sanitizer
def test_sanitized_module_refuses_to_load_without_preload(sanitized_build):
    assert "ASAN_OPTIONS=detect_leaks=0" in sanitized_build


@needs_sanitizer
def test_sanitized_clean_kernel_runs_silently(sanitized_build, host_cache_dir):
    proc = _run_sanitized_child("clean", host_cache_dir)
    assert proc.returncode == 0, proc.stderr
    assert "AddressSanitizer" not in proc.stderr
    assert "runtime error" not in proc.stderr
    assert "clean 0.250" in proc.stdout
    # out[i] = (warp sum of the reversed input) + threadIdx.x % 8; element 300 is block 1, thread 44.
    rev = np.arange(256)[::-1].reshape(8, 32).sum(axis=1)
    assert f"done {rev[0]} {rev[1] + 4}" in proc.stdout


@needs_sanitizer
def test_sanitized_shared_overflow_is_reported(sanitized_build, host_cache_dir):
    proc = _run_sanitized_child("shared_overflow", host_cache_dir)
    assert proc.returncode != 0
    # Sanitized builds keep each __shared__ variable in a per-OS-thread heap block, which has redzones.
    assert "AddressSanitizer: heap-buffer-overflow" in proc.stderr
    assert "sanitized_toy.cu" in proc.stderr


@needs_sanitizer
def test_sanitized_dynamic_shared_overflow_is_reported(sanitized_build, host_cache_dir):
    proc = _run_sanitized_child("dynamic_overflow", host_cache_dir)
    assert proc.returncode != 0
    assert "AddressSanitizer: use-after-poison" in proc.stderr
    assert "dynamic_overflow" in proc.stderr


@needs_sanitizer
def test_sanitized_signed_overflow_is_reported(sanitized_build, host_cache_dir):
    proc = _run_sanitized_child("signed_overflow", host_cache_dir)
    assert proc.returncode != 0
    assert "runtime error: signed integer overflow" in proc.stderr


@needs_sanitizer
def test_sanitized_stack_overflow_after_a_fiber_switch_is_reported(sanitized_build, host_cache_dir):
    proc = _run_sanitized_child("stack_overflow", host_cache_dir)
    assert proc.returncode != 0
    assert "AddressSanitizer: stack-buffer-overflow" in proc.stderr
    assert "stack_overflow" in proc.stderr


def test_toy_kernels_are_valid_cuda_for_nvrtc():
    """The toy kernels are real CUDA: NVRTC compiles them warning-free (skipped where NVRTC is absent)."""
    nvrtc = nvrtc_or_skip()
    for name, source in (
        ("toy_kernels.cu", TOY_SOURCE.read_text()),
        ("sanitized_toy.cu", SANITIZER_KERNELS),
        ("layout.cu", LAYOUT_KERNELS),
    ):
        program = nvrtc.createProgram(source, name, [], [])
        try:
            nvrtc.compileProgram(program, ["--gpu-architecture=sm_90", "--display-error-number", "--std=c++17"])
        except Exception as exc:
            raise AssertionError(f"{name}:\n{nvrtc.getProgramLog(program)}") from exc
        log = nvrtc.getProgramLog(program)
        assert "warning" not in log.lower(), log


# ---- blocks on a pool of OS threads ---------------------------------------------------------------------------

WAIT_NS = 10 * 10**9  # how long block 0 waits for block 1 before giving up (only a single thread gives up)


def _wait_for_block_one(mod: HostModule, threads: int, *, racy: int = 0, timeout_ns: int = WAIT_NS) -> tuple[int, int]:
    flag = np.zeros(1, np.int32)
    seen = np.full(1, -1, np.int32)
    counter = np.zeros(1, np.int32)
    mod.get_function("wait_for_block_one")(2, 32, (flag, seen, counter, np.int32(racy), np.int64(timeout_ns)),
                                           threads=threads)
    return int(seen[0]), int(counter[0])


def test_blocks_of_one_launch_run_at_the_same_time_on_two_os_threads(toy):
    before = toy.runtime_stats()["worker_blocks"]
    assert _wait_for_block_one(toy, 2) == (1, 2)
    assert toy.runtime_stats()["worker_blocks"] > before
    # One thread runs block 0 to the end first: it can only time out.
    assert _wait_for_block_one(toy, 1, timeout_ns=2_000_000) == (0, 2)


@pytest.mark.parametrize("threads", [1, 2, 4])
def test_atomics_barriers_and_shared_memory_under_several_os_threads(toy, threads):
    grid, block = 24, 128
    data = _rng(threads).integers(-(10**12), 10**12, 4 * grid * block, dtype=np.int64)
    out = np.zeros_like(data)
    grand = np.zeros(1, np.uint64)
    toy.get_function("segmented_scan4")(grid, block, (data, out, grand), threads=threads)
    np.testing.assert_array_equal(out, np.cumsum(data.reshape(grid, -1), axis=1).ravel())
    assert int(grand[0]) == int(data.sum()) % 2**64
    counter = np.zeros(1, np.int32)
    toy.get_function("atomics")(
        37, 96,
        (counter, np.zeros(1, np.uint64), np.zeros(1, np.float32), np.zeros(1, np.float64),
         np.array([-1, 0], np.int32), np.array([0, FULL, 0], np.uint32), np.zeros(1, np.uint32),
         np.zeros(1, np.uint32), np.array([100_000], np.uint32), np.zeros(1, np.uint64)),
        threads=threads,
    )
    assert counter[0] == 37 * 96


@pytest.mark.parametrize("threads", [2, 4])
def test_failure_reports_the_lowest_failing_block_and_the_next_launch_works(toy, threads):
    grid, block = 48, 32
    out = np.zeros(grid * block, np.int32)
    with pytest.raises(HostLaunchError) as info:
        toy.get_function("trap_from_block")(grid, block, (out, np.int32(29)), threads=threads)
    assert "kernel 'trap_from_block' block (29,0,0) thread (3,0,0)" in str(info.value)
    assert (out[: 29 * block] == 1).all()  # every block below the failing one ran, as with one thread
    with pytest.raises(HostLaunchError, match=r"block \(0,0,0\) thread \(32,0,0\).*deadlock|deadlock"):
        toy.get_function("skip_barrier_warp")(16, 64, (np.zeros(64, np.int32),), threads=threads)
    with pytest.raises(HostLaunchError, match="v < limit"):
        toy.get_function("maybe_assert")(8, 32, (np.arange(32, dtype=np.int32), np.int32(20)), threads=threads)
    out[:] = 0
    toy.get_function("trap_from_block")(grid, block, (out, np.int32(grid)), threads=threads)
    assert (out == 1).all()


POOL_CHILD = r"""
import sys
import threading
import numpy as np
sys.path.insert(0, sys.argv[1])
from test_host_runtime import TOY_SOURCE, _wait_for_block_one
from kvcanary_cupy.hostcuda import HostModule

first = HostModule(TOY_SOURCE.read_text(), name="toy_pool_first")
second = HostModule(TOY_SOURCE.read_text(), options=("-DKVC_SECOND_MODULE=1",), name="toy_pool_second")
out = np.zeros(64, np.int32)
no_trap = (out, np.int32(-1), np.int32(-1))

def workers():
    return first.runtime_stats()["workers"], second.runtime_stats()["workers"]

first.get_function("maybe_trap")(1, 64, no_trap, threads=4)
print("one-block", *workers())
first.get_function("maybe_trap")(2, 32, no_trap, threads=4)
print("two-blocks", *workers())
second.get_function("maybe_trap")(8, 8, no_trap, threads=4)
print("eight-blocks", *workers())
print("meet", *_wait_for_block_one(first, 2), *_wait_for_block_one(second, 2))
print("worker-blocks", first.runtime_stats()["worker_blocks"] > 0, second.runtime_stats()["worker_blocks"] > 0)

# Two Python threads launching on the two modules at once: one has the pool, the other runs alone.
data = np.random.default_rng(7).integers(-10**12, 10**12, 4 * 24 * 128, dtype=np.int64)
want = np.cumsum(data.reshape(24, -1), axis=1).ravel()
wrong = []

def scans(module):
    for _ in range(30):
        got = np.zeros_like(data)
        grand = np.zeros(1, np.uint64)
        module.get_function("segmented_scan4")(24, 128, (data, got, grand), threads=2)
        if not np.array_equal(got, want):
            wrong.append(module.name)

runners = [threading.Thread(target=scans, args=(m,)) for m in (first, second)]
for t in runners:
    t.start()
for t in runners:
    t.join()
print("concurrent", len(wrong), *workers())
"""


def test_every_module_shares_one_pool_and_small_launches_stay_on_the_caller(host_cache_dir):
    # A child process: the pool is the process's, and this one has already started workers.
    env = dict(os.environ, KVCANARY_CACHE_DIR=str(host_cache_dir))
    proc = subprocess.run([sys.executable, "-c", POOL_CHILD, str(Path(__file__).resolve().parent)],
                          capture_output=True, text=True, env=env, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [
        "one-block 0 0",  # a one-block launch wakes no worker
        "two-blocks 1 1",  # never more workers than blocks beyond the caller's; both modules see the same pool
        "eight-blocks 3 3",  # the second module's launch grows the same pool to threads - 1
        "meet 1 2 1 2",  # block 1 runs while block 0 waits for it, in either module
        "worker-blocks True True",
        "concurrent 0 3 3",  # launches from two Python threads at once: right results, no new workers
    ]


def test_thread_count_comes_from_launch_module_setting_env_then_affinity(monkeypatch, host_cache_dir):
    from kvcanary_cupy import CanaryArgumentError

    monkeypatch.delenv(hostcuda.THREADS_ENV, raising=False)
    assert hostcuda.default_host_threads() == len(os.sched_getaffinity(0))
    monkeypatch.setenv(hostcuda.THREADS_ENV, "3")
    assert hostcuda.default_host_threads() == hostcuda.host_threads() == 3
    hostcuda.set_host_threads(5)
    try:
        assert hostcuda.host_threads() == 5
    finally:
        hostcuda.set_host_threads(None)
    assert hostcuda.host_threads() == 3
    for bad in ("0", "two", "-1"):
        monkeypatch.setenv(hostcuda.THREADS_ENV, bad)
        with pytest.raises(CanaryArgumentError, match=f"kv-canary: {hostcuda.THREADS_ENV}"):
            hostcuda.host_threads()
    monkeypatch.delenv(hostcuda.THREADS_ENV)
    with pytest.raises(CanaryArgumentError, match="kv-canary: threads must be >= 1"):
        hostcuda.set_host_threads(0)
    with pytest.raises(CanaryArgumentError, match="kv-canary: threads must be an int"):
        HostModule("extern \"C\" __global__ void k() {}", threads=2.0, name="bad_threads")  # type: ignore[arg-type]


def test_a_spin_time_the_pool_would_not_take_is_refused_before_building(monkeypatch, host_cache_dir):
    from kvcanary_cupy import CanaryArgumentError

    source = 'extern "C" __global__ void k(int* p) { p[threadIdx.x] = 1; }'
    for bad in ("-1", "1000001", "2.5", "fast", " 5", "\u00b2"):
        monkeypatch.setenv(hostcuda.SPIN_ENV, bad)
        with pytest.raises(CanaryArgumentError, match=f"^kv-canary: {hostcuda.SPIN_ENV} must be an integer"):
            HostModule(source, name="spin_setting")
    for good in ("0", "200", "1000000", ""):  # empty is unset, as for the pool library
        monkeypatch.setenv(hostcuda.SPIN_ENV, good)
        HostModule(source, name="spin_setting")


# ---- ThreadSanitizer -------------------------------------------------------------------------------------------

TSAN_CHILD = r"""
import sys
import numpy as np
sys.path.insert(0, sys.argv[2])
from test_host_runtime import TOY_SOURCE, _wait_for_block_one
from kvcanary_cupy.hostcuda import HostLaunchError, HostModule

mod = HostModule(TOY_SOURCE.read_text(), sanitize="thread", name="toy_tsan")
if sys.argv[1] == "race":
    print("race", _wait_for_block_one(mod, 2, racy=1))
else:
    print("clean", _wait_for_block_one(mod, 2))
    grid, block = 16, 64
    data = np.arange(4 * grid * block, dtype=np.int64)
    out = np.zeros_like(data)
    grand = np.zeros(1, np.uint64)
    for threads in (2, 4):
        mod.get_function("segmented_scan4")(grid, block, (data, out, grand), threads=threads)
        assert (out == np.cumsum(data.reshape(grid, -1), axis=1).ravel()).all()
        flags = np.zeros(grid * block, np.int32)
        try:
            mod.get_function("trap_from_block")(grid, block, (flags, np.int32(5)), threads=threads)
        except HostLaunchError as exc:
            assert "block (5,0,0)" in str(exc)
        else:
            raise SystemExit("trap did not raise")
    print("done", int(grand[0]))
"""


def _tsan_runtime() -> str | None:
    path = sanitizer_preload("thread")
    return path if os.path.isfile(path) else None


needs_tsan = pytest.mark.skipif(_tsan_runtime() is None, reason="g++ ships no ThreadSanitizer runtime (libtsan.so)")


def _run_tsan_child(what: str, host_cache_dir: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["LD_PRELOAD"] = sanitizer_preload("thread")
    env["TSAN_OPTIONS"] = "halt_on_error=1:report_signal_unsafe=0"
    env["KVCANARY_CACHE_DIR"] = str(host_cache_dir)
    env["OPENBLAS_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-c", TSAN_CHILD, what, str(Path(__file__).parent)],
                          capture_output=True, text=True, env=env, timeout=300, check=False)


@needs_tsan
def test_thread_sanitizer_reports_a_race_between_blocks(host_cache_dir):
    proc = _run_tsan_child("race", host_cache_dir)
    assert proc.returncode != 0
    assert "ThreadSanitizer: data race" in proc.stderr
    assert "wait_for_block_one" in proc.stderr


@needs_tsan
def test_thread_sanitizer_is_silent_on_atomics_barriers_and_aborts(host_cache_dir):
    proc = _run_tsan_child("clean", host_cache_dir)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "ThreadSanitizer" not in proc.stderr
    assert "clean (1, 2)" in proc.stdout
    total = int(np.arange(4 * 16 * 64).sum())
    assert f"done {total * 2}" in proc.stdout
