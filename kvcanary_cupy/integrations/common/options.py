"""The options every engine's canary takes (:class:`EngineCanaryOptions`: mode, real-KV hashing, V endpoints,
backend, ring size, sweep interval, logger, rows spelled out per log line) and how they become the runtime's
:class:`CanaryConfig`. Each engine's ``CanaryOptions`` derives from it, sets its own logger and checks the fields
its own way."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

from ..._errors import fail
from ..._validate import bool_arg, int_arg
from ...backends import BACKEND_NAMES, auto_choice, available_backends, unavailable_reason
from ...runtime import CanaryConfig
from ...runtime.config import MAX_LOG_ROWS
from ...runtime.reporting import DEFAULT_LOG_ROWS

Options = TypeVar("Options", bound="EngineCanaryOptions")


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
    log_rows: int = DEFAULT_LOG_ROWS

    # the real_kv_hash values an engine supports
    REAL_KV_HASH_CHOICES: ClassVar[tuple[str, ...]] = ("none", "partial", "all")

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Every field strictly (a ``kv-canary: `` error naming ``CanaryOptions.<field>``): no truthiness, no
        arrays, no conversion. Run at construction and again before use (the fields are mutable)."""
        for name, choices in (("mode", ("off", "log", "raise")), ("real_kv_hash", self.REAL_KV_HASH_CHOICES),
                              ("backend", ("auto", *BACKEND_NAMES))):
            value = getattr(self, name)
            # isinstance first: `in` on an array or an object with an odd __eq__ would not give a bool
            if not isinstance(value, str) or value not in choices:
                fail(f"CanaryOptions.{name} must be one of {', '.join(choices)}, got {value!r}")
        bool_arg(self.with_v, "CanaryOptions.with_v")
        int_arg(self.ring_capacity, "CanaryOptions.ring_capacity", minimum=1, maximum=(1 << 31) - 1)
        int_arg(self.sweep_interval, "CanaryOptions.sweep_interval", minimum=0)
        if not isinstance(self.logger, str) or not self.logger:
            fail(f"CanaryOptions.logger must be a non-empty str, got {self.logger!r}")
        int_arg(self.log_rows, "CanaryOptions.log_rows", minimum=0, maximum=MAX_LOG_ROWS)

    def backend_choice(self, device_kind: str = "cpu") -> tuple[str, str]:
        """The backend the runtime will run for a cache on a ``device_kind`` device, and why (``auto``: see
        :func:`kvcanary_cupy.backends.auto_choice`; the runtime's launches flag invalid device values)."""
        if self.backend != "auto":
            return self.backend, "set by CanaryOptions.backend"
        return auto_choice(device_kind, "flag")

    def log_install(self, where: str, device_kind: str = "cpu") -> None:
        """The one INFO line an install writes on the options' logger: where, the mode, and the backend with
        the reason it was chosen."""
        backend, why = self.backend_choice(device_kind)
        logging.getLogger(self.logger).info("kv-canary installed in %s (mode=%s, real_kv_hash=%s, backend=%s: %s)",
                                            where, self.mode, self.real_kv_hash, backend, why)

    @classmethod
    def from_install(cls: type[Options], options: Any, option_fields: dict[str, Any]) -> Options:
        """The options of an engine's ``install(target, options=None, **option_fields)``: a ``CanaryOptions`` of
        this class (validated again: its fields may have been changed), or one built from keyword fields; both,
        unknown fields, or any other object are refused."""
        if options is not None and option_fields:
            fail("give either options or option fields, not both")
        known = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(option_fields) - set(known))
        if unknown:
            fail(f"install() got unknown option field(s) {', '.join(unknown)}; CanaryOptions fields: "
                 f"{', '.join(known)}")
        if options is None:
            return cls(**option_fields)
        if not isinstance(options, cls):
            fail(f"options must be a CanaryOptions (or None), got {type(options).__name__}; pass option fields as "
                 "keywords instead, e.g. install(target, mode='raise')")
        options.validate()
        return options

    def runtime_config(self, **extra: Any) -> CanaryConfig:
        """The runtime's config of these options (``extra``: further :class:`CanaryConfig` fields). The write-input
        and verify-token asserts are always on: an engine's request state gives the expected tokens."""
        return CanaryConfig(mode=self.mode, ring_capacity=self.ring_capacity, real_kv_hash_mode=self.real_kv_hash,
                            write_input_assert=True, verify_token_assert=True, backend=self.backend,
                            sweep_interval=self.sweep_interval, logger=self.logger, log_rows=self.log_rows,
                            **extra)


#: The backends that run on each kind of device the engine's KV cache may live on.
DEVICE_BACKENDS = {"cpu": ("numpy", "host"), "cuda": ("cuda",)}


def backend_refusal(backend: str, device_kind: str) -> str | None:
    """Why ``backend`` cannot check a KV cache on a ``device_kind`` device (``"cpu"``, ``"cuda"``), or None when it
    can: asked at install, so that a backend the engine's device cannot run is refused before any step."""
    runs_here = DEVICE_BACKENDS.get(device_kind, ())
    if backend == "auto":
        return None if runs_here else f"no backend runs on a {device_kind} KV cache"
    if backend not in runs_here:
        return (f"backend {backend!r} cannot check this engine's KV cache, which is on {device_kind} (backends for "
                f"{device_kind}: {', '.join(runs_here) or 'none'}, or auto)")
    reason = unavailable_reason(backend)
    if reason is not None:
        return f"backend {backend!r} is not available here: {reason} (available: {', '.join(available_backends())})"
    return None
