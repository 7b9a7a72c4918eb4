"""The plan step on small exact cases (SPEC §8 items 1–18, 20), on every CPU backend.

Expected values are written out by hand from SPEC §3.3, never computed by the code under test.
"""

from __future__ import annotations

import numpy as np
import pytest
from plan_helpers import fresh_plans, linear_rtt, run_plan

from kvcanary_cupy.backends import unavailable_reason

CPU_BACKENDS = [
    "numpy",
    pytest.param("host", marks=pytest.mark.skipif(unavailable_reason("host") is not None,
                                                  reason=f"host backend: {unavailable_reason('host')}")),
]

pytestmark = pytest.mark.parametrize("backend", CPU_BACKENDS)

RTT = linear_rtt(8, 256)  # row r, column c holds 1000 + 256 r + c


def slot(rp: int, pos: int) -> int:
    return 1000 + 256 * rp + pos


def test_prefill_from_empty_has_no_entries_and_anchor_seed(backend):
    out = run_plan(backend, rpi=[1], prefix=[0], extend=[5], rtt=RTT, write_capacity=3)
    assert out.num_valid == 0 and out.enable == 1
    assert out.write_num_valid_reqs == 1
    assert out.write_offsets == [0, 5, 0, 0]
    assert out.seeds == [-1]


def test_decode_verifies_whole_prefix_and_seeds_from_last_slot(backend):
    out = run_plan(backend, rpi=[2], prefix=[7], extend=[1], rtt=RTT)
    assert out.slots == [slot(2, p) for p in range(7)]
    assert out.positions == list(range(7))
    assert out.prevs == [-1] + [slot(2, p) for p in range(6)]
    assert out.tokens == [-1] * 7
    assert out.seeds == [slot(2, 6)]


def test_mixed_prefixes_offsets_and_entry_count(backend):
    out = run_plan(backend, rpi=[1, 2, 3], prefix=[0, 4, 10], extend=[8, 1, 1], rtt=RTT)
    assert out.write_offsets == [0, 8, 9, 10]
    assert out.num_valid == 14
    assert out.slots == [slot(2, p) for p in range(4)] + [slot(3, p) for p in range(10)]
    assert out.seeds == [-1, slot(2, 3), slot(3, 9)]


def test_chain_heads_have_prev_minus_one_and_others_their_predecessor(backend):
    out = run_plan(backend, rpi=[4], prefix=[3], extend=[1], rtt=RTT)
    assert out.prevs == [-1, slot(4, 0), slot(4, 1)]


def test_permuted_lut_translates_seed(backend):
    lut = np.random.default_rng(0).permutation(4096).astype(np.int64)
    out = run_plan(backend, rpi=[1], prefix=[5], extend=[2], rtt=RTT, window=64, lut=lut)
    assert out.seeds == [int(lut[slot(1, 4)])]
    assert out.slots == [int(lut[slot(1, p)]) for p in range(5)]


def test_swa_window_starts_late_but_keeps_the_real_predecessor(backend):
    lut = np.arange(4096, dtype=np.int64)
    out = run_plan(backend, rpi=[1], prefix=[200], extend=[1], rtt=RTT, window=128, lut=lut, capacity=256)
    assert out.num_valid == 128
    assert out.positions == list(range(72, 200))
    assert out.prevs[0] == slot(1, 71)  # not -1: the window does not reset the chain
    assert out.slots[0] == slot(1, 72)


def test_swa_short_prefix_and_multi_request_total(backend):
    lut = np.arange(4096, dtype=np.int64)
    out = run_plan(backend, rpi=[1], prefix=[3], extend=[1], rtt=RTT, window=128, lut=lut)
    assert out.num_valid == 3
    out = run_plan(backend, rpi=[1, 2, 3], prefix=[3, 130, 128], extend=[1, 1, 1], rtt=RTT, window=128,
                   lut=lut, capacity=512)
    assert out.num_valid == 3 + 128 + 128


