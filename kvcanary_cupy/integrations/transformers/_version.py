"""The transformers versions this integration is tested against, and the check that refuses the others."""

from __future__ import annotations

import re

from ..._errors import fail

SUPPORTED_RANGE = ">=5.24,<5.25"
_LOW, _HIGH = (5, 24), (5, 25)


def parse_version(text: str) -> tuple[int, int]:
    """``"5.24.0"`` -> ``(5, 24)``; patch, pre-release and local parts are ignored."""
    match = re.match(r"(\d+)\.(\d+)", text)
    if match is None:
        fail(f"transformers version {text!r} cannot be parsed; supported: transformers{SUPPORTED_RANGE}")
    return int(match.group(1)), int(match.group(2))


def check_version(version: str | None = None) -> str:
    """Return the installed (or given) transformers version; ``kv-canary:`` ValueError outside the tested range.

    The continuous-batching internals the canary hooks change between minor releases, so anything outside
    the range the tests ran on is refused instead of being hooked blindly."""
    if version is None:
        try:
            import transformers
        except ImportError:
            fail(f"the transformers integration needs transformers{SUPPORTED_RANGE} "
                 "(pip install 'kvcanary_cupy[transformers]')")
        version = str(transformers.__version__)
    if not _LOW <= parse_version(version) < _HIGH:
        fail(f"transformers {version} is not supported by kvcanary_cupy.integrations.transformers; "
             f"supported: transformers{SUPPORTED_RANGE} (pip install 'kvcanary_cupy[transformers]')")
    return version
