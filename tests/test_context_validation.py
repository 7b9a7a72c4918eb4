"""Bad input to RealKvSource, the context, write, verify and scatter: ValueError first, nothing written.

Also the host-side reading of the ring (decoded rows, totals past capacity, the table).
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest
from chain_helpers import context, verify_plan, write_plan

import kvcanary_cupy as kc
from kvcanary_cupy.backends import unavailable_reason

CPU_BACKENDS = [
    "numpy",
    pytest.param("host", marks=pytest.mark.skipif(unavailable_reason("host") is not None,
                                                  reason=f"host backend: {unavailable_reason('host')}")),
]


def rejects(fragment: str):
    return pytest.raises(ValueError, match=r"^kv-canary: .*" + fragment)


class TestRealKvSource:
    def test_valid_source(self):
        source = kc.RealKvSource(np.zeros((4, 64), np.uint8), page_size=2, num_bytes_per_token=32, read_bytes=16)
        assert source.byte_rows.shape == (4, 64) and source.slots_covered == 8

    @pytest.mark.parametrize(("kwargs", "fragment"), [
        ({"page_size": 0}, "page_size must be >= 1"),
        ({"num_bytes_per_token": 24}, "num_bytes_per_token must be a positive multiple of 16"),
        ({"num_bytes_per_token": 0}, "num_bytes_per_token must be a positive multiple of 16"),
        ({"read_bytes": 0}, "read_bytes must be a positive multiple of 16"),
        ({"read_bytes": 48}, "read_bytes must be a positive multiple of 16"),
        ({"read_bytes": 8}, "read_bytes must be a positive multiple of 16"),
    ])
    def test_layout_rules(self, kwargs, fragment):
        args = {"page_size": 1, "num_bytes_per_token": 32, "read_bytes": 32, **kwargs}
        with rejects(fragment):
            kc.RealKvSource(np.zeros((4, 64), np.uint8), **args)

    def test_empty_tensor(self):
        with rejects("RealKvSource.tensor must not be empty"):
            kc.RealKvSource(np.zeros((0, 64), np.uint8), page_size=1, num_bytes_per_token=16, read_bytes=16)

    def test_one_dimensional_tensor(self):
        with rejects("RealKvSource.tensor must be at least 2-D"):
            kc.RealKvSource(np.zeros(64, np.uint8), page_size=1, num_bytes_per_token=16, read_bytes=16)

    def test_row_stride_not_a_multiple_of_16(self):
        with rejects("row stride must be a multiple of 16"):
            kc.RealKvSource(np.zeros((4, 40), np.uint8)[:, :32], page_size=1, num_bytes_per_token=32,
                            read_bytes=32)

    def test_rows_narrower_than_a_page(self):
        with rejects("fewer than page_size"):
            kc.RealKvSource(np.zeros((4, 32), np.uint8), page_size=2, num_bytes_per_token=32, read_bytes=32)

    def test_misaligned_start(self):
        raw = np.zeros(4 * 64 + 16, np.uint8)
        start = 8 if raw.ctypes.data % 16 == 0 else 0  # a start that is 8 bytes off 16-byte alignment
        misaligned = raw[start: start + 4 * 64].reshape(4, 64)
        assert misaligned.ctypes.data % 16 == 8
        with rejects("16-byte aligned"):
            kc.RealKvSource(misaligned, page_size=1, num_bytes_per_token=32, read_bytes=32)

    def test_per_layer_strided_view_of_any_dtype(self):
        pool = np.zeros((3, 8, 16), np.float32)  # [layer, token, head_dim]: one layer is a strided view
        layer = pool[:, 2, :]
        source = kc.RealKvSource(layer, page_size=1, num_bytes_per_token=64, read_bytes=64)
        assert source.byte_rows.shape == (3, 64) and source.byte_rows.strides == (8 * 16 * 4, 1)


def launch_all(ctx, backend="numpy", **changes):
    """One verify and one write on ``ctx``; ``changes`` override individual arguments."""
    vp = changes.pop("verify_plan", verify_plan([1, 2], [0, 1], [-1, 1]))
    wp = changes.pop("write_plan", write_plan([2], [-1]))
    tokens = {"input_ids": np.array([5, 6], np.int64), "positions": np.array([0, 1], np.int64),
              "out_cache_loc": np.array([1, 2], np.int64)}
    tokens.update({k: changes.pop(k) for k in list(changes) if k in tokens})
    kc.launch_canary_verify_kernel(context=ctx, plan=vp, check_verify_expected_token=False, backend=backend)
    kc.launch_canary_write_kernel(context=ctx, plan=wp, enable_write_input_assert=False, backend=backend, **tokens)


def snapshot(ctx):
    return [np.array(getattr(ctx, f.name)).copy() for f in dataclasses.fields(ctx)
            if isinstance(getattr(ctx, f.name), np.ndarray)]


def assert_untouched(ctx, before):
    assert all(np.array_equal(a, b) for a, b in zip(before, snapshot(ctx), strict=True))


@pytest.mark.parametrize("backend", CPU_BACKENDS)
class TestLaunchValidation:
    def test_five_sources(self, backend):
        src = kc.RealKvSource(np.zeros((64, 16), np.uint8), page_size=1, num_bytes_per_token=16, read_bytes=16)
        with rejects("at most 4 RealKvSource"):
            context(real_kv_sources=(src,) * 5, real_kv_hash_mode=kc.RealKvHashMode.ALL)
        # A context built field by field (no allocate) is checked again at launch.
        ctx = dataclasses.replace(context(real_kv_sources=(src,), real_kv_hash_mode=kc.RealKvHashMode.ALL),
                                  real_kv_sources=(src,) * 5)
        before = snapshot(ctx)
        with rejects("at most 4 RealKvSource"):
            launch_all(ctx, backend)
        assert_untouched(ctx, before)

    def test_source_smaller_than_the_canary_buffer(self, backend):
        src = kc.RealKvSource(np.zeros((15, 32), np.uint8), page_size=2, num_bytes_per_token=16, read_bytes=16)
        ctx = context(num_slots=31, real_kv_sources=(src,), real_kv_hash_mode=kc.RealKvHashMode.ALL)
        before = snapshot(ctx)
        with rejects("covers 30 slots"):
            launch_all(ctx, backend)
        assert_untouched(ctx, before)

    @pytest.mark.parametrize(("field", "value", "fragment"), [
        ("canary_buf", np.zeros((8, 24), np.uint8), "slot stride"),
        ("canary_buf", np.zeros((8, 32), np.int64), "canary_buf must have dtype uint8"),
        ("violation_ring", np.zeros((4, 7), np.int64), "violation_ring must have shape"),
        ("violation_ring", np.zeros((0, 8), np.int64), "at least one row"),
        ("violation_write_index", np.zeros(1, np.int64), "violation_write_index must have dtype int32"),
        ("slot_run_counter", np.zeros(2, np.int64), "slot_run_counter must have shape"),
        ("status", None, "status is required"),
        ("real_kv_hash_mode", 7, "real_kv_hash_mode"),
        ("kernel_kind", "HEAD", "kernel_kind must be an int"),
    ])
    def test_bad_context_field(self, backend, field, value, fragment):
        ctx = dataclasses.replace(context(num_slots=8), **{field: value})
        before = snapshot(ctx)
        with rejects(fragment):
            launch_all(ctx, backend)
        assert_untouched(ctx, before)

    def test_misaligned_canary_buffer(self, backend):
        raw = np.zeros(8 * 32 + 16, np.uint8)
        start = 1 + (-raw.ctypes.data) % 8  # one byte past an 8-byte boundary
        ctx = dataclasses.replace(context(num_slots=8), canary_buf=raw[start: start + 8 * 32].reshape(8, 32))
        before = snapshot(ctx)
        with rejects("canary_buf must start at an 8-byte aligned address"):
            launch_all(ctx, backend)
        assert_untouched(ctx, before)

    def test_read_only_canary_buffer(self, backend):
        ctx = context(num_slots=8)
        ctx.canary_buf.flags.writeable = False
        with rejects("canary_buf is read-only"):
            launch_all(ctx, backend)

    def test_token_arrays_of_different_lengths(self, backend):
        ctx = context(num_slots=8)
        before = snapshot(ctx)
        with rejects("positions must have shape"):
            launch_all(ctx, backend, positions=np.array([0, 1, 2], np.int64))
        # the verify launched before the bad write did run; only the write refused
        assert int(ctx.kernel_run_counter[0]) == 1
        assert np.array_equal(ctx.canary_buf, before[0])

    def test_wrong_token_dtype(self, backend):
        ctx = context(num_slots=8)
        with rejects("out_cache_loc must have dtype int64"):
            launch_all(ctx, backend, out_cache_loc=np.array([1, 2], np.int32))

    def test_verify_plan_fields_of_different_lengths(self, backend):
        ctx = context(num_slots=8)
        vp = dataclasses.replace(verify_plan([1, 2], [0, 1], [-1, 1]), verify_expected_positions=np.zeros(3, np.int64))
        before = snapshot(ctx)
        with rejects("plan.verify_expected_positions must have shape"):
            launch_all(ctx, backend, verify_plan=vp)
        assert_untouched(ctx, before)

    def test_scatter_validation(self, backend):
        pool = np.zeros((2, 4), np.int32)
        good = {"flat_in": np.arange(3, dtype=np.int64), "offsets": np.array([0, 3], np.int64),
                "req_pool_indices": np.array([1], np.int64), "pool_out": pool}
        for change, fragment in (({"offsets": np.array([0, 3, 3], np.int64)}, "offsets must have shape"),
                                 ({"pool_out": np.zeros((2, 4), np.int64)}, "pool_out must have dtype int32"),
                                 ({"flat_in": np.zeros((1, 3), np.int64)}, "flat_in must be 1-D"),
                                 ({"status": np.zeros(2, np.int32)}, "status must have shape")):
            with rejects(fragment):
                kc.launch_scatter_req_token_ids(**{**good, **change}, backend=backend)
        assert not pool.any()


class TestDeviceValuesInTheReference:
    def test_slot_outside_the_buffer_raises_by_default_and_flags_on_request(self):
        ctx = context(num_slots=8)

        def write(**kwargs):
            kc.launch_canary_write_kernel(context=ctx, plan=write_plan([2], [-1]), input_ids=np.array([5, 6], np.int64),
                                          positions=np.array([0, 1], np.int64),
                                          out_cache_loc=np.array([1, 9], np.int64), enable_write_input_assert=False,
                                          **kwargs)

        before = snapshot(ctx)
        with rejects("out_cache_loc\\[1\\]=9 is outside canary_buf's 8 slots"):
            write()
        assert_untouched(ctx, before)
        write(on_invalid="flag")
        assert int(ctx.status[0]) == kc.CanaryStatus.SLOT_OUT_OF_RANGE
        assert int(ctx.slot_run_counter[0]) == 1

    def test_verify_slot_outside_the_buffer(self):
        ctx = context(num_slots=8)
        with rejects("plan.verify_slot_indices\\[0\\]=-3"):
            launch_all(ctx, verify_plan=verify_plan([-3], [0], [-1]))

    def test_write_range_outside_the_token_arrays(self):
        ctx = context(num_slots=8)
        with rejects("leaves the 2 tokens of input_ids"):
            launch_all(ctx, write_plan=write_plan([3], [-1]))

    def test_scatter_row_outside_the_pool(self):
        pool = np.zeros((2, 4), np.int32)
        with rejects("req_pool_indices\\[0\\]=5"):
            kc.launch_scatter_req_token_ids(flat_in=np.arange(3, dtype=np.int64), offsets=np.array([0, 3], np.int64),
                                            req_pool_indices=np.array([5], np.int64), pool_out=pool)
        status = np.zeros(1, np.int32)
        kc.launch_scatter_req_token_ids(flat_in=np.arange(3, dtype=np.int64), offsets=np.array([0, 3], np.int64),
                                        req_pool_indices=np.array([5], np.int64), pool_out=pool, status=status,
                                        on_invalid="flag")
        assert int(status[0]) == kc.CanaryStatus.SCATTER_OUT_OF_RANGE and not pool.any()


def test_missing_compiler_makes_the_host_backend_a_clear_error(monkeypatch):
    import kvcanary_cupy.hostcuda as hostcuda
    from kvcanary_cupy import backends

    monkeypatch.setattr(hostcuda, "find_compiler", lambda: None)
    backends.unavailable_reason.cache_clear()
    try:
        with rejects("backend='host' is not available here: no C\\+\\+ compiler was found"):
            launch_all(context(num_slots=8), "host")
    finally:
        backends.unavailable_reason.cache_clear()


class TestReadingViolations:
    def test_decoded_row_totals_and_table(self):
        ctx = context(num_slots=8, ring_capacity=2, kernel_kind=kc.CanaryLaunchTag.TAIL_K_SWA)
        launch_all(ctx)  # writes slots 1, 2 (verify ran first on an empty buffer: 2 violations)
        kc.launch_canary_verify_kernel(context=ctx, plan=verify_plan([1, 2], [3, 1], [-1, 1]),
                                       check_verify_expected_token=False)
        report = kc.read_violations(ctx)
        assert report.total == 3 and report.dropped == 1 and len(report.rows) == 2 and report.errored
        first = report.rows[0]
        assert first.launch_tag == "TAIL_K_SWA" and first.slot == 1
        assert first.reasons == ("VERIFY_CHAIN_HASH_MISMATCH",)
        assert first.stored_chain_hash == "0x0000000000000000"
        assert first.expected_aux_text == "0xde7fae23a9a1b716"
        assert first.labels == ["verify_chain_hash"]
        assert first.log_line().startswith("kv-canary violation index=0 tag=TAIL_K_SWA slot=1 position=0 ")
        table = report.table()
        assert "1 dropped after the ring filled" in table and "verify_chain_hash" in table
        assert kc.read_violations(ctx, start=1).rows[0].index == 1

    def test_write_rows_show_the_expected_position(self):
        ctx = context(num_slots=8)
        wp = write_plan([1], [-1])
        one = np.array([1], np.int64)
        kc.launch_canary_write_kernel(context=ctx, plan=wp, input_ids=one, positions=one, out_cache_loc=one,
                                      enable_write_input_assert=True, expected_input_tokens=one,
                                      expected_input_positions=np.array([4], np.int64))
        (row,) = kc.read_violations(ctx).rows
        assert row.is_write and row.expected_aux_text == "4" and row.labels == ["write_position"]
        assert "expected_position=4" in row.log_line()

    def test_a_table_row_lists_all_its_reasons_joined_by_a_bar(self):
        from kvcanary_cupy.violations import decode_row

        # a verify row with two reasons (chain 1 | token 32) and a write row with two (token 8 | position 16)
        rows = [decode_row(0, np.array([2, 5, 3, 7, 9, 0x1234, -1, 1 | 32], np.int64)),
                decode_row(1, np.array([6, 12, 40, 1, 2, 0, 41, 8 | 16], np.int64))]
        report = kc.ViolationReport(total=2, capacity=4, rows=rows, status=kc.CanaryStatus(0), slot_run_counter=0,
                                    kernel_run_counter=0)
        assert report.table().splitlines() == [
            "#  tag          slot  pos  stored_tok  exp_tok  stored_chain        expected_aux        reasons",
            "0  TAIL_K_FULL  5     3    7           9        0x0000000000001234  0xffffffffffffffff  "
            "verify_chain_hash|verify_token",
            "1  HEAD_K_SWA   12    40   1           2        0x0000000000000000  41                  "
            "write_token|write_position",
            "2 violation(s), 2 shown from a ring of 4",
        ]

    def test_status_names(self):
        ctx = context(num_slots=8)
        ctx.status[0] = kc.CanaryStatus.SLOT_OUT_OF_RANGE | kc.CanaryStatus.SCATTER_OUT_OF_RANGE
        report = kc.read_violations(ctx)
        assert report.status_names == ["SLOT_OUT_OF_RANGE", "SCATTER_OUT_OF_RANGE"]
        assert "status: SLOT_OUT_OF_RANGE, SCATTER_OUT_OF_RANGE" in report.table()


def test_verify_capacity_beyond_int32_is_refused_before_allocating():
    with rejects("verify_capacity must be <= 2147483647"):
        kc.VerifyPlan.allocate(verify_capacity=1 << 31)


def test_the_cuda_backend_passes_absent_pointers_as_an_explicit_null():
    """CuPy would turn None into a null *parameter* pointer; the kernels need a null *argument*."""
    from kvcanary_cupy.backends.host import HOST_SHAPE
    from kvcanary_cupy.backends.kernel_backend import KernelBackend
    from kvcanary_cupy.dlpack import CPU
    from kvcanary_cupy.scatter import ScatterLaunch

    calls = []

    class Module:
        def get_function(self, name):
            return lambda grid, block, args: calls.append((name, grid, block, args))

    pool = np.zeros((2, 4), np.int32)
    for null in (None, np.uint64(0)):  # the host launcher's way (None passed as is), then the CUDA backend's
        backend = KernelBackend("cuda", lambda file: Module(), HOST_SHAPE, null=null)
        backend.scatter(ScatterLaunch(np.arange(3, dtype=np.int64), np.array([0, 3], np.int64),
                                      np.array([1], np.int64), pool, None, CPU))
    (name, grid, block, args), (null_name, null_grid, null_block, null_args) = calls
    assert name == null_name == "kvc_scatter"
    assert args[-1] is None and all(a is not None for a in args[:-1])
    assert all(a is not None for a in null_args)
    assert isinstance(null_args[-1], np.uint64) and int(null_args[-1]) == 0
    # only the absent pointer changes: the launch shape is the same
    assert (null_grid, null_block) == (grid, block) and grid is not None and block is not None
    assert len(null_args) == len(args)


@pytest.mark.parametrize("change, message", [
    ({"kernel_kind": 1.5}, "kernel_kind must be an int, got float"),
    ({"kernel_kind": True}, "kernel_kind must be an int, got bool"),
])
def test_for_endpoint_refuses_a_bad_scalar_field_by_its_name(change, message):
    ctx = context()
    with pytest.raises(ValueError, match=rf"^kv-canary: {message}$"):
        ctx.for_endpoint(**change)


@pytest.mark.parametrize(("field", "value", "message"), [
    ("verify_num_valid", np.zeros(2, np.int32), "plan.verify_num_valid must have shape (1,), got (2,) (axis 0)"),
    ("verify_num_valid", np.zeros(1, np.int64), "plan.verify_num_valid must have dtype int32, got int64"),
    ("enable", np.ones(2, np.int32), "plan.enable must have shape (1,), got (2,) (axis 0)"),
    ("verify_prev_slot_indices", np.zeros(3, np.int64),
     "plan.verify_prev_slot_indices must have shape (2,), got (3,) (axis 0)"),
    ("verify_expected_positions", np.zeros(2, np.int32),
     "plan.verify_expected_positions must have dtype int64, got int32"),
], ids=["num_valid-shape", "num_valid-dtype", "enable-shape", "prevs-shape", "positions-dtype"])
def test_verify_refuses_a_plan_field_of_the_wrong_shape_or_dtype_by_its_name(field, value, message):
    ctx = context()
    plan = dataclasses.replace(verify_plan([1, 2], [0, 1], [-1, 1]), **{field: value})
    with pytest.raises(kc.CanaryArgumentError, match="^" + re.escape("kv-canary: " + message) + "$"):
        kc.launch_canary_verify_kernel(context=ctx, plan=plan, check_verify_expected_token=False, backend="numpy")


def test_write_refuses_a_plan_whose_offsets_hold_fewer_than_two_entries_saying_how_many():
    ctx = context()
    plan = dataclasses.replace(write_plan([1], [-1]), write_offsets=np.zeros(1, np.int64))
    with pytest.raises(kc.CanaryArgumentError, match="^" + re.escape(
            "kv-canary: plan.write_offsets must hold write_req_capacity + 1 >= 2 entries, got 1") + "$"):
        kc.launch_canary_write_kernel(context=ctx, plan=plan, input_ids=np.array([5], np.int64),
                                      positions=np.array([0], np.int64), out_cache_loc=np.array([1], np.int64),
                                      enable_write_input_assert=False, backend="numpy")
