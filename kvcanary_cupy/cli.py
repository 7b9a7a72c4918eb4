"""The ``kvcanary`` command (also ``python -m kvcanary_cupy``).

``kvcanary simulate`` drives the canary through a synthetic serving workload, injects KV-cache faults and
reports what was caught; ``kvcanary replay`` reruns a launch dumped by ``simulate --dump-failures`` on the CPU;
``kvcanary info`` shows the backends, versions and caches; ``kvcanary cache clear`` empties the host module cache.
:func:`main` returns the exit status instead of exiting: 0 success, 1 a failed run (a fault kind missed, a false
positive, a replay that does not reproduce), 2 bad arguments, 3 an internal error, 4 an inconclusive simulation
(a requested fault kind found no target in the workload, and nothing failed), 130 interrupted.
Which ``simulate`` option applies to which engine and mode is :mod:`.option_scope`'s table, checked against the
options typed (not argparse's defaults) before any engine is built or any file written.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, TextIO

PROG = "kvcanary"


class _UsageError(Exception):
    def __init__(self, parser: argparse.ArgumentParser, message: str) -> None:
        super().__init__(message)
        self.parser = parser


class BadArguments(Exception):
    """Arguments that parse but cannot run (unknown fault kind, unavailable backend, missing file...)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # never exits: main() turns it into status 2
        raise _UsageError(self, message)


def _int_at_least(minimum: int, wording: str) -> Any:
    """An argparse type: an int >= ``minimum``, with ``wording`` in the error message."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {wording}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected {wording}, got {value}")
        return value

    return parse


_positive = _int_at_least(1, "a positive integer")


def _kill_drill(text: str) -> tuple[int, int]:
    worker, at, step = text.partition("@")
    try:
        if not at:
            raise ValueError
        return int(worker), int(step)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected WORKER@STEP, e.g. 1@5, got {text!r}") from None


_non_negative = _int_at_least(0, "an integer >= 0")


def _seconds(text: str) -> float:
    """An argparse type: seconds in (0, one day] (nan, inf or 1e300 would reach the socket timeouts as garbage)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value <= 86400:  # false for nan too
        raise argparse.ArgumentTypeError(f"expected a number of seconds in (0, 86400], got {text!r}")
    return value


def _seed(text: str) -> int:
    try:
        value = int(text, 0)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer seed, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"the seed must be >= 0, got {value}")
    return value


def _tiers(text: str) -> tuple[str, ...]:
    """``--tiers``: ``host`` or ``host,disk`` (validated by SimConfig, with the message naming the option)."""
    return tuple(part.strip() for part in text.split(",") if part.strip())


