"""The tiered simulator's own bookkeeping, checked against what each load-back did (recorded as the run goes):
a load pins its page and locks the resident prefix it continues exactly while it is in flight; the restored-slot
and L3 byte counts are the sums over the loads; every tier fault is recorded at its load (group, first
position and slot, request, step), each firing of a kind makes at most one fault; a wrong-key fault on a
sliding-window model swaps the SWA KV too and is caught; the report's tier section states the capacities, the
pages left and the loads in flight. And the store's own accounts, against what it did (recorded as the run goes)
or on stores whose pages are made by hand: every write-back, demotion and deletion counted, each tier within its
cap and giving up its least recently used unpinned page first, a page pinned over the cap going once its load
completes, the device cache cut back between steps no further than its slots, a prompt finding the longest page
that continues its match, a load-back without room refused with nothing changed, one short of free slots
evicting the least recently used cached paths just enough, no load for a match the engine would cut back for its
sliding window, two loads of one page pinning it twice, the store's own directory made only when needed and
removed, a page's bytes copied off the device and packed whole."""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from collections import Counter, OrderedDict
from types import SimpleNamespace

import numpy as np
import pytest

from kvcanary_cupy.sim import tiers as tiers_module
from kvcanary_cupy.sim.config import SimConfig
from kvcanary_cupy.sim.faults import TIER_FAULT_KINDS
from kvcanary_cupy.sim.runner import Simulation
from kvcanary_cupy.sim.tiers import DEVICE_CACHE_SLOTS, TieredStore, TierPage, _host, _pack, _unpack

# the kinds under which a load reads exactly its own page's file, whole: a torn write shortens the file; a host
# page reused or a wrong key makes the load read another page (a file too, when that page is in L3)
OWN_FILE_KINDS = ["tier-disk-bit-rot", "tier-wrong-slots", "tier-stale-copy"]


def recorded_run(tmp_path, *, seed, inject, preset="decode", steps=90, requests=32):
    """A small tiered run whose load-backs are recorded: ``log.finished`` (every load, at completion), the lock
    changes the tier made (``log.tier_locks``), and the loads still in flight at the end (``log.in_flight``)."""
    cfg = SimConfig(preset=preset, steps=steps, requests=requests, seed=seed, backend="numpy",
                    tiers=("host", "disk"), tier_dir=str(tmp_path / "l3"), inject=inject, ring_capacity=512)
    sim = Simulation(cfg)
    store, eng = sim.tiers, sim.engine
    store.l2_slots = 128  # a small host tier: pages reach the disk within the run
    log = SimpleNamespace(finished=[], tier_locks=0, in_tier=False, in_flight=[], pages=[])
    lock, lookup, finish = eng.tree.lock, eng.on_lookup, store._finish

    def recording_lock(node, delta):
        if log.in_tier:
            log.tier_locks += delta
        lock(node, delta)

    def recording_lookup(*args, **kwargs):
        log.in_tier = True
        try:
            return lookup(*args, **kwargs)
        finally:
            log.in_tier = False

    def recording_finish(load, step):
        log.in_tier = True
        try:
            finish(load, step)
        finally:
            log.in_tier = False
        log.finished.append(load)

    eng.tree.lock, eng.on_lookup, store._finish = recording_lock, recording_lookup, recording_finish
    close = store.close

    def recording_close():  # the run ends: what is in flight and the pages, before the store is emptied
        log.in_flight = list(store.loads.values())
        log.pages = [*store.l2.values(), *store.l3.values()]
        close()

    store.close = recording_close
    report = sim.run()
    return sim, report, log


@pytest.mark.parametrize("seed", range(3))
def test_a_load_pins_its_page_and_locks_its_prefix_exactly_while_it_is_in_flight(tmp_path, seed):
    _sim, report, log = recorded_run(tmp_path, seed=seed, inject={})
    assert len(log.finished) >= 4 and report["tiers"]["l3_hits"] > 0
    # every finished load gave back its lock and its pin: what remains is one of each per load in flight
    assert log.tier_locks == len(log.in_flight)
    in_flight = Counter(id(load.page) for load in log.in_flight)
    assert {id(p): p.pinned for p in log.pages} == {id(p): in_flight[id(p)] for p in log.pages}


@pytest.mark.parametrize("seed", range(3))
def test_the_restored_slot_and_l3_byte_counts_are_the_sums_over_the_loads(tmp_path, seed):
    """Each load restores its page's slots once; an L3 load reads its page's file once (at its start: the
    stale-copy planner's look at a file is not a load's read); no fault here shortens a file or reads
    another page's."""
    _sim, report, log = recorded_run(tmp_path, seed=seed, inject=dict.fromkeys(OWN_FILE_KINDS, 0.05))
    tiers = report["tiers"]
    loads = log.finished + log.in_flight
    assert tiers["restored_slots"] == sum(load.page.n for load in log.finished) > 0
    assert tiers["l3_bytes_read"] == sum(load.page.nbytes for load in loads if load.tier == "L3") > 0
    assert tiers["l2_hits"] == sum(load.tier == "L2" for load in loads)
    assert tiers["l3_hits"] == sum(load.tier == "L3" for load in loads)


