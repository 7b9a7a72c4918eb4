"""torch CUDA tensors through the ``cuda`` backend: bit-identical to the NumPy reference, on torch's current
stream, and capturable in a torch CUDA graph once bound (kvcanary_cupy.bind).

Every test is marked ``gpu`` (the suite's conftest skips them with a reason where CuPy sees no CUDA device) and
additionally needs a torch build with CUDA.
"""

from __future__ import annotations

import numpy as np
import pytest
import strategies
from differential import SENTINEL, ChainResult, chain_results_equal, run_chain, run_plan
from engine_scenario import RTT, STEPS, Engine, to_numpy
from engine_scenario import SENTINEL as SCENARIO_SENTINEL
from hypothesis import given, settings
from plan_helpers import linear_rtt

import kvcanary_cupy as kc
from kvcanary_cupy import dlpack as dlpack_module
from kvcanary_cupy.bind import bind_plan, bind_scatter, bind_verify, bind_write
from kvcanary_cupy.context import RealKvSource
from kvcanary_cupy.dlpack import as_array, as_byte_rows

torch = pytest.importorskip("torch")
cp = pytest.importorskip("cupy")
sg = pytest.importorskip("kvcanary_cupy.compat.sglang")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="torch was built without CUDA or sees no GPU"),
]

DEV = "cuda"
SLEEP_CYCLES = 500_000_000  # ~0.25 s of GPU spinning: far longer than the host work of one launch


def on_gpu(arr, device=DEV):
    return None if arr is None else torch.from_numpy(np.array(arr, copy=True)).to(device)


def host(t) -> np.ndarray:
    return t.detach().cpu().numpy().copy()


def gpu_plans(capacity: int, write_capacity: int, fill: int = SENTINEL):
    vp = sg.VerifyPlan.allocate(verify_capacity=capacity, device=DEV)
    wp = sg.WritePlan.allocate(write_req_capacity=write_capacity, device=DEV)
    for t in (*vars(vp).values(), *vars(wp).values()):
        t.fill_(fill)
    return vp, wp


def plan_dict(vp, wp) -> dict[str, np.ndarray]:
    return {**{f"verify.{k}": host(v) for k, v in vars(vp).items()},
            **{f"write.{k}": host(v) for k, v in vars(wp).items()}}


def assert_same_plan(got, want) -> None:
    for name in want:
        if name == "write.verify_offsets":  # scratch: only [0, bs] is defined by the contract
            continue
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


# --- the bridge on CUDA tensors ------------------------------------------------------------------------------

def test_a_torch_cuda_tensor_becomes_a_cupy_view_of_the_same_memory_and_back():
    t = torch.arange(8, dtype=torch.int64, device=DEV)
    view = as_array(t, "t", writable=True)
    assert isinstance(view, cp.ndarray) and int(view.data.ptr) == t.data_ptr()
    view[3] = -1
    torch.cuda.synchronize()
    assert int(t[3]) == -1
    back = torch.from_dlpack(view)
    assert back.data_ptr() == t.data_ptr() and back.device == t.device


def test_byte_rows_of_a_cuda_bfloat16_pool_layer_are_a_cupy_view():
    pool = torch.zeros(6, 2, 64, dtype=torch.bfloat16, device=DEV)
    rows = as_byte_rows(pool[:, 1], "layer")
    assert isinstance(rows, cp.ndarray) and rows.shape == (6, 128) and rows.strides == (256, 1)
    assert int(rows.data.ptr) == pool.data_ptr() + 128


