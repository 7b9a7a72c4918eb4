"""The verify step: check a plan's slots against their canaries and append violations to the ring.

Owns :func:`launch_canary_verify_kernel` (SPEC §5). Each entry is independent: the slot's stored token,
position, chain hash and real-KV fingerprint are compared with the plan's expectation, the predecessor's
recomputed hash and the live KV bytes. Slot 0 is skipped (but counted); a predecessor of 0 is unreachable
and disables the chain check; ``enable == 0`` (overflowed plan) skips everything but the kernel counter.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ._errors import fail
from ._validate import array_arg, bool_arg, data_pointer, same_device
from .backends import resolve_backend
from .context import ContextArrays, VerifyOrWriteContext, check_context_memory, prepare_context
from .dlpack import Device, device_scope, stream_scope
from .plan import VerifyPlan


@dataclass(frozen=True)
class VerifyLaunch:
    context: ContextArrays
    slots: Any
    expected_tokens: Any
    expected_positions: Any
    prev_slots: Any
    num_valid: Any
    enable: Any
    check_verify_expected_token: bool
    device: Device
    twin: Any = None  # int64 view of twin_canary_buf, or None

    @property
    def capacity(self) -> int:
        return int(self.slots.shape[0])


def prepare_verify_launch(*, context: VerifyOrWriteContext, plan: VerifyPlan,
                          check_verify_expected_token: bool, twin_canary_buf: Any = None) -> VerifyLaunch:
    ctx = prepare_context(context, need_chain_flag=False)
    twin = None
    if twin_canary_buf is not None:
        twin = array_arg(twin_canary_buf, "twin_canary_buf", dtype=np.uint8, ndim=2,
                         shape=tuple(int(d) for d in ctx.canary_bytes.shape))
        if data_pointer(twin) % 8:
            fail("twin_canary_buf must start at an 8-byte aligned address (its fields are read as int64)")
        if data_pointer(twin) == data_pointer(ctx.canary_bytes):
            fail("twin_canary_buf must be another buffer than context.canary_buf")
        if ctx.mode != 0:
            fail("twin_canary_buf needs context.real_kv_hash_mode NONE: with real-KV hashing an entry's verdict "
                 "also depends on the context's own KV sources")
    if not isinstance(plan, VerifyPlan):
        fail(f"plan must be a VerifyPlan, got {type(plan).__name__}")
    check = bool_arg(check_verify_expected_token, "check_verify_expected_token")
    slots = array_arg(plan.verify_slot_indices, "plan.verify_slot_indices", dtype=np.int64, ndim=1)
    entries: dict[str, Any] = {"dtype": np.int64, "ndim": 1, "shape": (int(slots.shape[0]),)}
    tokens = array_arg(plan.verify_expected_tokens, "plan.verify_expected_tokens", **entries)
    positions = array_arg(plan.verify_expected_positions, "plan.verify_expected_positions", **entries)
    prevs = array_arg(plan.verify_prev_slot_indices, "plan.verify_prev_slot_indices", **entries)
    one: dict[str, Any] = {"dtype": np.int32, "ndim": 1, "shape": (1,)}
    num_valid = array_arg(plan.verify_num_valid, "plan.verify_num_valid", **one)
    enable = array_arg(plan.enable, "plan.enable", **one)
    plan_arrays = [
        ("plan.verify_slot_indices", slots), ("plan.verify_expected_tokens", tokens if check else None),
        ("plan.verify_expected_positions", positions), ("plan.verify_prev_slot_indices", prevs),
        ("plan.verify_num_valid", num_valid), ("plan.enable", enable),
        ("twin_canary_buf", None if twin is None else twin.view(np.int64)),
    ]
    device = same_device([("context.canary_buf", ctx.canary_bytes), *plan_arrays,
                          ("plan.verify_expected_tokens", tokens)])
    check_context_memory(ctx, writes_canary=False, inputs=plan_arrays)
    return VerifyLaunch(ctx, slots, tokens, positions, prevs, num_valid, enable, check, device,
                        None if twin is None else twin.view(np.int64))


def launch_canary_verify_kernel(
    *,
    context: VerifyOrWriteContext,
    plan: VerifyPlan,
    check_verify_expected_token: bool,
    twin_canary_buf: Any = None,
    backend: str = "auto",
    on_invalid: str | None = None,
) -> None:
    """Verify the first ``plan.verify_num_valid`` entries of ``plan`` against ``context`` (SPEC §5).

    ``twin_canary_buf``: a canary buffer of the same shape that a verify of this same plan has just checked
    (the runtime passes HEAD K's for HEAD V), only without real-KV hashing. An entry whose record and
    predecessor record hold the same words there got its verdict, and its row if any, from that launch and is
    skipped; any other entry is checked in full (docs/contract.md, "Twin buffers")."""
    with stream_scope(context, plan):
        launch = prepare_verify_launch(context=context, plan=plan,
                                       check_verify_expected_token=check_verify_expected_token,
                                       twin_canary_buf=twin_canary_buf)
        impl = resolve_backend(backend, launch.device, on_invalid)
        with device_scope(launch.device):
            impl.verify(launch)
