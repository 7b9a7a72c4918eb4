"""What an engine decides once: the canary's mode and switches (:class:`CanaryConfig`) and the sizes every
step must fit in (:class:`Capacities`). Both validate at construction with the usual ``kv-canary: `` error."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .._errors import fail
from .._validate import bool_arg, int_arg
from ..backends import BACKEND_NAMES
from ..constants import MAX_PLAN_BATCH_SIZE, RealKvHashMode
from ..context import real_kv_mode_arg
from .reporting import DEFAULT_LOG_ROWS

#: The most rows one log line may spell out (a line stays a line, not a dump: the dump is the ring's read).
MAX_LOG_ROWS = 1000

MODES = ("off", "log", "raise")
_HASH_MODES = {"none": RealKvHashMode.NONE, "partial": RealKvHashMode.PARTIAL, "all": RealKvHashMode.ALL}


def hash_mode(value: Any, name: str) -> RealKvHashMode:
    """A hash mode by name (any case) or as a :class:`RealKvHashMode` / its int value (not a bool or float)."""
    if isinstance(value, str):
        if value.lower() in _HASH_MODES:
            return _HASH_MODES[value.lower()]
        fail(f"{name} must be one of none, partial, all (or a RealKvHashMode), got {value!r}")
    return real_kv_mode_arg(value, name)


def _choice(value: Any, name: str, choices: tuple[str, ...]) -> str:
    # isinstance first: `in` on an array or an object with an odd __eq__ would not give a bool
    if not isinstance(value, str) or value not in choices:
        fail(f"{name} must be one of {', '.join(choices)}, got {value!r}")
    return value


@dataclass(frozen=True)
class CanaryConfig:
    """The canary's switches.

    Attributes:
        mode: "off" (nothing allocated or launched), "log" (per step one WARNING per group with violation rows,
            one summary, one ERROR per failed health check) or "raise"
            (:class:`~kvcanary_cupy.runtime.CanaryViolationError` one step after the launch).
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
        max_verify_entries_per_step: 0 (default) verifies every prefix slot of every request on every step
            (the full verify). N > 0 bounds the HEAD and TAIL verify of each group to at most N entries per
            step, taken round-robin through the plan's list of live prefix entries (a cursor that moves N entries
            a step and wraps to the start after the last one), so that a set of L live prefix entries is
            verified completely every ``ceil(L / N)`` steps (see :func:`~kvcanary_cupy.runtime.verify_latency_bound`).
            The write's checks of the step's new tokens and the sweep stay complete.
        log_rows: in ``log`` mode, the rows of a group whose slot, position and reasons a step's line spells
            out (default 5); the line counts the others, which stay in the report, ``stats()`` and the totals.
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
    max_verify_entries_per_step: int = 0
    log_rows: int = DEFAULT_LOG_ROWS

    def __post_init__(self) -> None:
        _choice(self.mode, "CanaryConfig.mode", MODES)
        int_arg(self.ring_capacity, "CanaryConfig.ring_capacity", minimum=1, maximum=(1 << 31) - 1)
        int_arg(self.sweep_interval, "CanaryConfig.sweep_interval", minimum=0)
        int_arg(self.stats_interval, "CanaryConfig.stats_interval", minimum=0)
        int_arg(self.max_verify_entries_per_step, "CanaryConfig.max_verify_entries_per_step", minimum=0,
                maximum=(1 << 31) - 1)
        int_arg(self.log_rows, "CanaryConfig.log_rows", minimum=0, maximum=MAX_LOG_ROWS)
        object.__setattr__(self, "real_kv_hash_mode", hash_mode(self.real_kv_hash_mode,
                                                                "CanaryConfig.real_kv_hash_mode"))
        for flag in ("write_input_assert", "verify_token_assert", "health_check"):
            bool_arg(getattr(self, flag), f"CanaryConfig.{flag}")
        _choice(self.backend, "CanaryConfig.backend", ("auto", *BACKEND_NAMES))
        if not isinstance(self.logger, str) or not self.logger:
            fail(f"CanaryConfig.logger must be a non-empty str, got {self.logger!r}")

    @property
    def enabled(self) -> bool:
        return self.mode != "off"

    @property
    def bounded_verify(self) -> bool:
        return self.max_verify_entries_per_step > 0


def verify_latency_bound(live_entries: int, max_entries_per_step: int, *, growth_per_step: int = 0) -> int:
    """Steps within which the bounded verify reaches every live prefix entry (its detection-latency bound).

    ``live_entries`` L: the entries of the plan's verify list; ``max_entries_per_step`` N (0: full verify, bound
    1); ``growth_per_step`` G: entries a step may insert into the list ahead of an entry (in decode, one per
    request row that grows). With an unchanging list the cursor visits every entry once in ``ceil(L / N)``
    steps. When entries are inserted, an entry waits at most for the rest of the cursor's current pass (it may
    have been inserted just behind the cursor) and then for its place in the next pass, and a pass over a list
    that grows by G entries a step takes at most ``ceil(L / (N - G))`` steps: the bound is twice that, for
    N > G (otherwise the cursor may never catch up and no bound holds: -1)."""
    if max_entries_per_step <= 0 or live_entries <= max_entries_per_step:
        return 1
    if growth_per_step == 0:
        return -(-live_entries // max_entries_per_step)
    if max_entries_per_step <= growth_per_step:
        return -1
    return 2 * -(-live_entries // (max_entries_per_step - growth_per_step))


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
        # one plan launch takes at most MAX_PLAN_BATCH_SIZE rows: refused here, before anything is allocated
        int_arg(self.max_batch_size, "Capacities.max_batch_size", minimum=1, maximum=MAX_PLAN_BATCH_SIZE)
        int_arg(self.max_tokens, "Capacities.max_tokens", minimum=1)
        for name in ("verify_capacity", "max_context_len", "pool_rows", "max_history_tokens", "max_sweep_slots"):
            value = getattr(self, name)
            if value is not None:
                int_arg(value, f"Capacities.{name}", minimum=1, maximum=(1 << 31) - 1)
