"""What each load-back leaves behind, checked as it completes against what its store held before: a tier fault's
restored slots are that fault's corrupted content and descend from it (a later join onto them fails), the damage
a rotten or torn L3 file does is charged to every load that reads the file (a second load of the same file
included), the join of the restored page onto the resident prefix reaches the fault tracker (and the engine's
splice hook when the page is new to the prefix cache), what the prefix cache already holds goes back as
duplicates (only those positions' slots when it holds part of the page), the page becomes the most recently used
path, stays pinned by the loads of it still in flight, and host memory fits its cap again; and the fault
planner's choices (which kind strikes a load, which page a confused tier hands back) and the late faults' bytes
(a wrong key only where a reader would see other content, a reused page keeping its own SWA KV), pinned on stores
built by hand."""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from types import SimpleNamespace

import numpy as np
import pytest

from kvcanary_cupy.sim.config import SimConfig
from kvcanary_cupy.sim.faults import TIER_FAULT_KINDS, CarriedTaint
from kvcanary_cupy.sim.runner import Simulation
from kvcanary_cupy.sim.tiers import Load, _pack, _unpack
from kvcanary_cupy.sim.workload import RequestSpec

FILE_KINDS = ("tier-disk-bit-rot", "tier-torn-write")  # the kinds that damage the page's file for good


def _ints(a) -> list[int]:
    return [int(x) for x in np.asarray(a).tolist()]


def checked_run(tmp_path, *, seed, inject, preset="decode", steps=60, requests=24, second_load=None):
    """A small tiered run whose every load-back is checked as it completes (``check_finish``); each load for which
    ``second_load(load)`` holds is followed at once by a second load of the same page for a request of the same
    prompt (with no fault of its own; a file is read after the first load's fault damaged it)."""
    cfg = SimConfig(preset=preset, steps=steps, requests=requests, seed=seed, backend="numpy",
                    tiers=("host", "disk"), tier_dir=str(tmp_path / "l3"), inject=inject, ring_capacity=512)
    sim = Simulation(cfg)
    store = sim.tiers
    store.l2_slots = 96  # a small host tier: pages reach the disk within the run
    log = SimpleNamespace(finished=[], second=[], joins=0, duplicates=0, over_cap=0, seen=set(), now=None)
    finish, lookup, complete = store._finish, store.lookup, store.complete

    def lookup_and_read_again(spec, keys, shared, node, step):
        started = lookup(spec, keys, shared, node, step)
        load = store.loads.get(spec.rid)
        if second_load and started and load is not None and id(load) not in log.seen and second_load(load):
            again = RequestSpec(-1 - len(log.second), spec.arrival, spec.tokens, spec.prompt_len)
            pending = dict(store.injector.pending)
            store.injector.pending.update(dict.fromkeys(pending, 0))  # no fault of its own
            try:
                if lookup(again, keys, shared, node, step):
                    log.second.append(store.loads[again.rid])
            finally:
                store.injector.pending.update(pending)
        if load is not None:
            log.seen.add(id(load))
        return started

    def completing(step):
        log.now = step
        complete(step)

    def checked_finish(load, step):
        # a load completes in the step that finds it ready, and its page joins the cache as used then
        assert step == log.now and load.ready_step <= step
        check_finish(sim, finish, load, step, log)
        log.finished.append(load)

    store.lookup = sim.engine.on_lookup = lookup_and_read_again
    store._finish, store.complete = checked_finish, completing
    report = sim.run()
    return sim, report, log


