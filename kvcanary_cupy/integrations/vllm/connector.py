"""The canary KV connector: a vLLM ``KVConnectorBase_V1`` that wraps another KV connector and carries the canary
records with the KV that connector saves and loads.

KV that leaves vLLM through a connector (a disk store, a prefill instance handing its KV to a decode instance)
comes back into slots whose records the canary never wrote. :class:`CanaryConnector` delegates every call of
vLLM's connector interface to the connector it wraps and adds two things:

* **save**: once the wrapped connector has saved a request's blocks (``wait_for_save``, after the canary's TAIL
  write of the step), the records of the saved slots (:meth:`~kvcanary_cupy.runtime.CanaryRuntime.offload`, 32
  bytes a token per canary buffer) go into a records file keyed the way the wrapped connector keys the KV (for
  ``ExampleConnector``: ``kvcanary-records.npz`` in the prompt's folder), with the prompt's tokens, how many of
  its positions the engine had written when the blocks were saved, and the size and modification time of each
  KV file the save left;
* **load**: once the wrapped connector has loaded a request's blocks (after ``start_load_kv`` for a synchronous
  load, at the first ``wait_for_layer_load`` otherwise: in both cases before the first layer's attention reads
  them), the records file is read and judged (:class:`LoadReason`), the records are restored into the slots the
  scheduler allocated for the load and verified there (:meth:`~kvcanary_cupy.runtime.CanaryRuntime.restore`:
  position, chain from the resident prefix, real-KV fingerprint re-hashed from the loaded bytes; the forward's
  HEAD verify then checks every token against the request). Each refused load is a :class:`LoadFinding` naming
  the request and its blocks, logged on the canary's logger; with ``on_refused="load-error"`` its blocks are also
  handed back to vLLM (``get_block_ids_with_load_errors``), which recomputes them or fails the request as its
  ``kv_load_failure_policy`` says.

Where the records of a connector's transfers are kept is the connector's :class:`RecordStore`; a connector
without one (any other than ``ExampleConnector`` today) is wrapped as a plain pass-through, said once at install
(the ``kv-transfer`` rule of :mod:`.support` then leaves the engine unchecked).

It is turned on in either of two ways (docs/vllm.md, "KV connectors"):

* ``KVCANARY_VLLM=log`` and ``KVCANARY_VLLM_CONNECTOR=<the kv_connector of --kv-transfer-config>``: the plugin
  has vLLM's connector factory build this wrapper around that connector (:func:`wrap_factory`);
* ``kv_connector="CanaryConnector"``, ``kv_connector_module_path="kvcanary_cupy.integrations.vllm.connector"``
  and ``kv_connector_extra_config={"kvcanary_wraps": "<connector>", ...}`` (an in-process ``install()``).
"""

from __future__ import annotations

import abc
import enum
import hashlib
import io
import logging
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ... import settings
from ..._errors import fail
from ...constants import CANARY_FIELD_POSITION, CANARY_FIELD_TOKEN, CANARY_FIELDS_PER_SLOT
from ...runtime import CanaryViolationError

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata
except ImportError:  # the module is importable without vLLM (docs, settings); the connector needs it
    KVConnectorBase_V1 = object
    KVConnectorMetadata = object

__all__ = ["CONNECTOR_SETTING", "ON_REFUSED_CHOICES", "ON_REFUSED_SETTING", "RECORDS_FILE", "WRAPS_KEY",
           "CanaryConnector", "LoadFinding", "LoadReason", "canary_connector_of", "unwrap_factory", "wrap_factory"]

CONNECTOR_SETTING = "KVCANARY_VLLM_CONNECTOR"
ON_REFUSED_SETTING = "KVCANARY_VLLM_CONNECTOR_ON_REFUSED"
ON_REFUSED_CHOICES = ("report", "load-error")
WRAPS_KEY = "kvcanary_wraps"  # kv_connector_extra_config key of the module-path route
ON_REFUSED_KEY = "kvcanary_on_refused"
RECORDS_FILE = "kvcanary-records.npz"
RECORDS_VERSION = 1


