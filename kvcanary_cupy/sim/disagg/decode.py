"""A decode worker: receives transferred requests into its own pool and slot numbers, verifies every received
prefix before the request's first decode step, then decodes under its own canary.

Per prefill step the worker receives that step's transfers (:mod:`.wire`). For each: a request row and fresh
slots from its own allocator, the KV rows written into its own paged KV, the records scattered into its own
canary buffers with :func:`~kvcanary_cupy.scatter_canary_records` (receiver-side transfer faults are placed
here). Then the **transfer verify**: :class:`~kvcanary_cupy.ReceivedPrefixVerifier` over every canary buffer,
for the new requests' whole received prefixes and for the resident requests (a transfer that lands on a slot
somebody still owns damages the owner, not the newcomer), into a ring of its own, read at once. A request with
a violation is rejected (a real server would ask for the transfer again); the others join the decode batch,
and the next decode step runs with the worker's ordinary per-step canary.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...context import VerifyOrWriteContext
from ...scatter import launch_scatter_req_token_ids
from ...transfer import ReceivedPrefixVerifier, scatter_canary_records
from ...violations import read_violations, to_host
from ..config import PRESETS
from ..engine import size_engine
from ..requests import Request
from .config import DisaggConfig
from .faults import TRANSFER_KINDS, TransferKind, differing_positions, kind_of
from .prefill import buffers_of, kv_rows, max_prefill_steps, workload_of
from .sides import SideSimulation
from .wire import OP_STOP, Channel, PeerLost, Transfer, describe

TRANSFER_VERIFY = "transfer verify"


@dataclass
class Placement:
    """How a receiver-side fault damages one landing: which positions' KV and records land, and the fault."""

    kv_land: np.ndarray  # bool [tokens]
    rec_land: np.ndarray  # bool [tokens]
    position: int
    slot: int
    detail: str
    taint: list[int]  # receiver slots whose violations the fault explains