def check_finish(sim, finish, load, step, log):
    """Run ``finish(load, step)`` and check what it did against what the store held before."""
    store, eng, tracker = sim.tiers, sim.engine, sim.tracker
    page = load.page
    slots = _ints(load.slots)
    held = eng.tree.cached_len(page.keys)  # how much of the page's prefix the device cache holds now
    damage = [*load.faults, *(f for f in page.damaged_by if f not in load.faults)]
    l2_over_cap = page.tier == "L2" and store.l2_used > store.l2_slots
    seen = SimpleNamespace(joins=[], hook=[], released=[], leaf=None)
    insert, release, hook = eng.tree.insert, eng._release, eng.on_splice

    def seen_insert(keys, full, now):
        cached, leaf = insert(keys, full, now)
        seen.leaf = leaf
        return cached, leaf

    def seen_join(prev, first):
        seen.joins.append((prev, first))
        type(tracker).on_splice(tracker, prev, first)

    def seen_hook(prev, first):
        seen.hook.append((prev, first))
        hook(prev, first)

    def seen_release(s):
        seen.released.append(_ints(s))
        release(s)

    tracker.on_splice, eng.on_splice, eng._release, eng.tree.insert = seen_join, seen_hook, seen_release, seen_insert
    try:
        finish(load, step)
    finally:
        del tracker.on_splice, eng._release, eng.tree.insert
        eng.on_splice = hook
    join = [(int(load.shared[-1]), slots[0])] if page.depth else []
    # the restored page's first slot joins the resident slot before it (a chain descending from a fault on
    # either side fails there)
    assert seen.joins == join
    if held > page.depth:  # positions the cache gained meanwhile: their restored copies go back
        assert seen.released == [slots[: held - page.depth]] and seen.hook == []
        log.duplicates += 1
    else:  # the page is new to the prefix cache: the engine's splice hook sees the same join
        assert seen.released == [] and seen.hook == join
        log.joins += bool(join)
    assert seen.leaf is not None and seen.leaf.last_use == step  # the most recently used path now
    # the page stays pinned by the loads of it still in flight (a second load of it started with this one)
    assert page.pinned == sum(other.page is page for other in store.loads.values())
    # the tier's damage (this load's faults and those that damaged the file before) is the restored slots'
    # corrupted content, and every chain written after them descends from it
    for fault in damage:
        for s in (s for s in slots if s > 0):
            assert s in fault.taint["FULL"] and s in fault.sources["FULL"], (fault.kind, s)
            assert fault.fid in tracker._chain["FULL"].get(s, ()), (fault.kind, s)
    if l2_over_cap:  # the page was pinned while host memory filled: unpinned, it may go now
        log.over_cap += 1
        assert store.l2_used <= store.l2_slots or all(p.pinned for p in store.l2.values())


@pytest.mark.parametrize("seed", range(4))
def test_a_rotten_or_torn_file_is_charged_to_every_load_that_reads_it(tmp_path, seed):
    """A second load of a page whose file a fault damaged reads the damage again (the same flipped bit, the same
    short file): its restore verify fails and the earlier fault explains it (no false positive); both loads
    count their file reads."""
    kind = FILE_KINDS[seed % 2]
    sim, report, log = checked_run(tmp_path, seed=seed, inject={kind: 0.2},
                                   second_load=lambda load: any(f.kind in FILE_KINDS for f in load.faults))
    assert log.second, seed  # a damaged file was read twice
    for load in log.second:
        assert not load.faults and load in log.finished
        (fault,) = load.page.damaged_by[:1]
        assert fault.kind == kind and set(_ints(load.slots)) <= fault.taint["FULL"]
    assert report["violations"]["false_positives"] == 0, sim.false_positives[:3]
    assert all(f.detected for f in sim.tracker.faults)
    loads = [*log.finished, *sim.tiers.loads.values()]
    assert report["tiers"]["l3_hits"] == sum(load.tier == "L3" for load in loads)


# runs in which a load-back continues a prefix resident on the device (its page joins it)
JOINING_RUNS = [("decode", 0, 90, 32), ("mixed", 1, 60, 24), ("swa", 2, 60, 24), ("eagle", 2, 60, 24)]


@pytest.mark.parametrize(("preset", "seed", "steps", "requests"), JOINING_RUNS)
def test_each_load_back_joins_taints_and_hands_its_page_to_the_cache_as_it_should(tmp_path, preset, seed, steps,
                                                                                   requests):
    """Every load is checked as it completes; a load that continues a resident prefix is followed by a second
    load of its page (whose restored copy the prefix cache then holds: it goes back as duplicates)."""
    sim, report, log = checked_run(tmp_path, seed=seed, preset=preset, steps=steps, requests=requests,
                                   inject=dict.fromkeys(TIER_FAULT_KINDS, 0.05),
                                   second_load=lambda load: load.page.depth > 0)
    assert log.joins >= 1 and log.duplicates >= 1 and any(load.faults for load in log.finished), seed
    assert all(load in log.finished or load.rid in sim.tiers.loads for load in log.second)
    assert report["violations"]["false_positives"] == 0


