"""The write step: stamp each new KV slot's canary (token, position, chained hash, real-KV fingerprint).

Owns :func:`launch_canary_write_kernel` (SPEC §4): host-visible validation in one place, then the selected
backend. Requests are independent; within a request the chain is serial: each written slot stores the hash
of its predecessor, seeded from the plan's seed slot or the anchor, and always advanced on the *actual*
token and position, so an input-assert mismatch never cascades into later chain errors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ._errors import fail
from ._validate import array_arg, bool_arg, optional_array_arg, same_device
from .backends import resolve_backend
from .context import ContextArrays, VerifyOrWriteContext, check_context_memory, prepare_context
from .dlpack import Device, DLPackArray, device_scope, stream_scope
from .plan import WritePlan


@dataclass(frozen=True)
class WriteLaunch:
    context: ContextArrays
    write_offsets: Any
    write_seed_slot_indices: Any
    write_num_valid_reqs: Any
    input_ids: Any
    positions: Any
    out_cache_loc: Any
    enable_write_input_assert: bool
    expected_input_tokens: Any | None
    expected_input_positions: Any | None
    device: Device

    @property
    def write_req_capacity(self) -> int:
        return int(self.write_seed_slot_indices.shape[0])


def prepare_write_launch(
    *,
    context: VerifyOrWriteContext,
    plan: WritePlan,
    input_ids: Any,
    positions: Any,
    out_cache_loc: Any,
    enable_write_input_assert: bool,
    expected_input_tokens: Any | None,
    expected_input_positions: Any | None,
) -> WriteLaunch:
    ctx = prepare_context(context, need_chain_flag=True)
    if not isinstance(plan, WritePlan):
        fail(f"plan must be a WritePlan, got {type(plan).__name__}")
    assert_inputs = bool_arg(enable_write_input_assert, "enable_write_input_assert")
    if assert_inputs and (expected_input_tokens is None or expected_input_positions is None):
        fail("expected_input_tokens and expected_input_positions are required when "
             "enable_write_input_assert=True")
    if not assert_inputs and (expected_input_tokens is not None or expected_input_positions is not None):
        fail("expected_input_tokens and expected_input_positions must be None when "
             "enable_write_input_assert=False")
    offsets = array_arg(plan.write_offsets, "plan.write_offsets", dtype=np.int64, ndim=1)
    capacity = int(offsets.shape[0]) - 1
    if capacity < 1:
        fail(f"plan.write_offsets must hold write_req_capacity + 1 >= 2 entries, got {capacity + 1}")
    seeds = array_arg(plan.write_seed_slot_indices, "plan.write_seed_slot_indices", dtype=np.int64, ndim=1,
                      shape=(capacity,))
    num_valid = array_arg(plan.write_num_valid_reqs, "plan.write_num_valid_reqs", dtype=np.int32, ndim=1,
                          shape=(1,))
    ids = array_arg(input_ids, "input_ids", dtype=np.int64, ndim=1)
    tokens = (int(ids.shape[0]),)
    pos = array_arg(positions, "positions", dtype=np.int64, ndim=1, shape=tokens)
    loc = array_arg(out_cache_loc, "out_cache_loc", dtype=np.int64, ndim=1, shape=tokens)
    exp_tok = optional_array_arg(expected_input_tokens, "expected_input_tokens", dtype=np.int64, ndim=1,
                                 shape=tokens)
    exp_pos = optional_array_arg(expected_input_positions, "expected_input_positions", dtype=np.int64,
                                 ndim=1, shape=tokens)
    inputs = [
        ("plan.write_offsets", offsets), ("plan.write_seed_slot_indices", seeds),
        ("plan.write_num_valid_reqs", num_valid), ("input_ids", ids), ("positions", pos),
        ("out_cache_loc", loc), ("expected_input_tokens", exp_tok), ("expected_input_positions", exp_pos),
    ]
    device = same_device([("context.canary_buf", ctx.canary_bytes), *inputs])
    check_context_memory(ctx, writes_canary=True, inputs=inputs)
    return WriteLaunch(ctx, offsets, seeds, num_valid, ids, pos, loc, assert_inputs, exp_tok, exp_pos, device)


def launch_canary_write_kernel(
    *,
    context: VerifyOrWriteContext,
    plan: WritePlan,
    input_ids: DLPackArray,
    positions: DLPackArray,
    out_cache_loc: DLPackArray,
    enable_write_input_assert: bool,
    expected_input_tokens: DLPackArray | None = None,
    expected_input_positions: DLPackArray | None = None,
    backend: str = "auto",
    on_invalid: str | None = None,
) -> None:
    """Write the canaries of one step's new tokens into ``context.canary_buf`` (SPEC §4).

    ``input_ids``, ``positions`` and ``out_cache_loc`` are int64 [num_tokens] laid out request-major as
    ``plan.write_offsets`` says; a negative ``out_cache_loc`` entry is skipped. With
    ``enable_write_input_assert`` the actual token/position of each entry is compared with the expected
    tensors and mismatches become violation rows. ``backend`` and ``on_invalid`` as for the plan launcher.
    """
    with stream_scope(context, plan, input_ids, positions, out_cache_loc, expected_input_tokens,
                      expected_input_positions):
        launch = prepare_write_launch(
            context=context, plan=plan, input_ids=input_ids, positions=positions, out_cache_loc=out_cache_loc,
            enable_write_input_assert=enable_write_input_assert, expected_input_tokens=expected_input_tokens,
            expected_input_positions=expected_input_positions,
        )
        impl = resolve_backend(backend, launch.device, on_invalid)
        with device_scope(launch.device):
            impl.write(launch)
