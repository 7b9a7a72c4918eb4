"""The number of whole blocks a paged layout's ``num_slots`` holds (blocks past it are outside the buffer), worked
out by hand at its edges: fewer slots than one block, exactly one block, strided blocks, and a negative count
refused by name."""

from __future__ import annotations

import numpy as np
import pytest

import kvcanary_cupy as kc
from kvcanary_cupy.layouts import prepare_layout

TABLE = np.zeros((2, 4), np.int32)


@pytest.mark.parametrize(("num_slots", "block_size", "block_stride", "blocks"), [
    (0, 4, None, 0),
    (3, 4, None, 0),  # fewer slots than one block: no whole block
    (4, 4, None, 1),  # exactly one block
    (7, 4, None, 1),
    (8, 4, None, 2),
    (9, 4, 5, 2),  # blocks 0 (slots 0-3) and 1 (slots 5-8), 5 apart
    (8, 4, 5, 1),  # block 1 would end at slot 8: outside
], ids=["empty", "under-one-block", "one-block", "one-block-and-a-bit", "two-blocks", "strided-two",
        "strided-one"])
def test_a_block_table_holds_the_whole_blocks_of_its_num_slots(num_slots, block_size, block_stride, blocks):
    layout = kc.BlockTable(TABLE, block_size, block_stride=block_stride, num_slots=num_slots)
    kind, value, _ = prepare_layout(req_to_token=None, layout=layout, bs=1, has_req_pool_indices=True)
    assert kind == "paged"
    assert value.num_blocks == blocks and isinstance(value.num_blocks, int)


@pytest.mark.parametrize(("num_slots", "pages"), [(3, 0), (4, 1), (11, 2), (12, 3)], ids=["3", "4", "11", "12"])
def test_a_page_list_holds_the_whole_pages_of_its_num_slots(num_slots, pages):
    layout = kc.PageList(np.array([0, 1], np.int32), np.array([0], np.int32), 4, num_slots=num_slots)
    _, value, _ = prepare_layout(req_to_token=None, layout=layout, bs=1, has_req_pool_indices=False)
    assert value.num_blocks == pages


def test_a_negative_num_slots_is_refused_by_name():
    with pytest.raises(kc.CanaryArgumentError, match=r"^kv-canary: layout\.num_slots must be >= 0, got -1$"):
        prepare_layout(req_to_token=None, layout=kc.BlockTable(TABLE, 4, num_slots=-1), bs=1,
                       has_req_pool_indices=True)
