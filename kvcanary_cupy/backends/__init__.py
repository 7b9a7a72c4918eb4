"""Backend selection: one dispatch in front of the three implementations of the same contract.

* ``numpy`` — the vectorized NumPy reference (:mod:`.numpy_backend`); CPU arrays.
* ``cuda`` — the ``kernels/*.cu`` sources compiled by NVRTC through ``cupy.RawModule``; CUDA arrays.
* ``host`` — the same ``kernels/*.cu`` compiled by g++ and run on the CPU (:mod:`kvcanary_cupy.hostcuda`);
  CPU arrays. Set ``KVCANARY_HOST_SANITIZE=1`` to build it with AddressSanitizer and UBSan
  (``KVCANARY_HOST_SANITIZE=thread``: ThreadSanitizer), ``KVCANARY_HOST_THREADS`` for its OS threads.

``auto`` (:func:`auto_choice`) picks ``cuda`` for CUDA arrays; for CPU arrays it picks ``host`` wherever g++
builds and runs a probe module (compiled once into the kernel cache, asked once per process) and the caller takes
flagged statuses (``on_invalid='flag'``, as the runtime and every engine integration do), else ``numpy`` (the
only backend that raises on invalid device values, and the one that runs without a compiler).

Validation happens before dispatch (in the launcher modules), so backends only compute. Availability, the
backend ``auto`` picks (one INFO line per process and choice, with the reason) and kernel compiles are logged on
the ``kvcanary_cupy`` logger (info / debug).
"""

from __future__ import annotations

import functools
import logging
import time
from typing import TYPE_CHECKING, Any, Protocol

from .._errors import fail
from ..settings import read as read_setting

if TYPE_CHECKING:
    from ..dlpack import Device
    from .kernel_backend import KernelBackend

log = logging.getLogger(__name__)

BACKEND_NAMES = ("numpy", "cuda", "host")


class Backend(Protocol):
    name: str

    def plan(self, launch: Any) -> None: ...
    def write(self, launch: Any) -> None: ...
    def verify(self, launch: Any) -> None: ...
    def scatter(self, launch: Any) -> None: ...
    def gather_records(self, launch: Any) -> None: ...
    def scatter_records(self, launch: Any) -> None: ...


@functools.cache
def unavailable_reason(name: str) -> str | None:
    """None if backend ``name`` can run on this machine, else why not (asked once per process: launches
    resolve their backend every call, and probing a driver or PATH each time would cost host time). For
    ``cuda`` this includes loading NVRTC, so ``auto`` never picks a backend that fails at its first compile."""
    reason = _probe(name)
    if reason is None:
        log.debug("backend %s is available", name)
    else:
        log.info("backend %s is unavailable: %s", name, reason)
    return reason


def _probe(name: str) -> str | None:
    if name == "numpy":
        return None
    if name == "host":
        from ..hostcuda import probe_compiler

        return probe_compiler(host_sanitizer_requested() or False)
    if name == "cuda":
        from .cuda import cuda_unavailable_reason

        return cuda_unavailable_reason()
    return f"unknown backend {name!r}"


def available_backends() -> list[str]:
    return [name for name in BACKEND_NAMES if unavailable_reason(name) is None]


def host_sanitize_requested() -> bool:
    return host_sanitizer_requested() is not None


def host_sanitizer_requested() -> str | None:
    """``KVCANARY_HOST_SANITIZE``: unset, empty or 0 -> None, 1 -> AddressSanitizer (``"address"``), ``thread``
    -> ThreadSanitizer; any other value is refused (:mod:`kvcanary_cupy.settings`)."""
    mode = read_setting("KVCANARY_HOST_SANITIZE")
    return None if mode in (None, "off") else str(mode)


@functools.cache
def _numpy_backend(on_invalid: str) -> Backend:
    from .numpy_backend import NumpyBackend

    return NumpyBackend(on_invalid=on_invalid)


