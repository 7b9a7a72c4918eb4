"""Edges of the canary record gather and scatter on the NumPy reference (survivors of the mutation run,
docs/mutation.md): flagged out-of-range slots keep the status word's other bits and work without a status
word, raised ones name the operation, and the argument checks that only these calls make."""

from __future__ import annotations

import re

import numpy as np
import pytest

import kvcanary_cupy as kc
from kvcanary_cupy import CanaryStatus

OUT = int(CanaryStatus.SLOT_OUT_OF_RANGE)
OTHER = int(CanaryStatus.TOKEN_RANGE_OUT_OF_BOUNDS)


def canary(num_slots: int = 8) -> np.ndarray:
    """uint8 [num_slots, 32]: slot s holds the record (s, 10 s, 100 s, 1000 s)."""
    s = np.arange(num_slots, dtype=np.int64)[:, None]
    return np.ascontiguousarray((s * np.array([1, 10, 100, 1000], np.int64)).view(np.uint8).reshape(num_slots, 32))


def records_of(buf: np.ndarray) -> np.ndarray:
    return buf.view(np.int64).reshape(buf.shape[0], -1)[:, :4]


def test_a_flagged_gather_zeroes_outside_slots_and_keeps_the_status_words_other_bits():
    buf = canary()
    status = np.array([OTHER], np.int32)
    out = np.full((3, 4), -7, np.int64)
    kc.gather_canary_records(canary_buf=buf, slots=np.array([2, 8, -1]), records_out=out, status=status,
                             backend="numpy", on_invalid="flag")
    assert out.tolist() == [[2, 20, 200, 2000], [0, 0, 0, 0], [0, 0, 0, 0]]
    assert int(status[0]) == OTHER | OUT


def test_a_flagged_scatter_skips_outside_slots_and_keeps_the_status_words_other_bits():
    buf = canary()
    status = np.array([OTHER], np.int32)
    recs = np.array([[5, 5, 5, 5], [6, 6, 6, 6]], np.int64)
    kc.scatter_canary_records(records=recs, slots=np.array([3, 99]), canary_buf=buf, status=status,
                              backend="numpy", on_invalid="flag")
    want = records_of(canary()).copy()
    want[3] = 5
    assert np.array_equal(records_of(buf), want)
    assert int(status[0]) == OTHER | OUT


@pytest.mark.parametrize("call", ["gather", "scatter"])
def test_flagged_outside_slots_need_no_status_word(call):
    buf = canary()
    if call == "gather":
        out = np.zeros((1, 4), np.int64)
        kc.gather_canary_records(canary_buf=buf, slots=np.array([9]), records_out=out, backend="numpy",
                                 on_invalid="flag")
        assert not out.any()
    else:
        kc.scatter_canary_records(records=np.ones((1, 4), np.int64), slots=np.array([9]), canary_buf=buf,
                                  backend="numpy", on_invalid="flag")
        assert np.array_equal(buf, canary())


@pytest.mark.parametrize("call", ["gather", "scatter"])
def test_a_raised_outside_slot_names_the_operation(call):
    buf = canary()
    message = f"kv-canary: slots[1]=8 is outside the 8 slots of canary_buf ({call})"
    with pytest.raises(kc.CanaryArgumentError, match=f"^{re.escape(message)}$"):
        if call == "gather":
            kc.gather_canary_records(canary_buf=buf, slots=np.array([1, 8]), records_out=np.zeros((2, 4), np.int64),
                                     backend="numpy", on_invalid="raise")
        else:
            kc.scatter_canary_records(records=np.ones((2, 4), np.int64), slots=np.array([1, 8]), canary_buf=buf,
                                      backend="numpy", on_invalid="raise")
    assert np.array_equal(buf, canary())


def test_a_gather_reads_a_read_only_canary_buffer_and_a_scatter_refuses_one():
    buf = canary()
    buf.flags.writeable = False
    out = np.zeros((1, 4), np.int64)
    kc.gather_canary_records(canary_buf=buf, slots=np.array([4]), records_out=out, backend="numpy")
    assert out.tolist() == [[4, 40, 400, 4000]]
    with pytest.raises(kc.CanaryArgumentError, match=r"^kv-canary: canary_buf"):
        kc.scatter_canary_records(records=out, slots=np.array([4]), canary_buf=buf, backend="numpy")


def _frozen_status() -> np.ndarray:
    status = np.zeros(1, np.int32)
    status.flags.writeable = False
    return status


@pytest.mark.parametrize(("status", "message"), [(np.zeros(2, np.int32), "status must have shape (1,)"),
                                                 (_frozen_status(), "status")], ids=["two-words", "read-only"])
def test_the_status_word_is_one_writable_int32(status, message):
    with pytest.raises(kc.CanaryArgumentError, match=f"^kv-canary: {re.escape(message)}"):
        kc.gather_canary_records(canary_buf=canary(), slots=np.array([1]), records_out=np.zeros((1, 4), np.int64),
                                 status=status, backend="numpy", on_invalid="flag")


def test_a_canary_buffer_without_slots_is_refused():
    with pytest.raises(kc.CanaryArgumentError, match=r"^kv-canary: canary_buf must hold at least one slot"):
        kc.gather_canary_records(canary_buf=np.zeros((0, 32), np.uint8), slots=np.zeros(0, np.int64),
                                 records_out=np.zeros((0, 4), np.int64), backend="numpy")


def test_the_backend_defaults_to_auto():
    buf = canary()
    out = np.zeros((1, 4), np.int64)
    kc.gather_canary_records(canary_buf=buf, slots=np.array([5]), records_out=out)
    kc.scatter_canary_records(records=out, slots=np.array([6]), canary_buf=buf)
    assert records_of(buf)[6].tolist() == [5, 50, 500, 5000]

