"""What ``CanaryRuntime.create`` derives from the pools and the capacities: the expected-token pool's shape (the
slot table's rows and width, or ``Capacities.pool_rows`` and ``max_context_len``), and a slot table it cannot use
refused by the pools' field name before anything is allocated."""

from __future__ import annotations

import numpy as np
import pytest
import runtime_scenario as sc
from test_runtime import LOGGER

from kvcanary_cupy import CanaryArgumentError
from kvcanary_cupy.runtime import CanaryConfig, CanaryRuntime, Capacities, KvPools


def _create(engine: sc.ToyEngine, pools: KvPools | None = None, **caps) -> CanaryRuntime:
    return CanaryRuntime.create(CanaryConfig(logger=LOGGER, verify_token_assert=True), pools or engine.pools(),
                                Capacities(max_batch_size=sc.MAX_BS, max_tokens=sc.MAX_TOKENS, **caps))


def test_the_expected_token_pool_takes_the_slot_tables_rows_and_width_unless_the_capacities_say():
    engine = sc.ToyEngine()
    assert engine.req_to_token.shape == (sc.ROWS, sc.WIDTH) == (5, 32)
    assert _create(engine).expected_token_pool.shape == (5, 32)
    assert _create(engine, pool_rows=7).expected_token_pool.shape == (7, 32)
    assert _create(engine, max_context_len=40).expected_token_pool.shape == (5, 40)
    assert _create(engine, pool_rows=3, max_context_len=9).expected_token_pool.shape == (3, 9)


@pytest.mark.parametrize("table", [np.zeros((5, 32), np.int64), np.zeros(32, np.int32), np.zeros((5, 32), np.float32)],
                         ids=["int64", "1-D", "float32"])
def test_a_slot_table_the_plan_cannot_read_is_refused_by_the_pools_field_name(table):
    engine = sc.ToyEngine()
    with pytest.raises(CanaryArgumentError) as info:
        _create(engine, KvPools(engine.groups(), req_to_token=table))
    assert str(info.value).startswith("kv-canary: KvPools.req_to_token must ")
