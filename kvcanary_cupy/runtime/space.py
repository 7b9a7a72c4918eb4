"""Where the runtime's buffers live and how the host touches them: NumPy on the CPU, CuPy or torch on a GPU.

Owns :class:`ArraySpace`. Every buffer the runtime allocates has an *owner* (the framework object handed to
the launchers: a NumPy/CuPy array, or a torch tensor with ``framework="torch"``) and a *view* (its NumPy/CuPy
view through DLPack, which the runtime's own copies and fills use). On CUDA, :meth:`ArraySpace.scope` makes
those copies run on the stream the launches run on (torch's current stream for torch, CuPy's otherwise), host
snapshots go to pinned memory with an event, and nothing here ever synchronises the device except
:meth:`ArraySpace.synchronize` and the waits on events recorded one step earlier.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any

import numpy as np

from .._errors import fail
from ..dlpack import Device, as_array, cupy_module, cupy_stream_for
from ..plan import _allocate, allocation_nbytes

FRAMEWORKS = ("numpy", "torch")


def parse_device(device: Any) -> Device:
    text = str(device)
    if text == "cpu":
        return Device("cpu", 0)
    if text == "cuda":
        return Device("cuda", 0)
    if text.startswith("cuda:") and text[5:].isdigit():
        return Device("cuda", int(text[5:]))
    fail(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}")


class ArraySpace:
    """Allocation, stream scope, host snapshots and events for one device and framework."""

    def __init__(self, device: Any, framework: str) -> None:
        if not isinstance(framework, str) or framework not in FRAMEWORKS:
            fail(f"framework must be one of {', '.join(FRAMEWORKS)}, got {framework!r}")
        self.device = parse_device(device)
        self.framework = framework
        self.torch: Any = None
        if framework == "torch":
            try:
                import torch
            except ImportError:
                fail("framework='torch' needs torch installed")
            self.torch = torch
        if self.device.kind == "cuda":
            cupy = cupy_module()
            if cupy is None:
                fail(f"device={device!r} needs CuPy (install the cuda12 or cuda13 extra)")
            self.xp: Any = cupy
        else:
            self.xp = np

    @property
    def is_cuda(self) -> bool:
        return self.device.kind == "cuda"

    # -- allocation (creation time only) -------------------------------------------------------------------

    def alloc(self, shape: int | tuple[int, ...], dtype: Any, fill: int = 0, *,
              name: str = "the requested size") -> tuple[Any, Any]:
        """A filled buffer: ``(owner, view)``. Sizes no device can hold are a ``kv-canary: `` error naming
        ``name``, the argument whose value sized the buffer."""
        if self.torch is None:
            owner = _allocate(str(self.device), shape, dtype, fill, name=name)
            return owner, owner
        torch = self.torch
        with self.scope():
            try:
                owner = torch.full(shape if isinstance(shape, tuple) else (shape,), fill,
                                   dtype=getattr(torch, np.dtype(dtype).name), device=str(self.device))
            except (MemoryError, RuntimeError, ValueError) as exc:  # torch's out-of-memory is a RuntimeError
                fail(f"{name} asks for {allocation_nbytes(shape, dtype)} bytes ({shape} x {np.dtype(dtype).name}), "
                     f"which cannot be allocated on device={str(self.device)!r} ({type(exc).__name__}: {exc})")
            view = as_array(owner, "runtime buffer", writable=True)
        return owner, view

    def host(self, shape: int | tuple[int, ...], dtype: Any) -> np.ndarray:
        """A zeroed host buffer for device-to-host copies (page-locked on CUDA, so copies are asynchronous)."""
        if not self.is_cuda:
            return np.zeros(shape, dtype)
        import cupyx

        out = cupyx.empty_pinned(shape, dtype)
        out[...] = 0
        return out

    # -- streams -------------------------------------------------------------------------------------------

    def scope(self) -> contextlib.AbstractContextManager:
        """The device and stream every runtime copy, fill and launch of this space runs on."""
        if not self.is_cuda:
            return contextlib.nullcontext()
        cupy = self.xp
        stack = contextlib.ExitStack()
        stack.enter_context(cupy.cuda.Device(self.device.index))
        if self.torch is not None:
            pointer = int(self.torch.cuda.current_stream(self.device.index).cuda_stream)
            stack.enter_context(cupy_stream_for(cupy, self.device.index, pointer))
        return stack

    def to_host_async(self, view: Any, out: np.ndarray) -> None:
        """Enqueue a copy of ``view`` into ``out`` (same shape) on the current stream (immediate on the CPU)."""
        if not self.is_cuda:
            np.copyto(out, view)
            return
        view.get(stream=self.xp.cuda.get_current_stream(), out=out, blocking=False)

    def upload(self, view: Any, host: np.ndarray) -> None:
        """Enqueue a host-to-device copy into ``view`` (immediate on the CPU)."""
        if not self.is_cuda:
            np.copyto(view, host)
            return
        view.set(host, stream=self.xp.cuda.get_current_stream())

    def event(self) -> Any:
        """A new event for :meth:`record` (None on the CPU). Creation time only: a step records the same events
        again and again, since creating one per step would allocate inside the step."""
        if not self.is_cuda:
            return None
        with self.xp.cuda.Device(self.device.index):
            return self.xp.cuda.Event(disable_timing=True)

    def record(self, event: Any) -> Any:
        """Record ``event`` (from :meth:`event`) after everything enqueued so far on the current stream and
        return it. A wait already enqueued on its earlier record is unaffected (CUDA takes the record current
        at the time of the wait), but the host must be done waiting on that earlier record."""
        if event is not None:
            event.record()
        return event

    @staticmethod
    def wait(event: Any) -> None:
        """Block until ``event`` completed; called on events recorded one step earlier."""
        if event is not None:
            event.synchronize()

    def read_after(self, event: Any, view: Any, out: np.ndarray, side: Any) -> None:
        """Copy ``view`` (written before ``event``) into ``out`` now, on the side stream ``side``, so the copy
        waits for ``event`` only and never for work enqueued after it."""
        if not self.is_cuda:
            np.copyto(out, view)
            return
        side.wait_event(event)
        view.get(stream=side, out=out, blocking=False)
        side.synchronize()

    def side_stream(self) -> Any:
        if not self.is_cuda:
            return None
        with self.xp.cuda.Device(self.device.index):
            return self.xp.cuda.Stream(non_blocking=True)

    def synchronize(self) -> None:
        """Wait for everything enqueued on the current stream (shutdown and explicit checks only)."""
        if self.is_cuda:
            with self.scope():
                self.xp.cuda.get_current_stream().synchronize()

    def capturing(self) -> bool:
        """True while torch captures a CUDA graph on this device (host paths must not run then)."""
        torch = self.torch if self.torch is not None else sys.modules.get("torch")
        if not self.is_cuda or torch is None:
            return False
        return bool(torch.cuda.is_current_stream_capturing())
