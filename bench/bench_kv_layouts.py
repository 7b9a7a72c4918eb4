"""CPU benchmarks of real-KV fingerprints over strided KV layouts, and the contiguous case against the code
that had no layouts.

Workload: a verify launch of 8192 entries (one chain over a shuffled set of slots, written first so the verify
is clean) with 2 real-KV sources of 256 bytes per token in ALL mode, pools of 16-token pages (1024 pages,
4 MiB each). The same pool bytes are read five ways:

* ``contiguous`` — a source without a layout (the path every existing integration takes);
* ``pre-layout kernels`` (host only) — the kernels and launch arguments as they were before layouts existed,
  compiled from git revision ``PRE_LAYOUT_REVISION`` in the same run: the baseline of the host group, so the
  contiguous row's ``ratio_to_baseline`` is the cost of the generalisation on the unchanged case;
* ``layout: one run per token`` — the contiguous case described by an explicit KvByteLayout (2 heads);
* ``layout: one run per head`` — heads before tokens inside a page (FlashInfer HND);
* ``layout: element by element`` — K column-major inside a (page, head) plane (vLLM's CPU cache).

The NumPy group times the reference's fold directly; its baseline is the fold over plain
``(rows, page_size, bytes_per_token, read_bytes)`` tuples, the input the pre-layout fold took.

On a loaded machine rows timed one after another drift apart; each contiguous row therefore also records
``alternating_ratio``: the median, over ``ALTERNATING_ROUNDS`` rounds that each time the contiguous call and
its baseline back to back (in alternating order), of their time ratio. Nothing here fails on a time; run
``make bench``.
"""

from __future__ import annotations

import functools
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import pytest
from alternating import alternating_ratio

import kvcanary_cupy as kc
from kvcanary_cupy.backends import resolve_backend, unavailable_reason
from kvcanary_cupy.dlpack import CPU
from kvcanary_cupy.hashing import fold_real_kv
from kvcanary_cupy.verify import prepare_verify_launch

PRE_LAYOUT_REVISION = "e6d1d83b3a4827af8c694eb83fd8ac24328409ba"  # the last commit before KvByteLayout
PAGES, PAGE, TOKEN_BYTES, SOURCES, ENTRIES = 1024, 16, 256, 2, 8192
HOST_REASON = unavailable_reason("host")
needs_host = pytest.mark.skipif(HOST_REASON is not None, reason=f"host backend: {HOST_REASON}")
ROOT = Path(__file__).resolve().parents[1]
ALTERNATING_ROUNDS = 41

# (key, label, layout or None): every layout reads 2 heads of 64 two-byte elements per token.
VARIANTS = [
    ("contiguous", "contiguous source (no layout)", None),
    ("token-run", "layout: one run per token",
     kc.KvByteLayout(page_stride=PAGE * TOKEN_BYTES, token_stride=TOKEN_BYTES, head_stride=128, element_stride=2,
                     num_heads=2, elements_per_head=64, element_bytes=2)),
    ("head-runs", "layout: one run per head (heads before tokens)",
     kc.KvByteLayout(page_stride=PAGE * TOKEN_BYTES, token_stride=128, head_stride=PAGE * 128, element_stride=2,
                     num_heads=2, elements_per_head=64, element_bytes=2)),
    ("elements", "layout: element by element (K column-major per page and head)",
     kc.KvByteLayout(page_stride=PAGE * TOKEN_BYTES, token_stride=2, head_stride=PAGE * 128, element_stride=PAGE * 2,
                     num_heads=2, elements_per_head=64, element_bytes=2)),
]


@functools.cache
def pools() -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(0)
    return tuple(rng.integers(0, 256, size=(PAGES, PAGE * TOKEN_BYTES), dtype=np.uint8) for _ in range(SOURCES))