def test_shifted_lut_applies_to_entries_and_seeds(backend):
    lut = np.arange(4096, dtype=np.int64) + 100
    out = run_plan(backend, rpi=[3], prefix=[4], extend=[1], rtt=RTT, window=16, lut=lut)
    assert out.slots == [slot(3, p) + 100 for p in range(4)]
    assert out.prevs == [-1] + [slot(3, p) + 100 for p in range(3)]
    assert out.seeds == [slot(3, 3) + 100]


def test_lut_evicted_and_negative_values(backend):
    rtt = RTT.copy()
    rtt[1, 0] = -5  # negative values pass through the LUT untranslated
    lut = np.arange(4096, dtype=np.int64)
    lut[slot(1, 1)] = 0  # evicted from the SWA pool
    out = run_plan(backend, rpi=[1], prefix=[3], extend=[1], rtt=rtt, window=8, lut=lut)
    assert out.slots == [-5, 0, slot(1, 2)]
    assert out.prevs == [-1, -5, 0]


def test_padding_rows_contribute_nothing_even_with_garbage_prefix(backend):
    out = run_plan(backend, rpi=[0, 2, 0], prefix=[99, 2, 99999], extend=[1, 1, 7], rtt=RTT)
    assert out.num_valid == 2
    assert out.slots == [slot(2, 0), slot(2, 1)]
    assert out.write_offsets[:4] == [0, 0, 1, 1]
    assert out.seeds == [-1, slot(2, 1), -1]
    assert out.write_num_valid_reqs == 3


def test_sparse_permuted_req_to_token_values_copied_verbatim(backend):
    rng = np.random.default_rng(1)
    rtt = rng.permutation(1 << 20)[: 8 * 64].astype(np.int32).reshape(8, 64)
    out = run_plan(backend, rpi=[5], prefix=[9], extend=[1], rtt=rtt)
    assert out.slots == rtt[5, :9].tolist()
    assert out.prevs == [-1, *rtt[5, :8].tolist()]


def test_entries_beyond_total_and_seeds_beyond_bs_are_untouched(backend):
    vp, wp = fresh_plans(capacity=16, write_capacity=6, fill=0x5A5A)
    run_plan(backend, rpi=[1, 2], prefix=[2, 3], extend=[1, 1], rtt=RTT, capacity=16, plans=(vp, wp))
    assert vp.verify_slot_indices[5:].tolist() == [0x5A5A] * 11
    assert vp.verify_expected_tokens[5:].tolist() == [0x5A5A] * 11
    assert wp.write_seed_slot_indices[2:].tolist() == [0x5A5A] * 4


def test_capacity_exactly_total_enables_and_one_short_overflows(backend):
    out = run_plan(backend, rpi=[1, 2], prefix=[3, 4], extend=[1, 1], rtt=RTT, capacity=7)
    assert (out.num_valid, out.enable) == (7, 1)
    vp, wp = fresh_plans(capacity=6, write_capacity=2)
    out = run_plan(backend, rpi=[1, 2], prefix=[3, 4], extend=[1, 1], rtt=RTT, capacity=6, plans=(vp, wp))
    assert (out.num_valid, out.enable) == (6, 0)
    assert vp.verify_slot_indices.tolist() == [0x5A5A] * 6  # no entry written on overflow
    assert out.write_offsets == [0, 1, 2]  # writes proceed
    assert out.seeds == [slot(1, 2), slot(2, 3)]


def test_overflow_request_larger_than_capacity(backend):
    out = run_plan(backend, rpi=[1], prefix=[8], extend=[1], rtt=RTT, capacity=4)
    assert (out.num_valid, out.enable) == (4, 0)


def test_all_extends_zero_still_produce_entries(backend):
    out = run_plan(backend, rpi=[1, 2], prefix=[2, 1], extend=[0, 0], rtt=RTT)
    assert out.write_offsets == [0, 0, 0]
    assert out.seeds == [-1, -1]
    assert out.slots == [slot(1, 0), slot(1, 1), slot(2, 0)]


