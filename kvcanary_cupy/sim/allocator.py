"""The token-to-KV slot allocator: :class:`SlotAllocator`, a free list with reference counts."""

from __future__ import annotations

from typing import Any

import numpy as np


class SlotAllocator:
    """Free-list allocator over ``[1, size)`` with reference counts; slot 0 is never handed out.

    The free list is a stack: ``alloc`` pops from its end and ``free`` pushes there, so a freed slot is the
    next one handed out — the pattern under which a premature free corrupts a live request quickly.
    """

    def __init__(self, size: int) -> None:
        self.size = int(size)
        self._free: list[int] = list(range(self.size - 1, 0, -1))
        self.refs = np.zeros(self.size, np.int32)

    @property
    def available(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> np.ndarray | None:
        if n > len(self._free):
            return None
        if n == 0:
            return np.empty(0, np.int64)
        out = np.array(self._free[-n:][::-1], np.int64)
        del self._free[-n:]
        self.refs[out] = 1
        return out

    def share(self, slot: int) -> None:
        self.refs[slot] += 1

    def free(self, slots: Any) -> list[int]:
        """Drop one reference per slot; returns the slots that went back to the free list."""
        released = []
        for s in np.asarray(slots, np.int64).tolist():
            if s <= 0 or self.refs[s] <= 0:
                continue  # not held: an engine refuses a double free
            self.refs[s] -= 1
            if self.refs[s] == 0:
                self._free.append(s)
                released.append(s)
        return released

    def force_free(self, slot: int) -> None:
        """Return ``slot`` to the free list now, whatever holds it (used by fault injection only)."""
        if self.refs[slot] > 0:
            self.refs[slot] = 0
            self._free.append(int(slot))
