"""Canary records that travel with KV pages: gather / scatter against the scalar oracle, the host kernels
against the reference bit for bit (hostile slots and odd launch shapes included), one validation for every
backend, and the receiver's whole-prefix verify catching each way a transfer goes wrong.

The last test reruns the host-backend tests of this file under AddressSanitizer + UBSan and requires zero reports.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from differential import host_threads
from hypothesis import given, settings
from hypothesis import strategies as st
from layout_oracle import layout_slots
from transfer_cases import TransferCase, transfer_cases
from transfer_oracle import gather_records_oracle, scatter_records_oracle

import kvcanary_cupy as kc
from kvcanary_cupy.backends import resolve_backend, unavailable_reason
from kvcanary_cupy.backends.host import HOST_SHAPE
from kvcanary_cupy.backends.kernel_backend import KernelBackend
from kvcanary_cupy.dlpack import CPU
from kvcanary_cupy.transfer import ReceivedPrefixVerifier, prepare_record_transfer

SCALE = float(os.environ.get("KVCANARY_DIFFERENTIAL_SCALE", "1"))
needs_host = pytest.mark.skipif(unavailable_reason("host") is not None,
                                reason=f"host backend: {unavailable_reason('host')}")


def examples(n: int) -> int:
    return max(5, int(n * SCALE))


def gather(backend, case: TransferCase) -> tuple[np.ndarray, int]:
    out = case.records.copy()
    status = np.zeros(1, np.int32)
    launch = prepare_record_transfer(canary_buf=case.canary, records=out, slots=case.slots, status=status,
                                     records_written=True)
    impl = resolve_backend(backend, CPU, "flag") if isinstance(backend, str) else backend
    impl.gather_records(launch)
    return out, int(status[0])


def scatter(backend, case: TransferCase) -> tuple[np.ndarray, int]:
    canary = case.canary.copy()
    status = np.zeros(1, np.int32)
    launch = prepare_record_transfer(canary_buf=canary, records=case.records, slots=case.slots, status=status,
                                     records_written=False)
    impl = resolve_backend(backend, CPU, "flag") if isinstance(backend, str) else backend
    impl.scatter_records(launch)
    return canary, int(status[0])


# ---- reference against the scalar oracle --------------------------------------------------------------------


@settings(max_examples=examples(300))
@given(transfer_cases(hostile=True, distinct=False))
def test_reference_gather_matches_oracle(case):
    got, status = gather("numpy", case)
    want, want_status = gather_records_oracle(case.canary, case.slots)
    assert got.tolist() == want
    assert status == want_status


@settings(max_examples=examples(300))
@given(transfer_cases(hostile=True, distinct=True))
def test_reference_scatter_matches_oracle(case):
    got, status = scatter("numpy", case)
    want = case.canary.copy()
    want_status = scatter_records_oracle(case.records, case.slots, want)
    np.testing.assert_array_equal(got, want)
    assert status == want_status


def test_reference_scatter_applies_duplicate_slots_in_order():
    canary = np.zeros((4, 32), np.uint8)
    records = np.arange(12, dtype=np.int64).reshape(3, 4)
    kc.scatter_canary_records(records=records, slots=np.array([2, 2, 1], np.int64), canary_buf=canary,
                              backend="numpy")
    assert canary.view(np.int64)[2].tolist() == [4, 5, 6, 7]
    assert canary.view(np.int64)[1].tolist() == [8, 9, 10, 11]


def test_reference_refuses_out_of_range_slots_before_writing():
    canary = np.arange(5 * 32, dtype=np.uint8).reshape(5, 32)
    records = np.full((2, 4), 9, np.int64)
    before_canary, before_records = canary.copy(), records.copy()
    with pytest.raises(kc.CanaryArgumentError, match=r"^kv-canary: slots\[1\]=5 is outside the 5 slots"):
        kc.gather_canary_records(canary_buf=canary, slots=np.array([1, 5], np.int64), records_out=records,
                                 backend="numpy")
    with pytest.raises(kc.CanaryArgumentError, match=r"^kv-canary: slots\[0\]=-1 is outside"):
        kc.scatter_canary_records(records=records, slots=np.array([-1, 2], np.int64), canary_buf=canary,
                                  backend="numpy")
    np.testing.assert_array_equal(canary, before_canary)
    np.testing.assert_array_equal(records, before_records)


# ---- host kernels against the reference ---------------------------------------------------------------------

THREADS = (1, 2, 4)  # OS threads of a host launch

ODD_SHAPES = (
    HOST_SHAPE,
    HOST_SHAPE.__class__(**{**HOST_SHAPE.__dict__, "transfer_grid_max": 1, "transfer_block": 32}),
    HOST_SHAPE.__class__(**{**HOST_SHAPE.__dict__, "transfer_grid_max": 3, "transfer_block": 96}),
    # Many small blocks whatever the record count: the pool's OS threads interleave the most.
    HOST_SHAPE.__class__(**{**HOST_SHAPE.__dict__, "transfer_grid_max": 8, "transfer_block": 32,
                            "min_work_per_block": 0}),
)


def host_backend(shape) -> KernelBackend:
    default = resolve_backend("host", CPU)
    return default if shape == HOST_SHAPE else KernelBackend("host", default._load_module, shape)


@needs_host
@settings(max_examples=examples(150))
@given(transfer_cases(hostile=True, distinct=False), st.sampled_from(ODD_SHAPES), st.sampled_from(THREADS))
def test_host_gather_matches_reference(case, shape, n_threads):
    with host_threads(n_threads):
        got, status = gather(host_backend(shape), case)
    want, want_status = gather("numpy", case)
    np.testing.assert_array_equal(got, want)
    assert status == want_status


@needs_host
@settings(max_examples=examples(150))
@given(transfer_cases(hostile=True, distinct=True), st.sampled_from(ODD_SHAPES), st.sampled_from(THREADS))
def test_host_scatter_matches_reference(case, shape, n_threads):
    with host_threads(n_threads):
        got, status = scatter(host_backend(shape), case)
    want, want_status = scatter("numpy", case)
    np.testing.assert_array_equal(got, want)
    assert status == want_status


@needs_host
def test_host_gather_without_status_still_zeroes_records():
    canary = np.full((3, 32), 0xAB, np.uint8)
    out = np.full((2, 4), 5, np.int64)
    kc.gather_canary_records(canary_buf=canary, slots=np.array([9, 1], np.int64), records_out=out, backend="host")
    assert out[0].tolist() == [0, 0, 0, 0]
    assert (out[1] == np.frombuffer(b"\xab" * 8, np.int64)[0]).all()


# ---- one validation for every backend -----------------------------------------------------------------------

BACKENDS = ["numpy"] + (["host"] if unavailable_reason("host") is None else [])


def _bad_calls():
    canary = np.zeros((8, 32), np.uint8)
    slots = np.array([1, 2], np.int64)
    records = np.zeros((2, 4), np.int64)
    frozen = records.copy()
    frozen.flags.writeable = False
    yield "records_out must have dtype int64", "gather", dict(canary_buf=canary, slots=slots,
                                                          records_out=records.astype(np.int32))
    yield r"records_out must have shape \(2, 4\)", "gather", dict(canary_buf=canary, slots=slots,
                                                              records_out=np.zeros((3, 4), np.int64))
    yield "slots must have dtype int64", "scatter", dict(records=records, slots=slots.astype(np.int32),
                                                         canary_buf=canary)
    yield "canary_buf slot stride", "scatter", dict(records=records, slots=slots,
                                                    canary_buf=np.zeros((8, 24), np.uint8))
    # long enough but not a multiple of 8: the int64 fields of every slot after the first would be misaligned
    for stride in (33, 36, 44):
        for op, kw in (("scatter", dict(records=records, slots=slots)), ("gather", dict(slots=slots,
                                                                                       records_out=records))):
            yield (f"canary_buf slot stride must be a multiple of 8 .*got {stride} bytes", op,
                   dict(kw, canary_buf=np.zeros((8, stride), np.uint8)))
    yield "records_out must be contiguous", "gather", dict(canary_buf=canary, slots=slots,
                                                       records_out=np.zeros((2, 8), np.int64)[:, ::2])
    yield "records_out is read-only", "gather", dict(canary_buf=canary, slots=slots, records_out=frozen)
    yield "status must have dtype int32", "scatter", dict(records=records, slots=slots, canary_buf=canary,
                                                          status=np.zeros(1, np.int64))
    whole = np.zeros(8 * 32 + 64, np.uint8)
    yield "records_out overlaps canary_buf", "gather", dict(canary_buf=whole[: 8 * 32].reshape(8, 32), slots=slots,
                                                        records_out=whole[64:128].view(np.int64).reshape(2, 4))
    yield "canary_buf overlaps records", "scatter", dict(records=whole[64:128].view(np.int64).reshape(2, 4),
                                                         slots=slots, canary_buf=whole[: 8 * 32].reshape(8, 32))
    # SPEC §0.8 through the shared check: every array aligned to its elements, status an output like the rest
    raw = np.zeros(8 * 32 + 16, np.uint8)
    base = (-raw.ctypes.data) % 8
    yield "canary_buf is not aligned", "gather", dict(canary_buf=raw[base + 4: base + 4 + 8 * 32].reshape(8, 32),
                                                      slots=slots, records_out=records)
    yield "slots is not aligned", "scatter", dict(records=records, canary_buf=canary,
                                                  slots=raw[base + 4: base + 20].view(np.int64))
    yield "records_out is not aligned", "gather", dict(canary_buf=canary, slots=slots,
                                                   records_out=raw[base + 4: base + 68].view(np.int64).reshape(2, 4))
    yield "status is not aligned", "scatter", dict(records=records, slots=slots, canary_buf=canary,
                                                   status=raw[base + 2: base + 6].view(np.int32))
    yield "status overlaps slots", "gather", dict(canary_buf=canary, slots=slots, records_out=records,
                                                  status=slots.view(np.int32)[:1])
    yield "overlaps", "gather", dict(canary_buf=canary, slots=slots, records_out=records,
                                     status=records.reshape(-1).view(np.int32)[3:4])
    yield "status overlaps canary_buf", "scatter", dict(records=records, slots=slots, canary_buf=canary,
                                                        status=canary[0, :4].view(np.int32))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("message, call, kwargs", list(_bad_calls()))
def test_bad_arguments_raise_before_anything_is_written(backend, message, call, kwargs):
    before = {k: np.array(v, copy=True) for k, v in kwargs.items()}
    fn = kc.gather_canary_records if call == "gather" else kc.scatter_canary_records
    with pytest.raises(kc.CanaryArgumentError, match=f"^kv-canary: .*{message}"):
        fn(**kwargs, backend=backend)
    for k, v in kwargs.items():
        np.testing.assert_array_equal(v, before[k], err_msg=k)


# ---- the receiver's verify of a whole received prefix ---------------------------------------------------------

def _plan_bytes(verifier: ReceivedPrefixVerifier) -> list[bytes]:
    plans = (verifier.plan, verifier._write_plan)
    return [np.asarray(getattr(p, f.name)).tobytes() for p in plans for f in dataclasses.fields(p)]


def _refused_verify_keeps_the_plan(backend: str, kv: object, break_context) -> None:
    """A verify that its own checks refuse is refused before the plan launch rewrites the verifier's plan."""
    verifier = ReceivedPrefixVerifier(verify_capacity=8, max_requests=2)
    source = kc.RealKvSource(kv, page_size=1, num_bytes_per_token=32, read_bytes=32)
    ctx = kc.VerifyOrWriteContext.allocate(num_slots=32, ring_capacity=64, real_kv_sources=(source,),
                                           real_kv_hash_mode=kc.RealKvHashMode.ALL)
    rtt = np.arange(1, 17, dtype=np.int32).reshape(2, 8)
    verifier.verify(context=ctx, req_pool_indices=np.array([1], np.int64), received_lens=np.array([3], np.int64),
                    req_to_token=rtt, backend=backend, on_invalid="flag")
    before, ring = _plan_bytes(verifier), ctx.violation_ring.copy()
    bad, message = break_context(ctx)
    with pytest.raises(kc.CanaryArgumentError, match=f"^kv-canary: .*{message}"):
        # other rows and lengths: a plan launch would have changed every plan field
        verifier.verify(context=bad, req_pool_indices=np.array([0, 1], np.int64), received_lens=np.array([5, 6]),
                        req_to_token=rtt, backend=backend, on_invalid="flag")
    assert _plan_bytes(verifier) == before
    np.testing.assert_array_equal(ctx.violation_ring, ring)


