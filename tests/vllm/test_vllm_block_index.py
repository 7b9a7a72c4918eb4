"""The sweep's block index over the KV cache groups of a hybrid model, step by step, worked out by hand: a block
one group's rows hold leaves every other group's index whichever group the step notes first (the block at the
start of its sequence and block 1 included), and block ids past the pool in a row's table (a table no engine
hands out) are ignored in every group, in and below a row's window, never an ``IndexError``; a sweep of one block
(or of none asked) takes the indexed blocks one at a time, round-robin; a decode step repeating the last step's
blocks is not indexed again (also with the forward's tokens given), a step that only moves a row's window past
a block drops it, and a single full-attention group runs no cross-group drop."""

from __future__ import annotations

import numpy as np
import pytest

from kvcanary_cupy.integrations.vllm.blocks import BlockIndex

BS = 4  # tokens per block
NUM_BLOCKS = 10


def indexed(index: BlockIndex) -> dict[int, dict[int, int]]:
    """Per group, ``{block: index in its sequence}``."""
    return {g: {int(b): int(where[b]) for b in np.flatnonzero(where >= 0)} for g, where in index.where.items()}


def two_groups() -> BlockIndex:
    return BlockIndex([NUM_BLOCKS, NUM_BLOCKS], [BS, BS], blocks_per_sweep=NUM_BLOCKS, group_ids=[0, 1])


@pytest.mark.parametrize(("holder", "taker"), [(1, 0), (0, 1)], ids=["first-takes", "second-takes"])
def test_a_block_one_group_takes_leaves_the_others_index_whichever_group_is_noted_first(holder, taker):
    """Step 0: the holder group's row writes 12 tokens into blocks 1, 2, 3 (indexed at 0, 1, 2; block 1 at the
    start of its sequence). Step 1: the taker group's row writes 8 tokens into blocks 1 and 5: both are the
    taker's now (indexed at 0, 1), and block 1 leaves the holder's index; blocks 2 and 3 stay."""
    index = two_groups()
    index.note_step(holder, np.array([[1, 2, 3]], np.int32), np.array([12]))
    assert indexed(index) == {holder: {1: 0, 2: 1, 3: 2}, taker: {}}
    index.note_step(taker, np.array([[1, 5]], np.int32), np.array([8]))
    assert indexed(index) == {holder: {2: 1, 3: 2}, taker: {1: 0, 5: 1}}


def test_a_block_past_the_pool_in_a_rows_table_is_ignored_in_every_group():
    """Group 0 (full attention) indexes blocks 1, 2. Group 1's row (16 tokens, its window from column 2 on)
    names block 10 (past the pool of 10) below its window and inside it, next to blocks 3 and 4: only those
    are taken (3 at 2, 4 at 3) and nothing else changes; group 0 noting a table with block 10 in it likewise
    indexes only its other blocks."""
    index = two_groups()
    index.note_step(0, np.array([[1, 2]], np.int32), np.array([8]))
    index.note_step(1, np.array([[10, 1, 3, 4]], np.int32), np.array([16]), first=np.array([2]))
    assert indexed(index) == {0: {1: 0, 2: 1}, 1: {3: 2, 4: 3}}
    index.note_step(1, np.array([[6, 7, 10, 8]], np.int32), np.array([16]), first=np.array([1]))
    assert indexed(index) == {0: {1: 0, 2: 1}, 1: {3: 2, 4: 3, 7: 1, 8: 3}}
    index.note_step(0, np.array([[10, 9]], np.int32), np.array([8]))
    assert indexed(index) == {0: {1: 0, 2: 1, 9: 1}, 1: {3: 2, 4: 3, 7: 1, 8: 3}}


