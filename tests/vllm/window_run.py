"""Run a sliding-window model (``mistral-sw``: every layer; ``gemma3``: sliding-window and full layers alternating,
two KV cache groups) through an in-process vLLM engine without and with the canary, and print what happened as
JSON on a line starting with "RESULT " (one engine per process: vLLM keeps process-wide state).

``python window_run.py MODEL_DIR ARCH SEED KV_BYTES``: the workloads of ``workloads(seed=SEED)`` (mixed lengths,
a shared prefix, more KV than the budget holds, parallel sampling) and long prompts (180 to 240 tokens, a window
of 64), the long ones run twice so that the second run hits the prefix cache (null blocks where the window does
not reach), on a KV cache of ``KV_BYTES``; each without the canary, then with it in ``log`` mode (NumPy backend,
sweep every 2 steps); then, on that install, one bit flipped in a cached block of each KV cache group (a block
vLLM's block pool holds cached for that group and frees last, K of head 0, element 0 of one token) and a short
request run until the sweeps have covered every indexed block: what the canary finds then; then each fault kind of
:data:`MODEL_FAULT_KINDS` the model has a target for, on a fresh install."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout's package, not an installed one
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
os.environ.pop("KVCANARY_VLLM", None)


def main() -> None:
    import numpy as np
    from vllm import LLM

    from kvcanary_cupy.integrations import vllm as kv
    from kvcanary_cupy.integrations.vllm.faults import MODEL_FAULT_KINDS, injector
    from kvcanary_cupy.integrations.vllm.workloads import ENGINE_ARGS, Workload, arch_engine_args, save_arch, workloads

    model_dir, arch, seed, kv_bytes = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    save_arch(model_dir, arch)
    llm = LLM(model=str(model_dir), **{**ENGINE_ARGS, **arch_engine_args(arch), "kv_cache_memory_bytes": kv_bytes})
    loads = workloads(seed=seed)
    rng = np.random.default_rng(1000 + seed)
    long = [tuple(rng.integers(3, 512, n).tolist()) for n in rng.integers(180, 241, 3)]
    loads["long-prompt"] = Workload("long-prompt", "prompts of 180 to 240 tokens, one repeated", (*long, long[0]),
                                    16)
    names = ["mixed-lengths", "shared-prefix", "preemption", "parallel-sampling", "long-prompt"]

    def run_all() -> dict[str, list]:
        out = {}
        for name in names:
            assert llm.reset_prefix_cache()
            out[name] = loads[name].run(llm)
        out["long-prompt-again"] = loads["long-prompt"].run(llm)  # hits what the run before cached
        return out

    want = run_all()
    canary = kv.install(llm, backend="numpy", sweep_interval=2)
    got = run_all()
    canary.finish()
    state = canary.state
    result = {
        "groups": [[g.spec, g.checked, g.real_kv] for g in canary.support.groups],
        "windows": [] if state is None else [geo.window for geo in state.geos],
        "disabled": canary.disabled,
        "exact": {name: got[name] == want[name] for name in want},
        "violations": [[v.step, v.group, list(v.violation.reasons)] for v in canary.violations][:20],
        "health": [str(p) for p in (state.health_problems if state else [])][:5],
        "dropped": 0 if state is None else state.dropped,
        "steps": canary.steps,
        "preemptions": canary.preemptions,
        "counters": {} if state is None else state.counters(),
        "sweep_interval": None if state is None else int(state.rt.config.sweep_interval),
        "swept_slots": 0 if state is None else int(state.rt.stats()["swept_slots"]),
    }
    result["planted"] = None if state is None else plant_and_sweep(llm, canary, seed)
    canary.remove()

    faults = {}
    for i, kind in enumerate(MODEL_FAULT_KINDS):
        assert llm.reset_prefix_cache()
        canary = kv.install(llm, backend="numpy")
        fault = injector(kind, 2, seed=seed * 10 + i)
        canary.observers.append(fault)
        loads["mixed-lengths"].run(llm)
        canary.finish()
        canary.remove()
        faults[kind] = {
            "injected": None if fault.fault is None else [fault.fault.step, fault.fault.slot, fault.fault.detail],
            "found": sorted({(v.step, v.group, v.violation.slot, r) for v in canary.violations
                             for r in v.violation.reasons})[:40]}
    result["faults"] = faults
    print("RESULT " + json.dumps(result), flush=True)


def plant_and_sweep(llm, canary, seed: int) -> dict:
    """Flip one bit of a cached block of each checked group, run one short unrelated request for as many steps as
    the sweep needs to cover every indexed block (twice over), flip the bits back. Returns, per group, the slot
    hit and what the canary reported meanwhile (each distinct launch tag, slot and reason of the group's rows), and
    how many rows it reported in all."""
    import numpy as np
    import torch
    from vllm import SamplingParams
    from vllm.v1.core.kv_cache_utils import get_group_id

    from kvcanary_cupy.integrations.vllm.blocks import sweep_latency_steps

    state = canary.state
    pool = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager.block_pool
    free = pool.free_block_queue.get_all_free_blocks()  # least recently freed first: evicted first
    rng = np.random.default_rng(2000 + seed)
    flips, out = [], {}
    for geo in state.geos:
        cached = [b.block_id for b in free if b.block_id != 0 and b.block_hash is not None
                  and get_group_id(b.block_hash) == geo.index]
        indexed = set(state.block_index.indexed(geo.index).tolist())
        late = [b for b in cached[len(cached) // 2:] if b in indexed]  # freed late: not evicted by the request
        out[geo.name] = {"cached": len(cached), "candidates": len(late), "slot": None}
        if not late:
            continue
        block, offset = int(rng.choice(late)), int(rng.integers(0, geo.block_size))
        # vLLM's CPU `vec` layout: per (block, head) K column-major [head_size, block_size], so K element 0 of
        # token `offset` is element `offset` of the plane's first row
        element = geo.caches[0][block, 0, 0, offset:offset + 1].view(torch.uint8)
        bit = int(rng.integers(0, 8 * element.numel()))
        element[bit // 8] ^= 1 << (bit % 8)
        flips.append((element, bit))
        out[geo.name]["slot"] = block * geo.block_size + offset
    before = len(canary.violations)
    most = max(len(state.block_index.indexed(geo.index)) for geo in state.geos)
    steps = 2 * sweep_latency_steps(most, state.block_index.blocks_per_sweep, int(state.rt.config.sweep_interval))
    prompt = rng.integers(3, 512, 4).tolist()
    llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=min(steps + 2, 200), temperature=0.0,
                                                                ignore_eos=True), use_tqdm=False)
    canary.finish()
    for element, bit in flips:
        element[bit // 8] ^= 1 << (bit % 8)
    found = canary.violations[before:]
    for name in out:
        out[name]["found"] = sorted({(v.violation.launch_tag, v.violation.slot, r) for v in found
                                     if v.group.split(":")[0] == name for r in v.violation.reasons})[:20]
    out["steps"] = steps
    out["rows"] = len(found)
    out["groups_with_rows"] = sorted({v.group.split(":")[0] for v in found})
    return out


if __name__ == "__main__":
    main()
