"""The engine runtime on a GPU with torch tensors: phases 2 and 3 captured in torch CUDA graphs and replayed
over several steps give the same rings as eager execution (and as the NumPy runtime), and no phase of a step
synchronises with the work it enqueued.

Marked ``gpu`` (skipped with a reason where CuPy sees no CUDA device); needs a torch build with CUDA.
"""

from __future__ import annotations

import numpy as np
import pytest
import runtime_scenario as sc

from kvcanary_cupy import RealKvSource
from kvcanary_cupy.runtime import CanaryConfig, CanaryRuntime, Capacities, KvGroup, KvPools, StepBatch

torch = pytest.importorskip("torch")
pytest.importorskip("cupy")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="torch was built without CUDA or sees no GPU"),
]

SLEEP_CYCLES = 500_000_000  # ~0.25 s of GPU spinning, far longer than the host work of any phase
CONFIG = dict(write_input_assert=True, verify_token_assert=True, sweep_interval=2, logger="kvcanary.gpu.test")


class GpuMirror:
    """The toy engine's state as persistent torch CUDA tensors, refreshed in place from the host engine."""

    def __init__(self, engine: sc.ToyEngine) -> None:
        self.engine = engine
        self.req_to_token = torch.from_numpy(engine.req_to_token).cuda()
        self.lut = torch.from_numpy(engine.lut).cuda()
        self.kv = {g: {kv: torch.from_numpy(t).cuda() for kv, t in d.items()} for g, d in engine.kv.items()}

    def refresh(self) -> None:
        self.req_to_token.copy_(torch.from_numpy(self.engine.req_to_token))
        self.lut.copy_(torch.from_numpy(self.engine.lut))
        for g, d in self.engine.kv.items():
            for kv, t in d.items():
                self.kv[g][kv].copy_(torch.from_numpy(t))

    def pools(self) -> KvPools:
        def src(g, kv):
            return (RealKvSource(self.kv[g][kv], page_size=sc.PAGE, num_bytes_per_token=sc.TOKEN_BYTES,
                                 read_bytes=sc.TOKEN_BYTES),)
        return KvPools((KvGroup.full("FULL", sc.NUM_SLOTS, src("FULL", "K"), src("FULL", "V")),
                        KvGroup.swa("SWA", sc.NUM_SLOTS, window=sc.WINDOW, lut=self.lut, k_sources=src("SWA", "K"))),
                       req_to_token=self.req_to_token)


def to_cuda(batch: StepBatch) -> StepBatch:
    return StepBatch(**{k: None if v is None else torch.from_numpy(np.asarray(v)).cuda()
                        for k, v in vars(batch).items()})


def runtime(mirror: GpuMirror) -> CanaryRuntime:
    return CanaryRuntime.create(CanaryConfig(**CONFIG), mirror.pools(), Capacities(max_batch_size=sc.MAX_BS,
                                                                                   max_tokens=sc.MAX_TOKENS),
                                device="cuda", framework="torch", sweep_source=mirror.engine.held)


def padding_batch() -> StepBatch:
    z = np.zeros(1, np.int64)
    return StepBatch(z, z, z, z[:0], z[:0], z[:0], z[:0], z[:0], z, z[:0], np.zeros(1, np.int64), z[:0])