def _simulate_epilog() -> str:
    from .integrations.transformers.faults import FAULT_KINDS as TRANSFORMERS_KINDS
    from .integrations.vllm.faults import FAULT_KINDS as VLLM_KINDS
    from .integrations.vllm.faults import MODEL_FAULT_KINDS, SPECULATIVE_FAULT_KINDS
    from .integrations.vllm.simulate_connector import CONNECTOR_FAULT_KINDS
    from .sim.disagg.faults import DEFAULT_TRANSFER_RATE, TRANSFER_KINDS
    from .sim.faults import DEFAULT_RATE, FAULT_KINDS, TIER_FAULT_KINDS
    from .sim.runner import PRESETS

    kinds = "\n".join(f"  {name:<16} {kind.title}" + ("  (needs an SWA preset)" if kind.needs == "swa" else "")
                      for name, kind in FAULT_KINDS.items())
    tier_kinds = "\n".join(f"  {name:<22} {kind.title}" + ("  (needs host,disk)" if kind.needs == "disk" else "")
                           for name, kind in TIER_FAULT_KINDS.items())
    transfer_kinds = "\n".join(f"  {name:<20} {kind.title} ({kind.side} side)" for name, kind in TRANSFER_KINDS.items())
    connector_kinds = "\n".join(f"  {name:<18} {kind.title}" for name, kind in CONNECTOR_FAULT_KINDS.items())
    presets = "\n".join(f"  {p.name:<8} {p.description}" for p in PRESETS.values())
    engine_kinds = "\n".join(textwrap.wrap(", ".join(TRANSFORMERS_KINDS), 110, initial_indent="  transformers: ",
                                           subsequent_indent=" " * 16, break_on_hyphens=False)
                             + textwrap.wrap(", ".join(VLLM_KINDS), 110, initial_indent="  vllm:         ",
                                             subsequent_indent=" " * 16, break_on_hyphens=False)
                             + textwrap.wrap(f"and, with --model-arch mistral-sw or gemma3, "
                                             f"{' and '.join(MODEL_FAULT_KINDS)} (gemma3 only: "
                                             f"{list(MODEL_FAULT_KINDS)[-1]}); with --speculative, "
                                             f"{', '.join(SPECULATIVE_FAULT_KINDS)}", 110,
                                             initial_indent=" " * 16, subsequent_indent=" " * 16,
                                             break_on_hyphens=False))
    return f"""\
examples:
  {PROG} simulate --preset mixed --inject all --steps 200 --requests 48 --seed 7
  {PROG} simulate --preset decode --steps 100             (a clean run must show no violation)
  {PROG} simulate --preset swa --inject swa-early-evict:0.1 --inject kv-bitflip
  {PROG} simulate --inject all --seed 7 --json report/run.json --html report/run.html --dump-failures report/dumps
  {PROG} simulate --engine transformers --inject all   (the canary inside transformers' continuous batching)
  {PROG} simulate --engine vllm --inject all --backend host   (inside vLLM's V1 engine, CPU build)
  {PROG} simulate --engine vllm --model-arch gemma3 --tensor-parallel 2 --inject all   (per rank)
  {PROG} simulate --engine vllm --connector example --disaggregated --inject all   (KV through a connector)
  {PROG} replay report/dumps/kv-bitflip-seed7-step7-TAIL_K_FULL-verify.npz --backend host --sanitize
  {PROG} simulate --disaggregated --decode-workers 2 --inject all --steps 60 --requests 16

fault kinds (--inject KIND[:RATE]; RATE = expected injections per step, default {DEFAULT_RATE};
'all' = every kind the preset can host; the run tries to inject each requested kind at least once, and a kind
that finds no target in a small workload is reported as "could not inject"):
{kinds}

tier fault kinds, with --tiers (injected at a load-back; 'all' adds them when --tiers is given):
{tier_kinds}

transfer fault kinds, with --disaggregated (RATE = probability per transfer, default {DEFAULT_TRANSFER_RATE};
the run tries each requested kind on the first transfers after the warm-up, and every fault must be caught
before its request's first decode step):
{transfer_kinds}

fault kinds of --engine transformers and vllm (--inject KIND, no rate: each requested kind is armed once in
every workload run; 'all' = every kind of the engine; docs/transformers.md and docs/vllm.md describe them):
{engine_kinds}

fault kinds of --engine vllm --connector example (injected into the connector's files and metadata between the
save and the load; each must be refused with its reason before the load's forward):
{connector_kinds}

presets:
{presets}

--disaggregated starts one prefill process and N decode processes (torch.distributed: gloo on CPU, NCCL
with GPUs; loopback addresses only); KV pages and canary records travel between them and every decode
worker verifies each received prefix before the request's first decode step.

exit status: 0 when every requested fault kind was injected and detected and nothing else was flagged;
1 when a kind was missed or something else was flagged; 4 when nothing failed but a requested kind could not
be injected (the workload is too small: raise --steps or --requests); 2 for bad arguments;
with --disaggregated, 1 also when a process died or the run missed its deadline."""


