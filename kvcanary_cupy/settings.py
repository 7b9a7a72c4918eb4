"""The ``KVCANARY_*`` environment variables: each one's name, documented range and parser, in one place.

Every variable the package reads is a :class:`Setting` of :data:`SETTINGS`. :func:`read` parses one (None when it
is unset or empty) and refuses a value outside its documented range with a ``kv-canary: `` ValueError that names
the variable: nothing is clamped, rounded or guessed. Each variable is read where the thing it configures is first
used, before that thing writes anything (a host module build checks the cache and thread variables before it
creates its folder; the vLLM plugin checks its own when vLLM registers it); :func:`problems` lists every bad one at
once, for a report such as ``kvcanary info``. ``docs/backends.md`` holds the same table for users (a test keeps
the two equal).
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ._errors import fail

__all__ = ["SETTINGS", "VLLM_PREFIX", "Setting", "problems", "read", "unknown_vllm_variables"]

VLLM_PREFIX = "KVCANARY_VLLM"

_DIGITS = re.compile(r"[0-9]+")
_DECIMAL = re.compile(r"[0-9]+(?:\.[0-9]+)?")


@dataclass(frozen=True)
class Setting:
    """One environment variable: ``allowed`` is its documented range as a refusal states it; ``parse`` turns a
    value inside that range into what the package uses and returns None for any other value."""

    name: str
    allowed: str
    parse: Callable[[str], Any]

    def value(self, raw: str) -> Any:
        parsed = self.parse(raw)
        if parsed is None:
            fail(f"{self.name} must be {self.allowed}, got {raw!r}")
        return parsed


def _integer(lo: int, hi: int) -> Callable[[str], int | None]:
    """Plain ASCII digits (no sign, no blanks, no underscores) from ``lo`` to ``hi``."""

    def parse(raw: str) -> int | None:
        if not _DIGITS.fullmatch(raw):
            return None
        value = int(raw)
        return value if lo <= value <= hi else None

    return parse


def _decimal(lo: float, hi: float) -> Callable[[str], float | None]:
    """A plain decimal number (``512``, ``0.5``) from ``lo`` to ``hi``: no sign, exponent, ``inf`` or ``nan``."""

    def parse(raw: str) -> float | None:
        if not _DECIMAL.fullmatch(raw):
            return None
        value = float(raw)
        return value if math.isfinite(value) and lo <= value <= hi else None

    return parse


def _choice(mapping: Mapping[str, Any]) -> Callable[[str], Any]:
    return lambda raw: mapping.get(raw)


def _any_text(raw: str) -> str:
    return raw


def _fault(raw: str) -> tuple[str, int, int | None] | None:
    """``<kind>[@<step>][:rank<R>]``: a fault kind of the vLLM integration, armed at ``step`` (default 3), in the
    worker of tensor-parallel rank ``R`` only when given (else in every worker)."""
    from .integrations.vllm.faults import FAULT_KINDS

    spec, colon, where = raw.partition(":")
    rank: int | None = None
    if colon:
        if not where.startswith("rank") or not _DIGITS.fullmatch(where[4:]):
            return None
        rank = int(where[4:])
        if rank > _INT32_MAX:
            return None
    kind, at, step = spec.partition("@")
    if kind not in FAULT_KINDS or (at and not _DIGITS.fullmatch(step)):
        return None
    value = int(step) if at else 3
    return (kind, value, rank) if value <= _INT32_MAX else None


def _connector_name(raw: str) -> str | None:
    """A connector class name as vLLM's factory registers them (letters, digits, ``_``), not the wrapper's own."""
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", raw) or raw == "CanaryConnector":
        return None
    return raw


_INT32_MAX = (1 << 31) - 1
_BOOL_WORDS = {"1": True, "true": True, "yes": True, "0": False, "false": False, "no": False}
_FAULT_KINDS_TEXT = ("<kind>[@<step>][:rank<R>] with a kind of kvcanary_cupy.integrations.vllm.faults.FAULT_KINDS, "
                     "a step and a rank from 0 to 2147483647")

#: Every ``KVCANARY_*`` variable the package reads (tests' own variables are not the package's).
SETTINGS: dict[str, Setting] = {s.name: s for s in (
    Setting("KVCANARY_CACHE_DIR", "a folder path", _any_text),
    Setting("KVCANARY_CACHE_MAX_MB", "a number of MiB from 0 to 1048576 (such as 512 or 0.5)",
            _decimal(0, 1 << 20)),
    Setting("KVCANARY_HOST_SANITIZE", "0 (off), 1 (AddressSanitizer and UBSan) or thread (ThreadSanitizer)",
            _choice({"0": "off", "1": "address", "thread": "thread"})),
    Setting("KVCANARY_HOST_THREADS", "an integer from 1 to 256", _integer(1, 256)),
    Setting("KVCANARY_HOST_SPIN_US", "an integer from 0 to 1000000 (microseconds)", _integer(0, 1_000_000)),
    Setting("KVCANARY_MAX_ALLOCATION_BYTES", "a positive integer number of bytes, at most 2**63 - 1",
            _integer(1, (1 << 63) - 1)),
    Setting("KVCANARY_DEBUG", "0 or 1", _choice({"0": False, "1": True})),
    Setting("KVCANARY_REPLAY_SANITIZED_CHILD", "1 (set by kvcanary replay --sanitize for its child)",
            _choice({"1": True})),
    Setting(VLLM_PREFIX, "log, raise or off", _choice({m: m for m in ("log", "raise", "off")})),
    Setting(f"{VLLM_PREFIX}_REAL_KV_HASH", "partial, all or none",
            _choice({m: m for m in ("partial", "all", "none")})),
    Setting(f"{VLLM_PREFIX}_WITH_V", "1 or 0 (or true/false, yes/no)", _choice(_BOOL_WORDS)),
    Setting(f"{VLLM_PREFIX}_BACKEND", "auto, numpy, host or cuda",
            _choice({b: b for b in ("auto", "numpy", "host", "cuda")})),
    Setting(f"{VLLM_PREFIX}_RING_CAPACITY", "an integer from 1 to 2147483647", _integer(1, _INT32_MAX)),
    Setting(f"{VLLM_PREFIX}_SWEEP_INTERVAL", "an integer from 0 (off) to 2147483647", _integer(0, _INT32_MAX)),
    # the range of CanaryConfig.log_rows (runtime/config.py), which checks the value again
    Setting(f"{VLLM_PREFIX}_LOG_ROWS", "an integer from 0 to 1000", _integer(0, 1000)),
    Setting(f"{VLLM_PREFIX}_ALLOW_UNTESTED", "1 or 0 (or true/false, yes/no)", _choice(_BOOL_WORDS)),
    Setting(f"{VLLM_PREFIX}_FAULT", _FAULT_KINDS_TEXT, _fault),
    # the kv_connector of --kv-transfer-config that the canary connector wraps (integrations/vllm/connector.py)
    Setting(f"{VLLM_PREFIX}_CONNECTOR", "the name of a vLLM KV connector (the kv_connector of --kv-transfer-config)",
            _connector_name),
    Setting(f"{VLLM_PREFIX}_CONNECTOR_ON_REFUSED", "report or load-error",
            _choice({m: m for m in ("report", "load-error")})),
)}


def read(name: str, environ: Mapping[str, str] | None = None) -> Any:
    """The parsed value of variable ``name`` (None when unset or empty); a value outside its range is refused."""
    raw = (os.environ if environ is None else environ).get(name)
    if raw is None or raw == "":
        return None
    return SETTINGS[name].value(raw)


def unknown_vllm_variables(environ: Mapping[str, str] | None = None) -> list[str]:
    """``KVCANARY_VLLM_*`` names that are not variables of the plugin (a misspelt option would be ignored)."""
    env = os.environ if environ is None else environ
    return sorted(k for k in env if k.startswith(f"{VLLM_PREFIX}_") and k not in SETTINGS)


def problems(environ: Mapping[str, str] | None = None) -> list[str]:
    """What is wrong with the ``KVCANARY_*`` variables that are set, one message per variable (empty: none)."""
    env = os.environ if environ is None else environ
    found = []
    for name in SETTINGS:
        try:
            read(name, env)
        except ValueError as exc:
            found.append(str(exc))
    found += [f"kv-canary: {name} is not a variable of the vLLM plugin (known: "
              f"{', '.join(n for n in SETTINGS if n.startswith(VLLM_PREFIX))})"
              for name in unknown_vllm_variables(env)]
    return found
