"""Write, verify and scatter on small exact cases (SPEC §8 items 21–39), on every CPU backend.

Hash values come from SPEC §2's published vectors or from the independent scalar oracle's hash functions.
"""

from __future__ import annotations

import numpy as np
import pytest
from chain_helpers import ANCHOR_HASH_SIGNED, context, fields, rows, verify, verify_plan, write
from oracle import fold_source_bytes, mix3, splitmix64, to_i64, to_u64

import kvcanary_cupy as kc
from kvcanary_cupy.backends import unavailable_reason

R = kc.FailReason
CPU_BACKENDS = [
    "numpy",
    pytest.param("host", marks=pytest.mark.skipif(unavailable_reason("host") is not None,
                                                  reason=f"host backend: {unavailable_reason('host')}")),
]
pytestmark = pytest.mark.parametrize("backend", CPU_BACKENDS)

# SPEC §2.2: the chain from the anchor with tokens 101..505 at positions 0..4.
CHAIN_TOKENS = [101, 202, 303, 404, 505]
CHAIN_PREV_HASHES = [0xDE7FAE23A9A1B716, 0x542FE5061275A6AB, 0x9890D56BDE53142E, 0x5213C65EEE8A1DD1,
                     0xC749AFFE5A5A9634]


def write_chain(ctx, slots, tokens, start_pos=0, seed=-1, backend="numpy", **kwargs):
    positions = list(range(start_pos, start_pos + len(slots)))
    write(ctx, [len(slots)], [seed], slots, tokens, positions, backend=backend, **kwargs)
    return positions


def verify_chain(ctx, slots, positions, seed=-1, backend="numpy", **kwargs):
    prevs = [seed, *slots[:-1]]
    verify(ctx, slots, positions, prevs, backend=backend, **kwargs)


# --- write ------------------------------------------------------------------------------------------------

def test_five_step_chain_matches_the_published_hashes(backend):
    ctx = context()
    write_chain(ctx, [3, 4, 5, 6, 7], CHAIN_TOKENS, backend=backend)
    f = fields(ctx)
    assert [to_u64(int(v)) for v in f[3:8, 2]] == CHAIN_PREV_HASHES
    assert f[3:8, 0].tolist() == CHAIN_TOKENS
    assert f[3:8, 1].tolist() == [0, 1, 2, 3, 4]
    assert f[3:8, 3].tolist() == [0] * 5  # no sources: no real-KV fingerprint
    assert int(ctx.slot_run_counter[0]) == 5 and int(ctx.kernel_run_counter[0]) == 1


def test_seeded_write_continues_the_chain_and_verifies_clean(backend):
    ctx = context()
    write_chain(ctx, [3, 4], CHAIN_TOKENS[:2], backend=backend)
    write_chain(ctx, [9, 10, 11], CHAIN_TOKENS[2:], start_pos=2, seed=4, backend=backend)
    f = fields(ctx)
    assert [to_u64(int(v)) for v in f[[3, 4, 9, 10, 11], 2]] == CHAIN_PREV_HASHES
    verify_chain(ctx, [3, 4, 9, 10, 11], [0, 1, 2, 3, 4], backend=backend)
    assert rows(ctx) == []


def test_real_kv_hash_never_enters_the_chain(backend):
    kv = np.zeros((64, 16), np.uint8)
    kv[:, 0] = np.arange(64)  # distinct bytes per slot
    source = kc.RealKvSource(kv, page_size=1, num_bytes_per_token=16, read_bytes=16)
    ctx = context(real_kv_sources=(source,), real_kv_hash_mode=kc.RealKvHashMode.ALL)
    write_chain(ctx, [3, 4, 5, 6, 7], CHAIN_TOKENS, backend=backend)
    assert [to_u64(int(v)) for v in fields(ctx)[3:8, 2]] == CHAIN_PREV_HASHES
    assert all(int(v) != 0 for v in fields(ctx)[3:8, 3])


def test_input_assert_equal_inputs_emit_nothing(backend):
    ctx = context()
    write_chain(ctx, [1, 2, 3], [7, 8, 9], backend=backend, expected=([7, 8, 9], [0, 1, 2]))
    assert rows(ctx) == []