@pytest.mark.parametrize("backend", BACKENDS)
def test_received_verify_with_aliased_context_outputs_leaves_the_verifier_plan_unchanged(backend):
    def alias(ctx):
        return dataclasses.replace(ctx, status=ctx.violation_write_index), "overlaps"

    _refused_verify_keeps_the_plan(backend, np.zeros((32, 32), np.uint8), alias)


@pytest.mark.parametrize("backend", BACKENDS)
def test_received_verify_after_the_kv_tensor_moved_leaves_the_verifier_plan_unchanged(backend):
    torch = pytest.importorskip("torch")
    kv = torch.zeros(32, 32, dtype=torch.uint8)

    def move(ctx):
        kv.resize_(64, 64)  # a larger storage elsewhere: the source's view would read freed memory
        return ctx, "moved or shrank"

    _refused_verify_keeps_the_plan(backend, kv, move)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("slot_args, message", [
    ({"req_pool_indices": np.array([1], np.int64)}, "one of req_to_token or layout is required"),
    ({"req_pool_indices": np.array([1], np.int64), "req_to_token": np.ones((2, 8), np.int32),
      "layout": kc.PageList(np.array([0, 1], np.int32), np.array([1], np.int32), 4)}, "both given"),
    ({"layout": kc.TokenTable(np.ones((2, 8), np.int32))}, "req_pool_indices is required with the token table"),
    ({"layout": kc.BlockTable(np.ones((2, 8), np.int32), 4)}, r"req_pool_indices is required with BlockTable"),
    ({"layout": kc.BlockTable(np.ones((2, 8), np.int32), 4, block_stride=3)}, "layout.block_stride"),
    ({"layout": kc.PageList(np.array([0, 1, 1], np.int32), np.array([1], np.int32), 4)}, "kv_page_indptr"),
    ({"layout": kc.PageList(np.array([0, 0, 0, 1], np.int32), np.array([1], np.int32), 4)},
     "received_lens holds 3 requests, more than this verifier's max_requests=2"),
])
def test_received_verify_takes_exactly_one_slot_layout_and_a_refused_one_writes_nothing(backend, slot_args, message):
    verifier = ReceivedPrefixVerifier(verify_capacity=8, max_requests=2)
    source = kc.RealKvSource(np.zeros((32, 32), np.uint8), page_size=1, num_bytes_per_token=32, read_bytes=32)
    ctx = kc.VerifyOrWriteContext.allocate(num_slots=32, ring_capacity=64, real_kv_sources=(source,),
                                           real_kv_hash_mode=kc.RealKvHashMode.ALL)
    layout = kc.PageList(np.array([0, 1], np.int32), np.array([2], np.int32), 4, num_slots=32)
    verifier.verify(context=ctx, received_lens=np.array([3], np.int64), layout=layout, backend=backend,
                    on_invalid="flag")
    assert verifier.plan.verify_slot_indices[:3].tolist() == [8, 9, 10]  # page 2 of 4 slots
    before, canary = _plan_bytes(verifier), ctx.canary_buf.copy()
    lens = np.array([5] * (3 if "max_requests" in message else 1), np.int64)
    with pytest.raises(kc.CanaryArgumentError, match=f"^kv-canary: .*{message}"):
        verifier.verify(context=ctx, received_lens=lens, backend=backend, on_invalid="flag", **slot_args)
    assert _plan_bytes(verifier) == before
    np.testing.assert_array_equal(ctx.canary_buf, canary)


