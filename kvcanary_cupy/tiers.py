"""Canary records that travel with KV pages down a cache hierarchy and back (device -> host memory -> disk).

Engines keep KV far beyond the device: SGLang's HiCache (host memory as L2, storage as L3), vLLM's
offloading connector, LMCache, Mooncake Store, transformers' ``cpu_offload_space``. A storage checksum proves
that the bytes read equal the bytes written; it cannot prove that the page restored is the page of *this*
request at *these* positions. The canary record can, because it names content and position, never a slot.
Three calls sit around an engine's offload and load-back:

1. offload, when pages are copied down: :func:`offload_canary_records` gathers the records of the pages'
   slots into one contiguous ``int64 [n, 4]`` buffer that is stored next to the pages (any slot layout: a slot
   list for SGLang's per-token table, block ids for a block table, page ids for CSR page lists);
2. load-back, once the pages have landed in (possibly different) device slots: :meth:`PrefixRestorer.restore`
   scatters the records into those slots and verifies the whole restored prefix in the same call: token
   (against the expected-token pool), position, the chain from the slot before it, and the real-KV
   fingerprint re-hashed from the restored bytes. Violations land in the context's ring before the first
   forward that reads the pages;
3. the engine's next forward plans and verifies as usual.

:func:`restore_canary_records` is the scatter alone, for an engine that verifies later with its own plan.
Everything is validated once for all backends (``numpy`` reference; ``cuda`` and ``host`` kernels from
``kernels/transfer.cu``); page ids are device values, so a page outside the canary buffer is never followed
but reported in ``status`` (:class:`~kvcanary_cupy.constants.CanaryStatus`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ._errors import fail
from .backends import resolve_backend
from .constants import CANARY_FIELDS_PER_SLOT
from .context import VerifyOrWriteContext
from .dlpack import device_scope, stream_scope
from .layouts import SlotLayout, layout_arrays
from .plan import OnInvalid
from .transfer import ReceivedPrefixVerifier, RecordTransferLaunch, prepare_record_transfer


def _pages_arg(slots: Any, pages: Any) -> tuple[Any, str]:
    if (slots is None) == (pages is None):
        fail("pass exactly one of slots (one slot per record) or pages (page ids with page_size)")
    return (slots, "slots") if pages is None else (pages, "pages")


def _prepare(*, canary_buf: Any, records: Any, slots: Any, pages: Any, page_size: int, page_stride: int | None,
             status: Any | None, records_written: bool) -> RecordTransferLaunch:
    index, name = _pages_arg(slots, pages)
    if name == "slots" and (page_size != 1 or page_stride not in (None, 1)):
        fail("page_size and page_stride apply to pages=, not to slots=")
    return prepare_record_transfer(canary_buf=canary_buf, records=records, slots=index, status=status,
                                   records_written=records_written, page_size=page_size, page_stride=page_stride,
                                   index_name=name)


def offload_canary_records(*, canary_buf: Any, records_out: Any, slots: Any | None = None, pages: Any | None = None,
                           page_size: int = 1, page_stride: int | None = None, status: Any | None = None,
                           backend: str = "auto", on_invalid: OnInvalid | None = None) -> None:
    """Gather the records of the KV being copied down a tier: ``records_out`` int64 ``[n, 4]``, contiguous.

    Exactly one of ``slots`` (int64 ``[n]``, the slots in position order: a per-token table) or ``pages``
    (int64 ``[p]``, page or block ids; record ``k * page_size + j`` is slot ``pages[k] * page_stride + j``, so
    ``n = p * page_size``; ``page_stride`` defaults to ``page_size``, larger for a strided block pool). A page
    outside ``canary_buf`` gives zero records (which never verify) and sets SLOT_OUT_OF_RANGE in ``status``;
    the NumPy reference raises for it unless ``on_invalid="flag"``.
    """
    with stream_scope(canary_buf, slots, pages, records_out, status):
        launch = _prepare(canary_buf=canary_buf, records=records_out, slots=slots, pages=pages, page_size=page_size,
                          page_stride=page_stride, status=status, records_written=True)
        impl = resolve_backend(backend, launch.device, on_invalid)
        with device_scope(launch.device):
            impl.gather_records(launch)


def restore_canary_records(*, records: Any, canary_buf: Any, slots: Any | None = None, pages: Any | None = None,
                           page_size: int = 1, page_stride: int | None = None, status: Any | None = None,
                           backend: str = "auto", on_invalid: OnInvalid | None = None) -> None:
    """Scatter records loaded back from a tier into the device slots the pages landed in (``slots`` or
    ``pages`` as for :func:`offload_canary_records`; distinct slots). Only the 4 record fields of each slot are
    written. Prefer :meth:`PrefixRestorer.restore`, which also verifies what it restored."""
    with stream_scope(records, slots, pages, canary_buf, status):
        launch = _prepare(canary_buf=canary_buf, records=records, slots=slots, pages=pages, page_size=page_size,
                          page_stride=page_stride, status=status, records_written=False)
        impl = resolve_backend(backend, launch.device, on_invalid)
        with device_scope(launch.device):
            impl.scatter_records(launch)


class PrefixRestorer(ReceivedPrefixVerifier):
    """Scatter + verify of prefixes loaded back from a lower tier, with plan scratch allocated once.

    ``verify_capacity``: positions verified per call (the sum of the restored prefix lengths);
    ``max_requests``: requests per call.
    """

    def restore(self, *, context: VerifyOrWriteContext, records: Any, restored_lens: Any, slots: Any | None = None,
                pages: Any | None = None, page_size: int = 1, page_stride: int | None = None,
                req_pool_indices: Any | None = None, req_to_token: Any | None = None,
                layout: SlotLayout | None = None, req_to_verify_expected_tokens: Any | None = None,
                req_to_verify_expected_tokens_valid_lens: Any | None = None, kv_token_id_vs_position_offset: int = 0,
                status: Any | None = None, backend: str = "auto", on_invalid: OnInvalid | None = None) -> None:
        """Write ``records`` into the restored slots of ``context``'s canary buffer, then verify positions
        ``[0, restored_lens[r])`` of every request: the restored pages and the device-resident prefix they
        continue (the chain of the first restored slot is checked against the slot before it).

        ``records``, ``slots`` / ``pages``, ``page_size``, ``page_stride``, ``status``: as for
        :func:`restore_canary_records` (the records of the restored pages, in the order of their slots).
        ``restored_lens``, ``req_pool_indices``, ``req_to_token`` / ``layout`` and the expected-token pool: as for
        :meth:`~kvcanary_cupy.ReceivedPrefixVerifier.verify`; the slot table must already map the restored
        positions to the slots the pages landed in. The pages' real KV must be in place (the verify re-hashes
        it). Every argument is checked before anything is written: a refused call leaves the canary buffer, the
        ring and ``status`` unchanged.
        """
        with stream_scope(context, records, slots, pages, status, self.plan, req_pool_indices, restored_lens,
                          *layout_arrays(req_to_token, layout), req_to_verify_expected_tokens,
                          req_to_verify_expected_tokens_valid_lens):
            launch = _prepare(canary_buf=context.canary_buf, records=records, slots=slots, pages=pages,
                              page_size=page_size, page_stride=page_stride, status=status, records_written=False)
            impl = resolve_backend(backend, launch.device, on_invalid)

            def scatter() -> Callable[[], None] | None:
                undo = _undo_scatter(launch) if getattr(impl, "on_invalid", None) == "raise" else None
                impl.scatter_records(launch)
                return undo

            # The plan reads only the slot table, never the canary: it runs (and refuses bad tables) before the
            # scatter touches the caller's canary buffer; a verify that refuses afterwards undoes the scatter.
            with device_scope(launch.device):
                self._plan_and_verify(
                    context=context, req_pool_indices=req_pool_indices, lens=restored_lens,
                    lens_name="restored_lens", req_to_token=req_to_token, layout=layout,
                    req_to_verify_expected_tokens=req_to_verify_expected_tokens,
                    req_to_verify_expected_tokens_valid_lens=req_to_verify_expected_tokens_valid_lens,
                    kv_token_id_vs_position_offset=kv_token_id_vs_position_offset, swa_window_size=0,
                    full_to_swa_index_mapping=None, backend=backend, on_invalid=on_invalid,
                    function="PrefixRestorer.restore", before_verify=scatter)


def _undo_scatter(launch: RecordTransferLaunch) -> Callable[[], None]:
    """What a host scatter is about to overwrite (the records of its in-range slots, and status), and how to
    put it back: the NumPy reference's restore undoes its scatter when the verify after it refuses."""
    rows = (launch.slots[:, None] * launch.page_stride + np.arange(launch.page_size)).reshape(-1)
    rows = rows[(launch.slots.repeat(launch.page_size) >= 0) & (rows >= 0) & (rows < launch.canary.shape[0])]
    saved = launch.canary[rows, :CANARY_FIELDS_PER_SLOT].copy()
    status = launch.status
    saved_status = None if status is None else status.copy()

    def undo() -> None:
        launch.canary[rows, :CANARY_FIELDS_PER_SLOT] = saved
        if status is not None:
            status[...] = saved_status
    return undo

__all__ = ["PrefixRestorer", "offload_canary_records", "restore_canary_records"]