@pytest.mark.parametrize("where", [0, 1, 2])
def test_input_assert_token_mismatch_sets_only_the_token_bit(backend, where):
    ctx = context()
    expected_tokens = [7, 8, 9]
    expected_tokens[where] = 70
    write_chain(ctx, [1, 2, 3], [7, 8, 9], backend=backend, expected=(expected_tokens, [0, 1, 2]))
    running = ANCHOR_HASH_SIGNED if where == 0 else int(fields(ctx)[1 + where, 2])
    assert rows(ctx) == [[0, 1 + where, where, [7, 8, 9][where], 70, running, where, R.WRITE_TOKEN_MISMATCH]]
    assert fields(ctx)[1:4, 0].tolist() == [7, 8, 9]  # actual values stored


def test_input_assert_position_mismatch_sets_only_the_position_bit(backend):
    ctx = context()
    write_chain(ctx, [1, 2, 3], [7, 8, 9], backend=backend, expected=([7, 8, 9], [0, 5, 2]))
    (row,) = rows(ctx)
    assert row[1] == 2 and row[2] == 1 and row[6] == 5 and row[7] == R.WRITE_POSITION_MISMATCH


def test_all_mismatching_inputs_give_one_row_each_and_a_clean_downstream_verify(backend):
    ctx = context()
    write_chain(ctx, [1, 2, 3], [7, 8, 9], backend=backend, expected=([0, 0, 0], [9, 9, 9]))
    assert [r[7] for r in rows(ctx)] == [R.WRITE_TOKEN_MISMATCH | R.WRITE_POSITION_MISMATCH] * 3
    verify_chain(ctx, [1, 2, 3], [0, 1, 2], backend=backend)
    assert len(rows(ctx)) == 3  # the chain advanced on the actual values: nothing new


def test_expected_tensors_must_match_the_assert_flag(backend):
    ctx = context()
    wp = kc.WritePlan.allocate(write_req_capacity=1)
    one = np.zeros(1, np.int64)
    with pytest.raises(ValueError, match=r"^kv-canary: expected_input_tokens and expected_input_positions "
                                         "must be None"):
        kc.launch_canary_write_kernel(context=ctx, plan=wp, input_ids=one, positions=one, out_cache_loc=one,
                                      enable_write_input_assert=False, expected_input_tokens=one,
                                      expected_input_positions=one, backend=backend)
    with pytest.raises(ValueError, match="are required when enable_write_input_assert=True"):
        kc.launch_canary_write_kernel(context=ctx, plan=wp, input_ids=one, positions=one, out_cache_loc=one,
                                      enable_write_input_assert=True, backend=backend)
    assert int(ctx.kernel_run_counter[0]) == 0


def test_negative_slots_are_skipped_and_slot_zero_is_written(backend):
    ctx = context()
    write(ctx, [3], [-1], [0, -1, 5], [11, 12, 13], [0, 1, 2], backend=backend)
    f = fields(ctx)
    assert f[0, :2].tolist() == [11, 0]
    assert f[5, :2].tolist() == [13, 2]
    # the skipped entry neither stored nor advanced the chain: slot 5 chains directly from slot 0
    assert to_u64(int(f[5, 2])) == mix3(to_u64(int(f[0, 2])), 11, 0)
    assert int(ctx.slot_run_counter[0]) == 2


def test_requests_beyond_write_num_valid_reqs_do_nothing(backend):
    ctx = context()
    wp_counts = [1, 1, 1]
    wp = __import__("chain_helpers").write_plan(wp_counts, [-1, -1, -1])
    wp.write_num_valid_reqs[0] = 2
    kc.launch_canary_write_kernel(context=ctx, plan=wp, input_ids=np.array([1, 2, 3], np.int64),
                                  positions=np.zeros(3, np.int64), out_cache_loc=np.array([4, 5, 6], np.int64),
                                  enable_write_input_assert=False, backend=backend)
    assert fields(ctx)[[4, 5, 6], 0].tolist() == [1, 2, 0]
    assert int(ctx.slot_run_counter[0]) == 2