class DecodeSide:
    """Rank ``worker`` (1..N)."""

    def __init__(self, cfg: DisaggConfig, worker: int, channel: Channel) -> None:
        self.cfg, self.worker, self.channel = cfg, worker, channel
        full = workload_of(cfg)
        self.specs = {s.rid: s for s in full}
        preset = PRESETS[cfg.preset]
        share = -(-cfg.requests // cfg.decode_workers)
        engine_cfg = size_engine(full, max_running=max(2, share + 1), chunk_size=preset.chunk_size,
                                 page_size=preset.page_size, with_v=cfg.with_v)
        self.longest = max(s.output_len for s in full)
        self.sim = SideSimulation(cfg.side_config(), [], engine_cfg,
                                  max_steps=max_prefill_steps(cfg) + self.longest + 16)
        sim = self.sim
        self.engine = sim.engine
        self.buffers = buffers_of(sim)
        self.rng = np.random.default_rng([cfg.seed, 100 + worker])
        xp = sim.xp
        self.state = VerifyOrWriteContext.allocate(num_slots=1, ring_capacity=cfg.ring_capacity, device=sim.device)
        group = sim.runtime.groups["FULL"]
        self.contexts = []
        for head, tail in zip(group.endpoints["HEAD"], group.endpoints["TAIL"], strict=True):
            for ep in (head, tail):  # the order of prefill.buffers_of
                self.contexts.append(ep.verify_ctx.for_endpoint(
                    violation_ring=self.state.violation_ring, violation_write_index=self.state.violation_write_index,
                    status=self.state.status, slot_run_counter=xp.zeros(1, np.int64),
                    kernel_run_counter=xp.zeros(1, np.int64)))
        self.verifier = ReceivedPrefixVerifier(verify_capacity=3 * engine_cfg.num_slots,
                                               max_requests=engine_cfg.max_reqs, device=sim.device)
        self.caught_at: dict[int, str] = {}
        self.fault_side: dict[int, str] = {}
        self.figures = {"requests": 0, "pages": 0, "kv_bytes": 0, "canary_bytes": 0, "accepted": 0, "rejected": 0,
                        "rejected_residents": 0, "verify_entries": 0, "recv_s": 0.0, "land_s": 0.0, "verify_s": 0.0}

    # -- landing a transfer --------------------------------------------------------------------------------

    def _new_fault(self, kind: TransferKind, step: int, req: Request, position: int, slot: int, detail: str,
                   taint: list[int]) -> None:
        fault = self.sim.tracker.new(kind, step, "FULL", detail, request=req, position=position, slot=slot)  # type: ignore[arg-type]
        self.sim.tracker.taint(fault, "FULL", taint)
        self.fault_side[fault.fid] = kind.side
        self.sim.timeline["injected"][step] += 1

    def _kv_of(self, slots: np.ndarray) -> np.ndarray:
        return kv_rows(self.sim, slots)

    def _old_records(self, slots: np.ndarray) -> np.ndarray:
        return np.stack([to_host(buf.view(np.int64)[self.sim.xp.asarray(slots), :4]) for buf in self.buffers])

    def _pick_owned(self, transfer: Transfer, n: int) -> tuple[int, Request, int, int] | None:
        """(position of the newcomer, resident victim, its position, its slot) with differing content."""
        residents = [r for r in self.engine.decoding if r.computed > 0]
        if not residents:
            return None
        for _ in range(8):
            victim = residents[int(self.rng.integers(len(residents)))]
            q = int(self.rng.integers(victim.computed))
            p = int(self.rng.integers(n))
            slot = int(victim.slots[q])
            if self.engine.alloc.refs[slot] != 1:
                continue  # shared with the prefix cache: pick a slot only the victim holds
            old = self._old_records(np.array([slot]))[:, 0]
            if differing_positions(old[None], transfer.records[:, p][None], axis=0).shape[0]:
                return p, victim, q, slot
        return None

    def _place(self, kind: TransferKind, transfer: Transfer, req: Request, slots: np.ndarray) -> Placement | None:
        """Decide how a receiver-side fault damages this landing (``slots`` may be changed in place); None when
        it would change nothing here."""
        eng, n, page = self.engine, transfer.tokens, self.engine.cfg.page_size
        pages = -(-n // page)
        placement = Placement(np.ones(n, bool), np.ones(n, bool), 0, 0, "", [])
        if kind.name == "slot-owned":
            pick = self._pick_owned(transfer, n)
            if pick is None:
                return None
            p, victim, q, vslot = pick
            eng.alloc.share(vslot)
            eng._release([int(slots[p])])
            slots[p] = vslot
            successor = [int(victim.slots[q + 1])] if q + 1 < victim.assigned else []
            placement.position, placement.slot, placement.taint = p, vslot, [vslot, *successor]
            placement.detail = (f"position {p} of request {req.rid} landed on slot {vslot}, still held by request "
                                f"{victim.rid} (position {q})")
        elif kind.name == "page-drop":
            k = int(self.rng.integers(pages))
            span = np.arange(k * page, min(n, (k + 1) * page))
            changed = span[differing_positions(self._kv_of(slots[span]), transfer.kv[span])]
            if changed.shape[0] == 0:
                return None
            placement.kv_land[span] = False
            placement.position, placement.slot = int(span[0]), int(slots[span[0]])
            placement.taint = [int(slots[p]) for p in changed]
            placement.detail = f"KV page {k} (positions {span[0]}..{span[-1]}) of request {req.rid} never landed"
        else:  # short-transfer
            if pages < 2:
                return None
            m = int(self.rng.integers(1, pages))
            tail = np.arange(m * page, n)
            stale_records = tail[differing_positions(self._old_records(slots[tail]), transfer.records[:, tail], axis=1)]
            changed = np.union1d(tail[differing_positions(self._kv_of(slots[tail]), transfer.kv[tail])], stale_records)
            if changed.shape[0] == 0:
                return None
            placement.kv_land[tail] = False
            placement.rec_land[tail] = False
            placement.position, placement.slot = int(tail[0]), int(slots[tail[0]])
            # the next position's chain check reads a stale record's chain hash: its slot fails even when it
            # holds the very record that should have landed there
            successors = stale_records[stale_records + 1 < n] + 1
            placement.taint = [int(slots[p]) for p in np.union1d(changed, successors)]
            placement.detail = (f"transfer of request {req.rid} ended after {m} of {pages} pages ({tail[0]} of {n} "
                                "positions)")
        return placement

    def _write(self, transfer: Transfer, slots: np.ndarray, kv_land: np.ndarray, rec_land: np.ndarray) -> None:
        """The KV rows into this worker's paged KV, the records into its canary buffers (what landed)."""
        xp, store = self.sim.xp, self.engine.kv["FULL"]
        words = self.engine.cfg.kv_words_per_token
        index = np.flatnonzero(kv_land)
        dest = xp.asarray(slots[index])
        page_of, row_of = dest // store.page_size, dest % store.page_size
        segments = [t for kind in ("K", "V") for t in store.tensors[kind]]  # the order of prefill.kv_rows
        for s, tensor in enumerate(segments):
            tensor[page_of, row_of] = xp.asarray(transfer.kv[index, s * words:(s + 1) * words].view(np.uint64))
        index = np.flatnonzero(rec_land)
        dest = xp.asarray(slots[index])
        for b, buf in enumerate(self.buffers):
            scatter_canary_records(records=xp.asarray(np.ascontiguousarray(transfer.records[b, index])), slots=dest,
                                   canary_buf=buf, backend=self.sim.backend)

    def _land(self, transfer: Transfer, step: int) -> tuple[Request, bool]:
        """Admit the request, write its KV and records into this worker's pool, placing a receiver-side fault.
        Returns the request and whether the fault the header asked for could be placed."""
        eng = self.engine
        spec = self.specs[transfer.rid]
        n = spec.prompt_len
        if transfer.tokens != n:
            raise RuntimeError(f"transfer of request {transfer.rid} carries {transfer.tokens} positions, its prompt "
                               f"has {n}")
        if not eng.rows_free:
            raise RuntimeError(f"decode worker {self.worker}: no free request row for request {transfer.rid}")
        rp = eng.rows_free.pop()
        req = Request(spec, rp, eng.cfg.max_seq_len)
        req.recycled = bool(eng.row_used[rp])
        eng.row_used[rp] = True
        req.admitted_step = step
        slots = eng._alloc(n)
        kind = kind_of(transfer.fault)
        placement = None
        if kind is not None and kind.side == "receiver":
            placement = self._place(kind, transfer, req, slots)
        eng._assign(req, 0, slots)
        req.computed = n
        req.num_tokens = min(n + 1, spec.total_len)  # the first token was sampled by the prefill side
        eng.flush()
        start = time.perf_counter()
        land = placement or Placement(np.ones(n, bool), np.ones(n, bool), 0, 0, "", [])
        self._write(transfer, slots, land.kv_land, land.rec_land)
        self.figures["land_s"] += time.perf_counter() - start
        if kind is not None and placement is not None:
            self._new_fault(kind, step, req, placement.position, placement.slot, placement.detail, placement.taint)
        elif kind is not None and kind.side == "sender":
            self._sender_fault(kind, transfer, req, step)
        self.figures["requests"] += 1
        self.figures["pages"] += -(-n // eng.cfg.page_size)
        self.figures["kv_bytes"] += transfer.kv.nbytes
        self.figures["canary_bytes"] += transfer.records.nbytes
        return req, kind is None or kind.side == "sender" or placement is not None

    def _sender_fault(self, kind: TransferKind, transfer: Transfer, req: Request, step: int) -> None:
        """Register what the prefill side did to this payload (its header says), in this worker's slots."""
        a, b, c, d = transfer.params
        n = transfer.tokens
        slots = req.slots
        page = self.engine.cfg.page_size
        if kind.name == "page-swap":
            positions = [p for k in (a, b) for p in range(k * page, min(n, (k + 1) * page))]
            detail, position = f"KV pages {a} and {b} of request {req.rid} swapped in flight", a * page
        elif kind.name == "kv-bitflip-wire":
            positions, position = [a], a
            detail = f"KV payload of request {req.rid}: position {a}, word {b}, bit {c} flipped in flight"
        elif kind.name == "record-bitflip-wire":
            positions, position = [p for p in (b, b + 1) if p < n], b
            detail = (f"canary record of request {req.rid}: buffer {a}, position {b}, field {c}, bit {d} flipped "
                      "in flight")
        else:  # wrong-request
            positions, position = list(range(n)), 0
            detail = f"records of request {a} sent with the pages of request {req.rid}"
        self._new_fault(kind, step, req, position, int(slots[position]), detail, [int(slots[p]) for p in positions])

    # -- the transfer verify -------------------------------------------------------------------------------

    def _transfer_verify(self, step: int, incoming: list[Request]) -> None:
        eng, sim, xp = self.engine, self.sim, self.sim.xp
        reqs = incoming + [r for r in eng.decoding if r.computed > 0]
        parts = [r.tokens[: r.num_tokens] for r in incoming]
        for r, part in zip(incoming, parts, strict=True):
            eng.pool_host[r.rp, : part.shape[0]] = part
        offsets = np.zeros(len(incoming) + 1, np.int64)
        np.cumsum([p.shape[0] for p in parts], out=offsets[1:])
        start = time.perf_counter()
        pool = sim.runtime.expected_token_pool  # the runtime's; its next prepare() rescatters the same rows
        launch_scatter_req_token_ids(flat_in=xp.asarray(np.concatenate(parts)), offsets=xp.asarray(offsets),
                                     req_pool_indices=xp.asarray(np.array([r.rp for r in incoming], np.int64)),
                                     pool_out=pool, status=self.state.status, backend=sim.backend)
        rpi = xp.asarray(np.array([r.rp for r in reqs], np.int64))
        lens = xp.asarray(np.array([r.computed for r in reqs], np.int64))
        valid = xp.asarray(np.array([r.num_tokens for r in reqs], np.int64))
        for ctx in self.contexts:
            self.verifier.verify(context=ctx, req_pool_indices=rpi, received_lens=lens, req_to_token=eng.req_to_token,
                                 req_to_verify_expected_tokens=pool,
                                 req_to_verify_expected_tokens_valid_lens=valid, backend=sim.backend)
            if int(to_host(self.verifier.plan.enable)[0]) != 1:
                raise RuntimeError(f"decode worker {self.worker}: the transfer verify plan overflowed its capacity")
        self.figures["verify_entries"] += len(self.contexts) * int(sum(r.computed for r in reqs))
        report = read_violations(self.state)
        self.figures["verify_s"] += time.perf_counter() - start
        self.state.violation_write_index.fill(0)
        if report.status:
            sim.status_bits |= report.status
            self.state.status.fill(0)
        sim.dropped += report.dropped
        bad: set[int] = set()
        for v in report.rows:
            bad.add(v.slot)
            sim.timeline["violations"][step] += 1
            sim.by_tag[f"{TRANSFER_VERIFY}/{v.launch_tag}"] += 1
            for name in v.reasons:
                sim.by_reason[name] += 1
            faults = sim.tracker.explain("FULL", v.slot, v.reason_bits, step)
            if not faults:
                sim.timeline["false_positives"][step] += 1
                sim.false_positives.append({
                    "read_step": step, "launch_step": step, "group": "FULL", "launch_tag": f"{TRANSFER_VERIFY}/"
                    f"{v.launch_tag}", "slot": v.slot, "position": v.position, "stored_token": v.stored_token,
                    "expected_token": v.expected_token, "reasons": list(v.reasons)})
                continue
            sim.timeline["explained"][step] += 1
            for fault, bits in faults:
                if sim.tracker.record(fault, step, step, f"{TRANSFER_VERIFY}/{v.launch_tag}", bits):
                    sim.timeline["detected"][step] += 1
                    self.caught_at[fault.fid] = TRANSFER_VERIFY
        rejected = [r for r in reqs if bad & set(r.slots[: r.computed].tolist())]
        for req in rejected:
            self._reject(req, resident=req not in incoming)
        dropped = {r.rid for r in rejected}
        for fault in sim.tracker.faults:
            if fault.request in dropped:
                sim.tracker.retire(fault)
        for req in incoming:
            if req in rejected:
                continue
            self.figures["accepted"] += 1
            if req.num_tokens >= req.spec.total_len:
                eng._finish(req, step)  # a one-token answer: the prefill side already produced it
            else:
                eng.decoding.append(req)

    def _reject(self, req: Request, *, resident: bool) -> None:
        eng = self.engine
        eng._release(req.slots[: req.assigned])
        eng.rows_free.append(req.rp)
        if req in eng.decoding:
            eng.decoding.remove(req)
        self.figures["rejected_residents" if resident else "rejected"] += 1

    # -- the loop ------------------------------------------------------------------------------------------

    def _note_caught(self) -> None:
        for fault in self.sim.tracker.faults:
            if fault.detected and fault.fid not in self.caught_at:
                self.caught_at[fault.fid] = f"decode step ({fault.detected_by})"

    def _drill(self, step: int) -> None:
        if self.cfg.kill_decode_worker == (self.worker, step):
            os.kill(os.getpid(), signal.SIGKILL)

    def run(self) -> dict[str, Any]:
        sim, channel = self.sim, self.channel
        t = 0
        while True:
            start, landing = time.perf_counter(), self.figures["land_s"]
            try:
                op, step, count = channel.recv_tick()
                if op == OP_STOP:
                    break
                incoming, placed = [], []
                for _ in range(count):
                    transfer = channel.recv_transfer()
                    req, ok = self._land(transfer, t)  # before the next receive reuses the buffers
                    incoming.append(req)
                    placed.append(ok)
            except RuntimeError as exc:
                raise PeerLost(f"decode worker {self.worker} lost the prefill process at step {t}: "
                               f"{describe(exc)}") from None
            self.figures["recv_s"] += time.perf_counter() - start - (self.figures["land_s"] - landing)
            if incoming:
                self._transfer_verify(t, incoming)
            try:
                channel.send_ack(step, placed)
            except RuntimeError as exc:
                raise PeerLost(f"decode worker {self.worker} lost the prefill process at step {t}: "
                               f"{describe(exc)}") from None
            self._drill(t)
            sim._step(t)
            self._note_caught()
            t += 1
        limit = t + self.longest + 8
        while self.engine.decoding and t < limit:
            self._drill(t)
            sim._step(t)
            self._note_caught()
            t += 1
        sim.finish(t - 1)
        self._note_caught()
        result = sim.result()
        for row in result["faults"]:
            row["worker"] = self.worker
            row["side"] = self.fault_side.get(row["id"], "")
            row["caught_at"] = self.caught_at.get(row["id"])
        result["transfer"] = dict(self.figures)
        result["kinds_requested"] = [k for k in TRANSFER_KINDS if k in self.cfg.inject]
        return result
