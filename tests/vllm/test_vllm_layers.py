"""A layer's real-KV sources (integrations/vllm/layers.py) over caches vLLM itself allocates: every
``KVCacheLayout`` through vLLM's own ``compute_layout_strides`` and ``create_kv_cache_views``, vLLM's own specs,
and the MLA layer's squeezed latent cache. Each source's fingerprints are compared with the scalar oracle's over
the bytes gathered by torch indexing of vLLM's views."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from chain_helpers import context, fields, write
from oracle import MODE_ALL, real_kv_hash, to_i64
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheTensor,
    MLAAttentionSpec,
    compute_layout_strides,
    create_kv_cache_views,
)
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm_caches import gathered

import kvcanary_cupy as kc
from kvcanary_cupy.integrations.vllm.layers import layer_sources


def vllm_views(spec, layout: KVCacheLayout, num_blocks: int, layers: int, seed: int) -> list[torch.Tensor]:
    """vLLM's per-layer views of one group's buffer (random bytes), strides from vLLM's own arithmetic."""
    layer_stride, block_stride, *_ = compute_layout_strides(spec, num_blocks, layers, layout)
    size = spec.page_size_bytes * num_blocks * layers
    raw = torch.from_numpy(np.random.default_rng(seed).integers(-128, 128, size=size, dtype=np.int8))
    tensor = KVCacheTensor(size=size, layers=[f"layer{i}" for i in range(layers)], layer_stride=layer_stride,
                           block_stride=block_stride)
    return create_kv_cache_views(raw, spec, num_blocks, layout, tensor)


def backend(name: str) -> SimpleNamespace:
    """A layer whose ``attn_backend.get_name()`` is ``name`` (what layer_sources reads of the layer)."""
    return SimpleNamespace(attn_backend=SimpleNamespace(get_name=lambda: name))


def stamped(source, num_slots: int, slots: list[int]) -> list[int]:
    ctx = context(num_slots=num_slots, real_kv_sources=(source,), real_kv_hash_mode=MODE_ALL)
    write(ctx, [len(slots)], [-1], slots, list(range(len(slots))), list(range(len(slots))))
    return [int(v) for v in fields(ctx)[slots, 3]]


def oracle(values: np.ndarray, slots: list[int]) -> list[int]:
    return [to_i64(real_kv_hash(s, [(values, 1, values.shape[1], values.shape[1])], MODE_ALL)) for s in slots]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.uint8], ids=str)
@pytest.mark.parametrize("layout", list(KVCacheLayout), ids=lambda x: x.name)
@pytest.mark.parametrize("backend_name", ["FLASH_ATTN", "TRITON_ATTN", "FLASHINFER"])
def test_packed_layouts_vllm_allocates_fingerprint_byte_exact(backend_name, layout, dtype):
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=16, dtype=dtype)
    views = vllm_views(spec, layout, num_blocks=3, layers=2, seed=list(KVCacheLayout).index(layout))
    slots = list(range(1, 48, 5))
    for cache in views:
        assert tuple(cache.shape) == (3, 2, 16, 32) and cache.dtype == dtype
        for which in ("k", "v"):
            values = gathered(cache, which, 16)
            (source,) = layer_sources(backend(backend_name), cache, spec, which, kv_cache_layout=layout)
            assert stamped(source, 48, slots) == oracle(values, slots), (layout.name, which)


def test_a_layer_stored_in_another_layout_than_the_resolved_one_is_refused():
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=16, dtype=torch.float16)
    (cache, _) = vllm_views(spec, KVCacheLayout.LBNHC, num_blocks=2, layers=2, seed=1)
    with pytest.raises(kc.CanaryArgumentError, match=r"^kv-canary: kv_cache has shape .* kv_cache_layout='LBHNC'"):
        layer_sources(backend("FLASH_ATTN"), cache, spec, "k", kv_cache_layout=KVCacheLayout.LBHNC)


def test_a_packed_cache_whose_content_is_not_k_then_v_is_refused():
    """A quantization mode that packs scales into the content axis (``state_content_bytes``) is not K then V."""
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=16, dtype=torch.uint8,
                             state_content_bytes=48)
    (cache,) = vllm_views(spec, KVCacheLayout.LBNHC, num_blocks=2, layers=1, seed=2)
    with pytest.raises(kc.CanaryArgumentError, match=r"^kv-canary: kv_cache's last axis holds 48 elements"):
        layer_sources(backend("FLASH_ATTN"), cache, spec, "k")