def test_mixing_torch_cpu_and_cuda_tensors_names_both_and_writes_nothing():
    vp, wp = gpu_plans(8, 2)
    before = plan_dict(vp, wp)
    with pytest.raises(ValueError, match=r"kv-canary: prefix_lens is on cpu but req_pool_indices is on cuda:0"):
        kc.launch_canary_plan_kernels(
            verify_plan_out=vp, write_plan_out=wp, req_pool_indices=on_gpu(np.array([1, 2])),
            prefix_lens=torch.tensor([1, 2]), extend_seq_lens=on_gpu(np.array([1, 1])),
            req_to_token=on_gpu(linear_rtt(4, 8)), swa_window_size=0, full_to_swa_index_mapping=None,
            verify_capacity=8)
    after = plan_dict(vp, wp)
    for name in before:
        np.testing.assert_array_equal(after[name], before[name], err_msg=name)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_mixing_two_gpus_names_both():
    vp, wp = gpu_plans(8, 2)
    with pytest.raises(ValueError, match=r"kv-canary: req_to_token is on cuda:1 but req_pool_indices is on cuda:0"):
        kc.launch_canary_plan_kernels(
            verify_plan_out=vp, write_plan_out=wp, req_pool_indices=on_gpu(np.array([1, 2])),
            prefix_lens=on_gpu(np.array([1, 2])), extend_seq_lens=on_gpu(np.array([1, 1])),
            req_to_token=on_gpu(linear_rtt(4, 8), "cuda:1"), swa_window_size=0, full_to_swa_index_mapping=None,
            verify_capacity=8)


# --- bit-identical to the NumPy reference --------------------------------------------------------------------

@settings(max_examples=80, deadline=None)
@given(strategies.plan_cases(max_bs=12, hostile=True))
def test_plan_on_torch_cuda_tensors_matches_the_numpy_reference(case):
    vp, wp = gpu_plans(case.kwargs["verify_capacity"], case.write_req_capacity)
    kwargs = {k: on_gpu(v) if isinstance(v, np.ndarray) else v for k, v in case.kwargs.items()}
    kc.launch_canary_plan_kernels(verify_plan_out=vp, write_plan_out=wp, **kwargs, on_invalid="flag")
    torch.cuda.current_stream().synchronize()
    assert_same_plan(plan_dict(vp, wp), run_plan("numpy", case))


@settings(max_examples=40, deadline=None)
@given(strategies.plan_cases(max_bs=12))
def test_compat_plan_launcher_on_cuda_matches_the_numpy_reference(case):
    vp, wp = gpu_plans(case.kwargs["verify_capacity"], case.write_req_capacity)
    kwargs = {k: on_gpu(v) if isinstance(v, np.ndarray) else v for k, v in case.kwargs.items()}
    sg.launch_canary_plan_kernels(verify_plan_out=vp, write_plan_out=wp, **kwargs)
    torch.cuda.current_stream().synchronize()
    assert_same_plan(plan_dict(vp, wp), run_plan("numpy", case))


@settings(max_examples=25, deadline=None)
@given(strategies.plan_cases(max_bs=12))
def test_compat_torch_reference_writes_back_into_cuda_plans(case):
    vp, wp = gpu_plans(case.kwargs["verify_capacity"], case.write_req_capacity)
    kwargs = {k: on_gpu(v) if isinstance(v, np.ndarray) else v for k, v in case.kwargs.items()}
    sg.launch_canary_plan_kernels_torch_reference(verify_plan_out=vp, write_plan_out=wp, **kwargs)
    assert_same_plan(plan_dict(vp, wp), run_plan("numpy", case))


def chain_snapshot(ctx, ring_start: int) -> ChainResult:
    index = int(ctx.violation_write_index[0])
    end = min(max(index, 0), ctx.violation_ring.shape[0])
    ring = host(ctx.violation_ring)
    return ChainResult(canary=host(ctx.canary_buf), ring=ring, rows=ring[max(ring_start, 0):end].tolist(),
                       landed=(max(ring_start, 0), max(end, 0)), write_index=index,
                       slot_run_counter=int(ctx.slot_run_counter[0]),
                       kernel_run_counter=int(ctx.kernel_run_counter[0]), status=int(ctx.status[0]))


