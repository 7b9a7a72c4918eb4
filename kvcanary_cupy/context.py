"""The launch context shared by verify and write: canary buffer, violation ring, counters, real-KV sources.

:class:`RealKvSource` validates its layout at construction (SPEC §1.6) so that every real-KV access is an
aligned load inside the tensor: 128-bit for a contiguous source, an element's own width at least for a strided
one (:class:`~kvcanary_cupy.KvByteLayout`). :class:`VerifyOrWriteContext` mirrors SGLang's context and adds
``status`` (int32 [1], :class:`~kvcanary_cupy.constants.CanaryStatus`), where the kernels report device values
they refused to follow. :func:`prepare_context` is the one place where a context is checked and viewed as
NumPy/CuPy arrays for a launch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ._errors import fail
from ._limits import check_allocation
from ._validate import (
    StorageGuard,
    array_arg,
    bool_arg,
    check_memory,
    data_pointer,
    int_arg,
    storage_guards,
)
from .constants import (
    CANARY_FIELDS_PER_SLOT,
    CANARY_SLOT_BYTES,
    MAX_REAL_KV_SOURCES,
    REAL_KV_ALIGN_BYTES,
    VIOLATION_FIELDS,
    CanaryLaunchTag,
    RealKvHashMode,
)
from .dlpack import as_byte_rows, as_byte_span, device_of
from .hashing import RealKvBytes
from .kv_bytes import KvByteLayout, contiguous_layout
from .plan import _allocate


@dataclass(frozen=True)
class RealKvSource:
    """Real KV bytes fingerprinted into each slot's ``real_kv_hash``.

    Without ``layout``, the bytes of canary slot ``s`` are, with the tensor viewed as ``uint8 [rows,
    row_bytes]`` (dims after 0 contiguous, dim 0 of any stride, e.g. one layer of a per-layer pool): row
    ``s // page_size``, columns ``(s % page_size) * num_bytes_per_token`` onward; the leading ``read_bytes``
    of them are hashed (16 in PARTIAL mode). ``tensor`` may be any DLPack producer of any dtype (torch
    bfloat16 is viewed as bytes).

    With ``layout`` (a :class:`~kvcanary_cupy.KvByteLayout`), slot ``s``'s bytes are the layout's logical
    stream (heads, then elements, at byte strides from the tensor's first byte; the tensor may have any
    non-negative strides and is read in place), ``num_bytes_per_token`` must equal its length, and its
    leading ``read_bytes`` are hashed the same way: a layout describing the contiguous case hashes the same.

    The byte view is taken once, here, and the source holds ``tensor``; a torch tensor whose storage later
    moves or shrinks (an engine growing its pool with ``resize_``) is refused at the next launch instead of
    being read through a stale view: build a new source after reallocating.
    """

    tensor: Any
    page_size: int
    num_bytes_per_token: int
    read_bytes: int
    layout: KvByteLayout | None = field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        page = int_arg(self.page_size, "RealKvSource.page_size")
        per_token = int_arg(self.num_bytes_per_token, "RealKvSource.num_bytes_per_token")
        read = int_arg(self.read_bytes, "RealKvSource.read_bytes")
        if page < 1:
            fail(f"RealKvSource.page_size must be >= 1, got {page}")
        if per_token <= 0 or per_token % REAL_KV_ALIGN_BYTES:
            fail(f"RealKvSource.num_bytes_per_token must be a positive multiple of 16, got {per_token}")
        if read <= 0 or read > per_token or read % REAL_KV_ALIGN_BYTES:
            fail(f"RealKvSource.read_bytes must be a positive multiple of 16 in (0, num_bytes_per_token="
                 f"{per_token}], got {read}")
        if self.layout is None:
            rows = as_byte_rows(self.tensor, "RealKvSource.tensor")
            row_stride = int(rows.strides[0]) if rows.shape[0] > 1 else int(rows.shape[1])
            if row_stride % REAL_KV_ALIGN_BYTES:
                fail(f"RealKvSource.tensor row stride must be a multiple of 16 bytes, got {row_stride}")
            if rows.shape[1] < page * per_token:
                fail(f"RealKvSource.tensor rows hold {rows.shape[1]} bytes, fewer than page_size * "
                     f"num_bytes_per_token = {page * per_token}")
            covered = int(rows.shape[0]) * page
        else:
            layout = self.layout
            if not isinstance(layout, KvByteLayout):
                fail(f"RealKvSource.layout must be a KvByteLayout or None, got {type(layout).__name__}")
            if per_token != layout.bytes_per_token:
                fail(f"RealKvSource.num_bytes_per_token must equal the layout's num_heads * elements_per_head * "
                     f"element_bytes = {layout.bytes_per_token}, got {per_token}")
            span = as_byte_span(self.tensor, "RealKvSource.tensor")
            layout.check_extent(int(span.shape[0]), "RealKvSource.tensor", "RealKvSource.layout")
            covered = layout.slots_covered(page, int(span.shape[0]))
            if covered == 0:
                fail(f"RealKvSource.layout addresses bytes beyond RealKvSource.tensor ({span.shape[0]} bytes from "
                     f"its first) already for slot 0 (last byte of a token at offset {layout.last_byte_in_token()})")
            rows = span.reshape(1, -1)
        if data_pointer(rows) % REAL_KV_ALIGN_BYTES:
            fail("RealKvSource.tensor must start at a 16-byte aligned address")
        object.__setattr__(self, "_rows", rows)
        object.__setattr__(self, "_covered", covered)
        object.__setattr__(self, "_guards", storage_guards([("RealKvSource.tensor", self.tensor)]))
        object.__setattr__(self, "_owner_guards", ())  # a preset's: the engine tensor ``tensor`` is a view of
        object.__setattr__(self, "_view", self._make_view())  # once: every launch reads it

    @property
    def byte_rows(self) -> Any:
        """The validated ``uint8 [rows, row_bytes]`` NumPy/CuPy view of the tensor; with a layout, one row
        holding every byte from the tensor's first to its last."""
        return self._rows  # type: ignore[attr-defined]

    def check_storage(self) -> None:
        """Refuse (ValueError) when the wrapped torch tensor's storage moved or shrank since construction (or the
        engine tensor it is a view of, for a source a preset built: :attr:`owner_guards`)."""
        for guard in self.owner_guards + self._guards:  # type: ignore[attr-defined]
            guard.check()

    @property
    def owner_guards(self) -> tuple[StorageGuard, ...]:
        """The storage checks of the engine tensors ``tensor`` is a view of (a preset's whole KV cache, whose K or
        V half this source reads), checked before the view's own: bound launches take them too."""
        return self._owner_guards  # type: ignore[attr-defined]

    @property
    def slots_covered(self) -> int:
        """How many leading canary slots have all their bytes inside the tensor."""
        return int(self._covered)  # type: ignore[attr-defined]

    def view(self) -> RealKvBytes:
        """What the hash reads: the byte view, page size, bytes per token, read bytes and resolved layout
        (a contiguous source gets the layout of its rows, so every backend walks one descriptor)."""
        return self._view  # type: ignore[attr-defined]

    def _make_view(self) -> RealKvBytes:
        rows = self.byte_rows
        layout = self.layout
        if layout is None:
            stride = int(rows.strides[0]) if rows.shape[0] > 1 else int(rows.shape[1])
            layout = contiguous_layout(stride, int(self.num_bytes_per_token))
        return RealKvBytes(rows, int(self.page_size), int(self.num_bytes_per_token), int(self.read_bytes), layout,
                           self.layout is None)


