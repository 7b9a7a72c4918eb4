"""The runtime's record moves at their edges: ``offload`` and ``restore`` of more slots than
``Capacities.max_tokens`` (in chunks) against the scalar protocol oracle, a slot outside the canary buffer
(a zero record and a status bit, never an exception), what a runtime in ``off`` mode answers, the refusals of
each by the caller's argument name, under CUDA-graph capture, and the timer phases they run under."""

from __future__ import annotations

import contextlib
import re

import numpy as np
import pytest
import runtime_scenario as sc
from test_runtime import BACKENDS, LOGGER, canary_records, drive, make, oracle_for, runtime_arrays
from test_runtime_tiers import DST, _offloaded

from kvcanary_cupy import CanaryArgumentError, CanaryStatus
from kvcanary_cupy.runtime import CanaryConfig, CanaryRuntime, Capacities, OffloadedRecords

POSITIONS, PREVS = [0, 1, 2, 3], [-1, *DST[:3]]
# offload()'s buffers of a group with K and V, in endpoint order: HEAD K, HEAD V, TAIL K, TAIL V
BUFFERS = {0: "HEAD_K", 1: "HEAD_V", 2: "TAIL_K", 3: "TAIL_V"}


def _oracle_records(oracle, group: str, buffer: int, slots: list[int]) -> np.ndarray:
    """The oracle's records of ``slots`` (full pool's slot space) in one canary buffer, as offload returns them."""
    g = next(g for g in oracle.groups if g.name == group)
    role, kv = BUFFERS[buffer].split("_")
    fields = (g.head if role == "HEAD" else g.tail)[kv].fields
    return np.array([[x & (2**64 - 1) for x in fields[s]] for s in g.translate(slots)], np.uint64).view(np.int64)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("count", [sc.MAX_TOKENS + 1, sc.MAX_TOKENS + 5, 2 * sc.MAX_TOKENS])
def test_offload_and_restore_of_more_slots_than_max_tokens_move_every_record_once(backend, count):
    """``count`` slots in chunks of ``max_tokens`` (16): offload returns, for every buffer of both groups, the
    oracle's records of those slots in order; restoring them into ``count`` other slots leaves every buffer as
    the oracle's after the same copy (SWA through the LUT)."""
    engine = sc.ToyEngine(swa=True, with_v=True)
    rt = make(engine, backend)
    oracle = oracle_for(engine, rt)
    drive(engine, rt, oracle)
    src = list(range(1, count + 1))  # the schedule wrote slots 1..24; the rest are zero records
    dst = list(range(sc.NUM_SLOTS - count - 1, sc.NUM_SLOTS - 1))
    for d in dst:
        engine.lut[d] = d  # SWA slots of the restored pages: unused by the schedule
    records = rt.offload(np.array(src))
    assert records.count == count and set(records.records) == {(g, b) for g in ("FULL", "SWA") for b in range(4)}
    for (group, b), got in records.records.items():
        np.testing.assert_array_equal(got, _oracle_records(oracle, group, b, src), err_msg=f"{group} {b}")
    rt.restore(records, dst, positions=list(range(count)), prev_slots=[-1, *dst[:-1]])
    oracle.copy_slots(src, dst)
    for name, got, want in canary_records(rt, oracle):
        assert np.array_equal(got, want), name


def _full_only(backend: str = "numpy", **config) -> tuple[sc.ToyEngine, CanaryRuntime]:
    engine = sc.ToyEngine(with_v=True)
    rt = make(engine, backend, **config)
    drive(engine, rt, steps=3)
    return engine, rt


@pytest.mark.parametrize("backend", BACKENDS)
def test_offload_of_a_slot_beyond_the_canary_gives_a_zero_record_and_a_status_bit(backend):
    _, rt = _full_only(backend)
    rt.flush()
    heads = np.asarray(rt.groups["FULL"].endpoints["HEAD"][0].verify_ctx.canary_buf).view(np.int64)[:, :4]
    records = rt.offload([2, sc.NUM_SLOTS + 3, 1])
    got = records.records[("FULL", 0)]
    np.testing.assert_array_equal(got[[0, 2]], heads[[2, 1]])
    assert got[1].tolist() == [0, 0, 0, 0] and np.any(got[0])
    assert rt.flush().status_bits == int(CanaryStatus.SLOT_OUT_OF_RANGE)
    assert rt.flush().status_bits == 0  # reported once


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_restore_into_a_slot_beyond_the_canary_skips_it_and_sets_a_status_bit(backend):
    """Two records restored into a free slot and a slot past the buffer: the free slot gets its record, nothing
    is written elsewhere, the restore returns 2 and the next report carries SLOT_OUT_OF_RANGE."""
    _, rt = _full_only(backend)
    rt.flush()
    records = rt.offload([1, 2])
    free = sc.NUM_SLOTS - 2
    before = runtime_arrays(rt)
    assert rt.restore(records, [free, sc.NUM_SLOTS + 1], positions=[0, 1], prev_slots=[-1, free]) == 2
    after = runtime_arrays(rt)
    for key in (k for k in before if k.endswith(".canary")):
        changed = np.flatnonzero(np.any(before[key] != after[key], axis=1)).tolist()
        assert changed == [free], key
    report = rt.flush()
    assert report.status_bits & int(CanaryStatus.SLOT_OUT_OF_RANGE)