@settings(max_examples=60, deadline=None)
@given(strategies.chain_cases(hostile=True))
def test_write_then_verify_on_torch_cuda_tensors_matches_the_numpy_reference(case):
    sources = [on_gpu(arr).view(torch.bfloat16) for arr, *_ in case.sources]  # bf16 pools, fingerprinted as bytes
    ctx = sg.VerifyOrWriteContext(
        canary_buf=on_gpu(case.canary_buf), kernel_kind=case.tag, violation_ring=on_gpu(case.ring),
        violation_write_index=on_gpu(np.array([case.write_index], np.int32)),
        slot_run_counter=on_gpu(np.array([case.slot_run_counter], np.int64)),
        kernel_run_counter=on_gpu(np.array([case.kernel_run_counter], np.int64)),
        real_kv_sources=tuple(RealKvSource(t, page_size=p, num_bytes_per_token=n, read_bytes=r)
                              for t, (_, p, n, r) in zip(sources, case.sources, strict=True)),
        real_kv_hash_mode=kc.RealKvHashMode(case.mode),
        enable_chain_position_assert=on_gpu(np.array([case.enable_chain_position_assert], np.int32)),
        status=on_gpu(np.array([case.status], np.int32)))
    wp = sg.WritePlan(write_offsets=on_gpu(case.write_offsets),
                      write_seed_slot_indices=on_gpu(case.write_seed_slot_indices),
                      write_num_valid_reqs=on_gpu(np.array([case.write_num_valid_reqs], np.int32)))
    kc.launch_canary_write_kernel(
        context=ctx, plan=wp, input_ids=on_gpu(case.input_ids), positions=on_gpu(case.positions),
        out_cache_loc=on_gpu(case.out_cache_loc), enable_write_input_assert=case.enable_write_input_assert,
        expected_input_tokens=on_gpu(case.expected_input_tokens),
        expected_input_positions=on_gpu(case.expected_input_positions), on_invalid="flag")
    after_write = chain_snapshot(ctx, case.write_index)
    # corrupt on the host, then refill the device buffers in place
    canary = host(ctx.canary_buf)
    source_bytes = [(host(s.view(torch.uint8)), *rest) for s, (_, *rest) in zip(sources, case.sources, strict=True)]
    case.apply_corruptions(canary, source_bytes)
    ctx.canary_buf.copy_(torch.from_numpy(canary))
    for s, (arr, *_) in zip(sources, source_bytes, strict=True):
        s.view(torch.uint8).copy_(torch.from_numpy(arr))
    vp = sg.VerifyPlan(
        verify_slot_indices=on_gpu(case.verify_slot_indices),
        verify_expected_tokens=on_gpu(case.verify_expected_tokens),
        verify_expected_positions=on_gpu(case.verify_expected_positions),
        verify_prev_slot_indices=on_gpu(case.verify_prev_slot_indices),
        verify_num_valid=on_gpu(np.array([case.verify_num_valid], np.int32)),
        enable=on_gpu(np.array([case.enable], np.int32)))
    kc.launch_canary_verify_kernel(context=ctx, plan=vp, check_verify_expected_token=case.check_verify_expected_token,
                                   on_invalid="flag")
    after_verify = chain_snapshot(ctx, after_write.write_index)
    want_write, want_verify = run_chain("numpy", case)
    chain_results_equal(after_write, want_write)
    chain_results_equal(after_verify, want_verify)


# --- streams ---------------------------------------------------------------------------------------------------

def ordered_plan_inputs():
    """Inputs whose correct values exist only after a slow torch producer on the launching stream. Everything
    that needs a host round trip (H2D copies, pinned allocation, first-time compilation) happens here, before
    the producer starts, so that nothing but the producer and the plan sits on the stream."""
    inputs = {
        "rpi": torch.zeros(2, dtype=torch.int64, device=DEV),
        "prefix": torch.zeros(2, dtype=torch.int64, device=DEV),
        "extend": torch.zeros(2, dtype=torch.int64, device=DEV),
        "rtt": on_gpu(linear_rtt(4, 16)),
        "rpi_source": torch.tensor([1, 3], device=DEV),
        "slots": torch.zeros(16, dtype=torch.int64, device="cpu").pin_memory(),
    }
    vp, wp = gpu_plans(16, 2, fill=0)
    kc.launch_canary_plan_kernels(**ordered_plan_kwargs(inputs, vp, wp))  # warm-up: compiles the plan kernels
    torch.cuda.synchronize()
    for t in (*vars(vp).values(), *vars(wp).values()):
        t.zero_()
    torch.cuda.synchronize()
    return inputs, vp, wp


