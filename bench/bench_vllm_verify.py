"""The TAIL verify of a vLLM CPU decode step on the host backend, with the caches as cold as a forward leaves them,
against the kernels of ``BASELINE_REVISION`` compiled in the same run.

Workload (the geometry of ``bench/bench_vllm.py``'s Llama): 8 requests of 320 tokens in 32-token blocks (2,560
prefix slots, one chain per request), 4 layers' caches of vLLM's CPU layout (``[blocks, 4 heads, 32, 2 x 64]``
fp32, ``isa="vec"``: K column-major inside each (block, head) plane, V row-major), PARTIAL hashing (16 bytes a
token and layer): one runtime group's TAIL verify of K, or of V, on one thread. Before every call a 64 MiB buffer
is summed (untimed): vLLM's forward streams the model's weights through the caches between two verifies.

Rows, per K and V: the verify with today's kernels (subject) and with ``kernels/`` at ``BASELINE_REVISION``
(baseline: the last revision whose fingerprint divided the slot by the page size once per source and walked
fp32 K's column-major elements one by one), with
``alternating_ratio``: the median over ``ALTERNATING_ROUNDS`` rounds, each timing the two back to back (order
alternating, caches evicted before each), of their time ratio. Nothing here fails on a time; run ``make bench``.
"""

from __future__ import annotations

import functools
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import pytest
from alternating import alternating_ratio

from kvcanary_cupy import RealKvHashMode, VerifyOrWriteContext, VerifyPlan, WritePlan, launch_canary_write_kernel
from kvcanary_cupy.backends import resolve_backend, unavailable_reason
from kvcanary_cupy.backends.host import HOST_SHAPE
from kvcanary_cupy.backends.kernel_backend import KernelBackend
from kvcanary_cupy.dlpack import CPU
from kvcanary_cupy.kv_layouts import vllm_cpu_source
from kvcanary_cupy.verify import prepare_verify_launch

BASELINE_REVISION = "ce63944f71e4d3419913bceb67d444077256939f"
REQUESTS, TOKENS, BLOCK, BLOCKS, HEADS, HEAD_SIZE, LAYERS = 8, 320, 32, 128, 4, 64, 4
ENTRIES = REQUESTS * TOKENS
ALTERNATING_ROUNDS = 61
HOST_REASON = unavailable_reason("host")
needs_host = pytest.mark.skipif(HOST_REASON is not None, reason=f"host backend: {HOST_REASON}")
ROOT = Path(__file__).resolve().parents[1]
_EVICT = np.ones(16 << 20, np.float32)  # 64 MiB


def evict() -> None:
    """Push the verify's records, plan and KV lines out of the caches, as a forward's weights do."""
    _EVICT.sum()


@functools.cache
def caches() -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(0)
    return tuple(rng.standard_normal((BLOCKS, HEADS, BLOCK, 2 * HEAD_SIZE)).astype(np.float32)
                 for _ in range(LAYERS))