def test_a_runtime_in_off_mode_offloads_no_records_and_restores_nothing():
    engine = sc.ToyEngine(with_v=True)
    rt = make(engine, mode="off")
    records = rt.offload(np.array([3, 5, 7]))
    assert (records.model, records.count, records.records) == ("target", 3, {})
    assert rt.restore(records, [9, 10, 11], positions=[0, 1, 2], prev_slots=[-1, 9, 10]) == 0
    assert rt.restore(OffloadedRecords("target", 0, {}), [], [], []) == 0


def test_offload_and_restore_refuse_each_argument_by_its_name_before_anything_is_written():
    _, rt, _, _, records, _, _ = _offloaded("numpy")
    before = runtime_arrays(rt)
    cases = [
        (lambda: rt.offload(np.array([1.0, 2.0])), "slots must be a 1-D integer host array, got float64 (2,)"),
        (lambda: rt.offload([[1, 2]]), "slots must be a 1-D integer host array"),
        (lambda: rt.restore(records, np.array(DST, float), POSITIONS, PREVS), "slots must be a 1-D integer"),
        (lambda: rt.restore(records, DST, np.array(POSITIONS, float), PREVS), "positions must be a 1-D integer"),
        (lambda: rt.restore(records, DST, POSITIONS, [PREVS]), "prev_slots must be a 1-D integer host array"),
        (lambda: rt.restore(dict(records.records), DST, POSITIONS, PREVS),
         "records must be the OffloadedRecords of offload(), got dict"),
        (lambda: rt.restore(None, DST, POSITIONS, PREVS), "records must be the OffloadedRecords of offload(), got "
                                                          "NoneType"),
        (lambda: rt.restore(records.select([0, 1, 2]), DST, POSITIONS, PREVS),
         "records has 3 entries but slots has 4 entries; restore takes one per restored slot"),
        (lambda: rt.restore(records, [DST[0], DST[1], DST[0], DST[3]], POSITIONS, PREVS),
         "slots must name distinct slots (two pages restored into one slot)"),
    ]
    for call, message in cases:
        with pytest.raises(CanaryArgumentError, match="^" + re.escape("kv-canary: " + message)):
            call()
    after = runtime_arrays(rt)
    assert [k for k in before if not np.array_equal(before[k], after[k])] == []


@pytest.mark.parametrize("call", ["offload", "restore"])
def test_offload_and_restore_refuse_to_run_under_capture(call, monkeypatch):
    _, rt, _, _, records, _, _ = _offloaded("numpy")
    before = runtime_arrays(rt)
    monkeypatch.setattr(rt.space, "capturing", lambda: True)  # what torch reports during a capture
    with pytest.raises(CanaryArgumentError, match="^" + re.escape(f"kv-canary: {call}() runs outside CUDA-graph "
                                                                  "capture")):
        if call == "offload":
            rt.offload(np.array(DST))
        else:
            rt.restore(records, DST, POSITIONS, PREVS)
    after = runtime_arrays(rt)
    assert [k for k in before if not np.array_equal(before[k], after[k])] == []


def test_offload_and_restore_run_under_their_own_timer_phases():
    """The timer hook sees one ``offload`` phase per offload; a restore runs its scatter and its verify under
    ``restore``, and each of its SWEEP launches (K and V of FULL and SWA: 4, one chunk) under ``restore`` too."""
    phases: list[str] = []

    @contextlib.contextmanager
    def timer(phase: str):
        phases.append(phase)
        yield

    engine = sc.ToyEngine(swa=True, with_v=True)
    rt = CanaryRuntime.create(CanaryConfig(logger=LOGGER), engine.pools(),
                              Capacities(max_batch_size=sc.MAX_BS, max_tokens=sc.MAX_TOKENS), timer=timer)
    drive(engine, rt, steps=2)
    phases.clear()
    records = rt.offload(np.array([1, 2, 3, 4]))
    assert phases == ["offload"]
    phases.clear()
    for d in DST:
        engine.lut[d] = d
    assert rt.restore(records, DST, POSITIONS, PREVS) == 4
    assert phases == ["restore"] * (2 + 4)


def test_a_torch_framework_runtime_moves_records_like_the_oracle():
    """The staging buffers of the record moves are allocated by the runtime's framework (torch tensors here):
    copy_slots, offload and restore carry every record of every buffer exactly as the oracle does."""
    pytest.importorskip("torch")
    engine = sc.ToyEngine(swa=True, with_v=True)
    rt = CanaryRuntime.create(CanaryConfig(logger=LOGGER), engine.pools(),
                              Capacities(max_batch_size=sc.MAX_BS, max_tokens=sc.MAX_TOKENS), framework="torch")
    assert rt.space.framework == "torch"
    oracle = oracle_for(engine, rt)
    drive(engine, rt, oracle)
    src, dst = [1, 2, 3], [sc.NUM_SLOTS - 4, sc.NUM_SLOTS - 3, sc.NUM_SLOTS - 2]
    for d in dst:
        engine.lut[d] = d
    rt.copy_slots(np.array(src), np.array(dst))
    oracle.copy_slots(src, dst)
    records = rt.offload(np.array([4, 5]))
    for (group, b), got in records.records.items():
        np.testing.assert_array_equal(got, _oracle_records(oracle, group, b, [4, 5]), err_msg=f"{group} {b}")
    rt.restore(records, [sc.NUM_SLOTS - 6, sc.NUM_SLOTS - 5], positions=[0, 1], prev_slots=[-1, sc.NUM_SLOTS - 6])
    oracle.copy_slots([4, 5], [sc.NUM_SLOTS - 6, sc.NUM_SLOTS - 5])
    for name, got, want in canary_records(rt, oracle):
        assert np.array_equal(np.asarray(got), want), name
