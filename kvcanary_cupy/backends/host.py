"""The ``host`` backend: the very same ``kernels/*.cu`` compiled by g++ and run on the CPU.

Blocks run on a pool of OS threads (docs/host-threads.md) and the threads of a block as cooperative fibers
(:mod:`kvcanary_cupy.hostcuda`), so barriers and warp shuffles behave as on a GPU. This is how CI executes the
kernels, how a CPU engine runs the canary on every core, and how a user replays a GPU batch on a laptop,
optionally under AddressSanitizer and UBSan (``sanitize=True``, which needs the
sanitizer runtime preloaded: ``LD_PRELOAD=$(g++ -print-file-name=libasan.so)``).
"""

from __future__ import annotations

import functools
from typing import Any

from .kernel_backend import KernelBackend, LaunchShape, kernel_source, kernels_dir, source_hash

# Few threads per block: each host thread is a fiber that runs its share of a block's work after the one
# before it, so more of them only add fiber starts and switches (one for the write, whose barriers would
# switch every fiber of a block, and for the scatter; 8 for the verify and the plan's entries, 32 for the
# plan's warp scans), and the kernels are correct for any grid and block. A decode step's write of 8 tokens:
# 2.8 us of CPU with one thread a block, 9.9 us with 8 (the bench geometry of docs/costs.md, "vLLM"). On a pool of
# OS threads (docs/host-threads.md) a launch with at least 2 x HOST_MIN_WORK_PER_BLOCK entries, tokens or
# records gets one block per HOST_MIN_WORK_PER_BLOCK of them, at most HOST_BLOCKS_PER_THREAD per OS thread (a
# few, so that a thread the OS delays holds up only a small share of the launch); a smaller launch keeps
# the grids below and runs on the calling thread alone, since waking a pool worker costs more than it saves.
HOST_MIN_WORK_PER_BLOCK = 1024
HOST_BLOCKS_PER_THREAD = 4
HOST_SHAPE = LaunchShape(
    plan_offsets_block=32,
    plan_entries_grid=2,
    plan_entries_block=8,
    verify_grid=2,
    verify_block=8,
    write_grid_max=8,
    write_block=1,
    scatter_grid_max=8,
    scatter_block=1,
    scatter_column_tiles_max=1,
    transfer_grid_max=4,
    transfer_block=64,
    min_work_per_block=HOST_MIN_WORK_PER_BLOCK,
    blocks_per_thread=HOST_BLOCKS_PER_THREAD,
)


def make_host_backend(*, sanitize: bool | str = False, shape: LaunchShape = HOST_SHAPE,
                      threads: int | None = None) -> KernelBackend:
    """The host backend. ``threads``: OS threads per launch (None: ``hostcuda.host_threads()`` at each
    launch, i.e. ``set_host_threads``, else ``$KVCANARY_HOST_THREADS``, else the usable cores)."""
    from ..hostcuda import HostModule, host_threads

    @functools.cache
    def load(file: str) -> Any:
        return HostModule(kernel_source(file), options=(f"-DKVC_SOURCE_HASH=0x{source_hash()}ull",),
                          include_dirs=(kernels_dir(),), sanitize=sanitize, name=file.removesuffix(".cu"),
                          threads=threads)

    def launch_threads() -> int:
        return threads if threads is not None else host_threads()

    return KernelBackend("host", load, shape, threads=launch_threads)
