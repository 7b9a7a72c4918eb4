"""The step's TAIL work on a thread of its own: :class:`TailThread`.

After an engine's forward the canary still has its TAIL launches to run (re-hash the prefix's real KV, stamp what
the forward wrote) and the one-step-late read of the rings. None of it changes what the engine does next, and on a
host backend the launches run in compiled code that releases the GIL; so they can run while the engine samples,
updates its requests and schedules the next step, on a core its forward left idle.

The thread may be given cores of its own (``cores``): it moves there when it starts, so that the work takes no
time from the engine's thread at all where the machine has a core the engine leaves idle meanwhile.

Work may also be *held* (:meth:`TailThread.hold`) and started later (:meth:`TailThread.release`): an engine whose
worker samples after its forward and then waits for the next step starts it once sampling returns, so that the
work takes the core while the worker waits rather than while it samples and sends its output (the step's
critical path). Held work starts at the latest when it is waited for.

The work's Python shares the GIL with the engine thread, which takes it back after each of its own GIL-free calls
(a torch operation, a host launch). CPython hands the GIL over when its holder blocks or, if it never does, once
the waiting thread has waited a *switch interval* (5 ms by default): an engine thread that wakes while the TAIL
thread runs Python waits until that Python reaches a launch, and can lose the GIL again to it when the launch
returns first. A thread may therefore be given a shorter interval (``switch_interval``): the interpreter's is
lowered to it while the thread exists (never raised; the lowest asked for while several exist) and put back
when the last such thread closes, unless something else changed it meanwhile.

The engine's next step must not start before that work is done: the next forward writes KV that a TAIL verify
may still be reading (a finished request's blocks are handed out again at once), and the next step's staging
overwrites the buffers the TAIL launches read. So the engine thread calls :meth:`TailThread.wait` before anything
of the next step runs (and before any read of the canary's state from outside the step). What the work raised is
raised there, on the engine thread.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from typing import Any

from ..._errors import fail


class _SwitchInterval:
    """The interpreter's switch interval as the TAIL threads that asked for a shorter one want it: lowered while
    one of them runs, put back when the last closes (unless it was changed meanwhile by someone else)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._asked: list[float] = []  # one entry per running thread that asked
        self._saved = 0.0  # the interval before the first of them
        self._set: float | None = None  # the interval last set here

    @property
    def claims(self) -> int:
        """The running threads that asked for an interval."""
        return len(self._asked)

    def claim(self, seconds: float) -> None:
        with self._lock:
            if not self._asked:
                self._saved = sys.getswitchinterval()
            self._asked.append(seconds)
            self._apply()

    def release(self, seconds: float) -> None:
        with self._lock:
            self._asked.remove(seconds)
            if self._asked:
                self._apply()
            elif self._set is not None and sys.getswitchinterval() == self._set:
                _set_switch_interval(self._saved)
                self._set = None

    def _apply(self) -> None:
        want = min([self._saved, *self._asked])
        if sys.getswitchinterval() != want:
            _set_switch_interval(want)
        self._set = sys.getswitchinterval()


def _set_switch_interval(seconds: float) -> None:
    """``sys.setswitchinterval`` to the nearest whole microsecond: CPython keeps whole microseconds, truncating, so
    an interval read back (``getswitchinterval()``, microseconds / 1e6) would come back one microsecond short."""
    sys.setswitchinterval((max(1, round(seconds * 1e6)) + 0.25) / 1e6)


SWITCH_INTERVAL = _SwitchInterval()


