"""The one way this package reports bad input: :class:`CanaryArgumentError`, a ``ValueError`` whose message
starts ``kv-canary: `` and names the offending argument first."""

from __future__ import annotations

from typing import NoReturn

PREFIX = "kv-canary: "


class CanaryArgumentError(ValueError):
    """Bad input to a public entry point, raised before any output is written.

    A ``ValueError`` subclass, so handlers written for ``ValueError`` keep working.
    """


def fail(message: str) -> NoReturn:
    """Raise :class:`CanaryArgumentError`; ``message`` names the offending argument first."""
    raise CanaryArgumentError(PREFIX + message)
