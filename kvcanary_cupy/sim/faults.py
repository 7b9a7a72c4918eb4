"""Fault injection: the KV-cache bugs of real serving engines, one small class per kind, and their bookkeeping.

Each injector picks a live target (a request in this step's batch, or a slot that such a request's verify
reads), breaks one thing the way the real bug does, and records a :class:`Fault`: its kind, step, request,
position and the slots whose violations it explains. Violations are read one step late and attributed by
:meth:`FaultTracker.explain`: a row is explained when the faults injected at or before the step that produced
it and tainting the row's slot (in the row's canary group: FULL, SWA or DRAFT) can, together, cause every
reason bit of the row. Anything else is a false positive and fails the run.

Taint starts with the slots a fault touches and the slots that follow them in some chain (a corrupted canary at
slot ``s`` shows up as a CHAIN mismatch on ``s``'s successor). Then it follows the engine (hooks
:meth:`FaultTracker.on_assign` and :meth:`FaultTracker.on_splice`): a slot written right after a corrupted one,
the new SWA slot of a tainted full slot, the join where the prefix cache splices a chain that descends from
corrupted content onto a clean one. A fault kind counts as detected when at least one of its faults was, and
each fault's latency is the number of steps from its injection to the host reading its first violation.

Rates are expected injections per step (see :class:`FaultInjector` for the schedule); every requested kind
fires once right after the warm-up, so each is exercised at least once.
"""

from __future__ import annotations

import abc
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from ..constants import FailReason
from .engine import Engine
from .requests import Batch, Request

R = FailReason
VERIFY_ANY = int(R.VERIFY_CHAIN_HASH_MISMATCH | R.VERIFY_POSITION_MISMATCH | R.VERIFY_REAL_KV_HASH_MISMATCH
                 | R.VERIFY_TOKEN_MISMATCH)
SLOT_CORRUPTION = VERIFY_ANY | int(R.WRITE_POSITION_MISMATCH)
GROUPS = ("FULL", "SWA", "DRAFT")
DEFAULT_RATE = 0.03
MAX_PENDING = 2


@dataclass
class Fault:
    """One injected fault and what became of it."""

    fid: int
    kind: str
    step: int
    group: str  # canary group whose buffers the fault hits first: FULL, SWA, DRAFT
    request: int | None
    position: int | None
    slot: int | None  # in the group's slot space (SWA slots for SWA)
    detail: str
    allowed_bits: int
    taint: dict[str, set[int]] = field(default_factory=lambda: {g: set() for g in GROUPS})
    sources: dict[str, set[int]] = field(default_factory=lambda: {g: set() for g in GROUPS})
    # outcome
    detection_read_step: int | None = None
    detection_launch_step: int | None = None
    detected_by: str | None = None
    violations: int = 0
    reason_bits: int = 0

    @property
    def detected(self) -> bool:
        return self.detection_read_step is not None

    @property
    def latency(self) -> int | None:
        """Steps from injection to the host reading the first violation it explains."""
        return None if self.detection_read_step is None else self.detection_read_step - self.step


@dataclass(frozen=True)
class CarriedTaint:
    """What the faults had charged to the slots of a page when it left the device (a tier's write-back), for the
    faults whose damage lives in the slots' KV and records (:attr:`FaultKind.damages_content`):
    ``(group, index in the page, explaining fault ids, corrupted-content fault ids, chain-descent fault ids)``
    for every page position some fault touched. The page's bytes and records carry that damage with them; on
    its load-back :meth:`FaultTracker.carry` charges it to the slots the page lands in."""

    entries: tuple[tuple[str, int, tuple[int, ...], tuple[int, ...], tuple[int, ...]], ...] = ()


