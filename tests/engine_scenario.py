"""An engine-like scenario shared by the bind tests (CPU) and the torch CUDA-graph tests (GPU).

Every shape stays fixed (padding rows, padded token arrays with ``out_cache_loc = -1``) and contents are
refilled in place between steps, as a serving engine does around a captured CUDA graph. ``Engine(to)`` holds
one canary group's persistent buffers in whatever framework ``to`` converts NumPy arrays into.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
from plan_helpers import linear_rtt

import kvcanary_cupy as kc

ROWS, WIDTH, BS, TOKENS, CAPACITY = 4, 16, 3, 8, 32
RTT = linear_rtt(ROWS, WIDTH, base=1)  # distinct nonzero slots: row r, column c -> 1 + 16 r + c
NUM_SLOTS = ROWS * WIDTH + 1
SENTINEL = 0x5A5A

# (req_pool_indices, prefix_lens, extend_seq_lens) per step; row 0 of the pool is padding
STEPS = [
    ([1, 2, 0], [0, 0, 0], [3, 2, 0]),  # two prefills
    ([1, 2, 0], [3, 2, 0], [1, 1, 0]),  # two decodes
    ([1, 0, 3], [4, 0, 0], [1, 0, 4]),  # request 2 finished, request 3 arrives
    ([1, 3, 0], [5, 4, 0], [1, 2, 0]),  # decode + a two-token extend
]
HISTORY = (np.arange(ROWS * WIDTH, dtype=np.int32).reshape(ROWS, WIDTH) * 7 + 3)  # tokens per pool row


def step_inputs(step: int) -> dict[str, np.ndarray]:
    """Every array input of one step, at the bound (padded) shapes."""
    rpi, prefix, extend = (np.array(v, np.int64) for v in STEPS[step])
    ids, pos, loc = np.zeros(TOKENS, np.int64), np.zeros(TOKENS, np.int64), np.full(TOKENS, -1, np.int64)
    k = 0
    for rp, p, e in zip(rpi, prefix, extend, strict=True):
        if rp == 0:
            continue
        for position in range(p, p + e):
            ids[k], pos[k], loc[k] = HISTORY[rp, position], position, RTT[rp, position]
            k += 1
    return {"req_pool_indices": rpi, "prefix_lens": prefix, "extend_seq_lens": extend,
            "valid_lens": prefix + extend, "input_ids": ids, "positions": pos, "out_cache_loc": loc}


def to_numpy(value: Any) -> np.ndarray:
    """A NumPy copy of a NumPy array or a torch tensor (on any device)."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy().copy()
    return np.array(value, copy=True)


class Engine:
    """The persistent buffers of one canary group, in one framework (``to`` turns NumPy into it)."""

    def __init__(self, to: Callable[[np.ndarray], Any], chain_assert: int = 0) -> None:
        self.to = to
        self.inputs = {k: to(v) for k, v in step_inputs(0).items()}
        self.req_to_token, self.pool = to(RTT), to(HISTORY)
        # Plans start from a sentinel so that "left untouched" is compared too.
        self.vp = kc.VerifyPlan(**{f.name: to(np.full(n, SENTINEL, d)) for f, (n, d) in zip(
            dataclasses.fields(kc.VerifyPlan), [(CAPACITY, np.int64)] * 4 + [(1, np.int32)] * 3, strict=True)})
        self.wp = kc.WritePlan(**{f.name: to(np.full(n, SENTINEL, d)) for f, (n, d) in zip(
            dataclasses.fields(kc.WritePlan), [(BS + 1, np.int64), (BS, np.int64), (1, np.int32), (BS + 1, np.int64)],
            strict=True)})
        self.ctx = kc.VerifyOrWriteContext(
            canary_buf=to(np.zeros((NUM_SLOTS, 32), np.uint8)), kernel_kind=kc.CanaryLaunchTag.HEAD_K_FULL,
            violation_ring=to(np.zeros((16, 8), np.int64)), violation_write_index=to(np.zeros(1, np.int32)),
            slot_run_counter=to(np.zeros(1, np.int64)), kernel_run_counter=to(np.zeros(1, np.int64)),
            enable_chain_position_assert=to(np.array([chain_assert], np.int32)), status=to(np.zeros(1, np.int32)))

    def plan_kwargs(self) -> dict:
        i = self.inputs
        return {"verify_plan_out": self.vp, "write_plan_out": self.wp, "req_pool_indices": i["req_pool_indices"],
                "prefix_lens": i["prefix_lens"], "extend_seq_lens": i["extend_seq_lens"],
                "req_to_token": self.req_to_token, "swa_window_size": 0, "full_to_swa_index_mapping": None,
                "verify_capacity": CAPACITY, "req_to_verify_expected_tokens": self.pool,
                "req_to_verify_expected_tokens_valid_lens": i["valid_lens"]}

    def verify_kwargs(self) -> dict:
        return {"context": self.ctx, "plan": self.vp, "check_verify_expected_token": True}

    def write_kwargs(self) -> dict:
        i = self.inputs
        return {"context": self.ctx, "plan": self.wp, "input_ids": i["input_ids"], "positions": i["positions"],
                "out_cache_loc": i["out_cache_loc"], "enable_write_input_assert": False}

    def refill(self, step: int) -> None:
        """Copy step ``step``'s inputs into the bound buffers, in place (on the current stream for torch)."""
        torch = sys.modules.get("torch")
        for name, values in step_inputs(step).items():
            target = self.inputs[name]
            if torch is not None and isinstance(target, torch.Tensor):
                target.copy_(torch.from_numpy(values))
            else:
                target[...] = values

    def corrupt_token(self, slot: int, value: int) -> None:
        torch = sys.modules.get("torch")
        buf = self.ctx.canary_buf
        words = buf.view(torch.int64) if torch is not None and isinstance(buf, torch.Tensor) else buf.view(np.int64)
        words[slot, 0] = value

    def plan_state(self) -> dict[str, np.ndarray]:
        """Every plan field as NumPy, except the scratch (only [0, bs] of it is defined)."""
        out = {f"{prefix}.{f.name}": to_numpy(getattr(obj, f.name))
               for prefix, obj in (("verify", self.vp), ("write", self.wp)) for f in dataclasses.fields(obj)}
        del out["write.verify_offsets"]
        return out

    def state(self) -> dict[str, np.ndarray]:
        """The plan state plus every array of the context."""
        out = self.plan_state()
        for f in dataclasses.fields(self.ctx):
            value = getattr(self.ctx, f.name)
            if not isinstance(value, (int, tuple)) and value is not None:
                out[f"ctx.{f.name}"] = to_numpy(value)
        return out
