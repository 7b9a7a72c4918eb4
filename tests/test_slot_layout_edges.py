"""The number of whole blocks a paged layout's ``num_slots`` holds (blocks past it are outside the buffer), worked
out by hand at its edges: fewer slots than one block, exactly one block, strided blocks, and a negative count
refused by name; and every refusal of a slot layout with its exact message (the other layout tests match a part
of each message)."""

from __future__ import annotations

import re

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


T32 = np.zeros((2, 4), np.int32)
PAGE_IDS = np.array([0], np.int32)
INDPTR = np.array([0, 1], np.int32)
REFUSALS = {
    "both": ({"req_to_token": T32, "layout": kc.TokenTable(T32)},
             "req_to_token and layout are both given; pass exactly one (req_to_token=X is layout=TokenTable(X))"),
    "neither": ({"req_to_token": None, "layout": None},
                "one of req_to_token or layout is required (TokenTable, BlockTable or PageList)"),
    "token-dtype": ({"layout": kc.TokenTable(T32.astype(np.int64))}, "req_to_token must have dtype int32, got int64"),
    "token-no-rows": ({"layout": kc.TokenTable(T32), "has_req_pool_indices": False},
                      "req_pool_indices is required with the token table (it selects req_to_token rows)"),
    "block-size": ({"layout": kc.BlockTable(T32, 0)}, "layout.block_size must be >= 1, got 0"),
    "batch-rows-type": ({"layout": kc.BlockTable(T32, 4, batch_rows=1)}, "layout.batch_rows must be a bool, got int"),
    "block-dtype": ({"layout": kc.BlockTable(T32.astype(np.int64), 4)},
                    "layout.block_table must have dtype int32, got int64"),
    "block-no-rows": ({"layout": kc.BlockTable(T32, 4), "has_req_pool_indices": False},
                      "req_pool_indices is required with BlockTable(batch_rows=False) (it selects block_table rows)"),
    "batch-rows-short": ({"layout": kc.BlockTable(T32, 4, batch_rows=True), "bs": 3},
                         "layout.block_table has 2 rows but the batch has 3 (batch_rows=True reads row r for batch "
                         "row r)"),
    "page-size": ({"layout": kc.PageList(INDPTR, PAGE_IDS, 0)}, "layout.page_size must be >= 1, got 0"),
    "indptr-type": ({"layout": kc.PageList("x", PAGE_IDS, 4)},
                    "layout.kv_page_indptr must be an array (NumPy, CuPy, or any DLPack producer such as a torch "
                    "tensor), got str"),
    "indptr-dtype": ({"layout": kc.PageList(INDPTR.astype(np.float64), PAGE_IDS, 4)},
                     "layout.kv_page_indptr must have dtype int32, got float64"),
    "indices-dtype": ({"layout": kc.PageList(INDPTR, PAGE_IDS.astype(np.int64), 4)},
                      "layout.kv_page_indices must have dtype int32, got int64"),
    "layout-type": ({"layout": "x"}, "layout must be a TokenTable, BlockTable or PageList, got str"),
}


@pytest.mark.parametrize("case", list(REFUSALS), ids=list(REFUSALS))
def test_a_slot_layout_is_refused_with_the_exact_message_naming_what_is_wrong(case):
    given, message = REFUSALS[case]
    kwargs = {"req_to_token": None, "bs": 1, "has_req_pool_indices": True, **given}
    with pytest.raises(kc.CanaryArgumentError, match="^" + re.escape("kv-canary: " + message) + "$"):
        prepare_layout(**kwargs)