def ordered_plan_kwargs(inputs, vp, wp) -> dict:
    return {"verify_plan_out": vp, "write_plan_out": wp, "req_pool_indices": inputs["rpi"],
            "prefix_lens": inputs["prefix"], "extend_seq_lens": inputs["extend"], "req_to_token": inputs["rtt"],
            "swa_window_size": 0, "full_to_swa_index_mapping": None, "verify_capacity": 16}


def produce_slowly(inputs) -> None:
    """torch kernels on the current stream, all asynchronous: a long spin, then the real batch."""
    torch.cuda._sleep(SLEEP_CYCLES)
    inputs["rpi"].copy_(inputs["rpi_source"])
    inputs["prefix"].fill_(5)
    inputs["extend"].fill_(1)


def expected_ordered_plan():
    rtt = linear_rtt(4, 16)
    return [int(rtt[1, p]) for p in range(5)] + [int(rtt[3, p]) for p in range(5)]


def test_launch_on_a_non_default_torch_stream_is_ordered_after_its_producers():
    inputs, vp, wp = ordered_plan_inputs()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        produce_slowly(inputs)
        kc.launch_canary_plan_kernels(**ordered_plan_kwargs(inputs, vp, wp))
        inputs["slots"].copy_(vp.verify_slot_indices, non_blocking=True)
    # Still spinning: the plan was queued behind the producer. Had it gone to another stream, it would have
    # run at once on the zeroed inputs and the copy below would read an empty plan.
    assert not side.query()
    side.synchronize()  # only this stream: no device-wide synchronisation
    assert inputs["slots"][:10].tolist() == expected_ordered_plan()


def test_a_bound_launch_runs_on_the_torch_stream_current_at_call_time():
    inputs, vp, wp = ordered_plan_inputs()
    plan = bind_plan(**ordered_plan_kwargs(inputs, vp, wp))  # bound while the default stream is current
    assert plan.follows_torch_stream
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        produce_slowly(inputs)
        plan()
        inputs["slots"].copy_(vp.verify_slot_indices, non_blocking=True)
    assert not side.query()
    side.synchronize()
    assert inputs["slots"][:10].tolist() == expected_ordered_plan()
    assert (torch.cuda.current_device(), side.cuda_stream) in dlpack_module._CUPY_STREAMS


# --- CUDA graphs -----------------------------------------------------------------------------------------------

def context_state(engine: Engine) -> ChainResult:
    ctx = engine.ctx
    index = int(to_numpy(ctx.violation_write_index)[0])
    ring = to_numpy(ctx.violation_ring)
    end = min(max(index, 0), ring.shape[0])
    return ChainResult(canary=to_numpy(ctx.canary_buf), ring=ring, rows=ring[:end].tolist(), landed=(0, end),
                       write_index=index, slot_run_counter=int(to_numpy(ctx.slot_run_counter)[0]),
                       kernel_run_counter=int(to_numpy(ctx.kernel_run_counter)[0]),
                       status=int(to_numpy(ctx.status)[0]))


def numpy_engine() -> Engine:
    return Engine(lambda a: np.array(a, copy=True), chain_assert=1)


def cuda_engine(chain_assert: int) -> Engine:
    return Engine(on_gpu, chain_assert=chain_assert)


def reference_step(engine: Engine, step: int, plan_only: bool = False) -> None:
    engine.refill(step)
    kc.launch_canary_plan_kernels(**engine.plan_kwargs())
    if not plan_only:
        kc.launch_canary_verify_kernel(**engine.verify_kwargs())
        kc.launch_canary_write_kernel(**engine.write_kwargs())


def assert_same_plan_state(got: dict, want: dict, step: int) -> None:
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=f"step {step}: {name}")


