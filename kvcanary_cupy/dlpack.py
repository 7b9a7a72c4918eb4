"""The DLPack bridge: any array-like that speaks DLPack becomes a NumPy (CPU) or CuPy (CUDA) view, no copy.

Every public launcher passes each array argument through :func:`as_array` once, so torch, JAX, CuPy and
NumPy arrays are all accepted and written in place. CuPy is imported only when a CUDA array shows up.
:func:`export` hands a view back to a framework (``torch``, ``cupy``, ``numpy``, ``jax.dlpack``) through
that framework's own ``from_dlpack``; the memory stays shared both ways.
"""

from __future__ import annotations

import contextlib
import dataclasses
import numbers
import sys
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from ._errors import CanaryArgumentError, fail

# DLDeviceType codes (dlpack.h)
_DL_CPU = 1
_DL_CUDA = 2
_DL_CUDA_HOST = 3
_DL_CUDA_MANAGED = 13


class DLPackArray(Protocol):
    """What every launcher's array arguments are: anything that exports itself through DLPack and has a
    shape — a NumPy or CuPy ndarray, a torch tensor, a JAX array. (Validation checks dtype, rank, shape,
    contiguity and device at run time; this type says what may be passed at all.)"""

    @property
    def __dlpack__(self) -> Callable[..., Any]: ...  # a method of any signature (they differ by framework)

    def __dlpack_device__(self) -> Any: ...

    @property
    def shape(self) -> Any: ...


@dataclass(frozen=True)
class Device:
    """Where an array lives: ``Device("cpu", 0)`` or ``Device("cuda", ordinal)``."""

    kind: str
    index: int = 0

    def __str__(self) -> str:
        return "cpu" if self.kind == "cpu" else f"cuda:{self.index}"


CPU = Device("cpu", 0)


def cupy_module() -> Any | None:
    """The CuPy module if it can be imported, else None (imported lazily, never at package import)."""
    try:
        import cupy
    except Exception:  # CuPy missing, or installed without a usable CUDA driver
        return None
    return cupy


def is_cupy_array(obj: Any) -> bool:
    # Cheap test that never imports CuPy: a CuPy array can only exist if CuPy was imported already.
    cupy = sys.modules.get("cupy")
    return cupy is not None and isinstance(obj, cupy.ndarray)


def device_of(arr: Any) -> Device:
    """Device of a NumPy or CuPy array."""
    if isinstance(arr, np.ndarray):
        return CPU
    if is_cupy_array(arr):
        return Device("cuda", int(arr.device.id))
    raise TypeError(f"not a NumPy or CuPy array: {type(arr).__name__}")


def _numpy_from_dlpack(obj: Any) -> np.ndarray:
    try:
        return np.from_dlpack(obj, copy=False)
    except TypeError:  # NumPy < 2.1 has no copy keyword and never copies
        return np.from_dlpack(obj)


def as_array(obj: Any, name: str, *, writable: bool = False) -> Any:
    """A zero-copy NumPy or CuPy view of ``obj`` (any DLPack producer), or ValueError naming ``name``.

    ``writable=True`` marks an output: a read-only import (a NumPy array with ``writeable=False``, or a
    producer that exports read-only memory) is refused rather than silently copied. Whatever goes wrong on
    the producer's side (a ``__dlpack__`` that raises or returns something other than a capsule, a
    ``__dlpack_device__`` that raises or returns junk, a layout or device DLPack cannot export) is a
    :class:`~kvcanary_cupy.CanaryArgumentError` naming ``name``: this is the one place foreign objects are
    touched, so no producer's own exception type can escape a launcher.
    """
    if type(obj) is np.ndarray or is_cupy_array(obj):
        arr = obj
    elif isinstance(obj, np.ndarray):
        arr = plain_ndarray(obj, name)
    elif _has_attr(obj, "__dlpack__") and _has_attr(obj, "__dlpack_device__"):
        try:
            arr = _import_dlpack(obj, name)
        except CanaryArgumentError:
            raise
        except Exception as exc:  # the producer's refusal or a broken producer, whatever it raised
            fail(f"{name} cannot be imported through DLPack ({type(exc).__name__}: {exc})")
    else:
        fail(f"{name} must be an array (NumPy, CuPy, or any DLPack producer such as a torch tensor), "
             f"got {type(obj).__name__}")
    if isinstance(arr, np.ndarray) and arr.dtype.hasobject:
        # references to Python objects: no value of them lies in the array's memory (DLPack cannot carry them)
        fail(f"{name} holds Python objects (dtype {arr.dtype}), not values in memory")
    if isinstance(arr, np.ndarray) and not arr.dtype.isnative:
        # DLPack carries native byte order only; a big-endian array would be read with its bytes swapped
        fail(f"{name} holds {arr.dtype.str} values in non-native byte order; pass "
             f"arr.astype(arr.dtype.newbyteorder('='))")
    if writable and not _is_writable(arr):
        fail(f"{name} is read-only; it is an output and must be writable")
    return arr


