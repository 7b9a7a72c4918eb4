"""The shared argument checks at their edges, with exact messages written out by hand: an int's upper bound
itself accepted, a bool and an int of another type named, integer vectors from NumPy subclasses and beyond int64,
the memory spans of arrays with negative strides, which the overlap check compares, a read-only input, a free
axis in a shape message, a device mismatch after an absent argument, and the bytes a torch tensor's storage
guard needs."""

from __future__ import annotations

import re

import numpy as np
import pytest

import kvcanary_cupy as kc
from kvcanary_cupy._validate import (
    array_arg,
    bool_arg,
    check_memory,
    host_int_vector,
    int_arg,
    same_device,
    storage_guards,
)


def refused(message: str):
    return pytest.raises(kc.CanaryArgumentError, match="^" + re.escape("kv-canary: " + message) + "$")


def test_an_int_takes_its_bounds_themselves_and_names_a_value_of_another_type():
    assert int_arg(7, "n", minimum=7, maximum=7) == 7
    with refused("n must be <= 7, got 8"):
        int_arg(8, "n", maximum=7)
    with refused("n must be an int, got float"):
        int_arg(7.0, "n")
    with refused("flag must be a bool, got int"):
        bool_arg(1, "flag")


def test_an_integer_vector_comes_from_a_numpy_subclass_as_its_plain_values_and_stays_within_int64():
    class Tagged(np.ndarray):
        """A NumPy subclass that is nothing but its values."""

    tagged = np.array([3, 1, 2], np.int64).view(Tagged)
    got = host_int_vector(tagged, "slots")
    assert type(got) is np.ndarray and got.dtype == np.int64 and got.tolist() == [3, 1, 2]
    top = np.iinfo(np.int64).max
    assert host_int_vector(np.array([top], np.uint64), "slots").tolist() == [top]
    with refused("slots must hold integers within int64"):
        host_int_vector(np.array([0, top + 1], np.uint64), "slots")
    with refused("slots must be a 1-D integer host array, got float64 (2,)"):
        host_int_vector(np.array([1.0, 2.0]), "slots")
    # a masked array's hidden entries are not slots: refused by name, never used
    with pytest.raises(kc.CanaryArgumentError, match=r"^kv-canary: slots "):
        host_int_vector(np.ma.masked_array([1, 2], mask=[False, True]), "slots")


def test_an_array_walking_backwards_is_compared_over_the_bytes_it_really_addresses():
    buf = np.zeros(16, np.int64)
    backwards = buf[9:3:-2]  # elements 9, 7, 5: bytes 40..80 of buf
    # outputs just outside that span: elements 2..4 (bytes 16..40) and 10..11 (bytes 80..96)
    check_memory([("out", buf[2:5])], [("backwards", backwards)])
    check_memory([("out", buf[10:12])], [("backwards", backwards)])
    with refused("out overlaps backwards in memory (an input it is read with); outputs of one launch must not share "
                 "memory with each other or with the inputs"):
        check_memory([("out", buf[5:6])], [("backwards", backwards)])
    with refused("backwards overlaps out in memory (another output); outputs of one launch must not share memory "
                 "with each other or with the inputs"):
        check_memory([("out", buf[9:10]), ("backwards", backwards)])


def test_every_later_span_that_starts_inside_one_is_compared_with_it():
    buf = np.zeros(16, np.int64)
    # "wide" spans elements 0..9; "early" (1..2) does not overlap the output "late" (6..7), which still must be
    # compared with "wide"
    with refused("late overlaps wide in memory (an input it is read with); outputs of one launch must not share "
                 "memory with each other or with the inputs"):
        check_memory([("late", buf[6:8])], [("wide", buf[0:10]), ("early", buf[1:3])])


def test_an_input_may_be_read_only_and_a_free_axis_shows_as_a_star_in_the_wanted_shape():
    table = np.arange(6, dtype=np.int64).reshape(2, 3)
    table.setflags(write=False)
    assert array_arg(table, "table", dtype=np.int64, ndim=2, shape=(None, 3)) is table  # read, never written
    with refused("table is read-only; it is an output and must be writable"):
        array_arg(table, "table", dtype=np.int64, ndim=2, writable=True)
    with refused("table must have shape ('*', 4), got (2, 3) (axis 1)"):
        array_arg(table, "table", dtype=np.int64, ndim=2, shape=(None, 4))
    assert table.tolist() == [[0, 1, 2], [3, 4, 5]]


def test_an_absent_argument_does_not_end_the_device_check():
    from test_dlpack_bridge import cuda_metadata_array

    on_gpu = cuda_metadata_array((1,), np.int64)
    with refused("late is on cuda:0 but first is on cpu; all arrays of one call must share a device"):
        same_device([("first", np.zeros(1, np.int64)), ("absent", None), ("late", on_gpu)])


def test_a_storage_guard_needs_the_storage_up_to_the_last_byte_its_tensor_addresses():
    """``needed_bytes``: from the storage's start to one past the tensor's last element, worked out by hand per
    view. (A shrinking storage resize in torch also moves the data pointer, which the guard checks as well; the
    bytes are what the guard states it needs.)"""
    torch = pytest.importorskip("torch")
    base = torch.zeros(40, dtype=torch.int64)
    words = torch.zeros(10, dtype=torch.int32)
    cases = [  # (view, its element size, index of its last element in the storage)
        (base, 8, 39),  # contiguous: stride 1 reaches element 39
        (base.as_strided((3, 2), (5, 1), storage_offset=4), 8, 4 + 2 * 5 + 1),  # rows 5 apart
        (base.as_strided((1,), (1,), storage_offset=9), 8, 9),  # one element
        (base.as_strided((4, 3), (0, 7), storage_offset=2), 8, 2 + 2 * 7),  # a broadcast axis reaches nothing
        (words[2:7], 4, 6),  # 4-byte elements
    ]
    for view, itemsize, last in cases:
        (guard,) = storage_guards([("kv", view)])
        assert guard.name == "kv" and guard.needed_bytes == (last + 1) * itemsize, (tuple(view.shape), view.stride())
        guard.check()  # nothing moved
    # a tensor on the meta device has no memory to guard; the one beside it is guarded
    guards = storage_guards([("meta", torch.empty(3, device="meta")), ("kv", base)])
    assert [g.name for g in guards] == ["kv"]
