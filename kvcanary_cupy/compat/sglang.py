"""SGLang-compatible names on torch tensors: what ``sglang ... kv_canary`` users import, with SGLang's keyword
signatures, running on this package's backends.

Owns the adapters only; the behaviour is the core's (SPEC §0 lists where it deliberately differs from SGLang):

* :class:`VerifyPlan` / :class:`WritePlan` / :class:`VerifyOrWriteContext` are subclasses of the core
  classes, so every core launcher (and :mod:`kvcanary_cupy.bind`) accepts them. The fields this project adds
  (``status``, ``verify_offsets``) may be omitted and are then allocated as torch zeros next to the other
  fields; ``allocate(..., device=torch.device | str)`` returns torch tensors.
* :func:`launch_canary_plan_kernels`, :func:`launch_canary_verify_kernel`, :func:`launch_canary_write_kernel`
  and :func:`launch_scatter_req_token_ids_kernel` dispatch like SGLang: CPU tensors through the NumPy
  reference, CUDA tensors through the CUDA kernels on torch's current stream. Dtypes are strict (SPEC §0.6).
  Host paths refuse to run under CUDA-graph capture, as SGLang's references did.
* Real-KV sources are the core's :class:`RealKvSource`, strided layouts (:class:`KvByteLayout`, e.g. from
  :mod:`kvcanary_cupy.kv_layouts`' presets over an engine's torch KV cache) included: read in place.
* :func:`launch_canary_plan_kernels_torch_reference` converts its inputs the way SGLang's reference did and
  writes its results back into the plan's tensors wherever they live.
"""

from __future__ import annotations

try:
    import torch
except ImportError as exc:  # torch is an optional dependency of this package
    raise ImportError(
        "kvcanary_cupy.compat.sglang works on torch tensors and needs torch: "
        "pip install kvcanary-cupy[torch]"
    ) from exc

import dataclasses
import numbers
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import context as _context
from .. import plan as _plan
from .._errors import CanaryArgumentError, fail
from .._limits import check_allocation
from .._validate import bool_arg, int_arg
from ..constants import (
    CANARY_SLOT_BYTES,
    MAX_REAL_KV_SOURCES,
    VIOLATION_FIELDS,
    CanaryLaunchTag,
    FailReason,
    RealKvHashMode,
)
from ..context import RealKvSource
from ..dlpack import as_array
from ..kv_bytes import KvByteLayout
from ..layouts import BlockTable, PageList, SlotLayout, TokenTable
from ..scatter import launch_scatter_req_token_ids as _core_scatter
from ..verify import launch_canary_verify_kernel as _core_verify
from ..write import launch_canary_write_kernel as _core_write

__all__ = [
    "CANARY_SLOT_BYTES",
    "MAX_REAL_KV_SOURCES",
    "CanaryLaunchTag",
    "FailReason",
    "KvByteLayout",
    "RealKvHashMode",
    "RealKvSource",
    "VerifyOrWriteContext",
    "VerifyPlan",
    "WritePlan",
    "launch_canary_plan_kernels",
    "launch_canary_plan_kernels_torch_reference",
    "launch_canary_verify_kernel",
    "launch_canary_write_kernel",
    "launch_scatter_req_token_ids",
    "launch_scatter_req_token_ids_kernel",
]

_TORCH_REFERENCE = "launch_canary_plan_kernels_torch_reference"
_INT32_MIN, _INT32_MAX = -(1 << 31), (1 << 31) - 1
_DL_CUDA_TYPES = (2, 13)  # kDLCUDA, kDLCUDAManaged


# --- helpers ---------------------------------------------------------------------------------------------

def _positive(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        fail(f"{name} must be an int, got {type(value).__name__}")
    if int(value) <= 0:
        fail(f"{name} must be positive, got {int(value)}")
    return int_arg(value, name)


def _device(device: Any) -> torch.device:
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as exc:
        fail(f"device={device!r} is not a torch device ({exc})")


def _allocating(what: str, device: torch.device, sizes: str, nbytes: int, build: Any) -> Any:
    """Run ``build()``; torch's refusals (a CUDA device in a CPU build, sizes beyond memory) become
    argument errors naming the size arguments (``sizes``, with their values) and ``device``."""
    try:
        return build()
    except (RuntimeError, AssertionError, MemoryError, ValueError) as exc:
        fail(f"{sizes} asks for {nbytes} bytes of {what}, which cannot be allocated on device={str(device)!r} "
             f"({type(exc).__name__}: {exc})")


def _is_cuda(obj: Any) -> bool:
    if isinstance(obj, torch.Tensor):
        return obj.is_cuda
    try:
        return int(obj.__dlpack_device__()[0]) in _DL_CUDA_TYPES
    except Exception:  # no producer, or a broken one: the core launcher's validation names the argument
        return False


def _refuse_capture(function: str) -> None:
    # A torch build without CUDA cannot capture, and its capture query raises instead of answering False.
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            f"kv-canary: {function} works on the host and must not run under CUDA-graph capture "
            "(its host reads would run once at capture time, never at replay); capture the CUDA path instead"
        )


