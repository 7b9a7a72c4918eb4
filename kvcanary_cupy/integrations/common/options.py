"""The options every engine's canary takes (:class:`EngineCanaryOptions`: mode, real-KV hashing, V endpoints,
backend, ring size, sweep interval, logger) and how they become the runtime's :class:`CanaryConfig`. Each engine's
``CanaryOptions`` derives from it, sets its own logger and checks the fields its own way."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...runtime import CanaryConfig


@dataclass
class EngineCanaryOptions:
    """The fields an engine's ``CanaryOptions`` shares with every other engine's (documented there)."""

    mode: str = "log"
    real_kv_hash: str = "partial"
    with_v: bool = True
    backend: str = "auto"
    ring_capacity: int = 4096
    sweep_interval: int = 8
    logger: str = "kvcanary_cupy"

    def runtime_config(self, **extra: Any) -> CanaryConfig:
        """The runtime's config of these options (``extra``: further :class:`CanaryConfig` fields). The write-input
        and verify-token asserts are always on: an engine's request state gives the expected tokens."""
        return CanaryConfig(mode=self.mode, ring_capacity=self.ring_capacity, real_kv_hash_mode=self.real_kv_hash,
                            write_input_assert=True, verify_token_assert=True, backend=self.backend,
                            sweep_interval=self.sweep_interval, logger=self.logger, **extra)
