"""The descriptor of where a token's KV bytes lie inside an engine's KV tensor: :class:`KvByteLayout`.

A :class:`~kvcanary_cupy.RealKvSource` without a layout reads each slot's bytes as one contiguous run (one
row of pages, ``num_bytes_per_token`` apart). Engines do not all store a token that way: vLLM's CPU attention
stores K column-major inside a block, FlashInfer puts heads before tokens. A :class:`KvByteLayout` describes
any such layout by byte strides from the tensor's first byte; the fingerprint then hashes a slot's *logical*
byte stream (heads in order, each head's elements in order), read in place. A layout describing the
contiguous case hashes exactly as the contiguous source does.

This module owns the descriptor, its validation, the coverage arithmetic (how many leading slots a tensor
holds) and the access kind the kernels dispatch on; :mod:`kvcanary_cupy.kv_layouts` holds the presets that
build sources over engines' KV tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from ._errors import fail
from ._validate import int_arg
from .constants import REAL_KV_ALIGN_BYTES

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
    token_term(s % page_size) + h * head_stride + element_term(e)``, where ``token_term(o) = o * token_stride``
    and ``element_term(e) = e * element_stride``.

    A layout that tiles tokens or groups elements (CPU attention's AMX layout: 16-token tiles, elements in VNNI
    pairs) splits the index into two digits, each with its own stride: with ``tokens_per_tile > 0``,
    ``token_term(o) = (o // tokens_per_tile) * tile_stride + (o % tokens_per_tile) * token_stride``; with
    ``elements_per_group > 0``, ``element_term(e) = (e // elements_per_group) * group_stride + (e %
    elements_per_group) * element_stride``. ``0`` (the default) splits nothing, and the split's stride must then
    be 0.

    Strides are non-negative multiples of ``element_bytes`` (so every element is naturally aligned when the
    tensor starts 16-byte aligned); ``element_bytes`` is 1, 2, 4, 8 or 16.
    """

    page_stride: int
    token_stride: int
    head_stride: int
    element_stride: int
    num_heads: int
    elements_per_head: int
    element_bytes: int
    tokens_per_tile: int = 0
    tile_stride: int = 0
    elements_per_group: int = 0
    group_stride: int = 0

    def __post_init__(self) -> None:
        eb = int_arg(self.element_bytes, "KvByteLayout.element_bytes")
        if eb not in ELEMENT_BYTES:
            fail(f"KvByteLayout.element_bytes must be one of {', '.join(map(str, ELEMENT_BYTES))}, got {eb}")
        int_arg(self.num_heads, "KvByteLayout.num_heads", minimum=1, maximum=1 << 31)
        int_arg(self.elements_per_head, "KvByteLayout.elements_per_head", minimum=1, maximum=1 << 31)
        for name in _STRIDES:
            stride = int_arg(getattr(self, name), f"KvByteLayout.{name}", minimum=0, maximum=1 << 48)
            if stride % eb:
                fail(f"KvByteLayout.{name} must be a multiple of element_bytes={eb} (elements are loaded "
                     f"naturally aligned), got {stride}")
        for digits, split_stride in _SPLITS:
            if not int_arg(getattr(self, digits), f"KvByteLayout.{digits}", minimum=0, maximum=1 << 31) \
                    and getattr(self, split_stride):
                fail(f"KvByteLayout.{split_stride} must be 0 when {digits} is 0 (nothing is split), got "
                     f"{getattr(self, split_stride)}")
        for f in fields(self):
            object.__setattr__(self, f.name, int(getattr(self, f.name)))

    def __repr__(self) -> str:  # the splits only where a layout has them, so plain strided layouts read as before
        shown = [f for f in fields(self) if f.name not in _SPLIT_FIELDS or any(
            getattr(self, digits) for digits, split_stride in _SPLITS if f.name in (digits, split_stride))]
        return f"KvByteLayout({', '.join(f'{f.name}={getattr(self, f.name)}' for f in shown)})"

    @property
    def bytes_per_token(self) -> int:
        """Length of one slot's logical byte stream."""
        return self.num_heads * self.elements_per_head * self.element_bytes

    @property
    def head_bytes(self) -> int:
        return self.elements_per_head * self.element_bytes

    def token_term(self, offset: int) -> int:
        """Byte offset of token ``offset`` of a page from the page's first byte."""
        return _digit_term(offset, self.tokens_per_tile, self.tile_stride, self.token_stride)

    def element_term(self, element: int) -> int:
        """Byte offset of element ``element`` of a head from the head's first byte."""
        return _digit_term(element, self.elements_per_group, self.group_stride, self.element_stride)

    def last_byte_in_token(self) -> int:
        """Offset, from a token's first byte, of the last byte any of its elements occupies."""
        return ((self.num_heads - 1) * self.head_stride
                + _largest_term(self.elements_per_head, self.elements_per_group, self.group_stride,
                                self.element_stride) + self.element_bytes - 1)

    def check_extent(self, span_bytes: int, tensor_name: str, layout_name: str) -> None:
        """Refuse this layout over a tensor of ``span_bytes`` bytes (named ``tensor_name``; the layout is
        ``layout_name``) when one token's stream is longer than the whole tensor: zero or overlapping strides may
        read some bytes twice, but a stream longer than the tensor reads nothing a real KV layout holds and would
        let the work per slot (``read_bytes``, and the reference's gather) grow without bound over a small tensor.
        Checked before anything is read or allocated."""
        if self.bytes_per_token > span_bytes:
            fail(f"{layout_name} reads {self.bytes_per_token} bytes per token (num_heads={self.num_heads} x "
                 f"elements_per_head={self.elements_per_head} x element_bytes={self.element_bytes}), more than the "
                 f"{span_bytes} bytes {tensor_name} spans: its strides read the same bytes over and over")

    def slots_covered(self, page_size: int, span_bytes: int) -> int:
        """How many leading slots (0, 1, ... N-1) have every byte inside a tensor of ``span_bytes`` bytes."""
        last = self.last_byte_in_token()
        ps = self.page_stride

        def largest(count: int) -> int:  # the largest token term of offsets 0 .. count - 1 (count >= 1)
            return _largest_term(count, self.tokens_per_tile, self.tile_stride, self.token_stride)

        def fitting_offsets(page_start: int) -> int:  # leading slots of one page that fit
            room = span_bytes - 1 - last - page_start
            if room < 0:
                return 0
            lo, hi = 1, page_size  # largest(count) grows with count: the longest run of offsets that fits
            while lo < hi:
                mid = (lo + hi + 1) // 2
                lo, hi = (mid, hi) if largest(mid) <= room else (lo, mid - 1)
            return lo

        if fitting_offsets(0) < page_size:
            return fitting_offsets(0)
        if ps == 0:
            return UNBOUNDED_SLOTS
        full_pages = (span_bytes - 1 - last - largest(page_size)) // ps + 1
        return min(UNBOUNDED_SLOTS, full_pages * page_size + fitting_offsets(full_pages * ps))

    def access_kind(self) -> int:
        """The kernels' walk for this layout (``ACCESS_*``): the widest loads its alignment allows."""
        eb, align = self.element_bytes, REAL_KV_ALIGN_BYTES
        if self.element_stride != eb or self.elements_per_group or self.page_stride % align \
                or self.token_stride % align or self.tile_stride % align:
            return ACCESS_ELEMENTS
        if self.num_heads == 1 or self.head_stride == self.head_bytes:
            return ACCESS_TOKEN_RUN if self.bytes_per_token % align == 0 else ACCESS_ELEMENTS
        if self.head_bytes % align == 0 and self.head_stride % align == 0:
            return ACCESS_HEAD_RUNS
        return ACCESS_ELEMENTS


