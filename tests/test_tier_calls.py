"""The tier calls' arguments that the round-trip tests leave at one value: the default backend, ``status`` on the
scatter, read-only buffers on the side a call only reads, and a restore whose verify refuses after the scatter
over strided pages, and the stream a call launches on (chosen from every array it reads). Expected records and
status words are worked out by hand from the slot arithmetic."""

from __future__ import annotations

import numpy as np
import pytest
from stream_scope_recorder import RecordingStreamScope, assert_chosen_from, record_fields

import kvcanary_cupy as kc

NUM_SLOTS = 24


def canary_with_records(seed: int) -> np.ndarray:
    """A canary buffer whose slot ``s`` holds record fields ``[s, 100 + s, 200 + s, 300 + s]`` (seed: the rest)."""
    buf = np.random.default_rng(seed).integers(0, 256, size=(NUM_SLOTS, 32), dtype=np.uint8)
    fields = buf.view(np.int64)
    fields[:, :4] = np.arange(NUM_SLOTS)[:, None] + np.array([0, 100, 200, 300])
    return buf


def records_of(slots: list[int]) -> np.ndarray:
    return np.array([[s, 100 + s, 200 + s, 300 + s] for s in slots], np.int64)


@pytest.mark.parametrize("seed", range(3))
def test_offload_and_restore_run_on_the_default_backend(seed):
    canary = canary_with_records(seed)
    canary.flags.writeable = False  # offload only reads the canary buffer
    out = np.empty((4, 4), np.int64)
    # pages 1 and 3 of 2 slots, 5 apart: slots 5, 6, 15, 16
    kc.offload_canary_records(canary_buf=canary, records_out=out, pages=np.array([1, 3], np.int64), page_size=2,
                              page_stride=5)
    np.testing.assert_array_equal(out, records_of([5, 6, 15, 16]))
    target = np.zeros((NUM_SLOTS, 32), np.uint8)
    out.flags.writeable = False  # restore only reads the records
    kc.restore_canary_records(records=out, canary_buf=target, slots=np.array([2, 9, 4, 20], np.int64))
    fields = target.view(np.int64)
    np.testing.assert_array_equal(fields[[2, 9, 4, 20], :4], records_of([5, 6, 15, 16]))
    assert np.count_nonzero(fields[:, :4]) == 4 * 4  # nothing else written (every restored field is non-zero)


def test_a_scatter_flags_a_page_outside_the_buffer_in_status_and_restores_the_others():
    records = records_of([1, 2, 3, 4, 5, 6])
    target = np.zeros((NUM_SLOTS, 32), np.uint8)
    status = np.zeros(1, np.int32)
    # pages of 2 slots, 10 apart: page 0 -> slots 0, 1; page 5 -> 50, 51 (outside 24 slots); page 2 -> 20, 21
    kc.restore_canary_records(records=records, canary_buf=target, pages=np.array([0, 5, 2], np.int64), page_size=2,
                              page_stride=10, status=status, backend="numpy", on_invalid="flag")
    assert int(status[0]) == int(kc.CanaryStatus.SLOT_OUT_OF_RANGE)
    fields = target.view(np.int64)
    np.testing.assert_array_equal(fields[[0, 1, 20, 21], :4], records_of([1, 2, 5, 6]))
    assert np.count_nonzero(fields[:, :4]) == 4 * 4


def test_slots_refuse_page_size_and_page_stride_by_name():
    for extra in ({"page_size": 2}, {"page_stride": 3}):
        with pytest.raises(kc.CanaryArgumentError,
                           match=r"^kv-canary: page_size and page_stride apply to pages=, not to slots= "):
            kc.restore_canary_records(records=records_of([1]), canary_buf=np.zeros((NUM_SLOTS, 32), np.uint8),
                                      slots=np.array([3], np.int64), backend="numpy", **extra)
    with pytest.raises(kc.CanaryArgumentError, match=r"^kv-canary: pass exactly one of slots \(one slot per record\) "
                                                     r"or pages \(page ids with page_size\)$"):
        kc.offload_canary_records(canary_buf=np.zeros((NUM_SLOTS, 32), np.uint8),
                                  records_out=np.empty((1, 4), np.int64), backend="numpy")


