"""Run a sliding-window model (``mistral-sw``: every layer; ``gemma3``: sliding-window and full layers alternating,
two KV cache groups) through an in-process vLLM engine without and with the canary, and print what happened as
JSON on a line starting with "RESULT " (one engine per process: vLLM keeps process-wide state).

``python window_run.py MODEL_DIR ARCH SEED KV_BYTES``: the workloads of ``workloads(seed=SEED)`` (mixed lengths,
a shared prefix, more KV than the budget holds, parallel sampling) and long prompts (180 to 240 tokens, a window
of 64), the long ones run twice so that the second run hits the prefix cache (null blocks where the window does
not reach), on a KV cache of ``KV_BYTES``; each without the canary, then with it in ``log`` mode (NumPy backend,
sweep every 2 steps where it is on); then each fault kind of :data:`MODEL_FAULT_KINDS` the model has a target for,
on a fresh install."""

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


if __name__ == "__main__":
    main()