class LoadReason(enum.Enum):
    """Why the canary connector refused a load (each one has a runbook section, ``#load-<name>``)."""

    LOAD_RECORDS_MISSING = "no records file next to the loaded KV"
    LOAD_RECORDS_DAMAGED = "the records file is truncated, bit-rotted or not a records file"
    LOAD_RECORDS_STALE = "the KV files changed since their records were saved"
    LOAD_RECORDS_FOREIGN = "the records belong to another token sequence than the one loaded under this key"
    LOAD_RECORDS_INCOMPATIBLE = ("the records were saved by a canary configured otherwise (real-KV hash mode, V "
                                 "endpoints, KV cache shape or dtype): their fingerprints cannot be compared")
    LOAD_SAVED_BEFORE_WRITTEN = "the blocks were saved before the engine had written all of their positions"
    LOAD_VERIFY_FAILED = "the restored records do not verify against the loaded KV (position, chain, real KV)"


@dataclass(frozen=True)
class LoadFinding:
    """One refused load: the engine step it was found at (the canary's step count, before that step's forward),
    the reason, the request, the block ids (of the scheduler's allocation) and positions concerned."""

    step: int
    reason: LoadReason
    request_id: str
    blocks: tuple[int, ...]
    positions: tuple[int, int]  # [first, last + 1)
    detail: str

    def fields(self) -> dict[str, Any]:
        return {"step": self.step, "reason": self.reason.name, "request_id": self.request_id,
                "blocks": list(self.blocks), "positions": list(self.positions), "detail": self.detail}


@dataclass
class Transfer:
    """One request's save or load this step, as the scheduler side of the wrapper saw it.

    ``token_ids``: the tokens whose KV moves (block-aligned); ``block_ids``: for a load, the blocks the scheduler
    allocated (where the KV must land), for a save, the blocks saved; ``written``: for a save, the positions the
    engine has written by the end of this step; ``slots``: for a save, the slots the wrapped connector saved (it
    may save fewer than ``token_ids``); ``key``: what the record store keys the transfer by."""

    kind: str  # "save" or "load"
    request_id: str
    token_ids: list[int]
    block_ids: list[int]
    written: int
    key: Any
    slots: list[int] = field(default_factory=list)


@dataclass
class CanaryConnectorMetadata(KVConnectorMetadata):
    """The wrapped connector's metadata for the step and the wrapper's own transfers."""

    inner: Any = None
    transfers: list[Transfer] = field(default_factory=list)


class RecordStore(abc.ABC):
    """Where the records of one connector's transfers are kept, keyed the way the connector keys its KV."""

    @abc.abstractmethod
    def transfers(self, inner_meta: Any, scheduler_output: Any, loads: dict[str, Any]) -> list[Transfer]:
        """The step's saves and loads, read from the wrapped connector's metadata."""

    @abc.abstractmethod
    def records_path(self, key: Any) -> Path:
        """The records file of the transfer keyed ``key``."""

    @abc.abstractmethod
    def kv_files(self, key: Any) -> list[Path]:
        """The wrapped connector's KV files of the transfer keyed ``key``."""


class ExampleRecordStore(RecordStore):
    """``ExampleConnector``: one folder per block-aligned prompt (a hash of its token ids and multimodal hashes);
    the records file goes into that folder next to the per-layer safetensors files."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def transfers(self, inner_meta: Any, scheduler_output: Any, loads: dict[str, Any]) -> list[Transfer]:
        new = list(getattr(scheduler_output, "scheduled_new_reqs", None) or ())
        scheduled = getattr(scheduler_output, "num_scheduled_tokens", {}) or {}
        taken: set[str] = set()
        out = []
        for meta in getattr(inner_meta, "requests", None) or ():
            tokens = [int(t) for t in meta.token_ids.tolist()]
            mm = list(meta.mm_hashes)
            kind = "save" if meta.is_store else "load"
            match = None
            for req in new:  # the scheduled request this transfer belongs to (same prompt, not yet matched)
                prompt = list(req.prompt_token_ids or [])
                if req.req_id not in taken and prompt[: len(tokens)] == tokens and \
                        (kind == "save") != (req.req_id in loads):
                    match = req
                    break
            if match is None:  # a request resumed from preemption: the connector's own slots are all there is
                block_size = self.inner._block_size
                slots = meta.slot_mapping.numpy()
                blocks = [int(b) for b in dict.fromkeys((slots // block_size).tolist())]
                out.append(Transfer(kind, "?", tokens, blocks, len(tokens), (tokens, mm), slots.tolist()))
                continue
            taken.add(match.req_id)
            written = int(match.num_computed_tokens) + int(scheduled.get(match.req_id, 0))
            out.append(Transfer(kind, match.req_id, tokens, [int(b) for b in match.block_ids[0]], written,
                                (tokens, mm), [int(x) for x in meta.slot_mapping.tolist()]))
        return out

    def _folder(self, key: Any) -> Path:
        import torch

        tokens, mm = key
        return Path(self.inner._generate_foldername_debug(torch.tensor(tokens), mm, create_folder=False))

    def records_path(self, key: Any) -> Path:
        return self._folder(key) / RECORDS_FILE

    def kv_files(self, key: Any) -> list[Path]:
        folder = self._folder(key)
        return sorted(folder.glob("*.safetensors")) if folder.is_dir() else []


def record_store_for(inner: Any) -> RecordStore | None:
    """The record store of a wrapped connector (None: the canary has none for it yet)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import ExampleConnector

    if type(inner) is ExampleConnector:
        return ExampleRecordStore(inner)
    return None


