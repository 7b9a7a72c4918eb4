"""The canary's share of vLLM's generation wall time with the plugin's default options, and where that time goes
(vLLM's CPU build, random weights), in vLLM's own process layout and with the engine in-process.

Options: ``CanaryOptions()`` as ``KVCANARY_VLLM=log`` gives them (PARTIAL real-KV hashing of K and V over every
layer, sweep every 8 steps), with ``backend="host"``, what ``auto`` picks on a CPU where g++ compiles the kernels
(``--backend`` takes another). The Prometheus metrics are fed as in the plugin (the engine state feeds them
after every step, where ``prometheus_client`` is installed).

Engines (``--engine``; each in a process of its own), at full size:

* ``llama``: a ~57M-parameter Llama (hidden 768, 8 layers, 4 KV heads of 64, vocab 4096);
* ``gemma3``: a Gemma3-style hybrid of the same dimensions, sliding-window (window 128, smaller than every
  prompt) and full-attention layers alternating: two KV cache groups, each checked;
* ``llama-ngram``: the Llama with n-gram speculative decoding (3 draft tokens a step);

all fp32, block size 32, 128 KV blocks, chunked prefill at 2048 tokens, prefix caching on, greedy,
``ignore_eos``. Layouts (``--layout``):

* ``vllm``, vLLM's default and what ``vllm serve`` runs: ``LLM`` starts its engine core and the model's worker in
  processes of their own (``VLLM_ENABLE_V1_MULTIPROCESSING=1``), and vLLM gives the worker its cores, keeping
  one for the engine core's scheduler (on 2 cores: the worker on one core, one OpenMP thread, ``KMP_BLOCKTIME``
  5 ms). The canary is installed in the worker each round with ``collective_rpc`` (as the plugin installs it
  there), and the worker's clocks and the canary's timers come back the same way; the CPU time is that of the
  three processes;
* ``in-process``: the engine core and the worker in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``); torch
  runs an OpenMP thread per core.

Workloads:

* ``cost``: 8 requests x 256-token prompts + 64 new tokens (the cost benchmark's shape);
* ``shared-prefix``: 12 requests sharing a 256-token system prompt, each with 64 tokens of its own, + 32 new
  tokens (prefix-cache hits on the system prompt's blocks).

A round is one ``LLM.generate`` of the workload with or without the canary, from an empty prefix cache. Before the
timed call each round runs one short untimed request (with the canary, the runtime is created at install and lives as
long as the engine: its one-time setup is reported apart, ``setup_s``). Rounds go in ABBA order (without, with, with,
without, ...), so a drift of the machine's speed cancels; a pair is one round without and one with the canary, and the
figure is the median over the pairs of ``with / without - 1``, with its spread; next to it the same median of the
engine's CPU time (every thread of its processes: this one and, in vLLM's layout, those it started), which other work
on the machine disturbs less (a round that waits for a core loses wall time, not CPU time); the 1-minute load average
before and after is recorded. Next to it, per step, where the time goes: the forward of vLLM (timed in every round,
with and without), the median time between two forwards (vLLM's sampling, output and scheduling, with the canary's
engine-thread parts and whatever the TAIL thread beside them slows; with and without), the canary's phase timers, and
wall clocks around each part of the canary's step (building the step, the slot table, staging, plan/HEAD, TAIL, the
block index, the ring read and sweep, the observers), the rest of the hook being the hook's own Python. In ``log``
mode the plan, HEAD and TAIL launches, the block index and the ring read run on the canary's TAIL thread while vLLM
samples and schedules (docs/vllm.md): their clocks are reported apart, and what the engine thread pays for them is the
wait at the start of the next step (``wait for TAIL``). ``scaling`` (full size only): the canary's time on the engine
thread per decode step against vLLM's own forward per step, for 1, 4 and 8 requests at 64- and 448-token contexts.

vLLM keeps process-wide state (one engine per process), so the measurement runs in a subprocess of its own: ``python
bench/bench_vllm.py [--tiny] [--pairs N] [--engine NAME [--layout vllm|in-process]]`` prints one JSON object; with
``--engine``, ``--workload NAME`` measures one workload only and ``--option FIELD=VALUE`` sets a ``CanaryOptions``
field other than its default (e.g. ``--option sweep_interval=0``; the result records the options measured). Under
``--benchmark-disable`` (``make test``) the pytest row runs the Llama and the hybrid on their small models (2 to 4
layers, 1 pair of a few tokens per workload) in vLLM's layout; ``make bench-vllm`` runs the full size, every engine in
both layouts.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

WORKLOADS = {
    "cost": dict(requests=8, shared=0, own=256, new=64),
    "shared-prefix": dict(requests=12, shared=256, own=64, new=32),
}
ENGINES = ("llama", "gemma3", "llama-ngram")
# vLLM's own process layout (its default: the engine core and the model's worker in processes of their own, the
# worker bound to the cores vLLM gives it) and the engine in the calling process
LAYOUTS = ("vllm", "in-process")
# the full-size Gemma3-style hybrid: the Llama's dimensions, sliding-window and full layers alternating
GEMMA3_MEDIUM = dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=8, num_attention_heads=12,
                     num_key_value_heads=4, head_dim=64, vocab_size=4096, sliding_window=128,
                     query_pre_attn_scalar=64, layer_types=["sliding_attention", "full_attention"] * 4,
                     max_position_embeddings=2048, initializer_range=0.2, tie_word_embeddings=False)
FULL = dict(size="medium", blocks=128, pairs=8, scale=1, scaling=True)
TINY = dict(size="small", blocks=48, pairs=1, scale=16, scaling=False)
# (requests, context tokens) of the scaling table's decode steps
SCALING = [(1, 64), (1, 448), (4, 64), (4, 448), (8, 64), (8, 448)]


class StepClock:
    """Wall clocks around vLLM's forward (every round) and around each part of the canary's step."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.steps: list[dict[str, float]] = []  # per step: batch size, context, tokens, forward, canary
        self.forward = 0.0
        # the wall time from the end of one forward to the start of the next: vLLM's sampling, output and
        # scheduling, the canary's engine-thread parts, and whatever the TAIL thread beside them slows
        self.between: list[float] = []
        self.forward_end: float | None = None

    def timed(self, name: str, fn: Any) -> Any:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - start

        return wrapper