def test_a_step_repeating_a_partly_unstamped_steps_table_and_counts_is_indexed_again():
    """One group, one row with blocks 1, 2. Step 0 stamps 8 tokens: 1 at 0, 2 at 1. Step 1 stamps only 4 (the
    row's re-stamps deferred) while the forward wrote 8, and block 2 is one another row stamps in the step: it
    keeps its index. Step 2 stamps 6 tokens: the same table, complete blocks (1) and blocks reached (2) as step
    1, but nothing left unstamped: block 2, holding two tokens now, is dropped (a step that repeats the last one
    is skipped only when the last one was indexed whole)."""
    index = BlockIndex([NUM_BLOCKS], [BS], blocks_per_sweep=NUM_BLOCKS)
    table = np.array([[1, 2]], np.int32)
    index.note_step(0, table, np.array([8]), np.array([8]))
    assert indexed(index) == {0: {1: 0, 2: 1}}
    index.note_step(0, table, np.array([4]), np.array([8]), stamped=np.array([2]))
    assert indexed(index) == {0: {1: 0, 2: 1}}
    index.note_step(0, table, np.array([6]), np.array([6]))
    assert indexed(index) == {0: {1: 0}}


@pytest.mark.parametrize("per_sweep", [0, 1], ids=["zero", "one"])
def test_a_sweep_of_one_block_takes_the_indexed_blocks_one_at_a_time_in_id_order(per_sweep):
    """Blocks 2, 5, 7 indexed (at 0, 1, 0), none held by the last step: with one block a sweep (a request for
    none still takes one), the sweeps take block 2, then 5, then 7, then 2 again, each block's slots with their
    positions."""
    index = BlockIndex([NUM_BLOCKS], [BS], blocks_per_sweep=per_sweep)
    index.where[0][[2, 5, 7]] = [0, 1, 0]
    swept = []
    for _ in range(4):
        slots, positions, _prev = index.sweep_entries(0, BS, BS)
        swept.append((slots.tolist(), positions.tolist()))
    assert swept == [([8, 9, 10, 11], [0, 1, 2, 3]), ([20, 21, 22, 23], [4, 5, 6, 7]),
                     ([28, 29, 30, 31], [0, 1, 2, 3]), ([8, 9, 10, 11], [0, 1, 2, 3])]


@pytest.mark.parametrize(("shared", "own"), [(9, 5), (3, 9), (5, 4)], ids=["shared-highest", "own-highest", "middle"])
def test_a_block_another_row_stamps_keeps_its_index_past_a_deferred_rows_stamps_whatever_its_id(shared, own):
    """One group. Row 0 stamps 12 tokens into blocks 1, 2 and ``shared`` (its twelve canary tokens, each
    stamped by row 0). Row 1, a sibling whose re-stamps the step deferred, has 8 tokens stamped and 14 written,
    into blocks 1, 2, ``shared`` and ``own``: past its two complete blocks, ``shared`` is row 0's to index (at
    2, row 0 stamps it whole) and ``own`` (no other row stamps it) is dropped, whichever of the two is the
    highest block id of the step."""
    index = BlockIndex([NUM_BLOCKS], [BS], blocks_per_sweep=NUM_BLOCKS)
    index.where[0][own] = 7  # indexed by an earlier step: the deferred row's unstamped tokens are there now
    table = np.array([[1, 2, shared, 0], [1, 2, shared, own]], np.int32)
    stamped = np.repeat(np.array([1, 2, shared]), BS)
    index.note_step(0, table, np.array([12, 8]), np.array([12, 14]), stamped=stamped,
                    stamped_rows=np.zeros(3 * BS, np.int64))
    assert indexed(index) == {0: {1: 0, 2: 1, shared: 2}}


@pytest.mark.parametrize(("shared", "own"), [(9, 5), (3, 9), (5, 4)], ids=["shared-highest", "own-highest", "middle"])
def test_a_rows_own_stamps_in_its_partly_filled_block_never_keep_that_blocks_index(shared, own):
    """Row 0 stamps 12 tokens into blocks 1, 2 and ``shared``; row 1, a drafting row (6 tokens accepted, 8
    written: its two drafts are not stamps), holds blocks 6 and ``own`` and stamps its accepted positions 4, 5
    into ``own`` in this step. Block 6 is complete (at 0); ``own``, indexed by an earlier step and stamped in
    this one only by row 1 itself, holds a block still being filled: it is dropped."""
    index = BlockIndex([NUM_BLOCKS], [BS], blocks_per_sweep=NUM_BLOCKS)
    index.where[0][own] = 1
    table = np.array([[1, 2, shared], [6, own, 0]], np.int32)
    stamped = np.array([*np.repeat([1, 2, shared], BS), own, own])
    rows = np.array([0] * 3 * BS + [1, 1])
    index.note_step(0, table, np.array([12, 6]), np.array([12, 8]), stamped=stamped, stamped_rows=rows)
    assert indexed(index) == {0: {1: 0, 2: 1, shared: 2, 6: 0}}