def _zeros_next_to(template: Any, length: int, dtype: torch.dtype, name: str) -> Any:
    """A zeroed 1-D array of ``length`` on ``template``'s device: torch when the template is torch (or any
    other DLPack producer), NumPy next to NumPy."""
    if template is None:
        fail(f"{name} is required")
    if isinstance(template, np.ndarray):
        return np.zeros(length, dtype=str(dtype).removeprefix("torch."))
    return torch.zeros(length, dtype=dtype, device=_tensor(template, name).device)


def _fill(arr: Any, value: int) -> None:
    if isinstance(arr, torch.Tensor):
        arr.fill_(value)
    else:
        arr[...] = value


def _run_parent_post_init(cls: type, obj: Any) -> None:
    parent = getattr(super(cls, obj), "__post_init__", None)
    if parent is not None:
        parent()


# --- data model ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class VerifyPlan(_plan.VerifyPlan):
    """SGLang's ``VerifyPlan`` (6 fields) plus this project's ``status`` (int32 [1]), which may be omitted:
    it is then allocated as zeros on the device of ``verify_num_valid``."""

    status: Any = None

    def __post_init__(self) -> None:
        if self.status is None:
            object.__setattr__(self, "status",
                               _zeros_next_to(self.verify_num_valid, 1, torch.int32, "verify_num_valid"))
        _run_parent_post_init(VerifyPlan, self)

    @classmethod
    def allocate(cls, *, verify_capacity: int, device: torch.device | str = "cpu",
                 max_allocation_bytes: int | None = None) -> VerifyPlan:
        """torch tensors on ``device``: entries and ``verify_num_valid`` uninitialised, ``enable`` = 1,
        ``status`` = 0 (as SGLang allocated them, plus ``status``)."""
        capacity = _positive(verify_capacity, "VerifyPlan verify_capacity")
        device = _device(device)
        check_allocation(_plan.VerifyPlan.allocation_bytes(capacity), argument=f"verify_capacity={capacity}",
                         what="VerifyPlan.allocate", device=str(device),
                         max_allocation_bytes=max_allocation_bytes)
        return _allocating("VerifyPlan", device, f"verify_capacity={capacity}",
                           _plan.VerifyPlan.allocation_bytes(capacity), lambda: cls(
            verify_slot_indices=torch.empty(capacity, dtype=torch.int64, device=device),
            verify_expected_tokens=torch.empty(capacity, dtype=torch.int64, device=device),
            verify_expected_positions=torch.empty(capacity, dtype=torch.int64, device=device),
            verify_prev_slot_indices=torch.empty(capacity, dtype=torch.int64, device=device),
            verify_num_valid=torch.empty(1, dtype=torch.int32, device=device),
            enable=torch.ones(1, dtype=torch.int32, device=device),
            status=torch.zeros(1, dtype=torch.int32, device=device),
        ))

    def zero_for_testing_(self) -> VerifyPlan:
        """Reset for plan-kernel tests, as SGLang's helper did (expected tokens to the -1 "skip" sentinel)."""
        for arr in (self.verify_slot_indices, self.verify_expected_positions, self.verify_prev_slot_indices,
                    self.verify_num_valid, self.enable, self.status):
            _fill(arr, 0)
        _fill(self.verify_expected_tokens, -1)
        return self