def sources(key: str) -> tuple[kc.RealKvSource, ...]:
    layout = dict((k, lay) for k, _, lay in VARIANTS)[key]
    if layout is None:
        return tuple(kc.RealKvSource(p, page_size=PAGE, num_bytes_per_token=TOKEN_BYTES, read_bytes=TOKEN_BYTES)
                     for p in pools())
    return tuple(kc.RealKvSource(p.reshape(-1), page_size=PAGE, num_bytes_per_token=TOKEN_BYTES,
                                 read_bytes=TOKEN_BYTES, layout=layout) for p in pools())


@functools.cache
def slots() -> np.ndarray:
    return np.random.default_rng(1).permutation(PAGES * PAGE)[:ENTRIES].astype(np.int64)


@functools.cache
def verify_launch(key: str):
    """A clean verify launch over ``slots()`` whose records were written with the same sources."""
    ctx = kc.VerifyOrWriteContext.allocate(num_slots=PAGES * PAGE, ring_capacity=64, real_kv_sources=sources(key),
                                           real_kv_hash_mode=kc.RealKvHashMode.ALL)
    s = slots()
    wp = kc.WritePlan.allocate(write_req_capacity=1)
    wp.write_offsets[:] = [0, ENTRIES]
    wp.write_seed_slot_indices[0] = -1
    wp.write_num_valid_reqs[0] = 1
    positions = np.arange(ENTRIES, dtype=np.int64)
    kc.launch_canary_write_kernel(context=ctx, plan=wp, input_ids=positions + 7, positions=positions,
                                  out_cache_loc=s, enable_write_input_assert=False, backend="numpy")
    vp = kc.VerifyPlan.allocate(verify_capacity=ENTRIES)
    vp.verify_slot_indices[:] = s
    vp.verify_expected_tokens[:] = -1
    vp.verify_expected_positions[:] = positions
    vp.verify_prev_slot_indices[:] = np.concatenate([[-1], s[:-1]])
    vp.verify_num_valid[0] = ENTRIES
    vp.enable[0] = 1
    return prepare_verify_launch(context=ctx, plan=vp, check_verify_expected_token=False)


def clean(launch) -> None:
    assert int(launch.context.write_index[0]) == 0 and int(launch.context.status[0]) == 0


# ---- the kernels as they were before layouts (host backend) --------------------------------------------------

@functools.cache
def pre_layout_module():
    """verify.cu and canary_common.cuh at PRE_LAYOUT_REVISION, compiled for the host; None with a reason."""
    from kvcanary_cupy.hostcuda import HostModule

    folder = Path(tempfile.mkdtemp(prefix="kvc-pre-layout-"))
    for name in ("verify.cu", "canary_common.cuh"):
        shown = subprocess.run(["git", "show", f"{PRE_LAYOUT_REVISION}:kernels/{name}"], cwd=ROOT,
                               capture_output=True, text=True, check=False)
        if shown.returncode != 0:
            return f"git cannot show {PRE_LAYOUT_REVISION}:kernels/{name} ({shown.stderr.strip()[:200]})"
        (folder / name).write_text(shown.stdout)
    return HostModule((folder / "verify.cu").read_text(), options=("-DKVC_SOURCE_HASH=0x0ull",),
                      include_dirs=(folder,), name="verify_pre_layout")


def pre_layout_verify(module, shape, launch) -> None:
    """The verify launch with the pre-layout argument list (5 scalars per source: rows, row stride, page
    size, bytes per token, read bytes)."""
    ctx = launch.context
    args: list = []
    for k in range(kc.MAX_REAL_KV_SOURCES):
        if k < len(ctx.sources):
            rows = ctx.sources[k].data
            stride = int(rows.strides[0]) if rows.shape[0] > 1 else int(rows.shape[1])
            args += [rows, np.int64(stride), np.int64(PAGE), np.int64(TOKEN_BYTES), np.int64(TOKEN_BYTES)]
        else:
            args += [None, np.int64(0), np.int64(1), np.int64(16), np.int64(16)]
    args += [np.int32(len(ctx.sources)), np.int32(ctx.mode)]
    module.get_function("kvc_verify")(
        (shape.verify_grid,), (shape.verify_block,),
        (ctx.canary, np.int64(ctx.num_slots), np.int64(ctx.canary.shape[1]), launch.slots, launch.expected_tokens,
         launch.expected_positions, launch.prev_slots, launch.num_valid, launch.enable, np.int64(launch.capacity),
         np.int32(launch.check_verify_expected_token), np.int64(ctx.kernel_kind), ctx.ring,
         np.int64(ctx.ring.shape[0]), ctx.write_index, ctx.slot_run_counter, ctx.kernel_run_counter, ctx.status,
         *args))


