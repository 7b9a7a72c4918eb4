"""The canary's cost where users feel it: its share of transformers' ``generate_batch`` wall time, and how its
cost per step grows with context length and batch size next to the engine's own step time.

1. **End-to-end share** (``share``): the bench workload of ``bench_transformers.py`` (58.5M-parameter Llama,
   8 x 256-token prompts + 64 new tokens, PARTIAL real-KV hashing of every layer's K and V) run in alternating
   rounds without and with the canary (at least 5 each; a round = one ``generate_batch`` without and one
   with, the canary's run second in even rounds and first in odd ones). The share of a round is
   ``with / without - 1``; the figure is the median over rounds with the spread (min..max) next to it.
   Alternating cancels most of the drift of a shared machine: both halves of a round see the same load.
   The canary's own phase timers give a second, less noisy figure.
2. **Scaling** (``scaling``): one decode step of the canary runtime alone (prepare, pre_forward, post_forward,
   finish_step) for B requests of L tokens each, on the transformers bench geometry (8 layers in two runtime
   groups of 4, K and V, PARTIAL hashing), next to the medium model's own decode step at the same B and L
   (one ``forward`` of B new tokens over a ``DynamicCache`` of L random tokens per layer). Each real-KV row is
   64 bytes here (one cache line: the PARTIAL hash reads the first 16 bytes of a row, as it does from the
   model's 2 KiB rows), which keeps a 32k-token context inside the machine's memory.

3. **Long context** (``long_context``): a real ``generate_batch`` of one request with a 32,768-token prompt
   and 32 new tokens, on the small test geometry (hidden 64, 2 layers: the medium model's prefill of 32k
   tokens alone takes minutes on 2 cores) with its position table stretched to the context, run without the
   canary, with the full verify and with the bounded verify (``max_verify_entries_per_step=4096``), the
   three in rotating order for ``--long-rounds`` rounds; per configuration the median share against the
   run without the canary of the same round, its spread, and the canary's timers.

``python bench/bench_engine_cost.py [--share-rounds N] [--out bench/engine_cost.json] [--plot PATH]`` prints
both tables and writes the JSON and the plot; under pytest (``--benchmark-disable``) each part runs once at a
tiny size so the suite stays alive.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvcanary_cupy import RealKvSource
from kvcanary_cupy.backends import unavailable_reason
from kvcanary_cupy.runtime import CanaryConfig, CanaryRuntime, Capacities, KvGroup, KvPools, StepBatch

BENCH_DIR = Path(__file__).resolve().parent
HOST_REASON = unavailable_reason("host")
CPU_BACKENDS = ["numpy"] + ([] if HOST_REASON else ["host"])
LAYERS, LAYERS_PER_GROUP, ROW_BYTES = 8, 4, 64


# ---- 1. the end-to-end share ---------------------------------------------------------------------------


def share_rounds(model: Any, spec: dict[str, Any], backend: str, rounds: int, *,
                 max_verify_entries: int = 0) -> dict[str, Any]:
    """``rounds`` pairs of ``generate_batch`` without and with the canary on ``backend`` (ABBA order)."""
    from bench_transformers import run_once

    from kvcanary_cupy.integrations.transformers import CanaryOptions

    options = CanaryOptions(backend=backend, real_kv_hash="partial", with_v=True,
                            max_verify_entries_per_step=max_verify_entries)
    run_once(model, spec, None)  # warm-up: kernels compiled, caches warm
    run_once(model, spec, backend, options=options)
    ratios, without, with_, timers = [], [], [], []
    for i in range(rounds):
        # Every other round runs the canary first, so a trend in the machine's speed (or a cost of running
        # second) cancels between rounds instead of landing in every ratio.
        if i % 2 == 0:
            base = run_once(model, spec, None)["wall_s"]
            r = run_once(model, spec, backend, options=options)
        else:
            r = run_once(model, spec, backend, options=options)
            base = run_once(model, spec, None)["wall_s"]
        without.append(base)
        with_.append(r["wall_s"])
        ratios.append(r["wall_s"] / base - 1.0)
        timers.append(r["canary_s"] / r["wall_s"])
    quartiles = statistics.quantiles(ratios, n=4) if rounds > 1 else [ratios[0]] * 3
    return {"backend": backend, "rounds": rounds, "max_verify_entries": max_verify_entries,
            "share_median": statistics.median(ratios), "share_min": min(ratios), "share_max": max(ratios),
            "share_q1": quartiles[0], "share_q3": quartiles[2],
            "timer_share_median": statistics.median(timers), "without_s": without, "with_s": with_,
            "load_1min": os.getloadavg()[0]}


# ---- 3. a real long context ----------------------------------------------------------------------------

LONG_CONTEXT, LONG_NEW = 32768, 32


def long_context_rounds(backend: str, rounds: int, *, context: int = LONG_CONTEXT, new: int = LONG_NEW,
                        bounded: int = 4096) -> dict[str, Any]:
    """``rounds`` rounds of (no canary, full verify, bounded verify) ``generate_batch`` runs of one request with
    a ``context``-token prompt, the three in rotating order; shares against the same round's run without."""
    import torch
    from bench_transformers import run_once
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvcanary_cupy.integrations.transformers import CanaryOptions
    from kvcanary_cupy.integrations.transformers.workloads import MODEL_SIZES

    torch.manual_seed(0)
    dims = {**MODEL_SIZES["small"], "max_position_embeddings": context + new + 64}
    model = LlamaForCausalLM(LlamaConfig(**dims)).eval()
    spec = dict(size="small", requests=1, prompt=context, new=new,
                cb=dict(page_size=64, num_blocks=(context + new) // 64 + 4, max_batch_tokens=2048))
    configs: dict[str, Any] = {
        "none": None,
        "full": CanaryOptions(backend=backend, real_kv_hash="partial", with_v=True),
        "bounded": CanaryOptions(backend=backend, real_kv_hash="partial", with_v=True,
                                 max_verify_entries_per_step=bounded)}
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in configs}
    order = list(configs)
    for i in range(rounds):
        for name in order[i % 3:] + order[: i % 3]:
            opts = configs[name]
            runs[name].append(run_once(model, spec, None if opts is None else backend, options=opts))
    out: dict[str, Any] = {"backend": backend, "context": context, "new_tokens": new, "rounds": rounds,
                           "bounded_n": bounded, "without_s": [r["wall_s"] for r in runs["none"]]}
    for name in ("full", "bounded"):
        shares = [r["wall_s"] / base["wall_s"] - 1.0 for r, base in zip(runs[name], runs["none"], strict=True)]
        out[name] = {"share_median": statistics.median(shares), "share_min": min(shares), "share_max": max(shares),
                     "timer_share_median": statistics.median(r["canary_s"] / r["wall_s"] for r in runs[name]),
                     "verify_s_median": statistics.median(r.get("verify_s", 0.0) for r in runs[name]),
                     "with_s": [r["wall_s"] for r in runs[name]]}
    return out


# ---- 2. scaling ----------------------------------------------------------------------------------------


class DecodeCanary:
    """The canary runtime over B requests of ``context`` tokens (the bench model's geometry), ready to time
    decode steps: every prefix slot already stamped by one prefill step, each decode step one token a row."""

    def __init__(self, backend: str, batch: int, context: int, *, steps: int, max_verify_entries: int = 0) -> None:
        width = context + steps + 1
        self.batch, self.context = batch, context
        self.num_slots = batch * width + 1
        rng = np.random.default_rng(0)
        self.kv = [rng.integers(0, 256, (self.num_slots, ROW_BYTES), dtype=np.uint8) for _ in range(2 * LAYERS)]
        self.req_to_token = np.zeros((batch + 1, width), np.int32)
        for r in range(batch):
            self.req_to_token[r + 1] = 1 + r * width + np.arange(width, dtype=np.int32)

        def source(arr: np.ndarray) -> RealKvSource:
            return RealKvSource(arr, page_size=1, num_bytes_per_token=ROW_BYTES, read_bytes=ROW_BYTES)

        groups = []
        for lo in range(0, LAYERS, LAYERS_PER_GROUP):
            layers = range(lo, lo + LAYERS_PER_GROUP)
            groups.append(KvGroup.full(f"L{lo}", self.num_slots, tuple(source(self.kv[2 * i]) for i in layers),
                                       tuple(source(self.kv[2 * i + 1]) for i in layers)))
        cfg = CanaryConfig(mode="log", backend=backend, real_kv_hash_mode="partial", write_input_assert=True,
                           verify_token_assert=True, max_verify_entries_per_step=max_verify_entries,
                           logger="kvcanary_cupy.bench")
        caps = Capacities(max_batch_size=batch, max_tokens=batch * context, verify_capacity=batch * width,
                          max_history_tokens=batch * width)
        self.rt = CanaryRuntime.create(cfg, KvPools(tuple(groups), req_to_token=self.req_to_token), caps)
        self.rt.mark_init_finished()
        self.lens = [0] * batch
        self.step(context)  # prefill: stamps every prefix slot

    @staticmethod
    def token(r: int, p: int) -> int:
        return (r * 7919 + p * 31) % 32000

    def step(self, extend: int) -> None:
        rows = np.arange(1, self.batch + 1, dtype=np.int64)
        prefix = np.asarray(self.lens, np.int64)
        ext = np.full(self.batch, extend, np.int64)
        pos = np.concatenate([np.arange(p, p + extend, dtype=np.int64) for p in self.lens])
        rid = np.repeat(np.arange(self.batch, dtype=np.int64), extend)
        ids = (rid * 7919 + pos * 31) % 32000
        loc = self.req_to_token[rid + 1, pos].astype(np.int64)
        valid = prefix + ext
        history = np.concatenate([(r * 7919 + np.arange(v, dtype=np.int64) * 31) % 32000
                                  for r, v in enumerate(valid.tolist())])
        offsets = np.concatenate([[0], np.cumsum(valid)]).astype(np.int64)
        batch = StepBatch(req_pool_indices=rows, prefix_lens=prefix, extend_seq_lens=ext, input_ids=ids,
                          positions=pos, out_cache_loc=loc, expected_input_ids=ids, expected_positions=pos,
                          valid_lens=valid, history_ids=history, history_offsets=offsets,
                          history_req_pool_indices=rows)
        rt = self.rt
        rt.prepare(batch)
        rt.pre_forward()
        rt.post_forward()  # the KV bytes of the new slots were "written" before (random, fixed)
        report = rt.finish_step()
        if report.new_violations:
            raise RuntimeError(f"{len(report.new_violations)} violations in a clean run")
        self.lens = [n + extend for n in self.lens]


def canary_step_ms(backend: str, batch: int, context: int, *, steps: int = 5, max_verify_entries: int = 0) -> float:
    """Fastest wall ms of ``steps`` canary decode steps (B rows of ``context`` prefix tokens, one new token each):
    on a shared machine the fastest step is the one least disturbed by other work."""
    canary = DecodeCanary(backend, batch, context, steps=steps + 1, max_verify_entries=max_verify_entries)
    canary.step(1)  # warm-up
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        canary.step(1)
        times.append(time.perf_counter() - start)
    return 1000 * min(times)


def engine_step_ms(model: Any, batch: int, context: int, *, steps: int = 3) -> float:
    """Fastest wall ms of the model's own decode step (B new tokens over a cache of ``context`` tokens), the
    first of ``steps + 1`` forwards being a warm-up."""
    import torch
    from transformers import DynamicCache

    cfg = model.config
    heads, dim = cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
    g = torch.Generator().manual_seed(0)
    times = []
    with torch.inference_mode():
        for _ in range(steps + 1):
            cache = DynamicCache(config=cfg)
            for layer in range(cfg.num_hidden_layers):
                k = torch.randn(batch, heads, context, dim, generator=g)
                cache.update(k, torch.randn(batch, heads, context, dim, generator=g), layer)
            ids = torch.randint(3, cfg.vocab_size, (batch, 1), generator=g)
            pos = torch.full((batch, 1), context, dtype=torch.long)
            start = time.perf_counter()
            model(input_ids=ids, position_ids=pos, past_key_values=cache, use_cache=True)
            times.append(time.perf_counter() - start)
            del cache
    return 1000 * min(times[1:])


SCALING_POINTS = [(1, 1024), (1, 4096), (1, 16384), (1, 32768), (2, 32768), (8, 1024), (8, 4096), (32, 1024)]
BOUNDED_N = 4096


def scaling_table(model: Any, points: list[tuple[int, int]], *, canary_steps: int = 5) -> list[dict[str, Any]]:
    rows = []
    for batch, context in points:
        row: dict[str, Any] = {"batch": batch, "context": context,
                               "engine_ms": engine_step_ms(model, batch, context)}
        for backend in CPU_BACKENDS:
            row[f"{backend}_ms"] = canary_step_ms(backend, batch, context, steps=canary_steps)
            row[f"{backend}_bounded_ms"] = canary_step_ms(backend, batch, context, steps=canary_steps,
                                                          max_verify_entries=BOUNDED_N)
        rows.append(row)
        print(_scaling_line(row), flush=True)
    return rows


def _scaling_line(row: dict[str, Any]) -> str:
    parts = [f"B={row['batch']:>2} L={row['context']:>6}: engine {row['engine_ms']:8.1f} ms"]
    for backend in CPU_BACKENDS:
        full, bounded = row[f"{backend}_ms"], row[f"{backend}_bounded_ms"]
        parts.append(f"{backend} {full:7.2f} ms ({100 * full / row['engine_ms']:5.1f} %), bounded {bounded:6.2f} ms "
                     f"({100 * bounded / row['engine_ms']:4.1f} %)")
    return "; ".join(parts)


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    styles = {"engine_ms": ("engine step (model forward)", "k", "-"), "numpy_ms": ("canary, NumPy", "C0", "-"),
              "host_ms": ("canary, host backend", "C1", "-"),
              "numpy_bounded_ms": (f"canary, NumPy, bounded {BOUNDED_N}", "C0", "--"),
              "host_bounded_ms": (f"canary, host, bounded {BOUNDED_N}", "C1", "--")}
    for ax, batch in zip(axes, (1, 8), strict=True):
        mine = sorted((r for r in rows if r["batch"] == batch), key=lambda r: r["context"])
        xs = [r["context"] for r in mine]
        for key, (label, color, style) in styles.items():
            if mine and key in mine[0]:
                ax.plot(xs, [r[key] for r in mine], style, color=color, marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("context length per request (tokens)")
        ax.set_title(f"batch of {batch} request{'s' if batch > 1 else ''}, one decode step")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("wall time per step (ms)")
    axes[1].legend(fontsize=8)
    fig.suptitle("kv-canary cost per decode step vs the engine's own step (58.5M Llama, 2 CPU cores)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# ---- pytest: each part once, tiny ------------------------------------------------------------------------


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_canary_decode_step_runs_clean(benchmark: Any, backend: str) -> None:
    canary = DecodeCanary(backend, 2, 64, steps=4, max_verify_entries=0)
    benchmark.group = "canary decode step, B=2 L=64 (transformers geometry)"
    benchmark.extra_info.update(role="subject", entries=2 * 64, key=f"engine-cost-{backend}")
    benchmark.pedantic(canary.step, args=(1,), rounds=1 if benchmark.disabled else 3, iterations=1)
    assert canary.lens == [64 + (1 if benchmark.disabled else 3)] * 2


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_bounded_canary_decode_step_runs_clean(benchmark: Any, backend: str) -> None:
    canary = DecodeCanary(backend, 2, 64, steps=4, max_verify_entries=16)
    benchmark.group = "canary decode step, B=2 L=64, bounded 16 (transformers geometry)"
    benchmark.extra_info.update(role="info", entries=16, key=f"engine-cost-bounded-{backend}")
    benchmark.pedantic(canary.step, args=(1,), rounds=1 if benchmark.disabled else 3, iterations=1)
    verified = [slots for (_, tag, op), (slots, _) in canary.rt.run_counters().items()
                if op == "verify" and not tag.startswith("SWEEP")]
    assert verified and all(0 < n <= 16 * 3 for n in verified)  # at most the window per step


@pytest.mark.skipif(HOST_REASON is not None, reason=f"host backend: {HOST_REASON}")
def test_long_context_rounds_run_clean(benchmark: Any) -> None:
    pytest.importorskip("transformers")
    if not benchmark.disabled:
        pytest.skip("the 32k-token rounds run from main() (minutes); under pytest only a small context")
    res = long_context_rounds("host", 1, context=256, new=4, bounded=64)
    assert res["rounds"] == 1 and len(res["without_s"]) == 1
    assert res["full"]["timer_share_median"] > 0 and res["bounded"]["timer_share_median"] > 0


def main() -> None:
    import torch
    from bench_transformers import FULL

    from kvcanary_cupy.integrations.transformers.workloads import build_model

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--share-rounds", type=int, default=5)
    parser.add_argument("--skip-share", action="store_true")
    parser.add_argument("--share-backends", nargs="+", default=CPU_BACKENDS, choices=CPU_BACKENDS)
    parser.add_argument("--skip-scaling", action="store_true")
    parser.add_argument("--long-rounds", type=int, default=3, help="rounds of the 32k-token run (0: skip it)")
    parser.add_argument("--out", default=str(BENCH_DIR / "engine_cost.json"))
    parser.add_argument("--plot", default=str(BENCH_DIR / "engine_cost.png"))
    parser.add_argument("--torch-threads", type=int, default=2, help="torch threads of the end-to-end share")
    parser.add_argument("--scaling-torch-threads", type=int, default=1,
                        help="torch threads of the engine step in the scaling table (on a loaded 2-core machine "
                             "two threads spin against each other and the step time stops meaning anything)")
    args = parser.parse_args()
    torch.set_num_threads(args.torch_threads)
    model = build_model("llama", FULL["size"])
    out: dict[str, Any] = json.loads(Path(args.out).read_text()) if Path(args.out).exists() else {}
    out["load_1min_start"] = os.getloadavg()[0]
    if not args.skip_share:
        out["share"] = []
        for backend in args.share_backends:
            res = share_rounds(model, FULL, backend, args.share_rounds)
            out["share"].append(res)
            out["share_load_after"] = os.getloadavg()[0]
            print(f"share {backend}: median {100 * res['share_median']:.1f} % (middle half "
                  f"{100 * res['share_q1']:.1f} .. {100 * res['share_q3']:.1f} %, rounds "
                  f"{100 * res['share_min']:.1f} .. {100 * res['share_max']:.1f} %), canary timers "
                  f"{100 * res['timer_share_median']:.1f} %; "
                  f"without {statistics.median(res['without_s']):.2f} s, load {res['load_1min']:.1f}", flush=True)
    out["torch_threads"] = args.torch_threads
    if args.long_rounds:
        out["long_context"] = [long_context_rounds(b, args.long_rounds) for b in args.share_backends]
        for r in out["long_context"]:
            print(f"long context {r['backend']} ({r['context']} tokens): " + "; ".join(
                f"{name} median {100 * r[name]['share_median']:.1f} % (rounds {100 * r[name]['share_min']:.1f} .. "
                f"{100 * r[name]['share_max']:.1f} %), timers {100 * r[name]['timer_share_median']:.1f} %"
                for name in ("full", "bounded")) + f"; without {statistics.median(r['without_s']):.2f} s", flush=True)
    if not args.skip_scaling:
        torch.set_num_threads(args.scaling_torch_threads)
        out["scaling_torch_threads"] = args.scaling_torch_threads
        out["scaling"] = scaling_table(model, SCALING_POINTS, canary_steps=5)
        plot(out["scaling"], Path(args.plot))
    out["load_1min_end"] = os.getloadavg()[0]
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()


def markdown(out: dict[str, Any]) -> str:
    """The share and scaling tables of a JSON written by :func:`main`, as Markdown (a quick look; docs/costs.md
    is rendered by bench/render_costs.py)."""
    lines = []
    if out.get("share"):
        lines += ["| backend | rounds | share, median of rounds | middle half of the rounds | spread (min..max) | "
                  "canary timers, median | run without the canary (median) |", "|---|--:|--:|--:|--:|--:|--:|"]
        for r in out["share"]:
            middle = (f"{100 * r['share_q1']:.1f} .. {100 * r['share_q3']:.1f} %" if "share_q1" in r else "n/a")
            lines.append(f"| {r['backend']} | {r['rounds']} | {100 * r['share_median']:.1f} % | {middle} | "
                         f"{100 * r['share_min']:.1f} .. {100 * r['share_max']:.1f} % | "
                         f"{100 * r['timer_share_median']:.1f} % | {statistics.median(r['without_s']):.1f} s |")
        lines.append("")
    if out.get("long_context"):
        lines += ["| backend | context | rounds | run without | full verify: share (spread), timers | "
                  "bounded verify: share (spread), timers |", "|---|--:|--:|--:|--:|--:|"]
        for r in out["long_context"]:
            cells = [f"{100 * r[n]['share_median']:.1f} % ({100 * r[n]['share_min']:.1f} .. "
                     f"{100 * r[n]['share_max']:.1f} %), {100 * r[n]['timer_share_median']:.1f} %"
                     for n in ("full", "bounded")]
            lines.append(f"| {r['backend']} | {r['context']:,} + {r['new_tokens']} | {r['rounds']} | "
                         f"{statistics.median(r['without_s']):.1f} s | {cells[0]} | {cells[1]} |")
        lines.append("")
    if out.get("scaling"):
        head = "| B × L | engine step |" + "".join(f" {b} full | {b} bounded |" for b in CPU_BACKENDS)
        lines += [head, "|---|--:|" + "--:|--:|" * len(CPU_BACKENDS)]
        for r in out["scaling"]:
            cells = [f"{r['batch']} × {r['context']:,}", f"{r['engine_ms']:.1f} ms"]
            for b in CPU_BACKENDS:
                for key in (f"{b}_ms", f"{b}_bounded_ms"):
                    cells.append(f"{r[key]:.2f} ms ({100 * r[key] / r['engine_ms']:.1f} %)")
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