# --- PrefixRestorer.restore over strided pages --------------------------------------------------------------

def restore_setup(seed: int):
    """A context of 24 slots holding random bytes, 4 records for pages 0 and 2 of 2 slots each 3 apart (slots
    0, 1, 6, 7), and request row 1 of a token table mapping positions 0..4 to slots 0, 1, 6, 7 and 30 (30 is
    outside the buffer: the NumPy reference's verify refuses it once the scatter has run)."""
    ctx = kc.VerifyOrWriteContext.allocate(num_slots=NUM_SLOTS, ring_capacity=16,
                                           kernel_kind=kc.CanaryLaunchTag.TAIL_K_FULL)
    ctx.canary_buf[...] = np.random.default_rng(seed).integers(0, 256, size=ctx.canary_buf.shape, dtype=np.uint8)
    records = np.arange(16, dtype=np.int64).reshape(4, 4) + 1000 * (seed + 1)
    table = np.zeros((2, 8), np.int32)
    table[1, :5] = [0, 1, 6, 7, 30]
    args = dict(records=records, restored_lens=np.array([5], np.int64), pages=np.array([0, 2], np.int64),
                page_size=2, page_stride=3, req_pool_indices=np.array([1], np.int64), req_to_token=table)
    return ctx, records, args


@pytest.mark.parametrize("seed", range(3))
def test_a_restore_whose_verify_refuses_puts_back_every_strided_row_it_scattered(seed):
    ctx, _, args = restore_setup(seed)
    before = ctx.canary_buf.copy()
    status = np.zeros(1, np.int32)
    restorer = kc.PrefixRestorer(verify_capacity=16, max_requests=1)
    with pytest.raises(kc.CanaryArgumentError,
                       match=r"^kv-canary: plan\.verify_slot_indices\[4\]=30 is outside canary_buf's 24 slots$"):
        restorer.restore(context=ctx, status=status, backend="numpy", **args)
    np.testing.assert_array_equal(ctx.canary_buf, before)
    assert int(status[0]) == 0


@pytest.mark.parametrize("seed", range(3))
def test_a_restore_refuses_a_page_past_the_buffer_before_writing(seed):
    ctx, _, args = restore_setup(seed)
    args["pages"] = np.array([0, 8], np.int64)  # page 8: rows 24, 25, just past the 24 slots
    args["req_to_token"][1, 2:4] = [24, 25]
    before = ctx.canary_buf.copy()
    restorer = kc.PrefixRestorer(verify_capacity=16, max_requests=1)
    with pytest.raises(kc.CanaryArgumentError, match=r"^kv-canary: "):
        restorer.restore(context=ctx, backend="numpy", **args)
    np.testing.assert_array_equal(ctx.canary_buf, before)


@pytest.mark.parametrize("seed", range(3))
def test_a_flagging_restore_scatters_the_pages_and_flags_what_lies_outside(seed):
    """on_invalid="flag": nothing raises; the records land at slots 0, 1, 6, 7 (page arithmetic by hand), and
    the verify of position 4 (slot 30) is flagged in status instead of refused."""
    ctx, records, args = restore_setup(seed)
    status = np.zeros(1, np.int32)
    restorer = kc.PrefixRestorer(verify_capacity=16, max_requests=1)
    restorer.restore(context=ctx, status=status, backend="numpy", on_invalid="flag", **args)
    np.testing.assert_array_equal(ctx.canary_buf.view(np.int64)[[0, 1, 6, 7], :4], records)
    assert int(ctx.status[0]) & int(kc.CanaryStatus.SLOT_OUT_OF_RANGE)