@needs_host
@pytest.mark.parametrize("key", ["pre-layout", *(k for k, _, _ in VARIANTS)])
def test_verify_with_real_kv_on_the_host(measure, benchmark, key):
    backend = resolve_backend("host", CPU)
    if key == "pre-layout":
        module = pre_layout_module()
        if isinstance(module, str):
            pytest.skip(module)
        launch = verify_launch("contiguous")
        fn = functools.partial(pre_layout_verify, module, backend.shape, launch)
        label, role = f"pre-layout kernels (git {PRE_LAYOUT_REVISION[:7]}), contiguous source", "baseline"
    else:
        launch = verify_launch(key)
        fn = functools.partial(backend.verify, launch)
        label = dict((k, lab) for k, lab, _ in VARIANTS)[key]
        role = "subject" if key == "contiguous" else "info"
    fn()
    clean(launch)
    info = {}
    if key == "contiguous" and not benchmark.disabled:
        module = pre_layout_module()
        if not isinstance(module, str):
            old = functools.partial(pre_layout_verify, module, backend.shape, verify_launch("contiguous"))
            info["alternating_ratio"] = round(alternating_ratio(fn, old, ALTERNATING_ROUNDS), 4)
    measure(fn, **info, group=f"real-KV verify · host · {ENTRIES} entries × {SOURCES} sources × {TOKEN_BYTES} B",
            label=f"host: {label}", role=role, entries=ENTRIES, key=f"cpu.kv-layouts.verify.host.{key}")
    clean(launch)


@pytest.mark.parametrize("key", ["plain-tuples", *(k for k, _, _ in VARIANTS)])
def test_fold_real_kv_in_numpy(measure, benchmark, key):
    s = slots()
    if key == "plain-tuples":
        views = [(p, PAGE, TOKEN_BYTES, TOKEN_BYTES) for p in pools()]
        label, role = "plain (rows, page_size, bytes, read) tuples: the pre-layout input", "baseline"
    else:
        views = [src.view() for src in sources(key)]
        label = dict((k, lab) for k, lab, _ in VARIANTS)[key]
        role = "subject" if key == "contiguous" else "info"
    want = fold_real_kv(s, [(p, PAGE, TOKEN_BYTES, TOKEN_BYTES) for p in pools()], int(kc.RealKvHashMode.ALL))
    got = fold_real_kv(s, views, int(kc.RealKvHashMode.ALL))
    if key in ("plain-tuples", "contiguous", "token-run"):  # these three read the very same byte order
        np.testing.assert_array_equal(got, want)
    info = {}
    if key == "contiguous" and not benchmark.disabled:
        plain = [(p, PAGE, TOKEN_BYTES, TOKEN_BYTES) for p in pools()]
        info["alternating_ratio"] = round(alternating_ratio(
            lambda: fold_real_kv(s, views, int(kc.RealKvHashMode.ALL)),
            lambda: fold_real_kv(s, plain, int(kc.RealKvHashMode.ALL)), ALTERNATING_ROUNDS), 4)
    measure(lambda: fold_real_kv(s, views, int(kc.RealKvHashMode.ALL)), **info,
            group=f"real-KV fold · numpy · {ENTRIES} slots × {SOURCES} sources × {TOKEN_BYTES} B",
            label=f"numpy: {label}", role=role, entries=ENTRIES, key=f"cpu.kv-layouts.fold.numpy.{key}")
