"""``CanaryRuntime.restore`` refuses, by the argument's name and before anything is written, a ``prev_slots`` or
``positions`` list of another length than ``slots`` (shorter or longer) and records of the right shape but not
int64; after every refusal the right restore still goes through and verifies clean."""

from __future__ import annotations

import re

import numpy as np
import pytest
from test_runtime import BACKENDS, runtime_arrays
from test_runtime_tiers import DST, _load_back, _offloaded

from kvcanary_cupy import CanaryArgumentError
from kvcanary_cupy.runtime import OffloadedRecords

POSITIONS, PREVS = [0, 1, 2, 3], [-1, *DST[:3]]


def _changed(before: dict[str, np.ndarray], rt) -> list[str]:
    after = runtime_arrays(rt)
    return [k for k in before if not np.array_equal(before[k], after[k])]


def _restores_clean(rt, records, engine, tier, lut) -> None:
    """The right restore after the refusals: accepted, and nothing reported (the refusals left no trace)."""
    _load_back(engine, tier, lut, DST)
    assert rt.restore(records, DST, positions=POSITIONS, prev_slots=PREVS) == 4
    report = rt.flush()
    assert report.new_violations == [] and report.status_bits == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_restore_refuses_prev_slots_and_positions_of_another_length_by_name_before_writing(backend):
    engine, rt, _, _, records, tier, lut = _offloaded(backend)
    before = runtime_arrays(rt)
    rng = np.random.default_rng(7)
    cases = []
    for length in (0, 1, 2, 3, 5, 6, 9):  # shorter and longer than the 4 restored slots
        prevs = rng.integers(-1, 64, length).tolist()
        positions = rng.integers(0, 64, length).tolist()
        cases.append(((records, DST, POSITIONS, prevs), f"prev_slots has {length} entries but slots has 4 entries"))
        cases.append(((records, DST, positions, PREVS), f"positions has {length} entries but slots has 4 entries"))
    for args, message in cases:
        with pytest.raises(CanaryArgumentError, match="^" + re.escape("kv-canary: " + message)):
            rt.restore(*args)
    assert _changed(before, rt) == []
    _restores_clean(rt, records, engine, tier, lut)


@pytest.mark.parametrize("backend", BACKENDS)
def test_restore_refuses_records_of_the_right_shape_but_not_int64_before_writing(backend):
    engine, rt, _, _, records, tier, lut = _offloaded(backend)
    before = runtime_arrays(rt)
    keys = list(records.records)
    for i, dtype in enumerate([np.int32, np.uint64, np.float64, np.int16, np.uint32, np.float32]):
        key = keys[(3 * i) % len(keys)]  # a different canary buffer's records each time
        bad = dict(records.records)
        bad[key] = records.records[key].astype(dtype)  # what a store that changed the element type gives back
        assert bad[key].shape == records.records[key].shape
        message = f"kv-canary: records.records[{key}] must be int64"
        with pytest.raises(CanaryArgumentError, match="^" + re.escape(message)):
            rt.restore(OffloadedRecords(records.model, records.count, bad), DST, positions=POSITIONS,
                       prev_slots=PREVS)
    assert _changed(before, rt) == []
    _restores_clean(rt, records, engine, tier, lut)
