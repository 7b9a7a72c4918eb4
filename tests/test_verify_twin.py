"""A verify with a twin buffer (HEAD V after HEAD K): entries whose records hold the same words as the twin's
are skipped (the twin's verify gave them their verdict), every other entry is checked in full."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import oracle
import pytest
import runtime_scenario as sc
from chain_helpers import context, fields, verify_plan, write

import kvcanary_cupy as kc
from kvcanary_cupy.backends import unavailable_reason
from kvcanary_cupy.runtime import CanaryConfig, CanaryRuntime, Capacities

BACKENDS = ["numpy"] + ([] if unavailable_reason("host") else ["host"])
SLOTS = [3, 4, 5, 6, 7, 8, 9, 10]  # one request, positions 0..7, each slot's predecessor the one before
POSITIONS = list(range(8))
PREVS = [-1, 3, 4, 5, 6, 7, 8, 9]
TOKENS = [100 + p for p in POSITIONS]


def _stamped_pair() -> tuple[kc.VerifyOrWriteContext, kc.VerifyOrWriteContext]:
    """Two buffers holding the same chain (HEAD K and HEAD V after one write each), on one ring."""
    k = context(num_slots=16, ring_capacity=32)
    v = k.for_endpoint(canary_buf=np.zeros_like(k.canary_buf), kernel_kind=int(kc.CanaryLaunchTag.HEAD_V_FULL),
                       slot_run_counter=np.zeros(1, np.int64), kernel_run_counter=np.zeros(1, np.int64))
    for ctx in (k, v):
        write(ctx, [8], [-1], SLOTS, TOKENS, POSITIONS)
        ctx.slot_run_counter[0] = ctx.kernel_run_counter[0] = 0
    k.violation_write_index[0] = 0
    return k, v


def _rows(ctx: kc.VerifyOrWriteContext, start: int) -> list[tuple[int, ...]]:
    end = int(ctx.violation_write_index[0])
    return [tuple(int(x) for x in r) for r in ctx.violation_ring[start:end]]


def _verify(ctx, twin, backend):
    kc.launch_canary_verify_kernel(context=ctx, plan=verify_plan(SLOTS, POSITIONS, PREVS, TOKENS),
                                   check_verify_expected_token=True, twin_canary_buf=twin, backend=backend)


def _oracle_rows(k_fields: np.ndarray, v_fields: np.ndarray) -> list[tuple[int, ...]]:
    states = [oracle.CanaryState(fields=[list(map(int, r[:4])) for r in f], ring_capacity=32)
              for f in (k_fields, v_fields)]
    oracle.verify_oracle(states[1], kernel_kind=int(kc.CanaryLaunchTag.HEAD_V_FULL), verify_slot_indices=SLOTS,
                         verify_expected_tokens=TOKENS, verify_expected_positions=POSITIONS,
                         verify_prev_slot_indices=PREVS, verify_num_valid=len(SLOTS), enable=1,
                         check_verify_expected_token=True, sources=[], mode=oracle.MODE_NONE, twin=states[0])
    return [tuple(r) for r in states[1].rows]


@pytest.mark.parametrize("backend", BACKENDS)
def test_only_records_that_differ_from_the_twin_are_checked(backend):
    k, v = _stamped_pair()
    fk, fv = fields(k), fields(v)
    fv[4, 0] += 1  # V alone: a wrong token at slot 4 (its successor's chain breaks in V too)
    fk[6, 1] += 1  # K alone: a wrong position at slot 6 (V's own records are right)
    fk[9, 0] += 7  # both, the same words: a wrong token at slot 9
    fv[9, 0] += 7
    _verify(k, None, backend)
    k_rows = _rows(k, 0)
    _verify(v, k.canary_buf, backend)
    v_rows = _rows(v, len(k_rows))
    assert sorted(r[1] for r in k_rows) == [6, 7, 9, 10]  # K's own: 6 (position), 9 (token), their successors
    # V: slot 4 and its successor 5 differ from K (checked, wrong); 6 and 7 differ (checked, right); 9 and
    # 10 hold K's words (skipped: K's rows report them).
    assert sorted((r[1], r[7]) for r in v_rows) == [
        (4, int(kc.FailReason.VERIFY_TOKEN_MISMATCH)), (5, int(kc.FailReason.VERIFY_CHAIN_HASH_MISMATCH))]
    assert all(r[0] == int(kc.CanaryLaunchTag.HEAD_V_FULL) for r in v_rows)
    assert sorted(v_rows) == sorted(_oracle_rows(fk, fv))
    assert int(v.slot_run_counter[0]) == len(SLOTS) and int(v.kernel_run_counter[0]) == 1  # all counted


@pytest.mark.parametrize("backend", BACKENDS)
def test_without_a_twin_every_entry_is_checked(backend):
    k, v = _stamped_pair()
    fields(k)[9, 0] += 7
    fields(v)[9, 0] += 7
    _verify(v, None, backend)
    assert sorted(r[1] for r in _rows(v, 0)) == [9, 10]


def test_random_twins_give_the_oracle_rows_on_every_backend():
    rng = np.random.default_rng(11)
    for _ in range(40):
        got = {}
        k, v = _stamped_pair()
        for buf in (fields(k), fields(v)):
            for _ in range(int(rng.integers(0, 4))):
                buf[int(rng.choice(SLOTS)), int(rng.integers(0, 4))] += int(rng.integers(1, 3))
        if rng.random() < 0.5:  # the same change in both
            slot, field = int(rng.choice(SLOTS)), int(rng.integers(0, 4))
            fields(k)[slot, field] += 9
            fields(v)[slot, field] += 9
        want = sorted(_oracle_rows(fields(k), fields(v)))
        for backend in BACKENDS:
            v.violation_write_index[0] = 0
            _verify(v, k.canary_buf, backend)
            got[backend] = sorted(_rows(v, 0))
            assert got[backend] == want, backend


def test_hostile_slots_with_a_twin_read_nothing_out_of_bounds_and_match_the_reference():
    """Slots and predecessors outside the buffers (negative, num_slots, huge): the host kernel and the NumPy
    reference (flag mode) skip and flag the same entries, with the twin, and agree on every row and status."""
    if "host" not in BACKENDS:
        pytest.skip("host backend unavailable")
    rng = np.random.default_rng(5)
    for _ in range(30):
        k, v = _stamped_pair()
        fields(v)[int(rng.choice(SLOTS)), int(rng.integers(0, 4))] += 1
        slots = rng.choice([0, -1, 16, 2**40, *SLOTS], 8).astype(np.int64)
        prevs = rng.choice([0, -1, 16, 2**40, *SLOTS], 8).astype(np.int64)
        got = {}
        for backend in ("numpy", "host"):
            v.violation_write_index[0] = 0
            v.status[0] = 0
            kc.launch_canary_verify_kernel(context=v, plan=verify_plan(slots, POSITIONS, prevs, TOKENS),
                                           check_verify_expected_token=True, twin_canary_buf=k.canary_buf,
                                           backend=backend, on_invalid="flag" if backend == "numpy" else None)
            got[backend] = (sorted(_rows(v, 0)), int(v.status[0]))
        assert got["numpy"] == got["host"]


def test_the_twin_verify_under_address_sanitizer_has_zero_reports():
    """This file's host runs again in a child under ASan + UBSan (each report a hard error)."""
    from kvcanary_cupy.hostcuda import sanitizer_preload

    if "host" not in BACKENDS:
        pytest.skip("host backend unavailable")
    preload = sanitizer_preload()
    if not Path(preload).is_file():
        pytest.skip(f"g++ has no AddressSanitizer runtime ({preload})")
    env = {**os.environ, "LD_PRELOAD": preload, "ASAN_OPTIONS": "detect_leaks=0:abort_on_error=1",
           "UBSAN_OPTIONS": "print_stacktrace=1:halt_on_error=1", "KVCANARY_HOST_SANITIZE": "1"}
    root = Path(__file__).resolve().parents[1]
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:benchmark", __file__,
         "-k", "(host or random) and not sanitizer", "--rootdir", str(root)],
        env=env, cwd=root, capture_output=True, text=True, timeout=900)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    assert "AddressSanitizer" not in output and "runtime error" not in output, output[-6000:]
    assert " passed" in output, output[-2000:]


