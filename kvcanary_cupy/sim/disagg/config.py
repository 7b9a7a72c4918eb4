"""What a disaggregated run depends on: the run's own options next to the synthetic engine's.

The workload, engine sizes, canary and sweep options mean what they mean for ``kvcanary simulate``
(:class:`~kvcanary_cupy.sim.SimConfig`); every process derives the same workload from the seed, the way a real
decode server learns a request's token ids from the router while its KV comes from the prefill server.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from ..config import PRESETS, SimConfig
from .faults import TRANSFER_KINDS

DEFAULT_PRESET = "decode"
# Every decode worker is a process of its own (its own interpreter, engine, KV pool and gloo connection, a few
# hundred MB), all forked at start-up and served one after the other by the single prefill process: past this
# many the run measures the machine's process table, not the canary.
MAX_DECODE_WORKERS = 16


@dataclass(frozen=True)
class DisaggConfig:
    """One prefill process and ``decode_workers`` decode processes; ``inject`` maps transfer fault kinds to the
    probability that one transfer carries that fault (each requested kind fires at least once)."""

    preset: str = DEFAULT_PRESET
    steps: int = 60  # prefill steps; decode workers then drain their requests
    requests: int = 16
    seed: int = 0
    backend: str = "auto"
    decode_workers: int = 2
    inject: dict[str, float] = field(default_factory=dict)
    sweep_interval: int = 8
    with_v: bool = False
    real_kv_hash: str = "all"
    warmup_steps: int = 2  # transfers before the first fault
    ring_capacity: int = 16384
    transfer_timeout_s: float = 30.0  # every send / receive, and the rendezvous
    deadline_s: float = 600.0  # the whole run, start-up included
    kill_decode_worker: tuple[int, int] | None = None  # fault drill: (worker, decode step) SIGKILLs itself

    def validate(self) -> None:
        """Raise ValueError naming the option for anything that cannot run."""
        self.side_config().validate()
        preset = PRESETS[self.preset]
        if preset.swa_window or preset.eagle:
            plain = [p.name for p in PRESETS.values() if not p.swa_window and not p.eagle]
            raise ValueError(f"--disaggregated ships the full KV pool only; preset {self.preset!r} has an SWA or "
                             f"EAGLE group (use --preset {' or '.join(plain)})")
        if not 1 <= self.decode_workers <= MAX_DECODE_WORKERS:
            raise ValueError(f"--decode-workers must be in 1..{MAX_DECODE_WORKERS}, got {self.decode_workers}: every "
                             "worker is a process of its own (interpreter, engine and KV pool), all started at once "
                             "and fed by one prefill process")
        for kind, rate in self.inject.items():
            if kind not in TRANSFER_KINDS:
                raise ValueError(f"unknown transfer fault kind {kind!r}; choose from {', '.join(TRANSFER_KINDS)}")
            if not 0 < rate <= 1:
                raise ValueError(f"--inject {kind}: the rate is a probability per transfer in (0, 1], got {rate}")
        if self.transfer_timeout_s <= 0 or self.deadline_s <= 0:
            raise ValueError("--transfer-timeout and the run deadline must be positive")
        if self.kill_decode_worker is not None:
            worker, step = self.kill_decode_worker
            if not 1 <= worker <= self.decode_workers or step < 0:
                raise ValueError(f"--kill-decode-worker {worker}@{step}: the worker must be in "
                                 f"1..{self.decode_workers} and the step >= 0")

    def side_config(self) -> SimConfig:
        """The per-process engine and canary options (faults are the transfer's, not the engine's)."""
        return SimConfig(preset=self.preset, steps=self.steps, requests=self.requests, seed=self.seed,
                         backend=self.backend, inject={}, sweep_interval=self.sweep_interval, with_v=self.with_v,
                         real_kv_hash=self.real_kv_hash, warmup_steps=self.warmup_steps, cooldown_steps=0,
                         ring_capacity=self.ring_capacity)

    def as_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["kill_decode_worker"] = list(self.kill_decode_worker) if self.kill_decode_worker else None
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DisaggConfig:
        data = dict(data)
        kill = data.get("kill_decode_worker")
        data["kill_decode_worker"] = tuple(kill) if kill else None
        return cls(**data)
