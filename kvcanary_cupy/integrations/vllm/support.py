"""What the canary checks in a vLLM engine and what it leaves unchecked, decided once, at install, from vLLM's own
configuration (the runner's KV cache groups and their spec classes, each layer's CPU attention ISA, the
speculative-decoding, scheduling, parallel and KV-transfer settings, the runner class).

:data:`RULES` is the one list of every case and its reason; :func:`assess` picks the rules that apply to a runner,
and docs/vllm.md's support table is printed from the same list (:func:`support_table`, kept equal by a test). A
monitor never stops the engine: in ``log`` and ``off`` mode what is not checked is logged, one line each, and the
rest is checked (or the canary disables itself with one line); ``raise`` mode refuses the configuration at install,
before the first request.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from ..._errors import fail
from .layers import backend_name, is_mla_spec

__all__ = ["CHECKED", "DISABLED", "PARTIAL", "RULES", "SKIPPED", "SPECULATIVE_METHODS", "UNHASHED", "GroupDecision",
           "Rule", "Support", "assess", "support_at_install", "support_table"]

CHECKED = "checked"
PARTIAL = "checked without real-KV hashes"
SKIPPED = "group skipped"
DISABLED = "canary disabled"
UNHASHED = "checked; these layers' K/V bytes not fingerprinted"

# the speculative-decoding methods the canary checks (run token-exact on vLLM's CPU build, tested)
SPECULATIVE_METHODS = ("ngram", "draft_model")


@dataclass(frozen=True)
class Rule:
    """One case of the support table: the ``area`` (model kind, dtype, ...), the ``configuration`` it covers, its
    ``status`` (:data:`CHECKED`, :data:`PARTIAL`, :data:`SKIPPED`, :data:`DISABLED`, or a note such as ``sweep off``)
    and ``why``."""

    key: str
    area: str
    configuration: str
    status: str
    why: str


RULES: tuple[Rule, ...] = (
    # model kinds: one rule per KV cache group, by its spec class
    Rule("full", "model kind", "full attention (`FullAttentionSpec`: Llama, Qwen, ...)", CHECKED,
         "every token's id, position and chain hash, and the real K/V bytes of every layer"),
    Rule("sliding-window", "model kind", "sliding-window group (`SlidingWindowSpec`: Mistral, Gemma2/3 local layers)",
         CHECKED, "each token's id, position and chain hash and its K/V bytes while its window still reads it: a "
                  "query at position q reads q - window + 1 .. q, and the block-table entries below that (blocks "
                  "vLLM has freed and handed out again, whose ids the worker keeps, or the null block of a prefix "
                  "hit) are never verified, stamped or indexed for the sweep"),
    Rule("mla", "model kind", "multi-head latent attention (`MLAAttentionSpec`: DeepSeek-V2/V3)", CHECKED,
         "every token's id, position and chain hash, and each layer's latent row `[blocks, block_size, 576]` "
         "(one row per token: the compressed KV and K's rotary part; MLA stores no V)"),
    Rule("mamba", "model kind", "Mamba / gated-delta-net / linear-attention group (`MambaSpec`: Qwen3-Next, Jamba)",
         SKIPPED, "it holds per-request recurrent state, not per-token KV: there is no token to check in it"),
    Rule("other-spec", "model kind", "any other KV cache spec (chunked-local, cross, encoder-only, sink, ...)",
         SKIPPED, "a group kind the canary does not know is left unchecked rather than checked wrongly"),
    Rule("no-group", "model kind", "no KV cache group left to check", DISABLED,
         "every group of the model is skipped (reasons above)"),
    Rule("skipped-group-sweep", "model kind", "a KV cache group skipped next to checked ones (the Mamba/GDN groups "
                                              "of Qwen3-Next)", "sweep off",
         "the groups share vLLM's block pool, and the skipped group's layers write the blocks it takes through a "
         "block table the canary does not read: a cached block handed to it could not be told from a corrupted "
         "one; every block a scheduled request reads is still verified, each step"),
    # dtypes and the CPU KV layout each one gets
    Rule("isa-vec", "dtype", "layers on CPU ISA `vec` or `vec16`: fp32 and fp16 models, bf16 on a CPU without AMX "
                             "tiles, head sizes a multiple of 16 but not 32; `auto` or fp8 KV cache", CHECKED,
         "the `vec` layout (`vec16` writes the same) is read in place, byte-exact"),
    Rule("isa-amx", "dtype", "layers on CPU ISA `amx`: bf16 models on a CPU with AMX tiles (block and head sizes "
                             "multiples of 32); bf16 or fp8 KV cache", CHECKED,
         "the `amx` layout (K in 16-token tiles with elements in VNNI pairs, V in 16-element chunks with tokens in "
         "pairs) is read in place, byte-exact"),
    Rule("isa-other", "dtype", "layers on any other CPU ISA (`neon`, `vsx`, `vxe`, `rvv`: other CPU architectures)",
         PARTIAL, "that ISA's KV layout is not implemented: token ids, positions and chain hashes are checked, the "
                  "K/V bytes are not (`real_kv_hash=none` asks for exactly that)"),
    Rule("mla-latent", "dtype", "MLA layers on vLLM's `CPU_MLA` backend (`attention_backend=CPU_MLA`; tested with "
                                "fp32 and bf16 models)", CHECKED,
         "the latent rows are read in place, byte-exact"),
    Rule("mla-other", "dtype", "MLA layers on any other MLA backend (`AMX_MLA`, vLLM's bf16 default on an AMX CPU; "
                               "the GPU MLA backends)", PARTIAL,
         "that backend's latent cache layout is not verified here: token ids, positions and chain hashes are "
         "checked, the latent bytes are not"),
    Rule("kv-fp8", "dtype", "`kv_cache_dtype` `fp8`, `fp8_e4m3`, `fp8_e5m2` (uint8 storage)", CHECKED,
         "the cache's own element size (1 byte) is the layout's: every token's K/V bytes are read in place"),
    Rule("kv-unsupported", "dtype", "`kv_cache_dtype` vLLM's CPU kernel does not support but accepts "
                                    "(`int8_per_token_head`, `fp8_per_token_head`, a 2-byte cache under an fp32 "
                                    "model)", CHECKED,
         "the kernel writes fp32 elements at fp32 offsets into the smaller cache, over other tokens' K/V (a vLLM "
         "bug): the canary reads each token where the cache's layout puts it and reports the overwrites as "
         "`VERIFY_REAL_KV_HASH_MISMATCH`"),
    # whole-engine features
    Rule("speculative", "speculative decoding", "`speculative_config` with method `ngram` or `draft_model`", CHECKED,
         "draft positions expect the scheduler's draft tokens (`scheduled_spec_decode_tokens`) and are stamped as "
         "they are written; from the first rejected draft on they are provisional (never verified, never swept) "
         "until the next step writes those positions again"),
    Rule("speculative-draft-kv", "speculative decoding", "the draft model's attention layers (`draft_model`: "
                                                         "they join the target's KV cache group)", UNHASHED,
         "the drafter writes their K/V after the target's forward, outside the hooked forward, and again in later "
         "steps; their tokens, positions and chain hashes are the target's, checked, and the target verifies "
         "every draft token, so a corruption there costs acceptance, never a wrong token"),
    Rule("speculative-other", "speculative decoding", "`speculative_config` with any other method (EAGLE, "
                                                      "EAGLE-3, MTP, DFlash, suffix, medusa, ...)", DISABLED,
         "untested: these drafters need a trained head or an MTP model (none runs on this CPU build), and their "
         "layers and inputs are not modelled; unset `speculative_config` to check this engine"),
    Rule("async", "scheduling", "async scheduling (`runner.use_async_scheduling`)", DISABLED,
         "the worker's request state holds -1 placeholders for sampled tokens; start vLLM with "
         "`async_scheduling=False` (`--no-async-scheduling`; on CPU vLLM always turns it off)"),
    Rule("sync", "scheduling", "synchronous scheduling, chunked prefill, prefix caching, preemption", CHECKED,
         "each step read from the runner's attention metadata and request state"),
    Rule("runner-v2", "runner", "Model Runner V2 (`vllm.v1.worker.gpu.model_runner`, vLLM's default on CUDA with "
                                "Triton)", DISABLED,
         "it has no `_model_forward` and no `requests` for the hooks; set `VLLM_USE_V2_MODEL_RUNNER=0`"),
    Rule("device", "runner", "a V1 runner on a GPU", DISABLED,
         "its attention metadata and caches live on the device, which this integration does not copy yet"),
    Rule("runner-cpu", "runner", "V1 `CPUModelRunner` (vLLM's CPU build)", CHECKED, "the tested runner"),
    Rule("tp", "tensor parallel", "`tensor_parallel_size > 1` (plugin in each worker)", CHECKED,
         "each rank checks its own KV-head shard and logs with its rank; vLLM's CPU build needs each rank's cores "
         "in `VLLM_CPU_OMP_THREADS_BIND` (`0-31|32-63`) where it has fewer NUMA nodes than workers"),
    Rule("pp", "pipeline parallel", "`pipeline_parallel_size > 1`", DISABLED,
         "untested: a later stage's forward gets intermediate tensors, not token ids"),
    Rule("kv-transfer", "KV connectors", "`kv_transfer_config` set (offloading, disaggregated prefill) without the "
                                          "canary connector, or around a connector it has no record store for",
         DISABLED, "blocks a connector loads carry no canary records and would all read as corruption; set "
                   "`KVCANARY_VLLM_CONNECTOR=<kv_connector>` to wrap it (record stores: `ExampleConnector`)"),
    Rule("kv-transfer-canary", "KV connectors", "the canary connector wrapping `ExampleConnector` "
                                                "(`KVCANARY_VLLM_CONNECTOR`)", CHECKED,
         "the records travel with the saved KV; a load is verified (token, position, chain, real KV) before the "
         "first layer reads it"),
)
RULE: dict[str, Rule] = {r.key: r for r in RULES}

_GROUP_RULES = {"FullAttentionSpec": "full", "SlidingWindowSpec": "sliding-window", "MLAAttentionSpec": "mla",
                "MambaSpec": "mamba"}


@dataclass(frozen=True)
class GroupDecision:
    """One vLLM KV cache group: its index, spec class and layers, the rule of its kind and, for a checked group,
    the rule of its layers' KV layout (real-KV hashes read or not)."""

    index: int
    spec: str
    layer_names: tuple[str, ...]
    rule: Rule
    layout: Rule | None = None
    isa: str = ""  # the layers' CPU attention ISA(s), as vLLM set them

    @property
    def name(self) -> str:
        return f"G{self.index}"

    @property
    def checked(self) -> bool:
        return self.rule.status == CHECKED

    @property
    def real_kv(self) -> bool:
        """The group's K/V bytes are fingerprinted (its layers' layout is implemented)."""
        return self.checked and self.layout is not None and self.layout.status == CHECKED