@pytest.mark.parametrize("mode", [kc.RealKvHashMode.PARTIAL, kc.RealKvHashMode.ALL])
def test_published_real_kv_vector(backend, mode):
    kv = np.zeros((8, 32), np.uint8)
    kv[2, :16] = [0x01, 0x02, 0x04, 0x08, 0x10, 0x20, 0x40, 0x80, 0x81, 0x82, 0x84, 0x88, 0x90, 0xA0, 0xC0, 0xFF]
    source = kc.RealKvSource(kv, page_size=1, num_bytes_per_token=16, read_bytes=16)
    ctx = context(num_slots=8, real_kv_sources=(source,), real_kv_hash_mode=mode)
    write_chain(ctx, [2], [5], backend=backend)
    assert to_u64(int(fields(ctx)[2, 3])) == 0x6041580849E6407D


def test_none_mode_stores_zero_even_with_sources(backend):
    kv = np.full((8, 16), 0xAB, np.uint8)
    source = kc.RealKvSource(kv, page_size=1, num_bytes_per_token=16, read_bytes=16)
    ctx = context(num_slots=8, real_kv_sources=(source,), real_kv_hash_mode=kc.RealKvHashMode.NONE)
    write_chain(ctx, [2, 3], [5, 6], backend=backend)
    assert fields(ctx)[2:4, 3].tolist() == [0, 0]


