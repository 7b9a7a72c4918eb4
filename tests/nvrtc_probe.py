"""Whether the NVRTC tests can run here. Only "not installed" skips them: CuPy absent (its NVRTC module not
found) or the NVRTC library absent (``cuda.pathfinder.DynamicLibNotFoundError``, what CuPy 14 raises when no
wheel, toolkit or system copy of NVRTC exists). Any other failure to import or load NVRTC is a broken
installation, and fails the test that asked."""

from __future__ import annotations

import importlib
from types import ModuleType

import pytest

NVRTC_MODULE = "cupy_backends.cuda.libs.nvrtc"


def _not_installed_error() -> type[BaseException] | None:
    try:
        from cuda.pathfinder import DynamicLibNotFoundError
    except ModuleNotFoundError:  # no cuda-pathfinder: CuPy 14 (which brings it) is not installed
        return None
    return DynamicLibNotFoundError


def nvrtc_or_skip(module: ModuleType | None = None) -> ModuleType:
    """CuPy's NVRTC binding with the library loaded; skips (module level allowed) only when not installed.
    ``module``: the binding to probe (tests hand in stand-ins)."""
    if module is None:
        try:
            module = importlib.import_module(NVRTC_MODULE)
        except ModuleNotFoundError as exc:
            if exc.name is None or not NVRTC_MODULE.startswith(exc.name):
                raise  # CuPy is there but something it needs is not: broken, not absent
            pytest.skip(f"CuPy is not installed ({exc})", allow_module_level=True)
    not_installed = _not_installed_error()
    try:
        module.getVersion()
    except Exception as exc:
        if not_installed is not None and isinstance(exc, not_installed):
            pytest.skip(f"the NVRTC library is not installed: {exc}", allow_module_level=True)
        raise AssertionError(f"NVRTC is installed but does not load: {type(exc).__name__}: {exc}") from exc
    return module