class TailThread:
    """At most one piece of work in flight (or held) on one worker thread; :meth:`wait` joins it. ``cores``: the
    CPUs the worker thread runs on (set when it starts; where the platform refuses them it stays on its
    creator's). ``switch_interval``: seconds; the interpreter's switch interval while the worker thread exists
    (from the first :meth:`submit` to :meth:`close`), if shorter than it was.

    One caller drives it (the engine thread). The hand-over is two locks, one each way, rather than a thread
    pool's futures: it runs twice a step on the engine's critical path, where a future, its condition and the
    pool's queue and bookkeeping cost tens of microseconds of the engine thread's Python each time."""

    def __init__(self, name: str = "kvcanary-tail", cores: frozenset[int] | None = None,
                 switch_interval: float | None = None) -> None:
        if switch_interval is not None and not 0 < switch_interval <= 1:
            fail(f"switch_interval must be in (0, 1] seconds, got {switch_interval!r}")
        self._name = name
        self.cores = cores
        self.switch_interval = switch_interval
        self.pinned: frozenset[int] | None = None  # the worker thread's CPUs, once it has moved to ``cores``
        self._thread: threading.Thread | None = None  # started by the first submit (after any fork of the engine)
        self._go = threading.Lock()  # released by the caller: ``_job`` is set (None: stop)
        self._done = threading.Lock()  # released by the worker: the job has run (its error in ``_error``)
        self._job: tuple[Callable[..., Any], tuple[Any, ...]] | None = None
        self._error: BaseException | None = None  # what the finished work raised, until wait() raises it
        self._pending = False  # a job was handed over and its end not yet taken by wait()
        self._joined = False  # ... and join() has seen it finish
        self._held: tuple[Callable[..., Any], tuple[Any, ...]] | None = None

    @property
    def started(self) -> bool:
        """The worker thread exists (the first :meth:`submit` starts it)."""
        return self._thread is not None

    @property
    def busy(self) -> bool:
        return self._pending or self._held is not None

    def submit(self, work: Callable[..., Any], *args: Any) -> None:
        """Run ``work(*args)`` on the worker; the previous work is waited for first (in order, one at a time)."""
        self.wait()
        if self._thread is None:
            if self.switch_interval is not None:
                SWITCH_INTERVAL.claim(self.switch_interval)
            self._go.acquire(blocking=False)
            self._done.acquire(blocking=False)
            self._thread = threading.Thread(target=self._serve, name=f"{self._name}_0", daemon=True)
            self._thread.start()
        self._job = (work, args)
        self._pending, self._joined = True, False
        self._go.release()

    def _serve(self) -> None:
        """The worker thread: move to ``cores``, then run each job handed over until a None job stops it."""
        self._move_to_cores()
        while True:
            self._go.acquire()
            job, self._job = self._job, None
            if job is None:
                self._done.release()
                return
            try:
                job[0](*job[1])
            except BaseException as exc:  # raised on the caller's thread by wait()
                self._error = exc
            del job  # the step's arrays are not kept alive until the next one
            self._done.release()

    def _move_to_cores(self) -> None:
        if self.cores:
            try:
                os.sched_setaffinity(0, self.cores)  # 0: the calling thread
                self.pinned = frozenset(os.sched_getaffinity(0))
            except (AttributeError, OSError):  # no such call here, or none of those CPUs is allowed
                self.pinned = None

    def hold(self, work: Callable[..., Any], *args: Any) -> None:
        """Keep ``work(*args)`` to run on the worker once :meth:`release` (or a wait) starts it; the previous work
        is waited for first."""
        self.wait()
        self._held = (work, args)

    def release(self) -> None:
        """Start the held work, if any."""
        held, self._held = self._held, None
        if held is not None:
            self.submit(held[0], *held[1])

    def wait(self) -> None:
        """Block until the work in flight or held (if any) is done; raise what it raised."""
        self.join()
        self._pending = False
        error, self._error = self._error, None
        if error is not None:
            raise error

    def join(self) -> None:
        """Block until the work in flight or held (if any) is done, its error kept for :meth:`wait` (for readers
        of the results, which must not take the error the next step is to raise); the work counts as in
        flight (:attr:`busy`) until :meth:`wait` has taken its end."""
        self.release()
        if self._pending and not self._joined:
            self._done.acquire()
            self._joined = True

    def close(self) -> None:
        """Wait for the work in flight (its error is raised, the worker stopped either way)."""
        try:
            self.wait()
        finally:
            thread, self._thread = self._thread, None
            if thread is not None:
                self._job = None
                self._go.release()
                self._done.acquire()
                thread.join()
                if self.switch_interval is not None:
                    SWITCH_INTERVAL.release(self.switch_interval)