# runs with a load-back continuing a resident prefix the cache holds no more of (at steps 65, 51 and 53)
PARTLY_CACHED_RUNS = [("decode", 0), ("swa", 0), ("eagle", 1)]


@pytest.mark.parametrize(("preset", "seed"), PARTLY_CACHED_RUNS)
def test_a_page_the_cache_holds_in_part_when_its_load_completes_gives_back_only_those_positions_slots(tmp_path,
                                                                                                     preset, seed):
    """The first load-back continuing a resident prefix finds, when it completes, the page's first position cached
    meanwhile (another request computed it, on a slot of its own): that position's restored slot goes back as a
    duplicate, the rest join the cache after it and stay held, and the resident prefix's slots stay held. (The
    run stops there: the slot put in the cache by hand holds no records a later sweep could check.)"""
    cfg = SimConfig(preset=preset, steps=90, requests=32, seed=seed, backend="numpy", tiers=("host", "disk"),
                    tier_dir=str(tmp_path / "l3"), ring_capacity=512)
    sim = Simulation(cfg)
    store, eng = sim.tiers, sim.engine
    store.l2_slots = 96
    finish = store._finish
    log = SimpleNamespace(finished=[], second=[], joins=0, duplicates=0, over_cap=0, seen=set(), checked=False)

    def partly_cached_finish(load, step):
        page = load.page
        if log.checked or not page.depth or page.n < 2 or eng.tree.cached_len(page.keys) != page.depth:
            finish(load, step)
            return
        computed = eng.alloc.alloc(1)  # the other request's slot for the page's first position
        eng.tree.insert(page.keys[: page.depth + 1], np.concatenate([load.shared, computed]), step)
        check_finish(sim, finish, load, step, log)  # the restored copy of that position goes back (only it)
        slots = _ints(load.slots)
        assert eng.alloc.refs[slots[0]] == 0 and slots[0] in eng.alloc._free
        assert (eng.alloc.refs[slots[1:]] == 1).all() and (eng.alloc.refs[load.shared] >= 1).all()
        path, _node = eng.tree.match(page.keys, step)
        assert _ints(path) == [*_ints(load.shared), int(computed[0]), *slots[1:]]
        log.checked = True

    store._finish = partly_cached_finish
    try:
        for t in range(cfg.steps):
            sim._step(t)
            if log.checked:
                break
    finally:
        store.close()
    assert log.checked and log.duplicates == 1, (preset, seed)


# -- the fault planner, on stores built by hand ---------------------------------------------------------------


@pytest.fixture
def midway(tmp_path, request):
    """A tiered run (``decode``, or the preset given as the fixture's parameter) stopped after 40 of its 60 steps
    (pages in host memory and on disk), no fault requested: the tests set the pending injections and the faults
    made themselves."""
    cfg = SimConfig(preset=getattr(request, "param", "decode"), steps=60, requests=24, seed=0, backend="numpy",
                    tiers=("host", "disk"), tier_dir=str(tmp_path / "l3"), ring_capacity=512)
    sim = Simulation(cfg)
    sim.tiers.l2_slots = 96
    for t in range(40):
        sim._step(t)
    store = sim.tiers
    assert cfg.preset != "decode" or (any(p.n >= 3 for p in store.l2.values()) and any(store.l3.values()))
    store.injector.pending = dict.fromkeys(TIER_FAULT_KINDS, 0)
    yield sim
    store.close()


def _page(store, tier, *, n=2):
    return next(p for p in (store.l2 if tier == "L2" else store.l3).values() if p.n >= n)


def _load(page, *, step=40):
    latency = 1 if page.tier == "L2" else 2
    return Load(page, -1, None, np.empty(0, np.int64), np.arange(1, page.n + 1, dtype=np.int64),
                np.arange(1, page.n + 1, dtype=np.int64), page.tier, step, step + latency)


