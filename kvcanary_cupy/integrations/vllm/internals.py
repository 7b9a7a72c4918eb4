"""Every vLLM internal the integration patches or reads, in one list (docs/vllm.md prints the same list).

A test walks :data:`INTERNALS` against the installed vLLM and fails when one is missing or its signature changed:
the integration then needs a look before the supported range is widened."""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass


@dataclass(frozen=True)
class Internal:
    """One internal: ``module:qualname`` (a class, function or method), how the canary uses it, and the
    parameter names it relies on (empty: none checked) or the instance attributes read (``attributes``)."""

    target: str
    use: str
    parameters: tuple[str, ...] = ()
    attributes: tuple[str, ...] = ()


RUNNER = "vllm.v1.worker.gpu_model_runner:GPUModelRunner"
FACTORY = "vllm.distributed.kv_transfer.kv_connector.factory:KVConnectorFactory"
EXAMPLE = "vllm.distributed.kv_transfer.kv_connector.v1.example_connector"

INTERNALS: tuple[Internal, ...] = (
    Internal(f"{RUNNER}.execute_model", "patched per instance: the step's SchedulerOutput, real steps only",
             ("self", "scheduler_output", "intermediate_tensors")),
    Internal(f"{RUNNER}._model_forward", "patched per instance: plan/HEAD before, TAIL after the forward",
             ("self", "input_ids", "positions", "intermediate_tensors", "inputs_embeds")),
    Internal(f"{RUNNER}.sample_tokens", "patched per instance: the step's TAIL work (log mode, the TAIL thread on "
             "the worker's cores) starts when it returns", ("self", "grammar_output")),
    Internal(f"{RUNNER}.initialize_kv_cache", "patched at class level by the plugin: the canary installed in a "
             "runner once its KV cache is built (profiling calls skipped)",
             ("self", "kv_cache_config", "is_profiling")),
    Internal(f"{RUNNER}.__init__", "read: requests, input_batch, kv_caches, kv_cache_config, use_async_scheduling, "
             "max_num_reqs, max_num_tokens, max_model_len, compilation_config.static_forward_context"),
    Internal("vllm.v1.worker.cpu_model_runner:CPUModelRunner", "the runner class on CPU (a GPUModelRunner)"),
    Internal("vllm.forward_context:get_forward_context", "read inside the forward: attn_metadata per layer"),
    Internal("vllm.v1.attention.backends.cpu_attn:CPUAttentionMetadata",
             "read: query_start_loc, seq_lens, block_table, slot_mapping (what attention reads and writes)",
             attributes=("query_start_loc", "seq_lens", "block_table", "slot_mapping", "num_actual_tokens")),
    Internal("vllm.v1.worker.gpu_input_batch:CachedRequestState",
             "read: prompt_token_ids + output_token_ids (the expected tokens)",
             attributes=("prompt_token_ids", "output_token_ids", "num_computed_tokens", "block_ids")),
    Internal("vllm.v1.worker.gpu_input_batch:InputBatch", "read: req_ids, num_reqs (the batch rows' order)",
             attributes=("req_ids", "num_reqs")),
    Internal("vllm.v1.core.sched.output:SchedulerOutput",
             "read: new_block_ids_to_zero (fresh blocks: dropped from the sweep), preempted_req_ids (counted), "
             "scheduled_spec_decode_tokens (the expected ids of draft positions)",
             attributes=("new_block_ids_to_zero", "preempted_req_ids", "num_scheduled_tokens",
                         "total_num_scheduled_tokens", "scheduled_spec_decode_tokens")),
    Internal("vllm.v1.kv_cache_interface:FullAttentionSpec", "read: block_size, num_kv_heads, head_size",
             attributes=("block_size", "num_kv_heads", "head_size")),
    Internal("vllm.model_executor.layers.attention:Attention", "read: kv_cache tensor, isa (CPU KV layout) and "
             "attn_backend.get_name() (CPU attention's own layout or vLLM's packed one)"),
    Internal("vllm.model_executor.layers.attention.mla_attention:MLAAttention.bind_kv_cache",
             "sets the MLA layer's kv_cache: the [B, 1, N, C] view squeezed to [num_blocks, block_size, 576], read",
             ("self", "kv_cache")),
    Internal("vllm.model_executor.layers.attention.mla_attention:MLACommonMetadata",
             "read: query_start_loc, slot_mapping, and the decode/prefill halves of the batch (decodes first)",
             attributes=("query_start_loc", "slot_mapping", "decode", "prefill")),
    Internal("vllm.model_executor.layers.attention.mla_attention:MLACommonDecodeMetadata",
             "read: block_table, seq_lens of the decode rows", attributes=("block_table", "seq_lens")),
    Internal("vllm.model_executor.layers.attention.mla_attention:MLACommonPrefillMetadata",
             "read: block_table, query_lens_cpu and chunked_context.context_lens_list of the prefill rows",
             attributes=("block_table", "query_lens_cpu", "chunked_context")),
    # what the support check (support.py) reads at install to decide what is checked
    Internal("vllm.v1.kv_cache_interface:KVCacheGroupSpec", "read at install: each group's spec class and layers",
             attributes=("kv_cache_spec", "layer_names")),
    Internal("vllm.v1.kv_cache_interface:SlidingWindowSpec", "read at install: a sliding-window group's window "
             "(the positions a query reads)", attributes=("sliding_window",)),
    Internal("vllm.v1.kv_cache_interface:MLAAttentionSpec", "named at install: a latent-attention group, checked "
             "(one latent row per token, no V)"),
    Internal("vllm.v1.kv_cache_interface:MambaSpec", "named at install: a Mamba/GDN state group, skipped"),
    Internal("vllm.v1.attention.backends.cpu_attn:CPUAttentionMetadataBuilder._set_isa_to_layers",
             "sets layer.isa when the KV cache is built: read at install (the layer's CPU KV layout)",
             ("self", "layer_names")),
    Internal("vllm.config:VllmConfig", "read at install (runner.vllm_config): pipeline parallel, KV connectors; "
             "runner.speculative_config and runner.use_async_scheduling are the runner's copies",
             attributes=("parallel_config", "kv_transfer_config", "speculative_config")),
    Internal("vllm.config:ParallelConfig", "read at install: pipeline_parallel_size; the worker's rank and "
             "world_size (runner.vllm_config.parallel_config: a rank's log lines and one-rank faults); "
             "world_size and data_parallel_size: a lone worker's TAIL thread takes the cores it leaves out",
             attributes=("pipeline_parallel_size", "tensor_parallel_size", "rank", "world_size",
                         "data_parallel_size")),
    Internal("vllm.v1.worker.worker_base:WorkerBase.__init__", "sets parallel_config.rank in each worker: what "
             "tells the ranks apart", ("self", "vllm_config", "local_rank", "rank")),
    Internal("vllm.entrypoints.llm:LLM.collective_rpc", "called by `kvcanary simulate --tensor-parallel 2`: a "
             "canary installed in, and read back from, each worker's model_runner",
             ("self", "method", "timeout", "args", "kwargs")),
    Internal("vllm.config:SpeculativeConfig", "read at install (runner.speculative_config): method (ngram and "
             "draft_model checked, any other disables the canary)", attributes=("method", "num_speculative_tokens")),
    Internal("vllm.v1.spec_decode.draft_model:DraftModelProposer", "read at install (runner.drafter): "
             "_draft_attn_layer_names, the draft model's layers in the target's KV cache group (not fingerprinted)"),
    Internal("vllm.v1.worker.gpu.model_runner:GPUModelRunner", "Model Runner V2: recognised at install (no "
             "_model_forward, no requests) and left unchecked"),
    Internal("vllm.v1.engine.llm_engine:LLMEngine", "read: engine_core.engine_core.model_executor."
             "driver_worker.worker.model_runner (in-process LLM only)"),
    Internal("vllm.entrypoints.llm:LLM.reset_prefix_cache", "called by install(): drops blocks cached before it",
             ("self",)),
    Internal("vllm.v1.engine.llm_engine:LLMEngine.abort_request", "called after a step the canary failed: the "
             "failed call's requests (output_processor.request_states, parent_requests) aborted",
             ("self", "request_ids", "internal")),
    Internal("vllm.v1.core.sched.scheduler:Scheduler", "read after a step the canary failed: requests "
             "(engine_core.engine_core.scheduler, in-process); any the output side did not know aborted"),
    Internal("vllm.v1.engine.llm_engine:LLMEngine.reset_prefix_cache", "called after a step the canary failed: "
             "blocks registered for KV the step may not have written dropped", ("self",)),
    Internal("vllm.plugins:load_general_plugins", "calls the entry points of group vllm.general_plugins"),
    Internal("vllm.platforms:current_platform", "read by the plugin at registration: device_type (the backend "
             "checked against it)", attributes=("device_type",)),
    # the canary KV connector (connector.py)
    Internal(f"{FACTORY}.get_connector_class", "patched by the plugin when KVCANARY_VLLM_CONNECTOR is set: the "
             "named connector's class answered with the canary connector wrapping it", ("kv_transfer_config",)),
    Internal("vllm.distributed.kv_transfer.kv_connector.v1.base:KVConnectorBase_V1", "the canary connector's "
             "base class: every hook delegated to the wrapped connector (a test lists them)"),
    Internal("vllm.distributed.kv_transfer:get_kv_transfer_group", "read at install: the worker's connector, "
             "attached to the canary when it is the canary connector"),
    Internal(f"{EXAMPLE}:ExampleConnector._generate_foldername_debug", "called: the prompt's folder, where the "
             "records file goes", ("self", "token_ids", "mm_hashes", "create_folder")),
    Internal(f"{EXAMPLE}:ReqMeta", "read in its metadata: what ExampleConnector saves and loads",
             attributes=("token_ids", "slot_mapping", "is_store", "mm_hashes")),
    Internal("vllm.v1.core.sched.output:NewRequestData", "read by the canary connector's scheduler side: the "
             "request a save or load belongs to, its allocated blocks and computed tokens",
             attributes=("req_id", "prompt_token_ids", "block_ids", "num_computed_tokens")),
)


def resolve(target: str) -> object:
    """The object named ``module:qualname`` (AttributeError / ImportError when it is gone)."""
    module, _, qualname = target.partition(":")
    obj: object = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def problems() -> list[str]:
    """What no longer matches in the installed vLLM (empty when every internal is as the integration expects)."""
    out = []
    for item in INTERNALS:
        try:
            obj = resolve(item.target)
        except (ImportError, AttributeError) as exc:
            out.append(f"{item.target}: missing ({exc})")
            continue
        if item.parameters:
            names = tuple(inspect.signature(obj).parameters)  # type: ignore[arg-type]
            if names[: len(item.parameters)] != item.parameters:
                out.append(f"{item.target}: parameters {names}, expected to start with {item.parameters}")
        if item.attributes:
            fields = set(getattr(obj, "__dataclass_fields__", {})) | set(getattr(obj, "__annotations__", {}))
            fields |= set(dir(obj))
            missing = [a for a in item.attributes if a not in fields]
            if missing:
                out.append(f"{item.target}: attributes {missing} missing")
    return out
