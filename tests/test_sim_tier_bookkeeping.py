"""The tiered simulator's own bookkeeping, checked against what each load-back did (recorded as the run goes):
a load pins its page and locks the resident prefix it continues exactly while it is in flight; the restored-slot
and L3 byte counts are the sums over the loads; every tier fault is recorded at its load (group, first
position and slot, request, step), each firing of a kind makes at most one fault; a wrong-key fault on a
sliding-window model swaps the SWA KV too and is caught; the report's tier section states the capacities, the
pages left and the loads in flight."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import pytest

from kvcanary_cupy.sim.config import SimConfig
from kvcanary_cupy.sim.faults import TIER_FAULT_KINDS
from kvcanary_cupy.sim.runner import Simulation

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


def test_a_run_too_short_to_write_anything_back_reports_no_record_bytes_per_kv_byte(tmp_path):
    _sim, report, _log = recorded_run(tmp_path, seed=0, inject={}, steps=6, requests=2)
    tiers = report["tiers"]
    assert tiers["written_back"] == tiers["kv_bytes"] == 0 and tiers["record_bytes_per_kv_byte"] == 0.0
