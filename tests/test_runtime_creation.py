"""What ``CanaryRuntime.create`` derives from the pools and the capacities: the expected-token pool's shape (the
slot table's rows and width, or ``Capacities.pool_rows`` and ``max_context_len``), and a slot table it cannot use
refused by the pools' field name before anything is allocated."""

from __future__ import annotations

from typing import Any

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


# A runtime of three groups (FULL, an SWA group with its LUT, a DRAFT model's group; K and V) with every capacity set
# to a value no other takes, so that a buffer's shape and dtype say which argument sized it.
_DISTINCT_CAPS = dict(max_batch_size=3, max_tokens=11, max_sweep_slots=13, pool_rows=6, max_context_len=35,
                      verify_capacity=17)
_RING, _WINDOW = 19, 23
# (shape, dtype) -> the argument a failed allocation of it must name, worked out from the capacities above: a
# violation ring row has 8 int64 fields, a canary record 4 (32 bytes), the history staging defaults to
# pool_rows x max_context_len = 210 tokens, and the SWA group's scratch takes the larger of max_tokens and
# max_sweep_slots (here the sweep's).
_SIZED_BY = {
    ((3,), "int64"): "Capacities.max_batch_size",  # request rows, write seeds, history rows
    ((4,), "int64"): "Capacities.max_batch_size",  # offsets, one past the rows
    # staged tokens, the SWA group's slots, copy_slots' slots and their LUT gathers
    ((11,), "int64"): "Capacities.max_tokens",
    ((11, 4), "int64"): "Capacities.max_tokens",  # copy_slots' records in flight
    ((13,), "int64"): "Capacities.max_sweep_slots",  # sweep plans, the sweep's staging, the SWA scratch
    ((13,), "bool"): "Capacities.max_sweep_slots",  # the SWA scratch's mask
    ((17,), "int64"): "Capacities.verify_capacity",
    ((23,), "int64"): "CanaryConfig.max_verify_entries_per_step",
    ((19, 8), "int64"): "CanaryConfig.ring_capacity",
    ((6, 35), "int32"): "Capacities.pool_rows x Capacities.max_context_len",
    ((210,), "int64"): "Capacities.max_history_tokens",
}
_CANARY_BUFFER = ((sc.NUM_SLOTS, 32), "uint8")  # one per (HEAD/TAIL, K/V) of each group, named by its group


def _create_with_distinct_capacities(engine: sc.ToyEngine, framework: str) -> CanaryRuntime:
    config = CanaryConfig(logger=LOGGER, verify_token_assert=True, write_input_assert=True, ring_capacity=_RING,
                          max_verify_entries_per_step=_WINDOW)
    return CanaryRuntime.create(config, engine.pools(), Capacities(**_DISTINCT_CAPS), framework=framework,
                                sweep_source=engine.held)


@pytest.mark.parametrize("framework", ["numpy", "torch"])
def test_a_buffer_the_allocator_cannot_make_is_refused_naming_the_argument_that_sized_it(monkeypatch, framework):
    """The allocator itself fails (the allocation limit let the creation through, the memory is not there): NumPy's
    ``np.full`` raises a MemoryError, torch's ``torch.full`` on the CPU a RuntimeError. Made to fail at each of the
    creation's allocations in turn, the creation is refused with the whole message naming the capacity or config
    field that sized that buffer, its bytes and its shape. Both frameworks name the buffer the runtime asked for;
    torch's own message is checked at the first buffer of each shape (each creation costs more under torch)."""
    engine = sc.ToyEngine(swa=True, draft=True, with_v=True)
    seen: list[tuple[tuple[int, ...], str]] = []
    fail_at: list[int | None] = [None]

    def allocating(shape: Any, dtype_name: str) -> None:
        """Note one allocation; fail it when it is the one chosen."""
        seen.append((tuple(shape) if isinstance(shape, tuple) else (int(shape),), dtype_name))
        if fail_at[0] is not None and len(seen) - 1 == fail_at[0]:
            raise error_type(error_text)

    if framework == "numpy":
        import kvcanary_cupy.plan as plan_module

        error_type, error_text = MemoryError, "Unable to allocate (faked)"

        class FailingNumpy:
            """NumPy as the plan module sees it, but for ``full``, the runtime's allocation."""

            def __getattr__(self, name: str) -> Any:
                return getattr(np, name)

            @staticmethod
            def full(shape: Any, fill: Any, dtype: Any) -> np.ndarray:
                allocating(shape, np.dtype(dtype).name)
                return np.full(shape, fill, dtype)

        monkeypatch.setattr(plan_module, "np", FailingNumpy())
    else:
        torch = pytest.importorskip("torch")
        real_full = torch.full
        error_type, error_text = RuntimeError, "DefaultCPUAllocator: can't allocate memory (faked)"

        def failing_full(size: Any, fill: Any, **kwargs: Any) -> Any:
            allocating(size, str(kwargs["dtype"]).removeprefix("torch."))
            return real_full(size, fill, **kwargs)

        monkeypatch.setattr(torch, "full", failing_full)

    _create_with_distinct_capacities(engine, framework)
    made = list(seen)
    names_met: list[str] = []
    for k, (shape, dtype) in enumerate(made):
        if framework == "torch" and (shape, dtype) in made[:k]:
            continue
        seen.clear()
        fail_at[0] = k
        with pytest.raises(CanaryArgumentError) as info:
            _create_with_distinct_capacities(engine, framework)
        assert len(seen) == k + 1  # refused at the failed allocation, nothing allocated after it
        message = str(info.value)
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        shown = str(shape[0]) if len(shape) == 1 else str(shape)  # the runtime sizes 1-D buffers by an int
        tail = (f" asks for {nbytes} bytes ({shown} x {dtype}), which cannot be allocated on device='cpu' "
                f"({error_type.__name__}: {error_text})")
        if (shape, dtype) == _CANARY_BUFFER:
            name = message.removeprefix("kv-canary: ").removesuffix(tail)
            assert name in ("KvGroup 'FULL' num_slots", "KvGroup 'SWA' num_slots", "KvGroup 'DRAFT' num_slots"), \
                message
        elif (shape, dtype) in _SIZED_BY:
            name = _SIZED_BY[(shape, dtype)]
        else:  # the runtime's 1-element words, in one int32 and one int64 block: sized by no argument
            assert len(shape) == 1 and dtype in ("int32", "int64"), (shape, dtype)
            name = "the requested size"
        assert message == "kv-canary: " + name + tail, (k, shape, dtype)
        names_met.append(name)
    assert set(names_met) >= set(_SIZED_BY.values()) | {"the requested size"}
    if framework == "numpy":
        for group in ("FULL", "SWA", "DRAFT"):  # HEAD and TAIL buffers of K and V
            assert names_met.count(f"KvGroup {group!r} num_slots") == 4, group


def test_a_torch_runtime_allocates_on_its_own_device_whatever_torchs_default_device():
    """An engine may set torch's default device (here the storage-less ``meta`` device); the runtime's buffers
    still go to the device of its pools, where the kernels read them."""
    torch = pytest.importorskip("torch")
    engine = sc.ToyEngine(swa=True, draft=True, with_v=True)
    with torch.device("meta"):
        rt = _create_with_distinct_capacities(engine, "torch")
    buffers = [ep.write_ctx.canary_buf for g in rt.groups.values() for ep in g.endpoints["HEAD"] + g.endpoints["TAIL"]]
    assert buffers and all(isinstance(b, torch.Tensor) and b.device.type == "cpu" for b in buffers)
