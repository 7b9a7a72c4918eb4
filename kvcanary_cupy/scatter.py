"""The expected-token scatter: copy each request's token history into its row of the expected-token pool.

Owns :func:`launch_scatter_req_token_ids` (SPEC §6). The plan later gathers expected tokens from that pool,
bounded by per-request valid lengths, because a recycled row keeps the stale tail of its previous owner.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ._validate import array_arg, check_memory, optional_array_arg, same_device
from .backends import resolve_backend
from .dlpack import Device, DLPackArray, device_scope, stream_scope


@dataclass(frozen=True)
class ScatterLaunch:
    flat_in: Any
    offsets: Any
    req_pool_indices: Any
    pool_out: Any
    status: Any | None
    device: Device


def prepare_scatter_launch(*, flat_in: Any, offsets: Any, req_pool_indices: Any, pool_out: Any,
                           status: Any | None = None) -> ScatterLaunch:
    """Every host-visible check of a scatter launch, for all backends."""
    flat = array_arg(flat_in, "flat_in", dtype=np.int64, ndim=1)
    rpi = array_arg(req_pool_indices, "req_pool_indices", dtype=np.int64, ndim=1)
    bs = int(rpi.shape[0])
    offs = array_arg(offsets, "offsets", dtype=np.int64, ndim=1, shape=(bs + 1,))
    pool = array_arg(pool_out, "pool_out", dtype=np.int32, ndim=2, writable=True)
    status_arr = optional_array_arg(status, "status", dtype=np.int32, ndim=1, shape=(1,), writable=True)
    inputs = [("flat_in", flat), ("offsets", offs), ("req_pool_indices", rpi)]
    outputs = [("pool_out", pool), ("status", status_arr)]
    device = same_device(inputs + outputs)
    check_memory(outputs=outputs, inputs=inputs)
    return ScatterLaunch(flat, offs, rpi, pool, status_arr, device)


def launch_scatter_req_token_ids(
    *,
    flat_in: DLPackArray,
    offsets: DLPackArray,
    req_pool_indices: DLPackArray,
    pool_out: DLPackArray,
    status: DLPackArray | None = None,
    backend: str = "auto",
    on_invalid: str | None = None,
) -> None:
    """``pool_out[rp_r, :n] = int32(flat_in[offsets[r]:offsets[r] + n])`` with ``n = min(len_r, width)``.

    ``flat_in`` int64 [total] (requests concatenated in batch order), ``offsets`` int64 [bs+1],
    ``req_pool_indices`` int64 [bs], ``pool_out`` int32 [rows, width]. Columns past ``n`` and rows not
    addressed keep their content. A request whose row or segment lies outside its buffer is skipped by the
    kernels and reported in ``status`` (int32 [1], :class:`~kvcanary_cupy.constants.CanaryStatus`) when one
    is given; the NumPy reference raises ValueError for it unless ``on_invalid="flag"``.
    """
    with stream_scope(flat_in, offsets, req_pool_indices, pool_out, status):
        launch = prepare_scatter_launch(flat_in=flat_in, offsets=offsets, req_pool_indices=req_pool_indices,
                                        pool_out=pool_out, status=status)
        impl = resolve_backend(backend, launch.device, on_invalid)
        with device_scope(launch.device):
            impl.scatter(launch)
