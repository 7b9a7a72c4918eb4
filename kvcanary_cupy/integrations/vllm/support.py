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

__all__ = ["CHECKED", "DISABLED", "PARTIAL", "RULES", "SKIPPED", "GroupDecision", "Rule", "Support", "assess",
           "support_at_install", "support_table"]

CHECKED = "checked"
PARTIAL = "checked without real-KV hashes"
SKIPPED = "group skipped"
DISABLED = "canary disabled"


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
         SKIPPED, "vLLM frees a block once it leaves the window and hands it out again at once, while the worker's "
                  "block table keeps its id; verifying only in-window positions is not implemented"),
    Rule("mla", "model kind", "multi-head latent attention (`MLAAttentionSpec`: DeepSeek-V2/V3)", SKIPPED,
         "the latent cache `[blocks, block_size, 576]` (one row per token, no heads, no V) and the MLA backend's "
         "metadata are not read yet"),
    Rule("mamba", "model kind", "Mamba / gated-delta-net / linear-attention group (`MambaSpec`: Qwen3-Next, Jamba)",
         SKIPPED, "it holds per-request recurrent state, not per-token KV: there is no token to check in it"),
    Rule("other-spec", "model kind", "any other KV cache spec (chunked-local, cross, encoder-only, sink, ...)",
         SKIPPED, "a group kind the canary does not know is left unchecked rather than checked wrongly"),
    Rule("no-group", "model kind", "no KV cache group left to check", DISABLED,
         "every group of the model is skipped (reasons above)"),
    Rule("hybrid-sweep", "model kind", "more than one KV cache group (hybrid models)", "sweep off",
         "the groups share vLLM's block pool and alias each other's bytes: a block moves between groups and is "
         "overwritten by the other group's layers, so only blocks a scheduled request reads are verified"),
    # dtypes and the CPU KV layout each one gets
    Rule("isa-vec", "dtype", "layers on CPU ISA `vec`: fp32 and fp16 models, bf16 on a CPU without AMX tiles; "
                             "`auto` or fp8 KV cache", CHECKED, "the `vec` layout is read in place, byte-exact"),
    Rule("isa-other", "dtype", "layers on any other CPU ISA: `amx` (bf16 on an AMX CPU), `vec16` (head size a "
                               "multiple of 16, not 32)", PARTIAL,
         "that ISA's KV layout (e.g. 16-token tiles with VNNI pairs) is not implemented: token ids, positions and "
         "chain hashes are checked, the K/V bytes are not (`real_kv_hash=none` asks for exactly that)"),
    # whole-engine features
    Rule("speculative", "speculative decoding", "`speculative_config` set (ngram, draft_model, EAGLE, MTP, ...)",
         DISABLED, "draft positions and the provisional K/V of rejected drafts are not modelled yet; unset "
                   "`speculative_config` to check this engine"),
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
         "each rank checks its own KV-head shard; vLLM's CPU build needs `VLLM_CPU_OMP_THREADS_BIND` set by hand"),
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

    @property
    def checked_groups(self) -> list[GroupDecision]:
        return [] if self.disabled else [g for g in self.groups if g.checked]

    @property
    def sweep(self) -> bool:
        """The prefix-cache sweep is safe (one KV cache group: no block moves to another group's layers)."""
        return len(self.groups) <= 1

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
            rule = RULE["hybrid-sweep"]
            lines.append(f"prefix-cache sweep off ({len(self.groups)} KV cache groups): {rule.why}")
        return [f"kv-canary: {line}" for line in lines]

    def refusal(self, real_kv_hash: str) -> str | None:
        """What ``raise`` mode refuses at install: anything the canary would leave unchecked (a group skipped, K/V
        bytes not read although ``real_kv_hash`` asks for them, the whole engine); None when all is checked."""
        if self.disabled:
            return f"the canary cannot check this engine: {self.disabled}"
        partial = [g for g in self.groups if not g.checked or (real_kv_hash != "none" and not g.real_kv)]
        if partial:
            return "part of this engine would go unchecked: " + "; ".join(self._group_line(g) for g in partial)
        return None


def _layout_rule(forward_context: dict[str, Any], layer_names: tuple[str, ...]) -> tuple[Rule, str]:
    """``isa-vec`` when every layer of the group has CPU attention's ``vec`` layout, else ``isa-other``; and the
    ISAs seen (``None``: a layer vLLM set none on)."""
    isas = {str(getattr(forward_context.get(name), "isa", None)) for name in layer_names}
    return (RULE["isa-vec"] if isas == {"vec"} else RULE["isa-other"]), "/".join(sorted(isas))


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
    if getattr(runner, "speculative_config", None) is not None:
        spec = runner.speculative_config
        engine.append((RULE["speculative"], f"method={getattr(spec, 'method', '?')}, "
                                            f"num_speculative_tokens={getattr(spec, 'num_speculative_tokens', '?')}"))
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
        layout, isa = _layout_rule(forward_context, names) if rule.status == CHECKED else (None, "")
        groups.append(GroupDecision(index, type(spec).__name__, names, rule, layout, isa))
    return Support(runner=cls.__name__, groups=groups, engine=engine)


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
    if options.mode == "raise":
        refusal = support.refusal(options.real_kv_hash)
        if refusal is not None:
            fail(f"mode='raise' refuses this engine at install: {refusal} (use mode='log' to check the rest"
                 f"{', or real_kv_hash=none for a layout it cannot read' if 'real-KV' in refusal else ''})")
        return support
    logger = logging.getLogger(options.logger)
    for line in support.unchecked(options.real_kv_hash):
        logger.warning("%s", line)
    return support
