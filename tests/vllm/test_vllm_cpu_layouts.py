"""vLLM's own CPU cache writer against the canary's reading of its layouts.

``cpu_attn_reshape_and_cache`` (vLLM's compiled op, the one its CPU attention calls every step) fills a layer's
cache ``[num_blocks, num_kv_heads, block_size, 2 * head_size]`` for the ISA it is given. Its `amx` path is plain
stores (no AMX instruction), so it runs on any x86 CPU: the caches here are exactly what a bf16 model on an AMX
machine holds. For every slot vLLM wrote, the fingerprint :func:`vllm_cpu_source` reads in place must equal the
fingerprint of the K/V row vLLM was given (the source without a layout), on the NumPy and host backends, and the
element offsets of the fact sheet's `amx` description must hold the values vLLM stored.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kvcanary_cupy as kc
from kvcanary_cupy.backends import unavailable_reason
from kvcanary_cupy.kv_layouts import vllm_cpu_source

ops = pytest.importorskip("vllm._custom_ops")
BACKENDS = ["numpy"] + (["host"] if unavailable_reason("host") is None else [])


def _fill(isa: str, cache_dtype: torch.dtype, dtype: torch.dtype, bs: int, heads: int, d: int, blocks: int,
          seed: int, kv_cache_dtype: str = "auto") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, np.ndarray]:
    """A cache filled by vLLM at a random subset of slots (some tokens skipped with slot -1, as vLLM's padding
    is): (cache, key, value, slot of each token)."""
    gen = torch.Generator().manual_seed(seed)
    cache = torch.zeros(blocks, heads, bs, 2 * d, dtype=cache_dtype)
    slots = torch.randperm(blocks * bs, generator=gen)[: blocks * bs * 3 // 4]
    slots[torch.randperm(slots.numel(), generator=gen)[:3]] = -1
    key = torch.randn(slots.numel(), heads, d, generator=gen).to(dtype)
    value = torch.randn(slots.numel(), heads, d, generator=gen).to(dtype)
    key_cache, value_cache = cache.view(blocks, heads, 2 * bs, d).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, isa, k_scale=1.0, v_scale=1.0,
                                   kv_cache_dtype=kv_cache_dtype)
    return cache, key, value, slots.numpy()


def _stamps(source: kc.RealKvSource, slots: list[int], backend: str, num_slots: int) -> list[int]:
    ctx = kc.VerifyOrWriteContext.allocate(num_slots=num_slots, real_kv_sources=(source,),
                                           real_kv_hash_mode=kc.RealKvHashMode.ALL)
    plan = kc.WritePlan.allocate(write_req_capacity=1)
    plan.write_offsets[:] = [0, len(slots)]
    plan.write_seed_slot_indices[:] = -1
    plan.write_num_valid_reqs[:] = 1
    n = np.arange(len(slots), dtype=np.int64)
    kc.launch_canary_write_kernel(context=ctx, plan=plan, input_ids=n + 7, positions=n,
                                  out_cache_loc=np.asarray(slots, np.int64), enable_write_input_assert=False,
                                  backend=backend)
    return [int(x) for x in ctx.canary_buf.view(np.int64)[slots, 3]]


def _rows(values: torch.Tensor) -> kc.RealKvSource:
    flat = values.reshape(values.shape[0], -1).contiguous().view(torch.uint8).numpy()
    return kc.RealKvSource(flat, page_size=1, num_bytes_per_token=flat.shape[1], read_bytes=flat.shape[1])


AMX_SHAPES = [(32, 1, 32), (32, 2, 64), (64, 2, 128), (128, 1, 64)]  # (block_size, heads, head_size)


@pytest.mark.parametrize(("bs", "heads", "d"), AMX_SHAPES)
def test_vllms_amx_writer_stores_each_element_where_the_fact_sheet_says(bs, heads, d):
    cache, key, value, slots = _fill("amx", torch.bfloat16, torch.bfloat16, bs, heads, d, 2, seed=bs + d)
    planes = cache.view(torch.int16).reshape(2, heads, 2 * bs * d).numpy()
    k, v = key.view(torch.int16).numpy(), value.view(torch.int16).numpy()
    for t, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        b, o = divmod(s, bs)
        for h in range(heads):
            for e in range(d):
                assert planes[b, h, (o // 16) * 16 * d + (e // 2) * 32 + (o % 16) * 2 + e % 2] == k[t, h, e]
                assert planes[b, h, bs * d + (e // 16) * bs * 16 + (o // 2) * 32 + (e % 16) * 2 + o % 2] == v[t, h, e]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("isa", "dtype", "bs", "heads", "d"), [
    *[("amx", torch.bfloat16, *shape) for shape in AMX_SHAPES],
    ("vec16", torch.bfloat16, 16, 2, 48), ("vec16", torch.float16, 32, 1, 80), ("vec16", torch.float32, 16, 2, 16 * 3),
    ("vec", torch.bfloat16, 32, 2, 64), ("vec", torch.float32, 32, 1, 32),
])
def test_the_preset_fingerprints_what_vllm_wrote_like_the_kv_it_was_given(backend, isa, dtype, bs, heads, d):
    blocks = 3
    cache, key, value, slots = _fill(isa, dtype, dtype, bs, heads, d, blocks, seed=7 * bs + d)
    written = [(t, s) for t, s in enumerate(slots.tolist()) if s >= 0]
    tokens, where = [t for t, _ in written], [s for _, s in written]
    for which, values in (("k", key), ("v", value)):
        source = vllm_cpu_source(cache, block_size=bs, num_kv_heads=heads, head_size=d, which=which,
                                 read_bytes=heads * d * cache.element_size(), isa=isa)
        want = _stamps(_rows(values[tokens]), list(range(len(tokens))), "numpy", len(tokens))
        assert _stamps(source, where, backend, blocks * bs) == want, which


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e5m2"])
@pytest.mark.parametrize(("isa", "bs"), [("amx", 32), ("amx", 64)])  # vLLM writes fp8 with amx and vec only
def test_an_fp8_cache_fingerprints_like_the_same_tokens_in_the_vec_layout(backend, kv_cache_dtype, isa, bs):
    """fp8 caches of a bf16 model: vLLM converts while it stores, so the expectation is the same tokens stored by
    vLLM's `vec` writer (whose layout is checked against the K/V given, above and in the fact sheet)."""
    heads, d, blocks = 2, 64, 2
    cache, *_, slots = _fill(isa, torch.uint8, torch.bfloat16, bs, heads, d, blocks, 3, kv_cache_dtype)
    vec, *_, same = _fill("vec", torch.uint8, torch.bfloat16, bs, heads, d, blocks, 3, kv_cache_dtype)
    assert np.array_equal(slots, same)
    where = [s for s in slots.tolist() if s >= 0]
    for which in ("k", "v"):
        got = vllm_cpu_source(cache, block_size=bs, num_kv_heads=heads, head_size=d, which=which,
                              read_bytes=heads * d, isa=isa)
        want = vllm_cpu_source(vec, block_size=bs, num_kv_heads=heads, head_size=d, which=which,
                               read_bytes=heads * d, isa="vec")
        assert _stamps(got, where, backend, blocks * bs) == _stamps(want, where, "numpy", blocks * bs), which