def patch_forward(runner: Any, clock_of: Any) -> None:
    """Time the runner's own forward (its class method, so with or without the canary)."""
    cls = type(runner)
    original = cls._model_forward

    @functools.wraps(original)
    def _model_forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return original(self, *args, **kwargs)
        finally:
            clock = clock_of()
            if clock is not None:
                end = time.perf_counter()
                clock.forward = end - start
                clock.seconds["forward"] += clock.forward
                if clock.forward_end is not None:
                    clock.between.append(start - clock.forward_end)
                clock.forward_end = end

    cls._model_forward = _model_forward


def instrument(canary: Any, clock: StepClock) -> None:
    """Wall clocks around the canary's parts (instance attributes; ``remove()`` of the canary drops the hooks).
    In log mode all but ``build step``, ``fresh blocks`` and ``observers`` run on the TAIL thread (:data:`PARTS`);
    ``wait for TAIL`` is what the engine thread waits for them at the start of the next step."""
    st, runner = canary.state, canary.runner
    for name, part in (("read_step", "build step"), ("_fill_table", "slot table"),
                       ("_step_batches", "step batches"), ("_post_forward", "TAIL"),
                       ("_note_complete_blocks", "block index"), ("_finish_step", "ring read + sweep"),
                       ("forget_blocks", "fresh blocks")):
        setattr(st, name, clock.timed(part, getattr(st, name)))
    canary._settle = clock.timed("wait for TAIL", canary._settle)
    for name, part in (("prepare", "stage + scatter"), ("pre_forward", "plan + HEAD")):
        setattr(st.rt, name, clock.timed(part, getattr(st.rt, name)))
    for obs in canary.observers:
        obs.after_forward = clock.timed("observers", obs.after_forward)
    hook = runner._model_forward

    @functools.wraps(hook)
    def model_forward(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        clock.forward = 0.0
        waited = clock.seconds["wait for TAIL"]
        try:
            return hook(*args, **kwargs)
        finally:
            total = time.perf_counter() - start
            clock.seconds["hook"] += total
            # the engine thread's share of the step: the hook less the forward, and the wait before the step
            clock.steps.append(dict(requests=int(runner.input_batch.num_reqs), forward=clock.forward,
                                    canary=total - clock.forward + clock.seconds["wait for TAIL"] - waited,
                                    tokens=int(kwargs["input_ids"].shape[0]) if "input_ids" in kwargs else 0))

    runner._model_forward = model_forward


def build_engine(name: str, spec: dict[str, Any]) -> tuple[Any, int]:
    """The engine ``name`` (:data:`ENGINES`) at the spec's size, and its vocabulary size."""
    from kvcanary_cupy.integrations.vllm.workloads import (
        MODEL_SIZES,
        arch_engine_args,
        engine,
        save_arch,
        save_llama,
        speculative_config,
    )

    root = Path(tempfile.gettempdir())
    args: dict[str, Any] = dict(max_model_len=512, max_num_batched_tokens=2048)
    if name == "gemma3":
        if spec["size"] == "medium":
            import torch
            import transformers

            model_dir = root / "kvcanary-vllm-gemma3-medium"
            if not (model_dir / "config.json").exists():
                torch.manual_seed(0)
                config = transformers.Gemma3TextConfig(**GEMMA3_MEDIUM)
                transformers.Gemma3ForCausalLM(config).save_pretrained(model_dir)
            vocab = int(GEMMA3_MEDIUM["vocab_size"])  # type: ignore[call-overload]
        else:
            model_dir, vocab = save_arch(root / "kvcanary-vllm-gemma3-small", "gemma3"), 512
            args.update(arch_engine_args("gemma3"))
        # engine() gives it the Llama's KV budget at the same size (at full size: the same layers, KV heads and
        # head size)
        return engine(model_dir, spec["size"], spec["blocks"], **args), vocab
    model_dir = save_llama(root / f"kvcanary-vllm-{spec['size']}", spec["size"])
    if name == "llama-ngram":
        args["speculative_config"] = speculative_config("ngram", model_dir)
    return engine(model_dir, spec["size"], spec["blocks"], **args), MODEL_SIZES[spec["size"]]["vocab_size"]


# -- the model runner's side of a round: in this process, or in vLLM's worker through ``collective_rpc`` ------------

_round: dict[str, Any] = {"clock": None, "canary": None, "before": {}}


def runner_setup(runner: Any) -> dict[str, Any]:
    """Once per engine: time the runner's forward; returns the runner process's OpenMP settings and cores."""
    import torch

    patch_forward(runner, lambda: _round["clock"])
    return {"torch_threads": torch.get_num_threads(), "cores": sorted(os.sched_getaffinity(0)),
            **{k: v for k, v in os.environ.items() if k.startswith(("KMP_", "OMP_"))}}


def runner_install(runner: Any, option_fields: dict[str, Any] | None) -> None:
    """Install the canary with ``CanaryOptions(**option_fields)`` (None: a round without it). Fields, not the
    options object: ``collective_rpc`` passes plain data."""
    from kvcanary_cupy.integrations.vllm import CanaryOptions, install

    _round["canary"] = install(runner, CanaryOptions(**option_fields)) if option_fields is not None else None


def runner_start(runner: Any, profile: bool) -> None:
    """Start the round's clocks (after its untimed request)."""
    clock, canary = StepClock(), _round["canary"]
    _round["clock"], _round["before"] = clock, {}
    if canary is not None:
        assert canary.state is not None
        _round["before"] = dict(canary.state.seconds)
        if profile:
            instrument(canary, clock)


def runner_stop(runner: Any) -> dict[str, Any]:
    """Stop the round: its clocks, and with the canary its timers, setup and findings (the canary removed)."""
    clock, canary, before = _round["clock"], _round["canary"], _round["before"]
    _round["clock"] = _round["canary"] = None
    result: dict[str, Any] = {"parts": dict(clock.seconds), "steps": clock.steps,
                              "between_ms": statistics.median(clock.between) * 1e3 if clock.between else 0.0}
    if canary is not None:
        canary.finish()
        canary.remove()
        assert canary.state is not None
        result["violations"] = [str(v) for v in canary.violations[:3]]
        result["timers"] = {k: v - before.get(k, 0.0) for k, v in canary.state.seconds.items()
                            if k != "setup" and v - before.get(k, 0.0) > 0}
        result["setup"] = canary.state.seconds.get("setup", 0.0)
        result["canary_steps"] = canary.state.steps
    return result


def on_worker(worker: Any, name: str, *args: Any) -> Any:
    """``collective_rpc``'s entry in vLLM's worker process: the runner-side function ``name`` on its runner."""
    return globals()[name](worker.model_runner, *args)


class InProcess:
    """The engine's model runner in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``)."""

    def __init__(self, llm: Any) -> None:
        from kvcanary_cupy.integrations.vllm import find_runner

        self.runner = find_runner(llm)

    def call(self, name: str, *args: Any) -> Any:
        return globals()[name](self.runner, *args)

    def pids(self) -> list[int]:
        return [os.getpid()]


class InWorker:
    """The model runner in vLLM's worker process (vLLM's own layout: this process, the engine core's and the
    worker's), reached through ``LLM.collective_rpc`` by this module's name (on the worker's ``PYTHONPATH``)."""

    def __init__(self, llm: Any) -> None:
        import bench_vllm

        self.llm, self.module = llm, bench_vllm

    def call(self, name: str, *args: Any) -> Any:
        results = self.llm.collective_rpc(self.module.on_worker, args=(name, *args))
        assert len(results) == 1, "one worker (no tensor parallelism) in this measurement"
        return results[0]

    def pids(self) -> list[int]:
        return _process_tree(os.getpid())


def runner_pid(runner: Any) -> int:
    return os.getpid()


def _process_tree(root: int) -> list[int]:
    """``root`` and every process below it (vLLM's engine core and workers)."""
    parents: dict[int, list[int]] = defaultdict(list)
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            parents[int(stat.rsplit(")", 1)[1].split()[1])].append(int(entry))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += parents.get(pid, [])
    return out


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds of these processes, every thread."""
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def measure(spec: dict[str, Any], backend: str, profile: bool = True, engine_name: str = "llama",
            option_fields: dict[str, Any] | None = None, workloads: tuple[str, ...] = tuple(WORKLOADS),
            layout: str = "in-process") -> dict[str, Any]:
    import numpy as np
    from vllm import SamplingParams

    from kvcanary_cupy.backends import unavailable_reason
    from kvcanary_cupy.integrations.vllm import CanaryOptions

    reason = unavailable_reason(backend)
    if reason is not None:
        return {"skipped": reason}
    llm, vocab = build_engine(engine_name, spec)
    side = InProcess(llm) if layout == "in-process" else InWorker(llm)
    fields = {"backend": backend, **(option_fields or {})}
    options = CanaryOptions(**fields)
    openmp = {**side.call("runner_setup"), "worker_pid": side.call("runner_pid")}
    warm = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)

    def prompts_of(w: dict[str, Any], seed: int) -> list[dict[str, Any]]:
        rng = np.random.default_rng(seed)
        shared = rng.integers(3, vocab, w["shared"] // spec["scale"]).tolist()
        return [{"prompt_token_ids": shared + rng.integers(3, vocab, max(1, w["own"] // spec["scale"])).tolist()}
                for _ in range(w["requests"])]

    def run(prompts: list[dict[str, Any]], new: int, with_canary: bool) -> dict[str, Any]:
        assert llm.reset_prefix_cache()
        side.call("runner_install", fields if with_canary else None)
        # untimed: one short request (the canary's runtime is created at install, once per engine)
        llm.generate([{"prompt_token_ids": [1, 2, 3, 4, 5]}], warm, use_tqdm=False)
        side.call("runner_start", profile)
        params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
        pids = side.pids()
        start, cpu_start = time.perf_counter(), cpu_seconds(pids)
        out = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - start
        cpu = cpu_seconds(pids) - cpu_start
        result: dict[str, Any] = {"wall": wall, "cpu": cpu, "tokens": [list(o.outputs[0].token_ids) for o in out],
                                  **side.call("runner_stop")}
        assert result.get("violations", []) == [], result["violations"]
        return result

    from safetensors import safe_open

    with safe_open(str(Path(llm.llm_engine.model_config.model) / "model.safetensors"), "np") as f:
        params = sum(int(np.prod(f.get_slice(k).get_shape())) for k in f.keys())
    out: dict[str, Any] = {"engine": engine_name, "params": params, "spec": spec, "backend": backend,
                           "layout": layout, "engine_pid": os.getpid(), "load_before": os.getloadavg()[0],
                           # the model runner's process: its OpenMP threads, settings and cores
                           "openmp": openmp,
                           "options": {k: getattr(options, k) for k in ("mode", "real_kv_hash", "with_v",
                                                                          "backend", "sweep_interval")},
                           "workloads": {}}
    # The first run with the canary in a process loads (or compiles) the kernels: once, outside the rounds.
    first = run(prompts_of(WORKLOADS["cost"], 99), 2, True)
    out["first_run_setup_s"] = first["setup"]
    for name in workloads:
        w = WORKLOADS[name]
        prompts = prompts_of(w, 0)
        new = max(2, w["new"] // spec["scale"])
        rounds: list[tuple[bool, dict[str, Any]]] = []
        for p in range(spec["pairs"]):
            order = (False, True) if p % 2 == 0 else (True, False)  # ABBA: without, with | with, without
            for with_canary in order:
                rounds.append((with_canary, run(prompts, new, with_canary)))
        offs = [r for c, r in rounds if not c]
        ons = [r for c, r in rounds if c]
        for r in ons + offs:
            assert r["tokens"] == offs[0]["tokens"], "the canary changed a token"
        shares = [on["wall"] / off["wall"] - 1 for on, off in zip(ons, offs, strict=True)]
        cpu_shares = [on["cpu"] / off["cpu"] - 1 for on, off in zip(ons, offs, strict=True)]
        steps = statistics.median(len(r["steps"]) for r in ons) if profile else ons[0]["canary_steps"]
        per_step = {k: statistics.median(r["parts"].get(k, 0.0) for r in ons) / steps * 1e3
                    for k in sorted({k for r in ons for k in r["parts"]})}
        timers = {k: statistics.median(r["timers"].get(k, 0.0) for r in ons) / steps * 1e3
                  for k in sorted({k for r in ons for k in r["timers"]})}
        forward_off = statistics.median(r["parts"].get("forward", 0.0) for r in offs) / steps * 1e3
        out["workloads"][name] = {
            "workload": w, "pairs": len(shares), "steps": steps,
            "median_share": statistics.median(shares), "min_share": min(shares), "max_share": max(shares),
            "quartiles": [float(q) for q in np.percentile(shares, [25, 75])],
            "median_cpu_share": statistics.median(cpu_shares),
            "cpu_quartiles": [float(q) for q in np.percentile(cpu_shares, [25, 75])],
            "median_off_s": statistics.median(r["wall"] for r in offs),
            "median_on_s": statistics.median(r["wall"] for r in ons),
            "timer_share": statistics.median(sum(r["timers"].values()) / r["wall"] for r in ons),
            "hook_share": statistics.median(r["parts"].get("hook", 0.0) / r["wall"] for r in ons) if profile else None,
            "per_step_ms": per_step, "timers_per_step_ms": timers, "forward_without_per_step_ms": forward_off,
            # the median time between two forwards of a round (decode steps: most of them), with and without
            "between_forwards_ms": {"with": statistics.median(r["between_ms"] for r in ons),
                                    "without": statistics.median(r["between_ms"] for r in offs)},
            "setup_s": statistics.median(r["setup"] for r in ons),
            "engine_parts": ENGINE_PARTS,
        }
    if (spec["scaling"] and profile and engine_name == "llama" and len(workloads) == len(WORKLOADS)
            and layout == "in-process"):
        out["scaling"] = scaling(run, vocab)
    out["load_after"] = os.getloadavg()[0]
    return out


# A fixed amount of CPU work with no GIL held, compiled by the host backend (the same g++ the kernels use).
SPIN_SOURCE = """
extern "C" __global__ void kvc_bench_spin(long long rounds, unsigned long long* sink) {
  unsigned long long x = 1;
  for (long long i = 0; i < rounds; ++i) x = x * 6364136223846793005ull + 1442695040888963407ull;
  *sink = x;
}
"""


REFERENCE_US = 1000  # the full run's reference load: 1 ms of CPU a step


class SyntheticLoad:
    """``us`` microseconds of CPU a step, in compiled code that holds no GIL (a host launch), run after every
    forward as the canary's TAIL work is: on a thread of its own, waited for before the next forward, or
    ``inline`` on the engine thread. The reference for the canary's own cost: what that much CPU a step costs
    vLLM, whatever it does."""

    def __init__(self, us: int, inline: bool) -> None:
        import numpy as np

        from kvcanary_cupy.hostcuda import HostModule

        self.us, self.inline = us, inline
        self.kernel = HostModule(SPIN_SOURCE, name="bench_spin", threads=1).get_function("kvc_bench_spin")
        self.sink = np.zeros(1, np.uint64)
        self.rounds = 1 << 16
        for _ in range(3):  # scaled to the median of a few calls, twice more at the new count
            self.rounds = max(1, int(self.rounds * us * 1e-6 / statistics.median(self._timed() for _ in range(7))))
        self.pending: Any = None
        self.pool: Any = None

    def _timed(self) -> float:
        import numpy as np

        start = time.thread_time()
        self.kernel((1,), (1,), (np.int64(self.rounds), self.sink))
        return max(time.thread_time() - start, 1e-6)

    def wait(self) -> None:
        if self.pending is not None:
            self.pending.result()
            self.pending = None

    def after_forward(self) -> None:
        if self.inline:
            self._timed()
            return
        if self.pool is None:
            from concurrent.futures import ThreadPoolExecutor

            self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bench-load")
        self.pending = self.pool.submit(self._timed)


_load: dict[str, Any] = {"load": None, "on": False}


def runner_synthetic(runner: Any, us: int, inline: bool) -> float:
    """Put a :class:`SyntheticLoad` after the runner's forward, off until :func:`runner_synthetic_on`; returns the
    load's calibrated microseconds a call."""
    load = SyntheticLoad(us, inline)
    original = runner._model_forward

    @functools.wraps(original)
    def model_forward(*args: Any, **kwargs: Any) -> Any:
        load.wait()
        out = original(*args, **kwargs)
        if _load["on"]:
            load.after_forward()
        return out

    runner._model_forward = model_forward
    _load["load"] = load
    return statistics.median(load._timed() for _ in range(9)) * 1e6


def runner_synthetic_on(runner: Any, on: bool) -> None:
    """Turn the load on or off, once the last round's load is done."""
    _load["load"].wait()
    _load["on"] = on


def measure_synthetic(spec: dict[str, Any], us: int, inline: bool, workloads: tuple[str, ...],
                      layout: str = "in-process") -> dict[str, Any]:
    """ABBA rounds of the engine alone against the engine with a :class:`SyntheticLoad` instead of the canary."""
    import numpy as np
    from vllm import SamplingParams

    llm, vocab = build_engine("llama", spec)
    side = InProcess(llm) if layout == "in-process" else InWorker(llm)
    out: dict[str, Any] = {"synthetic_us": us, "inline": inline, "layout": layout,
                           "load_before": os.getloadavg()[0], "workloads": {},
                           "calibrated_us": side.call("runner_synthetic", us, inline)}
    for name in workloads:
        w = WORKLOADS[name]
        rng = np.random.default_rng(0)
        shared = rng.integers(3, vocab, w["shared"] // spec["scale"]).tolist()
        prompts = [{"prompt_token_ids": shared + rng.integers(3, vocab, max(1, w["own"] // spec["scale"])).tolist()}
                   for _ in range(w["requests"])]
        params = SamplingParams(max_tokens=max(2, w["new"] // spec["scale"]), temperature=0.0, ignore_eos=True)
        walls: dict[bool, list[float]] = {False: [], True: []}
        for p in range(spec["pairs"] + 1):  # the first pair warms up, untimed
            for on in ((False, True) if p % 2 == 0 else (True, False)):
                assert llm.reset_prefix_cache()
                side.call("runner_synthetic_on", on)
                start = time.perf_counter()
                llm.generate(prompts, params, use_tqdm=False)
                if p:
                    walls[on].append(time.perf_counter() - start)
        shares = [a / b - 1 for a, b in zip(walls[True], walls[False], strict=True)]
        out["workloads"][name] = {"pairs": len(shares), "median_share": statistics.median(shares),
                                  "quartiles": [float(q) for q in np.percentile(shares, [25, 75])],
                                  "median_off_s": statistics.median(walls[False]),
                                  "median_on_s": statistics.median(walls[True])}
    out["load_after"] = os.getloadavg()[0]
    return out


def scaling(run: Any, vocab: int) -> list[dict[str, Any]]:
    """The canary's time per decode step against vLLM's forward per step, by batch size and context length."""
    import numpy as np

    rows = []
    for requests, context in SCALING:
        rng = np.random.default_rng(requests * 1000 + context)
        prompts = [{"prompt_token_ids": rng.integers(3, vocab, context).tolist()} for _ in range(requests)]
        r = run(prompts, 16, True)
        decode = [s for s in r["steps"] if s["tokens"] == requests][2:]  # decode steps, the first two left out
        rows.append({"requests": requests, "context": context, "decode_steps": len(decode),
                     "forward_ms": statistics.median(s["forward"] for s in decode) * 1e3,
                     "canary_ms": statistics.median(s["canary"] for s in decode) * 1e3})
    return rows


# the canary's parts in step order; those on the engine thread in log mode (in the hook, or the wait before the
# step), the others on the TAIL thread. A result records its engine thread's parts (one saved without them
# staged the step on the engine thread).
PARTS = ["build step", "slot table", "step batches", "stage + scatter", "fresh blocks", "observers", "wait for TAIL",
         "plan + HEAD", "TAIL", "block index", "ring read + sweep"]
ENGINE_PARTS = ["build step", "fresh blocks", "observers", "wait for TAIL"]
STAGED_ON_ENGINE_THREAD = ["build step", "slot table", "step batches", "stage + scatter", "fresh blocks",
                           "observers", "wait for TAIL"]


def _engine_parts(w: dict[str, Any]) -> list[str]:
    return list(w.get("engine_parts", STAGED_ON_ENGINE_THREAD))


def _cpu_share(w: dict[str, Any]) -> str:
    if "median_cpu_share" not in w:  # a result saved before the CPU clocks were taken
        return "-"
    q = w["cpu_quartiles"]
    return f"{w['median_cpu_share']:+.1%} ({q[0]:+.1%} .. {q[1]:+.1%})"


def _engine_thread_ms(w: dict[str, Any]) -> float:
    """The canary's time on vLLM's engine thread per step: the hook less the forward, and the wait for TAIL."""
    ms = w["per_step_ms"]
    return ms["hook"] - ms["forward"] + ms.get("wait for TAIL", 0.0)


LAYOUT_TITLES = {"vllm": "vLLM's own process layout (the engine core and the model's worker in processes of their own)",
                 "in-process": "The engine in the calling process (VLLM_ENABLE_V1_MULTIPROCESSING=0)"}


def markdown(result: dict[str, Any]) -> str:
    """The result's tables, per layout (a result of one layout, or one engine, as it is)."""
    if "layouts" not in result:
        return markdown_layout(result)
    return "\n\n".join(f"{LAYOUT_TITLES.get(layout, layout)}:\n\n{markdown_layout(part)}"
                        for layout, part in result["layouts"].items())


def markdown_layout(result: dict[str, Any]) -> str:
    """One layout's tables: the end-to-end share per engine and workload, the per-step breakdown, the scaling."""
    engines = result["engines"] if "engines" in result else {result.get("engine", "llama"): result}
    lines = ["| engine | workload | pairs | share, median | middle half | spread (min..max) | CPU share, median "
             "(middle half) | canary on the engine thread | without (median) | with (median) |",
             "|---|---|--:|--:|--:|--:|--:|--:|--:|--:|"]
    columns: list[tuple[str, dict[str, Any]]] = []
    for engine_name, res in engines.items():
        if "skipped" in res:
            lines.append(f"| {engine_name} | skipped: {res['skipped']} | | | | | | | | |")
            continue
        for name, w in res["workloads"].items():
            q = w["quartiles"]
            share = _engine_thread_ms(w) * w["steps"] / 1e3 / w["median_on_s"]
            lines.append(f"| {engine_name} | {name} | {w['pairs']} | {w['median_share']:+.1%} | "
                         f"{q[0]:+.1%} .. {q[1]:+.1%} | {w['min_share']:+.1%} .. {w['max_share']:+.1%} | "
                         f"{_cpu_share(w)} | {share:.1%} | {w['median_off_s']:.2f} s | {w['median_on_s']:.2f} s |")
            columns.append((f"{engine_name}: {name}", w))
    lines += ["", "| per step (ms) | " + " | ".join(c for c, _ in columns) + " |", "|---|" + "--:|" * len(columns)]
    rows = [("vLLM forward, without the canary", lambda w: w["forward_without_per_step_ms"]),
            ("vLLM forward, with the canary", lambda w: w["per_step_ms"]["forward"]),
            ("between two forwards (median), without the canary",
             lambda w: w.get("between_forwards_ms", {}).get("without", float("nan"))),
            ("between two forwards (median), with the canary",
             lambda w: w.get("between_forwards_ms", {}).get("with", float("nan")))]
    # a part's row says on which thread it ran in the first column's result (all of one run: the same)
    first = columns[0][1] if columns else {}
    engine_parts = _engine_parts(first)
    rows += [(part, lambda w, part=part: w["per_step_ms"].get(part, 0.0)) for part in PARTS if part in engine_parts]
    rows += [("the hook's own Python (rest)", lambda w: w["per_step_ms"]["hook"] - w["per_step_ms"]["forward"]
              - sum(w["per_step_ms"].get(p, 0.0) for p in _engine_parts(w) if p != "wait for TAIL")),
             ("**canary on the engine thread, total**", _engine_thread_ms)]
    rows += [(f"TAIL thread: {part}", lambda w, part=part: w["per_step_ms"].get(part, 0.0))
             for part in PARTS if part not in engine_parts]
    rows += [(f"timer: {k}", lambda w, k=k: w["timers_per_step_ms"].get(k, 0.0))
             for k in sorted({k for _, w in columns for k in w["timers_per_step_ms"]})]
    for label, get in rows:
        lines.append(f"| {label} | " + " | ".join(f"{get(w):.3f}" for _, w in columns) + " |")
    ref = result.get("reference")
    if ref:
        lines += ["", f"Reference ({ref['synthetic_us'] / 1e3:g} ms of GIL-free CPU a step on a thread of its own, "
                  "instead of the canary; the Llama):", "", "| workload | pairs | share, median | middle half |",
                  "|---|--:|--:|--:|"]
        for name, w in ref["workloads"].items():
            q = w["quartiles"]
            lines.append(f"| {name} | {w['pairs']} | {w['median_share']:+.1%} | {q[0]:+.1%} .. {q[1]:+.1%} |")
    scaled = [(n, r) for n, r in engines.items() if r.get("scaling")]
    for engine_name, res in scaled:
        lines += ["", f"Scaling ({engine_name}):", "",
                  "| requests x context | decode steps | vLLM forward | canary on the engine thread | share |",
                  "|---|--:|--:|--:|--:|"]
        for r in res["scaling"]:
            lines.append(f"| {r['requests']} x {r['context']} | {r['decode_steps']} | {r['forward_ms']:.2f} ms | "
                         f"{r['canary_ms']:.2f} ms | {r['canary_ms'] / r['forward_ms']:.1%} |")
    return "\n".join(lines)


def run_subprocess(tiny: bool, pairs: int | None = None, backend: str = "host",
                   engines: tuple[str, ...] = ENGINES, layouts: tuple[str, ...] = LAYOUTS) -> dict[str, Any]:
    """The measurement of each engine in each layout in a fresh process (vLLM: one engine per process); the JSON
    results. The in-process layout also runs the reference load, at full size."""
    env = dict(os.environ)
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    env.pop("KVCANARY_VLLM", None)
    out: dict[str, Any] = {"layouts": {}}

    def one(*extra: str) -> dict[str, Any]:
        args = [sys.executable, __file__, "--backend", backend, *extra] + (["--tiny"] if tiny else [])
        args += ["--pairs", str(pairs)] if pairs else []
        proc = subprocess.run(args, env=env, capture_output=True, text=True, timeout=3000)
        assert proc.returncode == 0, proc.stderr[-3000:]
        line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")][-1]
        return json.loads(line[len("RESULT "):])

    for layout in layouts:
        part: dict[str, Any] = {"engines": {}}
        for name in engines:
            part["engines"][name] = one("--engine", name, "--layout", layout)
        if not tiny:  # what REFERENCE_US of GIL-free CPU a step costs the Llama
            part["reference"] = one("--engine", "llama", "--synthetic", str(REFERENCE_US), "--layout", layout)
        out["layouts"][layout] = part
    return out


def test_vllm_canary_share_of_generation_time(benchmark):
    """One row: the ABBA measurement of every engine (full size under ``make bench-vllm``, tiny in make test)."""
    tiny = bool(getattr(benchmark, "disabled", False))
    # make test's tiny run: the Llama and the hybrid in vLLM's own layout (the in-process hooks of every engine are
    # driven by the tests under tests/vllm; an engine in vLLM's layout takes tens of seconds to start)
    engines, layouts = (ENGINES[:2], ("vllm",)) if tiny else (ENGINES, LAYOUTS)
    result = benchmark.pedantic(run_subprocess, args=(tiny, None, "host", engines, layouts), rounds=1, iterations=1)
    benchmark.extra_info.update(result)
    for layout, part in result["layouts"].items():
        for engine_name, res in part["engines"].items():
            if "skipped" in res:
                print(layout, engine_name, res["skipped"])
                continue
            assert res["layout"] == layout
            for name in WORKLOADS:
                row = res["workloads"][name]
                assert row["pairs"] >= 1 and row["steps"] > 1 and row["timer_share"] > 0
                assert row["per_step_ms"]["hook"] >= row["per_step_ms"]["build step"] > 0
                assert row["per_step_ms"]["TAIL"] > 0  # the TAIL thread ran the TAIL launches
    # vLLM's own layout runs the model in a worker process of its own, on the cores vLLM gives it
    worker = result["layouts"]["vllm"]["engines"]["llama"]
    if "skipped" not in worker:
        assert worker["openmp"]["worker_pid"] != worker["engine_pid"]
    print(json.dumps(result, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--pairs", type=int, default=None)
    parser.add_argument("--backend", default="host")
    parser.add_argument("--engine", choices=ENGINES, default=None,
                        help="measure this engine here (default: each engine in a process of its own)")
    parser.add_argument("--no-profile", action="store_true", help="no wall clocks around the canary's parts")
    parser.add_argument("--option", action="append", default=[], metavar="FIELD=VALUE",
                        help="a CanaryOptions field other than the default (with --engine; e.g. sweep_interval=0)")
    parser.add_argument("--workload", choices=list(WORKLOADS), action="append",
                        help="measure only this workload (with --engine; repeatable)")
    parser.add_argument("--synthetic", type=int, metavar="US",
                        help="instead of the canary, US microseconds of GIL-free CPU work a step on a thread of its "
                             "own (the Llama engine; the reference for what that much CPU costs vLLM)")
    parser.add_argument("--synthetic-inline", action="store_true", help="with --synthetic: on the engine thread")
    parser.add_argument("--layout", choices=LAYOUTS, default="vllm",
                        help="with --engine: vLLM's own process layout (engine core and worker in processes of "
                             "their own; the default) or the engine in this process")
    parser.add_argument("--markdown", metavar="JSON", help="print the tables of a saved result and exit")
    args = parser.parse_args()
    if args.markdown:
        text = Path(args.markdown).read_text()
        print(markdown(json.loads(text[text.find("{"):])))
        return
    if args.engine is None:
        print("RESULT " + json.dumps(run_subprocess(args.tiny, args.pairs, args.backend)), flush=True)
        return
    spec = dict(TINY if args.tiny else FULL)
    if args.pairs:
        spec["pairs"] = args.pairs
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if args.layout == "in-process" else "1"
    # this checkout's package, not whichever one the environment installed, here and in vLLM's worker, which
    # also imports this module by name (collective_rpc passes its functions by reference)
    here = Path(__file__).resolve().parent
    sys.path.insert(0, str(here.parent))
    os.environ["PYTHONPATH"] = os.pathsep.join([str(here), str(here.parent), os.environ.get("PYTHONPATH", "")])
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc with a function
    if args.synthetic is not None:
        print("RESULT " + json.dumps(measure_synthetic(spec, args.synthetic, args.synthetic_inline,
                                                       tuple(args.workload or WORKLOADS), args.layout)), flush=True)
        return
    fields = {}
    for item in args.option:
        key, _, value = item.partition("=")
        fields[key] = int(value) if value.lstrip("-").isdigit() else {"true": True, "false": False}.get(value, value)
    print("RESULT " + json.dumps(measure(spec, args.backend, not args.no_profile, args.engine, fields,
                                         tuple(args.workload or WORKLOADS), args.layout)), flush=True)


if __name__ == "__main__":
    main()