class FaultTracker:
    """Every fault of a run, and per canary group three slot indexes:

    * ``taint`` — slots whose violations a fault explains (what :meth:`explain` looks up);
    * ``sources`` — slots whose canary content a fault corrupted: a slot later written right after one of them
      is seeded from the corrupted content, so it is tainted too (its chain hash or position check fails);
    * ``chain`` — slots whose stored chain hash *descends* from corrupted content (written after a source, or
      after such a slot). They verify cleanly along their own chain, but when the prefix cache splices such a
      chain onto a clean one (or a clean one onto it) the join fails its chain check; :meth:`on_splice`
      taints the joining slot.
    """

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.faults: list[Fault] = []
        self._taint: dict[str, dict[int, list[Fault]]] = {g: defaultdict(list) for g in GROUPS}
        self._sources: dict[str, dict[int, list[Fault]]] = {g: defaultdict(list) for g in GROUPS}
        self._chain: dict[str, dict[int, set[int]]] = {g: {} for g in GROUPS}
        self._request_taint: dict[int, list[tuple[Fault, tuple[str, ...]]]] = defaultdict(list)

    def new(self, kind: FaultKind, step: int, group: str, detail: str, *, request: Request | None = None,
            position: int | None = None, slot: int | None = None) -> Fault:
        fault = Fault(fid=len(self.faults), kind=kind.name, step=step, group=group,
                      request=None if request is None else request.rid, position=position, slot=slot,
                      detail=detail, allowed_bits=kind.allowed_bits)
        self.faults.append(fault)
        return fault

    @staticmethod
    def _ints(slots: Any) -> list[int]:
        if isinstance(slots, (set, frozenset)):
            slots = sorted(slots)
        return [int(s) for s in np.atleast_1d(np.asarray(slots, np.int64)).tolist()]

    def taint(self, fault: Fault, group: str, slots: Any, *, source: bool = False, chain: bool = False,
              explain: bool = True) -> None:
        """Add ``slots`` of ``group`` to the fault's explained slots (``explain``), its corrupted-content
        slots (``source``) and/or the slots whose chain descends from it (``chain``)."""
        for s in self._ints(slots):
            if s <= 0:
                continue
            if explain and s not in fault.taint[group]:
                fault.taint[group].add(s)
                self._taint[group][s].append(fault)
            if source and s not in fault.sources[group]:
                fault.sources[group].add(s)
                self._sources[group][s].append(fault)
            if chain:
                self._chain[group].setdefault(s, set()).add(fault.fid)

    def taint_full(self, fault: Fault, slots: Any, *, groups: tuple[str, ...] = GROUPS, source: bool = False,
                   chain: bool = False, explain: bool = True) -> None:
        """Taint full-pool slots in the full-indexed groups and their current SWA slots in the SWA group."""
        slots = self._ints(slots)
        for group in groups:
            if group == "SWA":
                if self.engine.swa:
                    self.taint(fault, "SWA", [self.engine.swa_of(s) for s in slots], source=source, chain=chain,
                               explain=explain)
            elif group != "DRAFT" or self.engine.cfg.eagle:
                self.taint(fault, group, slots, source=source, chain=chain, explain=explain)

    def taint_request(self, fault: Fault, req: Request, groups: tuple[str, ...] = GROUPS) -> None:
        """Taint every slot ``req`` holds now or will be given."""
        self._request_taint[req.rid].append((fault, groups))
        self.taint_full(fault, req.slots[: req.assigned], groups=groups)

    def retire(self, fault: Fault) -> None:
        """``fault``'s damage is gone (its request was dropped and its slots go back to be rewritten): from
        now on it explains nothing, so a later owner of those slots is judged on its own."""
        for group in GROUPS:
            for s in fault.taint[group]:
                if fault in self._taint[group].get(s, ()):
                    self._taint[group][s].remove(fault)
            for s in fault.sources[group]:
                if fault in self._sources[group].get(s, ()):
                    self._sources[group][s].remove(fault)
            for fids in self._chain[group].values():
                fids.discard(fault.fid)
        for entries in self._request_taint.values():
            entries[:] = [(f, groups) for f, groups in entries if f is not fault]

    def _origin(self, group: str, pred: int) -> set[int]:
        """Faults whose corruption a slot written right after ``pred`` descends from."""
        out = set(self._chain[group].get(pred, ()))
        out.update(f.fid for f in self._sources[group].get(pred, ()))
        return out

    def on_assign(self, req: Request, positions: np.ndarray, slots: np.ndarray, preds: np.ndarray,
                  swa: np.ndarray, pred_swa: np.ndarray) -> None:
        """Engine hook, called whenever positions of ``req`` get slots: propagate taint to the new slots."""
        del positions
        for fault, groups in self._request_taint.get(req.rid, ()):
            self.taint_full(fault, slots, groups=groups)
        if not self.faults:
            return
        spaces = [("FULL", slots.tolist(), preds.tolist())]
        if self.engine.cfg.eagle:
            spaces.append(("DRAFT", spaces[0][1], spaces[0][2]))
        if self.engine.swa:
            spaces.append(("SWA", swa.tolist(), pred_swa.tolist()))
        for group, new, prev in spaces:
            chain, sources = self._chain[group], self._sources[group]
            for slot, pred in zip(new, prev, strict=True):
                origin = self._origin(group, pred) if pred > 0 else set()
                if origin:
                    chain[slot] = origin
                    for fault in sources.get(pred, ()):
                        self.taint(fault, group, [slot])  # seeded from corrupted content
                else:
                    chain.pop(slot, None)
        if self.engine.swa:
            # SWA taint follows the LUT: a verify that still reaches a tainted full slot (a stale req_to_token
            # entry, a doubly allocated slot) now lands on its new SWA slot
            for slot, x in zip(slots.tolist(), swa.tolist(), strict=True):
                for fault in self._taint["FULL"].get(slot, ()):
                    self.taint(fault, "SWA", [x], source=slot in fault.sources["FULL"])

    def snapshot(self, slots: dict[str, np.ndarray]) -> CarriedTaint:
        """The damage charged to ``slots`` (per group, in that group's slot space; 0 where a position has no slot
        in the group) now, for a page copied out of them (see :class:`CarriedTaint`)."""
        entries = []
        travels = {f.fid for f in self.faults if ALL_FAULT_KINDS[f.kind].damages_content}
        for group, arr in slots.items():
            taint, sources, chain = self._taint[group], self._sources[group], self._chain[group]
            for i, s in enumerate(self._ints(arr)):
                if s <= 0:
                    continue
                explain = tuple(sorted({f.fid for f in taint.get(s, ())} & travels))
                source = tuple(sorted({f.fid for f in sources.get(s, ())} & travels))
                descent = tuple(sorted(set(chain.get(s, ())) & travels))
                if explain or source or descent:
                    entries.append((group, i, explain, source, descent))
        return CarriedTaint(tuple(entries))

    def carry(self, carried: CarriedTaint, slots: dict[str, np.ndarray]) -> None:
        """A page copied out with ``carried`` landed in ``slots`` (per group, as for :meth:`snapshot`): each
        fault's damage to a page position is charged to the slot that position lands in. Only damage some fault
        had already caused travels: a page that left the device clean carries nothing, so a violation at its
        restored slots stays unexplained unless a fault explains it there."""
        for group, i, explain, source, descent in carried.entries:
            if group not in slots or i >= len(slots[group]):
                continue
            s = int(slots[group][i])
            if s <= 0:
                continue
            for fid in explain:
                self.taint(self.faults[fid], group, [s])
            for fid in source:
                self.taint(self.faults[fid], group, [s], source=True, explain=False)
            for fid in descent:
                self.taint(self.faults[fid], group, [s], chain=True, explain=False)

    def on_splice(self, prev: int, first: int) -> None:
        """Engine hook: the prefix cache now holds ``first`` right after ``prev`` (a request's own chain joined
        onto a cached path). If either side's chain descends from a fault, ``first`` fails its chain check."""
        pairs = [("FULL", prev, first)]
        if self.engine.cfg.eagle:
            pairs.append(("DRAFT", prev, first))
        if self.engine.swa:
            pairs.append(("SWA", self.engine.swa_of(prev), self.engine.swa_of(first)))
        for group, p, f in pairs:
            if p <= 0 or f <= 0:
                continue
            fids = self._origin(group, p) | self._chain[group].get(f, set())
            for fid in sorted(fids):
                self.taint(self.faults[fid], group, [f])

    def explain(self, group: str, slot: int, bits: int, launch_step: int) -> list[tuple[Fault, int]]:
        """Faults that explain a violation of ``group`` at ``slot`` produced by a launch at ``launch_step``, each
        with the reason bits it accounts for. The faults tainting the slot must, together, allow every bit of
        ``bits`` (one row may carry the reasons of two overlapping faults); each bit goes to the most specific
        faults allowing it (fewest allowed reasons). Empty: a false positive."""
        cands = [f for f in self._taint[group].get(slot, ()) if f.step <= launch_step]
        allowed = 0
        for f in cands:
            allowed |= f.allowed_bits
        if not cands or bits & ~allowed:
            return []
        share: dict[int, int] = {}
        for bit in (1 << i for i in range(bits.bit_length()) if bits >> i & 1):
            owners = [f for f in cands if f.allowed_bits & bit]
            narrowest = min(f.allowed_bits.bit_count() for f in owners)
            for f in owners:
                if f.allowed_bits.bit_count() == narrowest:
                    share[f.fid] = share.get(f.fid, 0) | bit
        return [(f, share[f.fid]) for f in cands if f.fid in share]

    @staticmethod
    def record(fault: Fault, read_step: int, launch_step: int, tag: str, bits: int) -> bool:
        """Count one violation explained (partly) by ``fault`` with reason ``bits``; True on its first detection."""
        fault.violations += 1
        fault.reason_bits |= bits
        if fault.detection_read_step is None:
            fault.detection_read_step, fault.detection_launch_step, fault.detected_by = read_step, launch_step, tag
            return True
        return False