def _due(store, *kinds, count=1):
    store.injector.pending = {k: (count if k in kinds else 0) for k in TIER_FAULT_KINDS}


def _made(sim, *kinds):
    sim.tracker.faults = [SimpleNamespace(kind=k) for k in kinds]


def test_the_planner_picks_the_least_injected_due_kind_that_fits_the_load(midway):
    store = midway.tiers
    l3, l2 = _load(_page(store, "L3")), _load(_page(store, "L2"))
    assert store._plan_fault(l3) is None  # nothing due
    _due(store, "tier-disk-bit-rot", "tier-torn-write", "tier-wrong-slots")
    assert store._plan_fault(l3) == "tier-disk-bit-rot"  # none made yet: the first by name
    assert store._plan_fault(l2) == "tier-wrong-slots"  # the file kinds strike only a load from disk
    _made(midway, "tier-disk-bit-rot")
    assert store._plan_fault(l3) == "tier-torn-write"
    _made(midway, "tier-disk-bit-rot", "tier-torn-write")
    assert store._plan_fault(l3) == "tier-wrong-slots"
    _made(midway, "tier-wrong-slots", "tier-wrong-slots", "tier-disk-bit-rot", "tier-torn-write", "kv-bitflip")
    assert store._plan_fault(l3) == "tier-disk-bit-rot"
    _due(store, "tier-torn-write")
    assert store._plan_fault(l3) == "tier-torn-write" and store._plan_fault(l2) is None


def test_a_wrong_slots_fault_needs_two_positions(midway):
    store = midway.tiers
    page = _page(store, "L2")
    _due(store, "tier-wrong-slots")
    assert store._plan_fault(_load(dataclasses.replace(page, n=2))) == "tier-wrong-slots"
    assert store._plan_fault(_load(dataclasses.replace(page, n=1))) is None


def _variants(page):
    """Pages around ``page`` (same depth unless named): other tokens, longer, shorter, other parts, deeper,
    the same tokens, damaged by a fault, carrying a fault's damage."""
    d, n = page.depth, page.n
    other = page.keys.copy()
    other[d:] += 1
    rep = dataclasses.replace
    return {
        "other": rep(page, key="other", keys=other),
        "longer": rep(page, key="longer", keys=np.concatenate([other, [7]]), n=n + 1),
        "shorter": rep(page, key="shorter", keys=other[:-1], n=n - 1),
        "parts": rep(page, key="parts", keys=other, layout=page.layout[:-1]),
        "deeper": rep(page, key="deeper", keys=np.concatenate([[5], other]), depth=d + 1),
        "same": rep(page, key="same"),
        "damaged": rep(page, key="damaged", keys=other, damaged_by=[SimpleNamespace(kind="tier-torn-write")]),
        "carrying": rep(page, key="carrying", keys=other,
                        carried=CarriedTaint((("FULL", 0, (0,), (0,), ()),))),
    }


def _hold(store, page, l2=(), l3=()):
    store.l2 = OrderedDict([(page.key, page), *((p.key, p) for p in l2)])
    store.l3 = OrderedDict((p.key, p) for p in l3)


def _keys(pages):
    return [p.key for p in pages]


def test_a_confused_tier_hands_back_a_clean_page_as_long_of_the_same_parts_at_the_same_depth(midway):
    store = midway.tiers
    page = _page(store, "L2", n=3)
    v = _variants(page)
    load = _load(page)
    _hold(store, page, [v["shorter"], v["other"], v["parts"], v["deeper"], v["same"], v["damaged"]],
          [v["longer"], v["carrying"]])
    assert _keys(store._others(load)) == ["other", "same", "longer"]
    assert _keys(store._others(load, other_tokens=True)) == ["other", "longer"]  # the same KV is no lookup error
    _hold(store, page, [v["shorter"], v["deeper"], v["damaged"]], [v["carrying"]])
    assert _keys(store._others(load)) == ["damaged", "carrying"]  # damaged ones when no clean one is left
    _hold(store, page, [v["shorter"], v["parts"], v["deeper"]])
    assert _keys(store._others(load)) == ["deeper"]  # another depth when none is at the same one
    _hold(store, page, [v["shorter"], v["parts"]])
    assert store._others(load) == [] and store._other(load) is None
    _due(store, "tier-host-page-reused", "tier-wrong-key")
    assert store._plan_fault(load) is None  # neither fits: no page to confuse it with
    _hold(store, page, [v["same"]])  # host page reuse fits, a wrong key does not (the same tokens)
    assert store._plan_fault(load) == "tier-host-page-reused"
    _due(store, "tier-wrong-key")
    assert store._plan_fault(load) is None
    _hold(store, page, [v["other"]])
    assert store._plan_fault(load) == "tier-wrong-key"


