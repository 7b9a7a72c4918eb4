"""Launching the ``kernels/*.cu`` entry points, shared by the ``cuda`` and ``host`` backends.

Both backends compile the same sources and expose modules with CuPy's ``RawModule`` interface
(``get_function(name)(grid, block, args)``); they differ only in how a module is built and in the launch
shapes they prefer (a GPU wants many threads, the host's fibers want few). Every scalar goes out with an
explicit NumPy width because neither CuPy nor the driver checks kernel argument types. Nothing here reads
device memory or allocates per launch, so a launch can be captured in a CUDA graph.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..constants import MAX_REAL_KV_SOURCES
from ..kv_layouts import ACCESS_TOKEN_RUN

KERNEL_FILES = ("plan.cu", "verify.cu", "write.cu", "scatter.cu", "transfer.cu")
_I64, _I32 = np.int64, np.int32


@functools.cache
def kernels_dir() -> Path:
    """The folder holding ``*.cu``/``*.cuh``: inside the installed package, or ``kernels/`` of a checkout."""
    package = Path(__file__).resolve().parent.parent
    for candidate in (package / "kernels", package.parent / "kernels"):
        if (candidate / "canary_common.cuh").is_file():
            return candidate
    raise FileNotFoundError(f"kernel sources not found next to {package}")


def kernel_source(file: str) -> str:
    return (kernels_dir() / file).read_text()


@functools.cache
def source_hash() -> str:
    """Hash of every kernel source and header; goes into the compile options so that no compiler cache
    (CuPy's hashes only the main text, not ``#include``d headers) can serve a stale build."""
    digest = hashlib.sha256()
    for path in sorted(kernels_dir().glob("*.cu*")):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


@dataclass(frozen=True)
class LaunchShape:
    """Grid and block sizes; the kernels are written to be correct for any of them."""

    plan_offsets_block: int  # multiple of 32, <= 1024
    plan_entries_grid: int
    plan_entries_block: int
    verify_grid: int
    verify_block: int
    write_grid_max: int  # the write grid is min(W, write_grid_max) blocks
    write_block: int  # multiple of 32
    scatter_grid_max: int  # requests per launch along x (grid-strided beyond)
    scatter_block: int
    transfer_grid_max: int = 64  # record gather/scatter: min(n, grid_max * block) threads, grid-strided
    transfer_block: int = 256


def _real_kv_args(ctx: Any) -> tuple[Any, ...]:
    """Each source's pointer and layout (kernels/canary_common.cuh, KVC_REAL_KV_PARAM): a contiguous source
    goes as its rows' own layout with 16-byte loads per token, exactly the walk it always had."""
    args: list[Any] = []
    for k in range(MAX_REAL_KV_SOURCES):
        if k < len(ctx.sources):
            source = ctx.sources[k]
            rows, page_size, per_token, read_bytes = source.data, source.page_size, source.num_bytes_per_token, \
                source.read_bytes
            if source.contiguous:  # the rows' stride as launched (a device copy may have packed the rows)
                stride = int(rows.strides[0]) if rows.shape[0] > 1 else int(rows.shape[1])
                args += [rows, _I64(stride), _I64(page_size), _I64(per_token), _I64(0), _I64(16),
                         _I64(per_token // 16), _I64(16), _I64(read_bytes), _I64(ACCESS_TOKEN_RUN)]
            else:
                lay = source.layout
                args += [rows, _I64(lay.page_stride), _I64(page_size), _I64(lay.token_stride),
                         _I64(lay.head_stride), _I64(lay.element_stride), _I64(lay.elements_per_head),
                         _I64(lay.element_bytes), _I64(read_bytes), _I64(lay.access_kind())]
        else:  # unused ABI slot: never dereferenced (the kernels stop at kv_count)
            args += [None, _I64(0), _I64(1), _I64(16), _I64(0), _I64(16), _I64(1), _I64(16), _I64(16),
                     _I64(ACCESS_TOKEN_RUN)]
    args += [_I32(len(ctx.sources)), _I32(ctx.mode)]
    return tuple(args)


def _paged_args(paged: Any) -> tuple[Any, ...]:
    """The PagedRows kernel parameters of a block table or CSR page list (kernels/plan.cu)."""
    ids = paged.ids
    if paged.indptr is None:
        rows, width = ids.shape
        indptr32 = indptr64 = None
    else:
        rows, width = 0, 0
        wide = paged.indptr.dtype == np.int64
        indptr32, indptr64 = (None, paged.indptr) if wide else (paged.indptr, None)
    return (ids, _I64(rows), _I64(width), indptr32, indptr64, _I64(ids.shape[0] if paged.indptr is not None else 0),
            _I32(paged.batch_rows), _I64(paged.block_size), _I64(paged.block_stride), _I64(paged.num_blocks))


class KernelBackend:
    """Plan / write / verify / scatter / record transfer as kernel launches on modules from ``load_module(file)``.

    ``null`` is what an absent pointer argument (``None`` below) becomes: CuPy turns ``None`` into a null
    *parameter* pointer rather than a null argument, so the CUDA backend passes an explicit 8-byte zero; the
    host launcher takes ``None`` itself.
    """

    def __init__(self, name: str, load_module: Callable[[str], Any], shape: LaunchShape, null: Any = None) -> None:
        self.name = name
        self._load_module = load_module
        self.shape = shape
        self._null = null
        self._functions: dict[str, Any] = {}

    def load_all(self) -> None:
        """Build (or load from the cache) every kernel module now rather than at its first launch."""
        for file in KERNEL_FILES:
            self._load_module(file)

    def function(self, file: str, name: str) -> Any:
        key = f"{file}:{name}"
        fn = self._functions.get(key)
        if fn is None:
            kernel = self._load_module(file).get_function(name)
            if self._null is None:
                fn = kernel
            else:
                null = self._null

                def fn(grid: Any, block: Any, args: tuple[Any, ...], _kernel: Any = kernel) -> None:
                    _kernel(grid, block, tuple(null if a is None else a for a in args))

            self._functions[key] = fn
        return fn

    def plan(self, launch: Any) -> None:
        shape = self.shape
        vp, wp = launch.verify, launch.write
        lut = launch.full_to_swa_index_mapping
        lut_len = 0 if lut is None else int(lut.shape[0])
        pool = launch.req_to_verify_expected_tokens
        pool_rows, pool_width = (0, 0) if pool is None else pool.shape
        bs = launch.bs
        if launch.paged is None:
            suffix = ""
            rows, width = launch.req_to_token.shape
            layout: tuple[Any, ...] = (launch.req_to_token, _I64(rows), _I64(width))
        else:
            suffix = "_paged"
            layout = _paged_args(launch.paged)
        self.function("plan.cu", "kvc_plan_offsets" + suffix)(
            (1,), (shape.plan_offsets_block,),
            (launch.req_pool_indices, launch.prefix_lens, launch.extend_seq_lens, _I64(bs), *layout,
             lut, _I64(lut_len), _I64(launch.swa_window_size), _I64(launch.verify_capacity),
             _I64(launch.write_req_capacity), wp.verify_offsets, wp.write_offsets, wp.write_seed_slot_indices,
             vp.verify_num_valid, vp.enable, wp.write_num_valid_reqs, vp.status),
        )
        self.function("plan.cu", "kvc_plan_entries" + suffix)(
            (shape.plan_entries_grid,), (shape.plan_entries_block,),
            (launch.req_pool_indices, launch.prefix_lens, _I64(bs), *layout,
             lut, _I64(lut_len), _I64(launch.swa_window_size), pool, _I64(pool_rows), _I64(pool_width),
             launch.req_to_verify_expected_tokens_valid_lens, _I32(pool is not None),
             _I32(launch.kv_token_id_vs_position_offset), wp.verify_offsets, vp.enable,
             _I64(launch.verify_capacity), vp.verify_slot_indices, vp.verify_expected_tokens,
             vp.verify_expected_positions, vp.verify_prev_slot_indices, vp.status),
        )

    def verify(self, launch: Any) -> None:
        ctx = launch.context
        self.function("verify.cu", "kvc_verify")(
            (self.shape.verify_grid,), (self.shape.verify_block,),
            (ctx.canary, _I64(ctx.num_slots), _I64(ctx.canary.shape[1]), launch.slots, launch.expected_tokens,
             launch.expected_positions, launch.prev_slots, launch.num_valid, launch.enable,
             _I64(launch.capacity), _I32(launch.check_verify_expected_token), _I64(ctx.kernel_kind), ctx.ring,
             _I64(ctx.ring.shape[0]), ctx.write_index, ctx.slot_run_counter, ctx.kernel_run_counter, ctx.status,
             *_real_kv_args(ctx)),
        )

    def write(self, launch: Any) -> None:
        ctx = launch.context
        capacity = launch.write_req_capacity
        grid = max(1, min(capacity, self.shape.write_grid_max))
        self.function("write.cu", "kvc_write")(
            (grid,), (self.shape.write_block,),
            (ctx.canary, _I64(ctx.num_slots), _I64(ctx.canary.shape[1]), launch.write_offsets,
             launch.write_seed_slot_indices, launch.write_num_valid_reqs, _I64(capacity), launch.input_ids,
             launch.positions, launch.out_cache_loc, _I64(launch.input_ids.shape[0]),
             _I32(launch.enable_write_input_assert), launch.expected_input_tokens,
             launch.expected_input_positions, ctx.chain_assert, _I64(ctx.kernel_kind), ctx.ring,
             _I64(ctx.ring.shape[0]), ctx.write_index, ctx.slot_run_counter, ctx.kernel_run_counter, ctx.status,
             *_real_kv_args(ctx)),
        )

    def scatter(self, launch: Any) -> None:
        bs = int(launch.req_pool_indices.shape[0])
        total = int(launch.flat_in.shape[0])
        rows, width = launch.pool_out.shape
        block = self.shape.scatter_block
        column_tiles = max(1, min(-(-min(width, total) // block), 65535))
        grid = (max(1, min(bs, self.shape.scatter_grid_max)), column_tiles)
        self.function("scatter.cu", "kvc_scatter")(
            grid, (block,),
            (launch.flat_in, _I64(total), launch.offsets, launch.req_pool_indices, _I64(bs), launch.pool_out,
             _I64(rows), _I64(width), launch.status),
        )

    def _transfer_grid(self, n: int) -> tuple[int, int]:
        block = self.shape.transfer_block
        return max(1, min(-(-n // block), self.shape.transfer_grid_max)), block

    def gather_records(self, launch: Any) -> None:
        n = launch.count
        grid, block = self._transfer_grid(n)
        self.function("transfer.cu", "kvc_gather_records")(
            (grid,), (block,),
            (launch.canary, _I64(launch.canary.shape[0]), _I64(launch.canary.shape[1]), launch.slots, _I64(n),
             launch.records, launch.status),
        )

    def scatter_records(self, launch: Any) -> None:
        n = launch.count
        grid, block = self._transfer_grid(n)
        self.function("transfer.cu", "kvc_scatter_records")(
            (grid,), (block,),
            (launch.records, _I64(n), launch.slots, launch.canary, _I64(launch.canary.shape[0]),
             _I64(launch.canary.shape[1]), launch.status),
        )
