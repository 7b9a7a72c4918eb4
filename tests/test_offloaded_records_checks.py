"""The whole-set check of carried canary records (``check_offloaded_records``), the subset taken from them
(``select_offloaded_records``) and the prefix restore's own argument names: each refusal with its exact
message, written out by hand, naming the caller's argument and what is wrong with it."""

from __future__ import annotations

import re

import numpy as np
import pytest

import kvcanary_cupy as kc
from kvcanary_cupy.runtime import OffloadedRecords
from kvcanary_cupy.tiers import check_offloaded_records, select_offloaded_records


def carried(model="m", count=3, records=None) -> OffloadedRecords:
    if records is None:
        records = {("g", 0): np.arange(4 * count, dtype=np.int64).reshape(count, 4)}
    return OffloadedRecords(model, count, records)


def refused(message: str):
    return pytest.raises(kc.CanaryArgumentError, match="^" + re.escape("kv-canary: " + message) + "$")


class NoFields:
    """An object with none of OffloadedRecords' fields."""


ROWS = np.zeros((3, 4), np.int64)
CHECK_CASES = {
    "no-fields": (NoFields(), {}, "records.model must be a str (the model it was offloaded from), got NoneType"),
    "model-int": (carried(model=5), {}, "records.model must be a str (the model it was offloaded from), got int"),
    "model-foreign": (carried(model="b"), {"models": ("a", "c")},
                      "records.model must be one of a, c, got 'b' (offloaded from another runtime)"),
    "records-list": (carried(records=[ROWS]), {},
                     "records.records must be a dict of (group, buffer index) -> int64 [count, 4] arrays, got list"),
    # each key fails one condition of (group name, buffer index) and passes the others
    "key-one-field": (carried(records={("g",): ROWS}), {},
                      "records.records has the key ('g',); keys are (group name, buffer index)"),
    "key-int-group": (carried(records={(5, 0): ROWS}), {},
                      "records.records has the key (5, 0); keys are (group name, buffer index)"),
    "key-bool-index": (carried(records={("g", True): ROWS}), {},
                       "records.records has the key ('g', True); keys are (group name, buffer index)"),
    "key-str-index": (carried(records={("g", "0"): ROWS}), {},
                      "records.records has the key ('g', '0'); keys are (group name, buffer index)"),
    "array-list": (carried(records={("g", 0): ROWS.tolist()}), {},
                   "records.records[('g', 0)] must be a NumPy host array (as offload() returned it), got list"),
    # ('g', 10) sorts before ('g', 9) by repr, after it by value: the message names the first by repr
    "extra-buffers": (carried(records={("g", 0): ROWS, ("g", 9): ROWS, ("g", 10): ROWS}), {"keys": [("g", 0)]},
                      "records hold records for canary buffer ('g', 10), which model 'm' of this runtime does not "
                      "have (offloaded from another runtime)"),
}


@pytest.mark.parametrize("case", list(CHECK_CASES), ids=list(CHECK_CASES))
def test_a_carried_record_set_is_refused_by_what_is_wrong_with_it(case):
    records, kwargs, message = CHECK_CASES[case]
    with refused(message):
        check_offloaded_records(records, **kwargs)


def test_a_whole_carried_record_set_is_accepted():
    check_offloaded_records(carried(records={("g", 0): ROWS, ("g", 1): ROWS}), models=("m",),
                            keys=[("g", 1), ("g", 0)])


def test_a_subset_names_the_record_set_and_its_index():
    with refused("OffloadedRecords.model must be a str (the model it was offloaded from), got int"):
        select_offloaded_records(carried(model=5), slice(None))
    with refused("index must be a 1-D integer host array, got int64 (1, 1)"):
        select_offloaded_records(carried(), [[1]])
    # a ragged list is no array at all: refused by name, not by NumPy
    with pytest.raises(kc.CanaryArgumentError, match=r"^kv-canary: index must be a host array \(ValueError: "):
        select_offloaded_records(carried(), [[1], [1, 2]])
    model, count, arrays = select_offloaded_records(carried(), [2, 0])
    assert (model, count) == ("m", 2)
    assert arrays[("g", 0)].tolist() == [[8, 9, 10, 11], [0, 1, 2, 3]]


def test_a_prefix_restore_names_a_context_of_another_type_and_its_restored_lens():
    restorer = kc.PrefixRestorer(verify_capacity=4, max_requests=1)
    common = dict(records=np.zeros((1, 4), np.int64), slots=np.array([1], np.int64), backend="numpy")
    with refused("context must be a VerifyOrWriteContext, got str"):
        restorer.restore(context="ctx", restored_lens=np.array([1], np.int64), **common)
    ctx = kc.VerifyOrWriteContext.allocate(num_slots=8, ring_capacity=4)
    before = ctx.canary_buf.copy()
    with refused("restored_lens must be 1-D, got shape (1, 1)"):
        restorer.restore(context=ctx, restored_lens=np.array([[1]], np.int64), req_pool_indices=np.array([1]),
                         req_to_token=np.zeros((2, 4), np.int32), **common)
    np.testing.assert_array_equal(ctx.canary_buf, before)