def test_restore_names_itself_when_the_expected_tokens_come_without_their_lengths():
    ctx, _, args = restore_setup(0)
    restorer = kc.PrefixRestorer(verify_capacity=16, max_requests=1)
    with pytest.raises(kc.CanaryArgumentError,
                       match=r"^kv-canary: PrefixRestorer\.restore requires req_to_verify_expected_tokens_valid_lens "
                             r"when req_to_verify_expected_tokens is set$"):
        restorer.restore(context=ctx, req_to_verify_expected_tokens=np.zeros((2, 8), np.int32), backend="numpy",
                         **args)


def test_restore_runs_on_the_default_backend():
    ctx, records, args = restore_setup(1)
    args["req_to_token"][1, 4] = 2  # a slot inside: every position verifies (their chains do not: flagged rows)
    restorer = kc.PrefixRestorer(verify_capacity=16, max_requests=1)
    restorer.restore(context=ctx, **args)
    np.testing.assert_array_equal(ctx.canary_buf.view(np.int64)[[0, 1, 6, 7], :4], records)


def test_slots_take_no_page_stride_at_all_not_even_1():
    target = np.zeros((NUM_SLOTS, 32), np.uint8)
    kc.restore_canary_records(records=records_of([7]), canary_buf=target, slots=np.array([3], np.int64),
                              backend="numpy")
    np.testing.assert_array_equal(target.view(np.int64)[3, :4], records_of([7])[0])
    for stride in (1, 2):  # a stride means pages: with slots it is refused by name, whatever its value
        before = target.copy()
        with pytest.raises(kc.CanaryArgumentError, match=r"^kv-canary: page_size and page_stride apply to pages="):
            kc.restore_canary_records(records=records_of([9]), canary_buf=target, slots=np.array([3], np.int64),
                                      page_stride=stride, backend="numpy")
        np.testing.assert_array_equal(target, before)


@pytest.mark.parametrize("seed", range(3))
def test_a_flagging_offload_gives_zero_records_for_a_page_outside_and_flags_it(seed):
    canary = canary_with_records(seed)
    out = np.full((4, 4), -7, np.int64)
    status = np.zeros(1, np.int32)
    # pages of 2 slots, 5 apart: page 2 -> slots 10, 11; page 5 -> 25, 26 (outside 24 slots)
    kc.offload_canary_records(canary_buf=canary, records_out=out, pages=np.array([2, 5], np.int64), page_size=2,
                              page_stride=5, status=status, backend="numpy", on_invalid="flag")
    np.testing.assert_array_equal(out[:2], records_of([10, 11]))
    assert not out[2:].any()
    assert int(status[0]) == int(kc.CanaryStatus.SLOT_OUT_OF_RANGE)


@pytest.mark.parametrize("seed", range(3))
def test_a_flagging_restore_flags_a_page_outside_in_the_callers_status(seed):
    ctx, records, args = restore_setup(seed)
    args["pages"] = np.array([0, 9], np.int64)  # page 9: rows 27, 28, outside the 24 slots
    args["req_to_token"][1, :5] = [0, 1, 2, 3, 4]
    status = np.zeros(1, np.int32)
    restorer = kc.PrefixRestorer(verify_capacity=16, max_requests=1)
    restorer.restore(context=ctx, status=status, backend="numpy", on_invalid="flag", **args)
    assert int(status[0]) == int(kc.CanaryStatus.SLOT_OUT_OF_RANGE)
    np.testing.assert_array_equal(ctx.canary_buf.view(np.int64)[[0, 1], :4], records[:2])


# --- the stream a tier call launches on ---------------------------------------------------------------------