def test_rerunning_identical_inputs_gives_identical_plans(backend):
    """The same batch planned into the same buffers twice, another batch in between: the hand-worked plan both
    times (nothing of the batch in between survives)."""
    plans = fresh_plans(capacity=64, write_capacity=3)
    args = {"rpi": [1, 0, 3], "prefix": [5, 0, 2], "extend": [2, 0, 1], "rtt": RTT, "plans": plans}
    want = {"slots": [slot(1, p) for p in range(5)] + [slot(3, 0), slot(3, 1)],
            "positions": [0, 1, 2, 3, 4, 0, 1],
            "prevs": [-1] + [slot(1, p) for p in range(4)] + [-1, slot(3, 0)],
            "tokens": [-1] * 7, "num_valid": 7, "enable": 1, "write_offsets": [0, 2, 2, 3],
            "seeds": [slot(1, 4), -1, slot(3, 1)], "write_num_valid_reqs": 3, "status": 0}
    first = run_plan(backend, **args)
    between = run_plan(backend, rpi=[2, 4, 5], prefix=[9, 3, 1], extend=[4, 4, 4], rtt=RTT, plans=plans)
    assert between.num_valid == 13 and between.write_offsets == [0, 4, 8, 12]
    again = run_plan(backend, **args)
    for out in (first, again):
        assert {k: getattr(out, k) for k in want} == want


def test_reused_write_plan_with_smaller_batch_zeroes_stale_tail(backend):
    vp, wp = fresh_plans(capacity=64, write_capacity=6)
    run_plan(backend, rpi=[1, 2, 3, 4, 5], prefix=[1] * 5, extend=[3] * 5, rtt=RTT, plans=(vp, wp))
    assert wp.write_offsets.tolist() == [0, 3, 6, 9, 12, 15, 0]
    run_plan(backend, rpi=[1, 2], prefix=[1, 1], extend=[2, 2], rtt=RTT, plans=(vp, wp))
    assert wp.write_offsets.tolist() == [0, 2, 4, 0, 0, 0, 0]


def test_positions_ascend_from_window_start_and_trailing_padding_counts(backend):
    lut = np.arange(4096, dtype=np.int64)
    out = run_plan(backend, rpi=[1, 2, 0, 0], prefix=[10, 3, 0, 0], extend=[1, 1, 0, 0], rtt=RTT, window=4,
                   lut=lut)
    assert out.positions == [6, 7, 8, 9, 0, 1, 2]
    assert out.write_num_valid_reqs == 4


@pytest.mark.parametrize("bs", [1, 31, 32, 33, 128])
@pytest.mark.parametrize("prefix", [0, 1, 127, 128, 129, 4096])
@pytest.mark.parametrize("extend", [1, 128, 4096])
def test_boundary_sweep(backend, bs, prefix, extend):
    rows, width = bs + 1, 4096 + 1
    rtt = (np.arange(rows * width, dtype=np.int64) % 1_000_003).astype(np.int32).reshape(rows, width)
    rpi = list(range(1, bs + 1))
    out = run_plan(backend, rpi=rpi, prefix=[prefix] * bs, extend=[extend] * bs, rtt=rtt,
                   capacity=max(1, bs * prefix))
    assert out.num_valid == bs * prefix and out.enable == 1
    assert out.write_offsets == [extend * r for r in range(bs + 1)]
    assert out.seeds == ([int(rtt[r, prefix - 1]) for r in rpi] if prefix else [-1] * bs)
    if prefix:
        last = bs - 1
        assert out.slots[last * prefix:] == rtt[rpi[last], :prefix].tolist()
        assert out.positions[last * prefix:] == list(range(prefix))


