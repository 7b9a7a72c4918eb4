"""Run vLLM with speculative decoding in-process, without and with the canary, and print what happened as JSON on a
line starting with "RESULT " (one engine per process: vLLM keeps process-wide state).

``python spec_run.py WORKDIR METHOD``: METHOD ``ngram`` (prompt lookup, 3 drafts) or ``draft_model`` (a second tiny
Llama, the target's weights with noise added, 2 drafts). The target is a tiny random-weight Llama whose greedy
output repeats often enough that drafts are both accepted and rejected. For every workload and seed: the
completions without the canary, then with it in ``log`` mode (sweep every 2 steps), with a tally of the drafts
accepted and rejected read from the runner's own structures (the scheduler's draft tokens of a step and the
next step's computed length); then the ``draft-rejected-kept`` fault, a bit flipped in the K/V of an accepted
draft token, and ``raise`` mode."""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout's package, not an installed one
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
os.environ.pop("KVCANARY_VLLM", None)

# the workload seeds of each method; parallel sampling is left out: vLLM 0.32's rejection sampler fails on a
# batch with top-k sampling under speculative decoding (`k.max()` of an empty tensor), with or without the canary
SEEDS = {"ngram": (0, 1, 2), "draft_model": (0, 1)}
WORKLOADS = ("mixed-lengths", "shared-prefix")
INIT = 0.05  # the target's initializer range: greedy output that repeats now and then (ngram drafts hit)
DRAFT_NOISE = 0.01  # the draft model: the target's weights plus Gaussian noise of this scale


def save_models(workdir: Path, method: str) -> tuple[Path, Path | None]:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvcanary_cupy.integrations.vllm.workloads import MODEL_SIZES

    target_dir, draft_dir = workdir / "target", workdir / "draft"
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(max_position_embeddings=2048, initializer_range=INIT,
                                         **MODEL_SIZES["small"]))
    model.save_pretrained(target_dir)
    if method != "draft_model":
        return target_dir, None
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * DRAFT_NOISE)
    model.save_pretrained(draft_dir)
    return target_dir, draft_dir


class DraftTally:
    """Drafts accepted and rejected per step: a row's draft tokens in one step (the scheduler's list, as the
    runner's input batch received them) against the tokens its request state gained by the next step."""

    def __init__(self) -> None:
        self.last: dict[str, tuple[int, list[int]]] = {}
        self.accepted = self.rejected = 0

    def before_forward(self, canary: Any, step: int, kwargs: dict, metadata: dict) -> None:
        pass

    def after_forward(self, canary: Any, step: int, batch: Any) -> None:
        runner = canary.runner
        drafts = canary.state.drafts
        for rid in list(self.last):
            first, proposed = self.last.pop(rid)
            state = runner.requests.get(rid)
            if state is None:
                continue
            have = list(state.prompt_token_ids) + list(state.output_token_ids)
            ok = 0
            while ok < len(proposed) and first + ok < len(have) and have[first + ok] == proposed[ok]:
                ok += 1
            self.accepted += ok
            self.rejected += len(proposed) - ok
        for i, rid in enumerate(batch.request_ids):
            if drafts.get(rid):
                self.last[rid] = (int(batch.prefix_lens[i] + batch.extend_lens[i]) - len(drafts[rid]),
                                  list(drafts[rid]))


