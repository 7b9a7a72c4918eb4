"""Edges of the canary record gather and scatter on the NumPy reference (survivors of the mutation run,
docs/mutation.md): flagged out-of-range slots keep the status word's other bits and work without a status
word, raised ones name the operation, the argument checks that only these calls make, and the stream each call
launches on (chosen from every array it reads); the received-prefix verifier's own argument checks."""

from __future__ import annotations

import re

import numpy as np
import pytest
from stream_scope_recorder import RecordingStreamScope, assert_chosen_from, record_fields

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



# ---- the stream each call launches on (chosen from every array it reads) -------------------------------------

def test_gather_and_scatter_choose_their_stream_from_every_array_and_launch_inside_it(monkeypatch):
    buf = canary()
    slots = np.array([3, 1, 6], np.int64)
    out = np.zeros((3, 4), np.int64)
    status = np.zeros(1, np.int32)
    scope = RecordingStreamScope(lambda: out)
    monkeypatch.setattr("kvcanary_cupy.transfer.stream_scope", scope)
    kc.gather_canary_records(canary_buf=buf, slots=slots, records_out=out, status=status, backend="numpy")
    assert len(scope.calls) == 1
    assert_chosen_from(scope.calls[0], buf, slots, out, status)
    (first, before), (last, after) = scope.events
    assert (first, last) == ("enter", "exit") and not before.any()
    assert after.tolist() == [[3, 30, 300, 3000], [1, 10, 100, 1000], [6, 60, 600, 6000]]

    target = np.zeros((8, 32), np.uint8)
    back = np.array([0, 7, 2], np.int64)
    scope = RecordingStreamScope(record_fields(target, [0, 7, 2]))
    monkeypatch.setattr("kvcanary_cupy.transfer.stream_scope", scope)
    kc.scatter_canary_records(records=out, slots=back, canary_buf=target, status=status, backend="numpy")
    assert len(scope.calls) == 1
    assert_chosen_from(scope.calls[0], out, back, target, status)
    (first, before), (last, after) = scope.events
    assert (first, last) == ("enter", "exit") and not before.any()
    np.testing.assert_array_equal(after, out)


@pytest.mark.parametrize("table_as", ["req_to_token", "req_to_token_swa", "page_list"])
def test_a_received_verify_chooses_its_stream_from_every_array_and_launches_inside_it(monkeypatch, table_as):
    ctx = kc.VerifyOrWriteContext.allocate(num_slots=32, ring_capacity=16)
    rows = np.array([1], np.int64)
    lens = np.array([3], np.int64)
    expected = np.zeros((2, 8), np.int32)
    valid = np.zeros(1, np.int64)  # no expected token to compare
    if table_as == "req_to_token":  # row 1: positions 0, 1, 2 at slots 16, 17, 18
        table = np.arange(8, 24, dtype=np.int32).reshape(2, 8)
        slot_args, arrays = {"req_to_token": table, "req_pool_indices": rows}, (table, rows)
    elif table_as == "req_to_token_swa":  # the same through a sliding window that holds all 3 positions
        table = np.arange(8, 24, dtype=np.int32).reshape(2, 8)
        lut = np.arange(32, dtype=np.int64)  # full slot s is SWA slot s
        slot_args = {"req_to_token": table, "req_pool_indices": rows, "swa_window_size": 8,
                     "full_to_swa_index_mapping": lut}
        arrays = (table, rows, lut)
    else:  # one page of 4 slots, page 2: slots 8, 9, 10
        layout = kc.PageList(np.array([0, 1], np.int32), np.array([2], np.int32), 4, num_slots=32)
        slot_args, arrays = {"layout": layout}, (layout.kv_page_indptr, layout.kv_page_indices)
    verifier = kc.ReceivedPrefixVerifier(verify_capacity=8, max_requests=2)
    verifier.plan.verify_slot_indices[...] = -1  # the plan's scratch starts uninitialised
    scope = RecordingStreamScope(lambda: verifier.plan.verify_slot_indices[:3])
    monkeypatch.setattr("kvcanary_cupy.transfer.stream_scope", scope)
    verifier.verify(context=ctx, received_lens=lens, req_to_verify_expected_tokens=expected,
                    req_to_verify_expected_tokens_valid_lens=valid, backend="numpy", on_invalid="flag", **slot_args)
    assert len(scope.calls) == 1
    assert_chosen_from(scope.calls[0], ctx, verifier.plan, lens, expected, valid, *arrays)
    (first, before), (last, after) = scope.events
    assert (first, last) == ("enter", "exit") and before.tolist() == [-1, -1, -1]  # planned inside the scope
    assert after.tolist() == ([8, 9, 10] if table_as == "page_list" else [16, 17, 18])


