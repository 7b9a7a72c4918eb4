"""Run the DeepSeek-style MLA model through an in-process vLLM engine with the canary reading every byte of the
latent cache, then flip one bit of a finished token's latent row, and print what happened as JSON on a line
starting with "RESULT " (one engine per process: vLLM keeps process-wide state).

``python mla_run.py MODEL_DIR SEED,SEED,... [DTYPE]`` (DTYPE float32 by default; vLLM's CPU_MLA backend): the
clean workloads without the canary, then with it (``log`` mode, ``real_kv_hash="all"``, backend numpy); then, per
seed, the ``mixed-lengths`` workload again with one bit flipped after a forward at step ``2 + SEED % 5``, in the
latent row of an earlier token of a decoding request, in a layer, byte and bit drawn from SEED."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout's package, not an installed one
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
os.environ.pop("KVCANARY_VLLM", None)

import numpy as np


class LatentBitflip:
    """After the forward of step ``at`` (or the first later step with a decoding request), flip one bit of the
    latent row of an earlier token of a decoding request, in one layer's cache, in place."""

    def __init__(self, at: int, seed: int) -> None:
        self.at = at
        self.rng = np.random.default_rng(seed)
        self.fault: dict[str, Any] | None = None

    def before_forward(self, canary: Any, step: int, kwargs: dict[str, Any], metadata: dict[str, Any]) -> None:
        pass

    def after_forward(self, canary: Any, step: int, batch: Any) -> None:
        import torch

        if self.fault is not None or step < self.at:
            return
        geo = canary.state.geos[0]
        for i, rid in enumerate(batch.request_ids):
            done = int(batch.prefix_lens[i] + batch.extend_lens[i])
            if int(batch.extend_lens[i]) != 1 or done < 2:
                continue
            position = int(self.rng.integers(0, done - 1))
            slot = int(batch.slot(geo, i, position))
            layer = int(self.rng.integers(0, len(geo.caches)))
            cache = geo.caches[layer]
            block, offset = divmod(slot, geo.block_size)
            row = cache[block, offset].view(torch.uint8)  # the token's latent row, as bytes, in place
            byte = int(self.rng.integers(0, row.shape[0]))
            bit = int(self.rng.integers(0, 8))
            row[byte] ^= 1 << bit
            self.fault = {"step": step + 1, "request": rid, "position": position, "slot": slot, "layer": layer,
                          "byte": byte, "bit": bit}
            return


def main() -> None:
    from vllm import LLM

    from kvcanary_cupy.integrations import vllm as kv
    from kvcanary_cupy.integrations.vllm.workloads import ENGINE_ARGS, arch_engine_args, save_arch, workloads

    model_dir, seeds = Path(sys.argv[1]), [int(seed) for seed in sys.argv[2].split(",")]
    dtype = sys.argv[3] if len(sys.argv) > 3 else "float32"
    save_arch(model_dir, "deepseek-mla")
    # 48 blocks of 16 tokens (two layers of 576 fp32 per token): the 768-token budget the preemption workload is
    # sized for (vLLM's CPU_MLA forces chunked prefill and prefix caching off, so the other workloads run whole)
    llm = LLM(model=str(model_dir), **{**ENGINE_ARGS, **arch_engine_args("deepseek-mla"),
                                      "dtype": dtype, "kv_cache_memory_bytes": 48 * 16 * 2 * 576 * 4})
    loads = workloads()
    names = ["mixed-lengths", "shared-prefix", "preemption"]
    want = {}
    for name in names:
        assert llm.reset_prefix_cache()
        want[name] = loads[name].run(llm)
    runner = kv.find_runner(llm)
    canary = kv.install(llm, backend="numpy", real_kv_hash="all", sweep_interval=2)
    got = {}
    for name in names:
        assert llm.reset_prefix_cache()
        got[name] = loads[name].run(llm)
    canary.finish()
    state = canary.state
    result: dict[str, Any] = {
        "groups": [[g.spec, g.checked, g.real_kv] for g in canary.support.groups],
        "cache_shapes": [list(c.shape) for c in state.geos[0].caches],
        "exact": {name: got[name] == want[name] for name in names},
        "violations": [[v.step, v.group, list(v.violation.reasons)] for v in canary.violations][:20],
        "steps": canary.steps,
        "layers": len(state.geos[0].caches),
        "runner": type(runner).__name__,
    }
    canary.remove()

    result["faults"] = []
    for seed in seeds:
        assert llm.reset_prefix_cache()
        canary = kv.install(llm, backend="numpy", real_kv_hash="all")
        fault = LatentBitflip(2 + seed % 5, seed)
        canary.observers.append(fault)
        loads["mixed-lengths"].run(llm)
        canary.finish()
        canary.remove()
        result["faults"].append({"seed": seed, "fault": fault.fault, "violations": [
            [v.step, list(v.violation.reasons), v.violation.slot, v.violation.position]
            for v in canary.violations][:20]})
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
