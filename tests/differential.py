"""Run one strategy case through a backend and collect every buffer it may touch, for comparisons.

Outputs start from a sentinel fill, so "left untouched" is part of what two backends must agree on.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

import kvcanary_cupy as kc
from kvcanary_cupy.backends import resolve_backend
from kvcanary_cupy.context import RealKvSource, VerifyOrWriteContext
from kvcanary_cupy.dlpack import CPU
from kvcanary_cupy.plan import prepare_plan_launch
from kvcanary_cupy.scatter import ScatterLaunch
from kvcanary_cupy.verify import prepare_verify_launch
from kvcanary_cupy.write import prepare_write_launch

SENTINEL = 0x5A5A5A5A

# Fewer random examples where a run repeats the suite many times (``make mutate`` sets 0.1).
SCALE = float(os.environ.get("KVCANARY_DIFFERENTIAL_SCALE", "1"))


def examples(n: int) -> int:
    """``n`` random examples, scaled by ``KVCANARY_DIFFERENTIAL_SCALE`` (at least 5)."""
    return max(5, int(n * SCALE))


@contextlib.contextmanager
def host_threads(threads: int) -> Iterator[None]:
    """Host launches inside the block run on ``threads`` OS threads (the process default afterwards)."""
    from kvcanary_cupy.hostcuda import set_host_threads

    set_host_threads(threads)
    try:
        yield
    finally:
        set_host_threads(None)


def run_plan(backend: Any, case: Any) -> dict[str, np.ndarray]:
    """All plan buffers after one launch. ``backend`` is a name or a backend object (custom shapes)."""
    capacity = case.kwargs["verify_capacity"]
    vp = kc.VerifyPlan.allocate(verify_capacity=capacity)
    wp = kc.WritePlan.allocate(write_req_capacity=case.write_req_capacity)
    for arr in (*vars(vp).values(), *vars(wp).values()):
        arr.fill(SENTINEL)
    if isinstance(backend, str):
        kc.launch_canary_plan_kernels(verify_plan_out=vp, write_plan_out=wp, **case.kwargs, backend=backend,
                                      on_invalid=None if backend != "numpy" else "flag")
    else:
        launch = prepare_plan_launch(verify_plan_out=vp, write_plan_out=wp, **case.kwargs,
                                     function="launch_canary_plan_kernels")
        backend.plan(launch)
    return {**{f"verify.{k}": v for k, v in vars(vp).items()}, **{f"write.{k}": v for k, v in vars(wp).items()}}


def plan_matches_oracle(out: dict[str, np.ndarray], expect: Any, case: Any) -> None:
    bs = case.bs
    assert int(out["verify.verify_num_valid"][0]) == expect.verify_num_valid
    assert int(out["verify.enable"][0]) == expect.enable
    assert int(out["verify.status"][0]) == expect.status
    if expect.entries is not None:
        n = len(expect.entries)
        columns = [out[f"verify.{name}"][:n].tolist() for name in (
            "verify_slot_indices", "verify_expected_tokens", "verify_expected_positions", "verify_prev_slot_indices")]
        got = list(zip(*columns, strict=True))
        assert got == [tuple(e) for e in expect.entries]
        untouched = slice(n, None)
    else:
        untouched = slice(None)
    for name in ("verify_slot_indices", "verify_expected_tokens", "verify_expected_positions",
                 "verify_prev_slot_indices"):
        assert (out[f"verify.{name}"][untouched] == SENTINEL).all(), f"{name} written beyond total"
    assert out["write.write_offsets"][: bs + 1].tolist() == expect.write_offsets
    assert (out["write.write_offsets"][bs + 1:] == 0).all()
    assert out["write.write_offsets"].shape[0] - bs - 1 == expect.write_offsets_tail_zeros
    assert out["write.write_seed_slot_indices"][:bs].tolist() == expect.seeds
    assert (out["write.write_seed_slot_indices"][bs:] == SENTINEL).all()
    assert int(out["write.write_num_valid_reqs"][0]) == expect.write_num_valid_reqs
    assert out["write.verify_offsets"][: bs + 1].tolist() == expect.verify_offsets


@dataclass
class ChainResult:
    canary: np.ndarray
    ring: np.ndarray
    rows: list[list[int]]  # rows landed by the launch, in ring order
    landed: tuple[int, int]  # the ring rows they occupy
    write_index: int
    slot_run_counter: int
    kernel_run_counter: int
    status: int


def _context(case: Any, sources: list[tuple[np.ndarray, int, int, int]], canary: np.ndarray,
             ring: np.ndarray) -> VerifyOrWriteContext:
    return VerifyOrWriteContext(
        canary_buf=canary, kernel_kind=case.tag, violation_ring=ring,
        violation_write_index=np.array([case.write_index], np.int32),
        slot_run_counter=np.array([case.slot_run_counter], np.int64),
        kernel_run_counter=np.array([case.kernel_run_counter], np.int64),
        real_kv_sources=tuple(RealKvSource(s[0], page_size=s[1], num_bytes_per_token=s[2], read_bytes=s[3],
                                           layout=s[4] if len(s) > 4 else None) for s in sources),
        real_kv_hash_mode=kc.RealKvHashMode(case.mode),
        enable_chain_position_assert=np.array([case.enable_chain_position_assert], np.int32),
        status=np.array([case.status], np.int32),
    )


def _snapshot(ctx: VerifyOrWriteContext, ring_start: int) -> ChainResult:
    index = int(ctx.violation_write_index[0])
    end = min(max(index, 0), ctx.violation_ring.shape[0])
    return ChainResult(
        canary=ctx.canary_buf.copy(), ring=ctx.violation_ring.copy(),
        rows=ctx.violation_ring[max(ring_start, 0):end].tolist(), landed=(max(ring_start, 0), max(end, 0)),
        write_index=index,
        slot_run_counter=int(ctx.slot_run_counter[0]), kernel_run_counter=int(ctx.kernel_run_counter[0]),
        status=int(ctx.status[0]),
    )


def run_chain(backend: Any, case: Any) -> tuple[ChainResult, ChainResult]:
    """Write, corrupt, verify; the state after the write and after the verify."""
    impl = resolve_backend(backend, CPU, "flag") if isinstance(backend, str) else backend
    sources = case.copy_sources()
    ctx = _context(case, sources, case.canary_buf.copy(), case.ring.copy())
    wp = kc.WritePlan(write_offsets=case.write_offsets, write_seed_slot_indices=case.write_seed_slot_indices,
                      write_num_valid_reqs=np.array([case.write_num_valid_reqs], np.int32),
                      verify_offsets=np.zeros(case.write_offsets.shape[0], np.int64))
    impl.write(prepare_write_launch(
        context=ctx, plan=wp, input_ids=case.input_ids, positions=case.positions, out_cache_loc=case.out_cache_loc,
        enable_write_input_assert=case.enable_write_input_assert,
        expected_input_tokens=case.expected_input_tokens, expected_input_positions=case.expected_input_positions))
    after_write = _snapshot(ctx, case.write_index)
    case.apply_corruptions(ctx.canary_buf, sources)
    vp = kc.VerifyPlan(
        verify_slot_indices=case.verify_slot_indices, verify_expected_tokens=case.verify_expected_tokens,
        verify_expected_positions=case.verify_expected_positions,
        verify_prev_slot_indices=case.verify_prev_slot_indices,
        verify_num_valid=np.array([case.verify_num_valid], np.int32), enable=np.array([case.enable], np.int32),
        status=np.zeros(1, np.int32))
    impl.verify(prepare_verify_launch(context=ctx, plan=vp,
                                      check_verify_expected_token=case.check_verify_expected_token))
    return after_write, _snapshot(ctx, after_write.write_index)


def chain_matches_oracle(case: Any, after_write: ChainResult, after_verify: ChainResult) -> None:
    import oracle

    state = case.initial_state()
    oracle.write_oracle(state, **case.write_kwargs())
    _state_equal(after_write, state, case.write_index)
    sources = case.copy_sources()
    buf = state.to_canary_array()
    case.apply_corruptions(buf, sources)
    state.load_canary(buf)
    first = state.write_index
    oracle.verify_oracle(state, **case.verify_kwargs(sources))
    _state_equal(after_verify, state, first)


def _state_equal(got: ChainResult, state: Any, ring_start: int) -> None:
    assert got.write_index == state.write_index
    assert got.slot_run_counter == state.slot_run_counter
    assert got.kernel_run_counter == state.kernel_run_counter
    assert got.status == state.status
    assert np.array_equal(got.canary, state.to_canary_array())
    assert np.array_equal(got.ring, state.to_ring_array())
    assert got.landed[0] == max(ring_start, 0)


def chain_results_equal(a: ChainResult, b: ChainResult) -> None:
    """Bit-for-bit equality, except that ring rows may land in a different order (atomic order on the
    kernels): the same multiset of rows must land, and the rest of the ring must be untouched."""
    assert (a.write_index, a.slot_run_counter, a.kernel_run_counter, a.status) == \
        (b.write_index, b.slot_run_counter, b.kernel_run_counter, b.status)
    assert np.array_equal(a.canary, b.canary)
    assert a.landed == b.landed
    hi = a.landed[1]
    # When the ring fills up during the launch (or the index starts outside it), which rows land depends on
    # the append order, which only the reference fixes: then only the count of landed rows is comparable.
    if a.write_index - a.landed[0] == hi - a.landed[0]:
        assert sorted(a.rows) == sorted(b.rows)
        # Rows of earlier launches may also sit in another order.
        assert sorted(a.ring[:hi].tolist()) == sorted(b.ring[:hi].tolist())
    assert np.array_equal(a.ring[hi:], b.ring[hi:])  # rows past the landed ones are untouched


def run_scatter(backend: Any, case: Any) -> tuple[np.ndarray, int]:
    impl = resolve_backend(backend, CPU, "flag") if isinstance(backend, str) else backend
    pool = case.pool_out.copy()
    status = np.zeros(1, np.int32)
    impl.scatter(ScatterLaunch(case.flat_in, case.offsets, case.req_pool_indices, pool, status, CPU))
    return pool, int(status[0])
