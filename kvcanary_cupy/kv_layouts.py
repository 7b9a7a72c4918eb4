"""Real-KV sources over the KV tensors engines really allocate, read in place: the vLLM presets.

Each preset describes its engine's memory layout as a :class:`~kvcanary_cupy.KvByteLayout` (module
:mod:`kvcanary_cupy.kv_bytes`, re-exported here) and returns a :class:`~kvcanary_cupy.RealKvSource` for K or V.
A preset checks everything about ``kv_cache`` and ``read_bytes`` itself, so that a refusal names the caller's
arguments (never the fields of the source it would have built), and the source it returns is guarded on
``kv_cache`` itself: a torch cache re-pointed or shrunk later (``set_``, ``resize_``) is refused at the next
launch, as a plain :class:`~kvcanary_cupy.RealKvSource` over it would be, not read through the K/V view taken
at construction.
"""

from __future__ import annotations

import sys
from typing import Any

from ._errors import fail
from ._validate import data_pointer, int_arg
from .constants import REAL_KV_ALIGN_BYTES
from .context import RealKvSource, also_guarding
from .dlpack import as_byte_span
from .kv_bytes import (
    ACCESS_ELEMENTS,
    ACCESS_HEAD_RUNS,
    ACCESS_TOKEN_RUN,
    ELEMENT_BYTES,
    UNBOUNDED_SLOTS,
    KvByteLayout,
    contiguous_layout,
)


