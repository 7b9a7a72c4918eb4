"""Round trip through the public API: plan + write random requests, verify clean, corrupt one thing, and
exactly the reason the contract predicts fires at exactly the predicted slot(s)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvcanary_cupy as kc
from kvcanary_cupy.backends import unavailable_reason

R = kc.FailReason
CORRUPTIONS = ("token", "position", "prev_hash", "real_kv_byte", "req_to_token", "expected_token")
PAGE, BYTES_PER_TOKEN = 4, 32


@dataclass
class Engine:
    lengths: list[int]
    slots: list[list[int]]  # slots[i][p]: slot of request i (pool row i + 1) at position p
    tokens: list[list[int]]
    req_to_token: np.ndarray
    pool: np.ndarray
    kv: np.ndarray
    ctx: kc.VerifyOrWriteContext
    backend: str

    def plan(self, prefix, extend):
        bs = len(self.lengths)
        vp = kc.VerifyPlan.allocate(verify_capacity=max(1, sum(prefix)))
        wp = kc.WritePlan.allocate(write_req_capacity=bs)
        kc.launch_canary_plan_kernels(
            verify_plan_out=vp, write_plan_out=wp, req_pool_indices=np.arange(1, bs + 1, dtype=np.int64),
            prefix_lens=np.array(prefix, np.int64), extend_seq_lens=np.array(extend, np.int64),
            req_to_token=self.req_to_token, swa_window_size=0, full_to_swa_index_mapping=None,
            verify_capacity=max(1, sum(prefix)), req_to_verify_expected_tokens=self.pool,
            req_to_verify_expected_tokens_valid_lens=np.array(self.lengths, np.int64), backend=self.backend)
        return vp, wp

    def write_all(self):
        _, wp = self.plan([0] * len(self.lengths), self.lengths)
        flat = lambda rows: np.array([v for row in rows for v in row], np.int64)  # noqa: E731
        kc.launch_canary_write_kernel(
            context=self.ctx, plan=wp, input_ids=flat(self.tokens),
            positions=flat([list(range(n)) for n in self.lengths]), out_cache_loc=flat(self.slots),
            enable_write_input_assert=False, backend=self.backend)

    def verify_all(self) -> set[tuple[int, int]]:
        start = int(self.ctx.violation_write_index[0])
        vp, _ = self.plan(self.lengths, [0] * len(self.lengths))
        kc.launch_canary_verify_kernel(context=self.ctx, plan=vp, check_verify_expected_token=True,
                                       backend=self.backend)
        return {(v.slot, v.reason_bits) for v in kc.read_violations(self.ctx, start=start).rows}


@st.composite
def engines(draw, backend: str) -> Engine:
    lengths = draw(st.lists(st.integers(2, 10), min_size=2, max_size=5))
    total = sum(lengths)
    num_slots = 1 + total + draw(st.integers(0, 8))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    perm = (rng.permutation(num_slots - 1) + 1).tolist()
    tokens_flat = rng.choice(1 << 30, size=total, replace=False).astype(np.int64) - (1 << 29)
    slots, tokens, at = [], [], 0
    for n in lengths:
        slots.append(perm[at: at + n])
        tokens.append(tokens_flat[at: at + n].tolist())
        at += n
    width = max(lengths) + 2
    rtt = np.zeros((len(lengths) + 1, width), np.int32)
    pool = np.zeros((len(lengths) + 1, width), np.int32)
    for i, n in enumerate(lengths):
        rtt[i + 1, :n] = slots[i]
        pool[i + 1, :n] = tokens[i]
    kv = rng.integers(0, 256, size=(-(-num_slots // PAGE), PAGE * BYTES_PER_TOKEN), dtype=np.uint8)
    source = kc.RealKvSource(kv, page_size=PAGE, num_bytes_per_token=BYTES_PER_TOKEN, read_bytes=BYTES_PER_TOKEN)
    ctx = kc.VerifyOrWriteContext.allocate(num_slots=num_slots, ring_capacity=64, real_kv_sources=(source,),
                                           real_kv_hash_mode=kc.RealKvHashMode.ALL,
                                           kernel_kind=kc.CanaryLaunchTag.TAIL_K_FULL)
    return Engine(lengths, slots, tokens, rtt, pool, kv, ctx, backend)


BACKENDS = [
    "numpy",
    pytest.param("host", marks=pytest.mark.skipif(unavailable_reason("host") is not None,
                                                  reason=f"host backend: {unavailable_reason('host')}")),
]


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=150)
@given(data=st.data(), kind=st.sampled_from(CORRUPTIONS))
def test_one_corruption_fires_exactly_the_predicted_reason(backend, data, kind):
    eng = data.draw(engines(backend))
    eng.write_all()
    assert eng.verify_all() == set()  # a freshly written chain verifies clean

    i = data.draw(st.integers(0, len(eng.lengths) - 1))
    n = eng.lengths[i]
    p = data.draw(st.integers(0, n - 1))
    s = eng.slots[i][p]
    successor = {(eng.slots[i][p + 1], int(R.VERIFY_CHAIN_HASH_MISMATCH))} if p + 1 < n else set()
    fields = eng.ctx.canary_buf.view(np.int64)
    if kind == "token":  # the slot's own token check, and its successor's chain link
        fields[s, 0] += 1
        predicted = {(s, int(R.VERIFY_TOKEN_MISMATCH))} | successor
    elif kind == "position":
        fields[s, 1] += 1
        predicted = {(s, int(R.VERIFY_POSITION_MISMATCH))} | successor
    elif kind == "prev_hash":
        fields[s, 2] ^= 1 << data.draw(st.integers(0, 63))  # prev_hash is hashed into the successor's link too
        predicted = {(s, int(R.VERIFY_CHAIN_HASH_MISMATCH))} | successor
    elif kind == "real_kv_byte":
        eng.kv[s // PAGE, (s % PAGE) * BYTES_PER_TOKEN + data.draw(st.integers(0, BYTES_PER_TOKEN - 1))] ^= \
            np.uint8(1 << data.draw(st.integers(0, 7)))
        predicted = {(s, int(R.VERIFY_REAL_KV_HASH_MISMATCH))}
    elif kind == "expected_token":
        eng.pool[i + 1, p] ^= 1 << data.draw(st.integers(0, 30))
        predicted = {(s, int(R.VERIFY_TOKEN_MISMATCH))}
    else:  # req_to_token: position p of request i now points at position q of another request
        j = data.draw(st.sampled_from([k for k in range(len(eng.lengths)) if k != i]))
        q = data.draw(st.integers(0, eng.lengths[j] - 1))
        w = eng.slots[j][q]
        eng.req_to_token[i + 1, p] = w
        bits = int(R.VERIFY_TOKEN_MISMATCH)  # tokens are distinct
        if q != p:
            bits |= int(R.VERIFY_POSITION_MISMATCH)
        if (p == 0) != (q == 0) or p > 0:  # two chain heads both store the anchor hash; anything else differs
            bits |= int(R.VERIFY_CHAIN_HASH_MISMATCH)
        predicted = {(w, bits)} | successor
    assert eng.verify_all() == predicted
