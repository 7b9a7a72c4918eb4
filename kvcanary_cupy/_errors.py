"""The one way this package reports bad input: ``ValueError`` whose message starts ``kv-canary: ``."""

from __future__ import annotations

from typing import NoReturn

PREFIX = "kv-canary: "


def fail(message: str) -> NoReturn:
    """Raise the package's ValueError; ``message`` names the offending argument first."""
    raise ValueError(PREFIX + message)
