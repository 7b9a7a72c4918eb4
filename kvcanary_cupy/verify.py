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
from ._validate import array_arg, bool_arg, same_device
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

    @property
    def capacity(self) -> int:
        return int(self.slots.shape[0])


def prepare_verify_launch(*, context: VerifyOrWriteContext, plan: VerifyPlan,
                          check_verify_expected_token: bool) -> VerifyLaunch:
    ctx = prepare_context(context, need_chain_flag=False)
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
    ]
    device = same_device([("context.canary_buf", ctx.canary_bytes), *plan_arrays,
                          ("plan.verify_expected_tokens", tokens)])
    check_context_memory(ctx, writes_canary=False, inputs=plan_arrays)
    return VerifyLaunch(ctx, slots, tokens, positions, prevs, num_valid, enable, check, device)


def launch_canary_verify_kernel(
    *,
    context: VerifyOrWriteContext,
    plan: VerifyPlan,
    check_verify_expected_token: bool,
    backend: str = "auto",
    on_invalid: str | None = None,
) -> None:
    """Verify the first ``plan.verify_num_valid`` entries of ``plan`` against ``context`` (SPEC §5)."""
    with stream_scope(context, plan):
        launch = prepare_verify_launch(context=context, plan=plan,
                                       check_verify_expected_token=check_verify_expected_token)
        impl = resolve_backend(backend, launch.device, on_invalid)
        with device_scope(launch.device):
            impl.verify(launch)
