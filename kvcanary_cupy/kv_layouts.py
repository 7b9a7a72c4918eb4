"""Where a token's KV bytes lie inside an engine's KV tensor: :class:`KvByteLayout` and the vLLM presets.

A :class:`~kvcanary_cupy.RealKvSource` without a layout reads each slot's bytes as one contiguous run (one
row of pages, ``num_bytes_per_token`` apart). Engines do not all store a token that way: vLLM's CPU attention
stores K column-major inside a block, FlashInfer puts heads before tokens. A :class:`KvByteLayout` describes
any such layout by byte strides from the tensor's first byte; the fingerprint then hashes a slot's *logical*
byte stream (heads in order, each head's elements in order), read in place. A layout describing the
contiguous case hashes exactly as the contiguous source does.

This module owns the descriptor, its validation, the coverage arithmetic (how many leading slots a tensor
holds), the access kind the kernels dispatch on, and the presets that read vLLM's KV tensors in place.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ._errors import fail
from ._validate import int_arg
from .constants import REAL_KV_ALIGN_BYTES

if TYPE_CHECKING:
    from .context import RealKvSource

ELEMENT_BYTES = (1, 2, 4, 8, 16)

# How the kernels walk a slot's logical bytes (kernels/canary_common.cuh, enum RealKvAccess).
ACCESS_TOKEN_RUN = 0  # the whole logical stream is one 16-byte aligned run: 128-bit loads from the token start
ACCESS_HEAD_RUNS = 1  # each head's elements are one 16-byte aligned run: 128-bit loads per head
ACCESS_ELEMENTS = 2  # anything else: one load per element (or per 8 bytes of a 16-byte element)

# Coverage of a layout whose pages all alias one page (page_stride 0): every slot, whatever the buffer.
UNBOUNDED_SLOTS = 1 << 62


@dataclass(frozen=True)
class KvByteLayout:
    """Byte strides, relative to the tensor's first byte, of one token's K (or V) bytes.

    Slot ``s``'s logical byte stream is: for each head ``h`` in ``range(num_heads)``, for each element ``e``
    in ``range(elements_per_head)``, the ``element_bytes`` bytes at ``(s // page_size) * page_stride +
    (s % page_size) * token_stride + h * head_stride + e * element_stride``. Strides are non-negative
    multiples of ``element_bytes`` (so every element is naturally aligned when the tensor starts 16-byte
    aligned); ``element_bytes`` is 1, 2, 4, 8 or 16.
    """

    page_stride: int
    token_stride: int
    head_stride: int
    element_stride: int
    num_heads: int
    elements_per_head: int
    element_bytes: int

    def __post_init__(self) -> None:
        eb = int_arg(self.element_bytes, "KvByteLayout.element_bytes")
        if eb not in ELEMENT_BYTES:
            fail(f"KvByteLayout.element_bytes must be one of {', '.join(map(str, ELEMENT_BYTES))}, got {eb}")
        int_arg(self.num_heads, "KvByteLayout.num_heads", minimum=1, maximum=1 << 31)
        int_arg(self.elements_per_head, "KvByteLayout.elements_per_head", minimum=1, maximum=1 << 31)
        for name in ("page_stride", "token_stride", "head_stride", "element_stride"):
            stride = int_arg(getattr(self, name), f"KvByteLayout.{name}", minimum=0, maximum=1 << 48)
            if stride % eb:
                fail(f"KvByteLayout.{name} must be a multiple of element_bytes={eb} (elements are loaded "
                     f"naturally aligned), got {stride}")
        for name in ("page_stride", "token_stride", "head_stride", "element_stride", "num_heads",
                     "elements_per_head", "element_bytes"):
            object.__setattr__(self, name, int(getattr(self, name)))

    @property
    def bytes_per_token(self) -> int:
        """Length of one slot's logical byte stream."""
        return self.num_heads * self.elements_per_head * self.element_bytes

    @property
    def head_bytes(self) -> int:
        return self.elements_per_head * self.element_bytes

    def last_byte_in_token(self) -> int:
        """Offset, from a token's first byte, of the last byte any of its elements occupies."""
        return ((self.num_heads - 1) * self.head_stride + (self.elements_per_head - 1) * self.element_stride
                + self.element_bytes - 1)

    def slots_covered(self, page_size: int, span_bytes: int) -> int:
        """How many leading slots (0, 1, ... N-1) have every byte inside a tensor of ``span_bytes`` bytes."""
        last = self.last_byte_in_token()
        ps, ts = self.page_stride, self.token_stride

        def fitting_offsets(page_start: int) -> int:  # slots of one page that fit (monotonic in the offset)
            room = span_bytes - 1 - last - page_start
            if room < 0:
                return 0
            return page_size if ts == 0 else min(page_size, room // ts + 1)

        if fitting_offsets(0) < page_size:
            return fitting_offsets(0)
        if ps == 0:
            return UNBOUNDED_SLOTS
        full_pages = (span_bytes - 1 - last - (page_size - 1) * ts) // ps + 1
        return min(UNBOUNDED_SLOTS, full_pages * page_size + fitting_offsets(full_pages * ps))

    def access_kind(self) -> int:
        """The kernels' walk for this layout (``ACCESS_*``): the widest loads its alignment allows."""
        eb, align = self.element_bytes, REAL_KV_ALIGN_BYTES
        if self.element_stride != eb or self.page_stride % align or self.token_stride % align:
            return ACCESS_ELEMENTS
        if self.num_heads == 1 or self.head_stride == self.head_bytes:
            return ACCESS_TOKEN_RUN if self.bytes_per_token % align == 0 else ACCESS_ELEMENTS
        if self.head_bytes % align == 0 and self.head_stride % align == 0:
            return ACCESS_HEAD_RUNS
        return ACCESS_ELEMENTS


def contiguous_layout(page_stride: int, bytes_per_token: int) -> KvByteLayout:
    """The layout of a contiguous source: one run of ``bytes_per_token`` bytes per token, pages
    ``page_stride`` bytes apart (what a source without a layout reads)."""
    return KvByteLayout(page_stride=page_stride, token_stride=bytes_per_token, head_stride=0,
                        element_stride=REAL_KV_ALIGN_BYTES, num_heads=1,
                        elements_per_head=bytes_per_token // REAL_KV_ALIGN_BYTES, element_bytes=REAL_KV_ALIGN_BYTES)


# ----------------------------------------------------------------------------------------------------------
# vLLM presets
# ----------------------------------------------------------------------------------------------------------
def _in_place(tensor: Any, name: str) -> tuple[Any, tuple[int, ...], tuple[int, ...], int]:
    """The tensor to slice (a torch tensor as given, anything else as its zero-copy NumPy/CuPy view, so that
    slicing never copies), its shape, its strides in elements and its element size."""
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


def _source(tensor: Any, page_size: int, layout: KvByteLayout, read_bytes: int) -> RealKvSource:
    from .context import RealKvSource

    return RealKvSource(tensor, page_size=page_size, num_bytes_per_token=layout.bytes_per_token,
                        read_bytes=read_bytes, layout=layout)


def vllm_cpu_source(kv_cache: Any, *, block_size: int, num_kv_heads: int, head_size: int, which: str,
                    read_bytes: int, isa: str) -> RealKvSource:
    """K or V of one layer of vLLM's CPU attention cache, read in place.

    ``kv_cache`` is ``[num_blocks, num_kv_heads, block_size, 2 * head_size]`` (the layer's ``kv_cache``);
    ``isa`` is the layer's ``isa``. For ``"vec"``, each (block, head) holds K column-major ``[head_size,
    block_size]`` and then V row-major ``[block_size, head_size]``. Other ISAs store other layouts and are
    refused. Canary slot ``block * block_size + offset`` is token ``offset`` of block ``block``.
    """
    if isa != "vec":
        fail(f"isa={isa!r}: the vLLM CPU KV layout of that ISA is not implemented (only 'vec' is); it is "
             "refused rather than fingerprinted wrongly")
    kv = _which(which, "which")
    bs = int_arg(block_size, "block_size", minimum=1)
    heads = int_arg(num_kv_heads, "num_kv_heads", minimum=1)
    d = int_arg(head_size, "head_size", minimum=1)
    kv_cache, shape, strides, item = _in_place(kv_cache, "kv_cache")
    _check_shape(shape, 4, "kv_cache", "[num_blocks, num_kv_heads, block_size, 2 * head_size]")
    if shape[1:] != (heads, bs, 2 * d):
        fail(f"kv_cache must have shape [num_blocks, num_kv_heads={heads}, block_size={bs}, 2 * head_size="
             f"{2 * d}], got {shape}")
    _check_strides(strides, "kv_cache")
    if (bs > 1 and strides[2] != 2 * d) or strides[3] != 1:
        fail(f"kv_cache must be contiguous within each (block, head) plane of block_size * 2 * head_size "
             f"elements, got strides {strides} (in elements)")
    # Each (block, head) plane is one run of 2 * block_size * head_size elements: K's half, then V's. A view
    # starting at the first byte of K or V is what the layout's strides are relative to: with an even
    # block_size, half the plane's rows (a plain slice); otherwise the planes viewed flat (no copy either:
    # each plane is contiguous) and sliced.
    if bs % 2 == 0:
        half = kv_cache[:, :, kv * (bs // 2):(kv + 1) * (bs // 2)]
    else:
        half = kv_cache.reshape(shape[0], heads, 2 * bs * d)[:, :, kv * bs * d:(kv + 1) * bs * d]
    if kv == 0:  # column-major [head_size, block_size]: consecutive tokens are adjacent elements
        token_stride, element_stride = item, bs * item
    else:  # row-major [block_size, head_size]
        token_stride, element_stride = d * item, item
    layout = KvByteLayout(page_stride=strides[0] * item, token_stride=token_stride, head_stride=strides[1] * item,
                          element_stride=element_stride, num_heads=heads, elements_per_head=d, element_bytes=item)
    return _source(half, bs, layout, read_bytes)


def flash_attn_source(kv_cache: Any, *, which: str, read_bytes: int) -> RealKvSource:
    """K or V of a flash-attention KV cache ``[2, num_blocks, block_size, num_kv_heads, head_size]``, read in
    place with the tensor's own strides (so a permuted allocation is read correctly too)."""
    kv = _which(which, "which")
    kv_cache, shape, strides, item = _in_place(kv_cache, "kv_cache")
    _check_shape(shape, 5, "kv_cache", "[2, num_blocks, block_size, num_kv_heads, head_size]")
    if shape[0] != 2:
        fail(f"kv_cache must have 2 on axis 0 (K, V), got shape {shape}")
    _check_strides(strides, "kv_cache")
    _, _, bs, heads, d = shape
    layout = KvByteLayout(page_stride=strides[1] * item, token_stride=strides[2] * item,
                          head_stride=strides[3] * item, element_stride=strides[4] * item, num_heads=heads,
                          elements_per_head=d, element_bytes=item)
    return _source(kv_cache[kv], bs, layout, read_bytes)


def flashinfer_hnd_source(kv_cache: Any, *, which: str, read_bytes: int) -> RealKvSource:
    """K or V of a FlashInfer HND KV cache ``[num_blocks, 2, num_kv_heads, block_size, head_size]`` (heads
    before tokens), read in place with the tensor's own strides."""
    kv = _which(which, "which")
    kv_cache, shape, strides, item = _in_place(kv_cache, "kv_cache")
    _check_shape(shape, 5, "kv_cache", "[num_blocks, 2, num_kv_heads, block_size, head_size]")
    if shape[1] != 2:
        fail(f"kv_cache must have 2 on axis 1 (K, V), got shape {shape}")
    _check_strides(strides, "kv_cache")
    _, _, heads, bs, d = shape
    layout = KvByteLayout(page_stride=strides[0] * item, token_stride=strides[3] * item,
                          head_stride=strides[2] * item, element_stride=strides[4] * item, num_heads=heads,
                          elements_per_head=d, element_bytes=item)
    return _source(kv_cache[:, kv], bs, layout, read_bytes)
