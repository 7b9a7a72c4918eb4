"""The runtime's one-element device words, packed so that one copy snapshots them all.

Counters, flags, write indices and status words are each an int32 or int64 ``[1]`` array that a kernel
updates; the runtime reserves them by name, allocates two blocks (one per dtype) and hands out 1-element
views. Reading them one step late then costs one asynchronous copy per block into host memory, instead of one
per word.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .space import ArraySpace

_DTYPES = (np.int32, np.int64)


class Scalars:
    """Named 1-element device words in two blocks, and their host snapshots."""

    def __init__(self) -> None:
        self._index: dict[str, tuple[int, int]] = {}  # name -> (block, position)
        self._names: list[list[str]] = [[], []]  # per block, the names in position order
        self._fills: list[list[int]] = [[], []]
        self._owners: list[Any] = [None, None]
        self._views: list[Any] = [None, None]

    def reserve(self, name: str, dtype: Any, fill: int = 0) -> None:
        block = _DTYPES.index(np.dtype(dtype).type)
        self._index[name] = (block, len(self._fills[block]))
        self._names[block].append(name)
        self._fills[block].append(fill)

    def allocate(self, space: ArraySpace) -> None:
        for block, dtype in enumerate(_DTYPES):
            fills = self._fills[block] or [0]
            owner, view = space.alloc(len(fills), dtype, 0)
            with space.scope():
                space.upload(view, np.asarray(fills, dtype))
            self._owners[block], self._views[block] = owner, view

    def owner(self, name: str) -> Any:
        block, i = self._index[name]
        return self._owners[block][i : i + 1]

    def view(self, name: str) -> Any:
        block, i = self._index[name]
        return self._views[block][i : i + 1]

    def host_buffers(self, space: ArraySpace) -> tuple[np.ndarray, np.ndarray]:
        int32s, int64s = (space.host(int(v.shape[0]), dt) for v, dt in zip(self._views, _DTYPES, strict=True))
        return int32s, int64s

    def copy_to(self, space: ArraySpace, host: tuple[np.ndarray, np.ndarray]) -> None:
        """Enqueue the copy of both blocks into ``host`` (pinned) on the current stream."""
        for view, out in zip(self._views, host, strict=True):
            space.to_host_async(view, out)

    def value(self, host: tuple[np.ndarray, np.ndarray], name: str) -> int:
        block, i = self._index[name]
        return int(host[block][i])

    def read(self, host: tuple[np.ndarray, np.ndarray]) -> dict[str, int]:
        """Every word of a host snapshot by name, as Python ints: one conversion per block (a step reads most
        of the words, and one look-up and conversion each costs several times more)."""
        # not strict: a block without words still holds one (allocate)
        words = dict(zip(self._names[0], host[0].tolist(), strict=False))
        words.update(zip(self._names[1], host[1].tolist(), strict=False))
        return words