@pytest.mark.parametrize("twin, message", [
    (lambda k, v: np.zeros((15, 32), np.uint8), "twin_canary_buf must have shape"),
    (lambda k, v: np.zeros((16, 32), np.int64), "twin_canary_buf must have dtype uint8"),
    (lambda k, v: v.canary_buf, "twin_canary_buf must be another buffer than context.canary_buf"),
])
def test_a_bad_twin_is_refused_before_anything_is_written(twin, message):
    k, v = _stamped_pair()
    fields(v)[4, 0] += 1
    before = [a.copy() for a in (v.canary_buf, v.violation_ring, v.violation_write_index, v.slot_run_counter)]
    with pytest.raises(kc.CanaryArgumentError, match="^kv-canary: " + message):
        _verify(v, twin(k, v), "numpy")
    after = [v.canary_buf, v.violation_ring, v.violation_write_index, v.slot_run_counter]
    assert all(np.array_equal(a, b) for a, b in zip(before, after, strict=True))


def test_a_twin_is_refused_with_real_kv_hashing():
    k, _ = _stamped_pair()
    kv = np.zeros((16, 16), np.uint8)
    source = kc.RealKvSource(kv, page_size=1, num_bytes_per_token=16, read_bytes=16)
    v = context(num_slots=16, real_kv_sources=(source,), real_kv_hash_mode=kc.RealKvHashMode.PARTIAL)
    fields(v)[4, 0] = 9
    before = [a.copy() for a in (v.canary_buf, v.violation_ring, v.violation_write_index, v.slot_run_counter)]
    with pytest.raises(kc.CanaryArgumentError, match=r"^kv-canary: twin_canary_buf needs context\.real_kv_hash_mode"):
        _verify(v, k.canary_buf, "numpy")
    after = [v.canary_buf, v.violation_ring, v.violation_write_index, v.slot_run_counter]
    assert all(np.array_equal(a, b) for a, b in zip(before, after, strict=True))


