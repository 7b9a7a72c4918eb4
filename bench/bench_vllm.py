"""The canary's share of vLLM's generation wall time (vLLM's CPU build, in-process engine, random weights).

The measured run: one ``LLM.generate`` of 8 requests x 256-token prompts + 64 new tokens (greedy, ``ignore_eos``)
on a ~57M-parameter Llama (hidden 768, 8 layers, 4 KV heads of 64, vocab 4096; fp32, block size 32, 128 KV blocks,
vLLM's default chunked prefill), real-KV hashing PARTIAL over every layer's K and V. Per backend (NumPy, host) one
run with the canary first loads its kernels (its setup time is reported apart, ``first_run_setup_s``); then rounds
of one run without and one with the canary (the prefix cache reset before each, so every round computes
everything; the canary's run second in even rounds and first in odd ones), at least 5; the figure is the median of
the per-round ratios with/without, with its spread (min, max), next to the canary's own phase timers (what
dominates).

vLLM keeps process-wide state (one engine per process), so the measurement runs in a subprocess of its own:
``python bench/bench_vllm.py [--tiny] [--rounds N]`` prints one JSON object. Under ``--benchmark-disable``
(``make test``) the pytest row runs the tiny model once (2 requests x 16 + 4 tokens); ``make bench-vllm`` runs the
full size.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

FULL = dict(size="medium", requests=8, prompt=256, new=64, blocks=128, rounds=5)
TINY = dict(size="small", requests=2, prompt=16, new=4, blocks=24, rounds=1)


def measure(spec: dict[str, Any], backends: list[str]) -> dict[str, Any]:
    import numpy as np
    from vllm import SamplingParams

    from kvcanary_cupy.backends import unavailable_reason
    from kvcanary_cupy.integrations.vllm import CanaryOptions, install
    from kvcanary_cupy.integrations.vllm.workloads import MODEL_SIZES, engine, num_params, save_llama

    model_dir = save_llama(Path(tempfile.gettempdir()) / f"kvcanary-vllm-{spec['size']}", spec["size"])
    llm = engine(model_dir, spec["size"], spec["blocks"], max_model_len=512, max_num_batched_tokens=2048)
    rng = np.random.default_rng(0)
    vocab = MODEL_SIZES[spec["size"]]["vocab_size"]
    prompts = [{"prompt_token_ids": rng.integers(3, vocab, spec["prompt"]).tolist()} for _ in range(spec["requests"])]
    params = SamplingParams(max_tokens=spec["new"], temperature=0.0, ignore_eos=True)

    def run(backend: str | None) -> tuple[float, dict[str, float], list[list[int]]]:
        assert llm.reset_prefix_cache()
        canary = install(llm, CanaryOptions(backend=backend, real_kv_hash="partial", with_v=True,
                                            sweep_interval=0)) if backend else None
        start = time.perf_counter()
        out = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - start
        phases: dict[str, float] = {}
        if canary is not None:
            canary.finish()
            canary.remove()
            assert canary.violations == [], canary.violations[:3]
            phases = dict(canary.state.seconds) if canary.state else {}
        return wall, phases, [list(o.outputs[0].token_ids) for o in out]

    run(None)  # warm-up (first-call allocations)
    result: dict[str, Any] = {"params": num_params(spec["size"]), "spec": spec, "backends": {}}
    for backend in backends:
        reason = unavailable_reason(backend)
        if reason is not None:
            result["backends"][backend] = {"skipped": reason}
            continue
        # The first run with the canary in a process loads (or compiles) its kernels: a one-time cost, reported
        # on its own, outside the rounds.
        _, first_phases, _ = run(backend)
        ratios, offs, ons, shares = [], [], [], []
        phase_sum: dict[str, float] = {}
        for i in range(spec["rounds"]):
            # Every other round runs the canary first, so a drift of the machine's speed cancels between rounds.
            if i % 2 == 0:
                off, _, want = run(None)
                on, phases, got = run(backend)
            else:
                on, phases, got = run(backend)
                off, _, want = run(None)
            assert got == want, "the canary changed a token"
            offs.append(off)
            ons.append(on)
            ratios.append(on / off)
            shares.append(sum(phases.values()) / on)
            for k, v in phases.items():
                phase_sum[k] = phase_sum.get(k, 0.0) + v / spec["rounds"]
        result["backends"][backend] = {
            "median_ratio": statistics.median(ratios), "min_ratio": min(ratios), "max_ratio": max(ratios),
            "median_off_s": statistics.median(offs), "median_on_s": statistics.median(ons),
            "median_timer_share": statistics.median(shares),
            "phases_s": dict(sorted(phase_sum.items(), key=lambda kv: -kv[1])),
            "first_run_setup_s": first_phases.get("setup", 0.0),
        }
    return result


def run_subprocess(tiny: bool, rounds: int | None = None) -> dict[str, Any]:
    """The measurement in a fresh process (vLLM: one engine per process); its JSON result."""
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    env.pop("KVCANARY_VLLM", None)
    args = [sys.executable, __file__] + (["--tiny"] if tiny else []) + (["--rounds", str(rounds)] if rounds else [])
    proc = subprocess.run(args, env=env, capture_output=True, text=True, timeout=3000)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


def test_vllm_canary_share_of_generation_time(benchmark):
    """One row: the alternating-rounds measurement (full size under ``make bench-vllm``, tiny in make test)."""
    tiny = bool(getattr(benchmark, "disabled", False))
    result = benchmark.pedantic(run_subprocess, args=(tiny,), rounds=1, iterations=1)
    benchmark.extra_info.update(result)
    numpy_row = result["backends"]["numpy"]
    assert numpy_row["median_ratio"] > 0 and numpy_row["median_timer_share"] > 0
    print(json.dumps(result, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--rounds", type=int, default=None)
    args = parser.parse_args()
    spec = dict(TINY if args.tiny else FULL)
    if args.rounds:
        spec["rounds"] = args.rounds
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    print("RESULT " + json.dumps(measure(spec, ["numpy", "host"])), flush=True)


if __name__ == "__main__":
    main()