def also_guarding(source: RealKvSource, named: list[tuple[str, Any]]) -> RealKvSource:
    """``source``, refusing its launches also when one of the torch tensors ``named`` (``(name, tensor)``) moves
    or shrinks: a source built over a view of an engine's tensor (K or V of a combined cache) holds the view,
    whose storage stays the one it was taken from when the engine re-points the tensor itself (``set_``)."""
    object.__setattr__(source, "_owner_guards", source.owner_guards + storage_guards(named))
    return source


@dataclass(frozen=True)
class VerifyOrWriteContext:
    """Everything a verify or write launch reads and writes besides its plan.

    Fields (SGLang's names): ``canary_buf`` uint8 [num_slots, stride >= 32]; ``kernel_kind`` the
    :class:`CanaryLaunchTag` stamped into violation rows; ``violation_ring`` int64 [capacity, 8];
    ``violation_write_index`` int32 [1]; ``slot_run_counter`` and ``kernel_run_counter`` int64 [1];
    ``real_kv_sources`` (at most 4); ``real_kv_hash_mode``; ``enable_chain_position_assert`` int32 [1]
    (device flag read at run time); plus ``status`` int32 [1].
    """

    canary_buf: Any
    kernel_kind: int
    violation_ring: Any
    violation_write_index: Any
    slot_run_counter: Any
    kernel_run_counter: Any
    real_kv_sources: tuple[RealKvSource, ...] = ()
    real_kv_hash_mode: RealKvHashMode = RealKvHashMode.NONE
    enable_chain_position_assert: Any = None
    status: Any = None

    @classmethod
    def allocate(
        cls,
        *,
        num_slots: int,
        ring_capacity: int = 1024,
        kernel_kind: int = CanaryLaunchTag.HEAD_K_FULL,
        real_kv_sources: tuple[RealKvSource, ...] = (),
        real_kv_hash_mode: RealKvHashMode = RealKvHashMode.NONE,
        slot_stride_bytes: int = CANARY_SLOT_BYTES,
        enable_chain_position_assert: bool = False,
        device: Any = "cpu",
        max_allocation_bytes: int | None = None,
    ) -> VerifyOrWriteContext:
        """A zeroed canary buffer with its own ring, counters and flags on ``device`` ("cpu" or "cuda[:N]").
        Endpoints that share the ring take this one through :meth:`for_endpoint`. Refused, before anything is
        allocated, when the total exceeds the allocation limit (see :mod:`kvcanary_cupy._limits`)."""
        slots = int_arg(num_slots, "num_slots", minimum=1)
        capacity = int_arg(ring_capacity, "ring_capacity", minimum=1)
        stride = int_arg(slot_stride_bytes, "slot_stride_bytes", minimum=CANARY_SLOT_BYTES)
        if stride % 8:
            fail(f"slot_stride_bytes must be a multiple of 8, got {stride}")
        kind = int_arg(kernel_kind, "kernel_kind")
        mode = real_kv_mode_arg(real_kv_hash_mode, "real_kv_hash_mode")
        sources = real_kv_sources_arg(real_kv_sources, "real_kv_sources")
        chain_assert = bool_arg(enable_chain_position_assert, "enable_chain_position_assert")
        check_context_allocation(slots, capacity, stride, device=device, max_allocation_bytes=max_allocation_bytes)
        return cls(
            canary_buf=_allocate(device, slots * stride, np.uint8, fill=0,
                                 name="num_slots x slot_stride_bytes").reshape(slots, stride),
            kernel_kind=kind,
            violation_ring=_allocate(device, capacity * VIOLATION_FIELDS, np.int64, fill=0,
                                     name="ring_capacity").reshape(
                capacity, VIOLATION_FIELDS),
            violation_write_index=_allocate(device, 1, np.int32, fill=0),
            slot_run_counter=_allocate(device, 1, np.int64, fill=0),
            kernel_run_counter=_allocate(device, 1, np.int64, fill=0),
            real_kv_sources=sources,
            real_kv_hash_mode=mode,
            enable_chain_position_assert=_allocate(device, 1, np.int32, fill=int(chain_assert)),
            status=_allocate(device, 1, np.int32, fill=0),
        )

    def for_endpoint(self, **changes: Any) -> VerifyOrWriteContext:
        """A context sharing this one's ring, write index and status, with some fields replaced (e.g.
        ``kernel_kind``, ``canary_buf``, ``real_kv_sources``, or fresh per-endpoint counters). Arrays are
        checked when a launch uses them; names and the scalar fields are checked here."""
        names = [f.name for f in dataclasses.fields(self)]
        unknown = sorted(set(changes) - set(names))
        if unknown:
            fail(f"for_endpoint got unknown field(s) {', '.join(unknown)}; fields: {', '.join(names)}")
        if "kernel_kind" in changes:
            changes["kernel_kind"] = int_arg(changes["kernel_kind"], "kernel_kind")
        if "real_kv_hash_mode" in changes:
            changes["real_kv_hash_mode"] = real_kv_mode_arg(changes["real_kv_hash_mode"], "real_kv_hash_mode")
        if "real_kv_sources" in changes:
            changes["real_kv_sources"] = real_kv_sources_arg(changes["real_kv_sources"], "real_kv_sources")
        return dataclasses.replace(self, **changes)


