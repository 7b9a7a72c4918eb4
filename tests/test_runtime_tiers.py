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


def _whole(records: OffloadedRecords) -> OffloadedRecords:
    return OffloadedRecords(records.model, records.count, {k: v.copy() for k, v in records.records.items()})


def _broken_records(records: OffloadedRecords) -> list[tuple[str, OffloadedRecords, str]]:
    """(what, a damaged copy of ``records``, words the refusal says): every way an engine can hand back records
    that are not what offload() gave, each refused as a whole at restore."""
    key = next(iter(records.records))
    arr = records.records[key]
    label = re.escape(f"records.records[{key!r}]")

    def with_array(value):
        out = _whole(records)
        out.records[key] = value
        return out

    def with_field(**changes):
        out = _whole(records)
        for name, value in changes.items():
            setattr(out, name, value)
        return out

    wide = np.zeros((arr.shape[0], 8), np.int64)
    wide[:, ::2] = arr
    cases = [
        ("matrix", with_array(np.asmatrix(arr)), f"{label} must be a plain array"),
        ("masked", with_array(np.ma.masked_array(arr, mask=np.zeros_like(arr, bool))), f"{label} must be a plain"),
        ("list", with_array(arr.tolist()), f"{label} must be a NumPy host array"),
        ("None", with_array(None), f"{label} must be a NumPy host array"),
        ("int32", with_array(arr.astype(np.int32)), rf"{label} must be int64 \[4, 4\]"),
        ("big-endian", with_array(arr.astype(">i8")), rf"{label} must be int64 \[4, 4\]"),
        ("one row short", with_array(arr[:3].copy()), rf"{label} must be int64 \[4, 4\]"),
        ("transposed", with_array(np.asfortranarray(arr)), f"{label} must be C-contiguous"),
        ("strided", with_array(wide[:, ::2]), f"{label} must be C-contiguous"),
        ("count as float", with_field(count=4.0), "records.count must be an int"),
        ("count as str", with_field(count="4"), "records.count must be an int"),
        ("negative count", with_field(count=-4), "records.count must be >= 0"),
        ("dict as list", with_field(records=list(records.records.items())), "records.records must be a dict"),
        ("no dict", with_field(records=None), "records.records must be a dict"),
        ("model None", with_field(model=None), "records.model must be a str"),
        ("foreign model", with_field(model="draft"), "records.model must be one of target"),
        ("key not a pair", with_field(records={**records.records, "FULL": arr}), "records.records has the key"),
    ]
    extra = _whole(records)
    extra.records[("FULL", 99)] = arr.copy()
    cases.append(("a buffer this runtime lacks", extra,
                  re.escape("records hold records for canary buffer ('FULL', 99)")))
    return cases


@pytest.mark.filterwarnings("ignore:the matrix subclass:PendingDeprecationWarning")
@pytest.mark.parametrize("backend", BACKENDS)
def test_restore_refuses_records_that_are_not_whole_by_name_and_writes_nothing(backend):
    _, rt, _, _, records, _, _ = _offloaded(backend)
    before = runtime_arrays(rt)
    for what, broken, words in _broken_records(records):
        with pytest.raises(CanaryArgumentError, match=f"^kv-canary: {words}"):
            rt.restore(broken, DST, [0, 1, 2, 3], [-1, *DST[:3]])
        after = runtime_arrays(rt)
        assert [k for k in before if not np.array_equal(before[k], after[k])] == [], what
    assert rt.restore(records, DST, [0, 1, 2, 3], [-1, *DST[:3]]) == 4  # the whole one is still accepted


@pytest.mark.parametrize(("index", "words"), [
    ([0, 1, 4], r"index holds 4, outside the 4 records \[0, 4\)"),
    ([-1, 0], r"index holds -1, outside the 4 records"),
    ([True, False], r"index as a boolean mask must have shape \(4,\)"),
    ([0.0, 1.0], "index must be a 1-D integer host array"),
    ([[0, 1], [2, 3]], "index must be a 1-D integer host array"),
    (2, "index must be a 1-D integer host array"),
    (None, "index must be a 1-D integer host array"),
    ("0", "index must be a 1-D integer host array"),
    (slice("a", None), "index slice"),
    (slice(0, 4, 0), "index slice"),
    (np.ma.masked_array([0, 1], mask=[False, True]), "index must be a plain array"),
])
def test_select_refuses_an_index_outside_the_records_by_name(index, words):
    _, _, _, _, records, _, _ = _offloaded("numpy")
    before = {k: v.copy() for k, v in records.records.items()}
    with pytest.raises(CanaryArgumentError, match=f"^kv-canary: {words}"):
        records.select(index)
    assert all(np.array_equal(before[k], records.records[k]) for k in before)


def test_select_picks_the_rows_named_by_an_index_a_mask_or_a_slice():
    _, _, _, _, records, _, _ = _offloaded("numpy")
    for index, rows in (([2, 0], [2, 0]), (np.array([True, False, False, True]), [0, 3]), (slice(1, 3), [1, 2]),
                        ([], []), (np.array([3], np.uint8), [3])):
        picked = records.select(index)
        assert picked.model == records.model and picked.count == len(rows)
        for key, arr in records.records.items():
            assert picked.records[key].flags.c_contiguous
            np.testing.assert_array_equal(picked.records[key], arr[rows].reshape(len(rows), 4))
    # a disabled runtime offloads no arrays; what is selected still counts the slots asked for
    assert OffloadedRecords("target", 4, {}).select([1, 3]).count == 2
