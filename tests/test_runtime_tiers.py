"""The runtime around an engine's KV offload and load-back: ``offload`` takes the records of the pages going down
a tier (every HEAD and TAIL buffer, K and V, SWA through the LUT), ``restore`` puts them into the slots the pages
came back to and verifies them before any forward reads them; a restore into the wrong slots, of rotten bytes
or of records that are not the pages' is reported by the next ``finish_step``/``flush``."""

from __future__ import annotations

import re

import numpy as np
import pytest
import runtime_scenario as sc
from test_runtime import BACKENDS, canary_records, drive, make, oracle_for, runtime_arrays

from kvcanary_cupy import CanaryArgumentError, FailReason
from kvcanary_cupy.runtime import OffloadedRecords

DST = [sc.NUM_SLOTS - 8 + i for i in range(4)]  # free slots the pages come back to


def _offloaded(backend: str):
    """Drive the toy engine, offload request 2's cached pages (records + KV bytes of every group), then let the
    engine reuse the device slots (their KV and records become another request's)."""
    engine = sc.ToyEngine(swa=True, with_v=True)
    rt = make(engine, backend)
    oracle = oracle_for(engine, rt)
    drive(engine, rt, oracle)
    src = engine.cached.pop(0)  # request 2's four slots leave the device
    records = rt.offload(np.array(src))
    assert records.count == 4 and records.nbytes == 4 * 32 * len(records.records)
    lut = {g: (lambda s: int(engine.lut[s])) if g == "SWA" else (lambda s: s) for g in engine.kv}
    tier = {(g, kv): np.stack([pool[lut[g](s) // sc.PAGE, lut[g](s) % sc.PAGE] for s in src])
            for g, pools in engine.kv.items() for kv, pool in pools.items()}
    return engine, rt, oracle, src, records, tier, lut


def _load_back(engine, tier, lut, dst, kv_fault: bool = False) -> None:
    """The engine's own load-back: new SWA slots for ``dst``, the tier's bytes copied into them."""
    for i, d in enumerate(dst):
        engine.lut[d] = sc.NUM_SLOTS - 8 + i
    for (g, kv), rows in tier.items():
        pool = engine.kv[g][kv]
        for d, row in zip(dst, rows, strict=True):
            pool[lut[g](d) // sc.PAGE, lut[g](d) % sc.PAGE] = row
    if kv_fault:
        engine.flip_kv_bit("FULL", dst[2])


@pytest.mark.parametrize("backend", BACKENDS)
def test_restored_pages_carry_their_records_and_verify_clean(backend):
    engine, rt, oracle, src, records, tier, lut = _offloaded(backend)
    _load_back(engine, tier, lut, DST)
    assert rt.restore(records, DST, positions=[0, 1, 2, 3], prev_slots=[-1, *DST[:3]]) == 4
    oracle.copy_slots(src, DST)  # what the oracle says a record copy leaves in every buffer
    for name, got, want in canary_records(rt, oracle):
        assert np.array_equal(got[DST], want[DST]), name
    report = rt.flush()
    assert report.new_violations == [] and report.status_bits == 0 and rt.check_health() == []


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fault", ["kv_bit_rot", "wrong_slots", "other_records", "stale_slot"])
def test_each_restore_fault_is_reported_at_the_slots_it_damaged(backend, fault):
    engine, rt, _, _, records, tier, lut = _offloaded(backend)
    _load_back(engine, tier, lut, DST, kv_fault=fault == "kv_bit_rot")
    positions, prevs = [0, 1, 2, 3], [-1, *DST[:3]]
    if fault == "wrong_slots":  # the records land in the slots in another order than the KV did
        records = records.select([1, 0, 2, 3])
    if fault == "other_records":  # records of request 3's cached path: another prefix at the same positions
        records = rt.offload(np.array(engine.cached[0][:4]))
    restore_slots = DST
    if fault == "stale_slot":  # the engine restores into slots the table does not name for these positions
        restore_slots = [DST[0], DST[1], DST[3], DST[2]]
        prevs = [-1, DST[0], DST[1], DST[3]]
    rt.restore(records, restore_slots, positions=positions, prev_slots=prevs)
    report = rt.flush()
    rows = [(g, v) for g, v in report.new_violations]
    assert rows and all(v.launch_tag.startswith("SWEEP") for _, v in rows)
    full = {v.slot: v.reason_bits for g, v in rows if g == "FULL" and v.launch_tag == "SWEEP_K_FULL"}
    chain, pos, real = (int(FailReason.VERIFY_CHAIN_HASH_MISMATCH), int(FailReason.VERIFY_POSITION_MISMATCH),
                        int(FailReason.VERIFY_REAL_KV_HASH_MISMATCH))
    want = {
        "kv_bit_rot": {DST[2]: real},
        # DST[0] holds position 1's record (its chain names position 0, not the anchor of a chain head),
        # DST[1] position 0's; neither record describes the bytes beside it; DST[2]'s chain names position 1
        "wrong_slots": {DST[0]: chain | pos | real, DST[1]: chain | pos | real, DST[2]: chain},
        # request 3's records chain among themselves at the same positions: only the bytes give them away (the
        # forward's plan would add the token check)
        "other_records": {d: real for d in DST},
        # the last two records swapped places, the KV did not: each record's chain and position hold
        "stale_slot": {DST[3]: real, DST[2]: real},
    }[fault]
    assert full == want


def test_restore_refuses_what_names_no_restore_before_anything_is_written():
    _, rt, _, _, records, _, _ = _offloaded("numpy")
    before = runtime_arrays(rt)
    for args, message in [((records, DST[:3], [0, 1, 2], [-1, 1, 2]), "slots has 3 entries"),
                          ((records, [DST[0]] * 4, [0, 1, 2, 3], [-1, 1, 2, 3]), "slots must name distinct slots"),
                          ((records.records, DST, [0, 1, 2, 3], [-1, 1, 2, 3]), "records must be the OffloadedRecords"),
                          ((OffloadedRecords("target", 4, {}), DST, [0, 1, 2, 3], [-1, 1, 2, 3]),
                           "records hold no records for canary buffer ('FULL', 0)"),
                          ((records, np.array(DST, float), [0, 1, 2, 3], [-1, 1, 2, 3]),
                           "slots must be a 1-D integer host array")]:
        with pytest.raises(CanaryArgumentError, match=re.escape(message)):
            rt.restore(*args)
    after = runtime_arrays(rt)
    assert [k for k in before if not np.array_equal(before[k], after[k])] == []