# ---- the records file ---------------------------------------------------------------------------------------

def _digest(arrays: dict[str, np.ndarray]) -> str:
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(arrays):
        arr = np.ascontiguousarray(arrays[name])
        h.update(name.encode())
        h.update(str(arr.dtype).encode())
        h.update(repr(arr.shape).encode())
        h.update(arr.tobytes())
    return h.hexdigest()


def _file_stats(paths: Iterable[Path]) -> tuple[list[str], np.ndarray]:
    names, stats = [], []
    for p in paths:
        st = p.stat()
        names.append(p.name)
        stats.append((st.st_size, st.st_mtime_ns))
    return names, np.asarray(stats, np.int64).reshape(-1, 2)


def write_records(path: Path, *, model: str, profile: str, tokens: list[int], written: int,
                  records: dict[tuple[str, int], Any], kv_files: list[Path]) -> int:
    """Write one records file (atomically: a temporary file renamed over it); returns its size in bytes."""
    names, stats = _file_stats(kv_files)
    arrays: dict[str, np.ndarray] = {
        "version": np.asarray([RECORDS_VERSION], np.int64), "model": np.asarray(model),
        "profile": np.asarray(profile),
        "tokens": np.asarray(tokens, np.int64), "written": np.asarray([written], np.int64),
        "kv_names": np.asarray(names, dtype=str), "kv_stats": stats,
        "keys": np.asarray([f"{g}|{b}" for g, b in records], dtype=str),
    }
    for i, key in enumerate(records):
        arrays[f"records_{i}"] = np.ascontiguousarray(records[key], np.int64)
    arrays["digest"] = np.asarray(_digest(arrays))
    buf = io.BytesIO()
    np.savez(buf, **arrays)  # type: ignore[arg-type]
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(buf.getvalue())
    os.replace(tmp, path)
    return len(buf.getvalue())


@dataclass
class SavedRecords:
    model: str
    profile: str
    tokens: np.ndarray
    written: int
    kv_names: list[str]
    kv_stats: np.ndarray
    records: dict[tuple[str, int], np.ndarray]


def read_records(path: Path) -> SavedRecords | tuple[LoadReason, str]:
    """The records file at ``path``, or why it cannot be used (missing, damaged)."""
    if not path.is_file():
        return LoadReason.LOAD_RECORDS_MISSING, f"{path} does not exist"
    try:
        with np.load(path, allow_pickle=False) as z:
            arrays = {name: z[name] for name in z.files}
        digest = str(arrays.pop("digest"))
        if _digest(arrays) != digest:
            return LoadReason.LOAD_RECORDS_DAMAGED, f"{path}: its content does not match its digest"
        if int(arrays["version"][0]) != RECORDS_VERSION:
            return LoadReason.LOAD_RECORDS_DAMAGED, f"{path}: records version {int(arrays['version'][0])}"
        keys = arrays["keys"].tolist()
        count = int(arrays["records_0"].shape[0]) if keys else 0  # the saved slots: at most the key's tokens
        written = int(arrays["written"][0])
        if not 0 <= written <= count <= int(arrays["tokens"].shape[0]):
            return LoadReason.LOAD_RECORDS_DAMAGED, f"{path}: {written} written of {count} saved records"
        records = {}
        for i, key in enumerate(keys):
            group, _, b = str(key).rpartition("|")
            arr = arrays[f"records_{i}"]
            if arr.dtype != np.int64 or arr.shape != (count, CANARY_FIELDS_PER_SLOT):
                return LoadReason.LOAD_RECORDS_DAMAGED, f"{path}: records of {key} have shape {arr.shape}"
            records[(group, int(b))] = np.ascontiguousarray(arr)
        return SavedRecords(str(arrays["model"]), str(arrays["profile"]), arrays["tokens"], int(arrays["written"][0]),
                            [str(n) for n in arrays["kv_names"].tolist()], arrays["kv_stats"].reshape(-1, 2),
                            records)
    except Exception as exc:  # a truncated zip, a bit flipped in a header, a missing member: all one reason
        return LoadReason.LOAD_RECORDS_DAMAGED, f"{path}: {type(exc).__name__}: {exc}"