def test_a_confused_tier_may_hand_back_any_of_its_candidates(midway):
    store = midway.tiers
    page = _page(store, "L2", n=3)
    v = _variants(page)
    _hold(store, page, [v["other"], v["same"]], [v["longer"]])
    load = _load(page)
    picked = {store._other(load).key for _ in range(60)}
    assert picked == {"other", "same", "longer"}
    assert {store._other(load, other_tokens=True).key for _ in range(60)} == {"other", "longer"}


def _with_records(store, page, records):
    """``page`` in host memory, holding ``records`` as its target FULL records (its KV unchanged)."""
    parts = _unpack(page.layout, store._read(page, count=False))
    parts["rec:target:FULL:0"] = records
    layout, blob = _pack(parts)
    return dataclasses.replace(page, layout=layout, blob=blob, tier="L2")


@pytest.mark.parametrize("midway", ["decode", "swa"], indirect=True)
def test_a_stale_copy_fits_only_a_page_whose_old_slots_were_rewritten(midway):
    store, rt = midway.tiers, midway.runtime
    pages = [*store.l2.values(), *store.l3.values()]
    page = next(p for p in pages if p.n >= 2 and (p.swa_alive.any() or not midway.engine.swa))
    now = rt.offload(page.origin, model="target").records[("FULL", 0)]
    _due(store, "tier-stale-copy")
    fresh = _with_records(store, page, now.copy())  # its old slots still hold what it holds
    assert store._stale(fresh) is None and store._plan_fault(_load(fresh)) is None
    changed = now.copy()
    changed.reshape(-1)[0] += 1
    rewritten = _with_records(store, page, changed)
    stale = store._stale(rewritten)
    assert stale is not None and store._plan_fault(_load(rewritten)) == "tier-stale-copy"
    np.testing.assert_array_equal(stale["rec:target:FULL:0"], now)  # what the old slots hold now
    # shaped as the page (on the SWA preset: SWA KV for the positions that had an SWA slot)
    assert {k: v.shape for k, v in stale.items()} == dict(page.layout)


def test_the_late_injections_skip_a_load_already_struck_or_no_longer_due(midway):
    store = midway.tiers
    page = _page(store, "L2")
    data = _unpack(page.layout, page.blob)
    load = _load(page)
    load.planned = "tier-wrong-slots"
    assert store._inject_at_finish(load, data) is data  # planned, but no longer due
    _due(store, "tier-wrong-slots")
    load.faults.append(SimpleNamespace(kind="tier-disk-bit-rot"))
    assert store._inject_at_finish(load, data) is data  # struck already (one fault per load)
    load.faults.clear()
    struck = store._inject_at_finish(load, data)
    assert "kv_order" in struck and [f.kind for f in load.faults] == ["tier-wrong-slots"]
    assert page.damaged_by == []  # the file is not damaged: a later load reads it right


@pytest.mark.parametrize("seed", range(2))
def test_disk_bit_rot_flips_one_bit_anywhere_in_the_pages_kv_bytes(midway, seed):
    store = midway.tiers
    store.rng = np.random.default_rng(seed)
    page = _page(store, "L3")
    kv_bytes = sum(int(np.prod(shape)) * 8 for name, shape in page.layout if name.startswith("kv:"))
    assert kv_bytes < page.nbytes
    places = []
    for _ in range(40):
        before = np.frombuffer(store.l3dir.read(page.file), np.uint8)
        _due(store, "tier-disk-bit-rot")
        load = _load(page)
        store._inject_at_start(load)
        after = np.frombuffer(store.l3dir.read(page.file), np.uint8)
        (at,) = np.flatnonzero(before != after)
        assert bin(int(before[at] ^ after[at])).count("1") == 1  # one bit of one byte
        (fault,) = load.faults
        assert fault.kind == "tier-disk-bit-rot" and fault.detail.endswith(f"bit flipped at byte {at} of {page.file}")
        assert page.damaged_by[-1] is fault and store.injector.pending["tier-disk-bit-rot"] == 0
        places.append(int(at))
    assert max(places) < kv_bytes and max(places) >= kv_bytes // 2  # the KV bytes, all of them