def _has_attr(obj: Any, attribute: str) -> bool:
    try:
        return hasattr(obj, attribute)
    except Exception:  # a __getattr__ raising something other than AttributeError
        return False


def _import_dlpack(obj: Any, name: str) -> Any:
    """The view of a DLPack producer that is not a NumPy or CuPy array (torch, JAX, anything else)."""
    if getattr(obj, "requires_grad", False) and hasattr(obj, "detach"):
        obj = obj.detach()  # a view that shares storage; DLPack refuses tensors that track gradients
    try:
        reported = obj.__dlpack_device__()
    except Exception as exc:
        fail(f"{name} reports no DLPack device ({type(exc).__name__}: {exc})")
    dev_type = _device_type(reported)
    if dev_type is None:
        fail(f"{name}.__dlpack_device__() must return (device_type, device_id) as two ints, got {reported!r}")
    if dev_type in (_DL_CPU, _DL_CUDA_HOST):
        return _numpy_from_dlpack(obj)
    if dev_type in (_DL_CUDA, _DL_CUDA_MANAGED):
        cupy = cupy_module()
        if cupy is None:
            fail(f"{name} lives on a CUDA device but CuPy is not installed (install the cuda12 or cuda13 extra)")
        return cupy.from_dlpack(obj)
    fail(f"{name} lives on DLPack device type {dev_type}, which is neither CPU nor CUDA")


def _device_type(reported: Any) -> int | None:
    """The device type of a ``__dlpack_device__()`` answer: a 2-tuple of ints (an IntEnum counts), else None."""
    if not isinstance(reported, tuple) or len(reported) != 2:
        return None
    if not all(isinstance(v, numbers.Integral) and not isinstance(v, bool) for v in reported):
        return None
    return int(reported[0])


def plain_ndarray(obj: np.ndarray, name: str) -> np.ndarray:
    """The base-class view of a NumPy subclass whose elements mean what the memory says (``np.memmap``...);
    subclasses that change indexing or hide elements are refused rather than misread."""
    if isinstance(obj, (np.matrix, np.ma.MaskedArray)):
        fail(f"{name} must be a plain array, got {type(obj).__module__}.{type(obj).__name__} (its "
             "indexing or masking would be ignored); pass np.asarray(...) of the data you mean")
    return obj.view(np.ndarray)


def _is_writable(arr: Any) -> bool:
    flags = getattr(arr, "flags", None)
    if flags is None:
        return True
    try:
        return bool(flags.writeable)
    except AttributeError:  # CuPy arrays have no writeable flag: device memory is always writable
        return True


def _dense_tensor(obj: Any, name: str, torch: Any) -> Any:
    """``obj`` detached, refused by ``name`` unless it is a dense tensor with data: a sparse, nested or meta
    tensor has no strides or bytes to view (torch raises its own errors for both)."""
    if obj.is_nested or obj.layout != torch.strided or obj.device.type == "meta":
        kind = "nested" if obj.is_nested else f"layout {obj.layout}"
        fail(f"{name} must be a dense tensor with data, got a {kind} tensor on {obj.device}")
    return obj.detach()