@dataclass
class Support:
    """What :func:`assess` decided for one runner: the groups, the whole-engine rules that apply (with what was
    read), and whether the canary runs at all."""

    runner: str
    groups: list[GroupDecision]
    engine: list[tuple[Rule, str]]
    draft_layers: tuple[str, ...] = ()  # the draft model's layers: checked, their K/V bytes not fingerprinted

    @property
    def checked_groups(self) -> list[GroupDecision]:
        return [] if self.disabled else [g for g in self.groups if g.checked]

    @property
    def sweep(self) -> bool:
        """The prefix-cache sweep is safe: every KV cache group is checked, so every write into the shared block
        pool is seen in a block table the canary reads (a block one group takes is dropped from the others'
        sweep)."""
        return all(g.checked for g in self.groups)

    @property
    def disabled(self) -> str | None:
        """Why the canary checks nothing in this engine (None: it checks its groups)."""
        reasons = [f"{rule.configuration.split(' (')[0]} ({seen}): {rule.why}" for rule, seen in self.engine
                   if rule.status == DISABLED]
        if not reasons and not any(g.checked for g in self.groups):
            rule = RULE["no-group"]
            reasons = [f"{rule.configuration}: " + "; ".join(self._group_line(g) for g in self.groups)]
        return "; ".join(reasons) or None

    @staticmethod
    def _group_line(g: GroupDecision) -> str:
        layers = ", ".join(g.layer_names[:2]) + (f" and {len(g.layer_names) - 2} more" if len(g.layer_names) > 2
                                                 else "")
        if not g.checked:
            return f"KV cache group {g.name} ({g.spec}; {layers}) is not checked: {g.rule.why}"
        assert g.layout is not None
        return f"KV cache group {g.name} ({g.spec}; {layers}) is {g.layout.status} (CPU attention ISA {g.isa}): " \
               f"{g.layout.why}"

    def unchecked(self, real_kv_hash: str = "partial") -> list[str]:
        """One line per group or feature not (fully) checked (with ``real_kv_hash="none"`` no group's K/V bytes are
        asked for, so none is missing); empty when everything is."""
        if self.disabled:
            return [f"kv-canary disabled in {self.runner}, this engine runs unchecked: {self.disabled}"]
        lines = [self._group_line(g) for g in self.groups
                 if not g.checked or (real_kv_hash != "none" and not g.real_kv)]
        if not self.sweep:
            rule = RULE["skipped-group-sweep"]
            skipped = ", ".join(g.name for g in self.groups if not g.checked)
            lines.append(f"prefix-cache sweep off (KV cache group(s) {skipped} skipped): {rule.why}")
        return [f"kv-canary: {line}" for line in lines]

    def notes(self, real_kv_hash: str = "partial") -> list[str]:
        """Lines logged at install in every mode for what is deliberately left out of the check without a gap in
        it (the draft model's K/V bytes); empty when there is none."""
        if self.disabled or not self.draft_layers or real_kv_hash == "none":
            return []
        rule = RULE["speculative-draft-kv"]
        layers = ", ".join(self.draft_layers[:2]) + (f" and {len(self.draft_layers) - 2} more"
                                                     if len(self.draft_layers) > 2 else "")
        return [f"kv-canary: the draft model's layers ({layers}) are {rule.status}: {rule.why}"]

    def refusal(self, real_kv_hash: str) -> str | None:
        """What ``raise`` mode refuses at install: anything the canary would leave unchecked (a group skipped, K/V
        bytes not read although ``real_kv_hash`` asks for them, the whole engine); None when all is checked."""
        if self.disabled:
            return f"the canary cannot check this engine: {self.disabled}"
        partial = [g for g in self.groups if not g.checked or (real_kv_hash != "none" and not g.real_kv)]
        if partial:
            return "part of this engine would go unchecked: " + "; ".join(self._group_line(g) for g in partial)
        return None


