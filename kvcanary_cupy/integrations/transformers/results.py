"""What a ``kvcanary simulate --engine transformers`` run records: its configuration, each ``generate_batch``'s
result and the whole simulation's outcome. :mod:`.simulate` fills them, :mod:`.report` reads them; neither of
those two imports the other at module level.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..common.records import EngineSimConfig, EngineSimulation, RunRecord
from .faults import FAULT_KINDS
from .workloads import MODEL_SIZES, workloads


@dataclass(frozen=True)
class TransformersSimConfig(EngineSimConfig):
    model_size: str = "small"
    inject_at: int = 4
    max_verify_entries: int = 0  # the runtime's bounded verify (0: every prefix slot every step)

    def validate(self) -> None:
        from ..._errors import fail
        from ._version import check_version

        check_version()
        if self.model_size not in MODEL_SIZES:
            fail(f"--model-size must be one of {', '.join(MODEL_SIZES)}, got {self.model_size!r}")
        if not 0 <= self.max_verify_entries <= (1 << 31) - 1:
            fail(f"--max-verify-entries must lie in [0, {(1 << 31) - 1}] (0: full verify), got "
                 f"{self.max_verify_entries}")
        self.check_choices("transformers", fault_kinds=FAULT_KINDS, workloads=workloads(),
                           backend_note=" on a CPU model")


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
class RunResult(RunRecord):
    tokens: dict[str, list[int]]  # request id -> generated tokens
    errors: dict[str, str]  # request id -> the engine's error, for requests that failed


class SimulationRecord(EngineSimulation[TransformersSimConfig, RunResult]):
    """The outcome of a simulation; ``wall`` and ``total_steps`` are set when the run finishes."""
