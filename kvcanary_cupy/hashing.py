"""The canary's hash functions, vectorized over NumPy ``uint64`` arrays (SPEC §2).

``splitmix64`` is the finalizer only (no golden-ratio increment, so ``splitmix64(0) == 0``); ``mix3`` chains
three rounds of it and is the step from one slot's (prev_hash, token, position) to its successor's
``prev_hash``; ``fold_real_kv`` fingerprints the real KV bytes of a batch of slots. The kernels implement
the same functions in ``kernels/canary_common.cuh``. All arithmetic is modulo 2**64: NumPy ``uint64``
multiplication wraps and ``>>`` on ``uint64`` is a logical shift, which is exactly what the finalizer needs.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .constants import CANARY_CHAIN_ANCHOR, REAL_KV_PARTIAL_BYTES, RealKvHashMode

_MUL1 = np.uint64(0xBF58476D1CE4E5B9)
_MUL2 = np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)
U64_MASK = (1 << 64) - 1


def splitmix64(x: np.ndarray) -> np.ndarray:
    """splitmix64 finalizer of a ``uint64`` array (a new array; the input is not modified)."""
    x = x ^ (x >> _S30)
    x *= _MUL1
    x ^= x >> _S27
    x *= _MUL2
    x ^= x >> _S31
    return x


def mix3(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """``sm(sm(sm(a) ^ b) ^ c)`` elementwise on ``uint64`` arrays (order-sensitive)."""
    h = splitmix64(a)
    h ^= b
    h = splitmix64(h)
    h ^= c
    return splitmix64(h)


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
    head = slots < 0
    safe = np.where(head, 0, slots)
    rows = fields[safe]
    h = mix3(rows[:, 2].view(np.uint64), rows[:, 0].view(np.uint64), rows[:, 1].view(np.uint64))
    h[head] = ANCHOR_HASH_U64
    return h


def fold_real_kv(
    slots: np.ndarray,
    sources: Sequence[tuple[np.ndarray, int, int, int]],
    mode: int,
) -> np.ndarray:
    """Real-KV fingerprint (``uint64``) of each slot in ``slots`` (SPEC §2.3).

    ``sources`` holds ``(bytes_2d, page_size, num_bytes_per_token, read_bytes)`` with ``bytes_2d`` a
    ``uint8 [rows, row_bytes]`` view (row stride may exceed ``row_bytes``). Every slot must address a row
    inside each source; callers guarantee that. NONE mode or no sources gives 0 without touching memory.
    """
    total = np.zeros(slots.shape[0], dtype=np.uint64)
    if mode == RealKvHashMode.NONE or not sources or slots.shape[0] == 0:
        return total
    for data, page_size, bytes_per_token, read_bytes in sources:
        nbytes = REAL_KV_PARTIAL_BYTES if mode == RealKvHashMode.PARTIAL else read_bytes
        rows = slots // page_size
        cols = (slots % page_size) * bytes_per_token
        # Gather each slot's leading bytes as little-endian uint64 words: [n, nbytes // 8].
        byte_idx = cols[:, None] + np.arange(nbytes, dtype=np.int64)[None, :]
        raw = data[rows[:, None], byte_idx]
        words = np.ascontiguousarray(raw).view("<u8")
        acc = np.zeros(slots.shape[0], dtype=np.uint64)
        for w in range(words.shape[1]):
            acc ^= words[:, w]
            acc = splitmix64(acc)
        total ^= acc
        total = splitmix64(total)
    return total
