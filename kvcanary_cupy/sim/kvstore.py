"""The real KV the canary fingerprints: :class:`KvStore`, one paged tensor per layer (K and optionally V)
written by the synthetic forward."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..context import RealKvSource

_C_TOKEN = np.uint64(0x9E3779B97F4A7C15)
_C_POS = np.uint64(0xC2B2AE3D27D4EB4F)
_C_SLOT = np.uint64(0x165667B19E3779F9)
_C_WORD = np.uint64(0xD6E8FEB86659FD93)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def _mix(x: Any) -> Any:
    x = x ^ (x >> np.uint64(30))
    x = x * _M1
    x = x ^ (x >> np.uint64(27))
    x = x * _M2
    return x ^ (x >> np.uint64(31))


class KvStore:
    """The real KV of one canary group: per layer a K (and optionally a V) tensor ``uint64 [pages, page_size,
    words]``. Slot ``s`` lives at page ``s // page_size``, row ``s % page_size`` — exactly the layout a
    :class:`~kvcanary_cupy.RealKvSource` with that page size describes.

    The "forward" stores bytes derived from (token, position, slot, layer): any change to the slot's real KV
    changes its fingerprint, and two slots never hold the same bytes.
    """

    def __init__(self, xp: Any, num_slots: int, page_size: int, words: int, layers: int, with_v: bool,
                 salt: int) -> None:
        self.page_size = page_size
        self.words = words
        self.salt = np.uint64(salt)
        pages = -(-num_slots // page_size)
        self.tensors: dict[str, list[Any]] = {
            "K": [xp.zeros((pages, page_size, words), np.uint64) for _ in range(layers)],
            "V": [xp.zeros((pages, page_size, words), np.uint64) for _ in range(layers)] if with_v else [],
        }
        self._word_ids = xp.arange(words, dtype=np.uint64)

    def write(self, dest: Any, tokens: Any, positions: Any, intended: Any) -> None:
        """Store the KV of ``tokens`` at ``positions`` (computed for slots ``intended``) into slots ``dest``."""
        if dest.shape[0] == 0:
            return
        base = _mix((tokens.astype(np.uint64) * _C_TOKEN) ^ (positions.astype(np.uint64) * _C_POS)
                    ^ (intended.astype(np.uint64) * _C_SLOT) ^ self.salt)
        page, row = dest // self.page_size, dest % self.page_size
        for k, layers in enumerate(self.tensors.values()):
            for layer, tensor in enumerate(layers):
                lane = np.uint64(1 + 64 * (2 * layer + k))
                words = _mix(base[:, None] ^ ((self._word_ids[None, :] + lane) * _C_WORD))
                tensor[page, row] = words

    def sources(self, kind: str) -> tuple[RealKvSource, ...]:
        per_token = self.words * 8
        return tuple(RealKvSource(t, page_size=self.page_size, num_bytes_per_token=per_token, read_bytes=per_token)
                     for t in self.tensors[kind])

    def flip_bit(self, kind: str, layer: int, slot: int, byte: int, bit: int) -> None:
        tensor = self.tensors[kind][layer]
        word = byte // 8
        mask = np.uint64(1 << ((byte % 8) * 8 + bit))
        page, row = slot // self.page_size, slot % self.page_size
        tensor[page, row, word] ^= mask