def run(captured: bool, *, check_no_sync: bool = False) -> list:
    engine = sc.ToyEngine(swa=True, with_v=True)
    mirror = GpuMirror(engine)
    rt = runtime(mirror)
    stream = torch.cuda.current_stream()
    # warm-up on an all-padding batch: compiles every kernel (not capture-safe) and writes nothing
    rt.prepare(to_cuda(padding_batch()))
    rt.pre_forward()
    rt.post_forward()
    pre = post = None
    if captured:
        pre, post = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        with torch.cuda.graph(pre):
            rt.pre_forward()
        with torch.cuda.graph(post):
            rt.post_forward()
    rt.finish_step()
    rt.mark_init_finished()
    reports = []
    for t in range(len(sc.SCHEDULE)):
        batch = engine.schedule(t)
        sb = engine.step_batch(batch, oracle=True, tokens=True)
        if t == 3:  # a wrong input token
            sb.input_ids = sb.input_ids.copy()
            sb.input_ids[1] += 5
        mirror.refresh()  # req_to_token and the LUT of this step
        gpu_batch = to_cuda(sb)
        sync_checked(lambda b=gpu_batch: rt.prepare(b), stream, check_no_sync)
        sync_checked(pre.replay if captured else rt.pre_forward, stream, check_no_sync)
        engine.forward(batch, "FULL", ids=sb.input_ids)
        engine.forward(batch, "SWA", ids=sb.input_ids)
        if t == 2:  # a bit flip in a live slot's K
            engine.flip_kv_bit("FULL", engine.slots[1][2])
        mirror.refresh()  # the "forward": real KV lands on the GPU
        sync_checked(post.replay if captured else rt.post_forward, stream, check_no_sync)
        engine.finish_step(t)
        reports.append(sync_checked(rt.finish_step, stream, check_no_sync and t > 0))
    torch.cuda.synchronize()
    reports.append(rt.flush())
    return reports, rt


def sync_checked(phase, stream, check: bool):
    if not check:
        return phase()
    torch.cuda._sleep(SLEEP_CYCLES)
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = phase()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert not stream.query(), f"{phase} waited for the work it follows"
    return out


def rows(reports) -> dict:
    out: dict = {}
    for rep in reports:
        for group, v in rep.new_violations:
            out.setdefault((group, rep.launch_step), []).append(tuple(v.raw))
    return {k: sorted(v) for k, v in out.items()}


def numpy_rows() -> dict:
    engine = sc.ToyEngine(swa=True, with_v=True)
    rt = CanaryRuntime.create(CanaryConfig(**CONFIG), KvPools(
        (KvGroup.full("FULL", sc.NUM_SLOTS, engine.sources("FULL", "K"), engine.sources("FULL", "V")),
         KvGroup.swa("SWA", sc.NUM_SLOTS, window=sc.WINDOW, lut=engine.lut, k_sources=engine.sources("SWA", "K"))),
        req_to_token=engine.req_to_token), Capacities(max_batch_size=sc.MAX_BS, max_tokens=sc.MAX_TOKENS),
        sweep_source=engine.held)
    rt.finish_step()  # the GPU runs spend step 0 on warm-up
    rt.mark_init_finished()
    reports = []
    for t in range(len(sc.SCHEDULE)):
        batch = engine.schedule(t)
        sb = engine.step_batch(batch, oracle=True, tokens=True)
        if t == 3:
            sb.input_ids = sb.input_ids.copy()
            sb.input_ids[1] += 5
        rt.prepare(sb)
        rt.pre_forward()
        engine.forward(batch, "FULL", ids=sb.input_ids)
        engine.forward(batch, "SWA", ids=sb.input_ids)
        if t == 2:
            engine.flip_kv_bit("FULL", engine.slots[1][2])
        rt.post_forward()
        engine.finish_step(t)
        reports.append(rt.finish_step())
    reports.append(rt.flush())
    return rows(reports)


def test_captured_phases_replayed_over_steps_give_the_eager_rings():
    eager, eager_rt = run(captured=False)
    graphed, graphed_rt = run(captured=True)
    assert rows(graphed) == rows(eager) == numpy_rows()
    assert rows(eager)  # the injected faults were found
    for name in ("FULL", "SWA"):
        for a, b in zip(eager_rt.groups[name].all_endpoints(), graphed_rt.groups[name].all_endpoints(), strict=True):
            assert torch.equal(a.verify_ctx.canary_buf, b.verify_ctx.canary_buf)
    assert all(not r.health_problems for r in graphed) and graphed_rt.stats() == eager_rt.stats()


def test_no_phase_synchronises_with_the_work_it_enqueued():
    reports, _ = run(captured=False, check_no_sync=True)
    assert rows(reports) == numpy_rows()
    assert all(not r.health_problems for r in reports)
