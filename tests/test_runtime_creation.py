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


def test_without_a_slot_table_the_expected_token_pool_needs_both_capacities():
    engine = sc.ToyEngine()
    from kvcanary_cupy.layouts import BlockTable

    pools = KvPools(engine.groups(), layout=BlockTable(engine.block_table, sc.PAGE, num_slots=sc.NUM_SLOTS))
    message = ("kv-canary: Capacities.pool_rows and Capacities.max_context_len are required with verify_token_assert "
               "when the pools have no req_to_token")
    for caps in ({}, {"pool_rows": 5}, {"max_context_len": 32}):
        with pytest.raises(CanaryArgumentError) as info:
            _create(engine, pools, **caps)
        assert str(info.value) == message, caps
    assert _create(engine, pools, pool_rows=5, max_context_len=32).expected_token_pool.shape == (5, 32)


def test_request_rows_are_required_exactly_when_a_group_reads_its_slots_through_them():
    from kvcanary_cupy.layouts import BlockTable

    engine = sc.ToyEngine()
    sb = engine.step_batch(engine.schedule(0))
    sb.req_pool_indices = None
    rows = CanaryRuntime.create(CanaryConfig(logger=LOGGER), engine.pools(),
                                Capacities(max_batch_size=sc.MAX_BS, max_tokens=sc.MAX_TOKENS))
    with pytest.raises(CanaryArgumentError) as info:
        rows.prepare(sb)
    assert str(info.value) == ("kv-canary: batch.req_pool_indices is required: a group of model 'target' reads its "
                               "slots through request rows (req_to_token or a BlockTable with batch_rows=False)")
    table = BlockTable(np.zeros((sc.MAX_BS, sc.WIDTH // sc.PAGE), np.int32), sc.PAGE, num_slots=sc.NUM_SLOTS,
                       batch_rows=True)
    row_less = CanaryRuntime.create(CanaryConfig(logger=LOGGER), KvPools(engine.groups(), layout=table),
                                    Capacities(max_batch_size=sc.MAX_BS, max_tokens=sc.MAX_TOKENS))
    row_less.prepare(sb)  # the batch's rows are the table's rows
    assert row_less.forwards == {"target": 1}


def test_an_expected_token_pool_beyond_the_allocation_limit_is_refused_by_its_capacities():
    """2000 x 2000 int32 entries (16 MB) and their history staging (32 MB) against a limit of 4 MB: the pool's
    capacities ask for most, and are named."""
    engine = sc.ToyEngine()
    with pytest.raises(CanaryArgumentError) as info:
        CanaryRuntime.create(CanaryConfig(logger=LOGGER, verify_token_assert=True), engine.pools(),
                             Capacities(max_batch_size=sc.MAX_BS, max_tokens=sc.MAX_TOKENS, pool_rows=2000,
                                        max_context_len=2000), max_allocation_bytes=4 << 20)
    assert str(info.value).startswith("kv-canary: Capacities.pool_rows=2000 x max_context_len=2000 makes "
                                      "CanaryRuntime.create need ")


def test_the_constructor_refuses_wrong_parts_and_hooks_by_name_and_defaults_to_numpy_on_the_cpu():
    engine = sc.ToyEngine()
    config, pools = CanaryConfig(logger=LOGGER), engine.pools()
    caps = Capacities(max_batch_size=sc.MAX_BS, max_tokens=sc.MAX_TOKENS)
    cases = [((dict(vars(config)), pools, caps), {}, "config must be a CanaryConfig, got dict"),
             ((config, pools.groups, caps), {}, "pools must be a KvPools, got tuple"),
             ((config, pools, {"max_tokens": 8}), {}, "capacities must be a Capacities, got dict"),
             ((config, pools, caps), {"sweep_source": 3}, "sweep_source must be callable, got int"),
             ((config, pools, caps), {"observer": "log"}, "observer must be callable, got str"),
             ((config, pools, caps), {"timer": [1]}, "timer must be callable, got list"),
             ((CanaryConfig(logger=LOGGER, sweep_interval=4), pools, caps), {},
              "CanaryConfig.sweep_interval=4 needs a sweep_source (the slots the prefix cache holds)")]
    for args, hooks, message in cases:
        with pytest.raises(CanaryArgumentError) as info:
            CanaryRuntime(*args, **hooks)
        assert str(info.value) == "kv-canary: " + message
    rt = CanaryRuntime(config, pools, caps)
    assert str(rt.space.device) == "cpu" and rt.space.framework == "numpy"
    assert rt.stats()["init_finished"] is False and np.all(rt.expected_token_pool is None)
    assert CanaryRuntime(CanaryConfig(mode="off", logger=LOGGER), pools, caps).expected_token_pool is None


def test_the_expected_token_pool_starts_as_zeros():
    rt = _create(sc.ToyEngine())
    assert np.array_equal(rt.expected_token_pool, np.zeros((5, 32), np.int32))


def test_the_history_staging_holds_pool_rows_times_max_context_len_tokens_and_a_row_past_the_pool_is_flagged():
    """Capacities(pool_rows=5, max_context_len=3): 15 history tokens per forward by default, so step 1's histories
    (6 + 4 = 10 tokens) are staged. The second names pool row 7, past the pool's 5: the scatter skips it and flags
    SCATTER_OUT_OF_RANGE, reported like any status bit; the first lands in row 1 (its first 3 positions)."""
    from kvcanary_cupy import CanaryStatus

    engine = sc.ToyEngine()
    rt = _create(engine, pool_rows=5, max_context_len=3)
    engine.schedule(0)
    engine.finish_step(0)
    sb = engine.step_batch(engine.schedule(1), tokens=True)
    assert sb.history_ids.shape[0] == 10
    sb.history_req_pool_indices = np.array([1, 7], np.int64)
    rt.prepare(sb)
    assert rt.flush().scatter_status == int(CanaryStatus.SCATTER_OUT_OF_RANGE)
    assert rt.expected_token_pool[1].tolist() == [sc.token(1, q) for q in range(3)]


@pytest.mark.parametrize(("last_prefix", "overflows"), [(3, False), (4, True)])
def test_the_default_verify_capacity_is_three_entries_per_slot(last_prefix, overflows):
    """A group of 8 slots plans at most 24 verify entries by default: four rows sharing slots 1-7 (radix sharing)
    with prefixes 7 + 7 + 7 + 3 = 24 fit, 7 + 7 + 7 + 4 = 25 overflow."""
    from kvcanary_cupy import RealKvSource
    from kvcanary_cupy.runtime import KvGroup, StepBatch

    source = RealKvSource(np.zeros((8, 32), np.uint8), page_size=1, num_bytes_per_token=32, read_bytes=32)
    table = np.zeros((5, 8), np.int32)
    table[1:, :7] = np.arange(1, 8)
    rt = CanaryRuntime.create(CanaryConfig(logger=LOGGER), KvPools((KvGroup("FULL", 8, (source,)),),
                                                                   req_to_token=table),
                              Capacities(max_batch_size=4, max_tokens=4))
    prefixes = np.array([7, 7, 7, last_prefix], np.int64)
    rt.prepare(StepBatch(req_pool_indices=np.arange(1, 5, dtype=np.int64), prefix_lens=prefixes,
                         extend_seq_lens=np.ones(4, np.int64), input_ids=np.arange(4, dtype=np.int64),
                         positions=prefixes.copy(), out_cache_loc=np.array([7, 7, 7, 7], np.int64)))
    rt.pre_forward()
    rt.post_forward()
    assert rt.flush().overflowed == (["FULL"] if overflows else [])