def _layout_rule(forward_context: dict[str, Any], layer_names: tuple[str, ...], spec: Any = None) \
        -> tuple[Rule, str]:
    """``isa-vec`` when every layer of the group has CPU attention's ``vec`` layout (``vec16`` writes the same),
    ``isa-amx`` when they have ``amx`` layouts (a cache of 2- or 1-byte elements, as vLLM gives only bf16 models
    and fp8 caches ``amx``), else ``isa-other``; and the ISAs seen (``None``: a layer vLLM set none on). An MLA
    group: ``mla-latent`` when every layer runs on ``CPU_MLA``, else ``mla-other``; and the backends seen."""
    if is_mla_spec(spec):
        backends = {str(backend_name(forward_context.get(name))) for name in layer_names}
        return (RULE["mla-latent"] if backends == {"CPU_MLA"} else RULE["mla-other"]), "/".join(sorted(backends))
    layers = [forward_context.get(name) for name in layer_names]
    isas = {str(getattr(layer, "isa", None)) for layer in layers}
    seen = "/".join(sorted(isas))
    if isas <= {"vec", "vec16"}:
        return RULE["isa-vec"], seen
    amx_readable = all(getattr(layer, "isa", None) != "amx" or _element_size(layer) in (1, 2) for layer in layers)
    return (RULE["isa-amx"] if isas <= {"vec", "vec16", "amx"} and amx_readable else RULE["isa-other"]), seen


