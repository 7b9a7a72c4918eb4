"""The ``host`` backend: the very same ``kernels/*.cu`` compiled by g++ and run on the CPU.

Blocks run one after another and the threads of a block as cooperative fibers (:mod:`kvcanary_cupy.hostcuda`),
so barriers and warp shuffles behave as on a GPU. This is how CI executes the kernels, and how a user replays
a GPU batch on a laptop, optionally under AddressSanitizer and UBSan (``sanitize=True``, which needs the
sanitizer runtime preloaded: ``LD_PRELOAD=$(g++ -print-file-name=libasan.so)``).
"""

from __future__ import annotations

import functools
from typing import Any

from .kernel_backend import KernelBackend, LaunchShape, kernel_source, kernels_dir, source_hash

# Few threads per launch: each host thread is a fiber, and the kernels are correct for any grid.
HOST_SHAPE = LaunchShape(
    plan_offsets_block=256,
    plan_entries_grid=2,
    plan_entries_block=64,
    verify_grid=2,
    verify_block=64,
    write_grid_max=8,
    write_block=32,
    scatter_grid_max=8,
    scatter_block=64,
    transfer_grid_max=4,
    transfer_block=64,
)


def make_host_backend(*, sanitize: bool = False, shape: LaunchShape = HOST_SHAPE) -> KernelBackend:
    from ..hostcuda import HostModule

    @functools.cache
    def load(file: str) -> Any:
        return HostModule(kernel_source(file), options=(f"-DKVC_SOURCE_HASH=0x{source_hash()}ull",),
                          include_dirs=(kernels_dir(),), sanitize=sanitize, name=file.removesuffix(".cu"))

    return KernelBackend("host", load, shape)