def context_allocation_bytes(num_slots: int, ring_capacity: int, slot_stride_bytes: int) -> int:
    """Bytes :meth:`VerifyOrWriteContext.allocate` takes: the canary buffer, the ring and five 1-element words."""
    return num_slots * slot_stride_bytes + ring_capacity * VIOLATION_FIELDS * 8 + 3 * 4 + 2 * 8


def check_context_allocation(num_slots: int, ring_capacity: int, slot_stride_bytes: int, *, device: Any,
                             max_allocation_bytes: int | None = None) -> None:
    """Refuse a context above the allocation limit, naming the argument behind the larger buffer."""
    canary = num_slots * slot_stride_bytes
    ring = ring_capacity * VIOLATION_FIELDS * 8
    if ring > canary:
        argument = f"ring_capacity={ring_capacity}"
    elif slot_stride_bytes > CANARY_SLOT_BYTES:  # a stride beyond the record: name it first
        argument = f"slot_stride_bytes={slot_stride_bytes} (x num_slots={num_slots})"
    else:
        argument = f"num_slots={num_slots} (x slot_stride_bytes={slot_stride_bytes})"
    check_allocation(context_allocation_bytes(num_slots, ring_capacity, slot_stride_bytes), argument=argument,
                     what="VerifyOrWriteContext.allocate", device=device, max_allocation_bytes=max_allocation_bytes)


