"""Where each ``kvcanary simulate`` option applies.

A run takes one of five modes (:data:`MODES`): the synthetic engine, the synthetic engine disaggregated into
prefill and decode processes, Hugging Face transformers, vLLM, and vLLM's KV connector runs (``--engine vllm
--connector``: an engine process saves, another loads, the canary connector between them). :data:`SCOPE` says for
every option which modes apply it and, for each other mode, why it cannot; :func:`refusals` checks the options a
user actually gave (not argparse's defaults) against it, so an option is either applied or refused with a reason,
never dropped.
:func:`inject_items` checks ``--inject KIND[:RATE]`` the same way for every mode (the rate's syntax and range),
and refuses a rate where the mode injects each kind once instead of at a rate.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from .sim.config import MIN_RATE

MODES = ("synthetic", "disaggregated", "transformers", "vllm", "vllm-connector")

#: How messages and help name a mode.
MODE_NAMES = {"synthetic": "the synthetic engine", "disaggregated": "--disaggregated",
              "transformers": "--engine transformers", "vllm": "--engine vllm",
              "vllm-connector": "--engine vllm --connector"}
_ENGINES = ("transformers", "vllm", "vllm-connector")


@dataclass(frozen=True)
class Scope:
    """The modes an option applies to; ``why_not[mode]``: the reason it cannot apply to each other mode."""

    applies: tuple[str, ...]
    why_not: dict[str, str] = field(default_factory=dict)

    def label(self) -> str:
        """What ``--help`` appends: empty where the option applies everywhere."""
        if len(self.applies) == len(MODES):
            return ""
        parts = []
        if "synthetic" in self.applies:
            parts.append("the synthetic engine" if "disaggregated" in self.applies
                         else "the synthetic engine without --disaggregated")
        elif "disaggregated" in self.applies:
            parts.append("--disaggregated")
        engines = [m for m in _ENGINES if m in self.applies]
        if "vllm" in engines and "vllm-connector" in engines:  # "--engine vllm" covers its connector runs
            engines.remove("vllm-connector")
        parts += [MODE_NAMES[m] for m in engines]
        return f" [applies to: {', '.join(parts)}]"


def _everywhere() -> Scope:
    return Scope(MODES)


def _only(applies: Iterable[str], **why_not: str) -> Scope:
    """A scope from the modes that apply and a reason per other mode (``engines=`` covers transformers and
    vLLM; ``{engine}`` in a reason is the mode's name)."""
    applies = tuple(applies)
    reasons: dict[str, str] = {}
    for mode in MODES:
        if mode in applies:
            continue
        text = why_not.get(mode) or (why_not.get("engines") if mode in _ENGINES else None)
        if text is None:
            raise ValueError(f"no reason given for mode {mode}")
        reasons[mode] = text.format(engine=MODE_NAMES[mode])
    return Scope(applies, reasons)


_OWN_WORKLOADS = "its workloads are fixed, and each runs its requests to completion"
_FIXED_ARMING = "it arms each fault at a fixed step of every workload run"
_DISAGG_ONLY = "it configures the disaggregated run, which the synthetic engine alone offers"
_NEEDS_DISAGG = "needs --disaggregated"
_CONNECTOR_PAIR = ("its --disaggregated run is one prefill and one decode instance that share the connector's "
                   "store, one after the other, with no socket to time out")
_TIERS_IN_DISAGG = ("its decode workers keep no prefix cache to write back or load into (each prefix arrives "
                    "once, from the prefill process, and is verified there by the transfer verify); run --tiers "
                    "without --disaggregated")
_TIERS_IN_TRANSFORMERS = ("the tiers are simulated with the synthetic engine (--engine synthetic); transformers' "
                          "own CPU offload (cpu_offload_space) needs pinned memory, which CPU-only torch refuses")
_TIERS_IN_VLLM = ("the tiers are simulated with the synthetic engine (--engine synthetic); the vLLM run has no KV "
                  "connector or CPU offload to write back to")
_TIERS_IN_CONNECTOR = "the KV connector's store is the lower tier of this run"
_VLLM_MODEL = ("the synthetic engine has no model: it writes synthetic KV",
               "the transformers engine runs its Llama-style model in fp32 on one process; model kinds, dtypes, "
               "speculative decoding and tensor parallel are vLLM's (--engine vllm)")
_CONNECTOR_MODEL = ("its engine processes run the Llama-style model in fp32, one worker each (the records "
                    "travel per prompt folder of ExampleConnector, one KV cache group)")
_CONNECTOR_ONLY = {"synthetic": "the synthetic engine has no KV connector (its lower tiers are --tiers)",
                   "disaggregated": "the synthetic engine has no KV connector (its transfers are its own)",
                   "transformers": "transformers has no KV connector interface",
                   "vllm": "needs --connector"}
_LAYOUT_IN_DISAGG = "its engines keep req_to_token"
_LAYOUT_IN_ENGINES = "the slot layout is the engine's own block table"

#: Every ``kvcanary simulate`` option, long name -> where it applies (a test walks the parser against it).
SCOPE: dict[str, Scope] = {
    # engine
    "--engine": _everywhere(),
    "--model-size": _only(_ENGINES, synthetic="the synthetic engine has no model: it writes synthetic KV",
                          disaggregated="the synthetic engine has no model: it writes synthetic KV"),
    "--model-arch": _only(("vllm",), synthetic=_VLLM_MODEL[0], disaggregated=_VLLM_MODEL[0],
                          transformers=_VLLM_MODEL[1], **{"vllm-connector": _CONNECTOR_MODEL}),
    "--dtype": _only(("vllm",), synthetic=_VLLM_MODEL[0], disaggregated=_VLLM_MODEL[0], transformers=_VLLM_MODEL[1],
                     **{"vllm-connector": _CONNECTOR_MODEL}),
    "--speculative": _only(("vllm",), synthetic=_VLLM_MODEL[0], disaggregated=_VLLM_MODEL[0],
                           transformers=_VLLM_MODEL[1], **{"vllm-connector": _CONNECTOR_MODEL}),
    "--tensor-parallel": _only(("vllm",), synthetic=_VLLM_MODEL[0], disaggregated=_VLLM_MODEL[0],
                               transformers=_VLLM_MODEL[1], **{"vllm-connector": _CONNECTOR_MODEL}),
    "--connector": _only(("vllm-connector",), **_CONNECTOR_ONLY),
    "--backend": _everywhere(),
    # workload
    "--preset": _only(("synthetic", "disaggregated"), engines="it runs its own workloads, not the presets"),
    "--steps": _only(("synthetic", "disaggregated"), engines=_OWN_WORKLOADS),
    "--requests": _only(("synthetic", "disaggregated"), engines=_OWN_WORKLOADS),
    "--seed": _everywhere(),
    "--warmup": _only(("synthetic", "disaggregated"), engines=_FIXED_ARMING),
    "--cooldown": _only(("synthetic",), disaggregated="every transfer fault must be caught before its request's "
                        "first decode step, so no step is kept free of faults", engines=_FIXED_ARMING),
    "--layout": _only(("synthetic",), disaggregated=_LAYOUT_IN_DISAGG, engines=_LAYOUT_IN_ENGINES),
    "--block-size": _only(("synthetic",), disaggregated=_LAYOUT_IN_DISAGG, engines=_LAYOUT_IN_ENGINES),
    "--block-stride": _only(("synthetic",), disaggregated=_LAYOUT_IN_DISAGG, engines=_LAYOUT_IN_ENGINES),
    # faults
    "--inject": _everywhere(),
    # canary
    "--sweep-interval": _everywhere(),
    "--max-verify-entries": _only(
        ("synthetic", "transformers"),
        disaggregated="every decode worker verifies each received prefix in full before the request's first "
                      "decode step",
        vllm="the vLLM integration has no bounded verify: it verifies every prefix entry every step",
        **{"vllm-connector": "the vLLM integration has no bounded verify: it verifies every prefix entry every "
                             "step"}),
    "--with-v": _only(("synthetic", "disaggregated"), engines="it always checks V endpoints"),
    "--real-kv-hash": _everywhere(),
    "--ring-capacity": _everywhere(),
    # tiers
    "--tiers": _only(("synthetic",), disaggregated=_TIERS_IN_DISAGG, transformers=_TIERS_IN_TRANSFORMERS,
                     vllm=_TIERS_IN_VLLM, **{"vllm-connector": _TIERS_IN_CONNECTOR}),
    "--tier-dir": _only(("synthetic",), disaggregated=_TIERS_IN_DISAGG, transformers=_TIERS_IN_TRANSFORMERS,
                        vllm=_TIERS_IN_VLLM, **{"vllm-connector": _TIERS_IN_CONNECTOR}),
    # disaggregated
    "--disaggregated": _only(("synthetic", "disaggregated", "vllm-connector"),
                             transformers="prefill/decode disaggregation is simulated with the synthetic engine",
                             vllm="in vLLM it runs through a KV connector: add --connector example"),
    "--decode-workers": _only(("disaggregated",), synthetic=_NEEDS_DISAGG, engines=_DISAGG_ONLY,
                              **{"vllm-connector": _CONNECTOR_PAIR}),
    "--transfer-timeout": _only(("disaggregated",), synthetic=_NEEDS_DISAGG, engines=_DISAGG_ONLY,
                                **{"vllm-connector": _CONNECTOR_PAIR}),
    "--kill-decode-worker": _only(("disaggregated",), synthetic=_NEEDS_DISAGG, engines=_DISAGG_ONLY,
                                  **{"vllm-connector": _CONNECTOR_PAIR}),
    # output
    "--json": _everywhere(),
    "--html": _everywhere(),
    "--dump-failures": _only(("synthetic",), disaggregated="its launches run in the worker processes and are not "
                             "recorded for replay", engines="it records no launches for replay"),
    "--quiet": _everywhere(),
    "--plain": _everywhere(),
}


def mode_of(engine: str, disaggregated: bool, connector: str | None = None) -> str:
    """The mode of a run: the engine, ``disaggregated`` for the synthetic engine with --disaggregated, or
    ``vllm-connector`` for vLLM with --connector."""
    if engine == "vllm" and connector is not None:
        return "vllm-connector"
    return "disaggregated" if engine == "synthetic" and disaggregated else engine


def refusals(mode: str, given: Iterable[str]) -> list[str]:
    """One message per option in ``given`` (long names, as typed) that does not apply to ``mode``, in the
    order given. An option missing from :data:`SCOPE` is refused too: nothing is applied unchecked."""
    out: list[str] = []
    for option in given:
        scope = SCOPE.get(option)
        if scope is None:
            out.append(f"{option} has no entry in the option table, so it cannot be applied")
        elif mode not in scope.applies:
            reason = scope.why_not[mode]
            if reason == _NEEDS_DISAGG:
                out.append(f"{option} needs --disaggregated")
            else:
                out.append(f"{option} does not apply to {MODE_NAMES[mode]}: {reason}")
    return out


@dataclass(frozen=True)
class InjectItem:
    """One ``KIND[:RATE]`` of ``--inject`` as typed; ``rate`` None when none was given."""

    text: str
    kind: str
    rate: float | None


def inject_items(values: Iterable[str], mode: str) -> list[InjectItem]:
    """``--inject`` values (each a comma list of ``KIND[:RATE]``) as items; ValueError naming the item for a
    rate that is not a number in [:data:`MIN_RATE`, 1], and for any rate where ``mode`` injects each kind once
    per run (transformers and vLLM arm each requested kind once, at a fixed step, in every workload)."""
    items: list[InjectItem] = []
    for value in values:
        for text in value.split(","):
            text = text.strip()
            if not text:
                continue
            kind, colon, rate_text = text.partition(":")
            rate: float | None = None
            if colon:
                try:
                    rate = float(rate_text)
                except ValueError:
                    raise ValueError(f"--inject {text!r}: the rate must be a number in (0, 1]") from None
                if not 0 < rate <= 1:  # false for nan too
                    raise ValueError(f"--inject {text!r}: the rate must be in (0, 1], got {rate_text}")
                if rate < MIN_RATE or not math.isfinite(rate):
                    raise ValueError(f"--inject {text!r}: the rate must lie in [{MIN_RATE}, 1]")
                if mode in _ENGINES:
                    raise ValueError(f"--inject {text!r}: a rate does not apply to {MODE_NAMES[mode]}: it injects "
                                     "each requested kind once per workload run, armed at a fixed step; give "
                                     "the kind without a rate")
            items.append(InjectItem(text, kind.strip(), rate))
    return items