PAGE_SENDER, PAGE_RECEIVER, WORDS = 4, 8, 4  # the two sides page their KV differently


@dataclass
class Side:
    """One process's canary (one TAIL buffer with real-KV sources) over a paged KV tensor."""

    kv: np.ndarray  # uint64 [pages, page_size, WORDS]
    ctx: kc.VerifyOrWriteContext
    req_to_token: np.ndarray
    pool: np.ndarray

    @classmethod
    def make(cls, num_slots: int, page: int) -> Side:
        kv = np.zeros((-(-num_slots // page), page, WORDS), np.uint64)
        source = kc.RealKvSource(kv, page_size=page, num_bytes_per_token=8 * WORDS, read_bytes=8 * WORDS)
        ctx = kc.VerifyOrWriteContext.allocate(num_slots=num_slots, ring_capacity=64, real_kv_sources=(source,),
                                               real_kv_hash_mode=kc.RealKvHashMode.ALL)
        return cls(kv, ctx, np.zeros((4, 64), np.int32), np.zeros((4, 64), np.int32))

    def kv_of(self, slots: np.ndarray) -> np.ndarray:
        page = self.kv.shape[1]
        return self.kv[slots // page, slots % page]

    def set_kv(self, slots: np.ndarray, values: np.ndarray) -> None:
        page = self.kv.shape[1]
        self.kv[slots // page, slots % page] = values


def _prefill(side: Side, slots: np.ndarray, tokens: np.ndarray, backend: str) -> None:
    n = slots.shape[0]
    side.set_kv(slots, np.random.default_rng(1).integers(0, 1 << 63, size=(n, WORDS)).astype(np.uint64))
    wp = kc.WritePlan.allocate(write_req_capacity=1)
    wp.write_offsets[:2] = [0, n]
    wp.write_seed_slot_indices[0] = -1
    wp.write_num_valid_reqs[0] = 1
    kc.launch_canary_write_kernel(context=side.ctx, plan=wp, input_ids=tokens, positions=np.arange(n, dtype=np.int64),
                                  out_cache_loc=slots, enable_write_input_assert=False, backend=backend)


RECEIVER_SLOTS = 96
BLOCK, BLOCK_STRIDE, PAGE = 4, 6, 4  # the receiver's block table (gaps between blocks) and CSR pages


def _receiver_layout(kind: str, rng: np.random.Generator, n: int) -> tuple[np.ndarray, dict, int, int]:
    """Where a receiver with slot layout ``kind`` keeps positions ``[0, n)`` of the received request: (the slots,
    from the layout oracle; the verify's slot arguments; the request's batch row; its expected-token row)."""
    if kind == "token":
        slots = (rng.permutation(RECEIVER_SLOTS - 1)[:n] + 1).astype(np.int64)
        table = np.zeros((4, 64), np.int32)
        table[2, :n] = slots
        return slots, {"req_pool_indices": np.array([2], np.int64), "req_to_token": table}, 0, 2
    if kind == "blocks":  # vLLM-style: rows picked by req_pool_indices, ids b with b * 6 + 4 <= 96
        ids = rng.permutation((RECEIVER_SLOTS - BLOCK) // BLOCK_STRIDE)[: -(-n // BLOCK)] + 1
        table = np.zeros((4, 8), np.int32)
        table[2, : ids.shape[0]] = ids
        layout = kc.BlockTable(table, BLOCK, block_stride=BLOCK_STRIDE, num_slots=RECEIVER_SLOTS)
        rows, r, pool_row, bs, args = [2], 0, 2, 1, {"req_pool_indices": np.array([2], np.int64)}
    else:  # FlashInfer-style CSR pages in batch order, behind an empty request, no req_pool_indices
        ids = rng.permutation(RECEIVER_SLOTS // PAGE - 1)[: -(-n // PAGE)] + 1
        layout = kc.PageList(np.array([0, 0, ids.shape[0]], np.int32), ids.astype(np.int32), PAGE,
                             num_slots=RECEIVER_SLOTS)
        rows, r, pool_row, bs, args = None, 1, 1, 2, {}  # the pool row is the batch row
    slots = np.array(layout_slots(layout, rows, bs, r, n), np.int64)
    return slots, {**args, "layout": layout}, r, pool_row


def _transfer(backend: str, fault: str | None, layout: str = "token") -> list[tuple[int, int]]:
    """Prefill 24 tokens on a sender, ship KV and records to a receiver with other slot numbers and another slot
    layout, verify there. Returns the (position in the request, reason bits) of every violation."""
    n = 24
    rng = np.random.default_rng(7)
    tokens = rng.integers(1, 32000, size=n).astype(np.int64)
    sender, receiver = Side.make(64, PAGE_SENDER), Side.make(RECEIVER_SLOTS, PAGE_RECEIVER)
    src_slots = (rng.permutation(63)[:n] + 1).astype(np.int64)
    dst_slots, slot_args, row, pool_row = _receiver_layout(layout, rng, n)
    _prefill(sender, src_slots, tokens, backend)
    receiver.set_kv(np.arange(1, RECEIVER_SLOTS), rng.integers(0, 1 << 63, size=(RECEIVER_SLOTS - 1, WORDS))
                    .astype(np.uint64))  # old contents

    records = np.empty((n, 4), np.int64)
    kc.gather_canary_records(canary_buf=sender.ctx.canary_buf, slots=src_slots, records_out=records, backend=backend)
    pages = sender.kv_of(src_slots).copy()  # "on the wire"
    if fault == "kv_bit_flip":
        pages[5, 1] ^= np.uint64(1 << 17)
    if fault == "record_bit_flip":
        records[9, 1] ^= 1 << 3
    if fault == "swapped":
        pages[[3, 4]] = pages[[4, 3]]
        records[[3, 4]] = records[[4, 3]]
    if fault == "swapped_page":  # the second and third 4-token pages land in each other's place
        order = np.r_[0:4, 8:12, 4:8, 12:n]
        pages, records = pages[order], records[order]
    landed = np.ones(n, bool)
    if fault == "dropped":
        landed[11] = False
    if fault == "dropped_page":
        landed[12:16] = False
    if fault == "short":
        landed[20:] = False
    receiver.set_kv(dst_slots[landed], pages[landed])
    kc.scatter_canary_records(records=records[landed], slots=dst_slots[landed], canary_buf=receiver.ctx.canary_buf,
                              backend=backend)
    pool = np.zeros((4, 64), np.int32)
    pool[pool_row, :n] = tokens
    received = np.zeros(row + 1, np.int64)
    received[row] = n
    verifier = kc.ReceivedPrefixVerifier(verify_capacity=128, max_requests=2)
    verifier.verify(context=receiver.ctx, received_lens=received, req_to_verify_expected_tokens=pool,
                    req_to_verify_expected_tokens_valid_lens=received, backend=backend, **slot_args)
    assert int(verifier.plan.enable[0]) == 1 and int(verifier.plan.verify_num_valid[0]) == n
    assert int(verifier.plan.status[0]) == 0
    np.testing.assert_array_equal(verifier.plan.verify_slot_indices[:n], dst_slots)
    report = kc.read_violations(receiver.ctx)
    slot_at = {int(s): p for p, s in enumerate(dst_slots)}
    return sorted((slot_at[v.slot], v.reason_bits) for v in report.rows)


CHAIN, POSITION, REAL_KV, TOKEN = (int(kc.FailReason.VERIFY_CHAIN_HASH_MISMATCH),
                                   int(kc.FailReason.VERIFY_POSITION_MISMATCH),
                                   int(kc.FailReason.VERIFY_REAL_KV_HASH_MISMATCH),
                                   int(kc.FailReason.VERIFY_TOKEN_MISMATCH))


@pytest.mark.parametrize("backend", BACKENDS)
def test_clean_transfer_verifies_clean_under_other_slot_numbers_and_page_size(backend):
    assert _transfer(backend, None) == []


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fault, want", [
    # (position in the request, reasons) of every violation, derived from what each fault leaves behind.
    ("kv_bit_flip", [(5, REAL_KV)]),
    ("record_bit_flip", [(9, POSITION), (10, CHAIN)]),  # field 1 is the position; the successor's chain breaks
    ("swapped", [(3, CHAIN | POSITION | TOKEN), (4, CHAIN | POSITION | TOKEN), (5, CHAIN)]),
    # A slot that received nothing keeps its old (here: never written, all-zero) record and old KV; its
    # successor's chain then starts from mix3(0, 0, 0) = 0 instead of the real hash.
    ("dropped", [(11, CHAIN | POSITION | REAL_KV | TOKEN), (12, CHAIN)]),
    # A short transfer leaves a zero tail: the first missing slot breaks the chain, every one of them the
    # position, token and real-KV checks (zero records chain to each other: mix3(0, 0, 0) = 0).
    ("short", [(20, CHAIN | POSITION | REAL_KV | TOKEN)] + [(p, POSITION | REAL_KV | TOKEN) for p in range(21, 24)]),
])
def test_each_transfer_fault_is_caught_at_the_positions_it_damaged(backend, fault, want):
    assert _transfer(backend, fault) == want


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", ["blocks", "pages"])
@pytest.mark.parametrize("fault, want", [
    (None, []),
    # Each page travels with its records, so inside a misplaced page the chain holds; its first token breaks
    # it (its predecessor is the other page's last token), as does the first token after the pair.
    ("swapped_page", [(4, CHAIN | POSITION | TOKEN), *[(p, POSITION | TOKEN) for p in (5, 6, 7)],
                      (8, CHAIN | POSITION | TOKEN), *[(p, POSITION | TOKEN) for p in (9, 10, 11)], (12, CHAIN)]),
    # A page that never landed keeps zero records (chained to each other) and old KV; its successor breaks.
    ("dropped_page", [(12, CHAIN | POSITION | REAL_KV | TOKEN),
                      *[(p, POSITION | REAL_KV | TOKEN) for p in (13, 14, 15)], (16, CHAIN)]),
])
def test_a_prefix_received_into_blocks_or_csr_pages_verifies_clean_and_page_faults_are_caught(backend, layout,
                                                                                                fault, want):
    assert _transfer(backend, fault, layout) == want


# ---- sanitizers ---------------------------------------------------------------------------------------------


@needs_host
def test_host_transfer_module_matches_the_sanitize_request():
    """In the sanitized child below this proves the transfer kernels really ran instrumented; here, that they
    did not."""
    from kvcanary_cupy.backends import host_sanitize_requested

    assert resolve_backend("host", CPU)._load_module("transfer.cu").sanitize is host_sanitize_requested()


@needs_host
def test_sanitized_host_transfer_run_has_zero_reports():
    """The host-backend tests of this file under ASan + UBSan (each a hard error): zero reports."""
    from kvcanary_cupy.hostcuda import sanitizer_preload

    preload = sanitizer_preload()
    if not Path(preload).is_file():
        pytest.skip(f"g++ has no AddressSanitizer runtime ({preload})")
    env = {**os.environ, "LD_PRELOAD": preload, "ASAN_OPTIONS": "detect_leaks=0:abort_on_error=1",
           "UBSAN_OPTIONS": "print_stacktrace=1:halt_on_error=1", "KVCANARY_HOST_SANITIZE": "1",
           "KVCANARY_DIFFERENTIAL_SCALE": "0.3", "PYTHONFAULTHANDLER": "1", "KVCANARY_HOST_THREADS": "4"}
    tests_dir = Path(__file__).parent
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:benchmark", str(Path(__file__)),
         "-k", "host and not sanitized", "--rootdir", str(tests_dir.parent)],
        env=env, cwd=tests_dir.parent, capture_output=True, text=True, timeout=900,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    assert "AddressSanitizer" not in output and "runtime error" not in output, output[-6000:]
    assert " passed" in output and "skipped" not in output.split(" passed")[-1], output[-2000:]