@pytest.mark.parametrize("seed", range(2))
def test_a_torn_write_keeps_half_to_nine_tenths_of_the_file_in_whole_words(midway, seed):
    store = midway.tiers
    store.rng = np.random.default_rng(seed)
    page = _page(store, "L3")
    original = store.l3dir.read(page.file)
    kept = []
    for _ in range(40):
        store.l3dir.truncate(page.file, 0)
        store.l3dir.truncate(page.file, len(original))  # back to full length (zeros: only the size matters)
        _due(store, "tier-torn-write")
        load = _load(page)
        store._inject_at_start(load)
        keep = store.l3dir.size(page.file)
        assert keep % 8 == 0 and page.nbytes // 2 - 8 < keep <= page.nbytes * 9 // 10
        (fault,) = load.faults
        assert fault.kind == "tier-torn-write" and fault.detail.endswith(
            f"{page.file} holds {keep} of {page.nbytes} bytes")
        assert page.damaged_by[-1] is fault
        kept.append(keep / page.nbytes)
    assert min(kept) < 0.6 and max(kept) > 0.8  # spread over the range


@pytest.mark.parametrize("seed", range(2))
def test_a_wrong_slots_fault_swaps_two_neighbouring_positions_and_names_them(midway, seed):
    store = midway.tiers
    store.rng = np.random.default_rng(seed)
    page = dataclasses.replace(_page(store, "L2", n=3), n=3)  # three positions: two pairs to strike
    data = _unpack(page.layout, page.blob)
    swapped = set()
    for _ in range(30):
        _due(store, "tier-wrong-slots")
        load = _load(page)
        load.planned = "tier-wrong-slots"
        order = store._inject_at_finish(load, data)["kv_order"].astype(np.int64)
        (i,) = np.flatnonzero(order[:-1] > order[1:])  # one descent: one neighbouring pair swapped
        expected = np.arange(page.n)
        expected[[i, i + 1]] = [i + 1, i]
        np.testing.assert_array_equal(order, expected)
        (fault,) = load.faults
        assert fault.detail.endswith(f"positions {page.depth + i} and {page.depth + i + 1} were copied into each "
                                     "other's device slots")
        swapped.add(int(i))
    assert swapped == {0, 1}  # either pair may be struck


def test_the_late_faults_bring_back_the_other_pages_bytes_and_name_it(midway):
    store = midway.tiers
    page = _page(store, "L2")
    names = [name for name, _ in page.layout]
    other = next(p for p in store.l3.values() if p.n >= page.n and [name for name, _ in p.layout] == names)
    data = _unpack(page.layout, page.blob)
    theirs = _unpack(other.layout, store._read(other, count=False))
    n = page.n

    def strike(kind, held):
        _due(store, kind)
        _hold(store, page, held)
        load = _load(page)
        load.planned = kind
        return load, store._inject_at_finish(load, data)

    load, out = strike("tier-host-page-reused", [dataclasses.replace(page, key="same")])
    assert out is data and not load.faults  # the same KV: nothing to see, no fault
    load, out = strike("tier-host-page-reused", [other])
    for name in names:  # the other page's KV for its first positions, our records
        np.testing.assert_array_equal(out[name], (theirs if name.startswith("kv:") else data)[name][:n])
    (fault,) = load.faults
    assert fault.detail.endswith(f"its host page was evicted and refilled with {other.key}'s KV before the copy "
                                 "to the device")
    load, out = strike("tier-wrong-key", [other])
    for name in names:  # the other page's first positions, records too
        np.testing.assert_array_equal(out[name], theirs[name][:n])
    (fault,) = load.faults
    assert fault.detail.endswith(f"the lookup answered with {other.key} (positions {other.depth}.."
                                 f"{other.depth + n - 1} of another prefix)")
    now = midway.runtime.offload(page.origin, model="target").records[("FULL", 0)].copy()
    now.reshape(-1)[0] += 1
    rewritten = _with_records(store, page, now)
    _due(store, "tier-stale-copy")
    load = _load(rewritten)
    load.planned = "tier-stale-copy"
    store._inject_at_finish(load, data)
    (fault,) = load.faults
    assert fault.detail.endswith("the copy came from its old device slots after they were given to another "
                                 "request and rewritten")