@dataclass(frozen=True)
class WritePlan(_plan.WritePlan):
    """SGLang's ``WritePlan`` (3 fields) plus this project's ``verify_offsets`` scratch (int64 [W+1]), which
    may be omitted: it is then allocated as zeros like ``write_offsets``."""

    verify_offsets: Any = None

    def __post_init__(self) -> None:
        if self.verify_offsets is None:
            offsets = self.write_offsets
            if offsets is None:
                fail("write_offsets is required")
            # sized by write_offsets: read its shape through the one conversion (a list or a scalar is refused)
            template = offsets if isinstance(offsets, np.ndarray) else _tensor(offsets, "write_offsets")
            shape = tuple(template.shape)
            if len(shape) != 1:
                fail(f"write_offsets must be 1-D, got shape {shape}")
            object.__setattr__(self, "verify_offsets", _zeros_next_to(offsets, shape[0], torch.int64, "write_offsets"))
        _run_parent_post_init(WritePlan, self)

    @classmethod
    def allocate(cls, *, write_req_capacity: int, device: torch.device | str = "cpu",
                 max_allocation_bytes: int | None = None) -> WritePlan:
        """torch tensors on ``device``, uninitialised like SGLang's; the scratch is zeroed."""
        capacity = _positive(write_req_capacity, "WritePlan write_req_capacity")
        device = _device(device)
        check_allocation(_plan.WritePlan.allocation_bytes(capacity), argument=f"write_req_capacity={capacity}",
                         what="WritePlan.allocate", device=str(device),
                         max_allocation_bytes=max_allocation_bytes)
        return _allocating("WritePlan", device, f"write_req_capacity={capacity}",
                           _plan.WritePlan.allocation_bytes(capacity), lambda: cls(
            write_offsets=torch.empty(capacity + 1, dtype=torch.int64, device=device),
            write_seed_slot_indices=torch.empty(capacity, dtype=torch.int64, device=device),
            write_num_valid_reqs=torch.empty(1, dtype=torch.int32, device=device),
            verify_offsets=torch.zeros(capacity + 1, dtype=torch.int64, device=device),
        ))

    def zero_for_testing_(self) -> WritePlan:
        """Reset for plan-kernel tests, as SGLang's helper did."""
        for arr in (self.write_offsets, self.write_seed_slot_indices, self.write_num_valid_reqs):
            _fill(arr, 0)
        return self


