"""What a simulation run depends on: the engine presets (:data:`PRESETS`), the run's options
(:class:`SimConfig`, validated with messages naming the command-line option), and the backend they resolve to."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..backends import BACKEND_NAMES, auto_choice, available_backends, log_auto_choice, unavailable_reason
from .faults import ALL_FAULT_KINDS
from .workload import WorkloadShape

LAYOUTS = ("token", "block", "csr")

# ---- presets -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Preset:
    name: str
    description: str
    shape: WorkloadShape
    max_running: int
    chunk_size: int
    swa_window: int = 0
    eagle: bool = False
    page_size: int = 16


PRESETS: dict[str, Preset] = {
    "decode": Preset(
        "decode", "short prompts, long generations; decode batches padded to CUDA-graph sizes",
        WorkloadShape(system_len=(16, 48), suffix_len=(4, 32), output_len=(48, 128), p_system=0.6,
                      p_followup=0.25, max_total_len=640),
        max_running=16, chunk_size=256),
    "prefill": Preset(
        "prefill", "long prompts in chunked prefill, short generations",
        WorkloadShape(system_prompts=3, system_len=(64, 192), suffix_len=(96, 384), output_len=(2, 8),
                      p_system=0.7, p_followup=0.1, max_total_len=768),
        max_running=8, chunk_size=128),
    "swa": Preset(
        "swa", "a sliding-window (SWA) group next to the full one: LUT, eviction outside the window",
        WorkloadShape(system_len=(16, 64), suffix_len=(16, 96), output_len=(24, 96), p_followup=0.25,
                      max_total_len=640),
        max_running=16, chunk_size=64, swa_window=32),
    "eagle": Preset(
        "eagle", "an EAGLE draft pool (offset +1) next to the target",
        WorkloadShape(system_len=(16, 64), suffix_len=(8, 96), output_len=(16, 96), p_followup=0.25,
                      max_total_len=640),
        max_running=16, chunk_size=96, eagle=True),
    "mixed": Preset(
        "mixed", "everything at once: chunked prefill and decode in one batch, prefix sharing, SWA and EAGLE",
        WorkloadShape(system_len=(16, 96), suffix_len=(8, 160), output_len=(4, 96), p_system=0.55,
                      p_followup=0.25, max_total_len=640),
        max_running=16, chunk_size=96, swa_window=48, eagle=True),
}


MAX_STEPS = 100_000
MAX_REQUESTS = 100_000
MAX_RING_CAPACITY = 1 << 24
MIN_RATE = 1e-6
MAX_BLOCK_SIZE = 4096


@dataclass(frozen=True)
class SimConfig:
    """Everything a run depends on; the report is a deterministic function of it (timings aside)."""

    preset: str = "mixed"
    steps: int = 200
    requests: int = 48
    seed: int = 0
    backend: str = "auto"
    inject: dict[str, float] = field(default_factory=dict)
    sweep_interval: int = 8
    with_v: bool = False
    real_kv_hash: str = "all"
    warmup_steps: int = 4
    cooldown_steps: int | None = None  # default: min(16, steps // 5)
    ring_capacity: int = 16384  # per canary group
    dump_dir: str | None = None
    canary_mode: str = "log"  # the runtime's mode: "log" (attribute every row) or "raise" (stop at the first)
    layout: str = "token"  # the slot layout the plan reads: token (req_to_token), block (block table), csr
    block_size: int | None = None  # block and csr layouts: tokens per KV block (None: the preset's page size)
    block_stride: int | None = None  # block layout: slots between consecutive block ids (None: block_size)
    tiers: tuple[str, ...] = ()  # lower KV tiers: "host" (L2 in host memory), "disk" (L3 files; needs host)
    tier_dir: str | None = None  # the L3 directory (None: a temporary one)
    max_verify_entries: int = 0  # the bounded verify: at most N verify entries per step and group (0: full verify)

    @property
    def blocks(self) -> tuple[int, int]:
        """``(block_size, block_stride)`` of the engine: ``(1, 1)`` in the token layout."""
        if self.layout == "token":
            return 1, 1
        size = PRESETS[self.preset].page_size if self.block_size is None else self.block_size
        return size, size if self.block_stride is None else self.block_stride

    @property
    def cooldown(self) -> int:
        return min(16, self.steps // 5) if self.cooldown_steps is None else self.cooldown_steps

    def validate(self) -> None:
        """Raise ValueError with a message naming the option for anything that cannot run."""
        if self.preset not in PRESETS:
            raise ValueError(f"--preset {self.preset!r} is unknown; choose from {', '.join(PRESETS)}")
        # Upper limits: far above any useful run, and below what would exhaust memory or run for days.
        if not 1 <= self.steps <= MAX_STEPS:
            raise ValueError(f"--steps must lie in [1, {MAX_STEPS}], got {self.steps}")
        if not 1 <= self.requests <= MAX_REQUESTS:
            raise ValueError(f"--requests must lie in [1, {MAX_REQUESTS}], got {self.requests}")
        for kind, rate in self.inject.items():
            if not MIN_RATE <= rate <= 1:  # NaN fails too
                raise ValueError(f"--inject {kind}:{rate}: the rate must lie in [{MIN_RATE}, 1] (expected "
                                 "injections per step)")
        if self.sweep_interval < 0:
            raise ValueError(f"--sweep-interval must be >= 0 (0 disables the sweep), got {self.sweep_interval}")
        if not 0 <= self.max_verify_entries <= (1 << 31) - 1:
            raise ValueError(f"--max-verify-entries must lie in [0, {(1 << 31) - 1}] (0: full verify), got "
                             f"{self.max_verify_entries}")
        if self.real_kv_hash not in ("all", "partial"):
            raise ValueError(f"--real-kv-hash must be 'all' or 'partial', got {self.real_kv_hash!r}")
        if self.warmup_steps < 0 or self.cooldown < 0:
            raise ValueError("--warmup and --cooldown must be >= 0")
        if not 1 <= self.ring_capacity <= MAX_RING_CAPACITY:
            raise ValueError(f"--ring-capacity must lie in [1, {MAX_RING_CAPACITY}], got {self.ring_capacity}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"--layout must be one of {', '.join(LAYOUTS)}, got {self.layout!r}")
        if self.block_size is not None and (self.layout == "token" or not 1 <= self.block_size <= MAX_BLOCK_SIZE):
            raise ValueError(f"--block-size applies to --layout block or csr and must lie in [1, {MAX_BLOCK_SIZE}], "
                             f"got {self.block_size} with --layout {self.layout}")
        size = self.blocks[0]
        if self.block_stride is not None and (self.layout != "block" or not size <= self.block_stride
                                              <= MAX_BLOCK_SIZE):
            raise ValueError(f"--block-stride applies to --layout block and must lie in [block size {size}, "
                             f"{MAX_BLOCK_SIZE}], got {self.block_stride} with --layout {self.layout}")
        if self.canary_mode not in ("log", "raise"):
            raise ValueError(f"canary_mode must be 'log' or 'raise', got {self.canary_mode!r}")
        if self.backend not in ("auto", *BACKEND_NAMES):
            raise ValueError(f"--backend {self.backend!r} is unknown; choose from auto, {', '.join(BACKEND_NAMES)}")
        for tier in self.tiers:
            if tier not in ("host", "disk"):
                raise ValueError(f"--tiers takes host and disk (host,disk), got {tier!r}")
        if self.tiers and (self.tiers[0] != "host" or len(set(self.tiers)) != len(self.tiers)):
            raise ValueError(f"--tiers must be host or host,disk (pages reach disk through host memory), got "
                             f"{','.join(self.tiers)}")
        if self.tier_dir is not None and "disk" not in self.tiers:
            raise ValueError("--tier-dir applies to --tiers host,disk")
        preset = PRESETS[self.preset]
        for kind in self.inject:
            if kind not in ALL_FAULT_KINDS:
                raise ValueError(f"unknown fault kind {kind!r}; choose from {', '.join(ALL_FAULT_KINDS)}")
            if ALL_FAULT_KINDS[kind].needs in ("tiers", "disk") and not self.tiers:
                raise ValueError(f"--inject {kind} needs a KV hierarchy (--tiers host,disk)")
            if ALL_FAULT_KINDS[kind].needs == "disk" and "disk" not in self.tiers:
                raise ValueError(f"--inject {kind} needs the L3 disk tier (--tiers host,disk)")
            if ALL_FAULT_KINDS[kind].needs == "swa" and not preset.swa_window:
                swa_presets = [p.name for p in PRESETS.values() if p.swa_window]
                raise ValueError(f"--inject {kind} needs an SWA group; preset {self.preset!r} has none "
                                 f"(use --preset {' or '.join(swa_presets)})")
        if self.inject and self.warmup_steps >= self.steps - self.cooldown:
            raise ValueError(f"no step is left to inject faults: --steps {self.steps} with a warm-up of "
                             f"{self.warmup_steps} and a cool-down of {self.cooldown} steps")


def applicable_kinds(preset: str, tiers: tuple[str, ...] = ()) -> list[str]:
    """Fault kinds that the preset's engine can host (``--inject all`` means these); the tier kinds only with
    ``--tiers`` (the disk ones with the disk tier)."""
    has = {"swa": bool(PRESETS[preset].swa_window), "tiers": bool(tiers), "disk": "disk" in tiers, "": True}
    return [k for k, kind in ALL_FAULT_KINDS.items() if has[kind.needs]]


def resolve_backend(name: str) -> tuple[str, Any, str]:
    """(backend name, array module, device) for a ``--backend`` value; ValueError when unavailable."""
    if name == "auto":
        on_device = unavailable_reason("cuda") is None
        name, why = ("cuda", "a CUDA device is available") if on_device else auto_choice("cpu", "flag")
        log_auto_choice(name, why)
    reason = unavailable_reason(name)
    if reason is not None:
        raise ValueError(f"--backend {name} is not available here: {reason} "
                         f"(available: {', '.join(available_backends())})")
    if name == "cuda":
        import cupy

        return name, cupy, "cuda"
    return name, np, "cpu"
