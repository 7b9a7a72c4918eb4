"""What an engine decides once: the canary's mode and switches (:class:`CanaryConfig`) and the sizes every
step must fit in (:class:`Capacities`). Both validate at construction with the usual ``kv-canary: `` error."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .._errors import fail
from .._validate import bool_arg, int_arg
from ..backends import BACKEND_NAMES
from ..constants import RealKvHashMode

MODES = ("off", "log", "raise")
_HASH_MODES = {"none": RealKvHashMode.NONE, "partial": RealKvHashMode.PARTIAL, "all": RealKvHashMode.ALL}


def hash_mode(value: Any, name: str) -> RealKvHashMode:
    if isinstance(value, str):
        if value.lower() in _HASH_MODES:
            return _HASH_MODES[value.lower()]
    else:
        try:
            return RealKvHashMode(int(value))
        except (TypeError, ValueError):
            pass
    fail(f"{name} must be one of none, partial, all (or a RealKvHashMode), got {value!r}")


@dataclass(frozen=True)
class CanaryConfig:
    """The canary's switches.

    Attributes:
        mode: "off" (nothing allocated or launched), "log" (one WARNING per violation, one summary per step)
            or "raise" (:class:`~kvcanary_cupy.runtime.CanaryViolationError` one step after the launch).
        ring_capacity: violation rows per group ring; the ring is drained after every read.
        sweep_interval: sweep the prefix cache every N steps (steps 0, N, 2N...); 0 disables the sweep.
        real_kv_hash_mode: "none", "partial" or "all" for the TAIL and SWEEP endpoints.
        write_input_assert: the write kernels compare the new tokens and positions with the batch's oracle
            (``StepBatch.expected_input_ids`` / ``expected_positions``).
        verify_token_assert: keep an expected-token pool, scatter the batch's token histories into it and
            check every verified slot's token against it.
        stats_interval: log one INFO stats line every N steps; 0 disables it.
        health_check: check the kernel and slot run counters every step (one step late).
        backend: "auto", "numpy", "cuda" or "host", as for the launchers.
        logger: name of the :mod:`logging` logger every record goes to.
    """

    mode: str = "log"
    ring_capacity: int = 4096
    sweep_interval: int = 0
    real_kv_hash_mode: Any = "all"
    write_input_assert: bool = False
    verify_token_assert: bool = False
    stats_interval: int = 0
    health_check: bool = True
    backend: str = "auto"
    logger: str = "kvcanary_cupy.runtime"

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            fail(f"CanaryConfig.mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        int_arg(self.ring_capacity, "CanaryConfig.ring_capacity", minimum=1, maximum=(1 << 31) - 1)
        int_arg(self.sweep_interval, "CanaryConfig.sweep_interval", minimum=0)
        int_arg(self.stats_interval, "CanaryConfig.stats_interval", minimum=0)
        object.__setattr__(self, "real_kv_hash_mode", hash_mode(self.real_kv_hash_mode,
                                                                "CanaryConfig.real_kv_hash_mode"))
        for flag in ("write_input_assert", "verify_token_assert", "health_check"):
            bool_arg(getattr(self, flag), f"CanaryConfig.{flag}")
        if self.backend not in ("auto", *BACKEND_NAMES):
            fail(f"CanaryConfig.backend must be one of auto, {', '.join(BACKEND_NAMES)}, got {self.backend!r}")
        if not isinstance(self.logger, str) or not self.logger:
            fail(f"CanaryConfig.logger must be a non-empty str, got {self.logger!r}")

    @property
    def enabled(self) -> bool:
        return self.mode != "off"


@dataclass(frozen=True)
class Capacities:
    """Sizes fixed at creation. Every buffer a step uses is allocated for them; a step that exceeds one is a
    ``kv-canary: `` ValueError before anything is launched.

    Attributes:
        max_batch_size: rows per forward, padding rows included (SGLang's write-request capacity).
        max_tokens: new tokens per forward, padding included (write-entry capacity).
        verify_capacity: verify entries per group and plan; None means 3 × the group's slot count (radix
            sharing can make the sum of prefixes exceed the pool).
        max_context_len, pool_rows: the expected-token pool's shape; None takes ``req_to_token``'s.
        max_history_tokens: token-history entries scattered per forward; None means pool_rows × max_context_len.
        max_sweep_slots: sweep plan entries; None means the largest group's slot count (larger sweeps run in
            chunks).
    """

    max_batch_size: int
    max_tokens: int
    verify_capacity: int | None = None
    max_context_len: int | None = None
    pool_rows: int | None = None
    max_history_tokens: int | None = None
    max_sweep_slots: int | None = None

    def __post_init__(self) -> None:
        int_arg(self.max_batch_size, "Capacities.max_batch_size", minimum=1)
        int_arg(self.max_tokens, "Capacities.max_tokens", minimum=1)
        for name in ("verify_capacity", "max_context_len", "pool_rows", "max_history_tokens", "max_sweep_slots"):
            value = getattr(self, name)
            if value is not None:
                int_arg(value, f"Capacities.{name}", minimum=1, maximum=(1 << 31) - 1)