def warm_up(*launches) -> None:
    """First calls outside capture (they compile the kernels), on a side stream as torch recommends."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for launch in launches:
            launch()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()


def reset_plans(engine: Engine) -> None:
    """Back to the fill the scenario's engines start from (the reference engine's plans hold it too)."""
    for t in (*vars(engine.vp).values(), *vars(engine.wp).values()):
        t.fill_(SCENARIO_SENTINEL)


def test_a_bound_plan_launch_captured_in_a_cuda_graph_replays_on_refilled_inputs():
    engine, reference = cuda_engine(chain_assert=1), numpy_engine()
    plan = bind_plan(**engine.plan_kwargs())
    warm_up(plan)
    reset_plans(engine)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        plan()
    for step in range(len(STEPS)):
        engine.refill(step)
        graph.replay()
        torch.cuda.current_stream().synchronize()
        reference_step(reference, step, plan_only=True)
        assert_same_plan_state(engine.plan_state(), reference.plan_state(), step)


def test_plan_verify_write_captured_in_a_cuda_graph_replay_like_the_reference():
    engine, reference = cuda_engine(chain_assert=0), numpy_engine()
    launches = (bind_plan(**engine.plan_kwargs()), bind_verify(**engine.verify_kwargs()),
                bind_write(**engine.write_kwargs()))
    warm_up(*launches)  # writes warm-up canaries, which the reset below discards
    reset_plans(engine)
    ctx = engine.ctx
    for t in (ctx.canary_buf, ctx.violation_ring, ctx.violation_write_index, ctx.slot_run_counter,
              ctx.kernel_run_counter, ctx.status):
        t.zero_()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for launch in launches:
            launch()
    ctx.enable_chain_position_assert.fill_(1)  # a device flag: read at replay time, not baked at capture
    for step in range(len(STEPS)):
        if step == 3:  # corrupt request 1's token at position 2 in both: TOKEN on it, CHAIN on its successor
            engine.corrupt_token(int(RTT[1, 2]), -12345)
            reference.corrupt_token(int(RTT[1, 2]), -12345)
        engine.refill(step)
        graph.replay()
        torch.cuda.current_stream().synchronize()
        reference_step(reference, step)
        assert_same_plan_state(engine.plan_state(), reference.plan_state(), step)
        chain_results_equal(context_state(engine), context_state(reference))
    assert int(ctx.violation_write_index) == 2
    assert int(ctx.kernel_run_counter) == 2 * len(STEPS)  # verify + write, once per replay


def test_a_bound_scatter_captured_in_a_cuda_graph_replays_on_refilled_inputs():
    flat, offsets, rpi = (torch.zeros(n, dtype=torch.int64, device=DEV) for n in (6, 3, 2))
    pool = torch.full((4, 5), -1, dtype=torch.int32, device=DEV)
    scatter = bind_scatter(flat_in=flat, offsets=offsets, req_pool_indices=rpi, pool_out=pool)
    warm_up(scatter)
    pool.fill_(-1)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        scatter()
    want = np.full((4, 5), -1, np.int32)
    for values, offs, rows in [([1, 2, 3, 4, 5, 6], [0, 2, 6], [1, 3]), ([9, 8, 7, 6, 5, 4], [0, 6, 6], [2, 1])]:
        flat.copy_(torch.tensor(values))
        offsets.copy_(torch.tensor(offs))
        rpi.copy_(torch.tensor(rows))
        graph.replay()
        torch.cuda.current_stream().synchronize()
        kc.launch_scatter_req_token_ids(flat_in=np.array(values, np.int64), offsets=np.array(offs, np.int64),
                                        req_pool_indices=np.array(rows, np.int64), pool_out=want)
        np.testing.assert_array_equal(host(pool), want)


def test_the_torch_reference_refuses_a_real_capture():
    vp, wp = gpu_plans(8, 2)
    kwargs = {
        "req_pool_indices": on_gpu(np.array([1, 2])), "prefix_lens": on_gpu(np.array([2, 1])),
        "extend_seq_lens": on_gpu(np.array([1, 1])), "req_to_token": on_gpu(linear_rtt(4, 8)),
        "swa_window_size": 0, "full_to_swa_index_mapping": None, "verify_capacity": 8,
        "req_to_verify_expected_tokens": None, "req_to_verify_expected_tokens_valid_lens": None,
        "kv_token_id_vs_position_offset": 0,
    }
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match=r"must not run under CUDA-graph capture"):
        with torch.cuda.graph(graph):
            sg.launch_canary_plan_kernels_torch_reference(verify_plan_out=vp, write_plan_out=wp, **kwargs)
    assert not torch.cuda.is_current_stream_capturing()
