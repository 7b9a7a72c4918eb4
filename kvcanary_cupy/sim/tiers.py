"""The synthetic engine's KV hierarchy (``kvcanary simulate --tiers host,disk``): an L2 in host memory and an L3
of files on local disk below the device pool, with write-back, asynchronous load-back and the canary records
travelling with every page.

* **write-back** — when the prefix cache evicts a path from the device (:meth:`TieredStore.write_back`, the
  engine's ``on_evict`` hook), its KV bytes (every layer, K and V, the full, SWA and draft pools) and the canary
  records of its slots (:meth:`~kvcanary_cupy.runtime.CanaryRuntime.offload`) are copied into one host page
  keyed by the whole prefix it ends. L2 holds at most ``l2_slots`` tokens; its least recently used pages are
  demoted to L3 as real files (``<tier dir>/<key>.kv``, created exclusively); L3 holds at most ``l3_bytes``
  and deletes its least recently used files.
* **load-back** — when a request arrives whose prompt continues its device match with a page a lower tier
  holds (the engine's ``on_lookup`` hook), the page's device slots are allocated and a load starts; the request
  waits. The load completes one step later from L2, two from L3 (a file read); then the bytes are copied into
  the new slots, :meth:`~kvcanary_cupy.runtime.CanaryRuntime.restore` scatters the records and verifies the
  restored slots (chain from the resident slot before them, position, real KV re-hashed) before any forward
  reads them, and the page joins the prefix cache, where the request finds it (prefix reuse across tiers).
* **faults** — the tier kinds of :mod:`.faults` (``tier-*``) are injected here, at a load-back, the way the real
  bugs strike; each fault names its tier and step.

The L3 directory is ``tier_dir`` (created if needed) or a temporary directory, checked at the start and used as
a boundary (:mod:`.l3dir`: no file outside it written or followed; a full disk or a removed directory mid-run
is a :class:`~kvcanary_cupy.sim.l3dir.TierStorageError`); :meth:`TieredStore.close` removes every file the
store wrote (and the temporary directory).
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..runtime import CanaryRuntime, OffloadedRecords
from .engine import Engine
from .faults import TIER_FAULT_KINDS, CarriedTaint, FaultInjector, FaultTracker
from .l3dir import TierDir, open_tier_dir
from .radix import RadixNode
from .workload import RequestSpec

TIER_NAMES = ("host", "disk")
L2_LATENCY, L3_LATENCY = 1, 2  # steps from the start of a load to its completion
L2_SLOTS = 1024  # host memory holds this many tokens of written-back pages; its LRU pages go to disk
L3_BYTES = 4 << 20  # the disk tier's cap; its LRU files are deleted
DEVICE_CACHE_SLOTS = 32  # a tiered engine keeps this much prefix cache on the device; the rest goes down


@dataclass
class TierPage:
    """One written-back prefix-cache path: positions ``[depth, depth + n)`` of the prefix ``keys``."""

    key: str  # hash of the whole prefix's keys
    keys: np.ndarray  # the prefix-cache keys of positions [0, depth + n)
    depth: int
    n: int
    layout: list[tuple[str, tuple[int, ...]]]  # (part name, shape) of every array in ``blob``, in order
    blob: np.ndarray | None  # uint8: the packed KV bytes and records (None while the page lives in a file)
    origin: np.ndarray  # the device slots it was copied from
    swa_alive: np.ndarray  # per position: whether it had an SWA slot (SWA KV is stored for those only)
    nbytes: int = 0
    tier: str = "L2"
    pinned: int = 0  # loads in flight
    carried: CarriedTaint = field(default_factory=CarriedTaint)  # faults' damage to the slots it was copied from
    damaged_by: list[Any] = field(default_factory=list)  # tier faults that damaged its file (every later read)
    file: str = ""  # its L3 file's name in the tier directory (while tier == "L3")


@dataclass
class Load:
    """A load-back in flight: ``page`` into the freshly allocated ``slots`` (after the device match)."""

    page: TierPage
    rid: int
    node: RadixNode
    shared: np.ndarray  # the device match it continues
    slots: np.ndarray
    units: np.ndarray  # allocation units (slots or blocks) held for it
    tier: str
    start_step: int
    ready_step: int
    data: dict[str, np.ndarray] | None = None  # read at the start (L3: the file) or at completion (L2)
    planned: str | None = None  # the tier fault kind this load-back carries, if any
    faults: list[Any] = field(default_factory=list)
    carried: list[CarriedTaint] = field(default_factory=list)  # damage of the bytes it brings back


def _host(a: Any) -> np.ndarray:
    """A host copy of a NumPy or CuPy array."""
    return a.get() if hasattr(a, "get") else np.array(a, copy=True)


def _pack(parts: dict[str, np.ndarray]) -> tuple[list[tuple[str, tuple[int, ...]]], np.ndarray]:
    layout = [(name, tuple(a.shape)) for name, a in parts.items()]
    blob = np.concatenate([np.ascontiguousarray(a).view(np.uint8).reshape(-1) for a in parts.values()]) \
        if parts else np.empty(0, np.uint8)
    return layout, blob


def _unpack(layout: list[tuple[str, tuple[int, ...]]], blob: np.ndarray) -> dict[str, np.ndarray]:
    """The arrays of a packed page (every part is 8-byte words: uint64 KV, int64 records)."""
    out, at = {}, 0
    for name, shape in layout:
        size = int(np.prod(shape)) * 8
        words = blob[at : at + size].view(np.uint64 if name.startswith("kv:") else np.int64)
        out[name] = words.reshape(shape)
        at += size
    return out


class TieredStore:
    """L2 (host memory) and L3 (files) below the engine's device pool; see the module docstring."""

    def __init__(self, tiers: tuple[str, ...], engine: Engine, runtime: CanaryRuntime, tracker: FaultTracker,
                 injector: FaultInjector, rng: np.random.Generator, *, tier_dir: str | None = None,
                 l2_slots: int | None = None, l3_bytes: int | None = None) -> None:
        self.tiers = tiers
        self.engine, self.rt, self.tracker, self.injector, self.rng = engine, runtime, tracker, injector, rng
        self.models = ["target"] + (["draft"] if engine.cfg.eagle else [])
        self.l2: OrderedDict[str, TierPage] = OrderedDict()
        self.l3: OrderedDict[str, TierPage] = OrderedDict()
        self.l2_slots = l2_slots if l2_slots is not None else L2_SLOTS
        self.l2_used = 0
        self.l3_bytes = l3_bytes if l3_bytes is not None else L3_BYTES
        self.l3_used = 0
        self._own_dir = "disk" in tiers and tier_dir is None
        self.dir = tempfile.mkdtemp(prefix="kvcanary-l3-") if self._own_dir else tier_dir
        self.l3dir: TierDir | None = None
        if "disk" in tiers:
            assert self.dir is not None
            try:
                self.l3dir = open_tier_dir(self.dir, self.l3_bytes)  # writable, with room for the cap
            except ValueError:
                if self._own_dir:
                    shutil.rmtree(self.dir, ignore_errors=True)
                raise
        self.loads: dict[int, Load] = {}
        self.step = 0
        self.stats = dict(written_back=0, written_back_slots=0, l2_hits=0, l3_hits=0, restored_slots=0,
                          demoted_to_l3=0, l3_files_written=0, l3_bytes_written=0, l3_bytes_read=0,
                          l2_evicted=0, l3_evicted=0, peak_l2_slots=0, peak_l3_bytes=0, record_bytes=0,
                          kv_bytes=0)
        engine.on_evict = self.write_back
        engine.on_lookup = self.lookup

    # -- write-back ------------------------------------------------------------------------------------------

    def _kv_parts(self, slots: np.ndarray, alive: np.ndarray) -> dict[str, np.ndarray]:
        eng = self.engine
        parts: dict[str, np.ndarray] = {}
        for name, store in eng.kv.items():
            where = eng.lut_host[slots[alive]] if name == "SWA" else slots
            page, row = where // store.page_size, where % store.page_size
            for kind, layers in store.tensors.items():
                for layer, tensor in enumerate(layers):
                    xp = eng.xp
                    parts[f"kv:{name}:{kind}:{layer}"] = _host(tensor[xp.asarray(page), xp.asarray(row)])
        return parts

    def _group_slots(self, slots: np.ndarray) -> dict[str, np.ndarray]:
        """``slots`` (full pool) in every canary group's slot space: the SWA group's through the LUT (0 where a
        position has no SWA slot)."""
        eng = self.engine
        out = {"FULL": slots}
        if eng.cfg.eagle:
            out["DRAFT"] = slots
        if eng.swa:
            out["SWA"] = eng.lut_host[slots]
        return out

    def _record_parts(self, slots: np.ndarray) -> dict[str, np.ndarray]:
        parts = {}
        for model in self.models:
            rec = self.rt.offload(slots, model=model)
            for (group, b), arr in rec.records.items():
                parts[f"rec:{model}:{group}:{b}"] = arr
        return parts

    def write_back(self, node: RadixNode) -> None:
        """Engine hook: the prefix cache is evicting ``node`` from the device; copy it into L2 (unless a tier
        already holds this prefix)."""
        keys = self.engine.tree.path_keys(node)
        key = hashlib.blake2b(np.ascontiguousarray(keys, np.int64).tobytes(), digest_size=12).hexdigest()
        for tier in (self.l2, self.l3):
            if key in tier:
                tier.move_to_end(key)
                return
        slots = np.asarray(node.slots, np.int64).copy()
        n = int(slots.shape[0])
        eng = self.engine
        alive = eng.lut_host[slots] != 0 if eng.swa else np.zeros(n, bool)
        parts = {**self._kv_parts(slots, alive), **self._record_parts(slots)}
        layout, blob = _pack(parts)
        page = TierPage(key, keys.copy(), int(keys.shape[0]) - n, n, layout, blob, slots, alive, int(blob.nbytes),
                        carried=self.tracker.snapshot(self._group_slots(slots)))
        self.l2[key] = page
        self.l2_used += n
        self.stats["written_back"] += 1
        self.stats["written_back_slots"] += n
        self.stats["record_bytes"] += sum(int(a.nbytes) for k, a in parts.items() if k.startswith("rec:"))
        self.stats["kv_bytes"] += sum(int(a.nbytes) for k, a in parts.items() if k.startswith("kv:"))
        self._fit_l2()
        self.stats["peak_l2_slots"] = max(self.stats["peak_l2_slots"], self.l2_used)

    def _fit_l2(self) -> None:
        for key in list(self.l2):
            if self.l2_used <= self.l2_slots:
                return
            page = self.l2[key]
            if page.pinned:
                continue
            del self.l2[key]
            self.l2_used -= page.n
            if "disk" in self.tiers:
                self._demote(page)
            else:
                self.stats["l2_evicted"] += 1

    def _demote(self, page: TierPage) -> None:
        """Write ``page`` to its L3 file and drop it from host memory."""
        assert page.blob is not None and self.l3dir is not None
        page.file = self.l3dir.create(page.key, page.blob.tobytes())
        page.blob, page.tier = None, "L3"
        self.l3[page.key] = page
        self.l3_used += page.nbytes
        self.stats["demoted_to_l3"] += 1
        self.stats["l3_files_written"] += 1
        self.stats["l3_bytes_written"] += page.nbytes
        for key in list(self.l3):
            if self.l3_used <= self.l3_bytes:
                break
            old = self.l3[key]
            if old.pinned:
                continue
            del self.l3[key]
            self.l3_used -= old.nbytes
            self.l3dir.remove(old.file)
            self.stats["l3_evicted"] += 1
        self.stats["peak_l3_bytes"] = max(self.stats["peak_l3_bytes"], self.l3_used)

    def _read(self, page: TierPage, *, count: bool = True) -> np.ndarray:
        """The page's bytes: from host memory, or read back from its file (a short file leaves the missing tail
        as the zeroed staging buffer holds it)."""
        if page.blob is not None:
            return page.blob.copy()
        assert self.l3dir is not None
        out = np.zeros(page.nbytes, np.uint8)
        data = self.l3dir.read(page.file)
        out[: len(data)] = np.frombuffer(data, np.uint8)[: page.nbytes]
        if count:  # a load-back's read (not the fault planner's look)
            self.stats["l3_bytes_read"] += len(data)
        return out

    # -- load-back -------------------------------------------------------------------------------------------

    def _find(self, keys: np.ndarray, depth: int) -> TierPage | None:
        """A page continuing a device match of ``depth`` keys with more of ``keys`` (the prompt's, whose last
        position is always computed)."""
        best = None
        for tier in (self.l2, self.l3):
            for page in tier.values():
                end = page.depth + page.n
                if page.depth != depth or end > keys.shape[0] - 1:
                    continue
                if np.array_equal(page.keys, keys[:end]) and (best is None or page.n > best.n):
                    best = page
        return best

    def lookup(self, spec: RequestSpec, keys: np.ndarray, shared: np.ndarray, node: RadixNode, step: int) -> bool:
        """Engine hook at admission: True while ``spec`` waits for a load-back of its prefix."""
        if spec.rid in self.loads:
            return True
        eng = self.engine
        depth = int(shared.shape[0])
        if eng.swa and depth and eng._usable(shared, depth) < depth:
            return False  # the engine would cut its own match back: no page continues it
        page = self._find(keys, depth)
        if page is None:
            return False
        units_needed = -(-page.n // eng.unit) if eng.paged else page.n
        eng.tree.lock(node, +1)  # the resident prefix stays while the load is in flight
        if eng.alloc.available < units_needed:
            eng._evict_tree(units_needed - eng.alloc.available)
        units = eng.alloc.alloc(units_needed)
        if units is None or (eng.swa and eng.swa_alloc.available < int(page.swa_alive.sum())):  # type: ignore[union-attr]
            if units is not None:
                eng.alloc.free(units)
            eng.tree.lock(node, -1)
            return False
        slots = (np.concatenate([eng.block_slots(int(b)) for b in units])[: page.n] if eng.paged else units)
        tier = page.tier
        latency = L2_LATENCY if tier == "L2" else L3_LATENCY
        page.pinned += 1
        (self.l2 if tier == "L2" else self.l3).move_to_end(page.key)
        load = Load(page, spec.rid, node, shared.copy(), slots.astype(np.int64), units, tier, step, step + latency)
        self.loads[spec.rid] = load
        self.stats["l2_hits" if tier == "L2" else "l3_hits"] += 1
        self._inject_at_start(load)
        if tier == "L3":
            load.data = _unpack(page.layout, self._read(page))  # the file read runs while the request waits
        return True

    def complete(self, step: int) -> None:
        """Finish every load due by ``step`` (between steps, before the batch is scheduled): copy the bytes into
        the new slots, restore and verify the records, and hand the page to the prefix cache."""
        self.step = step
        eng = self.engine
        if eng.tree.size > DEVICE_CACHE_SLOTS:  # the device cache stays small: older paths are written back
            eng._evict_tree(-(-(eng.tree.size - DEVICE_CACHE_SLOTS) // eng.unit))
        for rid in [r for r, load in self.loads.items() if load.ready_step <= step]:
            self._finish(self.loads.pop(rid), step)

    def _finish(self, load: Load, step: int) -> None:
        eng, page = self.engine, load.page
        data = load.data if load.data is not None else _unpack(page.layout, self._read(page))
        data = self._inject_at_finish(load, data)
        slots, n = load.slots, page.n
        alive = page.swa_alive
        if eng.swa:  # the restored positions that had an SWA slot get a new one
            got = eng.swa_alloc.alloc(int(alive.sum()))  # type: ignore[union-attr]
            assert got is not None  # reserved at the start
            eng.swa_owner[got] = slots[alive]
            eng.lut_host[slots[alive]] = got
            eng._lut_dirty.update(slots[alive].tolist())
            eng.flush()
        kv_slots = load.slots if "kv_order" not in data else slots[data.pop("kv_order").astype(np.int64)]
        for name, store in eng.kv.items():
            where = eng.lut_host[kv_slots[alive]] if name == "SWA" else kv_slots
            pg, row = where // store.page_size, where % store.page_size
            for kind, layers in store.tensors.items():
                for layer, tensor in enumerate(layers):
                    tensor[eng.xp.asarray(pg), eng.xp.asarray(row)] = eng.xp.asarray(data[f"kv:{name}:{kind}:{layer}"])
        positions = np.arange(page.depth, page.depth + n, dtype=np.int64)
        prevs = np.concatenate([[int(load.shared[-1]) if page.depth else -1], slots[:-1]]).astype(np.int64)
        for model in self.models:
            recs = {(k.split(":")[2], int(k.split(":")[3])): np.ascontiguousarray(a) for k, a in data.items()
                    if k.startswith(f"rec:{model}:")}
            self.rt.restore(OffloadedRecords(model, n, recs), slots, positions, prevs)
        self.stats["restored_slots"] += n
        # what faults had done to the page before it left the device travels with it to its new slots, and
        # the join with the resident slot before it fails if either side descends from corrupted content
        for carried in [page.carried, *load.carried]:
            self.tracker.carry(carried, self._group_slots(slots))
        if page.depth:
            self.tracker.on_splice(int(load.shared[-1]), int(slots[0]))
        # what the tier damaged, in every group's slot space: this load's faults, and those that damaged the
        # page's file for good (a rotten or torn file is read back the same way by every later load)
        for fault in load.faults + [f for f in page.damaged_by if f not in load.faults]:
            self.tracker.taint_full(fault, slots, source=True, chain=True)
        page.pinned -= 1
        # the page joins the prefix cache after its device match (duplicates of what is cached now go back)
        full = np.concatenate([load.shared, slots]).astype(np.int64)
        cached, leaf = eng.tree.insert(page.keys, full, step)
        eng.tree.lock(load.node, -1)
        if cached > page.depth:
            eng._release(slots[: cached - page.depth])
        elif self.engine.on_splice is not None and page.depth and leaf.parent is not None:
            self.engine.on_splice(int(load.shared[-1]), int(slots[0]))
        if page.tier == "L2":
            self._fit_l2()

    # -- faults ----------------------------------------------------------------------------------------------

    def _due(self, name: str) -> bool:
        return bool(self.injector.pending.get(name))

    def _plan_fault(self, load: Load) -> str | None:
        """At most one fault per load-back (each is then judged on its own): of the kinds due now that can strike
        this load (its tier, its size, another page to confuse it with, old slots rewritten since), the one
        injected least so far."""
        fits = {"tier-disk-bit-rot": lambda: load.tier == "L3", "tier-torn-write": lambda: load.tier == "L3",
                "tier-host-page-reused": lambda: load.tier == "L2" and bool(self._others(load)),
                "tier-wrong-key": lambda: bool(self._others(load, other_tokens=True)),
                "tier-wrong-slots": lambda: load.page.n >= 2,
                "tier-stale-copy": lambda: self._stale(load.page) is not None}
        due = [k for k, ok in fits.items() if self._due(k) and ok()]
        if not due:
            return None
        made = {k: sum(f.kind == k for f in self.tracker.faults) for k in due}
        return min(due, key=lambda k: (made[k], k))

    def _stale(self, page: TierPage) -> dict[str, np.ndarray] | None:
        """What a lazy copy taken now from the page's old device slots would bring back (their KV where the page
        had SWA slots, their records), or None while those slots still hold the page (nothing rewritten)."""
        now = self._record_parts(page.origin)
        ours = _unpack(page.layout, self._read(page, count=False))["rec:target:FULL:0"]
        if np.array_equal(now["rec:target:FULL:0"], ours):
            return None
        return {**self._kv_parts(page.origin, page.swa_alive), **now}

    def _fault(self, name: str, load: Load, detail: str) -> None:
        fault = self.tracker.new(TIER_FAULT_KINDS[name], load.start_step, "FULL",
                                 f"{load.tier} load-back started at step {load.start_step}: {detail}",
                                 position=load.page.depth, slot=int(load.slots[0]))
        fault.request = load.rid
        self.injector.pending[name] -= 1
        load.faults.append(fault)
        if name in ("tier-disk-bit-rot", "tier-torn-write"):
            load.page.damaged_by.append(fault)

    def _others(self, load: Load, *, other_tokens: bool = False) -> list[TierPage]:
        """Pages a confused tier could hand back instead of ``load``'s: as long, of the same parts (those at the
        same depth when there are any); ``other_tokens``: only those whose first positions hold other tokens (a
        page of the same tokens at the same positions is the same KV: no lookup error)."""
        page = load.page
        names = [name for name, _ in page.layout]
        ours = page.keys[page.depth :]
        options = [p for tier in (self.l2, self.l3) for p in tier.values()
                   if p is not page and p.n >= page.n and [name for name, _ in p.layout] == names
                   and not (other_tokens and np.array_equal(p.keys[p.depth : p.depth + page.n], ours))]
        same_depth = [p for p in options if p.depth == page.depth]
        options = same_depth or options
        # a page no fault damaged first: what the restore then brings back is this fault's doing alone
        clean = [p for p in options if not p.carried.entries and not p.damaged_by]
        return clean or options

    def _other(self, load: Load, *, other_tokens: bool = False) -> TierPage | None:
        options = self._others(load, other_tokens=other_tokens)
        return options[int(self.rng.integers(len(options)))] if options else None

    def _inject_at_start(self, load: Load) -> None:
        page = load.page
        load.planned = self._plan_fault(load)
        if load.planned == "tier-disk-bit-rot":
            assert self.l3dir is not None
            size = self.l3dir.size(page.file)
            kv_bytes = sum(int(np.prod(s)) * 8 for name, s in page.layout if name.startswith("kv:"))
            at = int(self.rng.integers(min(size, kv_bytes)))
            self.l3dir.flip_bit(page.file, at, int(self.rng.integers(8)))
            self._fault("tier-disk-bit-rot", load, f"bit flipped at byte {at} of {page.file}")
        elif load.planned == "tier-torn-write":
            keep = int(page.nbytes * (0.5 + 0.4 * float(self.rng.random()))) // 8 * 8
            assert self.l3dir is not None
            self.l3dir.truncate(page.file, keep)
            self._fault("tier-torn-write", load, f"{page.file} holds {keep} of {page.nbytes} bytes")

    @staticmethod
    def _first_positions(name: str, part: np.ndarray, other: TierPage, page: TierPage) -> np.ndarray:
        """``other``'s part ``name`` cut to ``page``'s first positions and shape: its SWA KV (stored for the
        positions that had an SWA slot) placed at ``page``'s SWA positions (zeros where ``other`` had none)."""
        if not name.startswith("kv:SWA"):
            return part[: page.n]
        per_position = np.zeros((other.n, *part.shape[1:]), part.dtype)
        per_position[other.swa_alive] = part
        return per_position[: page.n][page.swa_alive]

    def _inject_at_finish(self, load: Load, data: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        page, n = load.page, load.page.n
        if load.faults or load.planned is None or not self._due(load.planned):
            return data
        if load.planned == "tier-host-page-reused":
            other = self._other(load)
            if other is not None:
                theirs = _unpack(other.layout, self._read(other))
                kv = {k: v[:n] for k, v in theirs.items() if k.startswith("kv:") and not k.startswith("kv:SWA")}
                if any(not np.array_equal(v, data[k]) for k, v in kv.items()):
                    data = {**data, **kv}
                    load.carried.append(other.carried)
                    self._fault("tier-host-page-reused", load, f"its host page was evicted and refilled with "
                                f"{other.key}'s KV before the copy to the device")
        if load.planned == "tier-wrong-key" and self.engine.tree.cached_len(page.keys) < page.depth + n:
            # (a page the prefix cache meanwhile holds in full is dropped as a duplicate: no reader would see it)
            other = self._other(load, other_tokens=True)
            if other is not None:
                theirs = _unpack(other.layout, self._read(other))
                if not np.array_equal(theirs["rec:target:FULL:0"][:n], data["rec:target:FULL:0"]):
                    data = {k: self._first_positions(k, v, other, page) for k, v in theirs.items()}
                    load.carried[:] = [other.carried]
                    self._fault("tier-wrong-key", load, f"the lookup answered with {other.key} (positions "
                                f"{other.depth}..{other.depth + n - 1} of another prefix)")
        if load.planned == "tier-wrong-slots":
            order = np.arange(n)
            i = int(self.rng.integers(n - 1))
            order[[i, i + 1]] = order[[i + 1, i]]
            data = {**data, "kv_order": order.astype(np.uint64)}
            self._fault("tier-wrong-slots", load, f"positions {page.depth + i} and {page.depth + i + 1} were copied "
                        "into each other's device slots")
        if load.planned == "tier-stale-copy":
            stale = self._stale(page)
            if stale is not None:
                data = stale
                load.carried.append(self.tracker.snapshot(self._group_slots(page.origin)))
                self._fault("tier-stale-copy", load, "the copy came from its old device slots after they were given "
                            "to another request and rewritten")
        return data

    # -- end -------------------------------------------------------------------------------------------------

    def summary(self) -> dict[str, Any]:
        moved = self.stats["kv_bytes"]
        return {**self.stats, "tiers": list(self.tiers), "l2_capacity_slots": self.l2_slots,
                "l3_capacity_bytes": self.l3_bytes, "l2_pages": len(self.l2), "l3_files": len(self.l3),
                "record_bytes_per_kv_byte": (self.stats["record_bytes"] / moved) if moved else 0.0,
                "loads_in_flight": len(self.loads)}

    def close(self) -> None:
        """Remove every L3 file (and the directory when the store made it)."""
        if self.l3dir is not None:
            self.l3dir.close()  # only the files this run created; never raises
        self.l3.clear()
        if self._own_dir and self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