class TestExpectedTokens:
    POOL = (np.arange(8 * 16, dtype=np.int32) * 3 - 50).reshape(8, 16)  # negatives check sign extension

    def tok(self, rp: int, col: int) -> int:
        return int(self.POOL[rp, col])

    def test_no_pool_means_minus_one(self, backend):
        out = run_plan(backend, rpi=[1], prefix=[4], extend=[1], rtt=RTT)
        assert out.tokens == [-1] * 4

    def test_offset_zero_and_plus_one(self, backend):
        out = run_plan(backend, rpi=[2], prefix=[4], extend=[1], rtt=RTT, pool=self.POOL, lens=[16])
        assert out.tokens == [self.tok(2, c) for c in range(4)]
        out = run_plan(backend, rpi=[2], prefix=[4], extend=[1], rtt=RTT, pool=self.POOL, lens=[16], offset=1)
        assert out.tokens == [self.tok(2, c) for c in range(1, 5)]

    def test_offset_minus_one_skips_position_zero(self, backend):
        out = run_plan(backend, rpi=[2], prefix=[3], extend=[1], rtt=RTT, pool=self.POOL, lens=[16], offset=-1)
        assert out.tokens == [-1, self.tok(2, 0), self.tok(2, 1)]

    def test_valid_len_boundary(self, backend):
        out = run_plan(backend, rpi=[3], prefix=[6], extend=[1], rtt=RTT, pool=self.POOL, lens=[4])
        assert out.tokens == [self.tok(3, c) for c in range(4)] + [-1, -1]

    def test_offset_applies_before_the_bound(self, backend):
        out = run_plan(backend, rpi=[3], prefix=[6], extend=[1], rtt=RTT, pool=self.POOL, lens=[4], offset=1)
        assert out.tokens == [self.tok(3, c) for c in range(1, 4)] + [-1, -1, -1]

    def test_per_request_lens_and_zero_len(self, backend):
        out = run_plan(backend, rpi=[1, 2], prefix=[3, 3], extend=[1, 1], rtt=RTT, pool=self.POOL, lens=[0, 2])
        assert out.tokens == [-1, -1, -1, self.tok(2, 0), self.tok(2, 1), -1]

    def test_stale_pool_data_past_len_is_masked(self, backend):
        pool = self.POOL.copy()
        pool[4, 2:] = 777  # a previous, longer owner's tail
        out = run_plan(backend, rpi=[4], prefix=[5], extend=[1], rtt=RTT, pool=pool, lens=[2])
        assert out.tokens == [self.tok(4, 0), self.tok(4, 1), -1, -1, -1]

    def test_bound_applies_to_swa_window_entries(self, backend):
        lut = np.arange(4096, dtype=np.int64)
        out = run_plan(backend, rpi=[1], prefix=[10], extend=[1], rtt=RTT, window=4, lut=lut, pool=self.POOL,
                       lens=[8])
        assert out.positions == [6, 7, 8, 9]
        assert out.tokens == [self.tok(1, 6), self.tok(1, 7), -1, -1]


def test_overflowed_plan_only_bumps_the_verify_kernel_counter(backend):
    import kvcanary_cupy as kc

    vp, wp = fresh_plans(capacity=4, write_capacity=1)
    out = run_plan(backend, rpi=[1], prefix=[8], extend=[1], rtt=RTT, capacity=4, plans=(vp, wp))
    assert (out.num_valid, out.enable) == (4, 0)
    ctx = kc.VerifyOrWriteContext.allocate(num_slots=4096, ring_capacity=4)
    before = ctx.canary_buf.copy()
    kc.launch_canary_verify_kernel(context=ctx, plan=vp, check_verify_expected_token=True, backend=backend)
    assert int(ctx.kernel_run_counter[0]) == 1
    assert int(ctx.slot_run_counter[0]) == 0
    assert int(ctx.violation_write_index[0]) == 0
    assert np.array_equal(ctx.canary_buf, before)


def test_a_prefix_filling_the_whole_req_to_token_row_is_in_range(backend):
    """prefix == row width reads columns 0..width-1, all inside the row: no status bit, every entry planned
    (width + 1 would be beyond the row: SPEC §0.5's PREFIX_BEYOND_REQ_TO_TOKEN_ROW)."""
    rtt = linear_rtt(3, 16)
    out = run_plan(backend, rpi=[2], prefix=[16], extend=[1], rtt=rtt)
    assert out.status == 0 and out.enable == 1 and out.num_valid == 16
    assert out.slots == [1000 + 16 * 2 + p for p in range(16)] and out.seeds == [1000 + 16 * 2 + 15]
    beyond = run_plan(backend, rpi=[2], prefix=[17], extend=[1], rtt=rtt, on_invalid="flag")
    assert beyond.status == 2  # PLAN_PREFIX_BEYOND_REQ_TO_TOKEN_ROW
