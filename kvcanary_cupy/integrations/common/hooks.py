"""Instance overrides an engine integration sets on the engine's objects (wrapped methods, its own marker) and
takes out again: :class:`InstanceOverrides`, the base of every installed canary (``remove()``, and the context
manager that finishes and removes it)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, TypeVar

from ..._errors import fail

_Self = TypeVar("_Self", bound="InstanceOverrides")


class InstanceOverrides(ABC):
    """Attributes set on engine instances (never on their classes), so that deleting them restores the class's
    own methods; refuses to stack on an attribute something else already overrides on the instance."""

    installed: bool

    def __init__(self) -> None:
        self._wrapped: list[tuple[Any, str]] = []  # (object, attribute) set on instances, deleted by remove()

    def _set(self, obj: Any, name: str, value: Any) -> None:
        if name in vars(obj):
            fail(f"{type(obj).__name__}.{name} is already overridden on this instance; refusing to stack hooks")
        setattr(obj, name, value)
        self._wrapped.append((obj, name))

    def _unset_all(self) -> None:
        """Delete every instance attribute :meth:`_set` set, newest first."""
        for obj, name in reversed(self._wrapped):
            if name in vars(obj):
                delattr(obj, name)
        self._wrapped.clear()
        self.installed = False

    @abstractmethod
    def finish(self) -> Any:
        """Read what the last step appended (each engine's canary knows how)."""

    @abstractmethod
    def remove(self) -> None:
        """Take the canary out again: the engine's own methods back."""

    def __enter__(self: _Self) -> _Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.finish()
        self.remove()
