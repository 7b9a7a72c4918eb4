"""Host-visible argument checks shared by every launcher and every backend.

Only facts a host can see without reading device memory are checked here: types, dtypes, ranks, lengths,
contiguity, writability, devices, argument combinations, and the memory the arrays occupy (SPEC §0.8: every
array aligned to its element size, no output overlapping another output or an input, wrapped torch storage
still where it was). Values that live in device memory are the kernels' business (SPEC §0.5). Every failure
is a :class:`~kvcanary_cupy._errors.CanaryArgumentError` (a ``ValueError`` starting ``kv-canary: ``) that
names the argument, raised before any output is touched.
"""

from __future__ import annotations

import numbers
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._errors import fail
from .dlpack import Device, as_array, device_of, plain_ndarray


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


INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1


def host_int_vector(value: Any, name: str) -> np.ndarray:
    """A 1-D integer host array as int64, from anything NumPy reads as one (a list, a NumPy array, a CPU
    tensor): the one way host-side slot lists enter (``copy_slots``, a sweep source's answers). Refused
    rather than converted: a float or 2-D array would be truncated or flattened into slots the caller never
    named, and a masked array's hidden entries would be used as slots like the others (NumPy subclasses are
    judged as the DLPack bridge judges them)."""
    if isinstance(value, np.ndarray) and type(value) is not np.ndarray:
        value = plain_ndarray(value, name)
    try:
        arr = np.asarray(value)
    except Exception as exc:  # a device array, a ragged list...
        fail(f"{name} must be a host array ({type(exc).__name__}: {exc})")
    # ints beyond int64 make an object array; bools and floats are not slots
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        fail(f"{name} must be a 1-D integer host array, got {arr.dtype.name} {arr.shape}")
    if arr.dtype == np.uint64 and arr.size and int(arr.max()) > INT64_MAX:
        fail(f"{name} must hold integers within int64")
    return arr.astype(np.int64, copy=False)