@pytest.mark.parametrize("seed", range(3))
def test_every_tier_fault_is_recorded_at_its_load_and_each_firing_makes_at_most_one(tmp_path, seed):
    sim, report, log = recorded_run(tmp_path, seed=seed, inject=dict.fromkeys(TIER_FAULT_KINDS, 0.05))
    by_fault = {id(f): load for load in log.finished + log.in_flight for f in load.faults}
    faults = [f for f in sim.tracker.faults if f.kind in TIER_FAULT_KINDS]
    assert len({f.kind for f in faults}) >= 4, seed
    for fault in faults:
        load = by_fault[id(fault)]  # every tier fault struck one load-back
        assert (fault.group, fault.step, fault.request) == ("FULL", load.start_step, load.rid)
        assert (fault.position, fault.slot) == (load.page.depth, int(load.slots[0]))
        assert fault.detail.startswith(f"{load.tier} load-back started at step {load.start_step}: ")
    made = Counter(f.kind for f in faults)
    for kind, count in made.items():
        assert count <= len(sim.injector.fire_steps[kind]), (kind, count)
    assert all(v >= 0 for v in sim.injector.pending.values())
    assert report["violations"]["false_positives"] == 0


@pytest.mark.parametrize("seed", range(2))
def test_a_wrong_key_fault_on_a_sliding_window_model_is_caught(tmp_path, seed):
    """The confused page's SWA KV (stored only for positions that had an SWA slot) is placed at the loaded
    page's SWA positions: the restore takes it and the fault is caught, with no false positive."""
    sim, report, _log = recorded_run(tmp_path, seed=seed, inject={"tier-wrong-key": 0.1}, preset="swa")
    faults = [f for f in sim.tracker.faults if f.kind == "tier-wrong-key"]
    assert faults and all(f.detected for f in faults), seed
    assert report["violations"]["false_positives"] == 0


@pytest.mark.parametrize("seed", range(3))
def test_a_kind_that_fits_every_load_is_made_once_per_firing(tmp_path, seed):
    """A wrong-slots fault fits any load of two slots or more. At rate 0.01 it fires once in a 90-step run (at the
    first injectable step; the next firing would be 100 steps later): exactly one fault, although later loads
    would fit it too."""
    sim, _report, log = recorded_run(tmp_path, seed=seed, inject={"tier-wrong-slots": 0.01})
    assert len(sim.injector.fire_steps["tier-wrong-slots"]) == 1
    made = [f for f in sim.tracker.faults if f.kind == "tier-wrong-slots"]
    (fault,) = made
    later = [load for load in log.finished if load.start_step > fault.step and load.page.n >= 2]
    assert later  # loads it would have fitted


def test_the_reports_tier_section_states_the_capacities_the_pages_left_and_the_loads_in_flight(tmp_path):
    """The run's ``tiers`` section: the tiers asked for, the capacities in force (host memory cut to 128 slots
    here, the disk tier's default 4 MiB), the pages host memory still holds and the loads still in flight at
    the end (recorded before the store is emptied; the L3 files are gone by then), and the record bytes moved
    per KV byte moved."""
    _sim, report, log = recorded_run(tmp_path, seed=0, inject={})
    tiers = report["tiers"]
    assert tiers["tiers"] == ["host", "disk"]
    assert (tiers["l2_capacity_slots"], tiers["l3_capacity_bytes"]) == (128, 4 << 20)
    assert tiers["l2_pages"] == sum(p.tier == "L2" for p in log.pages) > 0
    assert tiers["l3_files"] == 0 and any(p.tier == "L3" for p in log.pages)
    assert tiers["loads_in_flight"] == len(log.in_flight)
    assert tiers["kv_bytes"] > 0 and tiers["record_bytes"] > 0
    assert tiers["record_bytes_per_kv_byte"] == pytest.approx(tiers["record_bytes"] / tiers["kv_bytes"])


# every count and peak of the report's tier section
TIER_COUNTS = ["written_back", "written_back_slots", "l2_hits", "l3_hits", "restored_slots", "demoted_to_l3",
               "l3_files_written", "l3_bytes_written", "l3_bytes_read", "l2_evicted", "l3_evicted", "peak_l2_slots",
               "peak_l3_bytes", "record_bytes", "kv_bytes"]


def test_a_run_too_short_to_write_anything_back_reports_every_count_zero(tmp_path):
    _sim, report, _log = recorded_run(tmp_path, seed=0, inject={}, steps=6, requests=2)
    tiers = report["tiers"]
    assert {k: tiers[k] for k in TIER_COUNTS} == dict.fromkeys(TIER_COUNTS, 0)
    assert tiers["record_bytes_per_kv_byte"] == 0.0 and tiers["l2_pages"] == tiers["loads_in_flight"] == 0