class AcceptedDraftBitflip:
    """One bit flipped in the V bytes of an accepted draft token (of a target layer), before the step after the
    one that wrote it: that step's verify reads the position as part of the row's prefix."""

    def __init__(self, at: int) -> None:
        self.at = at
        self.last: dict[str, tuple[int, int]] = {}  # request -> (first draft position, drafts)
        self.fault: tuple[int, str, int, int] | None = None

    def before_forward(self, canary: Any, step: int, kwargs: dict, metadata: dict) -> None:
        if self.fault is not None or step < self.at:
            return
        import torch

        st = canary.state
        geo = st.geos[0]
        n = int(canary.runner.input_batch.num_reqs)
        md = metadata[geo.layer_names[0]]
        cu = md.query_start_loc[: n + 1].tolist()
        seq = md.seq_lens[:n].tolist()
        for i, rid in enumerate(canary.runner.input_batch.req_ids[:n]):
            first, count = self.last.get(rid, (-1, 0))
            past = int(seq[i]) - (cu[i + 1] - cu[i])
            accepted = past - first
            if not 0 < accepted <= count:
                continue
            position = first + accepted - 1  # the last accepted draft
            block = int(md.block_table[i, position // geo.block_size])
            offset = position % geo.block_size
            name = next(x for x in geo.layer_names if x not in canary.support.draft_layers)
            cache = geo.caches[geo.layer_names.index(name)]
            half = cache.shape[-1] // 2
            flat = cache[block, 0].reshape(-1)
            element = flat[half * geo.block_size + offset * half:][:1].view(torch.uint8)
            element[0] ^= 1 << 3
            self.fault = (step, rid, position, block * geo.block_size + offset)
            return

    def after_forward(self, canary: Any, step: int, batch: Any) -> None:
        drafts = canary.state.drafts
        self.last = {rid: (int(batch.prefix_lens[i] + batch.extend_lens[i]) - len(drafts[rid]), len(drafts[rid]))
                     for i, rid in enumerate(batch.request_ids) if drafts.get(rid)}


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[tuple[str, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append((record.levelname, record.getMessage()))


def main() -> None:
    from vllm import LLM

    from kvcanary_cupy.integrations import vllm as kv
    from kvcanary_cupy.integrations.vllm.faults import injector
    from kvcanary_cupy.integrations.vllm.workloads import ENGINE_ARGS, kv_cache_bytes, workloads

    workdir, method = Path(sys.argv[1]), sys.argv[2]
    target, draft = save_models(workdir, method)
    spec: dict[str, Any] = ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
                             "prompt_lookup_min": 1} if method == "ngram" else
                            {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 2})
    llm = LLM(model=str(target), kv_cache_memory_bytes=kv_cache_bytes("small", 24),
              **{**ENGINE_ARGS, "speculative_config": spec})
    seeds, names = SEEDS[method], WORKLOADS
    loads = {seed: workloads(seed=seed) for seed in seeds}
    want = {}
    for seed in seeds:
        for name in names:
            assert llm.reset_prefix_cache()
            want[seed, name] = loads[seed][name].run(llm)

    lines = Lines()
    logger = logging.getLogger("kvcanary_cupy.vllm")
    logger.addHandler(lines)
    logger.setLevel(logging.INFO)
    canary = kv.install(llm, backend="numpy", sweep_interval=2)
    tally = DraftTally()
    canary.observers.append(tally)
    exact = {}
    for seed in seeds:
        for name in names:
            assert llm.reset_prefix_cache()
            exact[f"{name}/{seed}"] = loads[seed][name].run(llm) == want[seed, name]
    canary.finish()
    result: dict[str, Any] = {
        "exact": exact,
        "violations": [[v.step, v.group, list(v.violation.reasons)] for v in canary.violations][:20],
        "health": canary.state.health_problems[:5] if canary.state else None,
        "steps": canary.steps,
        "accepted": tally.accepted,
        "rejected": tally.rejected,
        "install_lines": list(lines.lines),
        "draft_layers": list(canary.support.draft_layers),
        "engine_rules": [rule.key for rule, _ in canary.support.engine],
        "sweep_interval": int(canary.state.rt.config.sweep_interval) if canary.state else None,
    }
    canary.remove()

    faults = {}
    for kind in ("draft-rejected-kept", "accepted-bitflip"):
        assert llm.reset_prefix_cache()
        canary = kv.install(llm, backend="numpy", sweep_interval=0)
        fault: Any = injector(kind, at=2) if kind != "accepted-bitflip" else AcceptedDraftBitflip(at=2)
        canary.observers.append(fault)
        loads[0]["mixed-lengths"].run(llm)
        canary.finish()
        canary.remove()
        planted = fault.fault
        if planted is not None and not isinstance(planted, tuple):
            planted = (planted.step, planted.request, planted.position, planted.slot)
        faults[kind] = {
            "step": None if planted is None else planted[0],
            "slot": None if planted is None else planted[3],
            "detail": None if planted is None else str(fault.fault),
            "violations": [[v.step, list(v.violation.reasons), v.violation.slot] for v in canary.violations][:12],
        }
    result["faults"] = faults

    lines.lines.clear()
    raised = kv.install(llm, mode="raise", backend="numpy")
    assert llm.reset_prefix_cache()
    last = seeds[-1]
    result["raise"] = [loads[last]["mixed-lengths"].run(llm) == want[last, "mixed-lengths"]]
    raised.finish()
    result["raise"] += [len(raised.violations), raised.steps, [level for level, _ in lines.lines]]
    raised.remove()
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
