"""Canary records that travel with KV pages between processes (disaggregated prefill -> decode).

A canary record (token, position, prev_hash, real_kv_hash: 32 bytes) names no slot: the chain hashes
content and position only, and the real-KV fingerprint covers the bytes of one token. So the records of a
request can be shipped next to its KV pages and checked on the receiving side against the receiver's own
slot table. Three calls sit around any transport (Mooncake, NIXL, NCCL, a socket):

1. sender: :func:`gather_canary_records` copies the records of the request's slots into one contiguous
   ``int64 [n, 4]`` buffer, shipped with the pages;
2. receiver, once the pages have landed: :func:`scatter_canary_records` copies the records into the
   receiver's own slots;
3. receiver, before the request's first decode step: :meth:`ReceivedPrefixVerifier.verify` plans and
   verifies the whole received prefix (chain, positions, expected tokens and the real-KV fingerprints of the
   received bytes) with the receiver's slot layout: SGLang's ``req_to_token``, or ``layout=`` a
   :class:`~kvcanary_cupy.layouts.BlockTable` (vLLM) or :class:`~kvcanary_cupy.layouts.PageList` (FlashInfer).

Gather and scatter validate every host-visible fact once, for every backend (``numpy`` reference, ``cuda``
and ``host`` kernels from ``kernels/transfer.cu``); slots are device values, so a slot outside the canary
buffer is never followed but reported in ``status`` (:class:`~kvcanary_cupy.constants.CanaryStatus`).
Neither allocates, so both can be captured in a CUDA graph.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._errors import fail
from ._validate import array_arg, check_memory, int_arg, optional_array_arg, same_device
from .backends import resolve_backend
from .constants import CANARY_FIELDS_PER_SLOT, CANARY_SLOT_BYTES
from .context import VerifyOrWriteContext
from .dlpack import Device, device_scope, stream_scope
from .layouts import SlotLayout, layout_arrays
from .plan import OnInvalid, VerifyPlan, WritePlan, _allocate, prepare_plan_launch
from .verify import prepare_verify_launch

_INT32_MAX = (1 << 31) - 1
RECORD_BYTES = CANARY_SLOT_BYTES  # one record on the wire: 4 little-endian int64 fields


@dataclass(frozen=True)
class RecordTransferLaunch:
    """A validated gather or scatter: ``canary`` int64 [num_slots, stride // 8], ``records`` int64
    [n * page_size, 4], ``slots`` int64 [n] (slots, or page ids when ``page_size`` > 1: page ``p`` holds
    slots ``p * page_stride + [0, page_size)``), optional ``status`` int32 [1]."""

    canary: Any
    records: Any
    slots: Any
    status: Any | None
    device: Device
    page_size: int = 1
    page_stride: int = 1

    @property
    def count(self) -> int:
        """Records moved: one per slot of every listed page."""
        return int(self.slots.shape[0]) * self.page_size


def prepare_record_transfer(*, canary_buf: Any, records: Any, slots: Any, status: Any | None,
                            records_written: bool, page_size: int = 1, page_stride: int | None = None,
                            index_name: str = "slots", canary_name: str = "canary_buf") -> RecordTransferLaunch:
    """Every host-visible check of a gather (``records_written``) or scatter, for all backends. With
    ``page_size`` > 1, ``slots`` (named ``index_name`` in messages) lists page ids, ``page_stride`` slots
    apart (None: ``page_size``). Messages name the arguments as the caller did: ``records_out`` for a gather,
    ``records`` for a scatter, the canary buffer as ``canary_name``."""
    records_name = "records_out" if records_written else "records"
    size = int_arg(page_size, "page_size", minimum=1, maximum=_INT32_MAX)
    step = size if page_stride is None else int_arg(page_stride, "page_stride", minimum=size, maximum=_INT32_MAX)
    buf = array_arg(canary_buf, canary_name, dtype=np.uint8, ndim=2, writable=not records_written)
    stride = int(buf.shape[1])
    if stride < CANARY_SLOT_BYTES or stride % 8:
        fail(f"{canary_name} slot stride must be a multiple of 8 holding at least {CANARY_FIELDS_PER_SLOT} int64 "
             f"fields, got {stride} bytes")
    if buf.shape[0] < 1:
        fail(f"{canary_name} must hold at least one slot")
    slot_arr = array_arg(slots, index_name, dtype=np.int64, ndim=1)
    n = int(slot_arr.shape[0]) * size
    rec = array_arg(records, records_name, dtype=np.int64, ndim=2, shape=(n, CANARY_FIELDS_PER_SLOT),
                    writable=records_written)
    status_arr = optional_array_arg(status, "status", dtype=np.int32, ndim=1, shape=(1,), writable=True)
    named = [(canary_name, buf), (records_name, rec), (index_name, slot_arr), ("status", status_arr)]
    device = same_device(named)
    # SPEC §0.8 as for every launcher: each array aligned to its elements (the int64 view of canary_buf
    # included), and what the call writes (records or canary_buf, and status) sharing no byte with anything
    # else it touches.
    fields = buf.view(np.int64)
    written = {records_name, "status"} if records_written else {canary_name, "status"}
    check_memory(outputs=[(n, fields if n == canary_name else a) for n, a in named if n in written],
                 inputs=[(n, fields if n == canary_name else a) for n, a in named if n not in written])
    return RecordTransferLaunch(fields, rec, slot_arr, status_arr, device, size, step)


def gather_canary_records(*, canary_buf: Any, slots: Any, records_out: Any, status: Any | None = None,
                          backend: str = "auto", on_invalid: str | None = None) -> None:
    """``records_out[i] = canary_buf[slots[i]]`` (the 4 fields, 32 bytes), for every i.

    ``canary_buf`` uint8 [num_slots, stride >= 32] (the sender's canary buffer), ``slots`` int64 [n] (the
    request's slots in position order), ``records_out`` int64 [n, 4], contiguous: the buffer to ship. A slot
    outside the buffer gives a zero record (which never verifies) and sets SLOT_OUT_OF_RANGE in ``status``
    (int32 [1]); the NumPy reference raises for it unless ``on_invalid="flag"``.
    """
    with stream_scope(canary_buf, slots, records_out, status):
        launch = prepare_record_transfer(canary_buf=canary_buf, records=records_out, slots=slots, status=status,
                                         records_written=True)
        impl = resolve_backend(backend, launch.device, on_invalid)
        with device_scope(launch.device):
            impl.gather_records(launch)


def scatter_canary_records(*, records: Any, slots: Any, canary_buf: Any, status: Any | None = None,
                           backend: str = "auto", on_invalid: str | None = None) -> None:
    """``canary_buf[slots[i]] = records[i]`` (the 4 fields; bytes past them are untouched), for every i.

    ``records`` int64 [n, 4] as received, ``slots`` int64 [n] the receiver's slots for the same positions,
    ``canary_buf`` the receiver's canary buffer. The slots must be distinct. A slot outside the buffer is
    skipped and sets SLOT_OUT_OF_RANGE in ``status``; the NumPy reference raises unless ``on_invalid="flag"``.
    """
    with stream_scope(records, slots, canary_buf, status):
        launch = prepare_record_transfer(canary_buf=canary_buf, records=records, slots=slots, status=status,
                                         records_written=False)
        impl = resolve_backend(backend, launch.device, on_invalid)
        with device_scope(launch.device):
            impl.scatter_records(launch)


class ReceivedPrefixVerifier:
    """Plan + verify of whole received prefixes on the receiver, with scratch allocated once.

    A received request has a prefix of ``received_lens[r]`` positions and nothing new to write, so the plan
    runs with extend 0 and every position becomes a verify entry: its slot from the receiver's slot layout
    (``req_to_token`` or ``layout``), its predecessor, its expected token from the receiver's expected-token pool (the
    request's token ids, which the receiver gets with the request anyway) and its position. The verify then
    recomputes each predecessor's chain hash and the real-KV fingerprint of the received bytes through
    ``context``'s sources (the receiver's KV; its page size may differ from the sender's, the bytes per
    token may not). Violations land in ``context``'s ring; ``plan.status`` reports hostile table values.
    A call that raises writes nothing: with the NumPy reference in ``raise`` mode the plan is built and
    verified in a second, private pair of host plans (allocated on first use) and copied into ``plan`` only
    once the verify accepted it.
    """

    def __init__(self, *, verify_capacity: int, max_requests: int, device: Any = "cpu") -> None:
        capacity = int_arg(verify_capacity, "verify_capacity", minimum=1)
        self.max_requests = int_arg(max_requests, "max_requests", minimum=1)
        self.verify_capacity = capacity
        self.plan = VerifyPlan.allocate(verify_capacity=capacity, device=device)
        self._write_plan = WritePlan._allocate(self.max_requests, device, sized_by="max_requests")
        self._no_extend = _allocate(device, self.max_requests, np.int64, fill=0, name="max_requests")
        self._shadows: tuple[VerifyPlan, WritePlan] | None = None

    def verify(self, *, context: VerifyOrWriteContext, req_pool_indices: Any | None = None, received_lens: Any,
               req_to_token: Any | None = None, req_to_verify_expected_tokens: Any | None = None,
               req_to_verify_expected_tokens_valid_lens: Any | None = None,
               kv_token_id_vs_position_offset: int = 0, swa_window_size: int = 0,
               full_to_swa_index_mapping: Any | None = None, layout: SlotLayout | None = None,
               backend: str = "auto", on_invalid: OnInvalid | None = None) -> None:
        """Verify positions ``[0, received_lens[r])`` of every request of the batch.

        Arguments as for :func:`~kvcanary_cupy.launch_canary_plan_kernels` (``received_lens`` takes the place
        of ``prefix_lens``); the expected-token check runs when an expected-token pool is given. The slots
        come from exactly one of ``req_to_token`` (rows ``req_pool_indices[r]``) or ``layout``: a
        :class:`~kvcanary_cupy.layouts.BlockTable` for a vLLM-style receiver, a
        :class:`~kvcanary_cupy.layouts.PageList` for a FlashInfer-style one; ``req_pool_indices`` may be None
        when the layout reads batch rows directly.
        """
        with stream_scope(context, self.plan, req_pool_indices, received_lens, *layout_arrays(req_to_token, layout),
                          full_to_swa_index_mapping, req_to_verify_expected_tokens,
                          req_to_verify_expected_tokens_valid_lens):
            self._plan_and_verify(
                context=context, req_pool_indices=req_pool_indices, lens=received_lens, lens_name="received_lens",
                req_to_token=req_to_token, layout=layout, req_to_verify_expected_tokens=req_to_verify_expected_tokens,
                req_to_verify_expected_tokens_valid_lens=req_to_verify_expected_tokens_valid_lens,
                kv_token_id_vs_position_offset=kv_token_id_vs_position_offset, swa_window_size=swa_window_size,
                full_to_swa_index_mapping=full_to_swa_index_mapping, backend=backend, on_invalid=on_invalid,
                function="ReceivedPrefixVerifier.verify")

    def _plan_and_verify(self, *, context: VerifyOrWriteContext, req_pool_indices: Any | None, lens: Any,
                         lens_name: str, req_to_token: Any | None, layout: SlotLayout | None,
                         req_to_verify_expected_tokens: Any | None,
                         req_to_verify_expected_tokens_valid_lens: Any | None,
                         kv_token_id_vs_position_offset: int, swa_window_size: int,
                         full_to_swa_index_mapping: Any | None, backend: str, on_invalid: OnInvalid | None,
                         function: str, before_verify: Callable[[], Callable[[], None] | None] | None = None) -> None:
        """Plan positions ``[0, lens[r])`` of every request as verify entries (extend 0) into ``self.plan``, run
        ``before_verify`` (a restore's scatter; it returns how to undo itself), then verify.

        Every host-visible argument of both launches is checked before anything runs. The NumPy reference in
        raise mode refuses device values (a table entry naming a slot outside canary_buf) only once the plan
        holding them exists: it plans and verifies on private plans, undoes ``before_verify`` if the verify
        refuses, and publishes the plan only when both ran, so that a refusal leaves self.plan, the canary, the
        ring and the counters as they were.
        """
        # The batch size sizes the extend-0 slice below, so it is checked here; the plan checks the rest.
        rows = optional_array_arg(req_pool_indices, "req_pool_indices", dtype=np.int64, ndim=1)
        name = "req_pool_indices"
        if rows is None:  # a layout that reads batch rows directly
            rows, name = array_arg(lens, lens_name, dtype=np.int64, ndim=1), lens_name
        bs = int(rows.shape[0])
        if bs > self.max_requests:
            fail(f"{name} holds {bs} requests, more than this verifier's max_requests={self.max_requests}")
        plan_inputs = dict(
            req_pool_indices=req_pool_indices, prefix_lens=lens, extend_seq_lens=self._no_extend[:bs],
            req_to_token=req_to_token, swa_window_size=swa_window_size,
            full_to_swa_index_mapping=full_to_swa_index_mapping, verify_capacity=self.verify_capacity,
            req_to_verify_expected_tokens=req_to_verify_expected_tokens,
            req_to_verify_expected_tokens_valid_lens=req_to_verify_expected_tokens_valid_lens,
            kv_token_id_vs_position_offset=kv_token_id_vs_position_offset, layout=layout,
            function=function, prefix_name=lens_name)
        check_tokens = req_to_verify_expected_tokens is not None
        verify = prepare_verify_launch(context=context, plan=self.plan, check_verify_expected_token=check_tokens)
        plan = prepare_plan_launch(verify_plan_out=self.plan, write_plan_out=self._write_plan, **plan_inputs)
        impl = resolve_backend(backend, verify.device, on_invalid)
        plan_impl = resolve_backend(backend, plan.device, on_invalid)
        if getattr(impl, "on_invalid", None) != "raise":  # kernels and "flag" never refuse a device value
            with device_scope(verify.device):
                plan_impl.plan(plan)
                if before_verify is not None:
                    before_verify()
                impl.verify(verify)
            return
        shadow_verify, shadow_write = self._shadow_plans()
        plan_impl.plan(prepare_plan_launch(verify_plan_out=shadow_verify, write_plan_out=shadow_write, **plan_inputs))
        undo = before_verify() if before_verify is not None else None
        try:
            impl.verify(prepare_verify_launch(context=context, plan=shadow_verify,
                                              check_verify_expected_token=check_tokens))
        except BaseException:
            if undo is not None:
                undo()
            raise
        for shadow, target in ((shadow_verify, self.plan), (shadow_write, self._write_plan)):
            for f in dataclasses.fields(shadow):
                np.copyto(getattr(target, f.name), getattr(shadow, f.name))

    def _shadow_plans(self) -> tuple[VerifyPlan, WritePlan]:
        """Host plans of this verifier's capacities, allocated on first use (NumPy reference, raise mode)."""
        if self._shadows is None:
            self._shadows = (VerifyPlan.allocate(verify_capacity=self.verify_capacity),
                             WritePlan.allocate(write_req_capacity=self.max_requests))
        return self._shadows