def _strike(store, page, kind, held, data):
    """``kind`` due and planned for a load of ``page`` while the tiers hold ``page`` and ``held``: the load and the
    bytes the late injection hands to the restore."""
    _due(store, kind)
    _hold(store, page, held)
    load = _load(page)
    load.planned = kind
    return load, store._inject_at_finish(load, data)


def _other_page(store, page):
    """Another page as long as ``page``, of the same parts, holding other tokens."""
    names = [name for name, _ in page.layout]
    return next(p for p in [*store.l2.values(), *store.l3.values()]
                if p is not page and p.n >= page.n and [name for name, _ in p.layout] == names
                and not np.array_equal(p.keys[p.depth : p.depth + page.n], page.keys[page.depth :]))


def test_a_wrong_key_strikes_only_where_a_reader_would_see_other_content(midway, monkeypatch):
    """A confused lookup hands back nothing different (no fault) when the other page's records are the load's own,
    when the only other page holds the same tokens at the same positions (the same KV), or when the prefix
    cache meanwhile holds the whole page (the restored copy goes back as a duplicate unread)."""
    store, eng = midway.tiers, midway.engine
    page = _page(store, "L2")
    data = _unpack(page.layout, page.blob)
    other = _other_page(store, page)
    same_records = _variants(page)["other"]  # other tokens, the load's own bytes
    load, out = _strike(store, page, "tier-wrong-key", [same_records], data)
    assert out is data and not load.faults
    records = data["rec:target:FULL:0"].copy()
    records.reshape(-1)[0] += 1
    same_tokens = dataclasses.replace(_with_records(store, page, records), key="sametokens")
    load, out = _strike(store, page, "tier-wrong-key", [same_tokens], data)
    assert out is data and not load.faults
    whole = page.depth + page.n
    monkeypatch.setattr(eng.tree, "cached_len", lambda keys: whole)
    load, out = _strike(store, page, "tier-wrong-key", [other], data)
    assert out is data and not load.faults
    monkeypatch.setattr(eng.tree, "cached_len", lambda keys: whole - 1)  # one position short: a reader sees it
    load, out = _strike(store, page, "tier-wrong-key", [other], data)
    assert [f.kind for f in load.faults] == ["tier-wrong-key"] and out is not data


@pytest.mark.parametrize("midway", ["swa"], indirect=True)
def test_a_page_refilled_with_another_pages_kv_on_a_sliding_window_model_keeps_its_own_swa_kv(midway):
    """The reused page's slot took the other page's KV of the full-attention layers; its SWA KV (stored only for
    the positions that had an SWA slot, a shape of its own) is the load's."""
    store = midway.tiers
    page = next(p for p in [*store.l2.values(), *store.l3.values()] if p.n >= 2 and p.swa_alive.any())
    data = _unpack(page.layout, store._read(page, count=False))
    other = _other_page(store, page)
    theirs = _unpack(other.layout, store._read(other, count=False))
    load, out = _strike(store, page, "tier-host-page-reused", [other], data)
    assert [f.kind for f in load.faults] == ["tier-host-page-reused"]
    swa = [name for name, _ in page.layout if name.startswith("kv:SWA")]
    assert swa and any(name.startswith("kv:FULL") for name, _ in page.layout)
    for name, _ in page.layout:
        expected = data[name] if name in swa or name.startswith("rec:") else theirs[name][: page.n]
        np.testing.assert_array_equal(out[name], expected, err_msg=name)