_STRIDES = ("page_stride", "token_stride", "head_stride", "element_stride", "tile_stride", "group_stride")
_SPLITS = (("tokens_per_tile", "tile_stride"), ("elements_per_group", "group_stride"))
_SPLIT_FIELDS = frozenset(name for split in _SPLITS for name in split)


def _digit_term(index: int, radix: int, high_stride: int, low_stride: int) -> int:
    """``index`` split into (``index // radix``, ``index % radix``), each digit times its stride (``radix`` 0:
    not split)."""
    if radix == 0:
        return index * low_stride
    return (index // radix) * high_stride + (index % radix) * low_stride


def _largest_term(count: int, radix: int, high_stride: int, low_stride: int) -> int:
    """The largest :func:`_digit_term` of the indices ``0 .. count - 1`` (``count >= 1``). Strides are
    non-negative, so within a digit group the last index is the largest: the candidates are the last index and,
    when it is not in the first group, the last index of the group before its own."""
    last = count - 1
    largest = _digit_term(last, radix, high_stride, low_stride)
    if radix and last >= radix:
        largest = max(largest, _digit_term((last // radix) * radix - 1, radix, high_stride, low_stride))
    return largest


def contiguous_layout(page_stride: int, bytes_per_token: int) -> KvByteLayout:
    """The layout of a contiguous source: one run of ``bytes_per_token`` bytes per token, pages
    ``page_stride`` bytes apart (what a source without a layout reads)."""
    return KvByteLayout(page_stride=page_stride, token_stride=bytes_per_token, head_stride=0,
                        element_stride=REAL_KV_ALIGN_BYTES, num_heads=1,
                        elements_per_head=bytes_per_token // REAL_KV_ALIGN_BYTES, element_bytes=REAL_KV_ALIGN_BYTES)


