"""Reusable scratch arrays for the NumPy reference's hot paths.

A fresh temporary of a few hundred KB is a fresh ``mmap`` for the C allocator, and every page of it faults on
first touch; measured on the 2-core CI machine, that made a 32k-entry plan four times slower than its
arithmetic. The reference therefore computes its per-entry temporaries into arrays that live as long as the
thread (grown geometrically, never shrunk) and copies only results into the caller's buffers.
"""

from __future__ import annotations

import threading

import numpy as np


class Workspace:
    def __init__(self) -> None:
        self._buffers: dict[str, np.ndarray] = {}
        self._arange = np.zeros(0, np.int64)

    def array(self, key: str, n: int, dtype: type) -> np.ndarray:
        """An uninitialised 1-D array of ``n`` items; the same memory every call with the same ``key``."""
        buf = self._buffers.get(key)
        need = n * np.dtype(dtype).itemsize
        if buf is None or buf.nbytes < need:
            # Large buffers all start at the same offset within a 4 KiB page; element-wise work between two
            # of them (a shifted copy, most of all) then stalls on 4K aliasing, measured 10x slower. Each
            # key therefore starts at its own cache-line offset within the page.
            stagger = (len(self._buffers) * 9 % 64) * 64
            size = max(need, 2 * (buf.nbytes if buf is not None else 0), 4096)
            raw = np.empty(size + 4096 + 64, np.uint8)
            start = (-raw.ctypes.data) % 64 + stagger
            buf = raw[start : start + size]
            self._buffers[key] = buf
        return buf[:need].view(dtype)

    def arange(self, n: int) -> np.ndarray:
        """``np.arange(n)`` as int64, read-only, shared by every caller."""
        if self._arange.shape[0] < n:
            grown = np.arange(max(n, 2 * self._arange.shape[0]), dtype=np.int64)
            grown.flags.writeable = False
            self._arange = grown
        return self._arange[:n]

    def repeat(self, key: str, values: np.ndarray, counts: np.ndarray, first: np.ndarray, total: int) -> np.ndarray:
        """``np.repeat(values, counts)`` into the workspace; ``first`` is the exclusive prefix sum of
        ``counts`` and ``total`` its sum. Built as the running sum of per-request jumps, which needs no
        allocation of ``total`` items."""
        out = self.array(key, total, np.int64)
        if total == 0:
            return out
        present = counts > 0
        starts = first[present]
        run_values = values[present].astype(np.int64, copy=False)
        out.fill(0)
        jumps = np.empty_like(run_values)
        jumps[0] = run_values[0]
        np.subtract(run_values[1:], run_values[:-1], out=jumps[1:])
        out[starts] = jumps
        np.cumsum(out, out=out)  # wraps modulo 2**64 like the values it reproduces
        return out


_local = threading.local()


def workspace() -> Workspace:
    """This thread's workspace (results must be copied out before the thread's next reference call)."""
    ws = getattr(_local, "workspace", None)
    if ws is None:
        ws = _local.workspace = Workspace()
    return ws