# ---- the received-prefix verifier's own argument checks ---------------------------------------------------------

@pytest.mark.parametrize("name", ["verify_capacity", "max_requests"])
def test_a_received_verifier_refuses_a_size_below_1_by_name_and_takes_1(name):
    sizes = {"verify_capacity": 4, "max_requests": 1}
    with pytest.raises(kc.CanaryArgumentError, match=rf"^kv-canary: {name} must be >= 1, got 0$"):
        kc.ReceivedPrefixVerifier(**{**sizes, name: 0})
    verifier = kc.ReceivedPrefixVerifier(**{**sizes, name: 1})
    ctx = kc.VerifyOrWriteContext.allocate(num_slots=32, ring_capacity=16)
    table = np.arange(8, 24, dtype=np.int32).reshape(2, 8)
    verifier.verify(context=ctx, req_pool_indices=np.array([1], np.int64), received_lens=np.array([1], np.int64),
                    req_to_token=table, backend="numpy", on_invalid="flag")
    assert int(verifier.plan.verify_num_valid[0]) == 1 and int(verifier.plan.verify_slot_indices[0]) == 16


def test_a_received_verify_takes_exactly_max_requests_requests_on_the_default_backend():
    verifier = kc.ReceivedPrefixVerifier(verify_capacity=8, max_requests=2)
    ctx = kc.VerifyOrWriteContext.allocate(num_slots=32, ring_capacity=16)
    table = np.arange(8, 32, dtype=np.int32).reshape(3, 8)  # row r: slots 8 r + 8 ...
    verifier.verify(context=ctx, req_pool_indices=np.array([2, 1], np.int64), received_lens=np.array([2, 3], np.int64),
                    req_to_token=table, on_invalid="flag")
    assert int(verifier.plan.verify_num_valid[0]) == 5
    assert verifier.plan.verify_slot_indices[:5].tolist() == [24, 25, 16, 17, 18]
    with pytest.raises(kc.CanaryArgumentError,
                       match=r"^kv-canary: req_pool_indices holds 3 requests, more than this verifier's "
                             r"max_requests=2$"):
        verifier.verify(context=ctx, req_pool_indices=np.array([1, 2, 1], np.int64),
                        received_lens=np.array([3, 3, 3], np.int64), req_to_token=table, backend="numpy")


def test_a_received_verify_names_its_batch_argument_and_itself():
    verifier = kc.ReceivedPrefixVerifier(verify_capacity=8, max_requests=2)
    ctx = kc.VerifyOrWriteContext.allocate(num_slots=32, ring_capacity=16)
    table = np.arange(8, 24, dtype=np.int32).reshape(2, 8)
    pages = kc.PageList(np.array([0, 1], np.int32), np.array([2], np.int32), 4, num_slots=32)
    cases = [
        ({"req_pool_indices": np.array([[1]]), "received_lens": np.array([3]), "req_to_token": table},
         r"req_pool_indices must be 1-D, got shape \(1, 1\)"),
        ({"received_lens": np.array([[3]]), "layout": pages}, r"received_lens must be 1-D, got shape \(1, 1\)"),
        ({"req_pool_indices": np.array([1]), "received_lens": np.array([3]), "req_to_token": table,
          "req_to_verify_expected_tokens": np.zeros((2, 8), np.int32)},
         "ReceivedPrefixVerifier.verify requires req_to_verify_expected_tokens_valid_lens when "
         "req_to_verify_expected_tokens is set"),
    ]
    for kwargs, message in cases:
        with pytest.raises(kc.CanaryArgumentError, match=f"^kv-canary: {message}$"):
            verifier.verify(context=ctx, backend="numpy", **kwargs)


# ---- pages: their size and stride, a page longer than the buffer, one-slot pages far apart ------------------

