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
from ..kv_bytes import ACCESS_TOKEN_RUN

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
    write_block: int
    scatter_grid_max: int  # requests per launch along x (grid-strided beyond)
    scatter_block: int
    # Column tiles along y (grid-strided beyond). The GPU wants many; a host block is a loop over fibers, so
    # tiles past the row's tokens cost a block each for nothing (the pool's columns are the longest context).
    scatter_column_tiles_max: int = 65535
    transfer_grid_max: int = 64  # record gather/scatter: min(n, grid_max * block) threads, grid-strided
    transfer_block: int = 256
    # Host backend on a pool of OS threads (0: off; see KernelBackend.pool_grid): plan entries, verify, write
    # and record transfer with at least 2 * min_work_per_block items (entries, tokens, records) get up to
    # blocks_per_thread blocks per OS thread; smaller launches keep the grids above and one OS thread.
    min_work_per_block: int = 0
    blocks_per_thread: int = 0


_NO_SPLITS = (_I64(0), _I64(0), _I64(0), _I64(0))  # tokens_per_tile, tile_stride, elements_per_group, group_stride


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
                         _I64(per_token // 16), _I64(16), _I64(read_bytes), _I64(ACCESS_TOKEN_RUN), *_NO_SPLITS]
            else:
                lay = source.layout
                args += [rows, _I64(lay.page_stride), _I64(page_size), _I64(lay.token_stride),
                         _I64(lay.head_stride), _I64(lay.element_stride), _I64(lay.elements_per_head),
                         _I64(lay.element_bytes), _I64(read_bytes), _I64(lay.access_kind()),
                         _I64(lay.tokens_per_tile), _I64(lay.tile_stride), _I64(lay.elements_per_group),
                         _I64(lay.group_stride)]
        else:  # unused ABI slot: never dereferenced (the kernels stop at kv_count)
            args += [None, _I64(0), _I64(1), _I64(16), _I64(0), _I64(16), _I64(1), _I64(16), _I64(16),
                     _I64(ACCESS_TOKEN_RUN), *_NO_SPLITS]
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


# A token the expected-token scatter copies costs about an eighth of what a verify entry costs (the unit of
# ``LaunchShape.min_work_per_block``): 2,400 tokens take 8 us of CPU, 1,024 verify entries 9 us.
SCATTER_TOKENS_PER_ITEM = 8

# Readers of a launch's real work at call time (only prepared host launches call them: host memory). A hostile
# device value only changes the thread count, never what the kernels do.
def _first(words: Any) -> Callable[[], Any]:
    """The first word of ``words`` (a count the plan wrote)."""
    return lambda: words.reshape(-1)[0]


def _scaled(work: Callable[[], Any], per_item: int) -> Callable[[], Any]:
    """``work`` counted in items of ``per_item`` of its own."""
    return lambda: work() // per_item


def _write_tokens(offsets: Any, num_valid_reqs: Any, capacity: int) -> Callable[[], Any]:
    """The tokens a write's plan holds: the offset past its last valid request."""
    return lambda: offsets[min(max(int(num_valid_reqs.reshape(-1)[0]), 0), capacity)]


class KernelBackend:
    """Plan / write / verify / scatter / record transfer as kernel launches on modules from ``load_module(file)``.

    ``null`` is what an absent pointer argument (``None`` below) becomes: CuPy turns ``None`` into a null
    *parameter* pointer rather than a null argument, so the CUDA backend passes an explicit 8-byte zero; the
    host launcher takes ``None`` itself.
    """

    def __init__(self, name: str, load_module: Callable[[str], Any], shape: LaunchShape, null: Any = None,
                 threads: Callable[[], int] | None = None) -> None:
        self.name = name
        self._load_module = load_module
        self.shape = shape
        self._null = null
        self._threads = threads
        self._functions: dict[str, Any] = {}
        self._recording: list[tuple[str, str, Any, Any, tuple[Any, ...], dict[str, Any]]] | None = None

    def pool_grid(self, base: int, work: int, cap: int = 2**31 - 1) -> tuple[int, dict[str, int]]:
        """Blocks for a launch of ``work`` items whose grid is ``base`` (at most ``cap``), and the keyword
        arguments of the launch. A backend without OS threads (``cuda``) keeps ``base``. On the host backend
        a launch too small to gain (fewer than 2 * min_work_per_block items) runs on the calling thread
        alone with ``base``, exactly as with one thread; a larger one gets one block per min_work_per_block
        items, at most blocks_per_thread per OS thread, never fewer than ``base``."""
        base = max(1, min(base, cap))
        shape = self.shape
        if self._threads is None or shape.min_work_per_block <= 0:
            return base, {}
        threads = self._threads()
        if threads <= 1 or work < 2 * shape.min_work_per_block:
            return base, {"threads": 1}
        sized = min(cap, -(-work // shape.min_work_per_block), shape.blocks_per_thread * threads)
        return max(base, sized), {"threads": threads}

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

    def _kernel(self, file: str, name: str, grid: Any, block: Any, args: tuple[Any, ...], **launch: Any) -> None:
        """Launch (or, inside :meth:`prepare`, record) one kernel; ``launch``: the host backend's ``threads``, and
        optionally ``work``: a callable that reads, at call time, how many items the launch really has (its
        capacity sized the grid); a prepared launch uses it to run small calls on the calling thread alone
        (:meth:`_threads_by_work`)."""
        if self._recording is not None:
            self._recording.append((file, name, grid, block, args, launch))
            return
        launch.pop("work", None)
        self.function(file, name)(grid, block, args, **launch)

    def _threads_by_work(self, threads: int | None, work: Callable[[], Any] | None) -> Callable[[], int] | None:
        """A prepared launch's thread count at call time: its grid was sized at bind time by the capacity (a
        verify by every entry the plan can hold), but a step usually fills a small share of it. A call whose
        real work is below 2 x ``min_work_per_block`` runs on the calling thread alone, as :meth:`pool_grid` does
        for an unbound launch of that size (waking a pool worker would cost more than it saves); a larger one
        keeps the bound thread count. The kernels give the same results on any number of threads."""
        if work is None or threads is None or threads <= 1 or self.shape.min_work_per_block <= 0:
            return None
        least = 2 * self.shape.min_work_per_block

        def threads_now() -> int:
            return threads if work() >= least else 1

        return threads_now

    def prepare(self, step: str, launch: Any) -> Callable[[], None]:
        """``step``'s kernel launches for ``launch`` with their arguments built once (and, on the host, packed
        once): a bound launch's buffers and scalars never change, so only the launches themselves remain per
        call. Nothing here reads device memory, so the launches recorded are exactly those a call would run."""
        self._recording = []
        try:
            getattr(self, step)(launch)
            recorded, self._recording = self._recording, None
        finally:
            self._recording = None
        calls: list[Callable[[], None]] = []
        for file, name, grid, block, args, launch_kw in recorded:
            work = launch_kw.pop("work", None)
            kernel = self._load_module(file).get_function(name)
            if self._null is None and hasattr(kernel, "prepared"):
                threads_of = self._threads_by_work(launch_kw.get("threads"), work)
                calls.append(kernel.prepared(grid, block, args, threads_of=threads_of, **launch_kw))
            else:
                calls.append(functools.partial(self.function(file, name), grid, block, args, **launch_kw))
        if len(calls) == 1:
            return calls[0]

        def run_all() -> None:
            for call in calls:
                call()

        return run_all

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
        self._kernel("plan.cu", "kvc_plan_offsets" + suffix,
            (1,), (shape.plan_offsets_block,),
            (launch.req_pool_indices, launch.prefix_lens, launch.extend_seq_lens, _I64(bs), *layout,
             lut, _I64(lut_len), _I64(launch.swa_window_size), _I64(launch.verify_capacity),
             _I64(launch.write_req_capacity), wp.verify_offsets, wp.write_offsets, wp.write_seed_slot_indices,
             vp.verify_num_valid, vp.enable, wp.write_num_valid_reqs, vp.status),
        )
        grid, threads = self.pool_grid(shape.plan_entries_grid, launch.verify_capacity)
        self._kernel("plan.cu", "kvc_plan_entries" + suffix,
            (grid,), (shape.plan_entries_block,),
            (launch.req_pool_indices, launch.prefix_lens, _I64(bs), *layout,
             lut, _I64(lut_len), _I64(launch.swa_window_size), pool, _I64(pool_rows), _I64(pool_width),
             launch.req_to_verify_expected_tokens_valid_lens, _I32(pool is not None),
             _I32(launch.kv_token_id_vs_position_offset), wp.verify_offsets, vp.enable,
             _I64(launch.verify_capacity), vp.verify_slot_indices, vp.verify_expected_tokens,
             vp.verify_expected_positions, vp.verify_prev_slot_indices, vp.status),
            work=_first(vp.verify_num_valid), **threads,
        )

    def verify(self, launch: Any) -> None:
        ctx = launch.context
        grid, threads = self.pool_grid(self.shape.verify_grid, launch.capacity)
        self._kernel("verify.cu", "kvc_verify",
            (grid,), (self.shape.verify_block,),
            (ctx.canary, _I64(ctx.num_slots), _I64(ctx.canary.shape[1]), launch.slots, launch.expected_tokens,
             launch.expected_positions, launch.prev_slots, launch.num_valid, launch.enable,
             _I64(launch.capacity), _I32(launch.check_verify_expected_token), _I64(ctx.kernel_kind), ctx.ring,
             _I64(ctx.ring.shape[0]), ctx.write_index, ctx.slot_run_counter, ctx.kernel_run_counter, ctx.status,
             launch.twin, *_real_kv_args(ctx)),
            work=_first(launch.num_valid), **threads,
        )

    def write(self, launch: Any) -> None:
        ctx = launch.context
        capacity = launch.write_req_capacity
        grid, threads = self.pool_grid(self.shape.write_grid_max, int(launch.input_ids.shape[0]), cap=capacity)
        self._kernel("write.cu", "kvc_write",
            (grid,), (self.shape.write_block,),
            (ctx.canary, _I64(ctx.num_slots), _I64(ctx.canary.shape[1]), launch.write_offsets,
             launch.write_seed_slot_indices, launch.write_num_valid_reqs, _I64(capacity), launch.input_ids,
             launch.positions, launch.out_cache_loc, _I64(launch.input_ids.shape[0]),
             _I32(launch.enable_write_input_assert), launch.expected_input_tokens,
             launch.expected_input_positions, ctx.chain_assert, _I64(ctx.kernel_kind), ctx.ring,
             _I64(ctx.ring.shape[0]), ctx.write_index, ctx.slot_run_counter, ctx.kernel_run_counter, ctx.status,
             *_real_kv_args(ctx)),
            work=_write_tokens(launch.write_offsets, launch.write_num_valid_reqs, capacity), **threads,
        )

    def scatter(self, launch: Any) -> None:
        bs = int(launch.req_pool_indices.shape[0])
        total = int(launch.flat_in.shape[0])
        rows, width = launch.pool_out.shape
        block = self.shape.scatter_block
        column_tiles = max(1, min(-(-min(width, total) // block), self.shape.scatter_column_tiles_max))
        requests, threads = self.pool_grid(self.shape.scatter_grid_max, total, cap=max(1, bs))
        self._kernel("scatter.cu", "kvc_scatter",
            (requests, column_tiles), (block,),
            (launch.flat_in, _I64(total), launch.offsets, launch.req_pool_indices, _I64(bs), launch.pool_out,
             _I64(rows), _I64(width), launch.status),
            work=_scaled(_first(launch.offsets[bs:]), SCATTER_TOKENS_PER_ITEM), **threads,
        )

    def _transfer_grid(self, n: int) -> tuple[int, int, dict[str, int]]:
        block = self.shape.transfer_block
        grid, threads = self.pool_grid(self.shape.transfer_grid_max, n, cap=max(1, -(-n // block)))
        return grid, block, threads

    def gather_records(self, launch: Any) -> None:
        n = launch.count
        grid, block, threads = self._transfer_grid(n)
        self._kernel("transfer.cu", "kvc_gather_records",
            (grid,), (block,),
            (launch.canary, _I64(launch.canary.shape[0]), _I64(launch.canary.shape[1]), launch.slots,
             _I64(launch.slots.shape[0]), _I64(launch.page_size), _I64(launch.page_stride), launch.records,
             launch.status),
            **threads,
        )

    def scatter_records(self, launch: Any) -> None:
        n = launch.count
        grid, block, threads = self._transfer_grid(n)
        self._kernel("transfer.cu", "kvc_scatter_records",
            (grid,), (block,),
            (launch.records, launch.slots, _I64(launch.slots.shape[0]), _I64(launch.page_size),
             _I64(launch.page_stride), launch.canary, _I64(launch.canary.shape[0]), _I64(launch.canary.shape[1]),
             launch.status),
            **threads,
        )
