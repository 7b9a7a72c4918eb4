"""The ``cuda`` backend: ``kernels/*.cu`` compiled by NVRTC through ``cupy.RawModule``, launched on CuPy's
current stream (which the DLPack bridge and the bind layer set to the caller's stream, e.g. torch's).

Each source file becomes one RawModule per process, compiled on first use. The kernel-source hash goes into
the options so that CuPy's on-disk cache, which keys on the main text only, never serves a build of an older
``canary_common.cuh``.
"""

from __future__ import annotations

import functools
import logging
import time
from typing import Any

import numpy as np

from ..dlpack import cupy_module
from .kernel_backend import KernelBackend, LaunchShape, kernel_source, kernels_dir, source_hash

log = logging.getLogger(__name__)


def nvrtc_options() -> tuple[str, ...]:
    """Options for every kernel module (also used by the NVRTC compile check)."""
    return ("-std=c++17", f"--include-path={kernels_dir()}", f"-DKVC_SOURCE_HASH=0x{source_hash()}ull")


def _cupy() -> Any:
    cupy = cupy_module()
    if cupy is None:
        raise RuntimeError("CuPy is not installed (install the cuda12 or cuda13 extra)")
    return cupy


def nvrtc_version() -> tuple[int, int]:
    """(major, minor) of the NVRTC that CuPy loads; raises when it cannot load one. Loading the library is
    all this costs (milliseconds): no compilation."""
    cupy = _cupy()
    major, minor = cupy.cuda.nvrtc.getVersion()
    return int(major), int(minor)


#: The NVIDIA driver's user-space library, which the CUDA runtime loads by this name.
DRIVER_LIBRARY = "libcuda.so.1"


def driver_loadable() -> bool:
    """Whether the NVIDIA driver's library loads in this process (it is on every machine with the driver)."""
    import ctypes

    try:
        ctypes.CDLL(DRIVER_LIBRARY)
    except OSError:
        return False
    return True


def cuda_unavailable_reason() -> str | None:
    """None when the cuda backend can compile and launch here: CuPy imports, a device is visible and NVRTC
    loads (a CuPy without a loadable NVRTC would fail at the first compile, mid-run)."""
    cupy = cupy_module()
    if cupy is None:
        return "CuPy is not installed (install the cuda12 or cuda13 extra)"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # no driver, or CUDA runtime libraries missing
        if not driver_loadable():  # the common case, said plainly rather than as the runtime's error code
            return f"no NVIDIA driver found ({DRIVER_LIBRARY} not loadable)"
        return f"CuPy cannot reach a CUDA device ({type(exc).__name__}: {exc})"
    if count <= 0:
        return "no CUDA device is visible"
    try:
        nvrtc_version()
    except Exception as exc:
        return (f"CuPy {cupy.__version__} cannot load NVRTC ({type(exc).__name__}: {exc}); install the cuda12 or "
                "cuda13 extra matching torch.version.cuda, which brings CuPy >= 14 and the NVRTC wheel")
    return None


@functools.cache
def _raw_module(file: str) -> Any:
    cupy = _cupy()
    started = time.perf_counter()
    module = cupy.RawModule(code=kernel_source(file), options=nvrtc_options())
    module.compile()  # now, not inside the first launch (which may be under CUDA-graph capture)
    log.info("compiled kernels/%s with NVRTC in %.2f s", file, time.perf_counter() - started)
    return module


def _gpu_shape() -> LaunchShape:
    cupy = _cupy()
    sms = int(cupy.cuda.Device().attributes["MultiProcessorCount"])
    return LaunchShape(
        plan_offsets_block=1024,
        plan_entries_grid=sms * 8,  # persistent: a fixed grid keeps launches graph-capturable
        plan_entries_block=128,
        verify_grid=64,
        verify_block=512,
        write_grid_max=1 << 30,  # one block per request
        write_block=64,
        scatter_grid_max=65535,
        scatter_block=256,
        transfer_grid_max=sms * 4,
        transfer_block=256,
    )


def make_cuda_backend() -> KernelBackend:
    return KernelBackend("cuda", _raw_module, _gpu_shape(), null=np.uint64(0))
