"""A 6-layer model in a fresh in-process vLLM engine (one engine per process): its KV cache group becomes two
runtime groups, layers 0-3 and 4-5, the second sharing the first's plan. Runs a workload with the canary and
without it, then corrupts one cached block's bytes in one layer and hits it again; prints JSON on a line starting
with "RESULT ".

``python deep_run.py MODEL_DIR LAYER SEED``"""

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
    from vllm import SamplingParams

    from kvcanary_cupy.integrations import vllm as kv
    from kvcanary_cupy.integrations.vllm.workloads import KV_BLOCKS, MODEL_SIZES, engine, workloads

    model_dir, layer, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    # the small model's KV budget per block is for its own layers: scaled to give KV_BLOCKS blocks of 6 layers
    scale = -(-6 // MODEL_SIZES["small"]["num_hidden_layers"])
    llm = engine(Path(model_dir), "small", KV_BLOCKS * scale)
    load = workloads()["shared-prefix"]
    want = load.run(llm)
    assert llm.reset_prefix_cache()
    canary = kv.install(llm, backend="host", sweep_interval=4)
    got = load.run(llm)
    canary.finish()
    clean = [(v.step, v.group) for v in canary.violations]
    groups = sorted(canary.state.rt.groups)
    leaders = {name: g.plan_name for name, g in canary.state.rt.groups.items()}
    # a prompt of 3 complete blocks, cached; then one byte of every slot of its second block in one layer flipped
    prompt = np.random.default_rng(seed).integers(3, 500, 100).tolist()
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    canary.finish()  # the last step's TAIL work done: its step counted
    runner = canary.runner
    block = runner.cache_config.block_size
    cache = canary.state.geos[0].caches[layer]
    start = canary.steps
    hit = {}

    class FlipOnHit:
        """At the hit's first step, before its forward: flip the K bytes of the prompt's second block."""

        def before_forward(self, canary, step, kwargs, metadata):
            if step == start and not hit:
                table = metadata[canary.state.geos[0].layer_names[0]].block_table
                hit["block"] = int(table[0, 1])
                cache[hit["block"]].view(-1)[: block].add_(1.0)

        def after_forward(self, canary, step, batch):
            pass

    canary.observers.append(FlipOnHit())
    llm.generate([{"prompt_token_ids": [*prompt, 7, 8, 9]}], params, use_tqdm=False)
    canary.finish()
    rows = [v for v in canary.violations if v.step >= start]
    canary.remove()
    print("RESULT " + json.dumps({
        "exact": got == want, "steps": start, "clean_rows": clean, "groups": groups, "leaders": leaders,
        "block": hit.get("block"), "block_size": block, "start": start,
        "rows": [(v.step, v.group, v.violation.slot, v.violation.launch_tag, list(v.violation.reasons))
                 for v in rows]}), flush=True)


if __name__ == "__main__":
    main()