@pytest.mark.parametrize("written", [False, True], ids=["no-written", "written-as-stamped"])
@pytest.mark.parametrize("group", [0, 1])
def test_a_decode_step_inside_a_block_repeating_the_last_steps_blocks_is_not_indexed_again(monkeypatch, group,
                                                                                          written):
    """A row with blocks 1, 2, 3 at 10 tokens (blocks 1, 2 complete), then decode steps at 11 (the same complete
    blocks and blocks reached: the index work is skipped, the index unchanged), at 12 (block 3 completes: indexed
    again) and at 12 once more (skipped). The other group's row held blocks 1 and 5: block 1 leaves its index at
    the first step; the work that drops it runs only for the steps indexed. ``written``: the forward's tokens
    given too, as many as stamped (as the canary passes them every step): the same."""
    index = two_groups()
    if written:
        note_step = index.note_step
        index.note_step = lambda gi, table, totals: note_step(gi, table, totals, written=totals.copy())
    index.note_step(1 - group, np.array([[1, 5]], np.int32), np.array([8]))
    calls = []
    drop = BlockIndex._drop_freed_and_claimed
    monkeypatch.setattr(BlockIndex, "_drop_freed_and_claimed", lambda self, *args: calls.append(args[0]) or drop(
        self, *args))
    table = np.array([[1, 2, 3]], np.int32)
    index.note_step(group, table, np.array([10]))
    assert indexed(index) == {group: {1: 0, 2: 1}, 1 - group: {5: 1}} and calls == [group]
    index.note_step(group, table, np.array([11]))
    assert indexed(index) == {group: {1: 0, 2: 1}, 1 - group: {5: 1}} and calls == [group]
    index.note_step(group, table, np.array([12]))
    assert indexed(index) == {group: {1: 0, 2: 1, 3: 2}, 1 - group: {5: 1}} and calls == [group, group]
    index.note_step(group, table, np.array([12]))
    assert calls == [group, group]


@pytest.mark.parametrize(("window_column", "left"), [(1, {2: 1}), (2, {})], ids=["past-one-block", "past-two"])
def test_a_step_that_only_moves_a_rows_window_past_a_block_drops_that_block(window_column, left):
    """A sliding-window row with blocks 1, 2, 3 at 10 tokens, its window from column 0 (blocks 1, 2 complete,
    indexed at 0, 1); then a decode step at 11 tokens whose window starts at ``window_column`` (a window that is
    no multiple of the block size moves past a block at a step where the row completes none): the same table,
    complete blocks and blocks reached, but the blocks left below the window are freed, and leave the index."""
    index = BlockIndex([NUM_BLOCKS], [BS], blocks_per_sweep=NUM_BLOCKS)
    table = np.array([[1, 2, 3]], np.int32)
    index.note_step(0, table, np.array([10]), first=np.array([0]))
    assert indexed(index) == {0: {1: 0, 2: 1}}
    index.note_step(0, table, np.array([11]), first=np.array([window_column]))
    assert indexed(index) == {0: left}


def test_a_single_full_attention_group_runs_no_cross_group_drop(monkeypatch):
    """One full-attention group: no other group's index to drop a block from and no column below a window, so
    the step's index work never runs the drop (the index itself as worked out: blocks 1, 2 complete)."""
    calls = []
    monkeypatch.setattr(BlockIndex, "_drop_freed_and_claimed", lambda self, *args: calls.append(args))
    index = BlockIndex([NUM_BLOCKS], [BS], blocks_per_sweep=NUM_BLOCKS)
    index.note_step(0, np.array([[1, 2, 3]], np.int32), np.array([9]))
    assert indexed(index) == {0: {1: 0, 2: 1}} and calls == []
