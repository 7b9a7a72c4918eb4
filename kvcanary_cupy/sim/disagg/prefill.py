"""The prefill process: the synthetic engine prefills every prompt under its canary and ships each finished
request's KV pages and canary records to a decode worker, chosen round-robin.

The engine sees each request as its prompt plus the first sampled token, so a request finishes on the step
its last prefill chunk runs; right after that step (before the next one can hand its slots to anybody) the
process gathers the request's KV rows and, with :func:`~kvcanary_cupy.gather_canary_records`, the records of
every canary buffer (HEAD and TAIL, K and V) at its slots, then sends them (:mod:`.wire`). Sender-side transfer
faults are applied to the outgoing payload here.
"""

from __future__ import annotations

import time
from typing import Any, cast

import numpy as np

from ...transfer import gather_canary_records
from ..config import PRESETS
from ..engine import Engine, size_engine
from ..requests import Request
from ..workload import RequestSpec, make_workload
from .config import DisaggConfig
from .faults import (
    KIND_INDEX,
    TRANSFER_KINDS,
    FaultSchedule,
    differing_positions,
    flip_kv_bit,
    flip_record_bit,
    swap_pages,
)
from .sides import SideSimulation
from .wire import OP_STOP, OP_TICK, Channel, PeerLost, Transfer, describe


class PrefillEngine(Engine):
    """The engine, remembering which requests finished in the last step."""

    finished: list[Request]

    def finish_step(self, batch: Any) -> list[Request]:
        self.finished = super().finish_step(batch)
        return self.finished


def workload_of(cfg: DisaggConfig) -> list[RequestSpec]:
    """The run's whole workload; every process draws the same one from the seed."""
    return make_workload(PRESETS[cfg.preset].shape, cfg.requests, cfg.steps, np.random.default_rng([cfg.seed, 0]))


def max_prefill_steps(cfg: DisaggConfig) -> int:
    """Steps the prefill side may take: arrivals end by 60 % of ``steps``; the rest is the prefill backlog."""
    return 4 * cfg.steps + 64


def wire_sizes(cfg: DisaggConfig) -> dict[str, int]:
    """The largest transfer (for the receiver's buffers): tokens, KV int64 words per token, canary buffers."""
    kinds = 2 if cfg.with_v else 1
    workload = workload_of(cfg)
    probe = size_engine(workload, max_running=1)
    return {"max_tokens": max(s.prompt_len for s in workload),
            "words": probe.kv_words_per_token * probe.num_layers * kinds, "buffers": 2 * kinds}


def buffers_of(sim: SideSimulation) -> list[Any]:
    """The canary buffers whose records travel, in a fixed order: per K/V endpoint, HEAD then TAIL."""
    group = sim.runtime.groups["FULL"]
    out = []
    for head, tail in zip(group.endpoints["HEAD"], group.endpoints["TAIL"], strict=True):
        out += [head.verify_ctx.canary_buf, tail.verify_ctx.canary_buf]
    return out


def kv_rows(sim: SideSimulation, slots: np.ndarray) -> np.ndarray:
    """The KV of ``slots`` as int64 [n, words]: every layer's K words, then every layer's V words."""
    store = sim.engine.kv["FULL"]
    xp = sim.xp
    index = xp.asarray(slots)
    page, row = index // store.page_size, index % store.page_size
    parts = [t[page, row] for kind in ("K", "V") for t in store.tensors[kind]]
    out = xp.concatenate(parts, axis=1) if parts else xp.zeros((slots.shape[0], 0), np.uint64)
    return np.ascontiguousarray(out.get() if hasattr(out, "get") else out).view(np.int64)