# ---- in the runtime: HEAD V has HEAD K's buffer as its twin --------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_runtime_reports_a_head_v_record_only_where_it_differs_from_head_k(backend):
    engine = sc.ToyEngine(with_v=True)
    rt = CanaryRuntime.create(CanaryConfig(backend=backend, logger="kvcanary_cupy.tests"), engine.pools(),
                              Capacities(max_batch_size=sc.MAX_BS, max_tokens=sc.MAX_TOKENS))
    reports = []
    for t in range(3):
        batch = engine.schedule(t)
        sb = engine.step_batch(batch, oracle=False, tokens=False)
        rt.prepare(sb)
        if t == 2:  # two prefix slots of pool row 1: one wrong in both HEAD buffers, one in HEAD V alone
            head_k, head_v = (ep.verify_ctx.canary_buf.view(np.int64) for ep in rt.groups["FULL"].endpoints["HEAD"])
            both, v_only = engine.slots[1][0], engine.slots[1][1]
            head_k[both, 1] += 3
            head_v[both, 1] += 3
            head_v[v_only, 1] += 5
        rt.pre_forward()
        engine.forward(batch, "FULL", ids=sb.input_ids)
        rt.post_forward()
        engine.finish_step(t)
        reports.append(rt.finish_step())
    reports.append(rt.flush())
    rows = [(v.launch_tag, v.slot) for rep in reports for _, v in rep.new_violations]
    head_k_rows = sorted(s for tag, s in rows if tag == "HEAD_K_FULL")
    head_v_rows = sorted(s for tag, s in rows if tag == "HEAD_V_FULL")
    # HEAD K: `both` (position) and its successor `v_only` (chain). HEAD V: `v_only` (its own position, and
    # the chain from `both`) and v_only's successor (chain), but not `both`: the same words as HEAD K's.
    assert head_k_rows == [both, v_only]
    assert head_v_rows == sorted([v_only, engine.slots[1][2]])
