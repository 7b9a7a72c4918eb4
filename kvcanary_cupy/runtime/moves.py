"""Record moves between slots and tiers (:class:`RecordMoves`): the canary records follow the engine's KV when it
copies slots (fork, copy-on-write), copies pages down to a lower tier (host memory, disk; the records travel as
:class:`OffloadedRecords`) and loads them back into (possibly other) slots, where they are verified before a
forward reads them."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._errors import fail
from .._validate import host_int_vector
from ..constants import CANARY_FIELDS_PER_SLOT
from ..tiers import (
    check_offloaded_records,
    offload_canary_records,
    restore_canary_records,
    select_offloaded_records,
)
from ..transfer import gather_canary_records, scatter_canary_records
from .batch import Buffer
from .groups import GroupState, gather_lut
from .sweep import Sweeping


@dataclass
class OffloadedRecords:
    """The canary records of ``count`` slots copied down a tier, one ``int64 [count, 4]`` host array per canary
    buffer (HEAD and TAIL, K and V) of every group of ``model``, keyed ``(group, buffer index)``. Store it next
    to the pages; :meth:`CanaryRuntime.restore` takes it back. ``nbytes``: what carrying it costs."""

    model: str
    count: int
    records: dict[tuple[str, int], np.ndarray]

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in self.records.values())

    def select(self, index: Any) -> OffloadedRecords:
        """The records of the slots ``index`` (a host integer index or boolean mask into ``[0, count)``)."""
        return OffloadedRecords(*select_offloaded_records(self, index))


class RecordMoves(Sweeping):
    """The record moves of the runtime: their staging buffers (:meth:`_allocate_moves`), :meth:`copy_slots`,
    :meth:`offload` and :meth:`restore` (whose verify of the restored slots is the sweep's)."""

    _copy_host: dict[str, np.ndarray]
    _copy_in: dict[str, Buffer]
    _copy_lut: dict[str, Buffer]
    _copy_records: Buffer

    def _allocate_moves(self) -> None:
        """Host staging, the slots on the device, their LUT gathers and the records in flight, in chunks of
        ``Capacities.max_tokens``."""
        space, caps = self.space, self.capacities
        self._copy_host = {k: space.host(caps.max_tokens, np.int64) for k in ("src", "dst")}
        tokens = "Capacities.max_tokens"
        self._copy_in = {k: Buffer(*space.alloc(caps.max_tokens, np.int64, name=tokens)) for k in ("src", "dst")}
        self._copy_lut = {k: Buffer(*space.alloc(caps.max_tokens, np.int64, name=tokens)) for k in ("src", "dst")}
        self._copy_records = Buffer(*space.alloc((caps.max_tokens, CANARY_FIELDS_PER_SLOT), np.int64, name=tokens))

    def copy_slots(self, src: Any, dst: Any, *, model: str = "target") -> None:
        """The engine copied the KV of slots ``src[i]`` to ``dst[i]`` (a forked request, copy-on-write): copy
        their canary records too, in every canary buffer (HEAD and TAIL, K and V) of every group of ``model``,
        so that the copies verify as what they are (the TAIL fingerprints then check the engine's byte copy).

        ``src``, ``dst``: 1-D integer host arrays of one length in the full pool's slot space (SWA groups
        gather both through their LUT); ``dst`` distinct and disjoint from ``src``. Outside any graph, between
        steps (after the engine's copy, before the next :meth:`prepare`). A slot outside a group's buffer is
        skipped (its destination gets a zero record, which never verifies) and sets SLOT_OUT_OF_RANGE in
        the group's status, reported by the next :meth:`finish_step`. No device allocation."""
        if not self.enabled:
            return
        self._outside_capture("copy_slots")
        groups = self._groups_of(model)
        src_arr, dst_arr = host_int_vector(src, "src"), host_int_vector(dst, "dst")
        n = int(src_arr.shape[0])
        if int(dst_arr.shape[0]) != n:
            fail(f"src has {n} slots but dst has {dst_arr.shape[0]}")
        if np.unique(dst_arr).shape[0] != n:
            fail("dst must name distinct slots (two copies into one slot)")
        if np.intersect1d(src_arr, dst_arr).size:
            fail("src and dst must be disjoint (a slot both copied and overwritten)")
        space, cap = self.space, self.capacities.max_tokens
        buffers = [(state, {id(ep.verify_ctx.canary_buf): ep.verify_ctx.canary_buf
                            for ep in state.all_endpoints()}) for state in groups]
        with self._timed("copy"), space.scope():
            for start in range(0, n, cap):
                m = min(cap, n - start)
                for key, arr in (("src", src_arr), ("dst", dst_arr)):
                    host = self._copy_host[key]
                    host[:m] = arr[start : start + m]
                    space.upload(self._copy_in[key].view[:m], host[:m])
                for state, bufs in buffers:
                    slots = {}
                    for key in ("src", "dst"):
                        if state.lut_view is None:
                            slots[key] = self._copy_in[key].owner[:m]
                        else:
                            gather_lut(state, space.xp, self._copy_in[key].view[:m], self._copy_lut[key].view[:m])
                            slots[key] = self._copy_lut[key].owner[:m]
                    status = self.scalars.owner(f"{state.name}.status")
                    records = self._copy_records.owner[:m]
                    for buf in bufs.values():
                        gather_canary_records(canary_buf=buf, slots=slots["src"], records_out=records,
                                              status=status, backend=self.config.backend, on_invalid="flag")
                        scatter_canary_records(records=records, slots=slots["dst"], canary_buf=buf, status=status,
                                               backend=self.config.backend, on_invalid="flag")

    def _canary_buffers(self, groups: list[GroupState]) -> list[tuple[GroupState, list[Any]]]:
        """Every distinct canary buffer of each group (SWEEP shares TAIL's), in endpoint order."""
        return [(state, list({id(ep.verify_ctx.canary_buf): ep.verify_ctx.canary_buf
                              for ep in state.all_endpoints()}.values())) for state in groups]

    def _group_slots(self, state: GroupState, key: str, m: int) -> Any:
        """The first ``m`` staged full-pool slots of ``key`` in ``state``'s slot space (through its LUT)."""
        if state.lut_view is None:
            return self._copy_in[key].owner[:m]
        gather_lut(state, self.space.xp, self._copy_in[key].view[:m], self._copy_lut[key].view[:m])
        return self._copy_lut[key].owner[:m]

    def offload(self, slots: Any, *, model: str = "target") -> OffloadedRecords:
        """The engine is copying the KV of ``slots`` down to a lower tier: return their canary records (every
        canary buffer of every group of ``model``), to be stored with the pages.

        ``slots``: a 1-D integer host array in the full pool's slot space (SWA groups gather it through their
        LUT), in position order. Outside any graph, between steps, before the engine frees the slots. A slot
        outside a group's buffer gives a zero record (which never verifies) and sets SLOT_OUT_OF_RANGE in the
        group's status. Synchronises (the records are copied to host memory)."""
        slot_arr = host_int_vector(slots, "slots")
        n = int(slot_arr.shape[0])
        if not self.enabled:
            return OffloadedRecords(model, n, {})
        self._outside_capture("offload")
        buffers = self._canary_buffers(self._groups_of(model))
        out = {(state.name, b): np.empty((n, CANARY_FIELDS_PER_SLOT), np.int64)
               for state, bufs in buffers for b in range(len(bufs))}
        space = self.space
        with self._timed("offload"), space.scope():
            for start, m, state, b, buf, src, status in self._staged_buffers(slot_arr, "src", buffers):
                offload_canary_records(canary_buf=buf, slots=src, records_out=self._copy_records.owner[:m],
                                       status=status, backend=self.config.backend, on_invalid="flag")
                space.to_host_async(self._copy_records.view[:m], out[(state.name, b)][start : start + m])
                space.synchronize()  # the staging buffer is reused by the next buffer
        return OffloadedRecords(model, n, out)

    def _staged_buffers(self, slot_arr: np.ndarray, role: str, buffers: list[tuple[GroupState, list[Any]]]
                        ) -> Iterator[tuple[int, int, GroupState, int, Any, Any, Any]]:
        """``slot_arr`` staged on the device in chunks of at most ``max_tokens`` slots (``role``: the "src" or
        "dst" staging buffer), then, per chunk, every canary buffer of ``buffers`` with that chunk's slots in the
        group's slot space: ``(start, length, group, buffer index, buffer, slots, group status)``."""
        space, cap = self.space, self.capacities.max_tokens
        n = int(slot_arr.shape[0])
        for start in range(0, n, cap):
            m = min(cap, n - start)
            host = self._copy_host[role]
            host[:m] = slot_arr[start : start + m]
            space.upload(self._copy_in[role].view[:m], host[:m])
            for state, bufs in buffers:
                group_slots = self._group_slots(state, role, m)
                status = self.scalars.owner(f"{state.name}.status")
                for b, buf in enumerate(bufs):
                    yield start, m, state, b, buf, group_slots, status

    def restore(self, records: OffloadedRecords, slots: Any, positions: Any, prev_slots: Any) -> int:
        """The engine loaded pages back from a lower tier into ``slots``: put their canary records there and
        verify the restored slots now, before any forward reads them. Returns the number of slots verified.

        ``records``: what :meth:`offload` returned for these pages (or :meth:`OffloadedRecords.select` of it), in
        the order of ``slots``; ``slots`` the device slots the pages landed in (full pool's slot space,
        distinct); ``positions`` their positions in the request; ``prev_slots`` the slot of each one's
        predecessor (``-1`` at position 0): the device slot the first restored page continues, so the chain
        across the boundary between resident and restored KV is checked too. The real KV must be in place
        (TAIL fingerprints are re-hashed from the restored bytes) and, for SWA groups, the LUT must map the
        restored slots. The verify runs on the SWEEP endpoints (chain, position, real KV); violations are
        reported by the next :meth:`finish_step` like any other. Outside any graph, between steps."""
        if not isinstance(records, OffloadedRecords):
            fail(f"records must be the OffloadedRecords of offload(), got {type(records).__name__}")
        check_offloaded_records(records, models=self.models)
        slot_arr = host_int_vector(slots, "slots")
        pos_arr, prev_arr = host_int_vector(positions, "positions"), host_int_vector(prev_slots, "prev_slots")
        n = int(slot_arr.shape[0])
        # one position, one predecessor and one record per restored slot: named before anything is written (a
        # shorter list would otherwise fail part way, a longer one be cut silently)
        for name, count in (("positions", int(pos_arr.shape[0])), ("prev_slots", int(prev_arr.shape[0])),
                            ("records", records.count)):
            if count != n:
                fail(f"{name} has {count} entries but slots has {n} entries; restore takes one per restored slot")
        if np.unique(slot_arr).shape[0] != n:
            fail("slots must name distinct slots (two pages restored into one slot)")
        if not self.enabled:
            return 0
        self._outside_capture("restore")
        self._check_launches(self._groups_of(records.model), "SWEEP")  # its verify runs them after the scatter
        buffers = self._canary_buffers(self._groups_of(records.model))
        check_offloaded_records(records, keys=[(state.name, b) for state, bufs in buffers for b in range(len(bufs))])
        space = self.space
        with self._timed("restore"), space.scope():
            for start, m, state, b, buf, dst, status in self._staged_buffers(slot_arr, "dst", buffers):
                space.upload(self._copy_records.view[:m], records.records[(state.name, b)][start : start + m])
                restore_canary_records(records=self._copy_records.owner[:m], slots=dst, canary_buf=buf,
                                       status=status, backend=self.config.backend, on_invalid="flag")
                space.synchronize()  # the staging buffer is reused by the next buffer
        groups = self._groups_of(records.model)
        with self._timed("restore"):
            self._verify_entries(groups, slot_arr, pos_arr, prev_arr, phase="restore")
        return n