def real_kv_mode_arg(value: Any, name: str) -> RealKvHashMode:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        fail(f"{name} must be a RealKvHashMode, got {value!r}")
    try:
        return RealKvHashMode(int(value))
    except ValueError:
        fail(f"{name} must be a RealKvHashMode ({', '.join(m.name for m in RealKvHashMode)}), got {value!r}")


def real_kv_sources_arg(value: Any, name: str) -> tuple[RealKvSource, ...]:
    if not isinstance(value, (tuple, list)):
        fail(f"{name} must be a tuple of RealKvSource, got {type(value).__name__}")
    if len(value) > MAX_REAL_KV_SOURCES:
        fail(f"{name}: at most {MAX_REAL_KV_SOURCES} RealKvSource entries are supported, got {len(value)}")
    for k, source in enumerate(value):
        if not isinstance(source, RealKvSource):
            fail(f"{name}[{k}] must be a RealKvSource, got {type(source).__name__}")
    return tuple(value)


@dataclass(frozen=True)
class ContextArrays:
    """A validated context: NumPy/CuPy views, sources as byte rows, plain-int scalars."""

    canary: Any  # int64 [num_slots, stride // 8] view of canary_buf
    canary_bytes: Any  # the uint8 [num_slots, stride] array itself
    kernel_kind: int
    ring: Any
    write_index: Any
    slot_run_counter: Any
    kernel_run_counter: Any
    sources: tuple[RealKvBytes, ...]  # each source's byte view, sizes and resolved layout
    mode: int
    chain_assert: Any
    status: Any
    # (name, array) of canary_buf, ring, write index, counters, status, chain flag, real-KV byte rows
    named: tuple[tuple[str, Any], ...] = ()

    @property
    def num_slots(self) -> int:
        return int(self.canary_bytes.shape[0])