REPLAY_EPILOG = f"""\
examples:
  {PROG} replay report/dumps/kv-bitflip-seed7-step7-TAIL_K_FULL-verify.npz   (a file 'make demo' writes)
  {PROG} replay FILE --backend host --sanitize     (the kernels under AddressSanitizer + UBSan)
  {PROG} replay FILE --backend numpy               (the NumPy reference instead of the kernels)

The file holds one launch's inputs (canary buffer before the launch, plan, real-KV bytes, flags) and the
violation rows it produced; the replay runs it again and compares the rows.
exit status: 0 reproduced, 1 not reproduced, 2 bad arguments."""


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = _Parser(prog=PROG, description="KV-cache canary: simulate a serving engine with injected faults,\n"
                     "replay a dumped failing launch on the CPU, or show what this machine offers.",
                     epilog=f"run '{PROG} COMMAND --help' for the options and examples of a command",
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    _add_simulate(sub)
    rep = sub.add_parser("replay", help="rerun a dumped launch on the CPU and print its violations",
                         description="Rerun a launch saved by 'simulate --dump-failures' through the exact kernel "
                         "code on the CPU and print the violations.", epilog=REPLAY_EPILOG,
                         formatter_class=argparse.RawDescriptionHelpFormatter)
    rep.add_argument("file", metavar="FILE", help="a .npz written by --dump-failures")
    rep.add_argument("--backend", choices=["host", "numpy"], default=None,
                     help="host (the CUDA kernels compiled for the CPU; default when g++ is present) or numpy")
    rep.add_argument("--sanitize", action="store_true",
                     help="run the host backend under AddressSanitizer and UBSan (re-executes Python)")
    rep.set_defaults(func=_cmd_replay)
    _add_machine_commands(sub)
    return parser


def _model_sizes() -> str:
    """The --model-size help: each engine's sizes, from the dicts the engines build their models from."""
    from .integrations.transformers.workloads import MODEL_SIZES as TRANSFORMERS_SIZES
    from .integrations.vllm.workloads import MODEL_SIZES as VLLM_SIZES

    def sizes(table: dict[str, dict[str, int]]) -> str:
        return ", ".join(f"{name} (hidden {d['hidden_size']}, {d['num_hidden_layers']} layers)"
                         for name, d in table.items())

    return f"transformers: {sizes(TRANSFORMERS_SIZES)}; vllm: {sizes(VLLM_SIZES)}"


def _add_simulate(sub: Any) -> None:
    """``simulate``: its options in groups; the help of each ends with where it applies (:mod:`.option_scope`)."""
    from .backends import BACKEND_NAMES
    from .integrations.vllm.workloads import DTYPES, MODEL_ARCHS, SPECULATIVE, TENSOR_PARALLEL
    from .option_scope import SCOPE
    from .sim.runner import PRESETS

    sim = sub.add_parser("simulate", help="run an engine with fault injection and report detections",
                         description="Drive the canary through a synthetic serving workload (or a real engine: "
                         "--engine transformers or vllm),\ninject KV-cache faults, and report per fault kind what "
                         "was detected, how fast, the false positives\nand the canary's cost. Every option states "
                         "its default and, where it does not apply everywhere,\nthe engines and modes it applies "
                         "to; an option given where it does not apply is refused (exit status 2).",
                         epilog=_simulate_epilog(), formatter_class=argparse.RawDescriptionHelpFormatter)
    engine = sim.add_argument_group("engine")
    engine.add_argument("--engine", choices=["synthetic", "transformers", "vllm"], default="synthetic",
                        help="synthetic (this project's engine), transformers (Hugging Face continuous batching "
                        "with a random-weight model; needs the transformers extra) or vllm (vLLM's V1 engine, CPU "
                        "build, in-process, random-weight model; needs the vllm extra) (default: %(default)s)")
    engine.add_argument("--model-size", choices=["small", "medium"], default="small",
                        help=f"the random-weight model: {_model_sizes()} (default: %(default)s)")
    engine.add_argument("--model-arch", choices=["llama", *MODEL_ARCHS], default="llama",
                        help="the model kind: llama (full attention), mistral-sw (every layer sliding-window), gemma3 "
                        "(sliding-window and full layers alternating), deepseek-mla (multi-head latent attention), "
                        "qwen3-next (gated-delta-net and full attention, bf16); tiny, random weights "
                        "(default: %(default)s)")
    engine.add_argument("--dtype", choices=list(DTYPES), default=None,
                        help="the model's dtype (default: the model kind's own: fp32, bf16 for qwen3-next)")
    engine.add_argument("--speculative", choices=list(SPECULATIVE), default=None,
                        help="speculative decoding: ngram (prompt lookup, 3 draft tokens) or draft (a draft model: the "
                        "model's weights plus noise, 2 draft tokens) (default: none, off)")
    engine.add_argument("--tensor-parallel", type=int, choices=list(TENSOR_PARALLEL), default=1,
                        metavar="{" + ",".join(map(str, TENSOR_PARALLEL)) + "}",
                        help="tensor-parallel workers, each a process with its own canary over its KV-head shard; "
                        "each fault is injected on one rank and reported per rank (default: %(default)s)")
    engine.add_argument("--connector", choices=["example"], default=None,
                        help="run vLLM through a KV connector with the canary connector around it: example "
                        "(vLLM's ExampleConnector, a file store); one engine process saves each prompt's KV with "
                        "its canary records, a new one loads and verifies them (with --disaggregated: a kv_producer "
                        "instance, then a kv_consumer instance); the connector fault kinds for --inject "
                        "(default: none, no connector)")
    engine.add_argument("--backend", choices=["auto", *BACKEND_NAMES], default="auto",
                        help="canary implementation: auto (cuda with a GPU, else host where g++ compiles it, "
                        "else numpy), numpy (reference), cuda (CuPy kernels), host (the CUDA kernels compiled for "
                        "the CPU); transformers and vllm take auto, numpy or host (default: %(default)s)")
    work = sim.add_argument_group("workload")
    work.add_argument("--preset", choices=list(PRESETS), default=None,
                      help="scenario (default: mixed; decode with --disaggregated)")
    work.add_argument("--steps", type=_positive, default=200, help="engine steps to run (default: %(default)s)")
    work.add_argument("--requests", type=_positive, default=48,
                      help="requests in the workload (default: %(default)s)")
    work.add_argument("--seed", type=_seed, default=0,
                      help="seed of the workload, the model and the faults (default: %(default)s)")
    work.add_argument("--warmup", type=_non_negative, default=4, metavar="N",
                      help="steps before the chain-position assert and the faults start (default: %(default)s)")
    work.add_argument("--cooldown", type=_non_negative, default=None, metavar="N",
                      help="last steps without new faults (default: min(16, steps/5))")
    work.add_argument("--layout", choices=["token", "block", "csr"], default="token",
                      help="slot layout the plan reads: token (SGLang's req_to_token; KV allocated per token), "
                      "block (a batch-row block table, vLLM-style) or csr (page lists, FlashInfer-style); in "
                      "block and csr the engine allocates KV in blocks of --block-size tokens, keeps each "
                      "request's block list and shares the prefix cache in whole blocks (default: %(default)s)")
    work.add_argument("--block-size", type=_positive, default=None, metavar="N",
                      help="tokens per KV block with --layout block or csr (default: the preset's page size, 16)")
    work.add_argument("--block-stride", type=_positive, default=None, metavar="N",
                      help="slots between consecutive block ids with --layout block, >= the block size "
                      "(transformers' physical stride; default: the block size)")
    faults = sim.add_argument_group("faults")
    faults.add_argument("--inject", action="append", default=[], metavar="KIND[:RATE][,...]",
                        help="inject fault kinds (repeatable, or a comma list; 'all' for every kind the run can "
                        "host; the kinds and rates are listed below; transformers and vllm take no rate: they "
                        "arm each kind once per workload run) (default: none, a clean run)")
    canary = sim.add_argument_group("canary")
    canary.add_argument("--sweep-interval", type=_non_negative, default=8, metavar="N",
                        help="verify every prefix-cache slot every N steps (0: never; default: %(default)s)")
    canary.add_argument("--max-verify-entries", type=_non_negative, default=0, metavar="N",
                        help="bounded verify: at most N prefix entries verified per step and group, round-robin "
                        "over the live prefixes (0: every prefix slot every step; default: %(default)s); the "
                        "synthetic engine's report states the detection-latency bound")
    canary.add_argument("--with-v", action="store_true",
                        help="add V endpoints next to K (default: off, K only; always on in transformers and vllm)")
    canary.add_argument("--real-kv-hash", choices=["all", "partial"], default="all",
                        help="bytes of real KV fingerprinted per slot: all, or the first 16 (default: %(default)s)")
    canary.add_argument("--ring-capacity", type=_positive, default=16384, metavar="ROWS",
                        help="violation ring rows per canary group (default: %(default)s)")
    tiers = sim.add_argument_group("tiers (a KV hierarchy below the device pool)")
    tiers.add_argument("--tiers", type=_tiers, default=(), metavar="host[,disk]",
                       help="host (an L2 in host memory) and disk (an L3 of files); evicted prefix-cache paths are "
                       "written back with their canary records and loaded back asynchronously, restored records "
                       "verified before a forward reads them; adds the tier-* fault kinds to --inject all "
                       "(default: none, the device pool alone)")
    tiers.add_argument("--tier-dir", metavar="DIR", default=None,
                       help="directory of the L3 files with --tiers host,disk; the files are removed at the end "
                       "(default: a temporary directory)")
    dis = sim.add_argument_group("disaggregated serving (prefill and decode in separate processes)")
    dis.add_argument("--disaggregated", action="store_true",
                     help="one prefill process + decode workers; transfer faults for --inject (default: off, one "
                     "process)")
    dis.add_argument("--decode-workers", type=_positive, default=2, metavar="N",
                     help="decode processes (default: %(default)s)")
    dis.add_argument("--transfer-timeout", type=_seconds, default=30.0, metavar="S",
                     help="seconds any send, receive or rendezvous may take before the run fails "
                     "(default: %(default)g)")
    dis.add_argument("--kill-decode-worker", type=_kill_drill, default=None, metavar="W@STEP",
                     help="fault drill: decode worker W kills itself (SIGKILL) at its step STEP; the run must "
                     "report it and exit non-zero (default: none, no drill)")
    out = sim.add_argument_group("output")
    out.add_argument("--json", metavar="PATH", default=None,
                     help="write the report as JSON (schema: kvcanary_cupy.sim.report); '-' writes it to standard "
                     "output and the table to standard error (default: none, no JSON)")
    out.add_argument("--html", metavar="PATH", default=None,
                     help="write an HTML report with a plot (default: none, no HTML)")
    out.add_argument("--dump-failures", metavar="DIR", default=None,
                     help="save the first failing launch of each fault kind as .npz for 'kvcanary replay' "
                     "(default: none, nothing saved)")
    out.add_argument("--quiet", action="store_true", help="no progress display (default: off, progress shown)")
    out.add_argument("--plain", action="store_true",
                     help="plain-text table even when rich is installed (default: off)")
    for action in sim._actions:
        scope = SCOPE.get(action.option_strings[-1]) if action.option_strings else None
        if scope is not None and action.help:
            action.help += scope.label()
    sim.set_defaults(func=_cmd_simulate)


def _add_machine_commands(sub: Any) -> None:
    """``info`` and ``cache``: what this machine offers, and the cache this package writes."""
    info = sub.add_parser("info", help="backends (and why one is unavailable), versions, cache folders",
                          description="Show which backends run here and why the others do not, the versions of "
                          "CuPy, NVRTC, the CUDA driver, g++, libasan and torch, and the cache folders.")
    info.add_argument("--json", action="store_true", help="print the same as JSON")
    info.set_defaults(func=_cmd_info)
    cache = sub.add_parser("cache", help="manage the compiled host module cache",
                           description="The host backend caches compiled kernels (see 'kvcanary info' for the "
                           "folder; $KVCANARY_CACHE_DIR or $XDG_CACHE_HOME move it).")
    actions = cache.add_subparsers(dest="action", metavar="ACTION", parser_class=_Parser, required=True)
    clear = actions.add_parser("clear", help="delete every cached host module",
                               description="Delete every cached host module (they are rebuilt on next use). "
                               "CuPy's own kernel cache is shared with other programs and left alone.")
    clear.set_defaults(func=_cmd_cache_clear)


def _writable(path: str, option: str) -> None:
    """Fail before the run, not after it, when a report file cannot be written."""
    parent = Path(path).parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise BadArguments(f"{option} {path}: cannot create {parent}: {exc.strerror}") from None
    if not os.access(parent, os.W_OK) or Path(path).is_dir():
        raise BadArguments(f"{option} {path}: not writable")


@dataclass(frozen=True)
class Output:
    """Where ``simulate`` sends its report, the same for every engine and mode."""

    json: str | None  # a path, '-' (standard output) or None
    html: str | None
    quiet: bool  # no progress display
    plain: bool  # a plain-text table even with rich


def _check_outputs(out: Output) -> None:
    for path, option in ((None if out.json == "-" else out.json, "--json"), (out.html, "--html")):
        if path:
            _writable(path, option)


def _emit(out: Output, report: dict[str, Any], print_report: Any, write_json: Any,
          write_html: Any) -> TextIO:
    """Print the report and write its files; returns the stream meant for people. With --json -, standard
    output carries the JSON alone and everything for people goes to standard error."""
    json_to_stdout = out.json == "-"
    human = sys.stderr if json_to_stdout else sys.stdout
    print_report(report, human, plain=out.plain)
    if json_to_stdout:
        json.dump(report, sys.stdout, indent=2)
        sys.stdout.write("\n")
    for path, writer in ((None if json_to_stdout else out.json, write_json), (out.html, write_html)):
        if path:
            try:
                print(f"wrote {writer(report, path)}", file=human)
            except OSError as exc:  # the run's verdict stands: report it, keep its exit status
                print(f"{PROG} simulate: error: cannot write {path}: {exc}", file=sys.stderr)
    return human


@dataclass(frozen=True)
class SimulatePlan:
    """What ``kvcanary simulate`` runs: the mode (:data:`.option_scope.MODES`) and its validated configuration
    (a ``SimConfig``, ``DisaggConfig`` or the engine's sim config), and where the report goes."""

    mode: str
    config: Any
    output: Output


def _given_options(argv: list[str]) -> list[str]:
    """The ``simulate`` options typed in ``argv`` (long names, in the parser's order), as opposed to the ones
    argparse filled in with their defaults: the same parser with every default suppressed parses ``argv`` again."""
    parser = build_parser()
    sim = _subparser(parser, "simulate")
    for action in sim._actions:
        action.default = argparse.SUPPRESS
    typed = vars(parser.parse_args(argv))
    return [a.option_strings[-1] for a in sim._actions if a.option_strings and a.dest in typed]


def _subparser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices[command]
    raise KeyError(command)


def plan_simulate(args: argparse.Namespace) -> SimulatePlan:
    """Check every option the user gave against the option table, then build and validate the mode's config;
    :class:`BadArguments` naming the option for anything that cannot run. Nothing is started or written."""
    from .option_scope import inject_items, mode_of, refusals

    mode = mode_of(args.engine, args.disaggregated, args.connector)
    problems = refusals(mode, args.given_options)
    if problems:
        raise BadArguments("; ".join(problems))
    try:
        inject = [item.text for item in inject_items(args.inject, mode)]
        config = _CONFIG_OF_MODE[mode](args, inject)
    except ValueError as exc:
        raise BadArguments(str(exc)) from None
    return SimulatePlan(mode, config, Output(json=args.json, html=args.html, quiet=args.quiet, plain=args.plain))


def _synthetic_config(args: argparse.Namespace, inject: list[str]) -> Any:
    from .sim.faults import parse_inject
    from .sim.runner import SimConfig, applicable_kinds

    preset = args.preset or "mixed"
    cfg = SimConfig(preset=preset, steps=args.steps, requests=args.requests, seed=args.seed, backend=args.backend,
                    inject=parse_inject(inject, applicable_kinds(preset, args.tiers)),
                    sweep_interval=args.sweep_interval, with_v=args.with_v, real_kv_hash=args.real_kv_hash,
                    warmup_steps=args.warmup, cooldown_steps=args.cooldown, ring_capacity=args.ring_capacity,
                    max_verify_entries=args.max_verify_entries, dump_dir=args.dump_failures, layout=args.layout,
                    block_size=args.block_size, block_stride=args.block_stride, tiers=args.tiers,
                    tier_dir=args.tier_dir)
    cfg.validate()
    return cfg


def _disaggregated_config(args: argparse.Namespace, inject: list[str]) -> Any:
    from .sim.disagg import DisaggConfig
    from .sim.disagg.faults import DEFAULT_TRANSFER_RATE, TRANSFER_KINDS
    from .sim.faults import parse_inject

    cfg = DisaggConfig(
        preset=args.preset or "decode", steps=args.steps, requests=args.requests, seed=args.seed,
        backend=args.backend, decode_workers=args.decode_workers,
        inject=parse_inject(inject, known=TRANSFER_KINDS, default_rate=DEFAULT_TRANSFER_RATE),
        sweep_interval=args.sweep_interval, with_v=args.with_v, real_kv_hash=args.real_kv_hash,
        warmup_steps=args.warmup, ring_capacity=args.ring_capacity, transfer_timeout_s=args.transfer_timeout,
        kill_decode_worker=args.kill_decode_worker)
    cfg.validate()
    return cfg


def _engine_modules(engine: str) -> tuple[ModuleType, ModuleType]:
    """The ``report`` and ``simulate`` modules of an engine integration."""
    try:
        report = importlib.import_module(f".integrations.{engine}.report", __package__)
        simulate = importlib.import_module(f".integrations.{engine}.simulate", __package__)
    except ImportError as exc:
        extra = "torch and transformers" if engine == "transformers" else "vLLM (pip install 'kvcanary_cupy[vllm]')"
        raise BadArguments(f"--engine {engine} needs {extra}: {exc}") from None
    return report, simulate


def _engine_config(engine: str) -> Any:
    def build(args: argparse.Namespace, inject: list[str]) -> Any:
        return _engine_modules(engine)[1].config_from_args(args)  # validated there; rates were refused above

    return build


def _connector_config(args: argparse.Namespace, inject: list[str]) -> Any:
    _engine_modules("vllm")  # vLLM importable, or the engine's own refusal
    from .integrations.vllm.simulate_connector import config_from_args

    return config_from_args(args)


_CONFIG_OF_MODE = {"synthetic": _synthetic_config, "disaggregated": _disaggregated_config,
                   "transformers": _engine_config("transformers"), "vllm": _engine_config("vllm"),
                   "vllm-connector": _connector_config}


def _cmd_simulate(args: argparse.Namespace) -> int:
    plan = plan_simulate(args)
    if plan.mode == "synthetic":
        return _run_synthetic(plan.config, plan.output)
    if plan.mode == "disaggregated":
        return _run_disaggregated(plan.config, plan.output)
    if plan.mode == "vllm-connector":
        return _run_connector(plan.config, plan.output)
    return _run_engine(plan.mode, plan.config, plan.output)


def _run_synthetic(cfg: Any, out: Output) -> int:
    from .sim.l3dir import TierStorageError
    from .sim.report import ProgressDisplay, print_report, write_html, write_json
    from .sim.runner import Simulation

    try:
        sim = Simulation(cfg)
    except (ValueError, OSError) as exc:
        raise BadArguments(str(exc)) from None
    _check_outputs(out)
    try:
        with ProgressDisplay(cfg.steps, enabled=not out.quiet) as progress:
            report = sim.run(progress)
    except TierStorageError as exc:  # the L3 directory failed mid-run (full disk, directory removed)
        print(f"{PROG} simulate: error: the disk tier failed: {exc}", file=sys.stderr)
        return 1
    human = _emit(out, report, print_report, write_json, write_html)
    if sim.recorder is not None:
        for kind, path in sim.recorder.dumped.items():
            print(f"dumped the first failing launch of {kind}: {path}", file=human)
        if sim.recorder.dumped:
            first = next(iter(sim.recorder.dumped.values()))
            print(f"replay one on the CPU with: {PROG} replay {first} --backend host --sanitize", file=human)
    return int(report["exit_code"])


def _run_engine(engine: str, cfg: Any, out: Output) -> int:
    """``simulate --engine <engine>`` for an engine the canary is installed in (transformers, vLLM)."""
    report_module, simulate_module = _engine_modules(engine)
    _check_outputs(out)
    report = simulate_module.run_quietly(cfg, progress=not out.quiet)
    _emit(out, report, report_module.print_report, report_module.write_json, report_module.write_html)
    return int(report["exit_code"])


def _run_connector(cfg: Any, out: Output) -> int:
    """``simulate --engine vllm --connector``: each engine a process of its own around the KV connector."""
    from .integrations.vllm import simulate_connector as sc

    _check_outputs(out)
    try:
        report = sc.run_connector_simulation(cfg, progress=not out.quiet)
    except sc.EngineProcessError as exc:  # the run has no verdict: say why, fail it
        print(f"{PROG} simulate: error: the connector run failed: {exc}", file=sys.stderr)
        return 1
    _emit(out, report, sc.print_report, sc.write_json, sc.write_html)
    return int(report["exit_code"])


def _run_disaggregated(cfg: Any, out: Output) -> int:
    from .sim.disagg import DisaggRunError, run_disaggregated
    from .sim.disagg.report import print_report, write_html, write_json

    _check_outputs(out)
    if not out.quiet:
        print(f"starting 1 prefill process and {cfg.decode_workers} decode worker(s) on 127.0.0.1", file=sys.stderr)
    try:
        report = run_disaggregated(cfg)
    except DisaggRunError as exc:
        print(f"{PROG} simulate: error: the disaggregated run failed: {exc}", file=sys.stderr)
        return 1
    _emit(out, report, print_report, write_json, write_html)
    return int(report["exit_code"])


def _cmd_replay(args: argparse.Namespace) -> int:
    from .backends import unavailable_reason
    from .sim.replay import run_replay

    backend = args.backend or ("host" if unavailable_reason("host") is None else "numpy")
    reason = unavailable_reason(backend)
    if reason is not None:
        raise BadArguments(f"--backend {backend} is not available here: {reason}")
    return run_replay(args.file, backend, sanitize=args.sanitize)


def _cmd_info(args: argparse.Namespace) -> int:
    from .diagnostics import collect, render_text

    info = collect()
    print(json.dumps(info, indent=2) if args.json else render_text(info))
    return 0


def _cmd_cache_clear(args: argparse.Namespace) -> int:
    from .cache import clear

    held = clear()
    print(f"removed {held.files} files ({held.bytes / (1024 * 1024):.1f} MiB) from {held.path}")
    return 0


def parse(argv: list[str], parser: argparse.ArgumentParser | None = None) -> argparse.Namespace:
    """``argv`` parsed (by ``parser``, default :func:`build_parser`'s); for ``simulate`` with
    ``given_options``, the options typed rather than defaulted."""
    args = (parser or build_parser()).parse_args(argv)
    if args.command == "simulate":
        args.given_options = _given_options(argv)
    return args


def _debug_requested() -> bool:
    """``KVCANARY_DEBUG=1``: an internal error shows its traceback. Read through the settings module like every
    variable (``0`` is off; a value outside ``0``/``1`` is said, not taken as on)."""
    from . import settings

    try:
        return bool(settings.read("KVCANARY_DEBUG"))
    except ValueError as exc:
        print(f"{PROG}: {str(exc).removeprefix('kv-canary: ')}", file=sys.stderr)
        return False


def main(argv: list[str] | None = None) -> int:
    """Run the command line ``argv`` (default: ``sys.argv[1:]``) and return the exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    try:
        args = parse(argv, parser)
    except _UsageError as exc:
        exc.parser.print_usage(sys.stderr)
        print(f"{exc.parser.prog}: error: {exc}", file=sys.stderr)
        return 2
    except SystemExit as exc:  # --help, --version
        return exc.code if isinstance(exc.code, int) else 0
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        return int(args.func(args))
    except BadArguments as exc:
        message = str(exc).removeprefix("kv-canary: ")
        print(f"{PROG} {args.command}: error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        if _debug_requested():
            raise
        print(f"{PROG} {args.command}: internal error: {type(exc).__name__}: {exc} "
              "(set KVCANARY_DEBUG=1 for the traceback)", file=sys.stderr)
        return 3


if __name__ == "__main__":
    raise SystemExit(main())
