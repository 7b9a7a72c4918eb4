"""The version gate of an engine integration: the engine's minor releases it was tested against, and the check
that refuses every other (the internals the canary hooks change between minor releases)."""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass

from ..._errors import fail


@dataclass(frozen=True)
class VersionGate:
    """``package`` (the engine's import name) in ``supported_range`` (``">=A.B,<C.D"``, minor releases).

    ``missing`` is the message when the package is not installed; ``unsupported_hint`` is appended to the message
    that refuses a version outside the range."""

    package: str
    supported_range: str
    missing: str
    unsupported_hint: str = ""

    def bounds(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """``">=5.24,<5.25"`` -> ``((5, 24), (5, 25))``."""
        match = re.fullmatch(r">=(\d+)\.(\d+),<(\d+)\.(\d+)", self.supported_range)
        if match is None:
            raise AssertionError(f"supported range {self.supported_range!r} is not of the form >=A.B,<C.D")
        low_major, low_minor, high_major, high_minor = (int(g) for g in match.groups())
        return (low_major, low_minor), (high_major, high_minor)

    def parse(self, text: str) -> tuple[int, int]:
        """``"5.24.0"`` -> ``(5, 24)``; patch, pre-release and local parts are ignored."""
        match = re.match(r"(\d+)\.(\d+)", text)
        if match is None:
            fail(f"{self.package} version {text!r} cannot be parsed; supported: {self.package}{self.supported_range}")
        return int(match.group(1)), int(match.group(2))

    def check(self, version: str | None = None) -> str:
        """Return the installed (or given) version; ``kv-canary:`` ValueError outside the tested range."""
        if version is None:
            try:
                module = importlib.import_module(self.package)
            except ImportError:
                fail(self.missing)
            version = str(module.__version__)
        low, high = self.bounds()
        if not low <= self.parse(version) < high:
            fail(f"{self.package} {version} is not supported by kvcanary_cupy.integrations.{self.package}; "
                 f"supported: {self.package}{self.supported_range}{self.unsupported_hint}")
        return version
