"""HostViews (kvcanary_cupy.integrations.common.state): the engine integrations' NumPy views of the torch
tensors they read every step. A kept view is only ever handed back for the very tensor it was taken from while
that tensor still covers the same memory; everything else is imported afresh."""

from __future__ import annotations

import numpy as np
import pytest

from kvcanary_cupy.integrations.common.state import HostViews

torch = pytest.importorskip("torch")


def test_the_same_static_buffer_gives_the_same_view_and_it_reads_the_buffers_current_values():
    views = HostViews()
    buffer = torch.arange(6, dtype=torch.int64)
    first = views(buffer)
    buffer[2] = 40  # the engine fills its static buffer for the next step
    second = views(buffer)
    assert second is first
    np.testing.assert_array_equal(second, [0, 1, 40, 3, 4, 5])


def test_a_tensor_moved_to_other_memory_is_imported_again():
    views = HostViews()
    buffer = torch.arange(4, dtype=torch.int64)
    old = views(buffer)
    buffer.set_(torch.full((4,), 7, dtype=torch.int64))
    np.testing.assert_array_equal(views(buffer), [7, 7, 7, 7])
    np.testing.assert_array_equal(old, [0, 1, 2, 3])  # the old view still reads the old (held) storage


def test_torch_refuses_to_resize_a_buffer_under_a_kept_view():
    """The case a shape check could not catch in time (memory freed under the view) cannot happen: torch
    refuses to resize a storage that NumPy shares."""
    views = HostViews()
    buffer = torch.arange(3, dtype=torch.int64)
    kept = views(buffer)
    with pytest.raises(RuntimeError, match="not resizable"):
        buffer.resize_(5000)
    np.testing.assert_array_equal(kept, [0, 1, 2])


def test_another_tensor_object_over_the_same_memory_gets_its_own_view():
    views = HostViews()
    base = torch.arange(8, dtype=torch.int64)
    whole, head = base[:], base[:3]
    assert views(whole).shape == (8,)
    assert views(head).shape == (3,)  # same data pointer, different tensor: not the kept view of `whole`


def test_a_full_table_drops_its_oldest_half_and_every_answer_stays_right():
    views = HostViews(limit=4)
    tensors = [torch.full((2,), i, dtype=torch.int64) for i in range(10)]
    for t in tensors:
        views(t)
    assert len(views._kept) <= 4
    for i, t in enumerate(tensors):
        np.testing.assert_array_equal(views(t), [i, i])
    views.clear()
    assert views._kept == {}