def as_byte_rows(obj: Any, name: str) -> Any:
    """A ``uint8 [rows, row_bytes]`` view of an array of any dtype with ndim >= 2 (dims after 0 contiguous).

    Dtypes NumPy cannot represent (bfloat16, fp8) are viewed as bytes on the producer's side first when the
    producer can do that without a copy (torch ``Tensor.view(torch.uint8)``).
    """
    if not (isinstance(obj, np.ndarray) or is_cupy_array(obj)):
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(obj, torch.Tensor):
            obj = _dense_tensor(obj, name, torch)
            if obj.ndim < 2:
                fail(f"{name} must be at least 2-D, got shape {tuple(obj.shape)}")
            if obj.dtype != torch.uint8 and obj.stride(-1) == 1:
                try:
                    obj = obj.view(torch.uint8)
                except RuntimeError as exc:  # e.g. a last dim whose byte size torch cannot reinterpret
                    fail(f"{name} cannot be viewed as bytes ({exc})")
    arr = as_array(obj, name)
    if arr.ndim < 2:
        fail(f"{name} must be at least 2-D, got shape {tuple(arr.shape)}")
    if arr.shape[0] == 0 or arr.size == 0:
        fail(f"{name} must not be empty, got shape {tuple(arr.shape)}")
    itemsize = arr.dtype.itemsize
    # Dims 1.. must form one contiguous run of bytes per row; dim 0 may have any (positive) stride.
    expected = itemsize
    for size, stride in zip(reversed(arr.shape[1:]), reversed(arr.strides[1:]), strict=True):
        if size > 1 and stride != expected:
            fail(f"{name} must be contiguous within each dim-0 row (strides {arr.strides}, shape {arr.shape})")
        expected *= size
    row_bytes = expected
    rows = arr.shape[0]
    row_stride = arr.strides[0] if rows > 1 else row_bytes
    if row_stride <= 0:
        fail(f"{name} must have a positive dim-0 stride, got {arr.strides[0]} bytes")
    xp = np if isinstance(arr, np.ndarray) else sys.modules["cupy"]
    flat = arr.reshape(rows, -1) if arr.ndim > 2 else arr
    if flat.dtype != np.uint8:
        flat = flat.view(np.uint8)
    if flat.shape != (rows, row_bytes):
        # a zero-copy strided reinterpretation: same memory, rows of row_bytes bytes, row_stride apart
        flat = xp.lib.stride_tricks.as_strided(flat, shape=(rows, row_bytes), strides=(row_stride, 1))
    return flat


def as_byte_span(obj: Any, name: str) -> Any:
    """A ``uint8 [span]`` view from the first byte of an array of any dtype and any non-negative strides to
    its last byte (the bytes between its elements included: they are inside the same allocation).

    This is how a strided KV view (one of K/V inside a combined cache, heads before tokens...) is read in
    place: a :class:`~kvcanary_cupy.KvByteLayout` addresses it by byte offsets from its first byte.
    """
    if not (isinstance(obj, np.ndarray) or is_cupy_array(obj)):
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(obj, torch.Tensor):
            obj = _dense_tensor(obj, name, torch)
            if obj.dtype != torch.uint8 and obj.ndim >= 1 and obj.stride(-1) == 1:
                try:
                    obj = obj.view(torch.uint8)
                except RuntimeError as exc:
                    fail(f"{name} cannot be viewed as bytes ({exc})")
    arr = as_array(obj, name)
    if arr.ndim < 1 or arr.size == 0:
        fail(f"{name} must not be empty, got shape {tuple(arr.shape)}")
    if any(s < 0 for s in arr.strides):
        fail(f"{name} has a negative stride {tuple(arr.strides)}; only non-negative strides are read in place")
    span = int(arr.dtype.itemsize) + sum((int(n) - 1) * int(s) for n, s in zip(arr.shape, arr.strides, strict=True))
    xp = np if isinstance(arr, np.ndarray) else sys.modules["cupy"]
    first = arr[(slice(0, 1),) * arr.ndim].reshape(1).view(np.uint8)  # the first element's bytes
    return xp.lib.stride_tricks.as_strided(first, shape=(span,), strides=(1,))