def _expected_rkv(slot, sources, mode):
    total = 0
    for data, page, per_token, read in sources:
        row = data[slot // page]
        start = (slot % page) * per_token
        nbytes = 16 if mode == kc.RealKvHashMode.PARTIAL else read
        total = splitmix64(total ^ fold_source_bytes(bytes(row[start : start + nbytes]), nbytes))
    return to_i64(total)


@pytest.mark.parametrize("num_sources", [1, 2, 3, 4])
def test_multiple_paged_sources_fold_in_order(backend, num_sources):
    rng = np.random.default_rng(num_sources)
    specs = [(16, 48, 32), (4, 32, 32), (1, 64, 48), (2, 16, 16)][:num_sources]
    sources, raw = [], []
    for page, per_token, read in specs:
        data = rng.integers(0, 256, size=(64 // page + 1, page * per_token + 16), dtype=np.uint8)
        sources.append(kc.RealKvSource(data, page_size=page, num_bytes_per_token=per_token, read_bytes=read))
        raw.append((data, page, per_token, read))
    ctx = context(num_slots=64, real_kv_sources=tuple(sources), real_kv_hash_mode=kc.RealKvHashMode.ALL)
    slots = [1, 15, 16, 17, 63]  # page boundaries of the page-16 source
    write_chain(ctx, slots, [1, 2, 3, 4, 5], backend=backend)
    assert fields(ctx)[slots, 3].tolist() == [_expected_rkv(s, raw, kc.RealKvHashMode.ALL) for s in slots]
    if num_sources > 1:  # order matters
        assert _expected_rkv(1, raw, 2) != _expected_rkv(1, raw[::-1], 2)


def test_kernel_counter_bumps_even_for_an_empty_plan(backend):
    ctx = context()
    write(ctx, [], [], [], [], [], backend=backend)
    assert int(ctx.kernel_run_counter[0]) == 1 and int(ctx.slot_run_counter[0]) == 0
    assert not fields(ctx).any()


@pytest.mark.parametrize("token", [0, 1, 0xFFFFFFFF, -1, 0x80000000, 0x7FFFFFFF, -(1 << 63), (1 << 63) - 1])
@pytest.mark.parametrize("position", [0, 1, 127, 128, 129, 0x7FFFFFFF])
def test_token_and_position_boundaries(backend, token, position):
    ctx = context()
    write(ctx, [2], [-1], [1, 2], [token, token], [position, position + 1], backend=backend)
    f = fields(ctx)
    assert f[1, :2].tolist() == [token, position]
    assert to_u64(int(f[2, 2])) == mix3(0xDE7FAE23A9A1B716, to_u64(token), position)
    verify_chain(ctx, [1, 2], [position, position + 1], backend=backend)
    assert rows(ctx) == []


def test_chain_position_assert_is_gated_by_the_device_flag(backend):
    for flag, expect_rows in ((0, 0), (1, 1)):
        ctx = context(enable_chain_position_assert=bool(flag))
        write_chain(ctx, [1, 2], [5, 6], backend=backend)  # seed slot 2 holds position 1
        write(ctx, [2], [2], [3, 4], [7, 8], [2, 4], backend=backend)  # 4 != 2 + 1
        assert len(rows(ctx)) == expect_rows
        if expect_rows:
            (row,) = rows(ctx)
            assert row[1:5] == [4, 4, 8, 8] and row[6] == 3 and row[7] == R.WRITE_POSITION_MISMATCH


# --- verify -----------------------------------------------------------------------------------------------

def test_clean_chain_head_and_wrong_head_hash(backend):
    ctx = context()
    write_chain(ctx, [5], [33], backend=backend)
    verify(ctx, [5], [0], [-1], backend=backend)
    assert rows(ctx) == []
    fields(ctx)[5, 2] ^= 1
    verify(ctx, [5], [0], [-1], backend=backend)
    (row,) = rows(ctx)
    assert row[7] == R.VERIFY_CHAIN_HASH_MISMATCH and row[6] == ANCHOR_HASH_SIGNED


def test_fifty_random_clean_heads(backend):
    rng = np.random.default_rng(7)
    ctx = context(num_slots=128)
    slots = rng.choice(np.arange(1, 128), 50, replace=False).tolist()
    tokens = rng.integers(-(1 << 31), 1 << 31, 50).tolist()
    write(ctx, [1] * 50, [-1] * 50, slots, tokens, [0] * 50, backend=backend, capacity=50)
    verify(ctx, slots, [0] * 50, [-1] * 50, backend=backend)
    assert rows(ctx) == []


def test_unreachable_predecessor_skips_the_chain_check_but_not_the_position(backend):
    ctx = context()
    write_chain(ctx, [1, 2], [5, 6], backend=backend)
    fields(ctx)[2, 2] = 12345  # any stored hash passes when prev is 0
    verify(ctx, [2], [1], [0], backend=backend)
    assert rows(ctx) == []
    verify(ctx, [2], [7], [0], backend=backend)
    (row,) = rows(ctx)
    assert row[7] == R.VERIFY_POSITION_MISMATCH and row[5] == row[6] == 12345


def test_each_corruption_fires_exactly_its_reason(backend):
    kv = np.arange(64 * 32, dtype=np.int64).astype(np.uint8).reshape(64, 32)
    source = kc.RealKvSource(kv, page_size=1, num_bytes_per_token=32, read_bytes=32)
    slots, positions = [3, 4, 5, 6], [0, 1, 2, 3]

    def fresh():
        ctx = context(real_kv_sources=(source,), real_kv_hash_mode=kc.RealKvHashMode.PARTIAL)
        write_chain(ctx, slots, [10, 11, 12, 13], backend=backend)
        return ctx

    ctx = fresh()
    fields(ctx)[4, 0] += 1  # token of slot 4 -> its successor's chain breaks
    verify_chain(ctx, slots, positions, backend=backend)
    assert [(r[1], r[7]) for r in rows(ctx)] == [(5, R.VERIFY_CHAIN_HASH_MISMATCH)]

    ctx = fresh()
    fields(ctx)[4, 1] += 1  # position: the slot's own position check and the successor's chain
    verify_chain(ctx, slots, positions, backend=backend)
    assert sorted((r[1], r[7]) for r in rows(ctx)) == [(4, R.VERIFY_POSITION_MISMATCH),
                                                      (5, R.VERIFY_CHAIN_HASH_MISMATCH)]

    ctx = fresh()
    fields(ctx)[4, 2] ^= 1 << 40  # prev_hash: its own chain check, and its successor's
    verify_chain(ctx, slots, positions, backend=backend)
    assert sorted((r[1], r[7]) for r in rows(ctx)) == [(4, R.VERIFY_CHAIN_HASH_MISMATCH),
                                                      (5, R.VERIFY_CHAIN_HASH_MISMATCH)]

    ctx = fresh()
    kv[4, 7] ^= 0x10  # one bit of real KV inside the first 16 bytes: PARTIAL sees it
    verify_chain(ctx, slots, positions, backend=backend)
    kv[4, 7] ^= 0x10
    assert [(r[1], r[7]) for r in rows(ctx)] == [(4, R.VERIFY_REAL_KV_HASH_MISMATCH)]


def test_ring_layout_is_pinned(backend):
    ctx = context(ring_capacity=4)
    write_chain(ctx, [5], [33], backend=backend)
    verify(ctx, [5], [1], [-1], backend=backend)
    assert rows(ctx) == [[0, 5, 0, 33, -1, ANCHOR_HASH_SIGNED, ANCHOR_HASH_SIGNED, R.VERIFY_POSITION_MISMATCH]]


def test_full_ring_keeps_counting(backend):
    ctx = context(ring_capacity=4, kernel_kind=kc.CanaryLaunchTag.TAIL_V_SWA)
    slots = list(range(1, 11))
    write(ctx, [10], [-1], slots, list(range(10)), list(range(10)), backend=backend)
    verify(ctx, slots, [p + 1 for p in range(10)], [-1, *slots[:-1]], backend=backend)
    assert int(ctx.violation_write_index[0]) == 10
    landed = rows(ctx)
    assert len(landed) == 4 and {r[0] for r in landed} == {kc.CanaryLaunchTag.TAIL_V_SWA}
    verify(ctx, slots[:3], [9, 9, 9], [-1, 1, 2], backend=backend)
    assert int(ctx.violation_write_index[0]) == 13 and len(rows(ctx)) == 4


def test_none_mode_never_reads_sources(backend):
    kv = np.full((64, 16), 0xEE, np.uint8)
    source = kc.RealKvSource(kv, page_size=1, num_bytes_per_token=16, read_bytes=16)
    ctx = context(real_kv_sources=(source,), real_kv_hash_mode=kc.RealKvHashMode.NONE)
    write_chain(ctx, [1, 2], [1, 2], backend=backend)
    kv[:] = 0x11
    verify_chain(ctx, [1, 2], [0, 1], backend=backend)
    assert rows(ctx) == []


def test_counters_empty_plan_slot_zero_and_disabled_plan(backend):
    ctx = context()
    verify(ctx, [], [], [], backend=backend)
    assert (int(ctx.kernel_run_counter[0]), int(ctx.slot_run_counter[0])) == (1, 0)
    verify(ctx, [0, 0], [5, 6], [3, 3], backend=backend)  # slot 0: no row, but counted
    assert (int(ctx.kernel_run_counter[0]), int(ctx.slot_run_counter[0])) == (2, 2)
    assert rows(ctx) == []
    verify(ctx, [7], [99], [-1], enable=0, backend=backend)
    assert (int(ctx.kernel_run_counter[0]), int(ctx.slot_run_counter[0])) == (3, 2)
    assert int(ctx.violation_write_index[0]) == 0


def test_num_valid_is_clamped_to_capacity(backend):
    ctx = context()
    verify(ctx, [0, 0, 0], [0, 0, 0], [0, 0, 0], num_valid=99, backend=backend)
    assert int(ctx.slot_run_counter[0]) == 3
    verify(ctx, [0, 0, 0], [0, 0, 0], [0, 0, 0], num_valid=-5, backend=backend)
    assert int(ctx.slot_run_counter[0]) == 3


def test_forty_thousand_entries_are_all_processed(backend):
    n = 40_000
    ctx = context(num_slots=n + 1, ring_capacity=8)
    slots = np.arange(1, n + 1)
    write(ctx, [n], [-1], slots, slots * 3, np.arange(n), backend=backend)
    positions = np.arange(n)
    positions[-1] += 1  # one wrong expectation at the very end
    verify(ctx, slots.tolist(), positions.tolist(), [-1, *slots[:-1].tolist()], backend=backend)
    assert int(ctx.slot_run_counter[0]) == 2 * n
    assert [(r[1], r[7]) for r in rows(ctx)] == [(n, R.VERIFY_POSITION_MISMATCH)]


def test_token_check(backend):
    ctx = context()
    write_chain(ctx, [1, 2, 3], [40, 41, 42], backend=backend)
    verify_chain(ctx, [1, 2, 3], [0, 1, 2], check=True, tokens=[-1, 41, 42], backend=backend)
    assert rows(ctx) == []
    verify_chain(ctx, [1, 2, 3], [0, 1, 2], check=True, tokens=[-1, 41, 99], backend=backend)
    assert rows(ctx) == [[0, 3, 2, 42, 99, int(fields(ctx)[3, 2]), int(fields(ctx)[3, 2]),
                          R.VERIFY_TOKEN_MISMATCH]]
    verify_chain(ctx, [1, 2, 3], [0, 1, 2], check=False, tokens=[-1, 41, 99], backend=backend)
    assert len(rows(ctx)) == 1  # disabled check: the expected token is not even read
    verify_chain(ctx, [1, 2, 3], [0, 1, 5], check=True, tokens=[-1, 41, 99], backend=backend)
    assert rows(ctx)[-1][7] == R.VERIFY_TOKEN_MISMATCH | R.VERIFY_POSITION_MISMATCH
    assert rows(ctx)[-1][4] == 99


@pytest.mark.parametrize("prev_hash", [0, -1, -(1 << 63), (1 << 63) - 1, 1])
def test_stored_hash_boundaries(backend, prev_hash):
    ctx = context()
    f = fields(ctx)
    f[1] = [9, 0, prev_hash, 0]
    f[2] = [10, 1, to_i64(mix3(to_u64(prev_hash), 9, 0)), 0]
    verify(ctx, [2], [1], [1], backend=backend)
    assert rows(ctx) == []


# --- scatter ----------------------------------------------------------------------------------------------

def test_scatter_copies_truncates_and_leaves_the_rest(backend):
    pool = np.full((4, 5), -9, np.int32)
    flat = np.array([1, 2, 3, (1 << 32) + 7, -1, 10, 11, 12, 13, 14, 15, 16], np.int64)
    offsets = np.array([0, 3, 5, 5, 12], np.int64)  # third request empty
    kc.launch_scatter_req_token_ids(flat_in=flat, offsets=offsets, req_pool_indices=np.array([1, 3, 0, 2]),
                                    pool_out=pool, backend=backend)
    assert pool.tolist() == [[-9] * 5, [1, 2, 3, -9, -9], [10, 11, 12, 13, 14], [7, -1, -9, -9, -9]]


def test_scatter_empty_batch_is_a_no_op(backend):
    pool = np.full((2, 3), 4, np.int32)
    kc.launch_scatter_req_token_ids(flat_in=np.zeros(0, np.int64), offsets=np.zeros(1, np.int64),
                                    req_pool_indices=np.zeros(0, np.int64), pool_out=pool, backend=backend)
    assert (pool == 4).all()


@pytest.mark.parametrize("beyond", [0, 1, 1 << 40], ids=["last-plus-one", "last-plus-two", "far"])
def test_a_predecessor_at_or_beyond_the_buffer_end_is_flagged_and_skips_the_chain_check(backend, beyond):
    """prev == num_slots is already outside (the bound is exclusive): flagged, never read, no chain check."""
    ctx = context()
    num_slots = fields(ctx).shape[0]
    write_chain(ctx, [1, 2], [5, 6], backend=backend)
    fields(ctx)[2, 2] = 12345  # a chain check against any predecessor would fail
    vp = verify_plan([2], [7], [num_slots + beyond])
    kc.launch_canary_verify_kernel(context=ctx, plan=vp, check_verify_expected_token=False, backend=backend,
                                   on_invalid="flag" if backend == "numpy" else None)
    (row,) = rows(ctx)
    assert row[7] == R.VERIFY_POSITION_MISMATCH and row[5] == row[6] == 12345
    assert int(ctx.status[0]) == int(kc.CanaryStatus.SLOT_OUT_OF_RANGE)
