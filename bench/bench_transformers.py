"""The canary's cost inside Hugging Face transformers' ``generate_batch`` (CPU torch, random weights).

One group: the same ``generate_batch`` (8 requests x 256-token prompts + 64 new tokens, greedy; a ~58M-parameter
Llama: hidden 512, 8 layers, vocab 32000; ``page_size=64, num_blocks=48, max_batch_tokens=2048``) without the
canary (baseline), with the canary on the NumPy backend (subject) and on the host backend (info); real-KV
hashing PARTIAL over every layer's K and V. Each canary row also records, in ``extra_info``, the canary's own
phase times from its timers (``canary_s``, ``canary_share`` of the row's wall time): the end-to-end difference
to the baseline is noisy on a shared 2-core machine, the timers are not.

Under ``--benchmark-disable`` (``make test``) the workload shrinks to the tests' tiny model and 2 short
requests, so the suite stays alive without costing minutes. ``python bench/bench_transformers.py`` prints the
figures of one full-size run of each row.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from kvcanary_cupy.backends import unavailable_reason
from kvcanary_cupy.integrations.transformers import CanaryOptions, install
from kvcanary_cupy.integrations.transformers.workloads import (
    build_model,
    cb_config,
    generation_config,
)

FULL = dict(size="medium", requests=8, prompt=256, new=64, cb=dict(page_size=64, num_blocks=48,
                                                                   max_batch_tokens=2048))
TINY = dict(size="small", requests=2, prompt=16, new=4, cb=dict(page_size=4, num_blocks=32, max_batch_tokens=64))
HOST_REASON = unavailable_reason("host")


def _prompts(spec: dict[str, Any], vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, vocab, (spec["prompt"],), generator=g).tolist() for _ in range(spec["requests"])]


def run_once(model: Any, spec: dict[str, Any], backend: str | None,
             options: CanaryOptions | None = None) -> dict[str, float]:
    """One ``generate_batch``; with ``backend`` the canary is installed for it (``options``: default PARTIAL
    hashing of K and V). Wall and canary seconds."""
    prompts = _prompts(spec, int(model.config.vocab_size))
    canary = None
    if backend is not None:
        canary = install(model, options or CanaryOptions(backend=backend, real_kv_hash="partial", with_v=True))
    start = time.perf_counter()
    try:
        out = model.generate_batch(inputs=prompts, generation_config=generation_config(spec["new"]),
                                   continuous_batching_config=cb_config(**spec["cb"]), progress_bar=False)
    finally:
        wall = time.perf_counter() - start
        if canary is not None:
            canary.finish()
            canary.remove()
    if any(r.error is not None for r in out.values()) or len(out) != spec["requests"]:
        raise RuntimeError("generate_batch failed")
    result = {"wall_s": wall, "canary_s": 0.0}
    if canary is not None:
        if canary.violations:
            raise RuntimeError(f"{len(canary.violations)} violations in a clean run")
        for st in canary.states.values():
            result["canary_s"] += sum(st.seconds.values())
            for phase, s in st.seconds.items():
                result[f"{phase}_s"] = result.get(f"{phase}_s", 0.0) + s
        result["steps"] = canary.steps
    return result


@pytest.fixture(scope="module")
def spec(request: pytest.FixtureRequest) -> dict[str, Any]:
    return TINY if request.config.getoption("benchmark_disable") else FULL


@pytest.fixture(scope="module")
def model(spec: dict[str, Any]) -> Any:
    torch.set_num_threads(2)
    return build_model("llama", spec["size"])


ROWS = [("baseline", None, "generate_batch, no canary"), ("subject", "numpy", "generate_batch + canary (NumPy)"),
        ("info", "host", "generate_batch + canary (host backend)")]


@pytest.mark.parametrize("role,backend,label", ROWS, ids=["no-canary", "canary-numpy", "canary-host"])
def test_generate_batch_with_canary(benchmark: Any, model: Any, spec: dict[str, Any], role: str,
                                    backend: str | None, label: str) -> None:
    if backend == "host" and HOST_REASON is not None:
        pytest.skip(f"host backend: {HOST_REASON}")
    tokens = spec["requests"] * (spec["prompt"] + spec["new"])
    benchmark.group = f"transformers generate_batch {spec['requests']}x{spec['prompt']}+{spec['new']} ({spec['size']})"
    benchmark.extra_info.update(label=label, role=role, entries=tokens, key=f"transformers-{backend or 'none'}",
                                params=sum(p.numel() for p in model.parameters()))
    results: list[dict[str, float]] = []

    def call() -> None:
        results.append(run_once(model, spec, backend))

    if benchmark.disabled:
        benchmark(call)
    else:
        call()  # warm-up: host kernels compiled, caches warm
        benchmark.pedantic(call, rounds=3, iterations=1)
    last = results[-1]
    benchmark.extra_info.update({k: round(v, 5) for k, v in last.items()})
    if backend is not None:
        benchmark.extra_info["canary_share"] = round(last["canary_s"] / last["wall_s"], 4)


def main() -> None:
    torch.set_num_threads(2)
    model = build_model("llama", FULL["size"])
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params; workload: "
          f"{FULL['requests']} x {FULL['prompt']} prompt + {FULL['new']} new tokens; real-KV PARTIAL, K and V")
    backends = [None, "numpy"] + ([] if HOST_REASON else ["host"])
    for backend in backends:
        run_once(model, FULL, backend)  # warm-up
    for backend in backends:
        r = run_once(model, FULL, backend)
        phases = ", ".join(f"{k[:-2]} {1000 * v / max(1, r.get('steps', 1)):.2f}"
                           for k, v in r.items() if k.endswith("_s") and k not in ("wall_s", "canary_s"))
        print(f"{backend or 'no canary':>9}: generate_batch {r['wall_s']:.2f} s; canary {r['canary_s']:.3f} s = "
              f"{100 * r['canary_s'] / r['wall_s']:.1f} % of it" + (f" (ms/step: {phases})" if backend else ""))


if __name__ == "__main__":
    main()
