"""Run one workload through a fresh in-process vLLM engine whose KV cache has the given ``kv_cache_dtype``, with the
canary (``log`` mode, every K/V byte fingerprinted), then again without it, and print what happened as JSON on a
line starting with "RESULT " (one engine per process: vLLM keeps process-wide state).

``python kv_dtype_run.py MODEL_DIR KV_CACHE_DTYPE WORKLOAD``"""

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
    from kvcanary_cupy.integrations import vllm as kv
    from kvcanary_cupy.integrations.vllm.workloads import engine, workloads

    model_dir, kv_dtype, name = sys.argv[1], sys.argv[2], sys.argv[3]
    # 64 fp32 blocks' worth of bytes: a 1-byte cache holds 256 blocks, so the fp32-geometry writes of the first
    # run's blocks (the lowest ids, about 20) stay inside the layer's tensor; past it they corrupt the process's
    # heap, which is vLLM's bug too but ends the run before it can be read. The canary runs first, on the engine's
    # first blocks: a block's misplaced writes land on blocks four times its id, which that run holds too.
    llm = engine(Path(model_dir), blocks=64, kv_cache_dtype=kv_dtype)
    load = workloads()[name]
    canary = kv.install(llm, backend="numpy", real_kv_hash="all")
    got = load.run(llm)
    canary.finish()
    canary.remove()
    assert llm.reset_prefix_cache()
    want = load.run(llm)
    cache = canary.runner.kv_caches[0]
    print("RESULT " + json.dumps({
        "exact": got == want, "steps": canary.steps, "cache_dtype": str(cache.dtype),
        "violations": len(canary.violations),
        "reasons": sorted({r for v in canary.violations for r in v.violation.reasons}),
        "first_step": min((v.step for v in canary.violations), default=None),
        "disabled": canary.disabled}), flush=True)


if __name__ == "__main__":
    main()