class PrefillSide:
    """Rank 0: step the prefill engine, ship finished requests, collect acknowledgements."""

    def __init__(self, cfg: DisaggConfig, channel: Channel) -> None:
        self.cfg = cfg
        self.channel = channel
        full = workload_of(cfg)
        self.workload = [RequestSpec(s.rid, s.arrival, s.tokens[: s.prompt_len + 1], s.prompt_len) for s in full]
        p = PRESETS[cfg.preset]
        engine_cfg = size_engine(self.workload, max_running=p.max_running, chunk_size=p.chunk_size,
                                 page_size=p.page_size, with_v=cfg.with_v)
        self.max_steps = max_prefill_steps(cfg)
        self.sim = SideSimulation(cfg.side_config(), self.workload, engine_cfg, PrefillEngine,
                                  max_steps=self.max_steps)
        self.engine = cast(PrefillEngine, self.sim.engine)
        self.buffers = buffers_of(self.sim)
        self.schedule = FaultSchedule(cfg.inject, cfg.warmup_steps, np.random.default_rng([cfg.seed, 7]))
        self.rng = np.random.default_rng([cfg.seed, 8])
        self.sent = 0
        self.recent: list[tuple[int, np.ndarray]] = []  # (rid, slots) of shipped requests, donors for wrong-request
        self.figures = {"requests": 0, "kv_bytes": 0, "canary_bytes": 0, "send_s": 0.0, "gather_s": 0.0}

    # -- building a transfer -------------------------------------------------------------------------------

    def _records(self, slots: np.ndarray) -> np.ndarray:
        xp = self.sim.xp
        n = slots.shape[0]
        out = xp.empty((len(self.buffers), n, 4), np.int64)
        index = xp.asarray(slots)
        for b, buf in enumerate(self.buffers):
            gather_canary_records(canary_buf=buf, slots=index, records_out=out[b], backend=self.sim.backend)
        return out.get() if hasattr(out, "get") else out

    def _sender_fault(self, kind: str, transfer: Transfer) -> bool:
        """Apply a sender-side fault to ``transfer`` in place; False when it cannot be placed on this one."""
        page = self.sim.engine_cfg.page_size
        if kind == "page-swap":
            done = swap_pages(transfer.kv, page, self.rng)
            if done is None:
                return False
            transfer.params = (*done, 0, 0)
        elif kind == "kv-bitflip-wire":
            words = self.sim.engine_cfg.kv_words_per_token
            transfer.params = (*flip_kv_bit(transfer.kv, words, self.cfg.real_kv_hash == "partial", self.rng), 0)
        elif kind == "record-bitflip-wire":
            transfer.params = flip_record_bit(transfer.records, self.rng)
        elif kind == "wrong-request":
            n = transfer.tokens
            donors = [(rid, s) for rid, s in self.recent if s.shape[0] >= n and rid != transfer.rid]
            for rid, donor_slots in reversed(donors):
                records = self._records(donor_slots[:n])
                if differing_positions(records, transfer.records, axis=1).shape[0]:
                    transfer.records = records
                    transfer.params = (rid, 0, 0, 0)
                    break
            else:
                return False
        transfer.fault = KIND_INDEX[kind]
        return True

    def _build(self, req: Request) -> tuple[Transfer, str | None]:
        n = req.prompt_len
        slots = req.slots[:n].copy()
        start = time.perf_counter()
        transfer = Transfer(req.rid, kv_rows(self.sim, slots), self._records(slots))
        self.figures["gather_s"] += time.perf_counter() - start
        kind = self.schedule.next()
        if kind is not None and TRANSFER_KINDS[kind].side == "sender" and not self._sender_fault(kind, transfer):
            self.schedule.retry(kind)
            kind = None
        elif kind is not None and TRANSFER_KINDS[kind].side == "receiver":
            transfer.fault = KIND_INDEX[kind]  # the decode worker places it and says whether it could
        self.recent = [*self.recent[-15:], (req.rid, slots)]
        return transfer, kind

    # -- the loop ------------------------------------------------------------------------------------------

    def _tick(self, step: int, finished: list[Request]) -> None:
        workers = self.cfg.decode_workers
        outgoing: dict[int, list[tuple[Transfer, str | None]]] = {w: [] for w in range(1, workers + 1)}
        for req in finished:
            outgoing[1 + self.sent % workers].append(self._build(req))
            self.sent += 1
        for worker, items in outgoing.items():
            start = time.perf_counter()
            try:
                self.channel.send_tick(worker, OP_TICK, step, len(items))
                for transfer, _ in items:
                    self.channel.send_transfer(worker, transfer)
                placed = self.channel.recv_ack(worker, step, len(items))
            except RuntimeError as exc:
                raise PeerLost(f"lost decode worker {worker} at prefill step {step}: {describe(exc)}") from None
            self.figures["send_s"] += time.perf_counter() - start
            for transfer, _ in items:
                self.figures["requests"] += 1
                self.figures["kv_bytes"] += transfer.kv.nbytes
                self.figures["canary_bytes"] += transfer.records.nbytes
            for (_, kind), ok in zip(items, placed, strict=True):
                if kind is not None and not ok:  # only a receiver-side fault can fail to be placed there
                    self.schedule.retry(kind)

    def run(self) -> dict[str, Any]:
        sim, engine = self.sim, self.engine
        total = len(self.workload)
        t = 0
        while t < self.max_steps and (t < self.cfg.steps or self.sent < total):
            engine.finished = []
            sim._step(t)
            self._tick(t, engine.finished)
            t += 1
        if self.sent < total:
            raise RuntimeError(f"prefill: {total - self.sent} of {total} requests were not prefilled within "
                               f"{self.max_steps} steps")
        for worker in range(1, self.cfg.decode_workers + 1):
            try:
                self.channel.send_tick(worker, OP_STOP, t, 0)
            except RuntimeError as exc:
                raise PeerLost(f"lost decode worker {worker} at the end of the run: {describe(exc)}") from None
        sim.finish(t - 1)
        result = sim.result()
        result["transfer"] = dict(self.figures)
        return result
