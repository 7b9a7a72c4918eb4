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


# vLLM's KVCacheLayout (vllm/v1/kv_cache_layout.py): the physical order, outermost first, of the logical axes
# [L, B, H, N, C] (layers, blocks, KV heads, tokens of a block, content) of the buffer a group's layers share.
VLLM_KV_CACHE_LAYOUTS: dict[str, tuple[int, ...]] = {
    "LBHNC": (0, 1, 2, 3, 4),
    "LBNHC": (0, 1, 3, 2, 4),
    "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
    "BHLNC": (1, 2, 0, 3, 4),
}
_AXIS_NAMES = "BHNC"


def _layer_view_order(kv_cache_layout: Any) -> tuple[str, tuple[int, ...]]:
    """The layout's name and the physical order, outermost first, of one layer's ``[B, H, N, C]`` axes; refused by
    the argument's name when it is not one of vLLM's layouts (a name, or vLLM's ``KVCacheLayout`` member)."""
    name = kv_cache_layout if isinstance(kv_cache_layout, str) else getattr(kv_cache_layout, "name", None)
    if not isinstance(name, str) or name not in VLLM_KV_CACHE_LAYOUTS:
        fail(f"kv_cache_layout must be one of vLLM's KV cache layouts ({', '.join(VLLM_KV_CACHE_LAYOUTS)}), given "
             f"by name or as a KVCacheLayout, got {kv_cache_layout!r}")
    return name, tuple(axis - 1 for axis in VLLM_KV_CACHE_LAYOUTS[name] if axis != 0)


def _check_order(shape: tuple[int, ...], strides: tuple[int, ...], order: tuple[int, ...], what: str) -> None:
    """Refuse strides that do not nest the axes in ``order`` (outermost first): each axis of more than one entry
    must step over every entry of each axis inside it. Padding between entries is allowed; an axis of one entry,
    or a broadcast one (stride 0), has no order."""
    ordered = [axis for axis in order if shape[axis] > 1 and strides[axis] > 0]
    for i, outer in enumerate(ordered):
        for inner in ordered[i + 1:]:
            if strides[outer] < strides[inner] * shape[inner]:
                fail(f"kv_cache has shape {shape} and strides {strides} (in elements), which do not store it in "
                     f"the order {what} names ({', '.join(_AXIS_NAMES[a] for a in order)} outermost first, "
                     f"for [B, H, N, C] = [num_blocks, num_kv_heads, block_size, content])")


def _packed_source(kv_cache: Any, head_size: Any, which: Any, read_bytes: Any, order: tuple[int, ...] | None,
                   what: str) -> RealKvSource:
    """K or V of a packed ``[num_blocks, num_kv_heads, block_size, head_size + head_size_v]`` cache, in place."""
    kv = _which(which, "which")
    given = kv_cache
    kv_cache, shape, strides, item = _in_place(kv_cache, "kv_cache")
    _check_shape(shape, 4, "kv_cache", "[num_blocks, num_kv_heads, block_size, head_size + head_size_v]")
    _check_strides(strides, "kv_cache")
    content = shape[3]
    d = int_arg(head_size, "head_size", minimum=1)
    if d > content:
        fail(f"head_size={d} is more than the {content} elements of kv_cache's last axis (head_size + head_size_v)")
    if kv == 1 and d == content:
        fail(f"which='v': kv_cache's last axis holds head_size={d} elements of K and no V")
    if order is not None:
        _check_order(shape, strides, order, what)
    _, heads, bs, _ = shape
    part = kv_cache[..., :d] if kv == 0 else kv_cache[..., d:]
    layout = _layout(item, page_stride=strides[0] * item, token_stride=strides[2] * item,
                     head_stride=strides[1] * item, element_stride=strides[3] * item, num_heads=heads,
                     elements_per_head=d if kv == 0 else content - d)
    return _source(given, part, which, bs, layout, read_bytes)


def vllm_attention_source(kv_cache: Any, *, head_size: int, which: str, read_bytes: int,
                          kv_cache_layout: Any = None) -> RealKvSource:
    """K or V of one layer of vLLM's attention cache as vLLM 0.32 allocates it for every attention backend, read
    in place.

    ``kv_cache`` is the layer's ``[num_blocks, num_kv_heads, block_size, head_size + head_size_v]`` view: K and V
    are packed in the last axis of each (block, head, token), K first (``head_size`` elements), V after it. The
    physical order of the axes is the resolved ``KVCacheLayout``'s, and the tensor's strides say it; the source
    reads those strides, so every layout (LBNHC, LBHNC, LHBNC and the block-outermost BL**/BHLNC, whose block
    stride steps over every layer's page) is read where it lies. ``kv_cache_layout`` (the layout's name or vLLM's
    ``KVCacheLayout``), when given, is checked against the strides, and a cache stored in another order is
    refused. Canary slot ``block * block_size + offset`` is token ``offset`` of block ``block``, with
    ``block_size`` the tensor's third axis (with kernel block splitting, the kernel block: the slot numbers are
    the same).
    """
    if kv_cache_layout is None:
        return _packed_source(kv_cache, head_size, which, read_bytes, None, "")
    name, order = _layer_view_order(kv_cache_layout)
    return _packed_source(kv_cache, head_size, which, read_bytes, order, f"kv_cache_layout={name!r}")