def _element_size(layer: Any) -> int | None:
    """The element size of a layer's KV cache tensor (None: it has none yet)."""
    cache = getattr(layer, "kv_cache", None)
    if isinstance(cache, (list, tuple)):  # vLLM keeps one tensor per virtual engine on some versions
        cache = cache[0] if cache else None
    size = getattr(cache, "element_size", None)
    return int(size()) if callable(size) else None


def _group_rule(spec: Any) -> Rule:
    return RULE[_GROUP_RULES.get(type(spec).__name__, "other-spec")]


def assess(runner: Any) -> Support:
    """Read a model runner's configuration and decide what the canary checks in it (reads only; never raises on
    an unknown configuration: what it does not recognise is not checked)."""
    engine: list[tuple[Rule, str]] = []
    cls = type(runner)
    if cls.__module__.startswith("vllm.v1.worker.gpu.") or not hasattr(runner, "_model_forward") \
            or not hasattr(runner, "requests"):
        engine.append((RULE["runner-v2"], f"{cls.__module__}.{cls.__name__}"))
    draft_layers: tuple[str, ...] = ()
    if getattr(runner, "speculative_config", None) is not None:
        spec = runner.speculative_config
        method = getattr(spec, "method", None)
        seen = f"method={method}, num_speculative_tokens={getattr(spec, 'num_speculative_tokens', '?')}"
        engine.append((RULE["speculative" if method in SPECULATIVE_METHODS else "speculative-other"], seen))
        draft_layers = _draft_layers(runner)
    if getattr(runner, "use_async_scheduling", False) is True:
        engine.append((RULE["async"], "runner.use_async_scheduling=True"))
    vllm_config = getattr(runner, "vllm_config", None)
    parallel = getattr(vllm_config, "parallel_config", None)
    pp = getattr(parallel, "pipeline_parallel_size", 1)
    if isinstance(pp, int) and pp > 1:
        engine.append((RULE["pp"], f"pipeline_parallel_size={pp}"))
    transfer = getattr(vllm_config, "kv_transfer_config", None)
    if transfer is not None:
        from .connector import canary_connector_of

        connector = getattr(transfer, "kv_connector", None)
        carrier = canary_connector_of()
        if carrier is not None and carrier.carries_records:
            engine.append((RULE["kv-transfer-canary"], f"kv_connector={connector} wrapping {carrier.wrapped}"))
        else:
            from ... import settings

            named = settings.read("KVCANARY_VLLM_CONNECTOR")
            seen = f"kv_connector={connector}"
            if carrier is not None:
                seen += f" wrapping {carrier.wrapped}, which has no record store"
            elif named is not None:
                seen += f", but KVCANARY_VLLM_CONNECTOR={named} names another connector"
            engine.append((RULE["kv-transfer"], seen))
    caches = getattr(runner, "kv_caches", None) or []
    device = getattr(getattr(caches[0], "device", None), "type", "cpu") if caches else "cpu"
    if device != "cpu":
        engine.append((RULE["device"], f"KV cache on {device}"))

    groups: list[GroupDecision] = []
    config = getattr(runner, "kv_cache_config", None)
    forward_context = getattr(getattr(runner, "compilation_config", None), "static_forward_context", None) or {}
    for index, group in enumerate(getattr(config, "kv_cache_groups", None) or ()):
        spec = group.kv_cache_spec
        names = tuple(group.layer_names)
        rule = _group_rule(spec)
        layout, isa = _layout_rule(forward_context, names, spec) if rule.status == CHECKED else (None, "")
        groups.append(GroupDecision(index, type(spec).__name__, names, rule, layout, isa))
    return Support(runner=cls.__name__, groups=groups, engine=engine, draft_layers=draft_layers)


