"""The vectorized NumPy reference against the independent scalar oracle, on random cases.

Valid inputs must give the oracle's outputs in "raise" mode (nothing to refuse); hostile device values must
give them in "flag" mode and a ValueError, with nothing written, in "raise" mode.
"""

from __future__ import annotations

import numpy as np
import oracle
import pytest
import strategies
from differential import chain_matches_oracle, examples, plan_matches_oracle, run_chain, run_plan, run_scatter
from hypothesis import given, settings

import kvcanary_cupy as kc


@settings(max_examples=examples(400))
@given(strategies.plan_cases(max_bs=16))
def test_plan_matches_oracle_on_valid_batches(case):
    expect = oracle.plan_oracle(**case.oracle_kwargs())
    assert expect.status == 0
    vp = kc.VerifyPlan.allocate(verify_capacity=case.kwargs["verify_capacity"])
    wp = kc.WritePlan.allocate(write_req_capacity=case.write_req_capacity)
    kc.launch_canary_plan_kernels(verify_plan_out=vp, write_plan_out=wp, **case.kwargs)  # raise mode: no raise
    plan_matches_oracle(run_plan("numpy", case), expect, case)


@settings(max_examples=examples(300))
@given(strategies.plan_cases(max_bs=12, hostile=True))
def test_plan_flags_hostile_values_like_the_oracle_and_raises_otherwise(case):
    expect = oracle.plan_oracle(**case.oracle_kwargs())
    plan_matches_oracle(run_plan("numpy", case), expect, case)
    vp = kc.VerifyPlan.allocate(verify_capacity=case.kwargs["verify_capacity"])
    wp = kc.WritePlan.allocate(write_req_capacity=case.write_req_capacity)
    before = [a.copy() for a in (*vars(vp).values(), *vars(wp).values())]
    if expect.status:
        with pytest.raises(ValueError, match=r"^kv-canary: "):
            kc.launch_canary_plan_kernels(verify_plan_out=vp, write_plan_out=wp, **case.kwargs)
        after = [*vars(vp).values(), *vars(wp).values()]
        assert all(np.array_equal(x, y) for x, y in zip(before, after, strict=True))
    else:
        kc.launch_canary_plan_kernels(verify_plan_out=vp, write_plan_out=wp, **case.kwargs)


@settings(max_examples=examples(30))
@given(strategies.plan_cases(allow_large_bs=True))
def test_plan_matches_oracle_on_large_batches(case):
    plan_matches_oracle(run_plan("numpy", case), oracle.plan_oracle(**case.oracle_kwargs()), case)


@settings(max_examples=examples(400))
@given(strategies.chain_cases())
def test_write_and_verify_match_oracle(case):
    chain_matches_oracle(case, *run_chain("numpy", case))


@settings(max_examples=examples(300))
@given(strategies.chain_cases(hostile=True))
def test_write_and_verify_flag_hostile_values_like_the_oracle(case):
    chain_matches_oracle(case, *run_chain("numpy", case))


@settings(max_examples=examples(200))
@given(strategies.scatter_cases(hostile=True))
def test_scatter_matches_oracle(case):
    pool, status = run_scatter("numpy", case)
    expected = case.pool_out.copy()
    expected_status = oracle.scatter_oracle(**case.oracle_kwargs(expected))
    assert np.array_equal(pool, expected)
    assert status == expected_status


@settings(max_examples=examples(100))
@given(strategies.scatter_cases(hostile=True))
def test_scatter_raise_mode_refuses_hostile_segments_and_writes_nothing(case):
    expected_status = oracle.scatter_oracle(**case.oracle_kwargs(case.pool_out.copy()))
    pool = case.pool_out.copy()
    if expected_status:
        with pytest.raises(ValueError, match=r"^kv-canary: request \d+"):
            kc.launch_scatter_req_token_ids(flat_in=case.flat_in, offsets=case.offsets,
                                            req_pool_indices=case.req_pool_indices, pool_out=pool)
        assert np.array_equal(pool, case.pool_out)
    else:
        kc.launch_scatter_req_token_ids(flat_in=case.flat_in, offsets=case.offsets,
                                        req_pool_indices=case.req_pool_indices, pool_out=pool)