class _RecordingTier(OrderedDict):
    """A tier's page dictionary that records every page put in and taken out, and checks that a page taken out
    is the least recently used one not pinned (the write-back's and demotion's eviction order)."""

    def __init__(self, log: list) -> None:
        super().__init__()
        self.log = log
        self.blob_bytes: dict[int, int] = {}  # id(page): its packed bytes in host memory as it came in

    def __setitem__(self, key, page) -> None:
        self.log.append(("in", page))
        if page.blob is not None:
            self.blob_bytes[id(page)] = page.blob.nbytes
        super().__setitem__(key, page)

    def __delitem__(self, key) -> None:
        page = self[key]
        assert key == next(k for k, p in self.items() if not p.pinned)  # the least recently used unpinned page
        self.log.append(("out", page))
        super().__delitem__(key)


def _part_bytes(page, prefix: str) -> int:
    return sum(int(np.prod(shape)) * 8 for name, shape in page.layout if name.startswith(prefix))


def _unlocked_leaves(tree) -> list:
    """The prefix-cache paths nothing holds (the ones an eviction may take)."""
    out, stack = [], list(tree.root.children.values())
    while stack:
        node = stack.pop()
        stack.extend(node.children.values())
        if not node.children and node.lock == 0:
            out.append(node)
    return out