@functools.cache
def _kernel_backend(name: str, sanitize: str | None) -> KernelBackend:
    if name == "cuda":
        from .cuda import make_cuda_backend

        return make_cuda_backend()
    from .host import make_host_backend

    return make_host_backend(sanitize=sanitize or False)


def resolve_backend(backend: str, device: Device, on_invalid: str | None = None) -> Backend:
    """The backend object for a launch whose arrays live on ``device``."""
    if not isinstance(backend, str) or backend not in ("auto", *BACKEND_NAMES):
        fail(f"backend={backend!r} is unknown; choose one of auto, {', '.join(BACKEND_NAMES)} "
             f"(available here: {', '.join(available_backends())})")
    if on_invalid not in (None, "raise", "flag"):
        fail(f"on_invalid must be 'raise' or 'flag', got {on_invalid!r}")
    name = backend
    if name == "auto":
        name, why = auto_choice(device.kind, on_invalid)
        log_auto_choice(name, why)
    if name in ("numpy", "host") and device.kind != "cpu":
        fail(f"backend={name!r} runs on CPU arrays, but the arrays are on {device}")
    if name == "cuda" and device.kind != "cuda":
        fail(f"backend='cuda' needs CUDA arrays (CuPy, torch CUDA tensors...), but the arrays are on {device}")
    reason = unavailable_reason(name)
    if reason is not None:
        fail(f"backend={name!r} is not available here: {reason} (available here: "
             f"{', '.join(available_backends())})")
    if name == "numpy":
        return _numpy_backend(on_invalid or "raise")
    if on_invalid == "raise":
        fail(f"on_invalid='raise' needs the numpy backend; backend={name!r} flags invalid device values in "
             "the status word instead (a kernel cannot raise without a host synchronisation)")
    return _kernel_backend(name, host_sanitizer_requested() if name == "host" else None)


def auto_choice(device_kind: str, on_invalid: str | None = "flag") -> tuple[str, str]:
    """The backend ``auto`` runs for arrays on a ``device_kind`` ("cpu" or "cuda") device, and why.

    CUDA arrays run the CUDA kernels. CPU arrays run the ``host`` backend (the same kernels compiled by g++,
    several times faster than the NumPy reference in an engine) where its probe compile works, unless the
    caller asks invalid device values to raise (``on_invalid`` "raise", or None, the launchers' default for the
    NumPy reference): only the reference can raise. Where the compiler is missing or fails, the NumPy
    reference runs and the reason says why."""
    if device_kind != "cpu":
        return "cuda", "the arrays are CUDA arrays"
    if on_invalid != "flag":
        return "numpy", (f"on_invalid={on_invalid!r}: only the NumPy reference raises on invalid device values"
                         if on_invalid is not None else
                         "the launcher's default on_invalid raises on invalid device values, which only the "
                         "NumPy reference does (on_invalid='flag' picks the host kernels)")
    reason = unavailable_reason("host")
    if reason is None:
        return "host", "the host kernels compile here (g++ built and ran the probe module)"
    return "numpy", f"the host backend is unavailable: {reason}"


@functools.cache
def log_auto_choice(name: str, why: str) -> None:  # cached: once per process and choice, not per launch
    """One INFO line naming the backend ``auto`` picked and why."""
    log.info("kv-canary backend auto: %s (%s)", name, why)


def prepare_backend(name: str) -> float:
    """Compile (or load from the cache) every kernel module of backend ``name`` now, so that no later launch
    pays for it; returns the seconds it took (0 for ``numpy``, which compiles nothing)."""
    if name == "numpy":
        return 0.0
    reason = unavailable_reason(name)
    if reason is not None:
        fail(f"backend={name!r} is not available here: {reason}")
    started = time.perf_counter()
    backend = _kernel_backend(name, host_sanitizer_requested() if name == "host" else None)
    backend.load_all()
    seconds = time.perf_counter() - started
    log.info("backend %s: kernels compiled or loaded in %.2f s", name, seconds)
    return seconds