def _equal_halves(kv_cache: Any) -> int:
    """head_size of a packed cache whose K and V have the same head size (half its last axis)."""
    _, shape, _, _ = _in_place(kv_cache, "kv_cache")
    _check_shape(shape, 4, "kv_cache", "[num_blocks, num_kv_heads, block_size, 2 * head_size]")
    if shape[3] % 2:
        fail(f"kv_cache's last axis ({shape[3]} elements) is not 2 * head_size: K and V are its two halves")
    return shape[3] // 2


def flash_attn_source(kv_cache: Any, *, which: str, read_bytes: int) -> RealKvSource:
    """K or V of one layer of vLLM 0.32's FlashAttention (or Triton) cache, read in place.

    ``kv_cache`` is ``[num_blocks, num_kv_heads, block_size, 2 * head_size]``, K and V the two halves of the last
    axis; FlashAttention views it as ``kv_cache.transpose(1, 2).split(head_size, -1)``. It accepts any
    ``KVCacheLayout`` (vLLM's default for it is LBNHC: a block's tokens outside its heads); the source reads the
    order from the tensor's strides. :func:`vllm_attention_source` is the same for unequal K and V head sizes.
    """
    _which(which, "which")
    return _packed_source(kv_cache, _equal_halves(kv_cache), which, read_bytes, None, "")


def flashinfer_hnd_source(kv_cache: Any, *, which: str, read_bytes: int) -> RealKvSource:
    """K or V of one layer of vLLM 0.32's FlashInfer cache in its HND layouts (LBHNC, BLHNC, BHLNC: a block's
    heads outside its tokens), read in place.

    ``kv_cache`` is ``[num_blocks, num_kv_heads, block_size, 2 * head_size]``, K and V the two halves of the last
    axis of each (block, head, token). Strides that put tokens outside heads (the NHD layouts) are refused: read
    those with :func:`flash_attn_source` or :func:`vllm_attention_source`.
    """
    _which(which, "which")
    return _packed_source(kv_cache, _equal_halves(kv_cache), which, read_bytes, (0, 1, 2, 3),
                          "FlashInfer's HND")


def vllm_mla_source(kv_cache: Any, *, which: str, read_bytes: int) -> RealKvSource:
    """The latent row of each token of one layer of vLLM's MLA cache, read in place.

    ``kv_cache`` is the MLA layer's ``[num_blocks, block_size, row]`` cache (``kv_lora_rank + qk_rope_head_dim``
    elements per token, 576 for DeepSeek: the compressed KV then the rotary part of K), one row per token, no
    heads. MLA stores no V: K is the whole row, and ``which="v"`` is refused. Canary slot ``block * block_size +
    offset`` is row ``offset`` of block ``block``.
    """
    _which(which, "which")
    if which == "v":
        fail("which='v': an MLA cache holds one latent row per token and no V; only which='k' has a source")
    given = kv_cache
    kv_cache, shape, strides, item = _in_place(kv_cache, "kv_cache")
    _check_shape(shape, 3, "kv_cache", "[num_blocks, block_size, latent row]")
    _check_strides(strides, "kv_cache")
    layout = _layout(item, page_stride=strides[0] * item, token_stride=strides[1] * item, head_stride=0,
                     element_stride=strides[2] * item, num_heads=1, elements_per_head=shape[2])
    return _source(given, kv_cache, which, shape[1], layout, read_bytes)


__all__ = [
    "ACCESS_ELEMENTS", "ACCESS_HEAD_RUNS", "ACCESS_TOKEN_RUN", "ELEMENT_BYTES", "UNBOUNDED_SLOTS", "VLLM_CPU_ISAS",
    "VLLM_KV_CACHE_LAYOUTS", "KvByteLayout", "contiguous_layout", "flash_attn_source", "flashinfer_hnd_source",
    "vllm_attention_source", "vllm_cpu_source", "vllm_mla_source",
]
