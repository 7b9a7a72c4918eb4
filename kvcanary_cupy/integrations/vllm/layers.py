"""Where one vLLM layer keeps a token's K and V: the layer's real-KV sources, chosen from what vLLM says.

The choice reads vLLM's own objects, never a guess from the model: the group's KV cache spec (an MLA spec
stores one latent row per token and no V), the layer's attention backend (vLLM's CPU attention keeps its own
per-ISA layout inside each block; every other backend uses the packed ``[blocks, heads, tokens, K|V]`` layout
vLLM 0.32 allocates for all of them), the cache tensor's shape and strides, and, when the caller has it, the
resolved ``KVCacheLayout``. Whatever is not understood is refused by :mod:`kvcanary_cupy.kv_layouts` with a
``kv-canary:`` error naming the argument, never read with a wrong layout.
"""

from __future__ import annotations

from typing import Any

from ..._errors import fail
from ...context import RealKvSource
from ...kv_layouts import vllm_attention_source, vllm_cpu_source, vllm_mla_source

# The attention backend whose caches follow vLLM's CPU kernels' own layout (vllm/v1/attention/backends/cpu_attn.py).
CPU_ATTENTION_BACKEND = "CPU_ATTN"


def is_mla_spec(spec: Any) -> bool:
    """Whether ``spec`` is vLLM's ``MLAAttentionSpec`` (or a subclass): one latent row per token, no V."""
    return any(cls.__name__ == "MLAAttentionSpec" for cls in type(spec).__mro__)


def backend_name(layer: Any) -> str | None:
    """The name of the layer's attention backend (``layer.attn_backend.get_name()``), None if it has none."""
    backend = getattr(layer, "attn_backend", None)
    get_name = getattr(backend, "get_name", None)
    return str(get_name()) if callable(get_name) else None


def layer_sources(layer: Any, cache: Any, spec: Any, which: str, read_bytes: int | None = None, *,
                  kv_cache_layout: Any = None) -> list[RealKvSource]:
    """The real-KV sources of ``which`` ("k" or "v") of one layer whose KV cache is ``cache``, in the group
    whose spec is ``spec``; ``read_bytes`` None reads a token's whole K (or V).

    - An MLA layer (``MLAAttentionSpec``): its ``[num_blocks, block_size, row]`` latent cache, one row per token,
      is K; it has no V, so ``which="v"`` gives no source (an empty list): with ``with_v`` on, an MLA group's
      real-KV fingerprint covers the latent rows only.
    - A layer of vLLM's CPU attention: :func:`~kvcanary_cupy.kv_layouts.vllm_cpu_source` with the layer's ISA
      (``layer.isa``); an ISA whose layout is not implemented is refused.
    - Any other attention layer: the packed cache ``[num_blocks, num_kv_heads, block_size, head_size +
      head_size_v]`` through :func:`~kvcanary_cupy.kv_layouts.vllm_attention_source`, its physical order read
      from the tensor's strides and checked against ``kv_cache_layout`` (the resolved ``KVCacheLayout``, e.g.
      ``runner.cache_config.get_resolved_kv_cache_layout()``) when given. A cache whose last axis is not
      ``head_size + head_size_v`` elements (a quantization mode packing scales with the values) is refused.
    """
    if which not in ("k", "v"):
        fail(f"which must be 'k' or 'v', got {which!r}")
    item = int(cache.element_size())
    if is_mla_spec(spec):
        if which == "v":
            return []
        row = int(cache.shape[-1]) * item
        return [vllm_mla_source(cache, which="k", read_bytes=read_bytes or row)]
    heads, head_size = int(spec.num_kv_heads), int(spec.head_size)
    head_size_v = int(getattr(spec, "head_size_v", None) or head_size)
    per_token = heads * (head_size if which == "k" else head_size_v) * item
    read = read_bytes or per_token
    if backend_name(layer) == CPU_ATTENTION_BACKEND:
        return [vllm_cpu_source(cache, block_size=int(cache.shape[2]), num_kv_heads=heads, head_size=head_size,
                                which=which, read_bytes=read, isa=str(getattr(layer, "isa", "vec")))]
    content = int(cache.shape[-1]) if cache.dim() == 4 else None
    if content is not None and content != head_size + head_size_v:
        fail(f"kv_cache's last axis holds {content} elements per (block, head, token), not head_size + "
             f"head_size_v = {head_size} + {head_size_v}: a packed quantized layout whose bytes are not read")
    return [vllm_attention_source(cache, head_size=head_size, which=which, read_bytes=read,
                                  kv_cache_layout=kv_cache_layout)]


__all__ = ["CPU_ATTENTION_BACKEND", "backend_name", "is_mla_spec", "layer_sources"]
