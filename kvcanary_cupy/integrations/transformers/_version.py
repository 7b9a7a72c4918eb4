"""The transformers versions this integration is tested against, and the check that refuses the others."""

from __future__ import annotations

from ..common.version import VersionGate

SUPPORTED_RANGE = ">=5.24,<5.25"
_GATE = VersionGate("transformers", SUPPORTED_RANGE,
                    missing=f"the transformers integration needs transformers{SUPPORTED_RANGE} "
                            "(pip install 'kvcanary_cupy[transformers]')",
                    unsupported_hint=" (pip install 'kvcanary_cupy[transformers]')")


def parse_version(text: str) -> tuple[int, int]:
    """``"5.24.0"`` -> ``(5, 24)``; patch, pre-release and local parts are ignored."""
    return _GATE.parse(text)


def check_version(version: str | None = None) -> str:
    """Return the installed (or given) transformers version; ``kv-canary:`` ValueError outside the tested range.

    The continuous-batching internals the canary hooks change between minor releases, so anything outside
    the range the tests ran on is refused instead of being hooked blindly."""
    return _GATE.check(version)
