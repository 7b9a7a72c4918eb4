"""The canary's hash functions, vectorized over NumPy ``uint64`` arrays (SPEC §2).

``splitmix64`` is the finalizer only (no golden-ratio increment, so ``splitmix64(0) == 0``); ``mix3`` chains
three rounds of it and is the step from one slot's (prev_hash, token, position) to its successor's
``prev_hash``; ``fold_real_kv`` fingerprints the real KV bytes of a batch of slots. The kernels implement
the same functions in ``kernels/canary_common.cuh``. All arithmetic is modulo 2**64: NumPy ``uint64``
multiplication wraps and ``>>`` on ``uint64`` is a logical shift, which is exactly what the finalizer needs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from .constants import CANARY_CHAIN_ANCHOR, REAL_KV_PARTIAL_BYTES, RealKvHashMode
from .kv_bytes import KvByteLayout

_MUL1 = np.uint64(0xBF58476D1CE4E5B9)
_MUL2 = np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)
U64_MASK = (1 << 64) - 1


def splitmix64_(x: np.ndarray, scratch: np.ndarray | None = None) -> np.ndarray:
    """splitmix64 finalizer of a ``uint64`` array, in place (``scratch``: optional same-shape uint64 buffer)."""
    tmp = np.empty_like(x) if scratch is None else scratch
    for shift, multiplier in ((_S30, _MUL1), (_S27, _MUL2)):
        np.right_shift(x, shift, out=tmp)
        x ^= tmp
        x *= multiplier
    np.right_shift(x, _S31, out=tmp)
    x ^= tmp
    return x


def splitmix64(x: np.ndarray) -> np.ndarray:
    """splitmix64 finalizer of a ``uint64`` array (a new array; the input is not modified)."""
    return splitmix64_(x.copy())


def mix3_(acc: np.ndarray, b: np.ndarray, c: np.ndarray, scratch: np.ndarray | None = None) -> np.ndarray:
    """``acc = sm(sm(sm(acc) ^ b) ^ c)`` in place on ``uint64`` arrays (order-sensitive)."""
    splitmix64_(acc, scratch)
    acc ^= b
    splitmix64_(acc, scratch)
    acc ^= c
    return splitmix64_(acc, scratch)


def mix3(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """``sm(sm(sm(a) ^ b) ^ c)`` elementwise on ``uint64`` arrays, as a new array."""
    return mix3_(a.copy(), b, c)


def splitmix64_int(x: int) -> int:
    """Scalar splitmix64 on a Python int (used for constants and messages, not in hot paths)."""
    return int(splitmix64(np.array([x & U64_MASK], dtype=np.uint64))[0])


ANCHOR_HASH_U64 = np.uint64(splitmix64_int(CANARY_CHAIN_ANCHOR))
ANCHOR_HASH_I64 = np.int64(ANCHOR_HASH_U64.view(np.int64))


def chain_hash(fields: np.ndarray, slots: np.ndarray) -> np.ndarray:
    """``slot_hash`` of each slot as ``uint64``: the value its successor must store as ``prev_hash``.

    ``fields`` is the canary buffer viewed as ``int64 [num_slots, >=4]``. Negative slots are chain heads and
    hash to ``splitmix64(ANCHOR)``; non-negative slots must be in range (callers mask them first).
    """
    # One gather of whole slot rows beats one gather per field: a slot's 32 bytes share a cache line.
    rows = fields.take(np.maximum(slots, 0), axis=0)
    h = rows[:, 2].view(np.uint64).copy()
    mix3_(h, rows[:, 0].view(np.uint64), rows[:, 1].view(np.uint64))
    h[slots < 0] = ANCHOR_HASH_U64
    return h


class RealKvBytes(NamedTuple):
    """One real-KV source as the hash reads it (``RealKvSource.view()``).

    ``data`` is ``uint8 [rows, row_bytes]`` (row stride may exceed ``row_bytes``); ``layout`` says where slot
    ``s``'s logical bytes lie, by byte offsets from ``data``'s first byte. ``contiguous`` marks a source
    built without a layout: its layout is the rows' own (one run per token), read by the row fast path.
    """

    data: Any
    page_size: int
    num_bytes_per_token: int
    read_bytes: int
    layout: KvByteLayout
    contiguous: bool


def _slot_words(data: np.ndarray, page_size: int, bytes_per_token: int, nbytes: int,
                slots: np.ndarray) -> np.ndarray:
    """The leading ``nbytes`` of each slot's bytes as little-endian uint64 words, ``[nbytes // 8, n]``."""
    rows = data.shape[0]
    row_stride = data.strides[0] if rows > 1 else data.shape[1]
    # Every access is 16-byte aligned (checked when the source was built), so the bytes can be read as
    # uint64 words: view the first word of each row, then stride over (row, slot in page, word).
    first_words = data[:, :8].view(np.uint64)
    words = np.lib.stride_tricks.as_strided(
        first_words, shape=(rows, page_size, bytes_per_token // 8), strides=(row_stride, bytes_per_token, 8),
        writeable=False)
    return np.ascontiguousarray(words[slots // page_size, slots % page_size, : nbytes // 8].T)


def _digit_terms(index: np.ndarray, radix: int, high_stride: int, low_stride: int) -> np.ndarray:
    """Byte offsets of ``index`` split into the digits (``index // radix``, ``index % radix``) of a
    :class:`KvByteLayout` (``radix`` 0: not split)."""
    if radix == 0:
        return index * low_stride
    high, low = np.divmod(index, radix)
    return high * high_stride + low * low_stride


def _layout_words(data: np.ndarray, page_size: int, layout: KvByteLayout, nbytes: int,
                  slots: np.ndarray) -> np.ndarray:
    """The leading ``nbytes`` of each slot's logical stream under ``layout`` as little-endian uint64 words,
    ``[nbytes // 8, n]``.

    The stream is gathered in units of ``min(element_bytes, 8)`` bytes, or of 8 bytes where each head's
    elements form one run of aligned words: every unit is naturally aligned (strides are multiples of the
    element size and the tensor starts 16-byte aligned), so the tensor can be read as an array of such
    units, indexed by byte offset // unit.
    """
    eb = layout.element_bytes
    runs = layout.element_stride == eb and not layout.elements_per_group and layout.head_bytes % 8 == 0 and not (
        (layout.page_stride | layout.token_stride | layout.tile_stride | layout.head_stride) % 8)
    unit = 8 if runs else min(eb, 8)
    logical = np.arange(0, nbytes, unit, dtype=np.int64)
    if runs:  # each head's elements are one run of whole aligned words: gather words, not elements
        head, within = np.divmod(logical, layout.head_bytes)
        intra = head * layout.head_stride + within
    else:
        element, within = np.divmod(logical, eb)
        head, index = np.divmod(element, layout.elements_per_head)
        intra = head * layout.head_stride + _digit_terms(index, layout.elements_per_group, layout.group_stride,
                                                         layout.element_stride) + within  # [units]
    page, offset = np.divmod(slots.astype(np.int64), page_size)
    token = page * layout.page_stride + _digit_terms(offset, layout.tokens_per_tile, layout.tile_stride,
                                                     layout.token_stride)  # [n]
    span = data.reshape(-1)  # a layout's source is one row: every byte from the tensor's first to its last
    units = np.lib.stride_tricks.as_strided(span[:unit].view(np.dtype(f"<u{unit}")), shape=(span.shape[0] // unit,),
                                            strides=(unit,), writeable=False)
    gathered = units[(token[:, None] + intra[None, :]) // unit]  # [n, units], one slot's stream per row
    return np.ascontiguousarray(gathered.view(np.dtype("<u8")).T)


def fold_real_kv(
    slots: np.ndarray,
    sources: Sequence[RealKvBytes | tuple[Any, int, int, int]],
    mode: int,
) -> np.ndarray:
    """Real-KV fingerprint (``uint64``) of each slot in ``slots`` (SPEC §2.3).

    Each source's slots are read as its :class:`RealKvBytes` says: a contiguous source by its rows, one with
    a layout through the layout; a plain ``(bytes_2d, page_size, num_bytes_per_token, read_bytes)`` tuple is
    a contiguous source. Every slot must lie inside each source; callers guarantee that. NONE mode or
    no sources gives 0 without touching memory.
    """
    n = slots.shape[0]
    total = np.zeros(n, dtype=np.uint64)
    if mode == RealKvHashMode.NONE or not sources or n == 0:
        return total
    scratch = np.empty(n, np.uint64)
    for source in sources:
        if isinstance(source, RealKvBytes) and not source.contiguous:
            nbytes = REAL_KV_PARTIAL_BYTES if mode == RealKvHashMode.PARTIAL else source.read_bytes
            words = _layout_words(source.data, source.page_size, source.layout, nbytes, slots)
        else:
            data, page_size, bytes_per_token, read_bytes = source[:4]
            nbytes = REAL_KV_PARTIAL_BYTES if mode == RealKvHashMode.PARTIAL else read_bytes
            words = _slot_words(data, page_size, bytes_per_token, nbytes, slots)
        acc = np.zeros(n, dtype=np.uint64)
        for word in words:
            acc ^= word
            splitmix64_(acc, scratch)
        total ^= acc
        splitmix64_(total, scratch)
    return total
