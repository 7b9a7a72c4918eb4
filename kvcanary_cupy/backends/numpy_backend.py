"""The ``numpy`` backend: the vectorized reference implementations behind the common backend interface.

Concurrency: a launch updates its context with read-modify-writes in Python (the ring's write index, the
counters, the status word, the canary slots), which two threads would interleave and lose. Launches that
share any of that state are therefore serialised: each array a launch updates in place maps to one of a
fixed set of locks (by address), and a launch holds the locks of all of them, taken in a fixed order, for
its whole run. Two threads verifying on one context (or on endpoints sharing a ring) give the result of
some serial order; launches on unrelated contexts still run side by side.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

from .._validate import data_pointer
from .numpy_chain import scatter_reference, verify_reference, write_reference
from .numpy_plan import plan_reference

_LOCKS = tuple(threading.Lock() for _ in range(64))


@contextlib.contextmanager
def _serialised(*arrays: Any) -> Iterator[None]:
    """Hold the locks of every array updated in place, taken in sorted order so that no two launches deadlock."""
    stripes = sorted({(data_pointer(a) >> 6) % len(_LOCKS) for a in arrays if a is not None})
    with contextlib.ExitStack() as held:
        for k in stripes:
            held.enter_context(_LOCKS[k])
        yield


def _context_state(ctx: Any) -> tuple[Any, ...]:
    return ctx.write_index, ctx.slot_run_counter, ctx.kernel_run_counter, ctx.status, ctx.ring


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
        with _serialised(*_context_state(launch.context), launch.context.canary):
            write_reference(launch, self.on_invalid)

    def verify(self, launch: Any) -> None:
        with _serialised(*_context_state(launch.context)):
            verify_reference(launch, self.on_invalid)

    def scatter(self, launch: Any) -> None:
        with _serialised(launch.status):
            scatter_reference(launch, self.on_invalid)
