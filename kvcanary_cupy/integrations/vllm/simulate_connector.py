"""``kvcanary simulate --engine vllm --connector example [--disaggregated]``: the canary connector around vLLM's
``ExampleConnector`` (:mod:`.connector`), each engine a process of its own, clean runs and one run per fault of
the connector path, reported like the other engines' runs.

vLLM keeps one KV transfer group per process, and a load must come from a process that did not save: every
engine run here is a child process running :func:`run_engine` (``python -m
kvcanary_cupy.integrations.vllm.simulate_connector SPEC``), which prints one ``RESULT`` line of JSON. A
workload is two phases over a store folder of its own: ``save-load`` (a ``kv_both`` instance computes and saves
the prompts, a new ``kv_both`` instance loads them) or, with ``--disaggregated``, ``producer-consumer`` (a
``kv_producer`` instance prefills, a ``kv_consumer`` instance decodes from its KV). Per workload: both phases
without the canary (the reference completions), both with it (the completions must be identical and nothing may
be flagged: chunked prefill is off, a whole prompt is saved in one step), then one load phase per requested
fault kind (:data:`CONNECTOR_FAULT_KINDS`) on a copy of the clean store with that fault injected into the
connector's real files or metadata. A fault is detected when the canary connector refuses the faulted
request's load with the fault's reason at the step of the load, before that step's forward; any other finding
or canary violation before the fault, and any in a clean run, is a false positive. Exit statuses as for the
other engines (0 passed, 1 failed, 4 inconclusive).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..._errors import fail
from .connector import RECORDS_FILE, LoadReason

__all__ = [
    "CONNECTORS",
    "CONNECTOR_FAULT_KINDS",
    "SCHEMA_ID",
    "ConnectorFault",
    "ConnectorSimConfig",
    "EngineProcessError",
    "folder_of",
    "inject_store_fault",
    "run_connector_simulation",
    "run_engine",
]

SCHEMA_ID = "kvcanary-vllm-connector-report/1"
CONNECTORS = {"example": "ExampleConnector"}  # --connector value -> vLLM's kv_connector name
RUN_TIMEOUT_S = 600  # one engine process: start, run, exit
NO_CHUNKING = 512  # max_num_batched_tokens that prefills every workload prompt in one step
CHUNKED = 128  # max_num_batched_tokens of the partial-save fault's save phase


@dataclass(frozen=True)
class ConnectorFault:
    """One fault kind of the connector path: its title and the reason the canary connector must refuse with."""

    title: str
    reason: LoadReason


CONNECTOR_FAULT_KINDS: dict[str, ConnectorFault] = {
    "kv-layout": ConnectorFault("a loaded block in another KV layout (LMCache#4463)", LoadReason.LOAD_VERIFY_FAILED),
    "kv-swap": ConnectorFault("K and V swapped in the saved blocks", LoadReason.LOAD_VERIFY_FAILED),
    "foreign-files": ConnectorFault("another prompt's KV and records under this prompt's key",
                                    LoadReason.LOAD_RECORDS_FOREIGN),
    "records-truncated": ConnectorFault("the records file truncated", LoadReason.LOAD_RECORDS_DAMAGED),
    "kv-bitrot": ConnectorFault("one bit of a saved KV file flipped", LoadReason.LOAD_VERIFY_FAILED),
    "records-bitrot": ConnectorFault("one bit of the records file flipped", LoadReason.LOAD_RECORDS_DAMAGED),
    "stale-kv": ConnectorFault("the KV files rewritten by an earlier version of the prefix",
                               LoadReason.LOAD_RECORDS_STALE),
    "records-missing": ConnectorFault("the records file missing", LoadReason.LOAD_RECORDS_MISSING),
    "wrong-blocks": ConnectorFault("the load sent into the wrong block ids (the connector's metadata one block "
                                   "over)", LoadReason.LOAD_VERIFY_FAILED),
    "partial-save": ConnectorFault("blocks saved before they were all written (chunked prefill: the connector's "
                                   "own bug)", LoadReason.LOAD_SAVED_BEFORE_WRITTEN),
}

# the workload's prompt lengths: partial last blocks, two of equal length (one sequence's files under the other's
# key), none one more than a multiple of the block size (ExampleConnector looks a prompt up by its first len - 1)
PROMPT_LENGTHS = (40, 70, 99, 80, 80, 66, 50, 120)
FOREIGN_PAIR = (3, 4)  # foreign-files puts prompt 4's files under prompt 3's key
PARTIAL_LENGTHS = (5, 150)  # the partial-save fault's batch: 5 + 123 tokens in the first 128-token step


# ---- one engine in a process of its own ----------------------------------------------------------------------

def run_engine(spec: dict[str, Any]) -> dict[str, Any]:
    """Run one engine as the spec says (in this process: call it from a fresh one) and return its result.

    The spec: ``model``, ``store`` (the ExampleConnector folder), ``prompts`` (token-id lists), ``max_tokens``,
    ``batch`` (true: all prompts in one ``generate``), ``engine`` (engine arguments over the defaults),
    ``canary`` (false: no canary, no wrapper: the plain connector), ``env`` (more KVCANARY_VLLM_* variables),
    ``wrap`` (KVCANARY_VLLM_CONNECTOR; "": unset), ``wrong_blocks`` (prompt indexes whose load the connector's
    metadata sends one block over: a load into the wrong block ids), ``policy`` (vLLM's kv_load_failure_policy),
    ``role`` (kv_both, kv_producer or kv_consumer), ``route`` (``plugin``, or ``install``: the wrapper named by
    ``kv_connector_module_path`` and the canary put in by ``install()``)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
    route = spec.get("route", "plugin")
    if route == "install":  # no plugin: the config names the wrapper, install() puts the canary in
        os.environ.pop("KVCANARY_VLLM", None)
    elif spec.get("canary", True):
        os.environ["KVCANARY_VLLM"] = "log"
        os.environ["KVCANARY_VLLM_CONNECTOR"] = spec.get("wrap", "ExampleConnector")
        if not os.environ["KVCANARY_VLLM_CONNECTOR"]:
            del os.environ["KVCANARY_VLLM_CONNECTOR"]
        os.environ.update(spec.get("env", {}))
    else:
        os.environ.pop("KVCANARY_VLLM", None)

    wrong = [tuple(p[:8]) for i, p in enumerate(spec["prompts"]) if i in spec.get("wrong_blocks", [])]
    if wrong:
        _send_loads_one_block_over(wrong)

    from vllm import SamplingParams

    from .hooks import find_runner
    from .workloads import engine

    transfer: dict[str, Any] = {"kv_connector": "ExampleConnector", "kv_role": spec.get("role", "kv_both"),
                                "kv_connector_extra_config": {"shared_storage_path": spec["store"]}}
    if route == "install":
        transfer["kv_connector"] = "CanaryConnector"
        transfer["kv_connector_module_path"] = "kvcanary_cupy.integrations.vllm.connector"
        transfer["kv_connector_extra_config"]["kvcanary_wraps"] = "ExampleConnector"
    if spec.get("policy"):
        transfer["kv_load_failure_policy"] = spec["policy"]
    llm = engine(spec["model"], kv_transfer_config=transfer, **spec.get("engine", {}))
    if route == "install":
        from . import install

        install(llm, real_kv_hash=spec.get("env", {}).get("KVCANARY_VLLM_REAL_KV_HASH", "partial"))
    params = SamplingParams(max_tokens=spec.get("max_tokens", 4), temperature=0.0, ignore_eos=True)
    canary = getattr(find_runner(llm), "_kvcanary", None)
    seen: list[int] = []  # per forward: the connector's findings made before it began
    batches_of_step: list[list[str]] = []  # per forward: the request ids it ran

    class Watch:
        def before_forward(self, canary: Any, step: int, kwargs: Any, metadata: Any) -> None:
            seen.append(len(canary.connector.findings) if canary.connector is not None else 0)

        def after_forward(self, canary: Any, step: int, batch: Any) -> None:
            batches_of_step.append([str(r) for r in batch.request_ids])

    if canary is not None:
        canary.observers.append(Watch())
    outputs, request_ids = [], []
    start = time.perf_counter()
    batches = [spec["prompts"]] if spec.get("batch") else [[p] for p in spec["prompts"]]
    for batch in batches:  # by default one at a time: each request's load is a step of its own
        out = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
        outputs += [list(o.outputs[0].token_ids) for o in out]
        request_ids += [o.request_id for o in out]
    result: dict[str, Any] = {"outputs": outputs, "request_ids": request_ids, "violations": [], "findings": [],
                              "findings_before_forward": seen, "step_requests": batches_of_step,
                              "wall": time.perf_counter() - start, "steps": 0}
    if canary is not None:
        canary.finish()
        result["violations"] = [{"step": v.step, "tag": v.violation.launch_tag, "slot": v.violation.slot,
                                 "position": v.violation.position, "stored_token": v.violation.stored_token,
                                 "expected_token": v.violation.expected_token,
                                 "reasons": list(v.violation.labels)} for v in canary.violations]
        result["steps"] = canary.steps
        st = canary.state
        result["seconds"] = dict(st.seconds) if st is not None else {}
        connector = canary.connector
        result["connector"] = None if connector is None else type(connector).__name__
        if connector is not None:
            result["findings"] = [f.fields() for f in connector.findings]
            result["saved_files"] = connector.saved_files
            result["saved_bytes"] = connector.saved_bytes
            result["kv_bytes_saved"] = connector.kv_bytes_saved
            result["restored_tokens"] = connector.restored_tokens
            result["internal_errors"] = connector.internal_errors
            result["connector_seconds"] = dict(connector.seconds)
        result["unchecked"] = canary.disabled
    return result


def _send_loads_one_block_over(prompt_heads: list[tuple[int, ...]]) -> None:
    """The wrong-blocks fault: ExampleConnector's loads of these prompts (known by their first 8 tokens) land one
    block over, rotated through the blocks the scheduler allocated (a load into the wrong block ids)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import ExampleConnector

    original = ExampleConnector.start_load_kv

    def start_load_kv(self: Any, forward_context: Any, **kwargs: Any) -> None:
        block_size = self._block_size
        for req in self._get_connector_metadata().requests:
            if not req.is_store and tuple(req.token_ids[:8].tolist()) in prompt_heads:
                blocks = req.slot_mapping // block_size
                order = list(dict.fromkeys(blocks.tolist()))
                if len(order) > 1:
                    rotate = {b: order[(i + 1) % len(order)] for i, b in enumerate(order)}
                    req.slot_mapping = req.slot_mapping % block_size + block_size * blocks.apply_(rotate.get)
        original(self, forward_context, **kwargs)

    ExampleConnector.start_load_kv = start_load_kv


class EngineProcessError(RuntimeError):
    """An engine process of the simulation died, failed or ran past its deadline."""


def spawn_engine(spec: dict[str, Any], timeout: float = RUN_TIMEOUT_S) -> dict[str, Any]:
    """:func:`run_engine` in a child process of this Python (this package first on its path, none of this
    process's KVCANARY_VLLM* variables); its result, or :class:`EngineProcessError` with the end of its output
    (the child is killed at ``timeout`` seconds)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCANARY_VLLM")}
    package_root = str(Path(__file__).resolve().parents[3])
    env["PYTHONPATH"] = os.pathsep.join([package_root, *filter(None, [env.get("PYTHONPATH")])])
    env.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    try:
        proc = subprocess.run([sys.executable, "-m", __name__, json.dumps(spec)], env=env, capture_output=True,
                              text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise EngineProcessError(f"an engine process ran past {timeout:g} s and was killed") from None
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise EngineProcessError(f"the engine process exited with status {proc.returncode}:\n{proc.stdout[-3000:]}\n"
                           f"{proc.stderr[-6000:]}")
    return dict(json.loads(lines[-1].removeprefix("RESULT ")))


# ---- faults in the store ---------------------------------------------------------------------------------------

def folder_of(store: Path, prompt: list[int], block_size: int) -> Path:
    """ExampleConnector's folder of a prompt (its own key function: a hash of the block-aligned token ids)."""
    from vllm.utils.hashing import safe_hash

    n = (len(prompt) - 1) // block_size * block_size
    return store / safe_hash(np.asarray(prompt[:n], np.int64).tobytes(), usedforsecurity=False).hexdigest()


def _swap_halves(t: Any, block_size: int) -> Any:
    """K and V swapped: per saved block, the rows of its K plane and of its V plane (vLLM's CPU layout as
    ExampleConnector's ``[B, H, N, C]`` view sees it: K in the first half of a block's rows, V in the second)."""
    import torch

    n = t.shape[0]
    blocks = t.reshape(n // block_size, block_size, *t.shape[1:])
    half = block_size // 2
    return torch.cat([blocks[:, half:], blocks[:, :half]], dim=1).reshape(t.shape).contiguous()


def _other_layout(t: Any) -> Any:
    """Another KV layout of the same bytes (LMCache#4463): each token's heads and channels regrouped as
    ``[2, H, C/2]`` instead of ``[H, C]``."""
    n, h, c = t.shape
    return t.reshape(n, h, 2, c // 2).permute(0, 2, 1, 3).reshape(n, h, c).contiguous()


def _flip_bit(t: Any) -> Any:
    """One bit of one value flipped (bit rot), a third of the way into the file."""
    import torch

    out = t.clone()
    bits = out.view(torch.int32).reshape(-1)
    bits[bits.shape[0] // 3] ^= 1 << 22
    return out


def _rewrite_kv(folder: Path, change: Any, *, keep_time: bool = True) -> None:
    """Rewrite every layer file of a folder through ``change`` (its modification time kept unless told: the
    bytes are what differs, which only the real-KV fingerprint can tell)."""
    import safetensors.torch

    for f in sorted(folder.glob("*.safetensors")):
        st = f.stat()
        t = safetensors.torch.load_file(str(f))["kv_cache"]
        safetensors.torch.save_file({"kv_cache": change(t)}, str(f))
        if keep_time:
            os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))


def inject_store_fault(kind: str, folder: Path, *, block_size: int, donor: Path | None = None) -> str:
    """Inject ``kind`` into one prompt's ``folder`` of an ExampleConnector store (``donor``: the folder of a prompt
    of the same length, for foreign-files); what was done, in words. wrong-blocks and partial-save are injected
    when the engines run, not into the files."""
    records = folder / RECORDS_FILE
    if kind == "kv-layout":
        _rewrite_kv(folder, _other_layout)
        return "every layer file's tokens regrouped as [2, H, C/2]"
    if kind == "kv-swap":
        _rewrite_kv(folder, lambda t: _swap_halves(t, block_size))
        return "K and V planes of every saved block swapped"
    if kind == "foreign-files":
        assert donor is not None
        for f in folder.iterdir():
            shutil.copy2(donor / f.name, f)
        return f"the files of prompt folder {donor.name[:12]} copied over"
    if kind == "records-truncated":
        records.write_bytes(records.read_bytes()[: records.stat().st_size // 2])
        return "records file cut to half its size"
    if kind == "kv-bitrot":
        _rewrite_kv(folder, _flip_bit)
        return "bit 22 of one value flipped a third into each layer file"
    if kind == "records-bitrot":
        raw = bytearray(records.read_bytes())
        raw[len(raw) // 2] ^= 0x10
        records.write_bytes(bytes(raw))
        return "bit 4 of the records file's middle byte flipped"
    if kind == "stale-kv":
        _rewrite_kv(folder, lambda t: t * 0.5, keep_time=False)
        return "KV files rewritten with other values after the records were saved"
    if kind == "records-missing":
        records.unlink()
        return "records file deleted"
    fail(f"fault kind {kind!r} is not injected into a store's files")
    raise AssertionError  # unreachable: fail() raises


# ---- the simulation --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ConnectorWorkload:
    """Two phases over one store: the instance that saves (its role, completion length) and the one that loads."""

    name: str
    description: str
    save_role: str
    save_tokens: int
    load_role: str
    load_tokens: int


WORKLOADS = {
    "save-load": ConnectorWorkload("save-load", "a kv_both instance saves each prompt's KV, a new one loads it",
                                   "kv_both", 5, "kv_both", 5),
    "producer-consumer": ConnectorWorkload("producer-consumer", "a kv_producer instance prefills, a kv_consumer "
                                           "instance decodes from its KV", "kv_producer", 1, "kv_consumer", 5),
}


@dataclass(frozen=True)
class ConnectorSimConfig:
    """The options of a connector simulation (``--disaggregated``: the producer/consumer workload)."""

    connector: str = "example"
    disaggregated: bool = False
    model_size: str = "small"
    inject: tuple[str, ...] = ()
    seed: int = 0
    backend: str = "auto"
    real_kv_hash: str = "all"
    sweep_interval: int = 8
    ring_capacity: int = 4096

    def validate(self) -> None:
        from ...sim.config import MAX_RING_CAPACITY
        from ._version import check_version
        from .workloads import MODEL_SIZES

        check_version()
        if self.connector not in CONNECTORS:
            fail(f"--connector must be one of {', '.join(CONNECTORS)}, got {self.connector!r}")
        if self.model_size not in MODEL_SIZES:
            fail(f"--model-size must be one of {', '.join(MODEL_SIZES)} for --engine vllm, got {self.model_size!r}")
        for kind in self.inject:
            if kind not in CONNECTOR_FAULT_KINDS:
                fail(f"unknown fault kind {kind!r} for --engine vllm --connector; choose from "
                     f"{', '.join(CONNECTOR_FAULT_KINDS)}")
        if self.backend not in ("auto", "numpy", "host"):
            fail(f"--backend {self.backend} is not available with --engine vllm --connector (use auto, numpy or "
                 "host)")
        if not 1 <= self.ring_capacity <= MAX_RING_CAPACITY:
            fail(f"--ring-capacity must lie in [1, {MAX_RING_CAPACITY}], got {self.ring_capacity}")
        if self.sweep_interval < 0:
            fail(f"--sweep-interval must be >= 0, got {self.sweep_interval}")

    @property
    def workload(self) -> ConnectorWorkload:
        return WORKLOADS["producer-consumer" if self.disaggregated else "save-load"]

    def canary_env(self) -> dict[str, str]:
        """The plugin's settings of this run's canary, in every engine process with the canary."""
        return {"KVCANARY_VLLM_REAL_KV_HASH": self.real_kv_hash, "KVCANARY_VLLM_BACKEND": self.backend,
                "KVCANARY_VLLM_SWEEP_INTERVAL": str(self.sweep_interval),
                "KVCANARY_VLLM_RING_CAPACITY": str(self.ring_capacity)}


def config_from_args(args: Any) -> ConnectorSimConfig:
    """The run's configuration from ``kvcanary simulate --engine vllm --connector`` arguments (ValueError)."""
    from ..common.records import parse_inject

    cfg = ConnectorSimConfig(connector=args.connector, disaggregated=bool(args.disaggregated),
                             model_size=args.model_size, inject=parse_inject(args.inject, CONNECTOR_FAULT_KINDS),
                             seed=args.seed, backend=args.backend, real_kv_hash=args.real_kv_hash,
                             sweep_interval=args.sweep_interval, ring_capacity=args.ring_capacity)
    cfg.validate()
    return cfg


@dataclass
class Phase:
    """One engine process's result (:func:`run_engine`) and where its steps start in the report's timeline."""

    result: dict[str, Any]
    offset: int


@dataclass
class ConnectorRun:
    """A clean run (``kind`` None: save then load, with the canary) or a fault run (its load phase, and its own
    save phase for partial-save); ``target`` the faulted prompt's index."""

    kind: str | None
    phases: list[Phase]
    target: int | None = None
    detail: str = ""

    @property
    def load(self) -> Phase:
        return self.phases[-1]


@dataclass
class ConnectorSimulation:
    cfg: ConnectorSimConfig
    prompts: list[list[int]] = field(default_factory=list)
    partial_prompts: list[list[int]] = field(default_factory=list)  # the partial-save fault's two prompts
    reference: list[dict[str, Any]] = field(default_factory=list)  # the two phases without the canary
    runs: list[ConnectorRun] = field(default_factory=list)
    wall: float = 0.0
    total_steps: int = 0

    def run(self, progress: Any = None) -> dict[str, Any]:
        from .workloads import BLOCK_SIZE, save_llama

        self.cfg.validate()
        cfg, w = self.cfg, self.cfg.workload
        start = time.perf_counter()
        rng = np.random.default_rng(cfg.seed)
        self.prompts = [rng.integers(3, 512, n).tolist() for n in PROMPT_LENGTHS]
        total = 4 + len(cfg.inject) + (1 if "partial-save" in cfg.inject else 0)
        done = [0]

        def show(what: str) -> None:
            done[0] += 1
            if progress is not None:
                progress(done[0], total, f"{w.name}: {what}")

        with tempfile.TemporaryDirectory(prefix="kvcanary-connector-") as tmp:
            root = Path(tmp)
            model = str(save_llama(root / "model", cfg.model_size, seed=cfg.seed))
            common = {"model": model, "engine": {"max_num_batched_tokens": NO_CHUNKING}}
            env = cfg.canary_env()

            def phase(store: Path, role: str, tokens: int, canary: bool, **more: Any) -> dict[str, Any]:
                spec = {**common, "store": str(store), "prompts": self.prompts, "role": role, "max_tokens": tokens,
                        "canary": canary, "env": env, **more}
                return spawn_engine(spec)

            for canary in (False, True):
                store = root / ("clean" if canary else "reference")
                saved = phase(store, w.save_role, w.save_tokens, canary)
                show(f"save phase {'with' if canary else 'without'} the canary")
                loaded = phase(store, w.load_role, w.load_tokens, canary)
                show(f"load phase {'with' if canary else 'without'} the canary")
                if canary:
                    self.runs.append(ConnectorRun(None, [Phase(saved, 0), Phase(loaded, saved["steps"] + 1)]))
                else:
                    self.reference = [saved, loaded]
            clean_store = root / "clean"
            for i, kind in enumerate(cfg.inject):
                store = root / f"fault-{i}"
                # the faulted prompt: one of several blocks (a load one block over must land elsewhere), not
                # one of the foreign-files pair, another for each seed and kind
                several = [j for j, n in enumerate(PROMPT_LENGTHS) if (n - 1) // BLOCK_SIZE >= 2
                           and j not in FOREIGN_PAIR]
                target = FOREIGN_PAIR[0] if kind == "foreign-files" else several[(cfg.seed + i) % len(several)]
                phases = []
                more: dict[str, Any] = {}
                if kind == "partial-save":
                    heads = np.random.default_rng(cfg.seed + 1000)
                    self.partial_prompts = [heads.integers(3, 512, n).tolist() for n in PARTIAL_LENGTHS]
                    spec = {**common, "store": str(store), "prompts": self.partial_prompts, "role": w.save_role,
                            "max_tokens": w.save_tokens, "env": env, "batch": True,
                            "engine": {"max_num_batched_tokens": CHUNKED}}
                    saved = spawn_engine(spec)
                    show(f"{kind}: save phase with chunked prefill")
                    phases.append(Phase(saved, 0))
                    more = {"prompts": self.partial_prompts, "batch": True}
                    target = 1
                    written = CHUNKED - PARTIAL_LENGTHS[0]
                    aligned = (PARTIAL_LENGTHS[1] - 1) // BLOCK_SIZE * BLOCK_SIZE
                    detail = (f"a {PARTIAL_LENGTHS[1]}-token prompt saved at the first {CHUNKED}-token step, next to "
                              f"a {PARTIAL_LENGTHS[0]}-token one: positions {written}..{aligned - 1} not written")
                else:
                    shutil.copytree(clean_store, store)
                    if kind == "wrong-blocks":
                        more = {"wrong_blocks": [target]}
                        detail = "ExampleConnector's load metadata rotated one block over"
                    else:
                        folder = folder_of(store, self.prompts[target], BLOCK_SIZE)
                        donor = folder_of(store, self.prompts[FOREIGN_PAIR[1]], BLOCK_SIZE)
                        detail = inject_store_fault(kind, folder, block_size=BLOCK_SIZE, donor=donor)
                loaded = phase(store, w.load_role, w.load_tokens, True, **more)
                offset = phases[0].result["steps"] + 1 if phases else 0
                phases.append(Phase(loaded, offset))
                self.runs.append(ConnectorRun(kind, phases, target, detail))
                show(kind)
        self.wall = time.perf_counter() - start
        return build_report(self)


# ---- the report ------------------------------------------------------------------------------------------------

def _request_of(result: dict[str, Any], index: int) -> str:
    return str(result["request_ids"][index])


def _is_request(request_id: str, rid: str) -> bool:
    """vLLM suffixes the request ids it is given: the connector's ``7-abc`` is the output's ``7``."""
    return request_id == rid or request_id.startswith(f"{rid}-")


def build_report(sim: ConnectorSimulation) -> dict[str, Any]:
    """The report (schema :data:`SCHEMA_ID`): the fields of the other engines' reports (``kinds``, ``faults``,
    ``violations``, ``false_positives``, ``workloads``, ``cost``, ``timeline``, ``outcome``, ``exit_code``), with
    the connector's refusals as the faults' detections (``reasons``: the :class:`LoadReason` names)."""
    import vllm

    from .report import OUTCOMES
    from .workloads import BLOCK_SIZE

    cfg, w = sim.cfg, sim.cfg.workload
    offset = 0
    false_positives: list[dict[str, Any]] = []
    faults: list[dict[str, Any]] = []
    fp_total = explained = internal_errors = 0
    timeline_rows: list[tuple[str, int]] = []  # (series, global step)
    for run in sim.runs:
        base = offset
        fault_step: int | None = None
        target_rid = None
        if run.kind is not None:
            load = run.load.result
            target_rid = _request_of(load, run.target or 0)
            fault_step = next((s for s, rids in enumerate(load["step_requests"])
                               if any(_is_request(r, target_rid) for r in rids)), None)
        mine: list[dict[str, Any]] = []
        # the blocks the faulted request's refused load landed in: the restore's own verify rows (SWEEP launches
        # between two forwards) carry the step of the last forward, the one before the load's
        load_blocks = set() if target_rid is None else {
            int(b) for f in run.load.result["findings"] if _is_request(f["request_id"], target_rid)
            for b in f["blocks"]}
        for ph in run.phases:
            res = ph.result
            internal_errors += int(res.get("internal_errors", 0))
            is_load = ph is run.load
            for f in res["findings"]:
                at = base + ph.offset + int(f["step"])
                if is_load and fault_step is not None and target_rid is not None and \
                        _is_request(f["request_id"], target_rid):
                    mine.append(f)
                    explained += 1
                    timeline_rows.append(("explained", at))
                    continue
                fp_total += 1
                timeline_rows.append(("false_positives", at))
                false_positives.append({"workload": w.name, "launch_step": at, "read_step": at,
                                        "launch_tag": f"LOAD {f['reason']}", "slot": None,
                                        "position": f["positions"][0], "stored_token": None, "expected_token": None,
                                        "reasons": [f["reason"]], "detail": f["detail"]})
            for v in res["violations"]:
                at = base + ph.offset + int(v["step"])
                if is_load and fault_step is not None and (
                        int(v["step"]) >= fault_step or (int(v["step"]) == fault_step - 1
                        and str(v["tag"]).startswith("SWEEP") and int(v["slot"]) // BLOCK_SIZE in load_blocks)):
                    explained += 1
                    timeline_rows.append(("explained", at + 1))
                    continue
                fp_total += 1
                timeline_rows.append(("false_positives", at + 1))
                false_positives.append({"workload": w.name, "launch_step": at, "read_step": at + 1,
                                        "launch_tag": v["tag"], "slot": v["slot"], "position": v["position"],
                                        "stored_token": v["stored_token"], "expected_token": v["expected_token"],
                                        "reasons": v["reasons"]})
        steps = max(ph.offset + int(ph.result["steps"]) for ph in run.phases)
        offset += steps + 1
        if run.kind is None:
            continue
        want = CONNECTOR_FAULT_KINDS[run.kind].reason.name
        load = run.load.result
        if fault_step is None:  # the faulted request never reached a forward
            faults.append({"id": len(faults), "kind": run.kind, "workload": w.name, "injected": False,
                           "step": None, "group": None, "request": target_rid, "position": None, "slot": None,
                           "detail": "the faulted request never ran", "detected": False, "detection_step": None,
                           "latency_steps": None, "detected_by": None, "reasons": [], "violations": 0})
            continue
        # detected: the fault's reason at the load's step, found before that step's forward began
        hits = [f for f in mine if f["reason"] == want and int(f["step"]) <= fault_step
                and load["findings_before_forward"][int(f["step"])] >= load["findings"].index(f) + 1]
        step = base + run.load.offset + fault_step
        timeline_rows.append(("injected", step))
        detection = None if not hits else base + run.load.offset + int(hits[0]["step"])
        if detection is not None:
            timeline_rows.append(("detected", detection))
        first = hits[0] if hits else None
        faults.append({
            "id": len(faults), "kind": run.kind, "workload": w.name, "injected": True, "step": step, "group": "G0",
            "request": target_rid, "position": None if first is None else first["positions"][0],
            "slot": None, "detail": run.detail, "detected": first is not None, "detection_step": detection,
            "latency_steps": None if detection is None else detection - step,
            "detected_by": None if first is None else f"LOAD {first['reason']}",
            "reasons": sorted({f["reason"] for f in mine}), "blocks": [] if first is None else first["blocks"],
            "violations": len(mine)})
    total_steps = offset
    tl = {k: [0] * (total_steps + 1) for k in ("violations", "explained", "false_positives", "detected", "injected")}
    for series, at in timeline_rows:
        at = min(at, total_steps)
        tl[series][at] += 1
        if series in ("explained", "false_positives"):
            tl["violations"][at] += 1
    kinds = [_kind_summary(kind, faults) for kind in cfg.inject]
    clean = sim.runs[0] if sim.runs and sim.runs[0].kind is None else None
    exact = clean is not None and [ph.result["outputs"] for ph in clean.phases] == \
        [r["outputs"] for r in sim.reference]
    failed = not exact or fp_total or internal_errors or any(k["status"] == "missed" for k in kinds)
    outcome = "failed" if failed else "inconclusive" if any(k["status"] == "not injected" for k in kinds) \
        else "passed"
    workload_rows = []
    if clean is not None:
        saved, loaded = (ph.result for ph in clean.phases)
        workload_rows.append({
            "name": w.name, "description": w.description, "arch": "llama", "requests": len(sim.prompts),
            "max_new_tokens": w.load_tokens, "steps": saved["steps"] + loaded["steps"], "token_exact": bool(exact),
            "violations": len(saved["violations"]) + len(loaded["violations"]),
            "findings": len(saved["findings"]) + len(loaded["findings"]),
            "saved_files": saved.get("saved_files", 0), "restored_tokens": loaded.get("restored_tokens", 0),
            "load_matches_save": loaded["outputs"] == saved["outputs"] if w.save_tokens == w.load_tokens else None,
            "wall_s": round(saved["wall"] + loaded["wall"], 4),
            "reference_wall_s": round(sum(r["wall"] for r in sim.reference), 4)})
    return {
        "schema": SCHEMA_ID, "passed": outcome == "passed", "outcome": outcome, "exit_code": OUTCOMES[outcome],
        "config": {"engine": "vllm", "connector": cfg.connector, "kv_connector": CONNECTORS[cfg.connector],
                   "disaggregated": cfg.disaggregated, "vllm_version": vllm.__version__,
                   "model_size": cfg.model_size, "seed": cfg.seed, "backend": cfg.backend,
                   "inject": {k: 1 for k in cfg.inject}, "real_kv_hash": cfg.real_kv_hash,
                   "sweep_interval": cfg.sweep_interval, "ring_capacity": cfg.ring_capacity,
                   "max_num_batched_tokens": NO_CHUNKING},
        "workloads": workload_rows, "kinds": kinds, "faults": faults,
        "violations": {"total": explained + fp_total, "explained": explained, "false_positives": fp_total,
                       "dropped": 0, "status": [], "internal_errors": internal_errors,
                       "health_problems_clean": 0, "health_problems_faulted": 0},
        "false_positives": false_positives[:200],
        "cost": _cost(sim, clean),
        "timeline": tl,
        "wall_s": round(sim.wall, 4),
    }


def _kind_summary(kind: str, faults: list[dict[str, Any]]) -> dict[str, Any]:
    struck = [f for f in faults if f["kind"] == kind and f["injected"]]
    caught = [f for f in struck if f["detected"]]
    lat = sorted(int(f["latency_steps"]) for f in caught)
    return {"kind": kind, "title": CONNECTOR_FAULT_KINDS[kind].title, "injected": len(struck),
            "detected": len(caught), "missed": len(struck) - len(caught),
            "status": "not injected" if not struck else ("detected" if len(caught) == len(struck) else "missed"),
            "latency_steps": {"min": lat[0], "median": float(np.median(lat)), "max": lat[-1]} if lat else None,
            "reasons": sorted({r for f in struck for r in f["reasons"]}),
            "expected_reason": CONNECTOR_FAULT_KINDS[kind].reason.name,
            "violations": sum(f["violations"] for f in struck)}


def _cost(sim: ConnectorSimulation, clean: ConnectorRun | None) -> dict[str, Any]:
    """What carrying the records cost in the clean run: records bytes per KV byte saved, and the wall time of the
    records' save and load per saved and per loaded token, next to the wrapped connector's own."""
    from ..common.report import backend_used

    out: dict[str, Any] = {"backend": backend_used(sim.cfg.backend)}
    if clean is None:
        return out
    saved, loaded = (ph.result for ph in clean.phases)
    kv_bytes = int(saved.get("kv_bytes_saved", 0))
    from .workloads import BLOCK_SIZE

    saved_tokens = sum((len(p) - 1) // BLOCK_SIZE * BLOCK_SIZE for p in sim.prompts)
    restored = int(loaded.get("restored_tokens", 0))
    s_save = saved.get("connector_seconds", {})
    s_load = loaded.get("connector_seconds", {})
    out.update({
        "records_bytes": int(saved.get("saved_bytes", 0)), "kv_bytes_saved": kv_bytes,
        "records_bytes_per_kv_byte": round(saved.get("saved_bytes", 0) / kv_bytes, 6) if kv_bytes else None,
        "restored_tokens": restored,
        "records_save_us_per_token": round(1e6 * s_save.get("save", 0.0) / saved_tokens, 3) if saved_tokens else None,
        "connector_save_us_per_token": round(1e6 * s_save.get("inner_save", 0.0) / saved_tokens, 3)
        if saved_tokens else None,
        "records_load_us_per_token": round(1e6 * s_load.get("load", 0.0) / restored, 3) if restored else None,
        "connector_load_us_per_token": round(1e6 * s_load.get("inner_load", 0.0) / restored, 3) if restored else None,
    })
    return out


def headline(report: dict[str, Any]) -> str:
    c = report["config"]
    w = report["workloads"][0]["name"] if report["workloads"] else "?"
    return (f"kv-canary in vLLM {c['vllm_version']} (CPU, V1 runner) around {c['kv_connector']}: workload {w}, "
            f"model {c['model_size']} (random weights), each engine a process of its own, seed {c['seed']}, "
            f"backend {report['cost']['backend']}, real-KV hash {c['real_kv_hash']}")


def summary_lines(report: dict[str, Any]) -> list[str]:
    from ..common.report import false_positive_line

    lines = []
    for w in report["workloads"]:
        lines.append(f"{w['name']:<17} {'token-exact' if w['token_exact'] else 'TOKENS DIFFER'} against the same "
                     f"requests without the canary, {w['violations']} violations and {w['findings']} refused loads "
                     f"clean; {w['requests']} requests, {w['saved_files']} prompts saved with their records, "
                     f"{w['restored_tokens']} tokens loaded and verified")
    for f in report["faults"]:
        if f["injected"]:
            found = (f"refused at step {f['detection_step']} ({', '.join(f['reasons'])}, blocks {f['blocks']})"
                     if f["detected"] else f"NOT refused with {CONNECTOR_FAULT_KINDS[f['kind']].reason.name}"
                     + (f" (found: {', '.join(f['reasons'])})" if f["reasons"] else ""))
            lines.append(f"{f['kind']}: load of request {f['request']} at step {f['step']}: {found}")
    if report["violations"]["internal_errors"]:
        lines.append(f"the canary connector failed {report['violations']['internal_errors']} time(s) (logged)")
    lines.append(false_positive_line(report))
    cost = report["cost"]
    if cost.get("records_bytes_per_kv_byte") is not None:
        lines.append(f"records carried: {cost['records_bytes']} bytes for {cost['kv_bytes_saved']} KV bytes saved "
                     f"({100 * cost['records_bytes_per_kv_byte']:.2f} %); records save "
                     f"{cost['records_save_us_per_token']} us/token (connector's own save "
                     f"{cost['connector_save_us_per_token']}), records load + verify "
                     f"{cost['records_load_us_per_token']} us/token (connector's own load "
                     f"{cost['connector_load_us_per_token']})")
    return lines


def _view() -> Any:
    from ..common.report import EngineReportView

    return EngineReportView(headline, summary_lines, title="kv-canary around a vLLM KV connector",
                            heading="kv-canary around a vLLM KV connector",
                            fault_columns=("step", "request", "detail", "detected at", "latency", "first tag"))


def print_report(report: dict[str, Any], stream: Any = None, *, plain: bool = False, width: int | None = None) -> None:
    _view().print_report(report, stream, plain=plain, width=width)


def write_html(report: dict[str, Any], path: str | Path) -> Path:
    return Path(_view().write_html(report, path))


def write_json(report: dict[str, Any], path: str | Path) -> Path:
    from ..common.report import write_json as write

    return Path(write(report, path))


def run_connector_simulation(cfg: ConnectorSimConfig, *, progress: bool = True) -> dict[str, Any]:
    """Run and return the report; one progress line per engine process on standard error when asked."""

    def show(done: int, total: int, what: str) -> None:
        if progress:
            print(f"run {done}/{total}: {what}", file=sys.stderr, flush=True)

    return ConnectorSimulation(cfg).run(show)


def main() -> None:
    result = run_engine(json.loads(sys.argv[1]))
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