def int_arg(value: Any, name: str, *, minimum: int | None = None, maximum: int | None = None) -> int:
    """A Python int from an int-like scalar (not bool, not an array), with optional bounds; always within
    int64, the width every scalar goes to the kernels with."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        fail(f"{name} must be an int, got {type(value).__name__}")
    value = int(value)
    low = INT64_MIN if minimum is None else max(minimum, INT64_MIN)
    high = INT64_MAX if maximum is None else min(maximum, INT64_MAX)
    if value < low:
        fail(f"{name} must be >= {low}, got {value}")
    if value > high:
        fail(f"{name} must be <= {high}, got {value}")
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


# --- memory: alignment, overlap, moved storage (SPEC §0.8) ---------------------------------------------------

def data_pointer(arr: Any) -> int:
    """Address of element 0 of a NumPy or CuPy array."""
    if isinstance(arr, np.ndarray):
        return int(arr.__array_interface__["data"][0])
    return int(arr.data.ptr)


def _span_end(arr: Any, pointer: int) -> tuple[int, int]:
    """``[first byte, last byte + 1)`` of the memory a non-empty array addresses."""
    if arr.flags.c_contiguous:
        return pointer, pointer + arr.nbytes
    lo = hi = pointer
    for extent, stride in zip(arr.shape, arr.strides, strict=True):
        reach = (extent - 1) * stride
        if reach < 0:
            lo += reach
        else:
            hi += reach
    return lo, hi + arr.dtype.itemsize


def check_memory(outputs: Sequence[tuple[str, Any]], inputs: Sequence[tuple[str, Any]] = ()) -> None:
    """Refuse what would make a kernel race or fault on the memory itself (SPEC §0.8).

    ``outputs`` are the arrays a launch writes, ``inputs`` those it only reads, as ``(name, array)`` pairs
    (None entries skipped); an array that is both read and written is an output. Every array must start at
    a multiple of its element size (loads, stores and atomics of int32/int64 fields are naturally aligned
    on a GPU, and misaligned ones are undefined behaviour in C++; the kernels index contiguous arrays from
    their first element, so the start is what matters); an output must share no byte with another output
    nor with an input, since one thread would then read or write what another thread writes.
    """
    spans: list[tuple[int, int, bool, str]] = []
    for is_output, group in ((True, outputs), (False, inputs)):
        for name, arr in group:
            if arr is None:
                continue
            pointer = data_pointer(arr)
            itemsize = arr.dtype.itemsize
            if pointer % itemsize:
                fail(f"{name} is not aligned to its {itemsize}-byte elements (address {pointer:#x}); kernels "
                     f"load it as {arr.dtype.name}")
            if arr.size:
                spans.append((*_span_end(arr, pointer), is_output, name))
    spans.sort()
    count = len(spans)
    for k in range(count - 1):
        _, hi, is_output, name = spans[k]
        j = k + 1
        while j < count and spans[j][0] < hi:  # sorted by start: only these can overlap span k
            _, _, other_output, other = spans[j]
            j += 1
            if is_output or other_output:
                written, read = (name, other) if is_output else (other, name)
                role = "another output" if is_output and other_output else "an input it is read with"
                fail(f"{written} overlaps {read} in memory ({role}); outputs of one launch must not share "
                     f"memory with each other or with the inputs")


@dataclass(frozen=True)
class StorageGuard:
    """What a wrapped torch tensor looked like when it was wrapped: a launch that uses a view taken then
    refuses to run if the tensor's storage has since moved or shrunk (``resize_``, ``set_``,
    ``untyped_storage().resize_``), since the view would address freed memory."""

    name: str
    tensor: Any  # held, so the storage object outlives every view of it
    pointer: int
    needed_bytes: int
    # The storage as wrapped, held: a resize of it (through any handle) shows in its nbytes, and a tensor moved
    # to other memory shows in its data_ptr, so a step's checks need no new storage handle per tensor.
    storage: Any

    def check(self) -> None:
        tensor = self.tensor
        if tensor.data_ptr() != self.pointer or self.storage.nbytes() < self.needed_bytes:
            fail(f"{self.name}: the torch tensor's storage moved or shrank since it was wrapped (resize_, "
                 f"set_ or a storage resize); wrap or bind it again")


class GuardSet:
    """The storage checks of several launches run as one: each storage's size read once against the most any
    of its tensors needs, then each tensor's address (an engine's KV-cache views all share one storage, and each
    torch call costs microseconds on a busy engine). A failure is reported by the guard it concerns, as
    :meth:`StorageGuard.check` reports it."""

    def __init__(self, guards: Iterable[StorageGuard]) -> None:
        self.guards = tuple(guards)
        by_storage: dict[int, tuple[Any, int, list[StorageGuard]]] = {}
        for guard in self.guards:
            storage, needed, members = by_storage.get(id(guard.storage), (guard.storage, 0, []))
            members.append(guard)
            by_storage[id(guard.storage)] = (storage, max(needed, guard.needed_bytes), members)
        self._storages = tuple(by_storage.values())

    def check(self) -> None:
        for storage, needed, members in self._storages:
            if storage.nbytes() < needed:
                for guard in members:
                    guard.check()
        for guard in self.guards:
            if guard.tensor.data_ptr() != guard.pointer:
                guard.check()


def storage_guards(named: Iterable[tuple[str, Any]]) -> tuple[StorageGuard, ...]:
    """One :class:`StorageGuard` per torch tensor among ``named`` (other producers cannot move their memory
    under a live view: NumPy refuses to resize a referenced array, CuPy and JAX arrays never resize). A tensor
    without plain storage (sparse, nested, meta) is skipped: no launch can read it, so no view of it exists to
    guard, and where a launch does read it the launch's own check refuses it by name."""
    torch = sys.modules.get("torch")
    if torch is None:
        return ()
    guards = []
    for name, obj in named:
        if isinstance(obj, torch.Tensor) and obj.layout == torch.strided and not obj.is_nested \
                and obj.device.type != "meta":
            storage = obj.untyped_storage()
            needed = obj.data_ptr() - storage.data_ptr() + _tensor_extent_bytes(obj)
            guards.append(StorageGuard(name, obj, obj.data_ptr(), needed, storage))
    return tuple(guards)


def _tensor_extent_bytes(tensor: Any) -> int:
    if tensor.numel() == 0:
        return 0
    reach = sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride(), strict=True)
                if stride > 0)
    return (reach + 1) * tensor.element_size()