# ---- the fault kinds ---------------------------------------------------------------------------------------


@dataclass
class InjectionContext:
    engine: Engine
    tracker: FaultTracker
    rng: np.random.Generator
    step: int
    batch: Batch | None
    group: str = "FULL"
    partial_hash: bool = False


def _choice(rng: np.random.Generator, items: list[Any]) -> Any:
    return items[int(rng.integers(len(items)))]


class FaultKind(abc.ABC):
    """One kind of KV-cache bug. Subclasses set the class attributes and implement :meth:`inject`."""

    name: ClassVar[str]
    title: ClassVar[str]
    summary: ClassVar[str]  # one sentence: the real bug and how the canary sees it
    phase: ClassVar[str]  # "batch", "forward", "after_forward" or "after_step"
    allowed_bits: ClassVar[int]
    needs: ClassVar[str] = ""  # "swa": needs an SWA group
    # the damage lives in slots' KV bytes or canary records (so it travels with a page copied to a lower tier);
    # False: it lives in what the plan reads (a slot table entry, the expected-token pool) and stays behind
    damages_content: ClassVar[bool] = True
    kv_groups: ClassVar[bool] = False  # picks one of the canary groups (FULL, SWA, DRAFT) per injection

    def applicable(self, engine: Engine) -> bool:
        return self.needs != "swa" or engine.swa

    @abc.abstractmethod
    def inject(self, ctx: InjectionContext) -> Fault | tuple[Fault, int, int] | None:
        """Corrupt the engine state once; return the fault record (with the token and victim slot it redirects,
        for a ``forward`` kind), or None when no target exists now."""


def _written_rows(batch: Batch, min_prefix: int) -> list[int]:
    return [i for i in range(len(batch.reqs)) if int(batch.prefix_h[i]) >= min_prefix]


