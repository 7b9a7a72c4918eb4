"""Random-weight models and request mixes that exercise transformers' continuous batching on a CPU: different
prompt lengths, shared prefixes (block sharing), more requests than the cache holds (queueing, frees, soft
resets), forked requests (block copies) and sliding-window layer groups. No download: every model is built from
a config with random weights."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

MODEL_SIZES: dict[str, dict[str, int]] = {
    # hidden 64, 2 layers: the tests' model (a step takes a few ms on 2 cores)
    "small": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, num_hidden_layers=2, max_position_embeddings=1024),
    # ~58M parameters: the bench model
    "medium": dict(vocab_size=32000, hidden_size=512, intermediate_size=1408, num_attention_heads=8,
                   num_key_value_heads=8, num_hidden_layers=8, max_position_embeddings=1024),
}


@dataclass(frozen=True)
class Workload:
    """A named batch of prompts with the engine settings that make it interesting."""

    name: str
    description: str
    arch: str  # "llama" (full attention only) or "gemma3" (sliding + full groups) or "mistral" (all sliding)
    prompts: tuple[tuple[int, ...], ...]
    max_new_tokens: int
    cb: dict[str, Any] = field(default_factory=dict)  # ContinuousBatchingConfig fields
    sampling: dict[str, Any] = field(default_factory=dict)  # GenerationConfig fields beyond greedy decoding

    @property
    def num_results(self) -> int:
        return len(self.prompts) * int(self.sampling.get("num_return_sequences", 1))

    def run(self, model: Any, **cb_fields: Any) -> Any:
        """``generate_batch`` over the prompts; the raw results (request id -> GenerationOutput)."""
        return model.generate_batch(inputs=[list(p) for p in self.prompts],
                                    generation_config=generation_config(self.max_new_tokens, **self.sampling),
                                    continuous_batching_config=cb_config(**self.cb, **cb_fields), progress_bar=False)


def _prompts(rng: np.random.Generator, lengths: list[int], vocab: int, prefix: list[int] | None = None
             ) -> tuple[tuple[int, ...], ...]:
    out = []
    for n in lengths:
        body = rng.integers(3, vocab, n).tolist()
        out.append(tuple((prefix or []) + body))
    return tuple(out)


def workloads(vocab: int = 512, seed: int = 0) -> dict[str, Workload]:
    rng = np.random.default_rng(seed)
    shared = rng.integers(3, vocab, 24).tolist()
    return {
        "mixed-lengths": Workload(
            "mixed-lengths", "prompts of 3 to 40 tokens, chunked prefill next to decode", "llama",
            _prompts(rng, [3, 17, 40, 9, 26], vocab), 12,
            dict(page_size=4, num_blocks=64, max_batch_tokens=32)),
        "shared-prefix": Workload(
            "shared-prefix", "a 24-token system prompt shared by every request (prefix reuse, dedup)", "llama",
            _prompts(rng, [5, 11, 3, 8, 14, 6], vocab, shared), 10,
            dict(page_size=4, num_blocks=64, max_batch_tokens=48, max_requests_per_batch=3)),
        "queueing": Workload(
            "queueing", "more requests than the cache holds: waiting, frees and soft resets", "llama",
            _prompts(rng, [10] * 6, vocab), 16,
            dict(page_size=4, num_blocks=10, max_batch_tokens=64)),
        "forks": Workload(
        "forks", "2 sampled continuations per prompt (seeded): forked requests share full pages, copy the last",
        "llama", _prompts(rng, [6, 11, 19, 27, 34], vocab), 10,
        dict(page_size=4, num_blocks=96, max_batch_tokens=16, seed=1),
        dict(do_sample=True, num_return_sequences=2)),
    "sliding-window": Workload(
            "sliding-window", "Gemma3-style model: 3 sliding-window layers (window 8) next to 1 full layer",
            "gemma3", _prompts(rng, [5, 19, 12, 30], vocab), 14,
            dict(page_size=4, num_blocks=48, max_batch_tokens=24)),
    }


def build_model(arch: str = "llama", size: str = "small", seed: int = 0) -> Any:
    """A random-weight causal LM in eval mode (fp32, CPU)."""
    import torch
    from transformers import (
        Gemma3ForCausalLM,
        Gemma3TextConfig,
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
    )

    torch.manual_seed(seed)
    dims: dict[str, Any] = dict(MODEL_SIZES[size])
    model: Any
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**dims))
    elif arch == "mistral":
        model = MistralForCausalLM(MistralConfig(sliding_window=8, **dims))
    elif arch == "gemma3":
        dims["num_hidden_layers"] = 4
        head_dim = dims["hidden_size"] // dims["num_attention_heads"]
        model = Gemma3ForCausalLM(Gemma3TextConfig(
            head_dim=head_dim, sliding_window=8, layer_types=["sliding_attention"] * 3 + ["full_attention"], **dims))
    else:
        raise ValueError(f"unknown arch {arch!r}")
    return model.eval()


def generation_config(max_new_tokens: int, **fields: Any) -> Any:
    from transformers import GenerationConfig

    return GenerationConfig(**{"max_new_tokens": max_new_tokens, "do_sample": False, "eos_token_id": -1,
                               "pad_token_id": 0, **fields})


def cb_config(**fields: Any) -> Any:
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    return ContinuousBatchingConfig(**fields)


def generate(model: Any, workload: Workload) -> dict[str, list[int]]:
    """``generate_batch`` over the workload; request id -> generated ids. Raises if any request failed."""
    out = workload.run(model)
    failed = {rid: r.error for rid, r in out.items() if r.error is not None}
    if failed or len(out) != workload.num_results:
        raise RuntimeError(f"generate_batch failed: {failed or 'missing results'}")
    return {rid: list(r.generated_tokens) for rid, r in out.items()}
