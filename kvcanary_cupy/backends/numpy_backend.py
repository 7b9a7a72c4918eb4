"""The ``numpy`` backend: the vectorized reference implementations behind the common backend interface.

Concurrency: a launch updates its context with read-modify-writes in Python (the ring's write index, the
counters, the status word), which two threads would interleave and lose. Launches that
share any of that state are therefore serialised: each word a launch read-modify-writes maps to one of a
fixed set of locks (by address), and a launch holds the locks of all of them, taken in a fixed order, for
its whole run. Two threads verifying on one context (or on endpoints sharing a ring) give the result of
some serial order; launches on unrelated contexts still run side by side.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

from .._validate import data_pointer
from .numpy_chain import scatter_reference, verify_reference, write_reference
from .numpy_plan import plan_reference
from .numpy_transfer import gather_records_reference, scatter_records_reference

_LOCKS = tuple(threading.Lock() for _ in range(64))


class _Serialised:
    """Holds the locks of the arrays a launch updates in place, taken in sorted order (no deadlock)."""

    __slots__ = ("locks",)

    def __init__(self, *arrays: Any) -> None:
        self.locks = [_LOCKS[k] for k in sorted({(data_pointer(a) >> 3) % len(_LOCKS) for a in arrays})]

    def __enter__(self) -> None:
        for lock in self.locks:
            lock.acquire()

    def __exit__(self, *exc: Any) -> None:
        for lock in reversed(self.locks):
            lock.release()


def _context_state(ctx: Any) -> _Serialised:
    # The read-modify-written words; the ring is only written at indices the write index hands out, and the
    # canary is written, never read back, by a write (two threads writing one canary race as two streams do).
    return _Serialised(ctx.write_index, ctx.slot_run_counter, ctx.kernel_run_counter, ctx.status)


def _status_word(status: Any | None) -> contextlib.AbstractContextManager:
    """The lock of an optional status word that a launch ORs bits into."""
    return contextlib.nullcontext() if status is None else _Serialised(status)


class NumpyBackend:
    """Reference backend. ``on_invalid="raise"`` refuses out-of-range device values with ValueError;
    ``"flag"`` reports them exactly like the kernels do (status bits, neutralised entries)."""

    name = "numpy"

    def __init__(self, on_invalid: str = "raise") -> None:
        self.on_invalid = on_invalid

    def plan(self, launch: Any) -> None:
        # Every plan output is overwritten (no read-modify-write), so concurrent plans need no lock.
        plan_reference(launch, self.on_invalid)

    def write(self, launch: Any) -> None:
        with _context_state(launch.context):
            write_reference(launch, self.on_invalid)

    def verify(self, launch: Any) -> None:
        with _context_state(launch.context):
            verify_reference(launch, self.on_invalid)

    def scatter(self, launch: Any) -> None:
        with _status_word(launch.status):
            scatter_reference(launch, self.on_invalid)

    def gather_records(self, launch: Any) -> None:
        with _status_word(launch.status):
            gather_records_reference(launch, self.on_invalid)

    def scatter_records(self, launch: Any) -> None:
        # The status word is read-modify-written (it may be shared with other launches, a context's included);
        # the records land in the caller's slots by plain stores, never read back, so two threads scattering
        # into one canary buffer race on the slots as two CUDA streams would (docs/contract.md, Threads).
        with _status_word(launch.status):
            scatter_records_reference(launch, self.on_invalid)
