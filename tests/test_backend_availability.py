"""The cuda backend counts as available only where NVRTC loads, and the library reports its choices on the
``kvcanary_cupy`` logger without printing anything."""

from __future__ import annotations

import logging
import types

import numpy as np
import pytest

import kvcanary_cupy as kc
import kvcanary_cupy.backends as backends
import kvcanary_cupy.backends.cuda as cuda_backend
from kvcanary_cupy.sim.runner import resolve_backend as sim_backend

MISSING = "CuPy failed to load libnvrtc.so.13: OSError: libnvrtc.so.13: cannot open shared object file"


def fake_cupy(nvrtc_error: str | None) -> types.SimpleNamespace:
    """A CuPy that sees one GPU; its NVRTC loads, or fails the way a CuPy without the NVRTC wheel does."""

    def get_version() -> tuple[int, int]:
        if nvrtc_error is not None:
            raise RuntimeError(nvrtc_error)
        return (13, 0)

    cuda = types.SimpleNamespace(runtime=types.SimpleNamespace(getDeviceCount=lambda: 1),
                                 nvrtc=types.SimpleNamespace(getVersion=get_version))
    return types.SimpleNamespace(__version__="14.2.0", cuda=cuda)


@pytest.fixture
def with_cupy(monkeypatch):
    def install(nvrtc_error: str | None) -> None:
        monkeypatch.setattr(cuda_backend, "cupy_module", lambda: fake_cupy(nvrtc_error))
        backends.unavailable_reason.cache_clear()

    yield install
    backends.unavailable_reason.cache_clear()


def test_a_gpu_without_a_loadable_nvrtc_is_not_a_cuda_backend(with_cupy, caplog):
    with_cupy(MISSING)
    with caplog.at_level(logging.INFO, logger="kvcanary_cupy"):
        reason = backends.unavailable_reason("cuda")
    assert reason is not None and "cannot load NVRTC" in reason and "libnvrtc.so.13" in reason
    assert "cuda12 or cuda13 extra" in reason
    assert "cuda" not in kc.available_backends()
    # auto falls back to a CPU backend instead of crashing at the first compile
    assert sim_backend("auto")[0] == ("host" if backends.unavailable_reason("host") is None else "numpy")
    assert any(r.name.startswith("kvcanary_cupy") and "backend cuda is unavailable" in r.getMessage()
               for r in caplog.records)


def test_a_gpu_whose_nvrtc_loads_is_a_cuda_backend(with_cupy):
    with_cupy(None)
    assert backends.unavailable_reason("cuda") is None and "cuda" in kc.available_backends()
    assert cuda_backend.nvrtc_version() == (13, 0)


def test_the_library_logs_its_backend_choice_and_host_compiles_and_prints_nothing(tmp_path, monkeypatch, caplog,
                                                                                 capfd):
    if backends.unavailable_reason("host") is not None:
        pytest.skip(f"host backend: {backends.unavailable_reason('host')}")
    from kvcanary_cupy.hostcuda import HostModule

    monkeypatch.setenv("KVCANARY_CACHE_DIR", str(tmp_path))
    backends.log_auto_choice.cache_clear()
    code = 'extern "C" __global__ void k(int* p) { p[threadIdx.x] = 1; }'
    with caplog.at_level(logging.DEBUG, logger="kvcanary_cupy"):
        HostModule(code, name="log_probe")
        HostModule(code, name="log_probe")  # the second comes from the cache
        vp = kc.VerifyPlan.allocate(verify_capacity=4)
        wp = kc.WritePlan.allocate(write_req_capacity=1)
        kc.launch_canary_plan_kernels(
            verify_plan_out=vp, write_plan_out=wp, req_pool_indices=np.array([1]), prefix_lens=np.array([2]),
            extend_seq_lens=np.array([1]), req_to_token=np.arange(8, dtype=np.int32).reshape(2, 4),
            swa_window_size=0, full_to_swa_index_mapping=None, verify_capacity=4)
    messages = [(r.levelno, r.getMessage()) for r in caplog.records if r.name.startswith("kvcanary_cupy")]
    assert any(level == logging.INFO and "compiling host module 'log_probe'" in m for level, m in messages)
    assert any(level == logging.INFO and "compiled host module 'log_probe'" in m for level, m in messages)
    assert any(level == logging.DEBUG and "cached build" in m for level, m in messages)
    assert any(level == logging.INFO and m.startswith("kv-canary backend auto: numpy (the launcher's default "
                                                      "on_invalid raises") for level, m in messages)
    assert capfd.readouterr() == ("", "")
    assert any(isinstance(h, logging.NullHandler) for h in logging.getLogger("kvcanary_cupy").handlers)
