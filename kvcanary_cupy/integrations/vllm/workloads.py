"""Random-weight models saved to disk and request mixes that exercise vLLM's scheduler on a CPU: mixed prompt
lengths under chunked prefill, a shared prefix (prefix caching), more KV than the budget holds (preemption,
recomputation, resumed requests with new block lists) and parallel sampling. No download."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

MODEL_SIZES: dict[str, dict[str, int]] = {
    # 2 layers, hidden 128: the tests' model
    "small": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=512),
    # ~57M parameters: the cost benchmark's model
    "medium": dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=8, num_attention_heads=12,
                   num_key_value_heads=4, vocab_size=4096),
}
BLOCK_SIZE = 32  # the smallest block size vLLM's CPU attention accepts here
# 24 blocks: the clean and fault workloads fit, the preemption workload does not.
KV_BLOCKS = 24
ENGINE_ARGS: dict[str, Any] = dict(skip_tokenizer_init=True, dtype="float32", max_model_len=256, enforce_eager=True,
                                   block_size=BLOCK_SIZE, seed=0, max_num_batched_tokens=64, max_num_seqs=8,
                                   async_scheduling=False)


def save_llama(directory: Path, size: str = "small", *, seed: int = 0) -> Path:
    """A random-weight ``LlamaForCausalLM`` saved under ``directory`` (once; reused after).
    ``initializer_range=0.2`` gives varied greedy output (the default 0.02 repeats one token)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    directory = Path(directory)
    if (directory / "config.json").exists():
        return directory
    torch.manual_seed(seed)
    dims: dict[str, Any] = dict(MODEL_SIZES[size])
    config = LlamaConfig(max_position_embeddings=2048, initializer_range=0.2, **dims)
    LlamaForCausalLM(config).save_pretrained(directory)
    return directory


def num_params(size: str) -> int:
    """Parameters of a model size (embeddings and LM head included)."""
    d = MODEL_SIZES[size]
    h, i, layers, v = d["hidden_size"], d["intermediate_size"], d["num_hidden_layers"], d["vocab_size"]
    kv = h // d["num_attention_heads"] * d["num_key_value_heads"]
    per_layer = h * h * 2 + 2 * h * kv + 3 * h * i + 2 * h
    return layers * per_layer + 2 * v * h + h


def kv_cache_bytes(size: str, blocks: int) -> int:
    """``kv_cache_memory_bytes`` that gives ``blocks`` blocks of a model size (fp32 K and V, every layer)."""
    d = MODEL_SIZES[size]
    head = d["hidden_size"] // d["num_attention_heads"]
    return blocks * BLOCK_SIZE * 2 * d["num_hidden_layers"] * d["num_key_value_heads"] * head * 4


def engine(model_dir: Path, size: str = "small", blocks: int = KV_BLOCKS, **overrides: Any) -> Any:
    """An in-process ``vllm.LLM`` over a saved model (set ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` first)."""
    from vllm import LLM

    return LLM(model=str(model_dir), kv_cache_memory_bytes=kv_cache_bytes(size, blocks),
               **{**ENGINE_ARGS, **overrides})


@dataclass(frozen=True)
class Workload:
    """A named batch of token-id prompts and the sampling that makes it interesting."""

    name: str
    description: str
    prompts: tuple[tuple[int, ...], ...]
    max_new_tokens: int
    sampling: dict[str, Any] = field(default_factory=dict)  # SamplingParams fields beyond greedy decoding

    def run(self, llm: Any) -> list[list[int]]:
        """``LLM.generate`` over the prompts; the generated ids of every completion, in order."""
        from vllm import SamplingParams

        params = SamplingParams(**{"max_tokens": self.max_new_tokens, "temperature": 0.0, "ignore_eos": True,
                                   **self.sampling})
        out = llm.generate([{"prompt_token_ids": list(p)} for p in self.prompts], params, use_tqdm=False)
        return [list(c.token_ids) for o in out for c in o.outputs]


def _prompts(rng: np.random.Generator, lengths: list[int], vocab: int, prefix: list[int] | None = None
             ) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple((prefix or []) + rng.integers(3, vocab, n).tolist()) for n in lengths)


def workloads(vocab: int = 512, seed: int = 0) -> dict[str, Workload]:
    rng = np.random.default_rng(seed)
    shared = rng.integers(3, vocab, 2 * BLOCK_SIZE).tolist()
    return {
        "mixed-lengths": Workload(
            "mixed-lengths", "prompts of 5 to 150 tokens, chunked prefill (64-token steps) next to decode",
            _prompts(rng, [5, 150, 33, 90, 12, 64], vocab), 12),
        "shared-prefix": Workload(
            "shared-prefix", "a 64-token system prompt shared by every request (prefix-cache hits)",
            _prompts(rng, [5, 20, 3, 40, 9, 27, 50, 12], vocab, shared), 10),
        "preemption": Workload(
            "preemption", "8 x 200 tokens over a 768-token KV budget: preemption, recompute, resumed requests",
            _prompts(rng, [120] * 8, vocab), 80),
        "parallel-sampling": Workload(
            "parallel-sampling", "2 completions per prompt (n=2 sharing the prompt's blocks; top_k=1: deterministic)",
            _prompts(rng, [6, 40, 70], vocab), 10, dict(n=2, temperature=1.0, top_k=1)),
    }
