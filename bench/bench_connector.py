"""What carrying the canary records through a vLLM KV connector costs (the canary connector around
``ExampleConnector``, vLLM's CPU build): bytes and wall time per KV byte moved and per loaded token.

Run with the vLLM environment (not a pytest module: each engine needs a process of its own)::

    LD_PRELOAD=.venv-vllm/lib/libiomp5.so .venv-vllm/bin/python bench/bench_connector.py [--size medium]

A save process prefills the prompts (whole prompts in one step) and the wrapped connector writes their KV; a
load process, new, loads every prompt back. Each process reports the connector's own wall time (the wrapped
connector's save and load calls) and the canary connector's (records gathered and written; records read,
judged, restored and verified), the KV bytes the connector wrote and the records bytes. Printed as JSON."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def child(spec: dict) -> dict:
    """One engine: generate the prompts one at a time (a load per request) and report the connector's tallies."""
    os.environ.update({"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_USE_V2_MODEL_RUNNER": "0",
                       "KVCANARY_VLLM": "log", "KVCANARY_VLLM_CONNECTOR": "ExampleConnector",
                       "KVCANARY_VLLM_REAL_KV_HASH": spec["real_kv_hash"]})
    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
    from vllm import SamplingParams

    from kvcanary_cupy.integrations.vllm.hooks import find_runner
    from kvcanary_cupy.integrations.vllm.workloads import engine

    transfer = {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {"shared_storage_path": spec["store"]}}
    llm = engine(spec["model"], spec["size"], blocks=spec["blocks"], kv_transfer_config=transfer,
                 max_num_batched_tokens=512)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    for prompt in spec["prompts"]:
        llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    canary = find_runner(llm)._kvcanary
    canary.finish()
    c = canary.connector
    return {"seconds": dict(c.seconds), "records_bytes": c.saved_bytes, "kv_bytes": c.kv_bytes_saved,
            "restored_tokens": c.restored_tokens, "findings": len(c.findings), "violations": len(canary.violations)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="small", choices=("small", "medium"))
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--real-kv-hash", default="partial", choices=("partial", "all"))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print("RESULT " + json.dumps(child(json.loads(args.child))), flush=True)
        return 0
    import numpy as np

    from kvcanary_cupy.integrations.vllm.workloads import save_llama

    rng = np.random.default_rng(0)
    vocab = 512 if args.size == "small" else 4096
    # 193..225 tokens: 192 block-aligned tokens move per prompt (ExampleConnector keys by the first len-1 tokens)
    prompts = [rng.integers(3, vocab, int(n)).tolist() for n in rng.integers(194, 225, args.prompts)]
    with tempfile.TemporaryDirectory() as tmp:
        model = save_llama(Path(tmp) / "model", args.size)
        spec = {"model": str(model), "size": args.size, "store": str(Path(tmp) / "store"), "prompts": prompts,
                "blocks": 24, "real_kv_hash": args.real_kv_hash}
        out = {}
        for phase in ("save", "load"):
            env = {**os.environ, "PYTHONPATH": str(ROOT)}
            env = {k: v for k, v in env.items() if not k.startswith("KVCANARY_VLLM")}
            run = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], env=env,
                                 capture_output=True, text=True, check=False)
            lines = [x for x in run.stdout.splitlines() if x.startswith("RESULT ")]
            if run.returncode or not lines:
                sys.stderr.write(run.stdout[-2000:] + run.stderr[-4000:])
                return 1
            out[phase] = json.loads(lines[-1].removeprefix("RESULT "))
    save, load = out["save"], out["load"]
    tokens = load["restored_tokens"]
    kv = save["kv_bytes"]
    report = {
        "model": args.size, "real_kv_hash": args.real_kv_hash, "prompts": args.prompts, "loaded_tokens": tokens,
        "kv_bytes_moved": kv, "records_bytes": save["records_bytes"],
        "records_bytes_per_kv_byte": save["records_bytes"] / kv,
        "save_records_ns_per_kv_byte": 1e9 * save["seconds"]["save"] / kv,
        "connector_save_ns_per_kv_byte": 1e9 * save["seconds"]["inner_save"] / kv,
        "load_records_us_per_token": 1e6 * load["seconds"]["load"] / tokens,
        "connector_load_us_per_token": 1e6 * load["seconds"]["inner_load"] / tokens,
        "findings": save["findings"] + load["findings"], "violations": save["violations"] + load["violations"],
    }
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