def _profile(state: Any) -> str:
    """What a record's real-KV fingerprint depends on besides the bytes: the hash mode, the V endpoints and the
    shape and dtype of the checked KV cache (a record saved under another profile cannot be compared)."""
    geo = state.geos[0]
    cache = geo.caches[0]
    return (f"real_kv_hash={state.opts.real_kv_hash} with_v={state.opts.with_v} block_size={geo.block_size} "
            f"layers={len(geo.caches)} cache={tuple(cache.shape[1:])}:{str(cache.dtype).removeprefix('torch.')}")


# ---- the connector -------------------------------------------------------------------------------------------

_original_get_connector_class: list[Any] = []
_original_descriptor: list[Any] = []  # the factory's own classmethod, put back by unwrap_factory()


def _inner_class(kv_transfer_config: Any, name: str) -> Any:
    """The connector class ``name`` as vLLM's factory resolves it (never the wrapper again)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if name in ("CanaryConnector", ""):
        fail(f"{WRAPS_KEY} must name the connector to wrap, got {name!r}")
    cfg = _config_copy(kv_transfer_config, name)
    get = _original_get_connector_class[0] if _original_get_connector_class else \
        KVConnectorFactory.get_connector_class
    return get(cfg)


def _config_copy(kv_transfer_config: Any, name: str) -> Any:
    import copy

    cfg = copy.copy(kv_transfer_config)
    object.__setattr__(cfg, "kv_connector", name)
    if WRAPS_KEY in (kv_transfer_config.kv_connector_extra_config or {}):
        object.__setattr__(cfg, "kv_connector_module_path",
                           kv_transfer_config.kv_connector_extra_config.get("kvcanary_wraps_module_path"))
    return cfg


class CanaryConnector(KVConnectorBase_V1):
    """A KV connector that delegates every call to the connector it wraps and carries the canary's records
    with the KV that connector saves and loads (module docstring)."""

    # set on the subclass wrap_factory() makes for one connector; the module-path route names it in the config
    wrapped_name: str | None = None

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer = vllm_config.kv_transfer_config
        extra = dict(transfer.kv_connector_extra_config or {})
        name = self.wrapped_name or extra.get(WRAPS_KEY)
        if not isinstance(name, str) or not name:
            fail(f"the canary connector needs the connector to wrap: set {CONNECTOR_SETTING} (plugin) or "
                 f"kv_connector_extra_config[{WRAPS_KEY!r}] (kv_connector_module_path)")
        on_refused = extra.get(ON_REFUSED_KEY) or settings.read(ON_REFUSED_SETTING) or "report"
        if on_refused not in ON_REFUSED_CHOICES:
            fail(f"kv_connector_extra_config[{ON_REFUSED_KEY!r}] must be one of {', '.join(ON_REFUSED_CHOICES)}, "
                 f"got {on_refused!r}")
        self.on_refused: str = on_refused
        inner_cls = _inner_class(transfer, name)
        self.inner: Any = inner_cls(vllm_config, role, kv_cache_config)
        self.store: RecordStore | None = record_store_for(self.inner)
        self.canary: Any = None  # the VllmCanary of this worker, attached once it is installed
        self.findings: list[LoadFinding] = []
        self.saved_files = 0
        self.saved_bytes = 0  # records bytes written
        self.restored_tokens = 0
        self.internal_errors = 0  # the wrapper's own failures (logged; the engine went on)
        # wall time of the records' save and load, and of the wrapped connector's own save and load calls
        self.seconds = {"save": 0.0, "load": 0.0, "inner_save": 0.0, "inner_load": 0.0}
        self.kv_bytes_saved = 0  # the KV files the wrapped connector left for the saves whose records were written
        self._loads: dict[str, Any] = {}  # scheduler side: requests whose load was allocated this step
        self._pending: list[Transfer] = []  # worker side: loads not verified yet this step
        self._refused_blocks: set[int] = set()

    @property
    def wrapped(self) -> str:
        return type(self.inner).__name__

    @property
    def carries_records(self) -> bool:
        """The wrapped connector has a record store: its saves and loads carry and verify records."""
        return self.store is not None

    def attach(self, canary: Any) -> None:
        """The canary installed in this worker's model runner (its runtime saves and restores the records)."""
        self.canary = canary

    # -- what the wrapper adds ---------------------------------------------------------------------------------

    def _state(self) -> Any:
        canary = self.canary
        state = None if canary is None else canary.state
        if state is None or not state.rt.enabled:
            return None
        state.settle()  # its records as the last step's TAIL left them
        return state

    def _logger(self) -> logging.Logger:
        name = self.canary.options.logger if self.canary is not None else "kvcanary_cupy.vllm"
        return logging.getLogger(name)

    def _save_records(self) -> None:
        try:
            self._save(self._connector_metadata)
        except Exception:  # the canary's own failure never fails the engine's save: said, counted, left
            self.internal_errors += 1
            self._logger().exception("kv-canary: the canary connector could not save this step's records; a later "
                                     "load of these blocks will be refused as missing its records")

    def _save(self, meta: Any) -> None:
        state = self._state()
        if state is None or self.store is None or not isinstance(meta, CanaryConnectorMetadata):
            return
        start = time.perf_counter()
        geo = state.geos[0]
        for t in meta.transfers:
            if t.kind != "save" or not t.token_ids:
                continue
            # the slots the wrapped connector saved, in position order (it may save fewer than the key's tokens)
            slots = np.asarray(t.slots[: len(t.token_ids)], np.int64)
            held = state.rt.offload(slots, model=geo.name)
            path = self.store.records_path(t.key)
            if not path.parent.is_dir():  # the wrapped connector saved nothing for it
                continue
            kv_files = self.store.kv_files(t.key)
            self.saved_bytes += write_records(path, model=geo.name, profile=_profile(state), tokens=t.token_ids,
                                              written=min(t.written, int(slots.shape[0])), records=held.records,
                                              kv_files=kv_files)
            self.kv_bytes_saved += sum(f.stat().st_size for f in kv_files)
            self.saved_files += 1
        self.seconds["save"] += time.perf_counter() - start

    def _verify_loads(self) -> None:
        pending, self._pending = self._pending, []
        state = self._state()
        if state is None or self.store is None or not pending:
            return
        start = time.perf_counter()
        try:
            self._verify(state, pending)
        except CanaryViolationError:  # raise mode: a real violation fails the step, as the forward's would
            self.canary._hook_failed = True
            raise
        except Exception:  # the canary's own failure never fails the engine's load: said, counted, left
            self.internal_errors += 1
            self._logger().exception("kv-canary: the canary connector could not verify this step's loads; they "
                                     "are left unchecked")
        finally:
            self.seconds["load"] += time.perf_counter() - start

    def _refuse(self, t: Transfer, reason: LoadReason, blocks: Iterable[int], positions: tuple[int, int],
                detail: str) -> None:
        finding = LoadFinding(self.canary.state.steps, reason, t.request_id, tuple(sorted(set(blocks))), positions,
                              detail)
        self.findings.append(finding)
        self._refused_blocks.update(finding.blocks)
        self._logger().warning(
            "kv-canary: connector load refused (%s) at step %d: request %s, blocks %s, positions %d..%d: %s "
            "(%s; runbook: docs/violations.md#%s)", reason.name, finding.step, t.request_id,
            list(finding.blocks), positions[0], positions[1] - 1, detail, reason.value,
            reason.name.lower().replace("_", "-"), extra={"kv_canary": {"connector_load": finding.fields()}})

    def _verify(self, state: Any, pending: list[Transfer]) -> None:
        from ...runtime import OffloadedRecords

        assert self.store is not None
        geo = state.geos[0]
        bs = geo.block_size
        for t in pending:
            n = len(t.token_ids)
            if n == 0:
                continue
            blocks = t.block_ids[: -(-n // bs)]
            slots = geo.slots_of(blocks, n)
            everything = (0, n)
            saved = read_records(self.store.records_path(t.key))
            if isinstance(saved, tuple):
                self._refuse(t, saved[0], blocks, everything, saved[1])
                continue
            want = np.asarray(t.token_ids, np.int64)
            if saved.tokens.shape[0] != n or not np.array_equal(saved.tokens, want):
                m = min(n, int(saved.tokens.shape[0]))
                differ = np.flatnonzero(saved.tokens[:m] != want[:m])
                at = int(differ[0]) if differ.size else m
                self._refuse(t, LoadReason.LOAD_RECORDS_FOREIGN, blocks, everything,
                             f"the records file is of a sequence of {saved.tokens.shape[0]} tokens that differs "
                             f"from the {n} loaded from position {at} on")
                continue
            names, stats = _file_stats(self.store.kv_files(t.key))
            if names != saved.kv_names or not np.array_equal(stats, saved.kv_stats):
                changed = sorted(set(names) ^ set(saved.kv_names)) or [
                    name for name, now, then in zip(names, stats, saved.kv_stats, strict=True)
                    if not np.array_equal(now, then)]
                self._refuse(t, LoadReason.LOAD_RECORDS_STALE, blocks, everything,
                             f"KV files changed since their records were saved: {', '.join(changed)}")
                continue
            if saved.written < n:
                self._refuse(t, LoadReason.LOAD_SAVED_BEFORE_WRITTEN, blocks[saved.written // bs:], (saved.written, n),
                             f"saved when positions {saved.written}..{n - 1} had not been written yet")
            if saved.profile != _profile(state):
                self._refuse(t, LoadReason.LOAD_RECORDS_INCOMPATIBLE, blocks, everything,
                             f"saved by a canary with {saved.profile}, this one has {_profile(state)}")
                continue
            keys = set(state.rt.offload(np.zeros(0, np.int64), model=geo.name).records)
            if saved.model != geo.name or set(saved.records) != keys:
                self._refuse(t, LoadReason.LOAD_RECORDS_DAMAGED, blocks, everything,
                             f"records of canary buffers {sorted(saved.records)} of {saved.model}, this engine has "
                             f"{sorted(keys)} of {geo.name}")
                continue
            m = saved.written  # the positions whose records were written when the blocks were saved
            if m == 0:
                continue
            first_buf = saved.records[min(saved.records)][:m]
            bad_pos = np.flatnonzero((first_buf[:, CANARY_FIELD_TOKEN] != saved.tokens[:m])
                                     | (first_buf[:, CANARY_FIELD_POSITION] != np.arange(m)))
            held = OffloadedRecords(geo.name, m, {k: np.ascontiguousarray(a[:m]) for k, a in saved.records.items()})
            prev = np.concatenate([[-1], slots[: m - 1]]).astype(np.int64)
            before = len(state.violations)
            state.rt.restore(held, slots[:m], np.arange(m, dtype=np.int64), prev)
            self.restored_tokens += m
            # the restore's verify rows, read now (not one step late): they decide this load before the forward
            state._collect(state.rt.flush())
            loaded = dict(zip(slots[:m].tolist(), range(m), strict=True))
            rows = [v.violation for v in state.violations[before:] if v.violation.launch_tag.startswith("SWEEP")
                    and v.violation.slot in loaded]
            bad = sorted({loaded[v.slot] for v in rows} | set(bad_pos.tolist()))
            if bad:
                reasons = sorted({r for v in rows for r in v.labels})
                self._refuse(t, LoadReason.LOAD_VERIFY_FAILED, {blocks[p // bs] for p in bad}, (bad[0], bad[-1] + 1),
                             f"{len(bad)} loaded position(s) do not verify"
                             + (f" ({', '.join(reasons)})" if reasons else " (records name other tokens/positions)"))

    # -- the interface: every method delegates -----------------------------------------------------------------

    @property
    def supports_divergent_local_hybrid_hits(self) -> bool:
        return bool(self.inner.supports_divergent_local_hybrid_hits)

    @property
    def requires_kv_delivery(self) -> bool:
        return bool(self.inner.requires_kv_delivery)

    @property
    def role(self) -> Any:
        return self.inner.role

    def get_mem_pool_context(self) -> Any:
        return self.inner.get_mem_pool_context()

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        super().bind_connector_metadata(connector_metadata)
        if isinstance(connector_metadata, CanaryConnectorMetadata):
            self.inner.bind_connector_metadata(connector_metadata.inner)
            self._pending = [t for t in connector_metadata.transfers if t.kind == "load"]
        else:
            self.inner.bind_connector_metadata(connector_metadata)
        self._refused_blocks = set()

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        self.inner.clear_connector_metadata()

    def _get_connector_metadata(self) -> Any:
        return self.inner._get_connector_metadata()

    def has_connector_metadata(self) -> bool:
        return bool(self.inner.has_connector_metadata())

    def register_kv_caches(self, kv_caches: Any) -> None:
        self.inner.register_kv_caches(kv_caches)

    def set_host_xfer_buffer_ops(self, copy_operation: Any) -> None:
        self.inner.set_host_xfer_buffer_ops(copy_operation)

    def finish_forward(self) -> None:
        self.inner.finish_forward()

    def reset_capture_state(self) -> None:
        self.inner.reset_capture_state()

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        inner = kv_connector_metadata.inner if isinstance(kv_connector_metadata, CanaryConnectorMetadata) \
            else kv_connector_metadata
        self.inner.handle_preemptions(inner)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        start = time.perf_counter()
        self.inner.start_load_kv(forward_context, **kwargs)
        self.seconds["inner_load"] += time.perf_counter() - start
        if self._pending and not self._async_loads():
            self._verify_loads()  # a synchronous load: its KV is in place now, before the forward

    def _async_loads(self) -> bool:
        """Loads still in flight after ``start_load_kv`` (the first ``wait_for_layer_load`` verifies them)."""
        return self.store is not None and not isinstance(self.store, ExampleRecordStore)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.inner.wait_for_layer_load(layer_name)
        if self._pending:
            self._verify_loads()

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        start = time.perf_counter()
        self.inner.save_kv_layer(layer_name, kv_layer, attn_metadata, **kwargs)
        self.seconds["inner_save"] += time.perf_counter() - start

    def wait_for_save(self) -> None:
        start = time.perf_counter()
        self.inner.wait_for_save()
        self.seconds["inner_save"] += time.perf_counter() - start
        self._save_records()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self.inner.get_finished(finished_req_ids)

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        return self.inner.get_transfer_results(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors = set(self.inner.get_block_ids_with_load_errors())
        if self.on_refused == "load-error":
            errors |= self._refused_blocks
        return errors

    def shutdown(self) -> Any:
        return self.inner.shutdown()

    def get_kv_connector_stats(self) -> Any:
        return self.inner.get_kv_connector_stats()

    def get_kv_connector_kv_cache_events(self) -> Any:
        return self.inner.get_kv_connector_kv_cache_events()

    def get_handshake_metadata(self) -> Any:
        return self.inner.get_handshake_metadata()

    def build_connector_worker_meta(self) -> Any:
        return self.inner.build_connector_worker_meta()

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        self._kv_cache_manager = kv_cache_manager
        self.inner.bind_kv_cache_manager(kv_cache_manager)

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        self.inner.bind_gpu_block_pool(gpu_block_pool)

    def get_loaded_kv_cache_group_ids(self, request: Any) -> Any:
        return self.inner.get_loaded_kv_cache_group_ids(request)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Any:
        return self.inner.get_num_new_matched_tokens(request, num_computed_tokens)

    def get_external_cache_hit_sources(self, *args: Any, **kwargs: Any) -> Any:
        return self.inner.get_external_cache_hit_sources(*args, **kwargs)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> Any:
        if num_external_tokens > 0:
            self._loads[request.request_id] = request
        return self.inner.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        inner_meta = self.inner.build_connector_meta(scheduler_output)
        loads, self._loads = self._loads, {}
        if self.store is None:
            return inner_meta
        return CanaryConnectorMetadata(inner=inner_meta,
                                       transfers=self.store.transfers(inner_meta, scheduler_output, loads))

    def on_new_request(self, request: Any) -> None:
        self.inner.on_new_request(request)

    def update_connector_output(self, connector_output: Any) -> None:
        self.inner.update_connector_output(connector_output)

    def request_finished(self, request: Any, block_ids: Any) -> Any:
        return self.inner.request_finished(request, block_ids)

    def request_finished_all_groups(self, request: Any, block_ids: Any) -> Any:
        return self.inner.request_finished_all_groups(request, block_ids)

    def register_finished_partial_tail(self, *args: Any, **kwargs: Any) -> Any:
        return self.inner.register_finished_partial_tail(*args, **kwargs)

    def take_events(self) -> Any:
        return self.inner.take_events()

    def has_pending_block_frees(self) -> bool:
        return bool(self.inner.has_pending_block_frees())

    def has_pending_push_work(self) -> bool:
        return bool(self.inner.has_pending_push_work())

    def get_finished_count(self) -> int | None:
        return self.inner.get_finished_count()

    def set_xfer_handshake_metadata(self, *args: Any, **kwargs: Any) -> Any:
        return self.inner.set_xfer_handshake_metadata(*args, **kwargs)

    def set_xfer_handshake_metadata_pp_aware(self, *args: Any, **kwargs: Any) -> Any:
        return self.inner.set_xfer_handshake_metadata_pp_aware(*args, **kwargs)

    def reset_cache(self) -> bool | None:
        return self.inner.reset_cache()

    # class-level hooks: answered by the wrapped connector's class
    @classmethod
    def _wrapped_class(cls, vllm_config: Any = None, extra_config: dict[str, Any] | None = None) -> Any:
        if cls.wrapped_name is not None and _wrapped_classes.get(cls.wrapped_name) is not None:
            return _wrapped_classes[cls.wrapped_name]
        transfer = getattr(vllm_config, "kv_transfer_config", None)
        extra = extra_config if extra_config is not None else dict(getattr(transfer, "kv_connector_extra_config",
                                                                           None) or {})
        name = cls.wrapped_name or extra.get(WRAPS_KEY)
        if transfer is None or not name:
            return KVConnectorBase_V1
        return _inner_class(transfer, name)

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
        return cls._wrapped_class(vllm_config).get_required_kvcache_layout(vllm_config)

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        return bool(cls._wrapped_class(extra_config=extra_config).requires_piecewise_for_cudagraph(extra_config))

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> Any:
        return cls._wrapped_class().build_kv_connector_stats(data)

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, *args: Any, **kwargs: Any) -> Any:
        return cls._wrapped_class(vllm_config).build_prom_metrics(vllm_config, *args, **kwargs)


_wrapped_classes: dict[str, Any] = {}


def wrap_factory(name: str) -> None:
    """Have vLLM's connector factory build a :class:`CanaryConnector` around the connector called ``name``
    whenever a ``kv_transfer_config`` asks for it (the plugin calls this in every vLLM process when
    ``KVCANARY_VLLM_CONNECTOR`` is set). Idempotent."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if _original_get_connector_class:
        return
    original = KVConnectorFactory.get_connector_class
    _original_get_connector_class.append(original)
    _original_descriptor.append(vars(KVConnectorFactory)["get_connector_class"])
    wrapper = type(f"Canary{name}", (CanaryConnector,), {"wrapped_name": name})

    def get_connector_class(kv_transfer_config: Any) -> Any:
        cls = original(kv_transfer_config)
        if kv_transfer_config.kv_connector != name:
            return cls
        _wrapped_classes[name] = cls
        return wrapper

    KVConnectorFactory.get_connector_class = staticmethod(get_connector_class)


def unwrap_factory() -> None:
    """Put vLLM's connector factory back as :func:`wrap_factory` found it (tests; connectors built stay)."""
    if _original_get_connector_class:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

        _original_get_connector_class.pop()
        KVConnectorFactory.get_connector_class = _original_descriptor.pop()


def canary_connector_of(runner: Any = None) -> CanaryConnector | None:
    """The canary connector of this process's vLLM worker (None: no connector, or another one)."""
    try:
        from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group
    except ImportError:
        return None
    if not has_kv_transfer_group():
        return None
    group = get_kv_transfer_group()
    return group if isinstance(group, CanaryConnector) else None
