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

The engine runtime carries its records in an :class:`~kvcanary_cupy.runtime.OffloadedRecords`, an object the
engine holds for as long as the pages stay down a tier; :func:`check_offloaded_records` judges it as a whole
when it comes back (and :func:`select_offloaded_records` when a subset is taken), so that a mutated, truncated
or foreign one is refused by name before anything is written.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ._errors import fail
from ._validate import host_int_vector, int_arg
from .backends import resolve_backend
from .constants import CANARY_FIELDS_PER_SLOT
from .context import VerifyOrWriteContext
from .dlpack import device_scope, plain_ndarray, stream_scope
from .layouts import SlotLayout, layout_arrays
from .plan import OnInvalid
from .transfer import ReceivedPrefixVerifier, RecordTransferLaunch, prepare_record_transfer


def _pages_arg(slots: Any, pages: Any) -> tuple[Any, str]:
    if (slots is None) == (pages is None):
        fail("pass exactly one of slots (one slot per record) or pages (page ids with page_size)")
    return (slots, "slots") if pages is None else (pages, "pages")


def _prepare(*, canary_buf: Any, records: Any, slots: Any, pages: Any, page_size: int, page_stride: int | None,
             status: Any | None, records_written: bool, canary_name: str = "canary_buf") -> RecordTransferLaunch:
    index, name = _pages_arg(slots, pages)
    # One slot per record: a page size or stride given with slots= would silently turn slot s into s * stride.
    if name == "slots" and (page_size != 1 or page_stride is not None):
        fail(f"page_size and page_stride apply to pages=, not to slots= (one slot per record), got page_size="
             f"{page_size!r} and page_stride={page_stride!r} with slots")
    return prepare_record_transfer(canary_buf=canary_buf, records=records, slots=index, status=status,
                                   records_written=records_written, page_size=page_size, page_stride=page_stride,
                                   index_name=name, canary_name=canary_name)


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
        if not isinstance(context, VerifyOrWriteContext):
            fail(f"context must be a VerifyOrWriteContext, got {type(context).__name__}")
        with stream_scope(context, records, slots, pages, status, self.plan, req_pool_indices, restored_lens,
                          *layout_arrays(req_to_token, layout), req_to_verify_expected_tokens,
                          req_to_verify_expected_tokens_valid_lens):
            launch = _prepare(canary_buf=context.canary_buf, records=records, slots=slots, pages=pages,
                              page_size=page_size, page_stride=page_stride, status=status, records_written=False,
                              canary_name="context.canary_buf")
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


# ---- the engine runtime's carried records --------------------------------------------------------------------

RecordKey = tuple[str, int]  # (group name, index of the group's canary buffer)


def check_offloaded_records(records: Any, name: str = "records", *, models: Sequence[str] | None = None,
                            keys: Sequence[RecordKey] | None = None) -> None:
    """Refuse an :class:`~kvcanary_cupy.runtime.OffloadedRecords` that is not whole: ``model`` a str (one of
    ``models`` when given), ``count`` an int >= 0, ``records`` a dict from ``(group, buffer index)`` to a plain,
    native int64 ``[count, 4]`` C-contiguous host array (what :meth:`~kvcanary_cupy.runtime.CanaryRuntime.offload`
    returns) and, given ``keys`` (the canary buffers a restore writes), exactly those buffers. ``name`` is the
    caller's name for it."""
    model, count, held = (getattr(records, f, None) for f in ("model", "count", "records"))
    if not isinstance(model, str):
        fail(f"{name}.model must be a str (the model it was offloaded from), got {type(model).__name__}")
    if models is not None and model not in models:
        fail(f"{name}.model must be one of {', '.join(models)}, got {model!r} (offloaded from another runtime)")
    count = int_arg(count, f"{name}.count", minimum=0)
    if not isinstance(held, dict):
        fail(f"{name}.records must be a dict of (group, buffer index) -> int64 [count, 4] arrays, got "
             f"{type(held).__name__}")
    for key, arr in held.items():
        if not (isinstance(key, tuple) and len(key) == 2 and isinstance(key[0], str)
                and isinstance(key[1], numbers.Integral) and not isinstance(key[1], bool)):
            fail(f"{name}.records has the key {key!r}; keys are (group name, buffer index)")
        label = f"{name}.records[{key!r}]"
        if not isinstance(arr, np.ndarray):
            fail(f"{label} must be a NumPy host array (as offload() returned it), got {type(arr).__name__}")
        arr = plain_ndarray(arr, label)
        if arr.dtype != np.dtype(np.int64) or arr.shape != (count, CANARY_FIELDS_PER_SLOT):
            fail(f"{label} must be int64 [{count}, {CANARY_FIELDS_PER_SLOT}] ({name}.count records of "
                 f"{CANARY_FIELDS_PER_SLOT} fields), got {arr.dtype} {arr.shape}")
        if not arr.flags.c_contiguous:
            fail(f"{label} must be C-contiguous, got strides {arr.strides}")
    if keys is None:
        return
    wanted = set(keys)
    missing = [k for k in keys if k not in held]
    if missing:
        fail(f"{name} hold no records for canary buffer {missing[0]} (offloaded from another model or runtime)")
    extra = sorted((k for k in held if k not in wanted), key=repr)
    if extra:
        fail(f"{name} hold records for canary buffer {extra[0]}, which model {model!r} of this runtime does not "
             f"have (offloaded from another runtime)")


def select_offloaded_records(records: Any, index: Any) -> tuple[str, int, dict[RecordKey, np.ndarray]]:
    """``(model, count, arrays)`` of the records of ``index``: a slice, a boolean mask of ``records.count``
    entries, or a 1-D integer host array of entries in ``[0, records.count)``. ``records`` is checked whole
    first (:func:`check_offloaded_records`); the arrays are new, contiguous copies."""
    check_offloaded_records(records, "OffloadedRecords")
    count = int(records.count)
    if isinstance(index, slice):
        try:
            rows = np.arange(count, dtype=np.int64)[index]
        except (TypeError, ValueError) as exc:  # a non-integer bound, a zero step
            fail(f"index slice {index!r} does not select from [0, {count}) ({exc})")
    else:
        if isinstance(index, np.ndarray):
            index = plain_ndarray(index, "index")
        try:
            mask: np.ndarray | None = np.asarray(index)
        except Exception:  # a device array, a ragged list: host_int_vector below says what it is
            mask = None
        if mask is not None and mask.dtype == np.bool_:
            if mask.shape != (count,):
                fail(f"index as a boolean mask must have shape ({count},) (one entry per record), got {mask.shape}")
            rows = np.flatnonzero(mask)
        else:
            rows = host_int_vector(index, "index")
            if rows.size and (int(rows.min()) < 0 or int(rows.max()) >= count):
                bad = int(rows.min()) if int(rows.min()) < 0 else int(rows.max())
                fail(f"index holds {bad}, outside the {count} records [0, {count})")
    return records.model, int(rows.shape[0]), {k: np.ascontiguousarray(a[rows]) for k, a in records.records.items()}


__all__ = ["PrefixRestorer", "check_offloaded_records", "offload_canary_records", "restore_canary_records",
           "select_offloaded_records"]
