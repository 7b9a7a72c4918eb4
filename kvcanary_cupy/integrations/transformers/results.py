"""What a ``kvcanary simulate --engine transformers`` run records: its configuration, each ``generate_batch``'s
result and the whole simulation's outcome. :mod:`.simulate` fills them, :mod:`.report` reads them; neither of
those two imports the other at module level.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .canary import StepViolation
from .faults import FAULT_KINDS
from .workloads import MODEL_SIZES, workloads


@dataclass(frozen=True)
class TransformersSimConfig:
    model_size: str = "small"
    inject: tuple[str, ...] = ()
    seed: int = 0
    backend: str = "auto"
    real_kv_hash: str = "partial"
    with_v: bool = True
    inject_at: int = 4
    sweep_interval: int = 8
    workloads: tuple[str, ...] = ()  # empty: all

    def validate(self) -> None:
        from ..._errors import fail
        from ._version import check_version

        check_version()
        if self.model_size not in MODEL_SIZES:
            fail(f"--model-size must be one of {', '.join(MODEL_SIZES)}, got {self.model_size!r}")
        for kind in self.inject:
            if kind not in FAULT_KINDS:
                fail(f"unknown fault kind {kind!r} for --engine transformers; choose from {', '.join(FAULT_KINDS)}")
        if self.backend not in ("auto", "numpy", "host"):
            fail(f"--backend {self.backend} is not available with --engine transformers on a CPU model "
                 "(use auto, numpy or host)")
        known = workloads()
        for name in self.workloads:
            if name not in known:
                fail(f"unknown workload {name!r}; choose from {', '.join(known)}")


class WorkloadStats:
    """Counts what the engine did in a run, from the canary's batch hook (no engine internals beyond it)."""

    def __init__(self) -> None:
        self.prefill_tokens = 0
        self.decode_tokens = 0
        self.prefix_tokens_reused = 0
        self.soft_resets = 0
        self.peak_batch = 0
        self._seen: dict[str, int] = {}

    def before_batch(self, canary: Any, step: int, kwargs: dict[str, Any], requests: list[Any], cache: Any) -> None:
        self.peak_batch = max(self.peak_batch, len(requests))
        for future in requests:
            state, q = future.state, int(future.query_length)
            past = int(state.position_offset) - q
            rid = state.request_id
            if rid not in self._seen:
                self.prefix_tokens_reused += past
            elif past == 0 and self._seen[rid] > 0:
                self.soft_resets += 1
            self._seen[rid] = past + q
            prompt = max(0, min(past + q, len(state.initial_tokens)) - past)
            self.prefill_tokens += prompt
            self.decode_tokens += q - prompt

    def on_layer_write(self, canary: Any, step: int, allocator: Any, layer_idx: int, write_index: Any) -> Any:
        return write_index

    def after_forward(self, canary: Any, step: int, batch: Any, cache: Any) -> None:
        return None


@dataclass
class RunResult:
    workload: str
    kind: str | None
    steps: int
    step_offset: int
    tokens: dict[str, list[int]]
    errors: dict[str, str]
    violations: list[StepViolation]
    fault: Any
    stats: WorkloadStats
    seconds: dict[str, float]
    wall: float
    counters: dict[str, int]
    status_bits: int
    dropped: int
    health_problems: list[tuple[int, str]]


@dataclass
class SimulationRecord:
    """The outcome of a simulation; ``wall`` and ``total_steps`` are set when the run finishes."""

    cfg: TransformersSimConfig
    runs: list[RunResult] = field(default_factory=list)
    token_exact: dict[str, bool] = field(default_factory=dict)
    reference_wall: dict[str, float] = field(default_factory=dict)
    model_params: int = 0
    wall: float = 0.0
    total_steps: int = 0