@pytest.mark.parametrize("index_as", ["slots", "pages"])
def test_offload_and_restore_choose_their_stream_from_every_array_and_launch_inside_it(monkeypatch, index_as):
    canary = canary_with_records(0)
    out = np.zeros((4, 4), np.int64)
    status = np.zeros(1, np.int32)
    if index_as == "pages":  # pages 1 and 3 of 2 slots, 5 apart: slots 5, 6, 15, 16
        index = {"pages": np.array([1, 3], np.int64), "page_size": 2, "page_stride": 5}
    else:
        index = {"slots": np.array([5, 6, 15, 16], np.int64)}
    scope = RecordingStreamScope(record_fields(canary, [5, 6, 15, 16]))
    monkeypatch.setattr("kvcanary_cupy.tiers.stream_scope", scope)
    kc.offload_canary_records(canary_buf=canary, records_out=out, status=status, backend="numpy", **index)
    assert len(scope.calls) == 1
    assert_chosen_from(scope.calls[0], canary, index[index_as], out, status)
    np.testing.assert_array_equal(out, records_of([5, 6, 15, 16]))

    target = np.zeros((NUM_SLOTS, 32), np.uint8)
    if index_as == "pages":  # pages 2 and 4 of 2 slots, 3 apart: slots 6, 7, 12, 13
        index, rows = {"pages": np.array([2, 4], np.int64), "page_size": 2, "page_stride": 3}, [6, 7, 12, 13]
    else:
        index, rows = {"slots": np.array([2, 9, 4, 20], np.int64)}, [2, 9, 4, 20]
    scope = RecordingStreamScope(record_fields(target, rows))
    monkeypatch.setattr("kvcanary_cupy.tiers.stream_scope", scope)
    kc.restore_canary_records(records=out, canary_buf=target, status=status, backend="numpy", **index)
    assert len(scope.calls) == 1
    assert_chosen_from(scope.calls[0], out, index[index_as], target, status)
    (first, before), (last, after) = scope.events
    assert (first, last) == ("enter", "exit")
    assert not before.any()  # the scatter had not run when the scope was entered ...
    np.testing.assert_array_equal(after, records_of([5, 6, 15, 16]))  # ... and had when it was left


@pytest.mark.parametrize(("table_as", "index_as"),
                         [("req_to_token", "pages"), ("block_table", "pages"), ("req_to_token", "slots")])
def test_a_prefix_restore_chooses_its_stream_from_every_array_and_launches_inside_it(monkeypatch, table_as,
                                                                                        index_as):
    ctx, records, args = restore_setup(2)
    if index_as == "slots":  # the slots pages 0 and 2 (2 slots, 3 apart) stand for
        del args["pages"], args["page_size"], args["page_stride"]
        args["slots"] = np.array([0, 1, 6, 7], np.int64)
    table = args.pop("req_to_token")
    table[1, 4] = 2  # every position inside the buffer
    if table_as == "req_to_token":
        args["req_to_token"] = table
    else:  # a block table of one-slot blocks maps positions to the same slots
        args["layout"] = kc.BlockTable(block_table=table, block_size=1)
    expected = np.zeros((2, 8), np.int32)
    valid = np.zeros(1, np.int64)  # one request; no expected token to compare
    status = np.zeros(1, np.int32)
    restorer = kc.PrefixRestorer(verify_capacity=16, max_requests=1)
    scope = RecordingStreamScope(record_fields(ctx.canary_buf, [0, 1, 6, 7]))
    before_call = ctx.canary_buf.view(np.int64)[[0, 1, 6, 7], :4].copy()
    monkeypatch.setattr("kvcanary_cupy.tiers.stream_scope", scope)
    restorer.restore(context=ctx, status=status, req_to_verify_expected_tokens=expected,
                     req_to_verify_expected_tokens_valid_lens=valid, backend="numpy", on_invalid="flag", **args)
    assert len(scope.calls) == 1
    assert_chosen_from(scope.calls[0], ctx, records, args[index_as], status, restorer.plan,
                       args["req_pool_indices"], args["restored_lens"], table, expected, valid)
    (first, before), (last, after) = scope.events
    assert (first, last) == ("enter", "exit")
    np.testing.assert_array_equal(before, before_call)
    np.testing.assert_array_equal(after, records)