def counted_run(tmp_path, *, seed, tiers, l2_slots=96, l3_bytes=None, preset="decode", layout="token"):
    """A clean tiered run whose store is watched: every page put into or taken out of host memory and the disk
    tier (in order), every L3 file created or removed, the pages a write-back made for each evicted node, and
    the tiers' fill after every write-back, completion and demotion. The device cache's cut between steps is
    checked as it happens (``log.cuts`` counts them, ``log.kept`` those that left a path nothing holds)."""
    cfg = SimConfig(preset=preset, steps=60, requests=24, seed=seed, backend="numpy", tiers=tiers, layout=layout,
                    tier_dir=str(tmp_path / "l3") if "disk" in tiers else None, ring_capacity=512)
    sim = Simulation(cfg)
    store, eng = sim.tiers, sim.engine
    store.l2_slots = l2_slots
    if l3_bytes is not None:
        store.l3_bytes = l3_bytes
    log = SimpleNamespace(l2=[], l3=[], created=[], removed=[], l2_fill=[], l3_fill=[], evicted=[], cuts=0, kept=0,
                          in_complete=False)
    store.l2, store.l3 = _RecordingTier(log.l2), _RecordingTier(log.l3)

    def fill_checked():
        """Each tier's fill is the sum over its pages, and within its cap unless every page left is pinned."""
        l2_fill = sum(p.n for p in store.l2.values())
        l3_fill = sum(p.nbytes for p in store.l3.values())
        assert (store.l2_used, store.l3_used) == (l2_fill, l3_fill)
        assert l2_fill <= store.l2_slots or all(p.pinned for p in store.l2.values())
        assert l3_fill <= store.l3_bytes or all(p.pinned for p in store.l3.values())
        return l2_fill, l3_fill

    write_back, complete, demote = store.write_back, store.complete, store._demote

    def watched_write_back(node):
        before = len(log.l2)
        write_back(node)
        made = [page for what, page in log.l2[before:] if what == "in"]
        log.evicted.append((np.asarray(node.slots, np.int64).copy(), eng.tree.path_keys(node).copy(), made))
        log.l2_fill.append(fill_checked()[0])

    def watched_complete(step):
        log.in_complete = True
        try:
            complete(step)
        finally:
            log.in_complete = False
        fill_checked()

    evict_tree = eng._evict_tree

    def watched_evict_tree(want):
        size, first = eng.tree.size, len(log.evicted)
        evict_tree(want)
        sizes = [len(slots) for slots, *_ in log.evicted[first:]]
        if log.in_complete and sizes:  # the cut between steps: to the device cache's slots, in whole units, no further
            over = size - DEVICE_CACHE_SLOTS
            assert over > 0 and sum(sizes[:-1]) < -(-over // eng.unit) * eng.unit
            left = _unlocked_leaves(eng.tree)
            assert sum(sizes) >= over or not left  # or nothing else could go
            log.cuts += 1
            log.kept += bool(left)

    def watched_demote(page):
        demote(page)
        log.l3_fill.append(sum(p.nbytes for p in store.l3.values()))

    eng.on_evict, store.complete, store._demote = watched_write_back, watched_complete, watched_demote
    eng._evict_tree = watched_evict_tree
    if store.l3dir is not None:
        create, remove = store.l3dir.create, store.l3dir.remove

        def watched_create(key, data):
            log.created.append((key, len(data)))
            return create(key, data)

        def watched_remove(name, **kwargs):
            log.removed.append(name)
            return remove(name, **kwargs)

        store.l3dir.create, store.l3dir.remove = watched_create, watched_remove
    report = sim.run()
    return sim, report, log


@pytest.mark.parametrize("seed", range(3))
def test_the_tier_counts_are_the_sums_over_the_pages_written_back_demoted_and_deleted(tmp_path, seed):
    """Host memory cut to 96 slots and the disk tier to 64 KiB: pages are written back, demoted to files and
    deleted from the disk tier within the run. Every evicted node becomes one page (its slots, its prefix's
    keys, its KV and records packed), unless a tier holds its prefix already; every count in the report is the
    sum over those events; each tier holds the sum of its pages and stays within its cap."""
    sim, report, log = counted_run(tmp_path, seed=seed, tiers=("host", "disk"), l3_bytes=64 << 10)
    tiers, store = report["tiers"], sim.tiers
    assert log.cuts > 0  # the device cache was cut back between steps (checked as it happened)
    written = [page for what, page in log.l2 if what == "in"]
    demoted = [page for what, page in log.l3 if what == "in"]
    deleted = [page for what, page in log.l3 if what == "out"]
    assert written and demoted and deleted, seed  # the run reached every path
    for slots, keys, made in log.evicted:
        if made:
            (page,) = made
            np.testing.assert_array_equal(page.origin, slots)
            np.testing.assert_array_equal(page.keys, keys)
            assert (page.depth, page.n) == (len(keys) - len(slots), len(slots))
            assert page.nbytes == _part_bytes(page, "") == store.l2.blob_bytes[id(page)]
    assert tiers["written_back"] == len(written) == sum(bool(made) for *_, made in log.evicted)
    assert tiers["written_back_slots"] == sum(page.n for page in written)
    assert tiers["kv_bytes"] == sum(_part_bytes(page, "kv:") for page in written) > 0
    assert tiers["record_bytes"] == sum(_part_bytes(page, "rec:") for page in written) > 0
    # every page leaving host memory is demoted to a file of its bytes; files leave the disk tier as deletions
    assert [page for what, page in log.l2 if what == "out"] == demoted
    assert tiers["demoted_to_l3"] == tiers["l3_files_written"] == len(demoted) == len(log.created)
    assert log.created == [(page.key, page.nbytes) for page in demoted]
    assert tiers["l3_bytes_written"] == sum(page.nbytes for page in demoted)
    assert tiers["l3_evicted"] == len(deleted) == len(log.removed)
    assert log.removed == [page.file for page in deleted] and tiers["l2_evicted"] == 0
    assert tiers["peak_l2_slots"] == max(log.l2_fill) and tiers["peak_l3_bytes"] == max(log.l3_fill)
    assert max(log.l3_fill) <= 64 << 10


@pytest.mark.parametrize(("preset", "seed"), [("mixed", 1), ("swa", 0)])
def test_the_device_cache_is_cut_back_to_its_slots_between_steps_in_whole_blocks_and_no_further(tmp_path, preset,
                                                                                                   seed):
    """On a paged layout (16-slot blocks) whose cuts leave cached paths nothing holds: each cut frees at least
    what the device cache holds over its 32 slots, rounded up to whole blocks, and stops there."""
    _sim, _report, log = counted_run(tmp_path, seed=seed, tiers=("host", "disk"), preset=preset, layout="block")
    assert log.cuts > 0 and log.kept > 0


@pytest.mark.parametrize("seed", range(2))
def test_without_a_disk_tier_the_least_recently_used_pages_are_deleted_and_no_file_written(tmp_path, seed):
    _sim, report, log = counted_run(tmp_path, seed=seed, tiers=("host",))
    tiers = report["tiers"]
    dropped = [page for what, page in log.l2 if what == "out"]
    assert dropped and not log.l3, seed
    assert tiers["l2_evicted"] == len(dropped)
    assert tiers["peak_l2_slots"] == max(log.l2_fill) <= 96
    assert tiers["demoted_to_l3"] == tiers["l3_files_written"] == tiers["l3_bytes_written"] == 0
    assert tiers["l3_evicted"] == tiers["peak_l3_bytes"] == tiers["l3_bytes_read"] == tiers["l3_hits"] == 0


class _DeviceArray:
    """Stands in for a CuPy array: its host copy comes from ``.get()``."""

    def __init__(self, values: np.ndarray) -> None:
        self.values = values

    def get(self) -> np.ndarray:
        return self.values.copy()


def test_a_page_is_copied_off_the_device_from_a_numpy_array_or_through_a_device_arrays_get():
    kv = np.arange(12, dtype=np.uint64).reshape(3, 4)
    copied = _host(kv)
    np.testing.assert_array_equal(copied, kv)
    assert copied.dtype == np.uint64 and not np.shares_memory(copied, kv)  # a copy: the page outlives the slots
    fetched = _host(_DeviceArray(kv))
    assert isinstance(fetched, np.ndarray) and fetched.dtype == np.uint64
    np.testing.assert_array_equal(fetched, kv)


def test_a_page_packs_its_parts_into_one_byte_blob_and_unpacks_them_whole():
    parts = {"kv:FULL:K:0": np.arange(6, dtype=np.uint64).reshape(3, 2) << np.uint64(60),
             "rec:target:FULL:0": -np.arange(12, dtype=np.int64).reshape(3, 4)}
    layout, blob = _pack(parts)
    assert layout == [("kv:FULL:K:0", (3, 2)), ("rec:target:FULL:0", (3, 4))]
    assert blob.dtype == np.uint8 and blob.shape == ((6 + 12) * 8,)
    assert blob[:48].tobytes() == parts["kv:FULL:K:0"].tobytes()  # in order, each part's bytes as they are
    unpacked = _unpack(layout, blob)
    for name, values in parts.items():
        assert unpacked[name].dtype == values.dtype
        np.testing.assert_array_equal(unpacked[name], values)
    layout, blob = _pack({})  # a page of no part: no byte
    assert layout == [] and blob.dtype == np.uint8 and blob.shape == (0,)


# -- the tiers' caps, eviction order and page lookup, on stores whose pages are made by hand ----------------------


def idle_store(tmp_path, *, tiers=("host", "disk"), preset="decode"):
    """A tiered simulation's store before its first step (no page yet), its L3 files in ``tmp_path / "l3"``."""
    cfg = SimConfig(preset=preset, steps=60, requests=24, seed=0, backend="numpy", tiers=tiers,
                    tier_dir=str(tmp_path / "l3") if "disk" in tiers else None, ring_capacity=512)
    return Simulation(cfg).tiers


def made_page(key: str, *, n: int = 2, nbytes: int = 1000, keys=None, depth: int = 0) -> TierPage:
    """A page in host memory of ``n`` positions after ``depth`` whose packed bytes are ``nbytes`` bytes of ``key``'s
    first character (the caps and the lookup read only its size, keys and pins)."""
    keys = np.arange(depth + n, dtype=np.int64) if keys is None else np.asarray(keys, np.int64)
    return TierPage(key, keys, depth, n, [], np.full(nbytes, ord(key[0]), np.uint8), np.arange(n, dtype=np.int64),
                    np.zeros(n, bool), nbytes)


def _in_l2(store, *pages) -> None:
    for page in pages:
        store.l2[page.key] = page
        store.l2_used += page.n


def test_the_disk_tier_keeps_to_its_cap_and_deletes_its_least_recently_used_unpinned_file_first(tmp_path):
    store = idle_store(tmp_path)
    store.l3_bytes = 3000
    a, b, c, d = (made_page(k) for k in ("aa", "bb", "cc", "dd"))
    for page in (a, b, c):
        blob = page.blob.tobytes()
        store._demote(page)
        assert (page.blob, page.tier) == (None, "L3") and store.l3dir.read(page.file) == blob  # its bytes, on disk
    assert list(store.l3) == ["aa", "bb", "cc"] and store.l3_used == 3000  # exactly at the cap: every file stays
    a.pinned = 1  # a load reads it: it stays, the next least recently used goes
    store._demote(d)
    assert list(store.l3) == ["aa", "cc", "dd"] and store.l3_used == 3000
    assert not os.path.exists(os.path.join(store.dir, b.file)) and os.path.exists(os.path.join(store.dir, a.file))
    a.pinned = 0
    e = made_page("ee", nbytes=1500)
    store._demote(e)  # 4,500 bytes: the two least recently used go
    assert list(store.l3) == ["dd", "ee"] and store.l3_used == 2500
    assert sorted(os.listdir(store.dir)) == sorted([d.file, e.file])
    s = store.stats
    assert (s["demoted_to_l3"], s["l3_files_written"], s["l3_bytes_written"]) == (5, 5, 5500)
    assert (s["l3_evicted"], s["peak_l3_bytes"]) == (3, 3000)
    store.close()


def test_the_memory_tier_keeps_to_its_cap_by_demoting_its_least_recently_used_unpinned_pages(tmp_path):
    store = idle_store(tmp_path)
    store.l2_slots = 6
    x, y, z = (made_page(k) for k in ("aa", "bb", "cc"))
    _in_l2(store, x, y, z)
    store._fit_l2()
    assert list(store.l2) == ["aa", "bb", "cc"] and not store.l3  # exactly at the cap: nothing moves
    x.pinned = 1
    _in_l2(store, made_page("dd", n=3))
    store._fit_l2()  # 9 slots: the pinned page stays, the next two go down to disk
    assert list(store.l2) == ["aa", "dd"] and store.l2_used == 5
    assert list(store.l3) == ["bb", "cc"] and store.stats["demoted_to_l3"] == 2 and store.stats["l2_evicted"] == 0
    store.close()
    host_only = idle_store(tmp_path, tiers=("host",))
    host_only.l2_slots = 4
    _in_l2(host_only, *(made_page(k) for k in ("aa", "bb", "cc")))
    host_only._fit_l2()  # no disk: the least recently used page is dropped
    assert list(host_only.l2) == ["bb", "cc"] and host_only.l2_used == 4 and host_only.stats["l2_evicted"] == 1
    assert not host_only.l3 and host_only.stats["demoted_to_l3"] == 0


def test_a_prompt_finds_the_longest_page_at_its_match_depth_that_leaves_its_last_position_to_compute(tmp_path):
    store = idle_store(tmp_path)
    prompt = [10, 11, 12, 13, 14, 15]  # its last position (5) is always computed
    deeper = made_page("d1", n=2, depth=3, keys=prompt[:5])
    short = made_page("a2", n=2, depth=2, keys=prompt[:4])
    other = made_page("e3", n=3, depth=2, keys=[10, 11, 12, 99, 14])
    whole = made_page("c4", n=4, depth=2, keys=prompt)  # would leave nothing to compute
    longest = made_page("b5", n=3, depth=2, keys=prompt[:5])
    store.l2.update((p.key, p) for p in (deeper, short, other))  # a page that does not fit comes first in each tier
    store.l3.update((p.key, p) for p in (whole, longest))
    keys = np.asarray(prompt, np.int64)
    assert store._find(keys, 2) is longest
    assert store._find(keys[:5], 2) is short  # the longest page now reaches the last position
    assert store._find(keys, 3) is deeper and store._find(keys, 1) is None
    assert store._find(np.asarray([10, 11, 12, 99, 14, 15]), 2) is other
    store.close()


def _store_beside(sim, tiers, **kwargs) -> TieredStore:
    """Another store over ``sim``'s engine (it takes over the engine's hooks), with the arguments given."""
    return TieredStore(tiers, sim.engine, sim.runtime, sim.tracker, sim.injector, np.random.default_rng(0), **kwargs)


def test_a_disk_tier_without_a_directory_gets_its_own_which_goes_at_the_end_even_when_refused(tmp_path, monkeypatch):
    made = []
    mkdtemp = tempfile.mkdtemp

    def recording_mkdtemp(**kwargs):
        made.append(mkdtemp(dir=tmp_path, **kwargs))
        return made[-1]

    monkeypatch.setattr(tiers_module.tempfile, "mkdtemp", recording_mkdtemp)
    sim = Simulation(SimConfig(preset="decode", steps=40, requests=16, seed=0, backend="numpy", tiers=("host",),
                               ring_capacity=512))
    assert made == [] and sim.tiers.l3dir is None  # memory only: no directory
    sim.run()
    assert made == [] and os.listdir(tmp_path) == []
    store = _store_beside(sim, ("host", "disk"), l2_slots=5, l3_bytes=1 << 20)
    (own,) = made
    assert store.dir == own and os.path.isdir(own)
    assert os.path.basename(own).startswith("kvcanary-l3-")  # a leftover in the temporary directory says whose
    summary = store.summary()  # the caps given are the ones in force
    assert (summary["l2_capacity_slots"], summary["l3_capacity_bytes"]) == (5, 1 << 20)
    store.close()
    assert not os.path.exists(own)
    given = tmp_path / "given"
    store = _store_beside(sim, ("host", "disk"), tier_dir=str(given))
    assert len(made) == 1 and store.dir == str(given)
    store.close()
    assert os.path.isdir(given)  # a directory the user named stays
    with pytest.raises(ValueError, match="the disk tier needs"):
        _store_beside(sim, ("host", "disk"), l3_bytes=1 << 62)  # more than any disk holds: refused at the start
    assert len(made) == 2 and not os.path.exists(made[1])


def test_an_own_directory_that_keeps_its_probe_file_is_refused_by_the_probe_not_by_its_removal(tmp_path,
                                                                                               monkeypatch):
    """A file system that refuses to remove files: the store's own directory fails the start-up check on its probe
    file and is refused with that check's message; removing the directory (which then fails too) does not replace
    the refusal with an error of its own."""
    made = []
    mkdtemp, unlink = tempfile.mkdtemp, os.unlink

    def recording_mkdtemp(**kwargs):
        made.append(mkdtemp(dir=tmp_path, **kwargs))
        return made[-1]

    def refusing_unlink(name, *args, **kwargs):
        if os.path.basename(str(name)).startswith(".kvcanary-probe-"):
            raise PermissionError(errno.EPERM, "Operation not permitted", str(name))
        unlink(name, *args, **kwargs)

    sim = Simulation(SimConfig(preset="decode", steps=40, requests=16, seed=0, backend="numpy", tiers=("host",),
                               ring_capacity=512))
    monkeypatch.setattr(tiers_module.tempfile, "mkdtemp", recording_mkdtemp)
    monkeypatch.setattr(os, "unlink", refusing_unlink)
    with pytest.raises(ValueError, match="cannot remove files from it: Operation not permitted"):
        _store_beside(sim, ("host", "disk"))
    monkeypatch.undo()
    assert len(made) == 1
    shutil.rmtree(made[0])


def _lookup_state(store, node, page):
    """What a refused load-back must leave as it was: the locks along the resident prefix, the page's pins, the
    loads, the counts and the free device slots."""
    locks, at = [], node
    while at is not store.engine.tree.root:
        locks.append(at.lock)
        at = at.parent
    return locks, page.pinned, sorted(store.loads), dict(store.stats), store.engine.alloc.available


# runs in which a load-back continues a resident prefix (its lookup locks that prefix), on a paged layout too
DEEP_LOAD_RUNS = [("decode", "token", 0, 90, 32), ("swa", "token", 2, 60, 24), ("mixed", "block", 1, 60, 24)]


@pytest.mark.parametrize(("preset", "layout", "seed", "steps", "requests"), DEEP_LOAD_RUNS)
def test_a_load_back_without_room_for_its_slots_is_refused_and_leaves_everything_as_it_was(tmp_path, preset, layout,
                                                                                          seed, steps, requests):
    """At each admission that would start a load-back (a page found, room for its slots without evicting), the
    same lookup is tried first with the device pool refusing the allocation and, on a sliding-window model, with
    one SWA slot fewer free than the page's SWA positions: each is refused (the request computes its prompt)
    and leaves the locks, pins, loads, counts and free slots as they were. Then the real lookup runs with
    exactly the SWA slots the page needs left free, and starts the load (reading the page's file at once when
    it lives on disk)."""
    cfg = SimConfig(preset=preset, steps=steps, requests=requests, seed=seed, backend="numpy", layout=layout,
                    tiers=("host", "disk"), tier_dir=str(tmp_path / "l3"), ring_capacity=512)
    sim = Simulation(cfg)
    store, eng = sim.tiers, sim.engine
    store.l2_slots = 96
    lookup = store.lookup
    tried = SimpleNamespace(pool=0, swa=0, deep=0, l3=0)

    def refused_first(spec, keys, shared, node, step):
        depth = int(shared.shape[0])
        page = None if spec.rid in store.loads else store._find(keys, depth)
        if page is None or eng.alloc.available < page.n or (eng.swa and depth and eng._usable(shared, depth) < depth):
            return lookup(spec, keys, shared, node, step)
        before = _lookup_state(store, node, page)
        eng.alloc.alloc = lambda n: None  # the pool refuses
        try:
            assert lookup(spec, keys, shared, node, step) is False
        finally:
            del eng.alloc.alloc
        assert _lookup_state(store, node, page) == before
        tried.pool += 1
        tried.deep += depth > 0
        need = int(page.swa_alive.sum())
        held = None
        if eng.swa and need and eng.swa_alloc.available >= need:
            held = eng.swa_alloc.alloc(eng.swa_alloc.available - need + 1)  # one SWA slot short
            assert lookup(spec, keys, shared, node, step) is False
            assert _lookup_state(store, node, page) == before
            eng.swa_alloc.free(held)
            held = eng.swa_alloc.alloc(eng.swa_alloc.available - need)  # exactly enough
            tried.swa += 1
        read = store.stats["l3_bytes_read"]
        try:
            started = lookup(spec, keys, shared, node, step)
            assert started and store.loads[spec.rid].page is page
            # a file is read as its load starts (while the request waits), host memory's page as it completes
            assert store.stats["l3_bytes_read"] - read == (page.nbytes if page.tier == "L3" else 0)
            tried.l3 += page.tier == "L3"
        finally:
            if held is not None:
                eng.swa_alloc.free(held)
        return started

    eng.on_lookup = refused_first
    report = sim.run()
    assert tried.pool >= 2 and tried.deep >= 1 and tried.l3 >= 1 and (tried.swa >= 1 or not eng.swa), tried
    assert report["violations"]["total"] == 0 and report["violations"]["false_positives"] == 0


def test_a_page_pinned_while_the_memory_tier_went_over_its_cap_goes_down_to_disk_when_its_load_completes(tmp_path):
    """Host memory's cap drops to 0 as the first load-back from it starts: every other page goes down to disk at
    the next write-back, but the loaded page is pinned and stays until its load completes; then it goes too."""
    cfg = SimConfig(preset="decode", steps=90, requests=32, seed=0, backend="numpy", tiers=("host", "disk"),
                    tier_dir=str(tmp_path / "l3"), ring_capacity=512)
    sim = Simulation(cfg)
    store = sim.tiers
    store.l2_slots = 128
    lookup, finish = store.lookup, store._finish
    seen = SimpleNamespace(load=None, checked=False)

    def cap_dropped_at_first_l2_load(spec, keys, shared, node, step):
        started = lookup(spec, keys, shared, node, step)
        load = store.loads.get(spec.rid)
        if started and seen.load is None and load is not None and load.tier == "L2":
            seen.load = load
            store.l2_slots = 0
        return started

    def checked_finish(load, step):
        finish(load, step)
        if load is seen.load:
            assert load.page.pinned == 0 and load.page.tier == "L3" and load.page.key in store.l3
            assert store.l2_used == sum(p.n for p in store.l2.values()) and all(p.pinned for p in store.l2.values())
            seen.checked = True

    store.lookup = sim.engine.on_lookup = cap_dropped_at_first_l2_load
    store._finish = checked_finish
    report = sim.run()
    assert seen.checked and report["violations"]["total"] == 0


# -- load-backs started by hand on an idle store: the resident prefix and the pool made for each case -------------


def _cached(eng, keys, *, now, slots=None) -> np.ndarray:
    """``keys`` put in the prefix cache (at ``now``) on fresh device slots, or on ``slots``; returns the slots."""
    keys = np.asarray(keys, np.int64)
    if slots is None:
        slots = eng.alloc.alloc(keys.shape[0])
    eng.tree.insert(keys, np.asarray(slots, np.int64), now)
    return slots


def _admit(store, keys, *, rid, step):
    """The engine's admission of a prompt of ``keys``: its device match, then the store's lookup."""
    keys = np.asarray(keys, np.int64)
    shared, node = store.engine.tree.match(keys, step)
    return store.lookup(SimpleNamespace(rid=rid), keys, shared, node, step), node


def _ints(a) -> list[int]:
    return [int(x) for x in np.asarray(a).tolist()]


SWA_WINDOW = 32  # the swa preset's window


@pytest.mark.parametrize(("dead", "starts"), [
    ([], True),  # every resident position has its SWA slot
    (list(range(8)), True),  # positions 0-7 lost theirs: the last 32 (one window) still have one
    (list(range(9)), False),  # only 31 of the last 32 positions have one: the engine cuts its match to nothing
    ([39], False),  # the last position lost its SWA slot: the engine cuts its match back to 39 positions
])
def test_a_page_continuing_a_match_the_engine_would_cut_back_for_its_sliding_window_is_not_loaded(tmp_path, dead,
                                                                                                  starts):
    """A 40-position resident prefix on a sliding-window model (window 32) and a host page continuing it at
    depth 40. The engine keeps a match only while its last window of positions still has SWA slots; where it
    would cut the match back, no page continues it: the request is admitted to compute (the lookup says no)
    with no load started, nothing locked or pinned."""
    store = idle_store(tmp_path, preset="swa")
    eng = store.engine
    assert eng.swa and eng.cfg.swa_window == SWA_WINDOW and not eng.paged
    prompt = np.arange(1000, 1044, dtype=np.int64)
    slots = _cached(eng, prompt[:40], now=0)
    alive = np.setdiff1d(np.arange(40), dead)
    eng.lut_host[slots[alive]] = eng.swa_alloc.alloc(alive.shape[0])
    page = made_page("aa", n=3, depth=40, keys=prompt[:43])
    _in_l2(store, page)
    started, node = _admit(store, prompt, rid=7, step=5)
    assert started is starts
    assert sorted(store.loads) == ([7] if starts else [])
    assert (page.pinned, node.lock, store.stats["l2_hits"]) == ((1, 1, 1) if starts else (0, 0, 0))
    store.close()


@pytest.mark.parametrize(("free", "evicted"), [(3, []), (2, [[500]]), (0, [[500], [600, 601]])])
def test_a_load_back_short_of_free_slots_evicts_the_least_recently_used_cached_paths_just_enough(tmp_path, free,
                                                                                                 evicted):
    """A 3-position page continuing a 2-position resident prefix; beside it the device cache holds a 1-slot path
    (used at step 0) and a 2-slot path (used at step 1), nothing else free but what each case leaves. With 3 free
    slots nothing is evicted; with 2 free the 1-slot path alone is (written back to host memory), and the load
    takes the 3 slots then free; with none free both paths go (3 slots) and the pool is empty again."""
    store = idle_store(tmp_path)
    eng = store.engine
    prompt = np.asarray([10, 11, 12, 13, 14, 15], np.int64)
    _cached(eng, prompt[:2], now=2)
    small, pair = _cached(eng, [500], now=0), _cached(eng, [600, 601], now=1)
    page = made_page("aa", n=3, depth=2, keys=prompt[:5])
    _in_l2(store, page)
    held = eng.alloc.alloc(eng.alloc.available - free)
    gone = []
    write_back = store.write_back

    def recording_write_back(node):
        gone.append(_ints(eng.tree.path_keys(node)))
        write_back(node)

    eng.on_evict = recording_write_back
    started, _node = _admit(store, prompt, rid=3, step=4)
    assert started and gone == evicted
    load = store.loads[3]
    freed = [*([small[0]] if evicted else []), *(pair.tolist() if len(evicted) == 2 else [])]
    assert eng.alloc.available == free + len(freed) - 3
    assert store.stats["written_back"] == len(evicted) and store.stats["written_back_slots"] == len(freed)
    assert len(set(_ints(load.slots))) == 3 and not set(_ints(load.slots)) & set(_ints(held))  # all fresh
    assert eng.tree.cached_len(np.asarray([600, 601], np.int64)) == (0 if len(evicted) == 2 else 2)
    store.close()


def test_two_loads_of_one_page_in_flight_pin_it_twice(tmp_path):
    """Two requests of the same prompt admitted in one step both wait for the same host page: it is pinned by
    each load (host memory over its cap keeps it), and the resident prefix locked by each."""
    store = idle_store(tmp_path)
    eng = store.engine
    prompt = np.asarray([10, 11, 12, 13, 14, 15], np.int64)
    _cached(eng, prompt[:2], now=0)
    page = made_page("aa", n=3, depth=2, keys=prompt[:5])
    _in_l2(store, page)
    (started_a, node), (started_b, _) = _admit(store, prompt, rid=1, step=3), _admit(store, prompt, rid=2, step=3)
    assert started_a and started_b and store.loads[1].page is store.loads[2].page is page
    assert page.pinned == 2 and node.lock == 2
    assert not set(_ints(store.loads[1].slots)) & set(_ints(store.loads[2].slots))
    store.l2_slots = 0
    store._fit_l2()
    assert list(store.l2) == ["aa"] and not store.l3
    store.close()