def export(arr: Any, to: Any) -> Any:
    """Hand ``arr`` (NumPy or CuPy) to a framework module that has ``from_dlpack`` (torch, cupy, numpy,
    ``jax.dlpack``); the result shares memory with ``arr``."""
    from_dlpack = getattr(to, "from_dlpack", None)
    if not callable(from_dlpack):
        fail(f"to={getattr(to, '__name__', to)!r} has no from_dlpack")
    if not (isinstance(arr, np.ndarray) or is_cupy_array(arr)):
        fail(f"arr must be a NumPy or CuPy array, got {type(arr).__name__}")
    try:
        return from_dlpack(arr)
    except Exception as exc:  # the consumer's refusal (device it cannot reach, dtype it lacks...)
        fail(f"arr cannot be handed to {getattr(to, '__name__', to)!r} through DLPack ({exc})")


def leaves(values: Iterable[Any]) -> Iterator[Any]:
    """Every leaf of launch arguments: dataclass fields (plans, contexts, real-KV sources) and sequences opened."""
    for value in values:
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            yield from leaves(getattr(value, f.name) for f in dataclasses.fields(value))
        elif isinstance(value, (tuple, list)):
            yield from leaves(value)
        else:
            yield value


def first_torch_cuda_tensor(values: Iterable[Any]) -> Any | None:
    """The first torch CUDA tensor among the leaves of ``values`` (torch is never imported here: a torch
    tensor can only exist if torch is loaded)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    return next((v for v in leaves(values) if isinstance(v, torch.Tensor) and v.is_cuda), None)


# One CuPy wrapper per (device, stream pointer): the streams an engine launches on (its compute stream, a
# graph-capture stream) are few and live as long as the process, and building a wrapper costs host time.
_CUPY_STREAMS: dict[tuple[int, int], Any] = {}


def cupy_stream_for(cupy: Any, device_index: int, pointer: int) -> Any:
    """A CuPy stream object for the external CUDA stream ``pointer`` on ``device_index``."""
    key = (device_index, pointer)
    stream = _CUPY_STREAMS.get(key)
    if stream is None:
        with warnings.catch_warnings():
            # CuPy 14 deprecates ExternalStream in favour of Stream.from_external, which needs an object
            # speaking the CUDA stream protocol; a raw pointer is what every torch version can give.
            warnings.simplefilter("ignore", DeprecationWarning)
            stream = _CUPY_STREAMS.setdefault(key, cupy.cuda.ExternalStream(pointer, device_index))
    return stream


def stream_scope(*values: Any) -> contextlib.AbstractContextManager:
    """The CuPy device and stream a launch must use.

    When an argument (or a field of a plan or context argument) is a torch CUDA tensor, kernels go to torch's
    current stream on that device, wrapped as a CuPy external stream: ordering with the engine's own kernels
    then holds without any synchronisation, and DLPack imports done inside the scope name that same stream, so
    the producer inserts no cross-stream wait. Otherwise CuPy's current stream is used unchanged.
    """
    tensor = first_torch_cuda_tensor(values)
    if tensor is None:
        return contextlib.nullcontext()
    cupy = cupy_module()
    if cupy is None:
        fail("a torch CUDA tensor was given but CuPy is not installed (install the cuda12 or cuda13 extra)")
    torch = sys.modules["torch"]
    index = tensor.device.index if tensor.device.index is not None else torch.cuda.current_device()
    pointer = int(torch.cuda.current_stream(tensor.device).cuda_stream)
    scope = contextlib.ExitStack()
    scope.enter_context(cupy.cuda.Device(index))
    scope.enter_context(cupy_stream_for(cupy, index, pointer))
    return scope


def device_scope(device: Device) -> contextlib.AbstractContextManager:
    """Make ``device`` CuPy's current device for a launch (kernels run where the arrays are, also when the
    caller's current device is another GPU); nothing to do for CPU arrays."""
    if device.kind != "cuda":
        return contextlib.nullcontext()
    return sys.modules["cupy"].cuda.Device(device.index)
