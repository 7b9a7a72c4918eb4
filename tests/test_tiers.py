"""KV pages down a cache hierarchy and back: offload / restore of canary records in pages (any slot layout)
against the scalar oracle, the host kernels against the reference bit for bit on hostile pages and odd launch
shapes, one validation for every backend, and the restore verify (scatter + whole-prefix verify) against an
oracle composed of the scalar page scatter, the scalar layout oracle and the scalar verify.

The last test reruns the host-backend tests of this file under AddressSanitizer + UBSan and requires zero reports.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import oracle
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from layout_oracle import layout_slots
from transfer_cases import PageCase, page_cases
from transfer_oracle import offload_pages_oracle, restore_pages_oracle

import kvcanary_cupy as kc
from kvcanary_cupy.backends import resolve_backend, unavailable_reason
from kvcanary_cupy.backends.host import HOST_SHAPE
from kvcanary_cupy.backends.kernel_backend import KernelBackend
from kvcanary_cupy.dlpack import CPU
from kvcanary_cupy.transfer import prepare_record_transfer

SCALE = float(os.environ.get("KVCANARY_DIFFERENTIAL_SCALE", "1"))
needs_host = pytest.mark.skipif(unavailable_reason("host") is not None,
                                reason=f"host backend: {unavailable_reason('host')}")
BACKENDS = ["numpy"] + (["host"] if unavailable_reason("host") is None else [])


def examples(n: int) -> int:
    return max(5, int(n * SCALE))


def _launch(case: PageCase, canary: np.ndarray, records: np.ndarray, status: np.ndarray, offload: bool):
    return prepare_record_transfer(canary_buf=canary, records=records, slots=case.pages, status=status,
                                   records_written=offload, page_size=case.page_size, page_stride=case.page_stride,
                                   index_name="pages")


def offload(backend, case: PageCase) -> tuple[np.ndarray, int]:
    out, status = case.records.copy(), np.zeros(1, np.int32)
    impl = resolve_backend(backend, CPU, "flag") if isinstance(backend, str) else backend
    impl.gather_records(_launch(case, case.canary, out, status, True))
    return out, int(status[0])


def restore(backend, case: PageCase) -> tuple[np.ndarray, int]:
    canary, status = case.canary.copy(), np.zeros(1, np.int32)
    impl = resolve_backend(backend, CPU, "flag") if isinstance(backend, str) else backend
    impl.scatter_records(_launch(case, canary, case.records, status, False))
    return canary, int(status[0])


# ---- reference against the scalar oracle --------------------------------------------------------------------


@settings(max_examples=examples(300))
@given(page_cases(hostile=True, distinct=False))
def test_reference_offload_of_pages_matches_oracle(case):
    got, status = offload("numpy", case)
    want, want_status = offload_pages_oracle(case.canary, case.pages, case.page_size, case.page_stride)
    assert got.tolist() == want
    assert status == want_status


@settings(max_examples=examples(300))
@given(page_cases(hostile=True, distinct=True))
def test_reference_restore_of_pages_matches_oracle(case):
    got, status = restore("numpy", case)
    want = case.canary.copy()
    want_status = restore_pages_oracle(case.records, case.pages, case.page_size, case.page_stride, want)
    np.testing.assert_array_equal(got, want)
    assert status == want_status


def test_public_calls_move_records_by_slots_and_by_strided_blocks():
    canary = np.arange(20 * 32, dtype=np.uint8).reshape(20, 32)
    out = np.empty((6, 4), np.int64)
    # blocks of 3 slots, 5 apart: block 1 is slots 5..7, block 3 slots 15..17
    kc.offload_canary_records(canary_buf=canary, pages=np.array([3, 1], np.int64), page_size=3, page_stride=5,
                              records_out=out, backend="numpy")
    fields = canary.view(np.int64)
    np.testing.assert_array_equal(out, fields[[15, 16, 17, 5, 6, 7], :4])
    target = np.zeros_like(canary)
    kc.restore_canary_records(records=out, canary_buf=target, slots=np.array([0, 2, 4, 6, 8, 10], np.int64),
                              backend="numpy")
    np.testing.assert_array_equal(target.view(np.int64)[[0, 2, 4, 6, 8, 10], :4], out)
    assert not target.view(np.int64)[[1, 3, 5]].any()


# ---- host kernels against the reference ---------------------------------------------------------------------

ODD_SHAPES = (
    HOST_SHAPE,
    HOST_SHAPE.__class__(**{**HOST_SHAPE.__dict__, "transfer_grid_max": 1, "transfer_block": 32}),
    HOST_SHAPE.__class__(**{**HOST_SHAPE.__dict__, "transfer_grid_max": 3, "transfer_block": 96}),
)


def host_backend(shape) -> KernelBackend:
    default = resolve_backend("host", CPU)
    return default if shape == HOST_SHAPE else KernelBackend("host", default._load_module, shape)


@needs_host
@settings(max_examples=examples(150))
@given(page_cases(hostile=True, distinct=False), st.sampled_from(ODD_SHAPES))
def test_host_offload_of_pages_matches_reference(case, shape):
    got, status = offload(host_backend(shape), case)
    want, want_status = offload("numpy", case)
    np.testing.assert_array_equal(got, want)
    assert status == want_status


@needs_host
@settings(max_examples=examples(150))
@given(page_cases(hostile=True, distinct=True), st.sampled_from(ODD_SHAPES))
def test_host_restore_of_pages_matches_reference(case, shape):
    got, status = restore(host_backend(shape), case)
    want, want_status = restore("numpy", case)
    np.testing.assert_array_equal(got, want)
    assert status == want_status


# ---- one validation for every backend -----------------------------------------------------------------------


def _bad_calls():
    canary = np.zeros((16, 32), np.uint8)
    pages = np.array([1, 2], np.int64)
    records = np.zeros((8, 4), np.int64)
    yield "pass exactly one of slots", "offload", dict(canary_buf=canary, records_out=records)
    yield "pass exactly one of slots", "restore", dict(canary_buf=canary, records=records, pages=pages,
                                                       slots=pages)
    yield "page_size and page_stride apply to pages=", "offload", dict(canary_buf=canary, records_out=records,
                                                                      slots=pages, page_size=4)
    # a page stride alone with slots= would silently turn slot s into s * stride: refused by name
    for call, kw in (("offload", dict(records_out=records[:2])), ("restore", dict(records=records[:2]))):
        for stride in (2, 5, 1):
            yield "page_size and page_stride apply to pages=.*page_stride=", call, dict(
                kw, canary_buf=canary, slots=pages, page_stride=stride)
    yield "page_size must be", "offload", dict(canary_buf=canary, records_out=records, pages=pages, page_size=0)
    yield "page_stride must be", "restore", dict(canary_buf=canary, records=records, pages=pages, page_size=4,
                                                 page_stride=3)
    yield r"records_out must have shape \(8, 4\)", "offload", dict(canary_buf=canary, records_out=records[:6],
                                                              pages=pages, page_size=4)
    yield "pages must have dtype int64", "restore", dict(canary_buf=canary, records=records,
                                                         pages=pages.astype(np.int32), page_size=4)
    # a page whose last slot lies past the buffer (slots 12..15 fit, 16..19 do not): refused by the reference
    yield r"pages\[1\]=4 is outside the 16 slots", "restore", dict(canary_buf=canary, records=records,
                                                                  pages=np.array([3, 4], np.int64), page_size=4)
    whole = np.zeros(16 * 32 + 256, np.uint8)
    yield "records_out overlaps canary_buf", "offload", dict(
        canary_buf=whole[: 16 * 32].reshape(16, 32), pages=pages, page_size=4,
        records_out=whole[256:512].view(np.int64).reshape(8, 4))


# A page outside the buffer is a device value: only the reference (on_invalid="raise") refuses it; the kernels
# flag it in status (the differential tests above).
BAD_CALLS = [(b, *call) for b in BACKENDS for call in _bad_calls() if b == "numpy" or "is outside" not in call[0]]


@pytest.mark.parametrize("backend, message, call, kwargs", BAD_CALLS)
def test_bad_arguments_raise_before_anything_is_written(backend, message, call, kwargs):
    before = {k: np.array(v, copy=True) for k, v in kwargs.items()}
    fn = kc.offload_canary_records if call == "offload" else kc.restore_canary_records
    with pytest.raises(kc.CanaryArgumentError, match=f"^kv-canary: .*{message}"):
        fn(**kwargs, backend=backend)
    for k, v in kwargs.items():
        np.testing.assert_array_equal(v, before[k], err_msg=k)


# ---- offload, evict, restore into other pages, verify --------------------------------------------------------

PAGE, NUM_PAGES, WORDS = 4, 20, 4  # the device pool: 20 pages of 4 slots
STRIDES = {"token": PAGE, "blocks": 6, "csr": PAGE}  # slots between page ids (the block table leaves gaps)
NUM_SLOTS = NUM_PAGES * 6
N, RESIDENT = 24, 2  # a 6-page request whose first 2 pages stay on the device


@dataclass
class Device:
    """A device KV pool (uint64 [slots, WORDS], one real-KV source) with one canary TAIL buffer."""

    kv: np.ndarray
    ctx: kc.VerifyOrWriteContext

    @classmethod
    def make(cls) -> Device:
        kv = np.zeros((NUM_SLOTS, WORDS), np.uint64)
        source = kc.RealKvSource(kv, page_size=1, num_bytes_per_token=8 * WORDS, read_bytes=8 * WORDS)
        ctx = kc.VerifyOrWriteContext.allocate(num_slots=NUM_SLOTS, ring_capacity=128, real_kv_sources=(source,),
                                               real_kv_hash_mode=kc.RealKvHashMode.ALL,
                                               kernel_kind=kc.CanaryLaunchTag.TAIL_K_FULL)
        return cls(kv, ctx)

    def write(self, slots: np.ndarray, tokens: np.ndarray, seed: int, backend: str) -> None:
        """A forward over positions [0, n): real KV and records for ``slots``."""
        n = slots.shape[0]
        self.kv[slots] = np.random.default_rng(seed).integers(0, 1 << 63, size=(n, WORDS)).astype(np.uint64)
        wp = kc.WritePlan.allocate(write_req_capacity=1)
        wp.write_offsets[:2] = [0, n]
        wp.write_seed_slot_indices[0] = -1
        wp.write_num_valid_reqs[0] = 1
        kc.launch_canary_write_kernel(context=self.ctx, plan=wp, input_ids=tokens,
                                      positions=np.arange(n, dtype=np.int64), out_cache_loc=slots,
                                      enable_write_input_assert=False, backend=backend)


def _slots_of(kind: str, pages: np.ndarray) -> np.ndarray:
    return (pages[:, None] * STRIDES[kind] + np.arange(PAGE)).reshape(-1).astype(np.int64)


def _layout(kind: str, pages: np.ndarray) -> tuple[dict, list[int] | None, int, int, list[int]]:
    """(the restore's slot arguments for a request holding ``pages``, then for the oracle: rows, bs, batch row,
    and the slots of positions [0, N) by the scalar layout oracle, or from the token table itself)."""
    if kind == "token":
        table = np.zeros((3, 64), np.int32)
        table[2, :N] = _slots_of(kind, pages)
        return {"req_pool_indices": np.array([2], np.int64), "req_to_token": table}, [2], 1, 0, table[2, :N].tolist()
    if kind == "blocks":
        table = np.zeros((3, 8), np.int32)
        table[2, : pages.shape[0]] = pages
        layout = kc.BlockTable(table, PAGE, block_stride=STRIDES[kind], num_slots=NUM_SLOTS)
        return ({"req_pool_indices": np.array([2], np.int64), "layout": layout}, [2], 1, 0,
                layout_slots(layout, [2], 1, 0, N))
    # CSR page lists in batch order behind an empty request, no req_pool_indices
    layout = kc.PageList(np.array([0, 0, pages.shape[0]], np.int32), pages.astype(np.int32), PAGE,
                         num_slots=NUM_SLOTS)
    return {"layout": layout}, None, 2, 1, layout_slots(layout, None, 2, 1, N)


def _index_args(kind: str, pages: np.ndarray) -> dict:
    if kind == "token":
        return {"slots": _slots_of(kind, pages)}
    return {"pages": pages, "page_size": PAGE, "page_stride": STRIDES[kind]}


def _round_trip(backend: str, kind: str, fault: str | None) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """Prefill a 6-page request, offload its last 4 pages (records + KV bytes) to a host tier, let other requests
    rewrite those device pages, restore the tier copy into 4 other pages, and verify the whole prefix. Returns
    (violations as (position, reason bits), the oracle's)."""
    rng = np.random.default_rng(11)
    tokens = rng.integers(1, 32000, size=N).astype(np.int64)
    dev = Device.make()
    pages = (rng.permutation(NUM_PAGES - 1)[:6] + 1).astype(np.int64)
    dev.write(_slots_of(kind, pages), tokens, seed=1, backend=backend)
    down = pages[RESIDENT:]
    records = np.empty(((6 - RESIDENT) * PAGE, 4), np.int64)
    kc.offload_canary_records(canary_buf=dev.ctx.canary_buf, records_out=records, backend=backend,
                              **_index_args(kind, down))
    kv_copy = dev.kv[_slots_of(kind, down)].copy()
    # another prefix at the same positions, offloaded too (the tier holds both)
    other_tokens = tokens.copy()
    other_tokens[RESIDENT * PAGE - 1] += 1
    other = Device.make()
    other.write(_slots_of(kind, pages), other_tokens, seed=2, backend=backend)
    other_records = np.empty_like(records)
    kc.offload_canary_records(canary_buf=other.ctx.canary_buf, records_out=other_records, backend=backend,
                              **_index_args(kind, down))
    other_kv = other.kv[_slots_of(kind, down)].copy()
    # the device pages are reused by someone else
    dev.write(_slots_of(kind, down), rng.integers(1, 32000, size=down.shape[0] * PAGE), seed=3, backend=backend)
    dev.ctx.violation_ring[...] = 0
    dev.ctx.violation_write_index[...] = 0

    free = np.setdiff1d(np.arange(1, NUM_PAGES), pages)
    new = rng.permutation(free)[: down.shape[0]].astype(np.int64)
    into = new.copy()
    if fault == "kv_bit_rot":
        kv_copy[5, 2] ^= np.uint64(1 << 40)
    if fault == "record_bit_rot":
        records[9, 0] ^= 1 << 4  # a token
    if fault == "other_prefix":  # the tier answers the page lookup with the other prefix's first page
        records[:PAGE], kv_copy[:PAGE] = other_records[:PAGE], other_kv[:PAGE]
    if fault == "wrong_slots":  # the restored pages land in each other's place; the table says otherwise
        into[[1, 2]] = into[[2, 1]]
    if fault == "torn":  # the last page never arrived (a short read): its slots keep what they held
        pass
    landed = slice(0, (down.shape[0] - (1 if fault == "torn" else 0)) * PAGE)
    dev.kv[_slots_of(kind, into)[landed]] = kv_copy[landed]
    table_pages = np.concatenate([pages[:RESIDENT], new])
    slot_args, rps, bs, r, slots = _layout(kind, table_pages)
    pool = np.zeros((3, 64), np.int32)
    pool[r if rps is None else rps[r], :N] = tokens  # a row-less layout reads the pool by batch row
    lens = np.zeros(bs, np.int64)
    lens[r] = N
    restore_into = into if fault != "torn" else into[:-1]
    restore_records = records[landed]

    # the oracle: scalar page scatter, then the scalar verify of every position through the scalar layout
    state_canary = dev.ctx.canary_buf.copy()
    restore_pages_oracle(restore_records, restore_into, PAGE, STRIDES[kind], state_canary)
    state = oracle.CanaryState.from_arrays(state_canary, dev.ctx.violation_ring)
    oracle.verify_oracle(state, kernel_kind=int(kc.CanaryLaunchTag.TAIL_K_FULL), verify_slot_indices=slots,
                         verify_expected_tokens=tokens.tolist(), verify_expected_positions=list(range(N)),
                         verify_prev_slot_indices=[-1, *slots[:-1]], verify_num_valid=N, enable=1,
                         check_verify_expected_token=True,
                         sources=[(dev.kv.view(np.uint8).reshape(NUM_SLOTS, -1), 1, 8 * WORDS, 8 * WORDS)],
                         mode=int(kc.RealKvHashMode.ALL))
    at = {s: p for p, s in enumerate(slots)}
    want = sorted((at[row[1]], row[7]) for row in state.rows)

    restorer = kc.PrefixRestorer(verify_capacity=64, max_requests=2)
    index = _index_args(kind, restore_into)
    restorer.restore(context=dev.ctx, records=restore_records, restored_lens=lens, req_to_verify_expected_tokens=pool,
                     req_to_verify_expected_tokens_valid_lens=lens, backend=backend, **index, **slot_args)
    got = sorted((at[v.slot], v.reason_bits) for v in kc.read_violations(dev.ctx).rows)
    np.testing.assert_array_equal(dev.ctx.canary_buf, state.to_canary_array())
    return got, want


FAULTS = [None, "kv_bit_rot", "record_bit_rot", "other_prefix", "wrong_slots", "torn"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["token", "blocks", "csr"])
@pytest.mark.parametrize("fault", FAULTS)
def test_restored_prefix_verifies_as_the_oracle_says_and_every_fault_is_caught(backend, kind, fault):
    got, want = _round_trip(backend, kind, fault)
    assert got == want
    if fault is None:
        assert got == []
    else:  # caught, and only at restored positions or the one right after a damaged one
        assert got and all(p >= RESIDENT * PAGE for p, _ in got)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_refused_restore_leaves_canary_ring_and_status_unchanged(backend):
    dev = Device.make()
    records = np.ones((8, 4), np.int64)
    status = np.zeros(1, np.int32)
    restorer = kc.PrefixRestorer(verify_capacity=64, max_requests=2)
    canary, ring = dev.ctx.canary_buf.copy(), dev.ctx.violation_ring.copy()
    table = np.zeros((3, 64), np.int32)
    with pytest.raises(kc.CanaryArgumentError, match=r"^kv-canary: .*req_pool_indices"):  # a row-less token table
        restorer.restore(context=dev.ctx, records=records, restored_lens=np.array([8], np.int64),
                         slots=np.arange(8, 16, dtype=np.int64), req_to_token=table, status=status, backend=backend)
    with pytest.raises(kc.CanaryArgumentError, match=r"^kv-canary: .*records must have shape \(4, 4\)"):
        restorer.restore(context=dev.ctx, records=records, restored_lens=np.array([8], np.int64),
                         slots=np.arange(8, 12, dtype=np.int64), req_to_token=table,
                         req_pool_indices=np.array([1], np.int64), backend=backend)
    np.testing.assert_array_equal(dev.ctx.canary_buf, canary)
    np.testing.assert_array_equal(dev.ctx.violation_ring, ring)
    assert int(status[0]) == 0


def _refused_by_its_verify(seed: int) -> tuple[dict, np.ndarray, np.ndarray]:
    """A restore of random records into random pages (``page_stride`` >= ``page_size``, gaps between pages) whose
    scatter is valid and whose verify then refuses: the slot table sends one restored position to a slot past
    the canary buffer, which only the verify reads. Returns (restore arguments, the records, the slots the
    scatter writes, by the hand formula slot = page * page_stride + j)."""
    rng = np.random.default_rng(seed)
    size = int(rng.integers(1, 5))
    stride = size + int(rng.integers(0, 4))
    count = int(rng.integers(1, 4))
    num_slots = stride * 8
    pages = (rng.permutation(7)[:count] + 1).astype(np.int64)  # distinct pages, all inside the buffer
    written = np.array([p * stride + j for p in pages for j in range(size)], np.int64)
    source_kv = rng.integers(0, 256, size=(num_slots, 32), dtype=np.uint8)
    source = kc.RealKvSource(source_kv, page_size=1, num_bytes_per_token=32, read_bytes=32)
    ctx = kc.VerifyOrWriteContext.allocate(num_slots=num_slots, ring_capacity=16, slot_stride_bytes=40,
                                           real_kv_sources=(source,), real_kv_hash_mode=kc.RealKvHashMode.ALL)
    ctx.canary_buf[...] = rng.integers(0, 256, size=ctx.canary_buf.shape, dtype=np.uint8)
    records = rng.integers(-(2**62), 2**62, size=(written.shape[0], 4), dtype=np.int64)
    table = np.zeros((2, 64), np.int32)
    table[1, : written.shape[0]] = written
    table[1, int(rng.integers(0, written.shape[0]))] = num_slots + int(rng.integers(0, 50))  # past the buffer
    lens = np.array([written.shape[0]], np.int64)
    args = dict(context=ctx, records=records, pages=pages, page_size=size, page_stride=stride, restored_lens=lens,
                req_pool_indices=np.array([1], np.int64), req_to_token=table, status=np.zeros(1, np.int32))
    return args, records, written


def test_a_restore_refused_by_its_verify_puts_back_exactly_the_rows_it_scattered():
    """The NumPy reference refuses a slot past the buffer only in the verify, after the scatter wrote the
    restored rows: the undo must cover those rows (pages * page_stride + j, not pages * page_size + j) and leave
    the canary buffer, the ring and status as they were, byte for byte, on every seed."""
    for seed in range(60):
        args, records, written = _refused_by_its_verify(seed)
        ctx = args["context"]
        before = [a.copy() for a in (ctx.canary_buf, ctx.violation_ring, ctx.violation_write_index, ctx.status,
                                     args["status"])]
        # what the scatter writes when nothing refuses: the hand formula's rows, each row's 4 fields
        scattered = ctx.canary_buf.copy()
        kc.restore_canary_records(records=records, canary_buf=scattered, pages=args["pages"],
                                  page_size=args["page_size"], page_stride=args["page_stride"], backend="numpy")
        changed = np.flatnonzero((scattered != ctx.canary_buf).any(axis=1))
        assert set(changed) <= set(written.tolist()), seed  # the scatter writes only the hand formula's rows
        np.testing.assert_array_equal(scattered[written, :32].view(np.int64), records)
        refusal = r"^kv-canary: plan\.verify_slot_indices\[\d+\]=\d+ is outside"  # the verify's, after the scatter
        with pytest.raises(kc.CanaryArgumentError, match=refusal):
            kc.PrefixRestorer(verify_capacity=64, max_requests=2).restore(**args, backend="numpy")
        after = [ctx.canary_buf, ctx.violation_ring, ctx.violation_write_index, ctx.status, args["status"]]
        for name, a, b in zip(("canary_buf", "ring", "write index", "context status", "status"), before, after,
                              strict=True):
            assert a.tobytes() == b.tobytes(), f"seed {seed}: a refused restore changed {name}"


def test_offload_and_prefix_restore_name_the_callers_arguments():
    """offload_canary_records names its output records_out (the name the caller used), and a restore names its
    context's canary buffer context.canary_buf; nothing is written."""
    canary = np.zeros((16, 32), np.uint8)
    pages = np.array([1, 2], np.int64)
    for bad, words in ((np.zeros((8, 4), np.int32), "records_out must have dtype int64"),
                       (np.zeros((8, 4), np.int64)[::-1], "records_out must be contiguous"),
                       ([[0] * 4] * 8, "records_out must be an array")):
        with pytest.raises(kc.CanaryArgumentError, match=f"^kv-canary: {words}"):
            kc.offload_canary_records(canary_buf=canary, records_out=bad, pages=pages, page_size=4)
    ctx = kc.VerifyOrWriteContext.allocate(num_slots=16)
    for bad_buf, words in ((np.zeros((16, 24), np.uint8), r"context\.canary_buf slot stride"),
                           (np.zeros((16, 32), np.int8), r"context\.canary_buf must have dtype uint8")):
        with pytest.raises(kc.CanaryArgumentError, match=f"^kv-canary: {words}"):
            kc.PrefixRestorer(verify_capacity=8, max_requests=1).restore(
                context=ctx.for_endpoint(canary_buf=bad_buf), records=np.zeros((8, 4), np.int64), pages=pages,
                page_size=4, restored_lens=np.array([8], np.int64), req_pool_indices=np.array([0], np.int64),
                req_to_token=np.zeros((1, 8), np.int32))
        assert not bad_buf.any()
    with pytest.raises(kc.CanaryArgumentError, match=r"^kv-canary: context must be a VerifyOrWriteContext"):
        kc.PrefixRestorer(verify_capacity=8, max_requests=1).restore(
            context=canary, records=np.zeros((8, 4), np.int64), pages=pages, page_size=4,
            restored_lens=np.array([8], np.int64))


# ---- sanitizers ---------------------------------------------------------------------------------------------


@needs_host
def test_sanitized_host_tier_run_has_zero_reports():
    """The host-backend tests of this file under ASan + UBSan (each a hard error): zero reports."""
    from kvcanary_cupy.hostcuda import sanitizer_preload

    preload = sanitizer_preload()
    if not Path(preload).is_file():
        pytest.skip(f"g++ has no AddressSanitizer runtime ({preload})")
    env = {**os.environ, "LD_PRELOAD": preload, "ASAN_OPTIONS": "detect_leaks=0:abort_on_error=1",
           "UBSAN_OPTIONS": "print_stacktrace=1:halt_on_error=1", "KVCANARY_HOST_SANITIZE": "1",
           "KVCANARY_DIFFERENTIAL_SCALE": "0.3", "PYTHONFAULTHANDLER": "1"}
    tests_dir = Path(__file__).parent
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:benchmark", str(Path(__file__)),
         "-k", "host and not sanitized", "--rootdir", str(tests_dir.parent)],
        env=env, cwd=tests_dir.parent, capture_output=True, text=True, timeout=900,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    assert "AddressSanitizer" not in output and "runtime error" not in output, output[-6000:]
    assert " passed" in output, output[-2000:]