class DoubleAllocation(FaultKind):
    """The allocator hands a slot that a live request still holds to a second request (a double free, or a
    free-list race). The second request's write overwrites the first one's canary: the first request's next
    verify sees a foreign position/token at that slot (POSITION, TOKEN) and a broken chain on its successor
    (CHAIN); its TAIL verify sees the new real KV bytes (REAL_KV). In the block layouts the allocator hands out a
    live *block*: the second request takes it as its next block, and each of its tokens written there overwrites
    the first request's canary at that offset."""

    name = "double-alloc"
    title = "slot handed to two live requests"
    summary = ("The allocator gives a slot that a live request still holds to a second request; the first "
               "request's next verify finds the intruder's token and position there and a broken chain after it.")
    phase = "batch"
    allowed_bits = SLOT_CORRUPTION

    def inject(self, ctx: InjectionContext) -> Fault | None:
        if ctx.engine.paged:
            return self._inject_block(ctx)
        batch, eng, rng = ctx.batch, ctx.engine, ctx.rng
        assert batch is not None
        # victim: a row with a written position of its own (not shared through the prefix cache) below its seed
        victims = [i for i in range(len(batch.reqs)) if int(batch.prefix_h[i]) - 1 > batch.reqs[i].tree_len]
        thieves = [j for j in range(len(batch.reqs)) if int(batch.extend_h[j]) > 0]
        pairs = [(i, j) for i in victims for j in thieves if i != j]
        if not pairs:
            return None
        i, j = _choice(rng, pairs)
        victim, thief = batch.reqs[i], batch.reqs[j]
        own = [p for p in range(victim.tree_len, int(batch.prefix_h[i]) - 1) if eng.entry_intact(victim, p)]
        if not own:
            return None
        p = _choice(rng, own)
        positions = [q for q in range(int(batch.prefix_h[j]), int(batch.prefix_h[j] + batch.extend_h[j])) if q != p]
        if not positions:
            return None
        q = _choice(rng, positions)
        slot = int(victim.slots[p])
        fault = ctx.tracker.new(self, ctx.step, "FULL", f"slot {slot} (request {victim.rid}, position {p}) also "
                                f"given to request {thief.rid} for position {q}", request=victim, position=p, slot=slot)
        ctx.tracker.taint_full(fault, [slot], source=True)
        ctx.tracker.taint_full(fault, eng.successors(slot))
        eng.rebind(batch, batch.token_index(j, q), slot)
        return fault

    def _inject_block(self, ctx: InjectionContext) -> Fault | None:
        batch, eng, rng = ctx.batch, ctx.engine, ctx.rng
        assert batch is not None
        size = eng.unit
        # victim: a whole block of a row's own (not shared through the prefix cache), written, below its seed
        victims = [(i, k) for i, req in enumerate(batch.reqs)
                   for k in range(-(-req.tree_len // size), (int(batch.prefix_h[i]) - 1) // size)
                   if eng.entry_intact(req, k * size)]
        # thief: a row given a fresh block this step (its first position is one of this step's new tokens)
        thieves = [(j, k) for j in range(len(batch.reqs))
                   for k in range(-(-int(batch.prefix_h[j]) // size),
                                  -(-int(batch.prefix_h[j] + batch.extend_h[j]) // size))]
        pairs = [(v, t) for v in victims for t in thieves if v[0] != t[0]]
        if not pairs:
            return None
        (i, k), (j, kj) = _choice(rng, pairs)
        victim, thief = batch.reqs[i], batch.reqs[j]
        block = victim.blocks[k]
        slots = eng.block_slots(block)
        fault = ctx.tracker.new(self, ctx.step, "FULL", f"block {block} (request {victim.rid}, positions {k * size}-"
                                f"{k * size + size - 1}) also given to request {thief.rid} as its block {kj}",
                                request=victim, position=k * size, slot=int(slots[0]))
        ctx.tracker.taint_full(fault, slots, source=True)  # the thief overwrites them as it fills the block
        ctx.tracker.taint_full(fault, set().union(*(eng.successors(s) for s in slots.tolist())))
        eng.rebind_block(batch, j, kj, block)
        return fault


class ReqToTokenCorruption(FaultKind):
    """A ``req_to_token`` entry of a live request points at the wrong slot (a stale or mis-indexed table
    write, e.g. after a retract or a prefix-cache remap). Attention reads someone else's KV; the plan gathers
    the wrong slot, whose stored position/token/chain belong to another sequence (POSITION, TOKEN, CHAIN), and
    the next position's chain check fails because its predecessor is now the foreign slot. In the block layouts
    the entry is a block id of the request's block list: all its positions read another block's slots."""

    name = "req-to-token"
    title = "req_to_token entry pointing at the wrong slot"
    summary = ("A live request's req_to_token entry is overwritten with another slot; the plan gathers the "
               "foreign slot, whose stored position, token and chain do not fit.")
    phase = "batch"
    allowed_bits = SLOT_CORRUPTION
    damages_content = False

    def inject(self, ctx: InjectionContext) -> Fault | None:
        if ctx.engine.paged:
            return self._inject_block(ctx)
        batch, eng, rng = ctx.batch, ctx.engine, ctx.rng
        assert batch is not None
        rows = _written_rows(batch, 2)
        if not rows:
            return None
        i = _choice(rng, rows)
        victim = batch.reqs[i]
        intact = [p for p in range(int(batch.prefix_h[i]) - 1) if eng.entry_intact(victim, p)]
        if not intact:
            return None
        p = _choice(rng, intact)
        donors = [j for j in _written_rows(batch, 1) if j != i] or [i]
        j = _choice(rng, donors)
        choices = [q for q in range(int(batch.prefix_h[j])) if q != p
                   and int(batch.reqs[j].slots[q]) != int(victim.slots[p])]
        if not choices:
            return None
        q = _choice(rng, choices)
        wrong = int(batch.reqs[j].slots[q])
        fault = ctx.tracker.new(self, ctx.step, "FULL", f"req_to_token[{victim.rp}, {p}] of request {victim.rid} "
                                f"set to slot {wrong} (position {q} of request {batch.reqs[j].rid}) instead of "
                                f"{int(victim.slots[p])}", request=victim, position=p, slot=wrong)
        ctx.tracker.taint_full(fault, [wrong, int(victim.slots[p + 1])])
        eng.corrupt_table_entry(victim.rp, p, wrong)
        return fault

    def _inject_block(self, ctx: InjectionContext) -> Fault | None:
        batch, eng, rng = ctx.batch, ctx.engine, ctx.rng
        assert batch is not None
        size = eng.unit
        # a block whose positions and the one after it are all verified (below the seed)
        rows = _written_rows(batch, size + 1)
        if not rows:
            return None
        i = _choice(rng, rows)
        victim = batch.reqs[i]
        intact = [k for k in range((int(batch.prefix_h[i]) - 1) // size) if eng.entry_intact(victim, k * size)]
        if not intact:
            return None
        k = _choice(rng, intact)
        donors = [j for j in _written_rows(batch, size) if j != i] or [i]
        j = _choice(rng, donors)
        # another written block at another block index: its stored positions differ from the victim's
        choices = [q for q in range(int(batch.prefix_h[j]) // size) if q != k
                   and batch.reqs[j].blocks[q] != victim.blocks[k]]
        if not choices:
            return None
        q = _choice(rng, choices)
        wrong = batch.reqs[j].blocks[q]
        fault = ctx.tracker.new(self, ctx.step, "FULL", f"req_to_block[{victim.rp}, {k}] of request {victim.rid} "
                                f"set to block {wrong} (block {q} of request {batch.reqs[j].rid}) instead of "
                                f"{victim.blocks[k]}", request=victim, position=k * size, slot=int(wrong * eng.stride))
        ctx.tracker.taint_full(fault, [*eng.block_slots(wrong).tolist(), int(victim.slots[(k + 1) * size])])
        eng.corrupt_table_entry(victim.rp, k, wrong)
        return fault


class KvBitFlip(FaultKind):
    """A bit of real KV flips in memory (a hardware error, or a kernel that writes one byte too far). Nothing
    in the canary's content chain changes; the TAIL verify re-hashes the slot's real KV bytes and finds a
    fingerprint that no longer matches the one stored when the KV was written (REAL_KV)."""

    name = "kv-bitflip"
    title = "flipped bit in real KV"
    summary = ("One bit of a live slot's K (or V) bytes flips; the TAIL verify re-hashes the real KV and the "
               "fingerprint stored at write time no longer matches.")
    phase = "after_forward"
    allowed_bits = int(R.VERIFY_REAL_KV_HASH_MISMATCH)
    kv_groups = True

    def inject(self, ctx: InjectionContext) -> Fault | None:
        batch, eng, rng = ctx.batch, ctx.engine, ctx.rng
        assert batch is not None
        target = _pick_verified_slot(ctx, exclude=set())
        if target is None:
            return None
        req, p, slot = target
        store = eng.kv[ctx.group]
        kind = _choice(rng, [k for k in ("K", "V") if store.tensors[k]])
        layer = int(rng.integers(len(store.tensors[kind])))
        limit = 16 if ctx.partial_hash else store.words * 8
        byte, bit = int(rng.integers(limit)), int(rng.integers(8))
        fault = ctx.tracker.new(self, ctx.step, ctx.group, f"{kind} layer {layer}, {ctx.group} slot {slot} "
                                f"(request {req.rid}, position {p}): byte {byte} bit {bit}",
                                request=req, position=p, slot=slot)
        ctx.tracker.taint(fault, ctx.group, [slot])
        store.flip_bit(kind, layer, slot, byte, bit)
        return fault


class KvMisdirectedWrite(FaultKind):
    """The forward writes one new token's KV into the wrong slot (a wrong ``out_cache_loc``, e.g. an
    off-by-one in a paged-KV index). The victim slot's bytes change under a live request, whose TAIL verify
    finds the fingerprint broken (REAL_KV); the intended slot keeps stale bytes."""

    name = "kv-misdirect"
    title = "KV write to the wrong slot"
    summary = ("The forward stores a new token's KV into a slot another live request still reads; that "
               "request's TAIL verify finds the victim slot's real-KV fingerprint broken.")
    phase = "forward"
    allowed_bits = int(R.VERIFY_REAL_KV_HASH_MISMATCH)
    kv_groups = True

    def inject(self, ctx: InjectionContext) -> tuple[Fault, int, int] | None:
        batch, eng, rng = ctx.batch, ctx.engine, ctx.rng
        assert batch is not None
        if batch.num_real_tokens == 0:
            return None
        token = int(rng.integers(batch.num_real_tokens))
        intended = int(batch.token_slot[token])
        if ctx.group == "SWA":
            intended = eng.swa_of(intended)
        new_slots = set(batch.token_slot.tolist())
        if ctx.group == "SWA":
            new_slots = {eng.swa_of(s) for s in new_slots}
        target = _pick_verified_slot(ctx, exclude=new_slots)
        if target is None:
            return None
        req, p, victim = target
        writer = batch.reqs[int(batch.token_row[token])]
        fault = ctx.tracker.new(self, ctx.step, ctx.group, f"KV of request {writer.rid} position "
                                f"{int(batch.token_pos[token])} written to {ctx.group} slot {victim} (request "
                                f"{req.rid}, position {p}) instead of {intended}", request=req, position=p,
                                slot=victim)
        ctx.tracker.taint(fault, ctx.group, [victim, intended])
        return fault, token, victim


def _pick_new_token(ctx: InjectionContext) -> tuple[int, Request, int, int] | None:
    """A random token of this step's batch: (flat index, its request, position, slot), or None if empty."""
    batch = ctx.batch
    assert batch is not None
    if batch.num_real_tokens == 0:
        return None
    token = int(ctx.rng.integers(batch.num_real_tokens))
    req = batch.reqs[int(batch.token_row[token])]
    return token, req, int(batch.token_pos[token]), int(batch.token_slot[token])


class WrongInputToken(FaultKind):
    """The forward is fed a wrong token id (a stale ``input_ids`` buffer, a detokenizer or speculative
    accept bug). The write's input assert compares it with the engine's token oracle (WRITE_TOKEN), and every
    later verify compares the stored token with the expected-token pool (TOKEN)."""

    name = "wrong-token"
    title = "wrong input token"
    summary = ("A new token enters the forward with the wrong id; the write's input assert flags it against "
               "the token oracle, and later verifies flag it against the expected-token pool.")
    phase = "batch"
    allowed_bits = int(R.WRITE_TOKEN_MISMATCH | R.VERIFY_TOKEN_MISMATCH | R.VERIFY_CHAIN_HASH_MISMATCH)

    def inject(self, ctx: InjectionContext) -> Fault | None:
        picked = _pick_new_token(ctx)
        if picked is None:
            return None
        token, req, pos, slot = picked
        batch, rng = ctx.batch, ctx.rng
        assert batch is not None  # _pick_new_token found a token in it
        true = int(req.tokens[pos])
        wrong = (true + 1 + int(rng.integers(1000))) % 32000 or 1
        fault = ctx.tracker.new(self, ctx.step, "FULL", f"request {req.rid} position {pos} fed token {wrong} "
                                f"instead of {true} (slot {slot})", request=req, position=pos, slot=slot)
        ctx.tracker.taint_full(fault, [slot], groups=("FULL", "SWA"), source=True)
        _later_this_step(ctx, req, pos, fault)
        batch.input_ids[token] = wrong
        return fault


class PositionOffByOne(FaultKind):
    """A new token is written with its position off by one (a wrong ``positions`` tensor, e.g. after a
    prefix-cache hit of the wrong length). The input assert flags it (WRITE_POSITION), the chain-position
    check flags the jump at the slot and at its successor (WRITE_POSITION), and every later verify finds a
    stored position that differs from the plan's (POSITION)."""

    name = "position-shift"
    title = "position off by one"
    summary = ("A new token is written at position p±1; the write's input and chain-position asserts flag "
               "it, and later verifies find the stored position off.")
    phase = "batch"
    allowed_bits = int(R.WRITE_POSITION_MISMATCH | R.VERIFY_POSITION_MISMATCH | R.VERIFY_CHAIN_HASH_MISMATCH)

    def inject(self, ctx: InjectionContext) -> Fault | None:
        picked = _pick_new_token(ctx)
        if picked is None:
            return None
        token, req, pos, slot = picked
        batch, rng = ctx.batch, ctx.rng
        assert batch is not None  # _pick_new_token found a token in it
        wrong = pos - 1 if pos > 0 and rng.random() < 0.5 else pos + 1
        fault = ctx.tracker.new(self, ctx.step, "FULL", f"request {req.rid} slot {slot} written at position "
                                f"{wrong} instead of {pos}", request=req, position=pos, slot=slot)
        ctx.tracker.taint_full(fault, [slot], groups=("FULL", "SWA"), source=True)
        _later_this_step(ctx, req, pos, fault)
        batch.positions[token] = wrong
        return fault


class SwaEarlyEviction(FaultKind):
    """Sliding-window eviction frees the SWA slot of a position that is still inside the window (an
    off-by-one in the window bound) while the LUT still maps the position to it. The slot is handed to the
    next new token and overwritten; the victim's next SWA verify finds the newcomer's position, token and
    real KV there (POSITION, TOKEN, REAL_KV) and a broken chain after it (CHAIN)."""

    name = "swa-early-evict"
    title = "SWA slot evicted while still in the window"
    summary = ("Window eviction frees the SWA slot of a position still inside the window; the slot is "
               "reused at once and the victim's next SWA verify finds another token's canary and KV in it.")
    phase = "after_step"
    allowed_bits = SLOT_CORRUPTION
    needs = "swa"

    def inject(self, ctx: InjectionContext) -> Fault | None:
        eng, rng = ctx.engine, ctx.rng
        window = eng.cfg.swa_window
        options = []
        for req in eng.decoding:
            if req.kv_left < 3:
                continue
            lo = max(req.tree_len, req.computed - window // 2)
            for p in range(lo, req.computed - 1):
                f = int(req.slots[p])
                x = eng.swa_of(f)
                if x and eng.swa_owner[x] == f and eng.entry_intact(req, p):
                    options.append((req, p, f, x))
        if not options:
            return None
        req, p, f, x = _choice(rng, options)
        fault = ctx.tracker.new(self, ctx.step, "SWA", f"SWA slot {x} of request {req.rid} position {p} (full slot "
                                f"{f}) freed with {req.computed - p} positions still in the window of {window}",
                                request=req, position=p, slot=x)
        ctx.tracker.taint(fault, "SWA", [x], source=True)
        successors = {int(req.slots[p + 1])} | eng.successors(f)
        ctx.tracker.taint(fault, "SWA", [eng.swa_of(s) for s in successors])
        eng.swa_owner[x] = 0
        eng.swa_alloc.force_free(x)  # type: ignore[union-attr]
        return fault


class StaleExpectedTokens(FaultKind):
    """A recycled ``req_to_token`` row keeps the previous owner's expected tokens: the engine refreshes a row of
    the expected-token pool from the decode path and forgot to do it when the row changed hands, so until the
    new owner's first decode step the plan gathers the previous owner's tokens as expected tokens. The
    verify's token check fails wherever the two histories differ (TOKEN); the first decoded token refreshes
    the row and the violations stop."""

    name = "stale-expected"
    title = "row recycled without clearing its expected tokens"
    summary = ("A recycled request row keeps its previous owner's expected tokens until the new request's first "
               "decode step; the verify's token check fails wherever the two histories differ.")
    phase = "batch"
    allowed_bits = int(R.VERIFY_TOKEN_MISMATCH)
    damages_content = False

    def inject(self, ctx: InjectionContext) -> Fault | None:
        batch, eng, rng = ctx.batch, ctx.engine, ctx.rng
        assert batch is not None
        options = []
        for req in batch.admitted:
            # the prompt is verified at the latest by the first decode step (which needs a second output token)
            if req.recycled and req.spec.output_len >= 2 and np.any(
                    eng.pool_host[eng.pool_row(batch, req), : req.prompt_len] != req.tokens[: req.prompt_len]):
                options.append(req)
        if not options:
            return None
        req = _choice(rng, options)
        fault = ctx.tracker.new(self, ctx.step, "FULL", f"request {req.rid} took row {req.rp}; its expected "
                                "tokens are not scattered until its first decode step", request=req,
                                position=None, slot=None)
        ctx.tracker.taint_request(fault, req)
        req.skip_scatter = True
        return fault


def _later_this_step(ctx: InjectionContext, req: Request, pos: int, fault: Fault) -> None:
    """The request's tokens after ``pos`` in this step's chunk are written in the same launch, from the corrupted
    running hash: the next one fails the chain-position check, all of them carry a corrupted chain."""
    later = req.slots[pos + 1 : req.assigned]
    if later.shape[0]:
        ctx.tracker.taint_full(fault, later[:1], groups=("FULL", "SWA"))
        ctx.tracker.taint_full(fault, later, groups=("FULL", "SWA"), chain=True, explain=False)


def _pick_verified_slot(ctx: InjectionContext, exclude: set[int]) -> tuple[Request, int, int] | None:
    """A (request, position, slot in ``ctx.group``'s space) that this step's verify of that group covers."""
    batch, eng, rng = ctx.batch, ctx.engine, ctx.rng
    assert batch is not None
    options = []
    for i, req in enumerate(batch.reqs):
        prefix = int(batch.prefix_h[i])
        lo = max(0, prefix - eng.cfg.swa_window) if ctx.group == "SWA" else 0
        for p in range(lo, prefix):
            if not eng.entry_intact(req, p):
                continue  # the plan reads another slot there
            slot = int(req.slots[p])
            if ctx.group == "SWA":
                slot = eng.swa_of(slot)
            if slot > 0 and slot not in exclude:
                options.append((req, p, slot))
    return _choice(rng, options) if options else None


class TierFault(FaultKind):
    """A KV hierarchy bug (``--tiers``): injected by :class:`~kvcanary_cupy.sim.tiers.TieredStore` at a
    load-back, never by the step phases. The restore verify (chain, position, real KV of the restored slots)
    runs before any forward reads the page; what it cannot see (a chain-consistent page of another prefix at
    position 0) the first forward's verify sees through the expected tokens."""

    phase = "tier"
    allowed_bits = SLOT_CORRUPTION
    needs = "tiers"

    def applicable(self, engine: Engine) -> bool:
        return True

    def inject(self, ctx: InjectionContext) -> Fault | None:
        return None  # the tiered store injects these itself (see TieredStore._inject_at_start / _finish)


class TierHostPageReused(TierFault):
    name = "tier-host-page-reused"
    title = "host page evicted and reused during a load-back"
    summary = ("An L2 host page is evicted and refilled while its asynchronous load-back is in flight (SGLang "
               "#27444, #31427): the device receives another page's KV under correct records; the restore "
               "verify's real-KV fingerprints disagree.")


class TierWrongKey(TierFault):
    name = "tier-wrong-key"
    title = "page restored under another prefix's key"
    summary = ("The tier answers a prefix lookup with another prefix's page (a key collision, LMCache #4463): "
               "its records chain to another predecessor and carry other tokens.")


class TierDiskBitRot(TierFault):
    name = "tier-disk-bit-rot"
    title = "a bit rotting in an L3 file"
    summary = ("One bit of an L3 file flips on disk (DingoCache #231: every transport counter green); the "
               "restored slot's real-KV fingerprint disagrees with its record.")
    needs = "disk"


class TierTornWrite(TierFault):
    name = "tier-torn-write"
    title = "a torn (short) L3 write"
    summary = ("An L3 file is shorter than the page written to it; the read-back fills the tail with the staging "
               "buffer's zeros: zero records and zero KV where the page should be.")
    needs = "disk"


class TierWrongSlots(TierFault):
    name = "tier-wrong-slots"
    title = "pages restored into the wrong device slots"
    summary = ("The load-back copies two positions' KV into each other's device slots while the slot table "
               "says otherwise (a packed layout misread on restore); the records and the bytes disagree.")


class TierStaleCopy(TierFault):
    name = "tier-stale-copy"
    title = "stale L2 copy restored after the device page was rewritten"
    summary = ("The copy to the tier is taken lazily from the page's old device slots after they were given to "
               "another request and rewritten: the restore brings back that request's KV and records.")


FAULT_KINDS: dict[str, FaultKind] = {k.name: k for k in (
    DoubleAllocation(), ReqToTokenCorruption(), KvBitFlip(), KvMisdirectedWrite(), WrongInputToken(),
    PositionOffByOne(), SwaEarlyEviction(), StaleExpectedTokens(),
)}
# The KV hierarchy's kinds (``--tiers``), kept apart: a run without tiers can host none of them.
TIER_FAULT_KINDS: dict[str, FaultKind] = {k.name: k for k in (
    TierHostPageReused(), TierWrongKey(), TierDiskBitRot(), TierTornWrite(), TierWrongSlots(), TierStaleCopy(),
)}
ALL_FAULT_KINDS: dict[str, FaultKind] = {**FAULT_KINDS, **TIER_FAULT_KINDS}


def parse_inject(specs: list[str], all_kinds: list[str] | None = None, *, known: Any = None,
                 default_rate: float = DEFAULT_RATE) -> dict[str, float]:
    """``["all", "kv-bitflip:0.1"]`` -> ``{kind: rate}``; raises ValueError with a readable message.
    ``all`` stands for ``all_kinds`` (default: every kind of ``known`` that needs no KV hierarchy; ``known`` is
    the engine's :data:`ALL_FAULT_KINDS` unless another registry is given)."""
    known = ALL_FAULT_KINDS if known is None else known
    rates: dict[str, float] = {}
    for spec in specs:
        name, _, rate_text = spec.partition(":")
        name = name.strip().lower().replace("_", "-")
        rate = default_rate
        if rate_text:
            try:
                rate = float(rate_text)
            except ValueError:
                raise ValueError(f"--inject {spec!r}: the rate must be a number in (0, 1]") from None
            if not 0 < rate <= 1:
                raise ValueError(f"--inject {spec!r}: the rate must be in (0, 1], got {rate}")
        if name == "all":
            # without a list, "all" is every kind that needs no KV hierarchy (the tier kinds need --tiers)
            everything = [k for k, v in known.items() if getattr(v, "needs", "") not in ("tiers", "disk")]
            for kind in everything if all_kinds is None else all_kinds:
                rates[kind] = rate
        elif name in known:
            rates[name] = rate
        else:
            raise ValueError(f"--inject {spec!r}: unknown fault kind {name!r}; choose from all, "
                             f"{', '.join(known)}")
    return rates


class FaultInjector:
    """Decides when each requested kind fires and runs its injector at the right phase of the step.

    Schedule: a kind with rate ``r`` fires at the first injectable step, then once in every following interval
    of ``round(1 / r)`` steps, at a random offset inside the interval (so ``r`` is the expected number of
    injections per step, spread evenly). A firing becomes a pending injection, made at the first opportunity
    (a step with a suitable target); at most :data:`MAX_PENDING` wait at once.
    """

    def __init__(self, rates: dict[str, float], engine: Engine, tracker: FaultTracker, rng: np.random.Generator,
                 *, start: int, stop: int, partial_hash: bool, kv_groups: list[str]) -> None:
        self.kinds = [ALL_FAULT_KINDS[name] for name in ALL_FAULT_KINDS if name in rates]
        self.rates = rates
        self.engine = engine
        self.tracker = tracker
        self.rng = rng
        self.start, self.stop = start, stop
        self.partial_hash = partial_hash
        self.kv_groups = kv_groups
        self.pending: dict[str, int] = dict.fromkeys(rates, 0)
        self.target_group: dict[str, str] = {}
        self.fire_steps: dict[str, set[int]] = {}
        for kind in self.kinds:
            period = max(1, round(1 / rates[kind.name]))
            fires = {start}
            for begin in range(start + period, stop, period):
                fires.add(begin + int(rng.integers(period)))
            self.fire_steps[kind.name] = {f for f in fires if f < stop}

    def begin_step(self, step: int) -> None:
        active = self.start <= step < self.stop
        for kind in self.kinds:
            if not active:
                self.pending[kind.name] = 0
                continue
            if step in self.fire_steps[kind.name]:
                self.pending[kind.name] = min(MAX_PENDING, self.pending[kind.name] + 1)
            if kind.kv_groups and self.pending[kind.name]:
                self.target_group[kind.name] = _choice(self.rng, self.kv_groups)

    def _context(self, step: int, batch: Batch | None, group: str) -> InjectionContext:
        return InjectionContext(self.engine, self.tracker, self.rng, step, batch, group, self.partial_hash)

    def _due(self, kind: FaultKind, phase: str, group: str | None) -> bool:
        if kind.phase != phase or not self.pending.get(kind.name):
            return False
        return not kind.kv_groups or self.target_group.get(kind.name) == group

    def run(self, phase: str, step: int, batch: Batch | None, group: str | None = None) -> Any:
        """Run the due injectors of ``phase``; for "forward" returns ``{group: (token, slot)}`` or None."""
        redirect = None
        for kind in self.kinds:
            if not self._due(kind, phase, group):
                continue
            result = kind.inject(self._context(step, batch, group or "FULL"))
            if result is None:
                continue
            self.pending[kind.name] -= 1
            if phase == "forward":
                assert isinstance(result, tuple)  # forward kinds name the token and slot they redirect
                _, token, victim = result
                redirect = {group: (token, victim)}
        return redirect