# ----------------------------------------------------------------------------------------------------------
# vLLM presets
# ----------------------------------------------------------------------------------------------------------
def _in_place(tensor: Any, name: str) -> tuple[Any, tuple[int, ...], tuple[int, ...], int]:
    """The tensor to slice (a torch tensor as given, anything else as its zero-copy NumPy/CuPy view, so that
    slicing never copies), its shape, its strides in elements and its element size."""
    as_byte_span(tensor, name)  # readable in place at all (dense, on a DLPack device, viewable as bytes)
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(tensor, torch.Tensor):
        return tensor, tuple(tensor.shape), tuple(tensor.stride()), int(tensor.element_size())
    from .dlpack import as_array

    arr = as_array(tensor, name)
    item = int(arr.dtype.itemsize)
    if any(s % item for s in arr.strides):
        fail(f"{name} has strides {arr.strides} that are not whole elements")
    return arr, tuple(arr.shape), tuple(int(s) // item for s in arr.strides), item


def _which(which: Any, name: str) -> int:
    if which not in ("k", "v"):
        fail(f"{name} must be 'k' or 'v', got {which!r}")
    return 0 if which == "k" else 1


def _check_shape(shape: tuple[int, ...], rank: int, name: str, what: str) -> None:
    if len(shape) != rank:
        fail(f"{name} must be {rank}-D {what}, got shape {shape}")
    if any(n <= 0 for n in shape):
        fail(f"{name} must not be empty, got shape {shape}")


def _check_strides(strides: tuple[int, ...], name: str) -> None:
    if any(s < 0 for s in strides):
        fail(f"{name} has a negative stride {strides}; only non-negative strides are read in place")


def _layout(item: int, **strides_and_sizes: int) -> KvByteLayout:
    """The layout of K or V in a cache of ``item``-byte elements, refused by the cache's name when the
    fingerprint cannot read it (an element size it has no load for, a token that is not whole 16-byte units)."""
    if item not in ELEMENT_BYTES:
        fail(f"kv_cache has {item}-byte elements; a KV layout is read in elements of "
             f"{', '.join(map(str, ELEMENT_BYTES))} bytes")
    layout = KvByteLayout(element_bytes=item, **strides_and_sizes)
    if layout.bytes_per_token % REAL_KV_ALIGN_BYTES:
        fail(f"kv_cache holds {layout.bytes_per_token} bytes of K (or V) per token (num_kv_heads="
             f"{layout.num_heads} x head_size={layout.elements_per_head} x {item}-byte elements), not a multiple "
             f"of {REAL_KV_ALIGN_BYTES}: the fingerprint reads whole {REAL_KV_ALIGN_BYTES}-byte units")
    return layout


def _source(kv_cache: Any, view: Any, which: str, page_size: int, layout: KvByteLayout,
            read_bytes: Any) -> RealKvSource:
    """The source over ``view`` (K or V of ``kv_cache``), with ``read_bytes`` and the view's start checked under
    the caller's names, guarded on ``kv_cache`` itself."""
    per_token = layout.bytes_per_token
    read = int_arg(read_bytes, "read_bytes")
    if read <= 0 or read > per_token or read % REAL_KV_ALIGN_BYTES:
        fail(f"read_bytes must be a positive multiple of {REAL_KV_ALIGN_BYTES} up to the {per_token} bytes of K "
             f"(or V) of one token, got {read}")
    torch = sys.modules.get("torch")
    start = view.data_ptr() if torch is not None and isinstance(view, torch.Tensor) else data_pointer(view)
    if start % REAL_KV_ALIGN_BYTES:
        fail(f"kv_cache's {which!r} part starts at address {start:#x}, not {REAL_KV_ALIGN_BYTES}-byte aligned "
             f"(the fingerprint loads aligned {REAL_KV_ALIGN_BYTES}-byte units)")
    layout.check_extent(int(as_byte_span(view, "kv_cache").shape[0]), f"kv_cache's {which!r} part",
                        f"kv_cache's {which!r} part, by its strides,")
    source = RealKvSource(view, page_size=page_size, num_bytes_per_token=per_token, read_bytes=read, layout=layout)
    return also_guarding(source, [("kv_cache", kv_cache)])


# vLLM's CPU attention ISAs whose KV layout is read (vllm/v1/attention/backends/cpu_attn.py, _get_attn_isa): `vec16`
# runs the `vec` kernels with 16-token steps and writes the cache exactly as `vec` does.
VLLM_CPU_ISAS = ("vec", "vec16", "amx")
# CPU attention's AMX layout: K in tiles of 16 tokens (AMX tile rows), elements in pairs (one 32-bit VNNI word);
# V in chunks of 16 elements (a tile's 16 columns), tokens in pairs.
_AMX_TILE_TOKENS = 16
_AMX_PAIR = 2
_AMX_V_CHUNK = 16
_AMX_ALIGN = 32  # vLLM picks `amx` for block sizes that are multiples of 32, head sizes too (else `vec16`)


def vllm_cpu_source(kv_cache: Any, *, block_size: int, num_kv_heads: int, head_size: int, which: str,
                    read_bytes: int, isa: str) -> RealKvSource:
    """K or V of one layer of vLLM's CPU attention cache, read in place.

    ``kv_cache`` is ``[num_blocks, num_kv_heads, block_size, 2 * head_size]`` (the layer's ``kv_cache``);
    ``isa`` is the layer's ``isa``. Each (block, head) plane holds K in its first ``block_size * head_size``
    elements and V in the rest, in the ISA's order (``o`` a token of the block, ``d`` an element of the head,
    offsets in elements from K's or V's first):

    - ``"vec"`` and ``"vec16"``: K column-major ``[head_size, block_size]`` (``d * block_size + o``), V row-major
      ``[block_size, head_size]`` (``o * head_size + d``);
    - ``"amx"`` (bf16 or fp8 cache): K in 16-token tiles with elements in pairs, ``(o // 16) * 16 * head_size +
      (d // 2) * 32 + (o % 16) * 2 + d % 2``; V in 16-element chunks with tokens in pairs, ``(d // 16) *
      block_size * 16 + (o // 2) * 32 + (d % 16) * 2 + o % 2``.

    Other ISAs store other layouts and are refused. Canary slot ``block * block_size + offset`` is token ``offset``
    of block ``block``.
    """
    if isa not in VLLM_CPU_ISAS:
        fail(f"isa={isa!r}: the vLLM CPU KV layout of that ISA is not implemented (only "
             f"{', '.join(map(repr, VLLM_CPU_ISAS))} are); it is refused rather than fingerprinted wrongly")
    kv = _which(which, "which")
    bs = int_arg(block_size, "block_size", minimum=1)
    heads = int_arg(num_kv_heads, "num_kv_heads", minimum=1)
    d = int_arg(head_size, "head_size", minimum=1)
    given = kv_cache
    kv_cache, shape, strides, item = _in_place(kv_cache, "kv_cache")
    _check_shape(shape, 4, "kv_cache", "[num_blocks, num_kv_heads, block_size, 2 * head_size]")
    if shape[1:] != (heads, bs, 2 * d):
        fail(f"kv_cache must have shape [num_blocks, num_kv_heads={heads}, block_size={bs}, 2 * head_size="
             f"{2 * d}], got {shape}")
    _check_strides(strides, "kv_cache")
    if (bs > 1 and strides[2] != 2 * d) or strides[3] != 1:
        fail(f"kv_cache must be contiguous within each (block, head) plane of block_size * 2 * head_size "
             f"elements, got strides {strides} (in elements)")
    if isa == "amx":
        if item not in (1, 2):
            fail(f"isa='amx' stores 2-byte (bf16) or 1-byte (fp8) elements; kv_cache has {item}-byte elements")
        if bs % _AMX_ALIGN or d % _AMX_ALIGN:
            fail(f"isa='amx' needs block_size and head_size multiples of {_AMX_ALIGN} (vLLM picks another ISA "
                 f"otherwise), got block_size={bs}, head_size={d}")
    # Each (block, head) plane is one run of 2 * block_size * head_size elements: K's half, then V's. A view
    # starting at the first byte of K or V is what the layout's strides are relative to: with an even
    # block_size, half the plane's rows (a plain slice); otherwise the planes viewed flat (no copy either:
    # each plane is contiguous) and sliced.
    if bs % 2 == 0:
        half = kv_cache[:, :, kv * (bs // 2):(kv + 1) * (bs // 2)]
    else:
        half = kv_cache.reshape(shape[0], heads, 2 * bs * d)[:, :, kv * bs * d:(kv + 1) * bs * d]
    splits: dict[str, int] = {}
    if isa == "amx" and kv == 0:  # 16-token tiles of head_size pairs; a pair is two adjacent elements
        token_stride, element_stride = _AMX_PAIR * item, item
        splits = dict(tokens_per_tile=_AMX_TILE_TOKENS, tile_stride=_AMX_TILE_TOKENS * d * item,
                      elements_per_group=_AMX_PAIR, group_stride=_AMX_PAIR * _AMX_TILE_TOKENS * item)
    elif isa == "amx":  # 16-element chunks of block_size tokens, tokens in pairs of adjacent elements
        token_stride, element_stride = item, _AMX_PAIR * item
        splits = dict(tokens_per_tile=_AMX_PAIR, tile_stride=_AMX_PAIR * _AMX_V_CHUNK * item,
                      elements_per_group=_AMX_V_CHUNK, group_stride=bs * _AMX_V_CHUNK * item)
    elif kv == 0:  # column-major [head_size, block_size]: consecutive tokens are adjacent elements
        token_stride, element_stride = item, bs * item
    else:  # row-major [block_size, head_size]
        token_stride, element_stride = d * item, item
    layout = _layout(item, page_stride=strides[0] * item, token_stride=token_stride, head_stride=strides[1] * item,
                     element_stride=element_stride, num_heads=heads, elements_per_head=d, **splits)
    return _source(given, half, which, bs, layout, read_bytes)


def flash_attn_source(kv_cache: Any, *, which: str, read_bytes: int) -> RealKvSource:
    """K or V of a flash-attention KV cache ``[2, num_blocks, block_size, num_kv_heads, head_size]``, read in
    place with the tensor's own strides (so a permuted allocation is read correctly too)."""
    kv = _which(which, "which")
    given = kv_cache
    kv_cache, shape, strides, item = _in_place(kv_cache, "kv_cache")
    _check_shape(shape, 5, "kv_cache", "[2, num_blocks, block_size, num_kv_heads, head_size]")
    if shape[0] != 2:
        fail(f"kv_cache must have 2 on axis 0 (K, V), got shape {shape}")
    _check_strides(strides, "kv_cache")
    _, _, bs, heads, d = shape
    layout = _layout(item, page_stride=strides[1] * item, token_stride=strides[2] * item,
                     head_stride=strides[3] * item, element_stride=strides[4] * item, num_heads=heads,
                     elements_per_head=d)
    return _source(given, kv_cache[kv], which, bs, layout, read_bytes)


def flashinfer_hnd_source(kv_cache: Any, *, which: str, read_bytes: int) -> RealKvSource:
    """K or V of a FlashInfer HND KV cache ``[num_blocks, 2, num_kv_heads, block_size, head_size]`` (heads
    before tokens), read in place with the tensor's own strides."""
    kv = _which(which, "which")
    given = kv_cache
    kv_cache, shape, strides, item = _in_place(kv_cache, "kv_cache")
    _check_shape(shape, 5, "kv_cache", "[num_blocks, 2, num_kv_heads, block_size, head_size]")
    if shape[1] != 2:
        fail(f"kv_cache must have 2 on axis 1 (K, V), got shape {shape}")
    _check_strides(strides, "kv_cache")
    _, _, heads, bs, d = shape
    layout = _layout(item, page_stride=strides[0] * item, token_stride=strides[3] * item,
                     head_stride=strides[2] * item, element_stride=strides[4] * item, num_heads=heads,
                     elements_per_head=d)
    return _source(given, kv_cache[:, kv], which, bs, layout, read_bytes)


__all__ = [
    "ACCESS_ELEMENTS", "ACCESS_HEAD_RUNS", "ACCESS_TOKEN_RUN", "ELEMENT_BYTES", "UNBOUNDED_SLOTS", "VLLM_CPU_ISAS",
    "KvByteLayout", "contiguous_layout", "flash_attn_source", "flashinfer_hnd_source", "vllm_cpu_source",
]
