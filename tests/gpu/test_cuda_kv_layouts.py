"""vLLM's KV layouts read in place on a GPU: each preset over a CuPy (and a torch CUDA) cache stamps the
fingerprints the NumPy reference computes from a host copy of the same cache.

Every test is marked ``gpu``; the suite's conftest skips them with a reason where no CUDA device is visible.
"""

from __future__ import annotations

import numpy as np
import pytest

import kvcanary_cupy as kc
from kvcanary_cupy.kv_layouts import (
    flash_attn_source,
    flashinfer_hnd_source,
    vllm_attention_source,
    vllm_cpu_source,
    vllm_mla_source,
)

pytestmark = pytest.mark.gpu
cp = pytest.importorskip("cupy")

BLOCKS, BS, HEADS, D = 4, 32, 2, 64


def _nhd(storage):
    """vLLM 0.32's [blocks, heads, block_size, 2 * D] view of a cache stored tokens outside heads (LBNHC)."""
    return storage.swapaxes(1, 2)


def _presets(which: str):
    """(build a source from the stored array, the stored array's shape): vLLM 0.32's layouts on a GPU."""
    return {
        "flash_attn": (lambda c: flash_attn_source(_nhd(c), which=which, read_bytes=HEADS * D * 2),
                       (BLOCKS, BS, HEADS, 2 * D)),
        "flashinfer_hnd": (lambda c: flashinfer_hnd_source(c, which=which, read_bytes=HEADS * D * 2),
                           (BLOCKS, HEADS, BS, 2 * D)),
        "vllm_attention_lbnhc": (lambda c: vllm_attention_source(_nhd(c), head_size=D, which=which,
                                                                 read_bytes=HEADS * D * 2, kv_cache_layout="LBNHC"),
                                 (BLOCKS, BS, HEADS, 2 * D)),
        "vllm_mla": (lambda c: vllm_mla_source(c, which="k", read_bytes=576 * 2), (BLOCKS, BS, 576)),
        "vllm_cpu": (lambda c: vllm_cpu_source(c, block_size=BS, num_kv_heads=HEADS, head_size=D, which=which,
                                               read_bytes=HEADS * D * 2, isa="vec"),
                     (BLOCKS, HEADS, BS, 2 * D)),
    }


def _stamped(source, device: str, slots: np.ndarray) -> np.ndarray:
    """Write one chain over ``slots`` with ``source`` (ALL mode) and return the stamped fingerprints."""
    xp = cp if device == "cuda" else np
    n = len(slots)
    ctx = kc.VerifyOrWriteContext.allocate(num_slots=BLOCKS * BS, real_kv_sources=(source,),
                                           real_kv_hash_mode=kc.RealKvHashMode.ALL, device=device)
    wp = kc.WritePlan.allocate(write_req_capacity=1, device=device)
    wp.write_offsets[...] = xp.asarray([0, n], xp.int64)
    wp.write_seed_slot_indices[...] = -1
    wp.write_num_valid_reqs[...] = 1
    kc.launch_canary_write_kernel(context=ctx, plan=wp, input_ids=xp.arange(n, dtype=xp.int64),
                                  positions=xp.arange(n, dtype=xp.int64), out_cache_loc=xp.asarray(slots),
                                  enable_write_input_assert=False, expected_input_tokens=None,
                                  expected_input_positions=None)
    buf = ctx.canary_buf.get() if device == "cuda" else ctx.canary_buf
    return buf.view(np.int64)[slots, 3]


@pytest.mark.parametrize("which", ["k", "v"])
@pytest.mark.parametrize("preset", ["flash_attn", "flashinfer_hnd", "vllm_attention_lbnhc", "vllm_mla", "vllm_cpu"])
def test_preset_over_a_cupy_cache_stamps_the_reference_fingerprints(preset, which):
    build, shape = _presets(which)[preset]
    host = np.random.default_rng(0).standard_normal(shape).astype(np.float16)
    slots = np.arange(1, BLOCKS * BS, 3, dtype=np.int64)
    want = _stamped(build(host), "cpu", slots)
    got = _stamped(build(cp.asarray(host)), "cuda", slots)
    assert np.array_equal(got, want) and (want != 0).all()


def test_vllm_cpu_preset_over_a_torch_cuda_bf16_cache():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device")
    build, shape = _presets("k")["vllm_cpu"]
    host = torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    slots = np.arange(0, BLOCKS * BS, 5, dtype=np.int64)
    want = _stamped(build(host), "cpu", slots)
    got = _stamped(build(host.cuda()), "cuda", slots)
    assert np.array_equal(got, want)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "uint8"])
@pytest.mark.parametrize("layout", ["LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC"])
def test_every_kv_cache_layout_over_a_torch_cuda_group_stamps_the_oracle_fingerprints(layout, dtype):
    """A group's layers allocated in one CUDA buffer as vLLM 0.32 does, per layout: each layer's K and V
    fingerprints equal the scalar oracle's over the same bytes gathered by torch indexing."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device")
    from oracle import MODE_ALL, real_kv_hash, to_i64
    from vllm_caches import gathered, vllm_group_caches

    caches = vllm_group_caches(layout, layers=2, blocks=BLOCKS, heads=HEADS, block_size=BS, head_size=16,
                               head_size_v=16, dtype=getattr(torch, dtype), seed=3, device="cuda")
    slots = np.arange(1, BLOCKS * BS, 3, dtype=np.int64)
    for cache in caches:
        for which in ("k", "v"):
            values = gathered(cache, which, 16)
            source = vllm_attention_source(cache, head_size=16, which=which, read_bytes=values.shape[1],
                                           kv_cache_layout=layout)
            want = [to_i64(real_kv_hash(int(s), [(values, 1, values.shape[1], values.shape[1])], MODE_ALL))
                    for s in slots]
            assert _stamped(source, "cuda", slots).tolist() == want
