"""Host-visible argument checks shared by every launcher and every backend.

Only facts a host can see without reading device memory are checked here: types, dtypes, ranks, lengths,
contiguity, writability, devices and argument combinations. Values that live in device memory are the
kernels' business (SPEC §0.5). Every failure is a ``ValueError`` starting ``kv-canary: `` that names the
argument, raised before any output is touched.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable
from typing import Any

import numpy as np

from ._errors import fail
from .dlpack import Device, as_array, device_of


def array_arg(
    obj: Any,
    name: str,
    *,
    dtype: type | np.dtype,
    ndim: int,
    shape: tuple[int | None, ...] | None = None,
    writable: bool = False,
) -> Any:
    """Convert ``obj`` through the DLPack bridge and check dtype, rank, shape and C-contiguity."""
    arr = as_array(obj, name, writable=writable)
    want = np.dtype(dtype)
    if arr.dtype != want:
        fail(f"{name} must have dtype {want.name}, got {arr.dtype.name}")
    if arr.ndim != ndim:
        fail(f"{name} must be {ndim}-D, got shape {tuple(arr.shape)}")
    if shape is not None:
        for axis, (got, expected) in enumerate(zip(arr.shape, shape, strict=True)):
            if expected is not None and got != expected:
                want_shape = tuple("*" if s is None else s for s in shape)
                fail(f"{name} must have shape {want_shape}, got {tuple(arr.shape)} (axis {axis})")
    if not arr.flags.c_contiguous:
        fail(f"{name} must be contiguous, got strides {tuple(arr.strides)} for shape {tuple(arr.shape)}")
    return arr


def optional_array_arg(obj: Any, name: str, **kwargs: Any) -> Any:
    return None if obj is None else array_arg(obj, name, **kwargs)


def int_arg(value: Any, name: str, *, minimum: int | None = None, maximum: int | None = None) -> int:
    """A Python int from an int-like scalar (not bool, not an array), with optional bounds."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        fail(f"{name} must be an int, got {type(value).__name__}")
    value = int(value)
    if minimum is not None and value < minimum:
        fail(f"{name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        fail(f"{name} must be <= {maximum}, got {value}")
    return value


def bool_arg(value: Any, name: str) -> bool:
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    fail(f"{name} must be a bool, got {type(value).__name__}")


def same_device(arrays: Iterable[tuple[str, Any]]) -> Device:
    """The one device all named arrays live on; mixing CPU/CUDA or two GPUs names both arguments."""
    first_name: str | None = None
    first_device: Device | None = None
    for name, arr in arrays:
        if arr is None:
            continue
        dev = device_of(arr)
        if first_device is None:
            first_name, first_device = name, dev
        elif dev != first_device:
            fail(f"{name} is on {dev} but {first_name} is on {first_device}; all arrays of one call must "
                 f"share a device")
    return first_device if first_device is not None else Device("cpu", 0)