def _draft_layers(runner: Any) -> tuple[str, ...]:
    """The attention layers of the runner's draft model (``draft_model`` speculative decoding): the drafter's
    own list, and any layer registered under the draft model's prefix."""
    names = set(getattr(getattr(runner, "drafter", None), "_draft_attn_layer_names", None) or ())
    forward_context = getattr(getattr(runner, "compilation_config", None), "static_forward_context", None) or {}
    names |= {name for name in forward_context if str(name).startswith("draft_model.")}
    return tuple(sorted(names))


def support_table() -> list[str]:
    """The support table of docs/vllm.md, one Markdown line per rule (header first)."""
    lines = ["| area | configuration | what the canary does | why |", "| --- | --- | --- | --- |"]
    lines += [f"| {r.area} | {r.configuration} | {r.status} | {r.why} |" for r in RULES]
    return lines


def support_at_install(runner: Any, options: Any) -> Support:
    """:func:`assess` the runner for an install with ``options`` (a ``CanaryOptions``): ``raise`` mode refuses
    (``kv-canary:`` ValueError, nothing hooked yet) what the canary would leave unchecked; ``log`` and ``off`` mode
    write one WARNING line per unchecked group or feature on the options' logger and go on."""
    support = assess(runner)
    logger = logging.getLogger(options.logger)
    if options.mode == "raise":
        refusal = support.refusal(options.real_kv_hash)
        if refusal is not None:
            fail(f"mode='raise' refuses this engine at install: {refusal} (use mode='log' to check the rest"
                 f"{', or real_kv_hash=none for a layout it cannot read' if 'real-KV' in refusal else ''})")
    else:
        for line in support.unchecked(options.real_kv_hash):
            logger.warning("%s", line)
    for line in support.notes(options.real_kv_hash):
        logger.info("%s", line)
    return support
