"""Pins the scalar oracle to the SPEC's published vectors and to small cases worked out by hand.

Expected values below are written out literally (from SPEC §2 and §8, or derived on paper from the plan
rules); none is obtained by running the oracle a second time. The last section only checks that every
strategy draws examples the oracle can run, and that non-hostile cases never raise a status bit.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

if __package__:
    from . import oracle, strategies
else:  # tests/ on sys.path
    import oracle
    import strategies

ANCHOR_HASH = 0xDE7FAE23A9A1B716
ANCHOR_HASH_SIGNED = -2414019407054260458
CHAIN_VECTOR = [
    0xDE7FAE23A9A1B716,
    0x542FE5061275A6AB,
    0x9890D56BDE53142E,
    0x5213C65EEE8A1DD1,
    0xC749AFFE5A5A9634,
]
KV_BYTES = bytes(
    [0x01, 0x02, 0x04, 0x08, 0x10, 0x20, 0x40, 0x80, 0x81, 0x82, 0x84, 0x88, 0x90, 0xA0, 0xC0, 0xFF]
)
KV_SOURCE_HASH = 0xF036E30B6961C78D
KV_STORED = 0x6041580849E6407D


def s64(x: int) -> int:
    """Signed view of a literal unsigned 64-bit constant (kept separate from the oracle's helper)."""
    return x - (1 << 64) if x >= 1 << 63 else x


def fresh_state(num_slots: int, ring_capacity: int = 16, stride: int = 32) -> oracle.CanaryState:
    return oracle.CanaryState.from_arrays(
        np.zeros((num_slots, stride), np.uint8), np.zeros((ring_capacity, 8), np.int64)
    )


def plan(**overrides: object) -> oracle.PlanExpect:
    args: dict[str, object] = {
        "swa_window_size": 0,
        "full_to_swa_index_mapping": None,
        "verify_capacity": 1000,
        "req_to_verify_expected_tokens": None,
        "req_to_verify_expected_tokens_valid_lens": None,
        "kv_token_id_vs_position_offset": 0,
        "write_req_capacity": 8,
    }
    args.update(overrides)
    for name in (
        "req_pool_indices",
        "prefix_lens",
        "extend_seq_lens",
        "req_to_verify_expected_tokens_valid_lens",
    ):
        if args.get(name) is not None:
            args[name] = np.asarray(args[name], dtype=np.int64)
    args["req_to_token"] = np.asarray(args["req_to_token"], dtype=np.int32)
    return oracle.plan_oracle(**args)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------------------------------------
# hash vectors (SPEC §2)
# ----------------------------------------------------------------------------------------------------------
def test_splitmix_and_anchor_vectors() -> None:
    assert oracle.splitmix64(0xC0FFEE1234567890) == ANCHOR_HASH
    assert oracle.anchor_hash() == ANCHOR_HASH
    assert oracle.to_i64(ANCHOR_HASH) == ANCHOR_HASH_SIGNED
    assert oracle.splitmix64(0) == 0
    assert oracle.mix3(0, 0, 0) == 0
    # Inputs are taken as unsigned 64-bit: -1 and 2**64 - 1 are the same word.
    assert oracle.mix3(-1, -1, -1) == oracle.mix3(2**64 - 1, 2**64 - 1, 2**64 - 1)
    assert oracle.to_u64(-1) == 2**64 - 1
    assert oracle.to_i64(2**63) == -(2**63)
    assert oracle.to_i32(0x80000000) == -(2**31)
    assert oracle.to_i32(0xFFFFFFFF) == -1


def test_five_step_chain_by_slot_hash() -> None:
    fields: list[list[int]] = []
    prev = -1
    for step, token in enumerate([101, 202, 303, 404, 505]):
        h = oracle.slot_hash(fields, prev)
        assert h == CHAIN_VECTOR[step]
        fields.append([token, step, oracle.to_i64(h), 0])
        prev = step


def test_five_step_chain_by_write_then_clean_verify() -> None:
    state = fresh_state(8)
    slots = [3, 5, 1, 7, 2]
    oracle.write_oracle(
        state,
        kernel_kind=2,
        write_offsets=np.array([0, 5], np.int64),
        write_seed_slot_indices=np.array([-1], np.int64),
        write_num_valid_reqs=np.array([1], np.int32),
        input_ids=np.array([101, 202, 303, 404, 505], np.int64),
        positions=np.arange(5, dtype=np.int64),
        out_cache_loc=np.array(slots, np.int64),
        enable_write_input_assert=False,
        expected_input_tokens=None,
        expected_input_positions=None,
        sources=[],
        mode=oracle.MODE_ALL,
        enable_chain_position_assert=1,
    )
    assert [state.fields[s][2] for s in slots] == [s64(h) for h in CHAIN_VECTOR]
    assert [state.fields[s][:2] for s in slots] == [[101, 0], [202, 1], [303, 2], [404, 3], [505, 4]]
    assert all(state.fields[s][3] == 0 for s in slots)  # no sources: real_kv_hash 0
    assert state.fields[0] == [0, 0, 0, 0]  # untouched slots stay zero
    assert (state.kernel_run_counter, state.slot_run_counter, state.write_index) == (1, 5, 0)

    oracle.verify_oracle(
        state,
        kernel_kind=2,
        verify_slot_indices=np.array(slots, np.int64),
        verify_expected_tokens=np.array([101, 202, 303, 404, 505], np.int64),
        verify_expected_positions=np.arange(5, dtype=np.int64),
        verify_prev_slot_indices=np.array([-1, *slots[:4]], np.int64),
        verify_num_valid=5,
        enable=1,
        check_verify_expected_token=True,
        sources=[],
        mode=oracle.MODE_ALL,
    )
    assert state.rows == [] and state.write_index == 0
    assert (state.kernel_run_counter, state.slot_run_counter) == (2, 10)


def test_real_kv_vector() -> None:
    assert int.from_bytes(KV_BYTES[:8], "little") == 0x8040201008040201
    assert int.from_bytes(KV_BYTES[8:], "little") == 0xFFC0A09088848281
    assert oracle.fold_source_bytes(KV_BYTES, 16) == KV_SOURCE_HASH
    assert oracle.splitmix64(KV_SOURCE_HASH) == KV_STORED
    arr = np.frombuffer(KV_BYTES, dtype=np.uint8).reshape(1, 16).copy()
    assert oracle.real_kv_hash(0, [(arr, 1, 16, 16)], oracle.MODE_PARTIAL) == KV_STORED
    assert oracle.real_kv_hash(0, [(arr, 1, 16, 16)], oracle.MODE_ALL) == KV_STORED
    assert oracle.real_kv_hash(0, [(arr, 1, 16, 16)], oracle.MODE_NONE) == 0
    assert oracle.real_kv_hash(0, [], oracle.MODE_ALL) == 0
    assert oracle.fold_source_bytes(bytes(64), 64) == 0  # all-zero bytes hash to 0


def test_real_kv_page_layout_modes_and_source_order() -> None:
    rng = np.random.default_rng(7)
    # page_size 4, 32 bytes per token, 16 hole bytes per row: slot 6 lives in row 1 at byte 2 * 32 = 64.
    arr = rng.integers(0, 256, size=(3, 4 * 32 + 16), dtype=np.uint8)
    arr[1, 64:80] = np.frombuffer(KV_BYTES, np.uint8)
    src = (arr, 4, 32, 32)
    assert oracle.real_kv_hash(6, [src], oracle.MODE_PARTIAL) == KV_STORED
    # ALL reads 32 bytes: two more splitmix rounds over the next 16 bytes.
    lo = int.from_bytes(arr[1, 80:88].tobytes(), "little")
    hi = int.from_bytes(arr[1, 88:96].tobytes(), "little")
    acc = oracle.splitmix64(oracle.splitmix64(KV_SOURCE_HASH ^ lo) ^ hi)
    assert oracle.real_kv_hash(6, [src], oracle.MODE_ALL) == oracle.splitmix64(acc)
    # Hole bytes are never read.
    holed = arr.copy()
    holed[:, 128:] ^= 0xFF
    assert oracle.real_kv_hash(6, [(holed, 4, 32, 32)], oracle.MODE_ALL) == oracle.real_kv_hash(
        6, [src], oracle.MODE_ALL
    )
    # Two sources fold in list order.
    other = (np.frombuffer(bytes(range(16)) * 8, np.uint8).reshape(8, 16).copy(), 1, 16, 16)
    h_a = oracle.fold_source_bytes(bytes(KV_BYTES), 16)
    h_b = oracle.fold_source_bytes(bytes(range(16)), 16)
    both = oracle.real_kv_hash(6, [src, other], oracle.MODE_PARTIAL)
    assert both == oracle.splitmix64(oracle.splitmix64(h_a) ^ h_b)
    assert both != oracle.real_kv_hash(6, [other, src], oracle.MODE_PARTIAL)


# ----------------------------------------------------------------------------------------------------------
# plan hand cases (SPEC §8 items 1-20 and the project's status rules)
# ----------------------------------------------------------------------------------------------------------
def test_plan_prefix_zero_extend_five() -> None:  # item 1
    got = plan(req_pool_indices=[1], prefix_lens=[0], extend_seq_lens=[5], req_to_token=[[0] * 8, [0] * 8])
    assert got == oracle.PlanExpect(
        entries=[],
        verify_num_valid=0,
        enable=1,
        write_offsets=[0, 5],
        write_offsets_tail_zeros=7,
        seeds=[-1],
        write_num_valid_reqs=1,
        status=0,
        verify_offsets=[0, 0],
    )


def test_plan_decode_prefix_seven() -> None:  # items 2 and 4
    table = [[0] * 8, [11, 12, 13, 14, 15, 16, 17, 18]]
    got = plan(req_pool_indices=[1], prefix_lens=[7], extend_seq_lens=[1], req_to_token=table)
    assert got.entries == [
        (11, -1, 0, -1),
        (12, -1, 1, 11),
        (13, -1, 2, 12),
        (14, -1, 3, 13),
        (15, -1, 4, 14),
        (16, -1, 5, 15),
        (17, -1, 6, 16),
    ]
    assert got.seeds == [17]
    assert got.write_offsets == [0, 1]
    assert (got.verify_num_valid, got.enable, got.status) == (7, 1, 0)


def test_plan_mixed_prefixes() -> None:  # item 3
    table = [[100 * i + j for j in range(12)] for i in range(4)]
    got = plan(
        req_pool_indices=[1, 2, 3], prefix_lens=[0, 4, 10], extend_seq_lens=[8, 1, 1], req_to_token=table
    )
    assert got.write_offsets == [0, 8, 9, 10]
    assert got.verify_offsets == [0, 0, 4, 14]
    assert got.verify_num_valid == 14
    assert got.seeds == [-1, 203, 309]
    expected = [(200, -1, 0, -1), (201, -1, 1, 200), (202, -1, 2, 201), (203, -1, 3, 202)]
    expected += [(300, -1, 0, -1)] + [(300 + p, -1, p, 299 + p) for p in range(1, 10)]
    assert got.entries == expected


@pytest.mark.parametrize("window", [0, 16])
def test_plan_permuted_lut(window: int) -> None:  # items 5 and 8
    lut = np.array([0, 40, 30, 20, 10], np.int64)
    got = plan(
        req_pool_indices=[1],
        prefix_lens=[3],
        extend_seq_lens=[2],
        req_to_token=[[0, 0, 0, 0], [1, 2, 3, 4]],
        swa_window_size=window,
        full_to_swa_index_mapping=lut,
    )
    assert got.seeds == [20]
    assert got.entries == [(40, -1, 0, -1), (30, -1, 1, 40), (20, -1, 2, 30)]


def test_plan_swa_window_keeps_real_predecessor() -> None:  # items 6 and 7
    table = [[0] * 256, [1000 + j for j in range(256)], [2000 + j for j in range(256)], [0] * 256]
    lut = np.arange(2400, dtype=np.int64) * 2
    got = plan(
        req_pool_indices=[1, 2, 3, 0],
        prefix_lens=[200, 3, 0, 500],
        extend_seq_lens=[1, 1, 4, 9],
        req_to_token=table,
        swa_window_size=128,
        full_to_swa_index_mapping=lut,
    )
    assert got.verify_offsets == [0, 128, 131, 131, 131]
    assert got.verify_num_valid == 131
    assert got.entries is not None
    assert got.entries[0] == (2144, -1, 72, 2142)  # lut[1072], position 72, prev lut[1071], not -1
    assert got.entries[127] == (2398, -1, 199, 2396)
    assert got.entries[128:] == [(4000, -1, 0, -1), (4002, -1, 1, 4000), (4004, -1, 2, 4002)]
    assert got.seeds == [2398, 4004, -1, -1]
    assert got.write_offsets == [0, 1, 2, 6, 6]


def test_plan_evicted_lut_and_negative_passthrough() -> None:
    lut = np.array([0, 0, 7, 9], np.int64)  # slot 1 evicted from SWA
    got = plan(
        req_pool_indices=[1],
        prefix_lens=[4],
        extend_seq_lens=[1],
        req_to_token=[[0] * 4, [1, 2, -1, 3]],
        swa_window_size=8,
        full_to_swa_index_mapping=lut,
    )
    assert got.entries == [(0, -1, 0, -1), (7, -1, 1, 0), (-1, -1, 2, 7), (9, -1, 3, -1)]
    assert got.seeds == [9]
    assert got.status == 0


def test_plan_padding_rows_and_capacity() -> None:  # items 9, 12, 13, 20
    table = [[5, 6, 7, 8], [1, 2, 3, 4]]
    base = {"req_pool_indices": [1, 0, 0], "prefix_lens": [4, 99, 99_999], "req_to_token": table}
    got = plan(**base, extend_seq_lens=[0, 3, 4], verify_capacity=4)
    assert got.enable == 1 and got.verify_num_valid == 4
    assert got.write_offsets == [0, 0, 0, 0]
    assert got.seeds == [-1, -1, -1]
    assert got.entries == [(1, -1, 0, -1), (2, -1, 1, 1), (3, -1, 2, 2), (4, -1, 3, 3)]
    short = plan(**base, extend_seq_lens=[2, 0, 0], verify_capacity=3)
    assert (short.enable, short.verify_num_valid, short.entries) == (0, 3, None)
    assert short.seeds == [4, -1, -1]  # seeds are produced on overflow too
    assert short.verify_offsets == [0, 4, 4, 4]


def test_plan_overflow_saturates_counts() -> None:
    got = plan(
        req_pool_indices=[1, 1],
        prefix_lens=[2**62, 8],
        extend_seq_lens=[0, 1],
        req_to_token=[[0] * 8, list(range(8))],
        verify_capacity=4,
    )
    assert got.verify_offsets == [0, 5, 10]
    assert (got.enable, got.verify_num_valid, got.entries) == (0, 4, None)
    # The huge prefix's seed is flagged (extend 0 -> no seed at all); the second seed is read normally.
    assert got.seeds == [-1, 7]
    assert got.status == 0


def test_plan_expected_tokens() -> None:  # item 18
    pool = np.array([[0] * 6, [50, 51, -52, 53, 54, 55]], np.int32)
    common = {
        "req_pool_indices": [1, 1],
        "prefix_lens": [5, 5],
        "extend_seq_lens": [1, 1],
        "req_to_token": [[0] * 6, [1, 2, 3, 4, 5, 6]],
        "req_to_verify_expected_tokens": pool,
    }
    got = plan(**common, req_to_verify_expected_tokens_valid_lens=[3, 0])
    assert got.entries is not None
    assert [e[1] for e in got.entries] == [50, 51, -52, -1, -1] + [-1] * 5
    shifted = plan(
        **common, req_to_verify_expected_tokens_valid_lens=[6, 6], kv_token_id_vs_position_offset=1
    )
    assert shifted.entries is not None
    assert [e[1] for e in shifted.entries][:5] == [51, -52, 53, 54, 55]
    back = plan(**common, req_to_verify_expected_tokens_valid_lens=[6, 6], kv_token_id_vs_position_offset=-1)
    assert back.entries is not None
    assert [e[1] for e in back.entries][:5] == [-1, 50, 51, -52, 53]
    with pytest.raises(ValueError, match="req_to_verify_expected_tokens_valid_lens"):
        plan(**common)


def test_plan_hostile_status_bits() -> None:
    table = [[0] * 4, [1, 2, 3, 4]]
    # (1) request row outside req_to_token: entries neutralised, seed -1.
    got = plan(req_pool_indices=[5, -1], prefix_lens=[2, 1], extend_seq_lens=[1, 1], req_to_token=table)
    assert got.entries == [(0, -1, 0, 0), (0, -1, 1, 0), (0, -1, 0, 0)]
    assert (got.seeds, got.status) == ([-1, -1], 1)
    # (2) prefix beyond the row.
    got = plan(req_pool_indices=[1], prefix_lens=[6], extend_seq_lens=[1], req_to_token=table)
    assert got.entries == [
        (1, -1, 0, -1),
        (2, -1, 1, 1),
        (3, -1, 2, 2),
        (4, -1, 3, 3),
        (0, -1, 4, 0),
        (0, -1, 5, 0),
    ]
    assert (got.seeds, got.status) == ([-1], 2)
    # (3) a slot number escaping the LUT poisons its own entry and its successor's (as prev).
    lut = np.array([0, 10, 20, 30, 40], np.int64)
    got = plan(
        req_pool_indices=[1],
        prefix_lens=[4],
        extend_seq_lens=[1],
        req_to_token=[[0] * 4, [1, 5, 2, 3]],
        swa_window_size=4,
        full_to_swa_index_mapping=lut,
    )
    assert got.entries == [(10, -1, 0, -1), (0, -1, 1, 0), (0, -1, 2, 0), (30, -1, 3, 20)]
    assert (got.seeds, got.status) == ([30], 4)
    # (4) expected-token read past the pool row (lens beyond width) and past the pool rows.
    pool = np.array([[7, 8, 9]], np.int32)
    got = plan(
        req_pool_indices=[1],
        prefix_lens=[4],
        extend_seq_lens=[0],
        req_to_token=table,
        req_to_verify_expected_tokens=np.array([[0, 0, 0], [7, 8, 9]], np.int32),
        req_to_verify_expected_tokens_valid_lens=[9],
    )
    assert got.entries == [(1, 7, 0, -1), (2, 8, 1, 1), (3, 9, 2, 2), (0, -1, 3, 0)]
    assert (got.seeds, got.status) == ([-1], 8)
    got = plan(
        req_pool_indices=[1],
        prefix_lens=[2],
        extend_seq_lens=[1],
        req_to_token=table,
        req_to_verify_expected_tokens=pool,
        req_to_verify_expected_tokens_valid_lens=[1],
    )
    assert got.entries == [(0, -1, 0, 0), (2, -1, 1, 1)]  # sot 1 >= lens 1: no read, no flag
    assert got.status == 8
    # The first failing check names the bit: a bad row never reaches the LUT check.
    got = plan(
        req_pool_indices=[3],
        prefix_lens=[9],
        extend_seq_lens=[1],
        req_to_token=table,
        swa_window_size=2,
        full_to_swa_index_mapping=lut,
    )
    assert got.entries == [(0, -1, 7, 0), (0, -1, 8, 0)]
    assert got.status == 1


def test_plan_write_offsets_wrap_and_tail() -> None:
    got = plan(
        req_pool_indices=[1, 1, 0],
        prefix_lens=[0, 0, 0],
        extend_seq_lens=[2**63 - 1, 2, -(2**62)],
        req_to_token=[[0], [0]],
        write_req_capacity=5,
    )
    assert got.write_offsets == [0, 2**63 - 1, -(2**63) + 1, -(2**63) + 1]
    assert got.write_offsets_tail_zeros == 2
    with pytest.raises(ValueError, match="bs > write_req_capacity"):
        plan(
            req_pool_indices=[1, 1],
            prefix_lens=[0, 0],
            extend_seq_lens=[1, 1],
            req_to_token=[[0]],
            write_req_capacity=1,
        )


# ----------------------------------------------------------------------------------------------------------
# write / verify hand cases (SPEC §4, §5, §8 items 21-38)
# ----------------------------------------------------------------------------------------------------------
def write_chain(
    state: oracle.CanaryState, slots: list[int], tokens: list[int], positions: list[int], **kw: object
) -> None:
    args: dict[str, object] = {
        "kernel_kind": 0,
        "write_offsets": np.array([0, len(slots)], np.int64),
        "write_seed_slot_indices": np.array([-1], np.int64),
        "write_num_valid_reqs": 1,
        "input_ids": np.array(tokens, np.int64),
        "positions": np.array(positions, np.int64),
        "out_cache_loc": np.array(slots, np.int64),
        "enable_write_input_assert": False,
        "expected_input_tokens": None,
        "expected_input_positions": None,
        "sources": [],
        "mode": oracle.MODE_NONE,
        "enable_chain_position_assert": 0,
    }
    args.update(kw)
    oracle.write_oracle(state, **args)  # type: ignore[arg-type]


def verify(
    state: oracle.CanaryState,
    slots: list[int],
    tokens: list[int],
    positions: list[int],
    prevs: list[int],
    **kw: object,
) -> None:
    args: dict[str, object] = {
        "kernel_kind": 4,
        "verify_slot_indices": np.array(slots, np.int64),
        "verify_expected_tokens": np.array(tokens, np.int64),
        "verify_expected_positions": np.array(positions, np.int64),
        "verify_prev_slot_indices": np.array(prevs, np.int64),
        "verify_num_valid": len(slots),
        "enable": 1,
        "check_verify_expected_token": False,
        "sources": [],
        "mode": oracle.MODE_NONE,
    }
    args.update(kw)
    oracle.verify_oracle(state, **args)  # type: ignore[arg-type]


def test_corrupted_token_flags_chain_on_successor_only() -> None:  # items 31, 37
    state = fresh_state(8)
    write_chain(state, [3, 5, 1, 7, 2], [101, 202, 303, 404, 505], [0, 1, 2, 3, 4])
    state.fields[1][0] = 999  # corrupt the token of slot 1 (position 2)
    slots, prevs = [3, 5, 1, 7, 2], [-1, 3, 5, 1, 7]
    verify(state, slots, [-1] * 5, [0, 1, 2, 3, 4], prevs)
    want_chain = oracle.to_i64(oracle.mix3(CHAIN_VECTOR[2], 999, 2))
    assert state.rows == [[4, 7, 3, 404, -1, s64(CHAIN_VECTOR[3]), want_chain, 1]]
    # With the token check on, slot 1 itself reports TOKEN (and still only the successor reports CHAIN).
    verify(state, slots, [101, 202, 303, 404, -1], [0, 1, 2, 3, 4], prevs, check_verify_expected_token=True)
    assert state.rows[1:] == [
        [4, 1, 2, 999, 303, s64(CHAIN_VECTOR[2]), s64(CHAIN_VECTOR[2]), 32],
        [4, 7, 3, 404, 404, s64(CHAIN_VECTOR[3]), want_chain, 1],
    ]
    assert state.write_index == 3 and state.kernel_run_counter == 3 and state.slot_run_counter == 15


def test_pinned_verify_row_and_prev_zero() -> None:  # items 30, 36
    state = fresh_state(8, ring_capacity=4)
    state.fields[5] = [33, 0, ANCHOR_HASH_SIGNED, 0]
    verify(state, [5], [-1], [1], [-1], kernel_kind=0)
    assert state.to_ring_array()[0].tolist() == [0, 5, 0, 33, -1, ANCHOR_HASH_SIGNED, ANCHOR_HASH_SIGNED, 2]
    # prev 0: any stored hash passes the chain check, the position is still compared.
    state.fields[6] = [1, 9, 12345, 0]
    verify(state, [6, 6, 0], [-1, -1, -1], [9, 8, 0], [0, 0, 0])
    assert state.rows[1:] == [[4, 6, 9, 1, -1, 12345, 12345, 2]]
    assert state.slot_run_counter == 1 + 3  # slot-0 entries are counted
    # enable 0: only the kernel counter moves.
    before = (state.write_index, state.slot_run_counter, state.status)
    verify(state, [6], [-1], [0], [0], enable=0)
    assert (state.write_index, state.slot_run_counter, state.status) == before
    assert state.kernel_run_counter == 3


def test_verify_real_kv_and_out_of_range_slots() -> None:
    arr = np.zeros((8, 16), np.uint8)
    arr[2] = np.frombuffer(KV_BYTES, np.uint8)
    src = [(arr, 1, 16, 16)]
    state = fresh_state(8)
    write_chain(state, [2, 3], [10, 11], [0, 1], sources=src, mode=oracle.MODE_PARTIAL)
    assert state.fields[2][3] == s64(KV_STORED) and state.fields[3][3] == 0
    flipped = [(arr.copy(), 1, 16, 16)]
    flipped[0][0][2, 0] ^= 1
    verify(state, [2, 3], [-1, -1], [0, 1], [-1, 2], sources=flipped, mode=oracle.MODE_PARTIAL)
    assert [row[7] for row in state.rows] == [4]
    # Out-of-range slots are skipped (counted) with status bit 1; an out-of-range prev is unreachable.
    verify(state, [-3, 8, 3], [-1, -1, -1], [0, 0, 1], [-1, -1, 8])
    assert state.status == 1 and len(state.rows) == 1 and state.slot_run_counter == 2 + 2 + 3
    # Negative and oversized verify_num_valid are clamped.
    verify(state, [3], [-1], [1], [2], verify_num_valid=-7)
    verify(state, [3], [-1], [1], [2], verify_num_valid=99)
    assert state.slot_run_counter == 7 + 0 + 1


def test_write_assert_rows_and_skips() -> None:  # items 22, 23, 25
    state = fresh_state(8, ring_capacity=2)
    state.fields[4] = [77, 9, 1234, 0]  # seed at position 9
    seed_hash = oracle.mix3(1234, 77, 9)
    oracle.write_oracle(
        state,
        kernel_kind=7,
        write_offsets=np.array([0, 4, 4, 0], np.int64),
        write_seed_slot_indices=np.array([4, -1, 99], np.int64),
        write_num_valid_reqs=5,  # clamped to W = 3
        input_ids=np.array([1, 2, 3, 4], np.int64),
        positions=np.array([10, 12, 99, 13], np.int64),
        out_cache_loc=np.array([0, -1, 6, 9], np.int64),
        enable_write_input_assert=True,
        expected_input_tokens=np.array([1, 0, 5, 4], np.int64),
        expected_input_positions=np.array([10, 0, 11, 13], np.int64),
        sources=[],
        mode=oracle.MODE_NONE,
        enable_chain_position_assert=1,
    )
    second = oracle.mix3(seed_hash, 1, 10)
    assert state.fields[0] == [1, 10, oracle.to_i64(seed_hash), 0]  # slot 0 is written
    assert state.fields[6] == [3, 99, oracle.to_i64(second), 0]
    assert state.rows == [
        [7, 6, 99, 3, 5, oracle.to_i64(second), 11, 8 | 16],  # input-assert row first
        [7, 6, 99, 3, 3, oracle.to_i64(second), 11, 16],  # then the chain-position row
    ]
    # slot 9 >= num_slots: flagged, skipped, not counted; the -1 slot is skipped silently. Request 2's
    # offsets run backwards (4 -> 0): it owns no token, and the offsets are flagged out of order (bit 8).
    assert state.status == 1 | 8 and state.slot_run_counter == 2 and state.kernel_run_counter == 1
    # A token range leaving the arrays skips the whole request.
    oracle.write_oracle(
        state,
        kernel_kind=7,
        write_offsets=np.array([2, 6], np.int64),
        write_seed_slot_indices=np.array([-1], np.int64),
        write_num_valid_reqs=1,
        input_ids=np.zeros(4, np.int64),
        positions=np.zeros(4, np.int64),
        out_cache_loc=np.array([1, 2, 3, 5], np.int64),
        enable_write_input_assert=False,
        expected_input_tokens=None,
        expected_input_positions=None,
        sources=[],
        mode=oracle.MODE_NONE,
        enable_chain_position_assert=0,
    )
    assert state.status == 3 | 8 and state.slot_run_counter == 2 and state.fields[3] == [0, 0, 0, 0]


def test_ring_fill_once() -> None:  # item 32
    state = fresh_state(8, ring_capacity=1)
    for slot in (1, 2, 3):
        state.fields[slot] = [slot, 5, 0, 0]
    verify(state, [1, 2, 3], [-1] * 3, [0, 0, 0], [0, 0, 0])
    assert state.write_index == 3 and len(state.rows) == 3 and state.landed_rows() == 1
    assert state.to_ring_array().tolist() == [[4, 1, 5, 1, -1, 0, 0, 2]]


def test_state_round_trip_keeps_extra_bytes() -> None:
    buf = np.arange(3 * 48, dtype=np.int64).astype(np.uint8).reshape(3, 48)
    ring = np.full((2, 8), -9, np.int64)
    state = oracle.CanaryState.from_arrays(buf, ring, np.array([0], np.int32), 4, 5, 0)
    assert state.fields[1][0] == int.from_bytes(bytes(range(48, 56)), "little")
    state.fields[2] = [-1, 2, 3, 4]
    out = state.to_canary_array()
    assert out[:, 32:].tolist() == buf[:, 32:].tolist()
    assert out[2, :8].tolist() == [255] * 8
    state.append_row([1, 2, 3, 4, 5, 6, 7, 8])
    assert state.to_ring_array().tolist() == [[1, 2, 3, 4, 5, 6, 7, 8], [-9] * 8]


def test_scatter_hand_case() -> None:  # item 39
    pool = np.full((3, 4), -7, np.int32)
    status = oracle.scatter_oracle(
        flat_in=np.array([1, 2, 3, 4, 5, 6, 2**32 + 9, -1, 0x80000000], np.int64),
        offsets=np.array([0, 6, 6, 9], np.int64),
        req_pool_indices=np.array([2, 0, 1], np.int64),
        pool_out=pool,
    )
    assert status == 0
    assert pool.tolist() == [[-7] * 4, [9, -1, -(2**31), -7], [1, 2, 3, 4]]
    status = oracle.scatter_oracle(
        flat_in=np.arange(4, dtype=np.int64),
        offsets=np.array([0, 2, 9, -1, 0], np.int64),
        req_pool_indices=np.array([3, 1, 0, 0], np.int64),
        pool_out=pool,
    )
    assert status == 4  # row 3 out of range; segment [2, 9) leaves flat_in; [-1, 0) starts below 0
    assert pool.tolist() == [[-7] * 4, [9, -1, -(2**31), -7], [1, 2, 3, 4]]


# ----------------------------------------------------------------------------------------------------------
# strategy smoke tests
# ----------------------------------------------------------------------------------------------------------
SMOKE = settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _check_plan(case: strategies.PlanCase, hostile: bool) -> None:
    kw = case.kwargs
    bs = case.bs
    assert kw["req_pool_indices"].dtype == np.int64 and kw["req_to_token"].dtype == np.int32
    got = oracle.plan_oracle(**case.oracle_kwargs())
    assert len(got.write_offsets) == bs + 1 and len(got.seeds) == bs and len(got.verify_offsets) == bs + 1
    assert got.write_offsets_tail_zeros == case.write_req_capacity - bs >= 0
    assert got.verify_num_valid == min(got.verify_offsets[-1], kw["verify_capacity"])
    assert (got.entries is None) == (got.enable == 0)
    rps = kw["req_pool_indices"].tolist()
    assert all(seed == -1 for seed, rp in zip(got.seeds, rps, strict=True) if rp == 0)
    if got.entries is not None:
        assert len(got.entries) == got.verify_num_valid
        # Position 0 has no predecessor, except in entries neutralised to (0, -1, pos, 0).
        assert all(
            prev == -1 for slot, exp, pos, prev in got.entries if pos == 0 and (slot, exp, prev) != (0, -1, 0)
        )
    if not hostile:
        assert got.status == 0
        assert all(b >= a for a, b in zip(got.write_offsets, got.write_offsets[1:], strict=False))


@SMOKE
@given(strategies.plan_cases())
def test_smoke_plan_cases(case: strategies.PlanCase) -> None:
    _check_plan(case, hostile=False)


@SMOKE
@given(strategies.plan_cases(hostile=True))
def test_smoke_plan_cases_hostile(case: strategies.PlanCase) -> None:
    _check_plan(case, hostile=True)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
@given(strategies.plan_cases(allow_large_bs=True, hostile=True))
def test_smoke_plan_cases_large(case: strategies.PlanCase) -> None:
    _check_plan(case, hostile=True)


def _run_chain(case: strategies.ChainCase) -> oracle.CanaryState:
    state = case.initial_state()
    status0, index0, kernels0 = state.status, state.write_index, state.kernel_run_counter
    oracle.write_oracle(state, **case.write_kwargs())
    buf = state.to_canary_array()
    sources = case.copy_sources()
    case.apply_corruptions(buf, sources)
    state.load_canary(buf)
    oracle.verify_oracle(state, **case.verify_kwargs(sources))
    assert state.kernel_run_counter == kernels0 + 2
    assert state.write_index == index0 + len(state.rows)
    assert state.status & status0 == status0
    return state


@SMOKE
@given(strategies.chain_cases())
def test_smoke_chain_cases(case: strategies.ChainCase) -> None:
    status0 = case.status
    state = _run_chain(case)
    assert state.status == status0  # nothing hostile: no new status bit


@SMOKE
@given(strategies.chain_cases(hostile=True))
def test_smoke_chain_cases_hostile(case: strategies.ChainCase) -> None:
    """Hostile values add only the bounds bits and the out-of-order write bit to the status; every row carries
    the launch's tag, names a slot inside the canary buffer (an out-of-range slot is skipped, never reported as
    read) and at least one defined reason bit."""
    status0 = case.status
    state = _run_chain(case)
    bounds = (oracle.STATUS_SLOT_OUT_OF_RANGE | oracle.STATUS_TOKEN_RANGE_OUT_OF_BOUNDS
              | oracle.STATUS_WRITE_OFFSETS_OUT_OF_ORDER)
    assert state.status & ~(status0 | bounds) == 0
    reasons = 0x3F  # the six FailReason bits
    for row in state.rows:
        assert row[0] == case.tag, row
        assert 0 <= row[1] < case.num_slots, row
        assert row[7] != 0 and row[7] & ~reasons == 0, row


@SMOKE
@given(strategies.scatter_cases())
def test_smoke_scatter_cases(case: strategies.ScatterCase) -> None:
    pool = case.pool_out.copy()
    assert oracle.scatter_oracle(**case.oracle_kwargs(pool)) == 0


@SMOKE
@given(strategies.scatter_cases(hostile=True))
def test_smoke_scatter_cases_hostile(case: strategies.ScatterCase) -> None:
    pool = case.pool_out.copy()
    assert oracle.scatter_oracle(**case.oracle_kwargs(pool)) in (0, 4)


@SMOKE
@given(strategies.chain_cases(perturb=False))
def test_unperturbed_chain_cases_are_clean(case: strategies.ChainCase) -> None:
    """Write and verify agree with each other: an unperturbed scenario reports nothing at all."""
    state = _run_chain(case)
    assert state.rows == [] and state.status == case.status


def test_oracle_speed_budget() -> None:
    """Typical plan and chain examples stay in the low milliseconds."""
    case = strategies.plan_cases(max_bs=16)
    worst = 0.0

    @settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
    @given(case)
    def run(c: strategies.PlanCase) -> None:
        nonlocal worst
        t0 = time.perf_counter()
        oracle.plan_oracle(**c.oracle_kwargs())
        worst = max(worst, time.perf_counter() - t0)

    run()
    assert worst < 0.1