@functools.cache
def slots() -> np.ndarray:
    """Request r's tokens in blocks 1 + 16 r .. (block 0 is vLLM's null block), each request one chain."""
    blocks = 1 + 16 * np.arange(REQUESTS)[:, None] + np.arange(TOKENS // BLOCK)[None, :]
    return (blocks[:, :, None] * BLOCK + np.arange(BLOCK)[None, None, :]).reshape(-1).astype(np.int64)


@functools.cache
def verify_launch(which: str):
    """A clean verify launch over ``slots()`` whose records were written with the same sources."""
    sources = tuple(vllm_cpu_source(c, block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD_SIZE, which=which,
                                    read_bytes=16, isa="vec") for c in caches())
    ctx = VerifyOrWriteContext.allocate(num_slots=BLOCKS * BLOCK, ring_capacity=64, real_kv_sources=sources,
                                        real_kv_hash_mode=RealKvHashMode.PARTIAL)
    s = slots()
    positions = np.tile(np.arange(TOKENS, dtype=np.int64), REQUESTS)
    wp = WritePlan.allocate(write_req_capacity=REQUESTS)
    wp.write_offsets[:] = np.arange(REQUESTS + 1) * TOKENS
    wp.write_seed_slot_indices[:] = -1
    wp.write_num_valid_reqs[0] = REQUESTS
    launch_canary_write_kernel(context=ctx, plan=wp, input_ids=positions + 7, positions=positions,
                               out_cache_loc=s, enable_write_input_assert=False, backend="numpy")
    vp = VerifyPlan.allocate(verify_capacity=ENTRIES)
    vp.verify_slot_indices[:] = s
    vp.verify_expected_tokens[:] = -1
    vp.verify_expected_positions[:] = positions
    prev = np.concatenate([[-1], s[:-1]])
    prev[positions == 0] = -1
    vp.verify_prev_slot_indices[:] = prev
    vp.verify_num_valid[0] = ENTRIES
    vp.enable[0] = 1
    return prepare_verify_launch(context=ctx, plan=vp, check_verify_expected_token=False)


@functools.cache
def baseline_backend() -> KernelBackend | str:
    """The host backend over ``kernels/`` at BASELINE_REVISION (the same launch ABI), or why it cannot be built."""
    from kvcanary_cupy.hostcuda import HostModule, host_threads

    folder = Path(tempfile.mkdtemp(prefix="kvc-verify-baseline-"))
    for name in ("verify.cu", "canary_common.cuh"):  # the verify is all this file launches
        shown = subprocess.run(["git", "show", f"{BASELINE_REVISION}:kernels/{name}"], cwd=ROOT,
                               capture_output=True, text=True, check=False)
        if shown.returncode != 0:
            return f"git cannot show {BASELINE_REVISION}:kernels/{name} ({shown.stderr.strip()[:200]})"
        (folder / name).write_text(shown.stdout)

    @functools.cache
    def load(file: str) -> HostModule:
        return HostModule((folder / file).read_text(), options=("-DKVC_SOURCE_HASH=0x0ull",),
                          include_dirs=(folder,), name=f"baseline_{file.removesuffix('.cu')}")

    # the launch shape and thread count of today's host backend (make_host_backend), so the grids are the same
    return KernelBackend("host-baseline", load, HOST_SHAPE, threads=host_threads)


def clean(launch) -> None:
    assert int(launch.context.write_index[0]) == 0 and int(launch.context.status[0]) == 0


@needs_host
@pytest.mark.parametrize("role", ["subject", "baseline"])
@pytest.mark.parametrize("which", ["k", "v"])
def test_cold_tail_verify_of_a_vllm_decode_step(measure, benchmark, which, role):
    from kvcanary_cupy.hostcuda import threads_on_this_thread

    launch = verify_launch(which)
    today = resolve_backend("host", CPU)
    backend = today if role == "subject" else baseline_backend()
    if isinstance(backend, str):
        pytest.skip(backend)
    info = {}
    with threads_on_this_thread(1):
        fn = functools.partial(backend.verify, launch)
        fn()
        clean(launch)
        if role == "subject" and not benchmark.disabled:
            old = baseline_backend()
            if not isinstance(old, str):
                info["alternating_ratio"] = round(alternating_ratio(fn, functools.partial(old.verify, launch),
                                                                     ALTERNATING_ROUNDS, setup=evict), 4)
        label = ("today's kernels" if role == "subject" else f"kernels at git {BASELINE_REVISION[:7]}")
        measure(fn, setup=evict, **info, label=f"{which.upper()}: {label}", role=role, entries=ENTRIES,
                group=f"cold TAIL verify · vLLM CPU cache ({which.upper()}) · {ENTRIES} entries × {LAYERS} "
                      "sources × 16 B · host, 1 thread",
                key=f"cpu.vllm-verify.{which}.{role}")
    clean(launch)
