"""The plan step: turn one batch into the flat list of slots to verify and the per-request write offsets.

Owns the plan data model (:class:`VerifyPlan`, :class:`WritePlan`, SPEC §3.2) and the public entry point
:func:`launch_canary_plan_kernels`, which validates every host-visible fact once and hands a normalized
:class:`PlanLaunch` to the selected backend (``numpy`` reference, ``cuda`` kernels, ``host`` kernels).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from ._errors import fail
from ._limits import check_allocation
from ._validate import array_arg, check_memory, int_arg, optional_array_arg, same_device
from .backends import resolve_backend
from .constants import MAX_PLAN_BATCH_SIZE
from .dlpack import Device, DLPackArray, device_scope, stream_scope
from .layouts import PagedSlots, SlotLayout, layout_arrays, prepare_layout

OnInvalid = Literal["raise", "flag"]
_INT32_MIN, _INT32_MAX = -(1 << 31), (1 << 31) - 1


def _allocate(device: Any, shape: int | tuple[int, ...], dtype: Any, fill: int | None = None, *,
              name: str = "the requested size") -> Any:
    """One plan array on ``device`` ("cpu" -> NumPy, "cuda"/"cuda:N" -> CuPy). ``name``: the argument whose
    value sized the array, named when the memory cannot be had."""
    dev = str(device)
    xp: Any = np
    index = ""
    if dev == "cpu":
        pass
    elif dev == "cuda" or dev.startswith("cuda:"):
        from .dlpack import cupy_module

        xp = cupy_module()
        if xp is None:
            fail(f"device={dev!r} needs CuPy (install the cuda12 or cuda13 extra)")
        index = dev.split(":")[1] if ":" in dev else ""
        if index and not index.isdigit():
            fail(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    else:
        fail(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    try:
        if xp is np:
            return np.full(shape, fill, dtype) if fill is not None else np.empty(shape, dtype)
        with xp.cuda.Device(int(index) if index else None):
            arr = xp.full(shape, fill, dtype) if fill is not None else xp.empty(shape, dtype)
            if fill is not None:
                # The fill ran on CuPy's current stream; a first launch on another stream (torch's) must see
                # it. Allocation is setup-time work, never inside a captured region, so waiting is harmless.
                xp.cuda.get_current_stream().synchronize()
            return arr
    except (MemoryError, ValueError) as exc:  # sizes beyond what the device (or NumPy) can hold
        fail(f"{name} asks for {allocation_nbytes(shape, dtype)} bytes ({shape} x {np.dtype(dtype).name}), which "
             f"cannot be allocated on device={dev!r} ({type(exc).__name__}: {exc})")
    except Exception as exc:  # CuPy installed but no usable GPU or driver (CUDARuntimeError...)
        fail(f"device={dev!r} is not usable here ({type(exc).__name__}: {exc})")


def allocation_nbytes(shape: int | tuple[int, ...], dtype: Any) -> int:
    """Bytes an array of ``shape`` and ``dtype`` takes (Python ints: no overflow whatever the sizes)."""
    count = 1
    for extent in (shape,) if isinstance(shape, int) else shape:
        count *= int(extent)
    return count * np.dtype(dtype).itemsize


@dataclass(frozen=True)
class VerifyPlan:
    """Flat verify entries, sized once to ``verify_capacity`` and refilled by every plan launch.

    Fields (SGLang's names, shapes and dtypes, plus ``status``):
        verify_slot_indices: int64 [C] — slot to verify (SWA-translated).
        verify_expected_tokens: int64 [C] — expected token or -1 (no check).
        verify_expected_positions: int64 [C] — logical position the slot must hold.
        verify_prev_slot_indices: int64 [C] — predecessor slot, -1 for a chain head, 0 = unreachable.
        verify_num_valid: int32 [1] — ``min(total, C)``.
        enable: int32 [1] — 1, or 0 when the batch overflowed ``C`` (allocated as 1).
        status: int32 [1] — :class:`~kvcanary_cupy.constants.PlanStatus` bits of the last plan launch.
    The fields hold whatever arrays they were built from (NumPy, CuPy, torch...); launchers view them
    through DLPack on every call, so the memory stays the owner's.
    """

    verify_slot_indices: Any
    verify_expected_tokens: Any
    verify_expected_positions: Any
    verify_prev_slot_indices: Any
    verify_num_valid: Any
    enable: Any
    status: Any

    @classmethod
    def allocate(cls, *, verify_capacity: int, device: Any = "cpu",
                 max_allocation_bytes: int | None = None) -> VerifyPlan:
        """Plan arrays on ``device``; refused above the allocation limit (see :mod:`kvcanary_cupy._limits`)."""
        capacity = int_arg(verify_capacity, "verify_capacity")
        if capacity <= 0:
            fail(f"VerifyPlan verify_capacity must be positive, got {capacity}")
        if capacity > _INT32_MAX:  # verify_num_valid is int32
            fail(f"VerifyPlan verify_capacity must be <= {_INT32_MAX}, got {capacity}")
        check_allocation(cls.allocation_bytes(capacity), argument=f"verify_capacity={capacity}",
                         what="VerifyPlan.allocate", device=device, max_allocation_bytes=max_allocation_bytes)
        return cls(
            verify_slot_indices=_allocate(device, capacity, np.int64, name="verify_capacity"),
            verify_expected_tokens=_allocate(device, capacity, np.int64, name="verify_capacity"),
            verify_expected_positions=_allocate(device, capacity, np.int64, name="verify_capacity"),
            verify_prev_slot_indices=_allocate(device, capacity, np.int64, name="verify_capacity"),
            verify_num_valid=_allocate(device, 1, np.int32),
            enable=_allocate(device, 1, np.int32, fill=1),
            status=_allocate(device, 1, np.int32, fill=0),
        )

    @staticmethod
    def allocation_bytes(verify_capacity: int) -> int:
        """Bytes :meth:`allocate` takes for ``verify_capacity`` entries."""
        return 4 * 8 * int(verify_capacity) + 3 * 4

    @classmethod
    def from_tensors(cls, **fields: Any) -> VerifyPlan:
        """Wrap caller-owned arrays (any DLPack producer). ``status`` may be omitted: a 1-element int32
        array is then allocated next to ``verify_num_valid`` (same framework when it is a NumPy array)."""
        _known_fields(cls, fields)
        if fields.get("status") is None:
            fields["status"] = _status_like(fields.get("verify_num_valid"))
        return cls(**fields)


@dataclass(frozen=True)
class WritePlan:
    """Per-request write metadata, sized once to ``write_req_capacity`` (W).

    Fields:
        write_offsets: int64 [W+1] — exclusive prefix sum of per-request write counts; ``[bs]`` is the
            total and ``(bs, W]`` is zeroed on every launch.
        write_seed_slot_indices: int64 [W] — chain seed slot per request (SWA-translated) or -1.
        write_num_valid_reqs: int32 [1] — ``bs`` (padding rows included).
        verify_offsets: int64 [W+1] — scratch: exclusive prefix sum of per-request verify counts, which
            the plan's entries kernel searches. Kept here because W bounds the batch size, so a plan
            launch allocates nothing and can be captured in a CUDA graph.
    """

    write_offsets: Any
    write_seed_slot_indices: Any
    write_num_valid_reqs: Any
    verify_offsets: Any

    @classmethod
    def allocate(cls, *, write_req_capacity: int, device: Any = "cpu",
                 max_allocation_bytes: int | None = None) -> WritePlan:
        """Plan arrays on ``device``; refused above the allocation limit (see :mod:`kvcanary_cupy._limits`)."""
        capacity = int_arg(write_req_capacity, "write_req_capacity")
        if capacity <= 0:
            fail(f"WritePlan write_req_capacity must be positive, got {capacity}")
        check_allocation(cls.allocation_bytes(capacity), argument=f"write_req_capacity={capacity}",
                         what="WritePlan.allocate", device=device, max_allocation_bytes=max_allocation_bytes)
        return cls._allocate(capacity, device, sized_by="write_req_capacity")

    @classmethod
    def _allocate(cls, capacity: int, device: Any, *, sized_by: str) -> WritePlan:
        """The arrays of :meth:`allocate`; ``sized_by`` is the caller's name for the capacity."""
        return cls(
            write_offsets=_allocate(device, capacity + 1, np.int64, name=sized_by),
            write_seed_slot_indices=_allocate(device, capacity, np.int64, name=sized_by),
            write_num_valid_reqs=_allocate(device, 1, np.int32),
            verify_offsets=_allocate(device, capacity + 1, np.int64, name=sized_by),
        )

    @staticmethod
    def allocation_bytes(write_req_capacity: int) -> int:
        """Bytes :meth:`allocate` takes for ``write_req_capacity`` requests."""
        return 8 * (int(write_req_capacity) + 1) * 2 + 8 * int(write_req_capacity) + 4

    @classmethod
    def from_tensors(cls, **fields: Any) -> WritePlan:
        """Wrap caller-owned arrays. ``verify_offsets`` may be omitted: it is then allocated like
        ``write_offsets`` (same framework when that is a NumPy array)."""
        _known_fields(cls, fields)
        if fields.get("verify_offsets") is None:
            fields["verify_offsets"] = _scratch_like(fields.get("write_offsets"))
        return cls(**fields)


def _known_fields(cls: type, fields: dict[str, Any]) -> None:
    """Unknown or missing field names are argument errors, not dataclass TypeErrors."""
    names = [f.name for f in dataclasses.fields(cls)]
    optional = {"status", "verify_offsets"}
    unknown = sorted(set(fields) - set(names))
    if unknown:
        fail(f"{cls.__name__}.from_tensors got unknown field(s) {', '.join(unknown)}; fields: {', '.join(names)}")
    missing = [n for n in names if n not in fields and n not in optional]
    if missing:
        fail(f"{cls.__name__}.from_tensors is missing field(s) {', '.join(missing)}")


def _status_like(template: Any) -> Any:
    return _like(template, 1, np.int32, "verify_num_valid")


def _scratch_like(template: Any) -> Any:
    if template is None:
        fail("write_offsets is required")
    from .dlpack import as_array

    length = as_array(template, "write_offsets").shape
    if len(length) != 1:
        fail(f"write_offsets must be 1-D, got shape {tuple(length)}")
    return _like(template, int(length[0]), np.int64, "write_offsets")


def _like(template: Any, length: int, dtype: type, name: str) -> Any:
    """A zeroed array of ``length`` on the same device and framework as ``template``."""
    if template is None:
        fail(f"{name} is required")
    if isinstance(template, np.ndarray):
        return np.zeros(length, dtype)
    torch = _loaded("torch")
    if torch is not None and isinstance(template, torch.Tensor):
        return torch.zeros(length, dtype=getattr(torch, np.dtype(dtype).name), device=template.device)
    from .dlpack import as_array, device_of

    dev = device_of(as_array(template, name))
    return _allocate("cpu" if dev.kind == "cpu" else f"cuda:{dev.index}", length, dtype, fill=0)


def _loaded(module: str) -> Any:
    import sys

    return sys.modules.get(module)


@dataclass(frozen=True)
class PlanLaunch:
    """Validated, normalized plan arguments: every array a NumPy or CuPy view, every scalar a Python int.

    ``req_pool_indices`` is None when the layout reads batch rows directly (every row active, expected-token
    pool row = batch row). Exactly one of ``req_to_token`` (the token table) and ``paged`` is set.
    """

    req_pool_indices: Any | None
    prefix_lens: Any
    extend_seq_lens: Any
    req_to_token: Any | None
    paged: PagedSlots | None
    full_to_swa_index_mapping: Any | None
    req_to_verify_expected_tokens: Any | None
    req_to_verify_expected_tokens_valid_lens: Any | None
    swa_window_size: int
    kv_token_id_vs_position_offset: int
    verify_capacity: int
    write_req_capacity: int
    verify: VerifyPlan
    write: WritePlan
    device: Device
    prefix_name: str = "prefix_lens"  # what the caller called prefix_lens (messages name it)

    @property
    def bs(self) -> int:
        return int(self.prefix_lens.shape[0])


def prepare_plan_launch(
    *,
    verify_plan_out: VerifyPlan,
    write_plan_out: WritePlan,
    req_pool_indices: Any | None = None,
    prefix_lens: Any,
    extend_seq_lens: Any,
    req_to_token: Any | None = None,
    swa_window_size: int,
    full_to_swa_index_mapping: Any | None,
    verify_capacity: int,
    req_to_verify_expected_tokens: Any | None,
    req_to_verify_expected_tokens_valid_lens: Any | None,
    kv_token_id_vs_position_offset: int,
    function: str,
    layout: SlotLayout | None = None,
    prefix_name: str = "prefix_lens",
) -> PlanLaunch:
    """Every host-visible check of a plan launch (SPEC §0, §3.4), in one place for all backends.

    ``prefix_name``: the name the caller gave ``prefix_lens`` (``received_lens`` for a received-prefix verify),
    used in every message about it."""
    if not isinstance(verify_plan_out, VerifyPlan):
        fail(f"verify_plan_out must be a VerifyPlan, got {type(verify_plan_out).__name__}")
    if not isinstance(write_plan_out, WritePlan):
        fail(f"write_plan_out must be a WritePlan, got {type(write_plan_out).__name__}")
    window = int_arg(swa_window_size, "swa_window_size", minimum=0)
    offset = int_arg(kv_token_id_vs_position_offset, "kv_token_id_vs_position_offset",
                     minimum=_INT32_MIN, maximum=_INT32_MAX)
    capacity = int_arg(verify_capacity, "verify_capacity", minimum=1, maximum=_INT32_MAX)
    if window > 0 and full_to_swa_index_mapping is None:
        fail(f"swa_window_size={window} needs full_to_swa_index_mapping (the full-to-SWA slot LUT)")
    if req_to_verify_expected_tokens is not None and req_to_verify_expected_tokens_valid_lens is None:
        fail(f"{function} requires req_to_verify_expected_tokens_valid_lens when "
             "req_to_verify_expected_tokens is set")

    rpi = optional_array_arg(req_pool_indices, "req_pool_indices", dtype=np.int64, ndim=1)
    prefix = array_arg(prefix_lens, prefix_name, dtype=np.int64, ndim=1)
    bs = int((prefix if rpi is None else rpi).shape[0])
    if bs > MAX_PLAN_BATCH_SIZE:
        fail(f"the batch holds {bs} requests; one plan launch supports at most {MAX_PLAN_BATCH_SIZE}")
    if prefix.shape[0] != bs:
        fail(f"{prefix_name} must have shape ({bs},), got {tuple(prefix.shape)} (axis 0)")
    extend = array_arg(extend_seq_lens, "extend_seq_lens", dtype=np.int64, ndim=1, shape=(bs,))
    layout_kind, layout_value, layout_named = prepare_layout(req_to_token=req_to_token, layout=layout, bs=bs,
                                                      has_req_pool_indices=rpi is not None)
    lut = optional_array_arg(full_to_swa_index_mapping, "full_to_swa_index_mapping", dtype=np.int64, ndim=1)
    if lut is not None and lut.shape[0] == 0:
        fail("full_to_swa_index_mapping must not be empty")
    pool = optional_array_arg(req_to_verify_expected_tokens, "req_to_verify_expected_tokens",
                              dtype=np.int32, ndim=2)
    valid_lens = optional_array_arg(req_to_verify_expected_tokens_valid_lens,
                                    "req_to_verify_expected_tokens_valid_lens",
                                    dtype=np.int64, ndim=1, shape=(bs,))

    vp = verify_plan_out
    slots = array_arg(vp.verify_slot_indices, "verify_plan_out.verify_slot_indices",
                      dtype=np.int64, ndim=1, writable=True)
    if slots.shape[0] != capacity:
        fail(f"verify_capacity={capacity} must equal verify_plan_out.verify_slot_indices.shape[0]="
             f"{slots.shape[0]}")
    entry: dict[str, Any] = {"dtype": np.int64, "ndim": 1, "shape": (capacity,), "writable": True}
    one: dict[str, Any] = {"dtype": np.int32, "ndim": 1, "shape": (1,), "writable": True}
    verify = VerifyPlan(
        verify_slot_indices=slots,
        verify_expected_tokens=array_arg(vp.verify_expected_tokens, "verify_plan_out.verify_expected_tokens",
                                         **entry),
        verify_expected_positions=array_arg(vp.verify_expected_positions,
                                            "verify_plan_out.verify_expected_positions", **entry),
        verify_prev_slot_indices=array_arg(vp.verify_prev_slot_indices,
                                           "verify_plan_out.verify_prev_slot_indices", **entry),
        verify_num_valid=array_arg(vp.verify_num_valid, "verify_plan_out.verify_num_valid", **one),
        enable=array_arg(vp.enable, "verify_plan_out.enable", **one),
        status=array_arg(vp.status, "verify_plan_out.status", **one),
    )

    wp = write_plan_out
    offsets = array_arg(wp.write_offsets, "write_plan_out.write_offsets", dtype=np.int64, ndim=1,
                        writable=True)
    w_cap = int(offsets.shape[0]) - 1
    if w_cap <= 0:
        fail(f"write_plan_out.write_offsets must hold write_req_capacity + 1 >= 2 entries, got {w_cap + 1}")
    write = WritePlan(
        write_offsets=offsets,
        write_seed_slot_indices=array_arg(wp.write_seed_slot_indices, "write_plan_out.write_seed_slot_indices",
                                          dtype=np.int64, ndim=1, shape=(w_cap,), writable=True),
        write_num_valid_reqs=array_arg(wp.write_num_valid_reqs, "write_plan_out.write_num_valid_reqs", **one),
        verify_offsets=array_arg(wp.verify_offsets, "write_plan_out.verify_offsets", dtype=np.int64, ndim=1,
                                 shape=(w_cap + 1,), writable=True),
    )
    if bs > w_cap:
        fail(f"the batch holds {bs} requests but write_plan_out has write_req_capacity {w_cap}")

    named = [
        ("req_pool_indices", rpi), (prefix_name, prefix), ("extend_seq_lens", extend),
        *layout_named, ("full_to_swa_index_mapping", lut),
        ("req_to_verify_expected_tokens", pool),
        ("req_to_verify_expected_tokens_valid_lens", valid_lens),
    ]
    named += [(f"verify_plan_out.{f.name}", getattr(verify, f.name)) for f in dataclasses.fields(verify)]
    named += [(f"write_plan_out.{f.name}", getattr(write, f.name)) for f in dataclasses.fields(write)]
    device = same_device(named)
    is_output = [name.startswith(("verify_plan_out.", "write_plan_out.")) for name, _ in named]
    check_memory(outputs=[a for a, out in zip(named, is_output, strict=True) if out],
                 inputs=[a for a, out in zip(named, is_output, strict=True) if not out])
    return PlanLaunch(
        req_pool_indices=rpi, prefix_lens=prefix, extend_seq_lens=extend,
        req_to_token=layout_value if layout_kind == "token" else None,
        paged=layout_value if layout_kind == "paged" else None,
        full_to_swa_index_mapping=lut, req_to_verify_expected_tokens=pool,
        req_to_verify_expected_tokens_valid_lens=valid_lens, swa_window_size=window,
        kv_token_id_vs_position_offset=offset, verify_capacity=capacity, write_req_capacity=w_cap,
        verify=verify, write=write, device=device, prefix_name=prefix_name,
    )


def launch_canary_plan_kernels(
    *,
    verify_plan_out: VerifyPlan,
    write_plan_out: WritePlan,
    req_pool_indices: DLPackArray | None = None,
    prefix_lens: DLPackArray,
    extend_seq_lens: DLPackArray,
    req_to_token: DLPackArray | None = None,
    swa_window_size: int,
    full_to_swa_index_mapping: DLPackArray | None,
    verify_capacity: int,
    req_to_verify_expected_tokens: DLPackArray | None = None,
    req_to_verify_expected_tokens_valid_lens: DLPackArray | None = None,
    kv_token_id_vs_position_offset: int = 0,
    layout: SlotLayout | None = None,
    backend: str = "auto",
    on_invalid: OnInvalid | None = None,
) -> None:
    """Fill ``verify_plan_out`` and ``write_plan_out`` for one batch (SPEC §3.3), in place.

    ``backend``: "auto" (NumPy reference for CPU arrays, CUDA kernels for CUDA arrays), "numpy", "cuda"
    or "host" (the CUDA kernels compiled for the CPU). ``on_invalid`` only concerns device values such as
    a request row outside ``req_to_token``: the NumPy reference raises ValueError by default ("raise") and
    can instead flag them exactly like the kernels ("flag": bits in ``verify_plan_out.status`` and
    neutralised entries); the kernel backends always flag, since they cannot raise without a host sync.

    The slots come from exactly one of ``req_to_token`` (SGLang's token table) or ``layout`` (a
    :class:`~kvcanary_cupy.layouts.TokenTable`, :class:`~kvcanary_cupy.layouts.BlockTable` or
    :class:`~kvcanary_cupy.layouts.PageList`). ``req_pool_indices`` may be None only when the layout reads
    batch rows directly (``BlockTable(batch_rows=True)``, ``PageList``): every row is then active and reads
    expected-token pool row ``r``.
    """
    with stream_scope(verify_plan_out, write_plan_out, req_pool_indices, prefix_lens, extend_seq_lens,
                      *layout_arrays(req_to_token, layout), full_to_swa_index_mapping,
                      req_to_verify_expected_tokens, req_to_verify_expected_tokens_valid_lens):
        launch = prepare_plan_launch(
            verify_plan_out=verify_plan_out, write_plan_out=write_plan_out, req_pool_indices=req_pool_indices,
            prefix_lens=prefix_lens, extend_seq_lens=extend_seq_lens, req_to_token=req_to_token,
            swa_window_size=swa_window_size, full_to_swa_index_mapping=full_to_swa_index_mapping,
            verify_capacity=verify_capacity, req_to_verify_expected_tokens=req_to_verify_expected_tokens,
            req_to_verify_expected_tokens_valid_lens=req_to_verify_expected_tokens_valid_lens,
            kv_token_id_vs_position_offset=kv_token_id_vs_position_offset,
            function="launch_canary_plan_kernels", layout=layout,
        )
        impl = resolve_backend(backend, launch.device, on_invalid)
        with device_scope(launch.device):
            impl.plan(launch)