def _offload(page_size, page_stride=None, pages=(), canary_buf=None, status=None, **kwargs):
    buf = canary() if canary_buf is None else canary_buf
    out = np.full((len(pages) * page_size if isinstance(page_size, int) and page_size < 64 else 0, 4), -7, np.int64)
    kc.offload_canary_records(canary_buf=buf, records_out=out, pages=np.array(pages, np.int64), page_size=page_size,
                              page_stride=page_stride, status=status, backend="numpy", **kwargs)
    return out


@pytest.mark.parametrize(("page_size", "page_stride", "message"), [
    (0, None, "page_size must be >= 1, got 0"),
    (1 << 31, None, "page_size must be <= 2147483647, got 2147483648"),
    (2, 1, "page_stride must be >= 2, got 1"),
    (2, 1 << 31, "page_stride must be <= 2147483647, got 2147483648"),
], ids=["size-0", "size-past-int32", "stride-below-size", "stride-past-int32"])
def test_a_page_size_or_stride_out_of_bounds_is_refused_by_name(page_size, page_stride, message):
    with pytest.raises(kc.CanaryArgumentError, match="^" + re.escape("kv-canary: " + message) + "$"):
        _offload(page_size, page_stride)


@pytest.mark.parametrize("stride", [2, 3, 5])
def test_one_slot_pages_far_apart_read_slot_page_times_stride(stride):
    # pages of one slot each, `stride` slots apart, in a buffer of 16 slots (slot s holds s, 10 s, 100 s, 1000 s)
    out = _offload(1, stride, pages=[1, 0, 2], canary_buf=canary(16))
    assert out[:, 0].tolist() == [stride, 0, 2 * stride]
    target = np.zeros((16, 32), np.uint8)
    kc.restore_canary_records(records=out, canary_buf=target, pages=np.array([2, 1, 3], np.int64), page_size=1,
                              page_stride=stride, backend="numpy")
    assert records_of(target)[[2 * stride, stride, 3 * stride], 0].tolist() == [stride, 0, 2 * stride]
    assert np.count_nonzero(records_of(target)[:, 0]) == 2  # nothing else written (page 1 got record 0)


def test_a_buffer_shorter_than_one_page_holds_no_page():
    status = np.zeros(1, np.int32)
    out = _offload(4, pages=[0], canary_buf=canary(3), status=status, on_invalid="flag")  # 3 slots, a page of 4
    assert not out.any()
    assert int(status[0]) == OUT


def test_a_scatter_names_its_records_argument_records():
    with pytest.raises(kc.CanaryArgumentError, match=r"^kv-canary: records must have shape \(1, 4\), got \(1, 3\) "
                                                     r"\(axis 1\)$"):
        kc.restore_canary_records(records=np.zeros((1, 3), np.int64), canary_buf=canary(), slots=np.array([1]),
                                  backend="numpy")


def test_a_received_verify_plans_with_no_new_token_and_names_received_lens():
    verifier = kc.ReceivedPrefixVerifier(verify_capacity=16, max_requests=1)
    ctx = kc.VerifyOrWriteContext.allocate(num_slots=32, ring_capacity=16)
    table = np.arange(8, 24, dtype=np.int32).reshape(2, 8)
    rows = np.array([1], np.int64)
    # a prefix filling the whole row: nothing is planned past it (a new token would be position 8, outside)
    verifier.verify(context=ctx, req_pool_indices=rows, received_lens=np.array([8], np.int64), req_to_token=table,
                    backend="numpy")
    assert int(verifier.plan.status[0]) == 0 and int(verifier.plan.verify_num_valid[0]) == 8
    with pytest.raises(kc.CanaryArgumentError,
                       match=r"^kv-canary: received_lens\[0\]=9 reaches beyond req_to_token's row width 8$"):
        verifier.verify(context=ctx, req_pool_indices=rows, received_lens=np.array([9], np.int64),
                        req_to_token=table, backend="numpy")


def test_a_flagging_received_verify_flags_a_row_outside_the_table_in_plan_and_verify():
    verifier = kc.ReceivedPrefixVerifier(verify_capacity=16, max_requests=1)
    ctx = kc.VerifyOrWriteContext.allocate(num_slots=32, ring_capacity=16)
    table = np.arange(8, 24, dtype=np.int32).reshape(2, 8)
    verifier.verify(context=ctx, req_pool_indices=np.array([5], np.int64), received_lens=np.array([3], np.int64),
                    req_to_token=table, backend="numpy", on_invalid="flag")
    assert int(verifier.plan.status[0]) != 0