def prepare_context(context: Any, name: str = "context", *, need_chain_flag: bool) -> ContextArrays:
    """Check a context's host-visible facts and view its arrays; raises before anything is written."""
    if not isinstance(context, VerifyOrWriteContext):
        fail(f"{name} must be a VerifyOrWriteContext, got {type(context).__name__}")
    buf = array_arg(context.canary_buf, f"{name}.canary_buf", dtype=np.uint8, ndim=2, writable=True)
    stride = int(buf.shape[1])
    if stride < CANARY_SLOT_BYTES or stride % 8:
        fail(f"{name}.canary_buf slot stride must be a multiple of 8 holding at least "
             f"{CANARY_FIELDS_PER_SLOT} int64 fields, got {stride} bytes")
    if data_pointer(buf) % 8:
        fail(f"{name}.canary_buf must start at an 8-byte aligned address (its fields are read as int64)")
    kind = int_arg(context.kernel_kind, f"{name}.kernel_kind")
    ring = array_arg(context.violation_ring, f"{name}.violation_ring", dtype=np.int64, ndim=2,
                     shape=(None, VIOLATION_FIELDS), writable=True)
    if ring.shape[0] < 1:
        fail(f"{name}.violation_ring must hold at least one row")
    one32: dict[str, Any] = {"dtype": np.int32, "ndim": 1, "shape": (1,), "writable": True}
    one64: dict[str, Any] = {"dtype": np.int64, "ndim": 1, "shape": (1,), "writable": True}
    write_index = array_arg(context.violation_write_index, f"{name}.violation_write_index", **one32)
    slot_counter = array_arg(context.slot_run_counter, f"{name}.slot_run_counter", **one64)
    kernel_counter = array_arg(context.kernel_run_counter, f"{name}.kernel_run_counter", **one64)
    if context.status is None:
        fail(f"{name}.status is required (int32 [1]; VerifyOrWriteContext.allocate makes one)")
    status = array_arg(context.status, f"{name}.status", **one32)
    chain_flag = None
    if need_chain_flag:
        if context.enable_chain_position_assert is None:
            fail(f"{name}.enable_chain_position_assert is required (int32 [1])")
        chain_flag = array_arg(context.enable_chain_position_assert, f"{name}.enable_chain_position_assert",
                               dtype=np.int32, ndim=1, shape=(1,))
    mode = int(real_kv_mode_arg(context.real_kv_hash_mode, f"{name}.real_kv_hash_mode"))
    sources = real_kv_sources_arg(context.real_kv_sources, f"{name}.real_kv_sources")
    num_slots = int(buf.shape[0])
    views = []
    for k, source in enumerate(sources):
        source.check_storage()
        if source.slots_covered < num_slots:
            fail(f"{name}.real_kv_sources[{k}] covers {source.slots_covered} slots "
                 f"({_coverage_words(source)}), fewer than the {num_slots} slots of canary_buf")
        views.append(source.view())
    named = [(f"{name}.canary_buf", buf), (f"{name}.violation_ring", ring),
             (f"{name}.violation_write_index", write_index), (f"{name}.slot_run_counter", slot_counter),
             (f"{name}.kernel_run_counter", kernel_counter), (f"{name}.status", status),
             (f"{name}.enable_chain_position_assert", chain_flag)]
    named += [(f"{name}.real_kv_sources[{k}].tensor", v[0]) for k, v in enumerate(views)]
    first = device_of(buf)
    for arg, arr in named:
        if arr is not None and device_of(arr) != first:
            fail(f"{arg} is on {device_of(arr)} but {name}.canary_buf is on {first}; all arrays of one "
                 "call must share a device")
    return ContextArrays(
        canary=buf.view(np.int64), canary_bytes=buf, kernel_kind=kind, ring=ring, write_index=write_index,
        slot_run_counter=slot_counter, kernel_run_counter=kernel_counter, sources=tuple(views), mode=mode,
        chain_assert=chain_flag, status=status, named=tuple(named),
    )


def _coverage_words(source: RealKvSource) -> str:
    if source.layout is None:
        return f"{source.byte_rows.shape[0]} rows x page_size {source.page_size}"
    return f"its layout over {source.byte_rows.shape[1]} bytes, page_size {source.page_size}"


def check_context_memory(ctx: ContextArrays, *, writes_canary: bool, inputs: list[tuple[str, Any]]) -> None:
    """SPEC §0.8 for a verify or write launch: the context's ring, index, counters and status (and the
    canary buffer, for a write) are outputs; the canary buffer of a verify, the chain flag, the real-KV
    tensors and the launch's own arrays (``inputs``) are read alongside."""
    canary_name = ctx.named[0][0]
    outputs = [(n, a) for n, a in ctx.named[1:6]]
    reads = [(n, a) for n, a in ctx.named[6:]]
    canary = (canary_name, ctx.canary)  # viewed as int64: that is how the kernels load it
    (outputs if writes_canary else reads).append(canary)
    check_memory(outputs=outputs, inputs=reads + inputs)