@dataclass(frozen=True)
class VerifyOrWriteContext(_context.VerifyOrWriteContext):
    """SGLang's context fields; ``status`` (int32 [1]) may be omitted and is then allocated as zeros on the
    device of ``violation_write_index``."""

    def __post_init__(self) -> None:
        if self.status is None:
            object.__setattr__(self, "status", _zeros_next_to(self.violation_write_index, 1, torch.int32,
                                                              "violation_write_index"))
        _run_parent_post_init(VerifyOrWriteContext, self)

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
        device: torch.device | str = "cpu",
        max_allocation_bytes: int | None = None,
    ) -> VerifyOrWriteContext:
        """Like the core's ``allocate``, with torch tensors on ``device``: a zeroed canary buffer, ring,
        counters and status, and the chain-position flag set to ``enable_chain_position_assert``."""
        slots = _positive(num_slots, "num_slots")
        capacity = _positive(ring_capacity, "ring_capacity")
        stride = _positive(slot_stride_bytes, "slot_stride_bytes")
        if stride < CANARY_SLOT_BYTES or stride % 8:
            fail(f"slot_stride_bytes must be a multiple of 8 and >= {CANARY_SLOT_BYTES}, got {stride}")
        kind = int_arg(kernel_kind, "kernel_kind")
        mode = _context.real_kv_mode_arg(real_kv_hash_mode, "real_kv_hash_mode")
        sources = _context.real_kv_sources_arg(real_kv_sources, "real_kv_sources")
        chain_assert = bool_arg(enable_chain_position_assert, "enable_chain_position_assert")
        device = _device(device)
        _context.check_context_allocation(slots, capacity, stride, device=str(device),
                                          max_allocation_bytes=max_allocation_bytes)

        def zeros(*shape: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(*shape, dtype=dtype, device=device)

        sizes = f"num_slots={slots} x slot_stride_bytes={stride}, ring_capacity={capacity}"
        nbytes = slots * stride + capacity * VIOLATION_FIELDS * 8 + 4 * 3 + 8 * 2
        return _allocating("VerifyOrWriteContext", device, sizes, nbytes, lambda: cls(
            canary_buf=zeros(slots, stride, dtype=torch.uint8),
            kernel_kind=kind,
            violation_ring=zeros(capacity, VIOLATION_FIELDS, dtype=torch.int64),
            violation_write_index=zeros(1, dtype=torch.int32),
            slot_run_counter=zeros(1, dtype=torch.int64),
            kernel_run_counter=zeros(1, dtype=torch.int64),
            real_kv_sources=sources,
            real_kv_hash_mode=mode,
            enable_chain_position_assert=torch.full((1,), int(chain_assert), dtype=torch.int32, device=device),
            status=zeros(1, dtype=torch.int32),
        ))


# --- launchers -------------------------------------------------------------------------------------------

def launch_canary_plan_kernels(
    *,
    verify_plan_out: _plan.VerifyPlan,
    write_plan_out: _plan.WritePlan,
    req_pool_indices: torch.Tensor | None = None,
    prefix_lens: torch.Tensor,
    extend_seq_lens: torch.Tensor,
    req_to_token: torch.Tensor | None = None,
    swa_window_size: int,
    full_to_swa_index_mapping: torch.Tensor | None,
    verify_capacity: int,
    req_to_verify_expected_tokens: torch.Tensor | None,
    req_to_verify_expected_tokens_valid_lens: torch.Tensor | None,
    kv_token_id_vs_position_offset: int,
    layout: SlotLayout | None = None,
) -> None:
    """SGLang's signature; fills both plans in place (SPEC §3). CPU plans go through the NumPy reference,
    CUDA plans through the CUDA kernels on torch's current stream (capturable; bind it with
    :func:`kvcanary_cupy.bind.bind_plan` to keep DLPack conversion out of the captured region). ``layout``
    takes a block table or CSR page lists instead of ``req_to_token`` (:mod:`kvcanary_cupy.layouts`)."""
    if not _is_cuda(getattr(verify_plan_out, "verify_slot_indices", None)):
        _refuse_capture("launch_canary_plan_kernels")
    _plan.launch_canary_plan_kernels(
        verify_plan_out=verify_plan_out, write_plan_out=write_plan_out, req_pool_indices=req_pool_indices,
        prefix_lens=prefix_lens, extend_seq_lens=extend_seq_lens, req_to_token=req_to_token,
        swa_window_size=swa_window_size, full_to_swa_index_mapping=full_to_swa_index_mapping,
        verify_capacity=verify_capacity, req_to_verify_expected_tokens=req_to_verify_expected_tokens,
        req_to_verify_expected_tokens_valid_lens=req_to_verify_expected_tokens_valid_lens,
        kv_token_id_vs_position_offset=kv_token_id_vs_position_offset, layout=layout,
    )


def launch_canary_plan_kernels_torch_reference(
    *,
    verify_plan_out: _plan.VerifyPlan,
    write_plan_out: _plan.WritePlan,
    req_pool_indices: torch.Tensor | None = None,
    prefix_lens: torch.Tensor,
    extend_seq_lens: torch.Tensor,
    req_to_token: torch.Tensor | None = None,
    swa_window_size: int,
    full_to_swa_index_mapping: torch.Tensor | None,
    verify_capacity: int,
    req_to_verify_expected_tokens: torch.Tensor | None,
    req_to_verify_expected_tokens_valid_lens: torch.Tensor | None,
    kv_token_id_vs_position_offset: int,
    layout: SlotLayout | None = None,
) -> None:
    """The host reference under SGLang's name and signature, converting inputs as SGLang's reference did.

    Inputs may live on any device and have any integer dtype and any strides: the per-request inputs, the
    LUT and the valid lengths are read as int64 on the host; ``req_to_token`` and the expected-token pool
    are read as int64 too and handed to the reference as int32 (values outside int32 are refused with
    ValueError, where SGLang would have used them). The project's NumPy reference then runs on those host
    copies and the results are copied back into the plan's own tensors (``copy_``, converting to each field's
    dtype and device). A call that raises writes nothing. Not capturable: it reads device memory on the host.
    A ``layout`` is converted the same way: block tables and page indices as int32, page offsets as int64.
    """
    _refuse_capture(_TORCH_REFERENCE)
    # SGLang's own words; the core launcher would name itself instead.
    if req_to_verify_expected_tokens is not None and req_to_verify_expected_tokens_valid_lens is None:
        raise CanaryArgumentError(
            "kv-canary: launch_canary_plan_kernels_torch_reference requires "
            "req_to_verify_expected_tokens_valid_lens when req_to_verify_expected_tokens is set"
        )
    if not isinstance(verify_plan_out, _plan.VerifyPlan):
        fail(f"verify_plan_out must be a VerifyPlan, got {type(verify_plan_out).__name__}")
    if not isinstance(write_plan_out, _plan.WritePlan):
        fail(f"write_plan_out must be a WritePlan, got {type(write_plan_out).__name__}")

    # Any: a None passes through to the core launcher, whose validation names the missing argument.
    def wide(obj: Any, name: str) -> Any:
        return None if obj is None else _host_input(obj, name, torch.int64)

    def narrow(obj: Any, name: str) -> Any:
        return None if obj is None else _host_int32(obj, name)

    # Outputs: host tensors of the core dtypes, starting from the plans' current contents so that entries
    # the plan leaves untouched are copied back unchanged. A CPU field of the right dtype is used directly.
    targets: list[tuple[torch.Tensor, torch.Tensor]] = []

    def host_plan(plan: Any, prefix: str, dtypes: dict[str, torch.dtype]) -> dict[str, torch.Tensor]:
        fields = {}
        for f in dataclasses.fields(plan):
            target = _tensor(getattr(plan, f.name), f"{prefix}.{f.name}", writable=True)
            host = target.to(device="cpu", dtype=dtypes[f.name]).contiguous()
            targets.append((target, host))
            fields[f.name] = host
        return fields

    i64, i32 = torch.int64, torch.int32
    verify_fields = host_plan(verify_plan_out, "verify_plan_out", {
        "verify_slot_indices": i64, "verify_expected_tokens": i64, "verify_expected_positions": i64,
        "verify_prev_slot_indices": i64, "verify_num_valid": i32, "enable": i32, "status": i32})
    write_fields = host_plan(write_plan_out, "write_plan_out", {
        "write_offsets": i64, "write_seed_slot_indices": i64, "write_num_valid_reqs": i32,
        "verify_offsets": i64})
    # The results are copied back field by field at the end: every copy must be able to succeed, or a
    # call would write some fields and then raise.
    _check_copy_targets([(f"{p}.{f.name}", getattr(plan, f.name)) for p, plan in
                         (("verify_plan_out", verify_plan_out), ("write_plan_out", write_plan_out))
                         for f in dataclasses.fields(plan)])

    _plan.launch_canary_plan_kernels(
        verify_plan_out=_plan.VerifyPlan(**verify_fields),
        write_plan_out=_plan.WritePlan(**write_fields),
        req_pool_indices=wide(req_pool_indices, "req_pool_indices"),
        prefix_lens=wide(prefix_lens, "prefix_lens"),
        extend_seq_lens=wide(extend_seq_lens, "extend_seq_lens"),
        req_to_token=narrow(req_to_token, "req_to_token"),
        layout=_host_layout(layout, wide, narrow),
        swa_window_size=swa_window_size,
        full_to_swa_index_mapping=wide(full_to_swa_index_mapping, "full_to_swa_index_mapping"),
        verify_capacity=verify_capacity,
        req_to_verify_expected_tokens=narrow(req_to_verify_expected_tokens, "req_to_verify_expected_tokens"),
        req_to_verify_expected_tokens_valid_lens=wide(req_to_verify_expected_tokens_valid_lens,
                                                      "req_to_verify_expected_tokens_valid_lens"),
        kv_token_id_vs_position_offset=kv_token_id_vs_position_offset,
        backend="numpy",
    )
    for target, host in targets:
        if host is not target:  # converted or moved: write the result back where the caller keeps it
            target.copy_(host)


def _byte_span(t: torch.Tensor) -> tuple[int, int] | None:
    if t.numel() == 0:
        return None
    reach = sum((n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True))
    return t.data_ptr(), t.data_ptr() + (reach + 1) * t.element_size()


def _check_copy_targets(named: list[tuple[str, Any]]) -> None:
    """Each output tensor must hold every element in its own memory (no stride-0 or self-overlapping view)
    and share none with another output."""
    spans = []
    for name, obj in named:
        t = _tensor(obj, name, writable=True)
        dims = sorted((st, n) for n, st in zip(t.shape, t.stride(), strict=True) if n > 1)
        extent = 1
        for stride, size in dims:
            if stride < extent:
                fail(f"{name} has elements sharing memory (shape {tuple(t.shape)}, strides {t.stride()}, e.g. "
                     "an expand()ed tensor); an output needs one memory location per element")
            extent = stride * size
        span = _byte_span(t)
        if span is not None:
            spans.append((*span, t.device, name))
    spans.sort(key=lambda item: (str(item[2]), item[0]))
    reach: tuple[Any, int, str] | None = None  # (device, furthest end so far, its owner)
    for lo, hi, dev, name in spans:
        if reach is not None and reach[0] == dev and lo < reach[1]:
            fail(f"{name} overlaps {reach[2]} in memory; outputs of one launch must not share memory")
        if reach is None or reach[0] != dev or hi > reach[1]:
            reach = (dev, hi, name)


def _host_layout(layout: Any, wide: Any, narrow: Any) -> Any:
    """``layout`` with its arrays read on the host like the other plan inputs (bad layouts pass through to
    the core's validation, which names them)."""
    if isinstance(layout, TokenTable):
        return dataclasses.replace(layout, req_to_token=narrow(layout.req_to_token, "req_to_token"))
    if isinstance(layout, BlockTable):
        return dataclasses.replace(layout, block_table=narrow(layout.block_table, "layout.block_table"))
    if isinstance(layout, PageList):
        return dataclasses.replace(layout, kv_page_indptr=wide(layout.kv_page_indptr, "layout.kv_page_indptr"),
                                   kv_page_indices=narrow(layout.kv_page_indices, "layout.kv_page_indices"))
    return layout


def _tensor(obj: Any, name: str, *, writable: bool = False) -> torch.Tensor:
    """``obj`` as a dense torch tensor with data, sharing its memory (any DLPack producer; read-only outputs
    refused). The one place this layer turns arguments into tensors, so what torch cannot read as plain
    memory (sparse or meta tensors) or cannot import (a non-native byte order) is an argument error here
    rather than torch's own exception later."""
    if isinstance(obj, torch.Tensor):
        if obj.layout != torch.strided or obj.device.type == "meta":
            fail(f"{name} must be a dense tensor with data, got layout {obj.layout} on {obj.device}")
        return obj.detach()
    arr = as_array(obj, name, writable=writable)
    try:
        return torch.from_dlpack(arr)
    except Exception as exc:  # a dtype torch lacks, or torch's own refusal of the import
        fail(f"{name} cannot be handed to torch through DLPack ({type(exc).__name__}: {exc})")


def _host_input(obj: Any, name: str, dtype: torch.dtype) -> torch.Tensor:
    return _tensor(obj, name).to(device="cpu", dtype=dtype).contiguous()


def _host_int32(obj: Any, name: str) -> torch.Tensor:
    t = _tensor(obj, name)
    if t.dtype != torch.int32:
        t = t.to(device="cpu", dtype=torch.int64)  # read as int64, like SGLang's reference
        if t.numel() and (int(t.min()) < _INT32_MIN or int(t.max()) > _INT32_MAX):
            fail(f"{name} holds values outside int32 (min {int(t.min())}, max {int(t.max())}); the plan "
                 "reads it as int32")
        t = t.to(torch.int32)
    return t.to(device="cpu").contiguous()


def launch_canary_verify_kernel(
    *,
    context: _context.VerifyOrWriteContext,
    plan: _plan.VerifyPlan,
    check_verify_expected_token: bool,
) -> None:
    """SGLang's signature for :func:`kvcanary_cupy.launch_canary_verify_kernel` (SPEC §5)."""
    if not _is_cuda(getattr(context, "canary_buf", None)):
        _refuse_capture("launch_canary_verify_kernel")
    _core_verify(context=context, plan=plan, check_verify_expected_token=check_verify_expected_token)


def launch_canary_write_kernel(
    *,
    context: _context.VerifyOrWriteContext,
    plan: _plan.WritePlan,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    out_cache_loc: torch.Tensor,
    enable_write_input_assert: bool,
    expected_input_tokens: torch.Tensor | None,
    expected_input_positions: torch.Tensor | None,
) -> None:
    """SGLang's signature for :func:`kvcanary_cupy.launch_canary_write_kernel` (SPEC §4)."""
    if not _is_cuda(getattr(context, "canary_buf", None)):
        _refuse_capture("launch_canary_write_kernel")
    _core_write(context=context, plan=plan, input_ids=input_ids, positions=positions, out_cache_loc=out_cache_loc,
                enable_write_input_assert=enable_write_input_assert, expected_input_tokens=expected_input_tokens,
                expected_input_positions=expected_input_positions)


def launch_scatter_req_token_ids_kernel(
    *,
    flat_in: torch.Tensor,
    offsets: torch.Tensor,
    req_pool_indices: torch.Tensor,
    pool_out: torch.Tensor,
) -> None:
    """SGLang's signature for :func:`kvcanary_cupy.launch_scatter_req_token_ids` (SPEC §6). Wrong dtypes are a
    ValueError here (SGLang raised TypeError), like every other argument error of this package."""
    if not _is_cuda(pool_out):
        _refuse_capture("launch_scatter_req_token_ids_kernel")
    _core_scatter(flat_in=flat_in, offsets=offsets, req_pool_indices=req_pool_indices, pool_out=pool_out)


launch_scatter_req_token_ids = launch_scatter_req_token_ids_kernel
