"""The ``cuda`` backend: ``kernels/*.cu`` compiled by NVRTC through ``cupy.RawModule``, launched on CuPy's
current stream (which the DLPack bridge and the bind layer set to the caller's stream, e.g. torch's).

Each source file becomes one RawModule per process, compiled on first use. The kernel-source hash goes into
the options so that CuPy's on-disk cache, which keys on the main text only, never serves a build of an older
``canary_common.cuh``.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from ..dlpack import cupy_module
from .kernel_backend import KernelBackend, LaunchShape, kernel_source, kernels_dir, source_hash


def nvrtc_options() -> tuple[str, ...]:
    """Options for every kernel module (also used by the NVRTC compile check)."""
    return ("-std=c++17", f"--include-path={kernels_dir()}", f"-DKVC_SOURCE_HASH=0x{source_hash()}ull")


def cuda_unavailable_reason() -> str | None:
    cupy = cupy_module()
    if cupy is None:
        return "CuPy is not installed (install the cuda12 or cuda13 extra)"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # no driver, or CUDA runtime libraries missing
        return f"CuPy cannot reach a CUDA device ({type(exc).__name__}: {exc})"
    return None if count > 0 else "no CUDA device is visible"


@functools.cache
def _raw_module(file: str) -> Any:
    cupy = cupy_module()
    return cupy.RawModule(code=kernel_source(file), options=nvrtc_options())


def _gpu_shape() -> LaunchShape:
    cupy = cupy_module()
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
