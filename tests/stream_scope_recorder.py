"""A stand-in for ``stream_scope`` that records what a launch chose its CUDA stream from (on the CPU the real
one is a no-op, so only a stand-in shows which arguments it was given and that the launch ran inside it)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np


class RecordingStreamScope:
    """Stands in for ``stream_scope``: keeps the arguments each call chose its stream from, and what ``watch()``
    returned when the scope was entered and left (what the launch writes: a test sees that it ran inside)."""

    def __init__(self, watch: Callable[[], np.ndarray]):
        self.watch = watch
        self.calls: list[tuple] = []
        self.events: list[tuple[str, np.ndarray]] = []

    def __call__(self, *values):
        self.calls.append(values)
        return self

    def __enter__(self):
        self.events.append(("enter", np.array(self.watch())))

    def __exit__(self, *exc):
        self.events.append(("exit", np.array(self.watch())))
        return False


def assert_chosen_from(values: tuple, *arrays) -> None:
    """Each array a launch reads must be among the arguments its stream is chosen from: a torch CUDA tensor in
    any of them (the others may be CuPy arrays) puts the launch on torch's current stream."""
    for k, arr in enumerate(arrays):
        assert any(v is arr for v in values), f"argument {k} is not among the stream scope's arguments"


def record_fields(canary_buf: np.ndarray, rows: list[int]) -> Callable[[], np.ndarray]:
    """What ``watch`` reads for a gather or scatter: the 4 record fields of ``rows`` of a canary buffer."""
    return lambda: canary_buf.view(np.int64)[rows, :4]
