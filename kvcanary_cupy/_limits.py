"""The most bytes one creation may ask for, checked on the computed total before anything is allocated.

A capacity of 2**31 is a valid integer, and filling buffers for it one by one runs the machine out of memory (or
stalls for a minute in page faults) before any allocator refuses. So every creation (a runtime, a context, a plan)
adds up its buffers first and is refused, naming the argument and the byte count, above a limit:

* ``max_allocation_bytes=`` where the creation takes it, else
* the environment variable ``KVCANARY_MAX_ALLOCATION_BYTES`` (a positive integer), else
* half the machine's physical memory on the CPU (the canary shares the host with the engine it watches), or
  the whole memory of the GPU on CUDA (the device allocator then refuses what does not fit).
"""

from __future__ import annotations

import os
from typing import Any

from ._errors import fail
from .settings import read as read_setting

_LIMIT_ENV = "KVCANARY_MAX_ALLOCATION_BYTES"
HOST_MEMORY_FRACTION = 0.5


def physical_memory_bytes() -> int | None:
    """This machine's physical memory, or None where the OS does not say."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, OSError, ValueError):
        return None


def _device_memory_bytes(index: int) -> int | None:
    from .dlpack import cupy_module

    cupy = cupy_module()
    if cupy is None:
        return None
    try:
        return int(cupy.cuda.runtime.getDeviceProperties(index)["totalGlobalMem"])
    except Exception:  # no usable device: the allocation itself will say so
        return None


def allocation_limit(device: Any = "cpu", max_allocation_bytes: int | None = None) -> tuple[int | None, str]:
    """(limit in bytes or None for none known, where it comes from)."""
    if max_allocation_bytes is not None:
        if isinstance(max_allocation_bytes, bool) or not isinstance(max_allocation_bytes, int) \
                or max_allocation_bytes <= 0:
            fail(f"max_allocation_bytes must be a positive int, got {max_allocation_bytes!r}")
        return max_allocation_bytes, "max_allocation_bytes"
    from_env = read_setting(_LIMIT_ENV)
    if from_env is not None:
        return int(from_env), _LIMIT_ENV
    dev = str(device)
    if dev.startswith("cuda"):
        index = int(dev[5:]) if dev[5:].isdigit() else 0
        return _device_memory_bytes(index), f"the memory of {dev}"
    memory = physical_memory_bytes()
    return (None if memory is None else int(memory * HOST_MEMORY_FRACTION),
            "half this machine's physical memory")


def check_allocation(total_bytes: int, *, argument: str, what: str, device: Any = "cpu",
                     max_allocation_bytes: int | None = None) -> None:
    """Refuse ``total_bytes`` above the limit: ``argument`` (the caller's argument, with its value) names what
    asked, ``what`` the creation."""
    limit, source = allocation_limit(device, max_allocation_bytes)
    if limit is not None and total_bytes > limit:
        fail(f"{argument} makes {what} need {total_bytes} bytes ({total_bytes / 2**30:.1f} GiB), above the "
             f"allocation limit of {limit} bytes ({limit / 2**30:.1f} GiB, {source}); raise it with "
             f"max_allocation_bytes= or {_LIMIT_ENV}")