def test_cpu_attention_layers_take_the_cpu_layout_and_their_isa():
    spec = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=16, dtype=torch.float32)
    (cache,) = vllm_views(spec, KVCacheLayout.LBHNC, num_blocks=2, layers=1, seed=3)
    layer = backend("CPU_ATTN")
    layer.isa = "vec"
    (k,) = layer_sources(layer, cache, spec, "k")
    assert k.layout.element_stride == 32 * 4  # K column-major: one element per token row of the block
    # the oracle for CPU "vec": K of token t, head h is elements t, t + bs, ... of the (block, head) plane
    planes = cache.reshape(2, 2, 2 * 32 * 16)
    values = np.stack([np.concatenate([planes[b, h, t: 32 * 16: 32].numpy() for h in range(2)])
                       for b in range(2) for t in range(32)]).view(np.uint8)
    slots = list(range(0, 64, 3))
    assert stamped(k, 64, slots) == oracle(values, slots)
    layer.isa = "amx"
    with pytest.raises(kc.CanaryArgumentError, match=r"^kv-canary: isa='amx'"):
        layer_sources(layer, cache, spec, "v")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8], ids=str)
def test_mla_layers_fingerprint_their_latent_rows_and_have_no_v(dtype):
    """MLA's spec, views squeezed as ``MLAAttention.bind_kv_cache`` does: ``[blocks, block_size, 576]``."""
    spec = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=dtype)
    views = [v.squeeze(1) for v in vllm_views(spec, KVCacheLayout.LBHNC, num_blocks=3, layers=2, seed=4)]
    slots = list(range(0, 48, 7))
    for cache in views:
        assert tuple(cache.shape) == (3, 16, 576)
        (k,) = layer_sources(backend("CPU_MLA"), cache, spec, "k")
        values = cache.reshape(48, 576).contiguous().view(torch.uint8).numpy()
        assert stamped(k, 48, slots) == oracle(values, slots)
        assert layer_sources(backend("CPU_MLA"), cache, spec, "v") == []


@pytest.mark.parametrize("context", [None, [0, 48]])
@pytest.mark.parametrize("decodes", [0, 2])
def test_mla_metadata_is_read_as_one_batch_decodes_first(decodes, context):
    """MLA metadata splits the batch into decode rows, then prefill rows (whose cached context, on backends that
    keep prefix caching on, is in ``chunked_context``): the step read gets the whole block table and each row's
    sequence length (a prefill's: its query plus its cached context). vLLM's CPU_MLA turns prefix caching off, so
    the context case is built here by hand."""
    from kvcanary_cupy.integrations.vllm.metadata import attention_metadata

    table = torch.arange(4 * 6, dtype=torch.int32).reshape(4, 6)  # rows: requests in the batch's order
    decode = None if decodes == 0 else SimpleNamespace(block_table=table[:decodes], seq_lens=torch.tensor([17, 40]))
    queries = torch.tensor([30, 5]) if decodes else torch.tensor([9, 1, 30, 5])
    chunked = None if context is None else SimpleNamespace(context_lens_list=(context if decodes else [0, 0, *context]))
    prefill = SimpleNamespace(block_table=table[decodes:], query_lens_cpu=queries, chunked_context=chunked)
    md = SimpleNamespace(query_start_loc=torch.tensor([0]), slot_mapping=torch.tensor([1]), decode=decode,
                         prefill=prefill)
    got = attention_metadata(md)
    assert torch.equal(got.block_table, table)
    want = ([17, 40] if decodes else [9, 1]) + [30 + (context or [0, 0])[0], 5 + (context or [0, 0])[1]]
    assert got.seq_lens.tolist() == want
    assert got.query_start_loc is md.query_start_loc and got.slot_mapping is md.slot_mapping
    plain = SimpleNamespace(query_start_loc=1, seq_lens=2, block_table=3, slot_mapping=4)
    assert attention_metadata(plain) is plain
