"""The NVRTC availability probe of the compile tests: "not installed" skips, any other load failure fails."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from nvrtc_probe import nvrtc_or_skip


def binding(error: BaseException | None) -> SimpleNamespace:
    def get_version():
        if error is not None:
            raise error
        return (12, 9)
    return SimpleNamespace(getVersion=get_version)


def test_a_loadable_nvrtc_is_returned():
    module = binding(None)
    assert nvrtc_or_skip(module) is module


def test_a_missing_nvrtc_library_skips():
    pathfinder = pytest.importorskip("cuda.pathfinder", reason="CuPy 14 (and cuda-pathfinder) is not installed")
    with pytest.raises(pytest.skip.Exception, match="the NVRTC library is not installed"):
        nvrtc_or_skip(binding(pathfinder.DynamicLibNotFoundError("libnvrtc.so.12 not found")))


BROKEN = [OSError("libnvrtc.so.12: invalid ELF header"), RuntimeError("symbol not found"),
          ImportError("undefined symbol: nvrtcGetCUBIN")]


@pytest.mark.parametrize("error", BROKEN, ids=["oserror", "runtime", "import"])
def test_a_broken_nvrtc_fails_instead_of_skipping(error):
    try:
        with pytest.raises(AssertionError, match="NVRTC is installed but does not load"):
            nvrtc_or_skip(binding(error))
    except pytest.skip.Exception as skip:
        pytest.fail(f"a broken NVRTC was turned into a skip: {skip}")


def test_the_real_binding_here_loads_or_is_not_installed():
    """On this machine: either NVRTC loads, or the probe says why it is not installed (a skip), never an error
    turned into a skip."""
    try:
        module = nvrtc_or_skip()
    except pytest.skip.Exception as skip:
        assert "not installed" in str(skip)
        return
    assert module.getVersion()[0] >= 11
