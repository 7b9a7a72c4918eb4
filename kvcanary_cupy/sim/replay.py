"""Dump a failing launch to ``.npz`` and run it again, anywhere — the way to debug a GPU-only failure on a laptop.

During a simulation with ``--dump-failures DIR`` the :class:`LaunchRecorder` keeps host copies of every
launch's inputs for the current and the previous step (violations are read one step late). When the first
violation explaining a fault kind is read, the launch that produced it is saved as
``DIR/<kind>-seed<S>-step<N>-<TAG>-<op>.npz`` (the seed keeps runs from overwriting each other):

* ``meta`` — a JSON string: format, kind, step, model (target/draft), group, launch tag, op (verify/write),
  role, the backend it ran on, hash mode, real-KV source geometry, flags (``check_verify_expected_token``,
  ``enable_write_input_assert``, ``enable_chain_position_assert``), ring capacity and, for HEAD/TAIL launches,
  the plan scalars (SWA window, token offset, capacities);
* ``canary_buf`` — the canary buffer *before* the launch; ``source_<i>`` — the real-KV bytes of each source;
  ``twin_canary_buf`` — for a HEAD V verify, HEAD K's buffer, its twin (docs/contract.md, "Twin buffers");
* verify: ``plan_slots``, ``plan_expected_tokens``, ``plan_expected_positions``, ``plan_prev_slots``,
  ``plan_num_valid``, ``plan_enable``; write: ``write_offsets``, ``write_seeds``, ``write_num_valid_reqs``,
  ``input_ids``, ``positions``, ``out_cache_loc``, ``expected_input_tokens``, ``expected_input_positions``;
* HEAD/TAIL launches: the plan inputs ``in_req_pool_indices``, ``in_prefix_lens``, ``in_extend_seq_lens``,
  ``in_req_to_token`` (or, for a block table / CSR layout, its arrays ``in_layout_<field>`` and its scalars in
  the plan meta's ``layout``), ``in_expected_pool``, ``in_valid_lens`` (and ``in_lut`` for SWA), and the plan
  the engine computed (``plan_*``/``write_*`` above), so a replay can also check the plan kernels;
* ``expected_rows`` — the violation rows that launch produced (int64 ``[n, 8]``).

:func:`replay_case` rebuilds a fresh context from those arrays, recomputes the plan when its inputs are there,
reruns the launch on the chosen backend (``host`` runs the exact ``kernels/*.cu`` code on the CPU, under
AddressSanitizer and UBSan when the process was started for it, see :func:`run_replay`) and compares the
violation rows with the recorded ones as multisets (the kernels append rows in atomic order).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

import numpy as np

from .._errors import CanaryArgumentError
from ..constants import CANARY_SLOT_BYTES, MAX_REAL_KV_SOURCES, FailReason, RealKvHashMode
from ..context import RealKvSource, VerifyOrWriteContext
from ..kv_bytes import KvByteLayout
from ..layouts import BlockTable, PageList
from ..plan import VerifyPlan, WritePlan, launch_canary_plan_kernels
from ..verify import launch_canary_verify_kernel
from ..violations import ViolationReport, read_violations, to_host
from ..write import launch_canary_write_kernel

if TYPE_CHECKING:
    from ..runtime import Endpoint, GroupState, LaunchEvent

FORMAT = "kvcanary-replay/1"
_WRITE_BITS = int(FailReason.WRITE_TOKEN_MISMATCH | FailReason.WRITE_POSITION_MISMATCH)


def _h(arr: Any) -> np.ndarray:
    return np.ascontiguousarray(to_host(arr))


class LaunchRecorder:
    """Host copies of the last two steps' launches, dumped when a fault kind is first detected.

    Installed as the canary runtime's ``observer``: it sees every launch (before it for verify and write,
    after it for the plan) and copies what a replay needs from the runtime's own buffers."""

    def __init__(self, directory: str | Path, *, preset: str, seed: int, backend: str) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.preset, self.seed, self.backend = preset, seed, backend
        self._launches: dict[int, list[dict[str, Any]]] = {}
        self._plans: dict[tuple[int, str], dict[str, Any]] = {}
        self._step = 0
        self._req_to_token: Any = None
        self._layout: BlockTable | PageList | None = None
        self._expected_pool: Any = None
        self._check_tokens = False
        self.dumped: dict[str, Path] = {}

    def attach(self, *, req_to_token: Any, expected_pool: Any, check_tokens: bool,
               layout: BlockTable | PageList | None = None) -> None:
        """The engine's slot table (or the block table / page lists the plan reads instead) and the runtime's
        expected-token pool (plan inputs of every group)."""
        self._req_to_token, self._expected_pool, self._check_tokens = req_to_token, expected_pool, check_tokens
        self._layout = layout

    def begin_step(self, step: int) -> None:
        self._step = step
        for old in [s for s in self._launches if s < step - 1]:
            del self._launches[old]
        for key in [k for k in self._plans if k[0] < step - 1]:
            del self._plans[key]
        self._launches.setdefault(step, [])

    def observe(self, event: LaunchEvent) -> None:
        if event.group is None:
            return
        if event.kind == "plan" and event.when == "after":
            self.plan(self._step, event.group, event.stage)
        elif event.kind == "verify" and event.when == "before" and event.endpoint is not None:
            self.verify(self._step, event.group, event.endpoint)
        elif event.kind == "write" and event.when == "before" and event.endpoint is not None:
            self.write(self._step, event.group, event.endpoint, event.stage)

    def plan(self, step: int, group: GroupState, stage: Any) -> None:
        vp, wp, spec = group.verify_plan, group.write_plan, group.spec
        arrays = {
            "in_req_pool_indices": _h(stage.view("req_pool_indices")), "in_prefix_lens": _h(stage.view("prefix_lens")),
            "in_extend_seq_lens": _h(stage.view("extend_seq_lens")),
            "in_expected_pool": _h(self._expected_pool), "in_valid_lens": _h(stage.view("valid_lens")),
            "plan_slots": _h(vp.verify_slot_indices), "plan_expected_tokens": _h(vp.verify_expected_tokens),
            "plan_expected_positions": _h(vp.verify_expected_positions),
            "plan_prev_slots": _h(vp.verify_prev_slot_indices), "plan_num_valid": _h(vp.verify_num_valid),
            "plan_enable": _h(vp.enable), "write_offsets": _h(wp.write_offsets),
            "write_seeds": _h(wp.write_seed_slot_indices), "write_num_valid_reqs": _h(wp.write_num_valid_reqs),
        }
        if spec.full_to_swa_index_mapping is not None:
            arrays["in_lut"] = _h(spec.full_to_swa_index_mapping)
        meta: dict[str, Any] = {"swa_window": spec.swa_window, "offset": spec.kv_token_id_vs_position_offset,
                                "verify_capacity": int(vp.verify_slot_indices.shape[0]),
                                "write_req_capacity": int(wp.write_seed_slot_indices.shape[0])}
        layout = self._layout
        if layout is None:
            arrays["in_req_to_token"] = _h(self._req_to_token)
        else:
            scalars = {}
            for name, value in vars(layout).items():
                if isinstance(value, (int, bool)) or value is None:
                    scalars[name] = value
                else:
                    arrays[f"in_layout_{name}"] = _h(value)
            meta["layout"] = {"kind": type(layout).__name__, **scalars}
        self._plans[(step, group.name)] = {"arrays": arrays, "meta": meta}

    def _context(self, ctx: VerifyOrWriteContext) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        arrays = {"canary_buf": _h(ctx.canary_buf)}
        sources: list[dict[str, Any]] = []
        for i, src in enumerate(ctx.real_kv_sources):
            arrays[f"source_{i}"] = _h(src.byte_rows)
            sources.append({"page_size": int(src.page_size), "num_bytes_per_token": int(src.num_bytes_per_token),
                            "read_bytes": int(src.read_bytes)})
            if src.layout is not None:  # the recorded bytes are the tensor's span; the layout says where tokens lie
                sources[-1]["layout"] = dataclasses.asdict(src.layout)
        meta = {"tag": int(ctx.kernel_kind), "real_kv_hash_mode": int(ctx.real_kv_hash_mode), "sources": sources,
                "enable_chain_position_assert": int(_h(ctx.enable_chain_position_assert)[0]),
                "ring_capacity": int(ctx.violation_ring.shape[0])}
        return arrays, meta

    def verify(self, step: int, group: GroupState, ep: Endpoint) -> None:
        arrays, meta = self._context(ep.verify_ctx)
        plan = group.sweep_plan if ep.role == "SWEEP" else group.verify_plan
        check = self._check_tokens and ep.role != "SWEEP"
        arrays.update({
            "plan_slots": _h(plan.verify_slot_indices), "plan_expected_tokens": _h(plan.verify_expected_tokens),
            "plan_expected_positions": _h(plan.verify_expected_positions),
            "plan_prev_slots": _h(plan.verify_prev_slot_indices), "plan_num_valid": _h(plan.verify_num_valid),
            "plan_enable": _h(plan.enable),
        })
        if ep.role == "HEAD" and ep.kv == "V":  # HEAD K's buffer is its twin (runtime/groups.py)
            arrays["twin_canary_buf"] = _h(group.endpoints["HEAD"][0].verify_ctx.canary_buf)
        meta.update(op="verify", role=ep.role, check_verify_expected_token=bool(check))
        self._add(step, group, ep, arrays, meta)

    def write(self, step: int, group: GroupState, ep: Endpoint, stage: Any) -> None:
        assert ep.write_ctx is not None
        arrays, meta = self._context(ep.write_ctx)
        wp = group.write_plan
        loc = group.swa_out_cache_loc.view if group.swa_out_cache_loc is not None else stage.view("out_cache_loc")
        arrays.update({
            "write_offsets": _h(wp.write_offsets), "write_seeds": _h(wp.write_seed_slot_indices),
            "write_num_valid_reqs": _h(wp.write_num_valid_reqs), "input_ids": _h(stage.view("input_ids")),
            "positions": _h(stage.view("positions")), "out_cache_loc": _h(loc),
            "expected_input_tokens": _h(stage.view("expected_input_ids")),
            "expected_input_positions": _h(stage.view("expected_positions")),
        })
        meta.update(op="write", role=ep.role, enable_write_input_assert=True)
        self._add(step, group, ep, arrays, meta)

    def _add(self, step: int, group: GroupState, ep: Endpoint, arrays: dict[str, np.ndarray],
             meta: dict[str, Any]) -> None:
        meta.update(step=step, model=group.model, group=group.name, tag_name=ep.tag.name)
        self._launches.setdefault(step, []).append({"arrays": arrays, "meta": meta})

    def dump(self, kind: str, launch_step: int, model: str, group: str, violation: Any,
             rows: list[Any]) -> Path | None:
        """Save the launch of ``launch_step`` that produced ``violation`` (first detection of ``kind``)."""
        if kind in self.dumped:
            return None
        op = "write" if violation.reason_bits & _WRITE_BITS else "verify"
        tag = violation.launch_tag
        record = next((r for r in self._launches.get(launch_step, ())
                       if r["meta"]["model"] == model and r["meta"]["tag_name"] == tag and r["meta"]["op"] == op),
                      None)
        if record is None:
            return None
        same = [r.raw for r in rows if r.launch_tag == tag and bool(r.reason_bits & _WRITE_BITS) == (op == "write")]
        arrays = dict(record["arrays"])
        meta = dict(record["meta"], format=FORMAT, kind=kind, backend=self.backend, preset=self.preset,
                    seed=self.seed)
        plan = self._plans.get((launch_step, group)) if meta["role"] != "SWEEP" else None
        if plan is not None:
            meta["plan"] = plan["meta"]
            for key, value in plan["arrays"].items():
                arrays.setdefault(key, value)  # the launch's own plan arrays win (they are the same)
                if key.startswith("in_"):
                    arrays[key] = value
        arrays["expected_rows"] = np.asarray(same, np.int64).reshape(-1, 8)
        arrays["meta"] = np.array(json.dumps(meta))
        path = self.dir / f"{kind}-seed{self.seed}-step{launch_step}-{tag}-{op}.npz"
        np.savez_compressed(path, **arrays)
        self.dumped[kind] = path
        return path


# ---- loading and replaying ---------------------------------------------------------------------------------


@dataclass
class ReplayCase:
    path: Path
    meta: dict[str, Any]
    arrays: dict[str, np.ndarray]

    @property
    def title(self) -> str:
        m = self.meta
        where = f"{m['role']} {m['op']} of the {m['model']} model's {m['group']} group ({m['tag_name']})"
        return f"{m['kind']}: {where} at step {m['step']}, recorded on {m['backend']}"


# Limits of a file this tool agrees to load: far above any real dump, far below what would exhaust a laptop.
MAX_MEMBER_BYTES = 1 << 30  # one array, uncompressed
MAX_ROWS = 1 << 24  # ring capacity, plan capacities


def load_case(path: str | Path) -> ReplayCase:
    """Read a dump and check it completely (every meta key, every array's dtype and shape) before anything
    runs; ValueError naming the file and the offending field if it is not a well-formed dump."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: no such file")
    try:
        with np.load(path, allow_pickle=False) as data:
            if not hasattr(data, "zip"):
                raise ValueError("a single .npy array, not an .npz archive")
            for name in data.files:
                size = data.zip.getinfo(f"{name}.npy").file_size
                if size > MAX_MEMBER_BYTES:
                    raise ValueError(f"entry {name!r} unpacks to {size} bytes, over the {MAX_MEMBER_BYTES}-byte "
                                     "limit of a replay file")
            arrays = {k: data[k] for k in data.files}
    except Exception as exc:  # not a zip, truncated, a pickled member, too large...
        raise ValueError(f"{path}: not a kvcanary replay file ({type(exc).__name__}: {exc})") from None
    if "meta" not in arrays:
        raise ValueError(f"{path}: not a kvcanary replay file (no meta entry)")
    meta_entry = arrays.pop("meta")
    try:
        meta = json.loads(str(meta_entry)) if meta_entry.ndim == 0 and meta_entry.dtype.kind == "U" else None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: entry 'meta' is not JSON ({exc})") from None
    if not isinstance(meta, dict):
        raise ValueError(f"{path}: entry 'meta' must be a JSON object (a 0-d string array)")
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path}: unsupported replay format {meta.get('format')!r} (expected {FORMAT})")
    _check_case(path, meta, arrays)
    return ReplayCase(path, meta, arrays)


def _check_case(path: Path, meta: dict[str, Any], arrays: dict[str, np.ndarray]) -> None:
    """The schema of a dump (see the module docstring), every field named in the error."""

    def bad(field: str, why: str) -> ValueError:
        return ValueError(f"{path}: {field} {why}")

    def key(d: dict[str, Any], name: str, kind: type, where: str = "meta", low: int | None = None,
            high: int | None = None) -> Any:
        if name not in d:
            raise bad(f"{where}.{name}", "is missing")
        value = d[name]
        # JSON true/false load as bool, a subclass of int: an int field takes no bool, a bool field no int.
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise bad(f"{where}.{name}", f"must be {'an object' if kind is dict else kind.__name__}, got {value!r}")
        number: Any = value  # an int here whenever a bound is given
        if (low is not None and number < low) or (high is not None and number > high):
            raise bad(f"{where}.{name}", f"must lie in [{low}, {high}], got {value}")
        return value

    def array(name: str, dtype: type, ndim: int, shape: tuple[int | None, ...] | None = None) -> np.ndarray:
        if name not in arrays:
            raise bad(f"entry {name!r}", "is missing")
        a = arrays[name]
        if a.dtype != np.dtype(dtype) or a.ndim != ndim:
            raise bad(f"entry {name!r}", f"must be a {ndim}-D {np.dtype(dtype).name} array, got {a.ndim}-D "
                      f"{a.dtype}")
        if shape is not None and any(w is not None and g != w for g, w in zip(a.shape, shape, strict=True)):
            raise bad(f"entry {name!r}", f"must have shape {shape}, got {a.shape}")
        return a

    for name in ("kind", "model", "group", "tag_name", "role", "backend"):
        key(meta, name, str)
    key(meta, "step", int, low=0)
    op = key(meta, "op", str)
    if op not in ("verify", "write"):
        raise bad("meta.op", f"must be 'verify' or 'write', got {op!r}")
    key(meta, "tag", int, low=-(1 << 63), high=(1 << 63) - 1)
    mode = key(meta, "real_kv_hash_mode", int)
    if mode not in {int(m) for m in RealKvHashMode}:
        raise bad("meta.real_kv_hash_mode", f"must be one of {[int(m) for m in RealKvHashMode]}, got {mode}")
    chain_flag = meta.get("enable_chain_position_assert")
    if chain_flag not in (0, 1):  # recorded as 0/1; true/false also read
        raise bad("meta.enable_chain_position_assert", f"must be 0 or 1, got {chain_flag!r}")
    key(meta, "ring_capacity", int, low=1, high=MAX_ROWS)
    sources = key(meta, "sources", list)
    if len(sources) > MAX_REAL_KV_SOURCES:
        raise bad("meta.sources", f"lists {len(sources)} sources; at most {MAX_REAL_KV_SOURCES} are supported")
    canary = array("canary_buf", np.uint8, 2)
    if canary.shape[0] < 1 or canary.shape[1] < CANARY_SLOT_BYTES or canary.shape[1] % 8:
        raise bad("entry 'canary_buf'", f"must be [slots >= 1, stride >= {CANARY_SLOT_BYTES}, a multiple of 8], "
                  f"got {canary.shape}")
    if "twin_canary_buf" in arrays:
        twin = array("twin_canary_buf", np.uint8, 2)
        if twin.shape != canary.shape:
            raise bad("entry 'twin_canary_buf'", f"must have canary_buf's shape {canary.shape}, got {twin.shape}")
    for i, source in enumerate(sources):
        if not isinstance(source, dict):
            raise bad(f"meta.sources[{i}]", f"must be an object, got {source!r}")
        for name in ("page_size", "num_bytes_per_token", "read_bytes"):
            key(source, name, int, f"meta.sources[{i}]", low=1, high=1 << 40)
        array(f"source_{i}", np.uint8, 2)
        if "layout" in source:
            layout = key(source, "layout", dict, f"meta.sources[{i}]")
            fields = [f.name for f in dataclasses.fields(KvByteLayout)]
            # the digit splits have defaults (a dump recorded before they existed has none of them)
            required = [f.name for f in dataclasses.fields(KvByteLayout) if f.default is dataclasses.MISSING]
            if not set(required) <= set(layout) <= set(fields):
                raise bad(f"meta.sources[{i}].layout", f"must have exactly the keys {fields} (the last "
                          f"{len(fields) - len(required)} optional), got {sorted(layout)}")
            for name in fields:
                if name in layout:
                    key(layout, name, int, f"meta.sources[{i}].layout", low=0, high=1 << 48)
    if op == "verify":
        key(meta, "check_verify_expected_token", bool)
        slots = array("plan_slots", np.int64, 1)
        for name in ("plan_expected_tokens", "plan_expected_positions", "plan_prev_slots"):
            array(name, np.int64, 1, slots.shape)
        for name in ("plan_num_valid", "plan_enable"):
            array(name, np.int32, 1, (1,))
    else:
        assert_inputs = key(meta, "enable_write_input_assert", bool)
        offsets = array("write_offsets", np.int64, 1)
        if offsets.shape[0] < 2:
            raise bad("entry 'write_offsets'", f"must hold at least 2 entries, got {offsets.shape[0]}")
        array("write_seeds", np.int64, 1, (offsets.shape[0] - 1,))
        array("write_num_valid_reqs", np.int32, 1, (1,))
        ids = array("input_ids", np.int64, 1)
        token_names = ["positions", "out_cache_loc"]
        if assert_inputs:
            token_names += ["expected_input_tokens", "expected_input_positions"]
        for name in token_names:
            array(name, np.int64, 1, ids.shape)
    array("expected_rows", np.int64, 2, (None, 8))
    if "in_req_to_token" in arrays:
        plan = key(meta, "plan", dict)
        key(plan, "swa_window", int, "meta.plan", low=0, high=(1 << 63) - 1)
        key(plan, "offset", int, "meta.plan", low=-(1 << 31), high=(1 << 31) - 1)
        key(plan, "verify_capacity", int, "meta.plan", low=1, high=MAX_ROWS)
        key(plan, "write_req_capacity", int, "meta.plan", low=1, high=MAX_ROWS)
        rpi = array("in_req_pool_indices", np.int64, 1)
        for name in ("in_prefix_lens", "in_extend_seq_lens", "in_valid_lens"):
            array(name, np.int64, 1, rpi.shape)
        array("in_req_to_token", np.int32, 2)
        array("in_expected_pool", np.int32, 2)
        if "in_lut" in arrays:
            array("in_lut", np.int64, 1)
        for name in ("plan_slots", "plan_num_valid", "plan_enable"):
            if name not in arrays:  # a write dump carries the plan's verify side for the plan check
                raise bad(f"entry {name!r}", "is missing (the plan inputs are there, so the plan must be too)")
        if op == "write" or "write_offsets" in arrays:
            array("write_seeds", np.int64, 1)
            array("write_offsets", np.int64, 1)


def _aligned(a: np.ndarray, align: int = 64) -> np.ndarray:
    buf = np.empty(a.nbytes + align, np.uint8)
    start = (-buf.ctypes.data) % align
    out = buf[start : start + a.nbytes].view(a.dtype).reshape(a.shape)
    out[...] = a
    return out


@dataclass
class ReplayOutcome:
    report: ViolationReport
    expected_rows: np.ndarray
    reproduced: bool
    plan_check: str | None

    @property
    def rows(self) -> list[tuple[int, ...]]:
        return [tuple(r.raw) for r in self.report.rows]


def _recompute_plan(case: ReplayCase, backend: str) -> str | None:
    a, meta = case.arrays, case.meta.get("plan")
    if meta is None or ("in_req_to_token" not in a and "layout" not in meta):
        return None
    vp = VerifyPlan.allocate(verify_capacity=meta["verify_capacity"])
    wp = WritePlan.allocate(write_req_capacity=meta["write_req_capacity"])
    slots: dict[str, Any] = {"req_to_token": a.get("in_req_to_token")}
    rows: np.ndarray | None = a["in_req_pool_indices"]
    if "layout" in meta:
        spec = dict(meta["layout"])
        cls = {"BlockTable": BlockTable, "PageList": PageList}[spec.pop("kind")]
        fields = {k.removeprefix("in_layout_"): v for k, v in a.items() if k.startswith("in_layout_")}
        layout = cls(**fields, **spec)
        slots = {"layout": layout}
        if isinstance(layout, PageList) or layout.batch_rows:
            rows = None  # a batch-row layout: the runtime launched it without request rows
    launch_canary_plan_kernels(
        verify_plan_out=vp, write_plan_out=wp, req_pool_indices=rows,
        prefix_lens=a["in_prefix_lens"], extend_seq_lens=a["in_extend_seq_lens"], **slots,
        swa_window_size=meta["swa_window"], full_to_swa_index_mapping=a.get("in_lut"),
        verify_capacity=meta["verify_capacity"], req_to_verify_expected_tokens=a["in_expected_pool"],
        req_to_verify_expected_tokens_valid_lens=a["in_valid_lens"],
        kv_token_id_vs_position_offset=meta["offset"], backend=backend,
        on_invalid="flag" if backend == "numpy" else None)
    diffs = []
    n = int(vp.verify_num_valid[0])
    if n != int(a["plan_num_valid"][0]) or int(vp.enable[0]) != int(a["plan_enable"][0]):
        diffs.append("num_valid/enable")
    elif int(vp.enable[0]):
        pairs = ((vp.verify_slot_indices, "plan_slots"), (vp.verify_expected_tokens, "plan_expected_tokens"),
                 (vp.verify_expected_positions, "plan_expected_positions"),
                 (vp.verify_prev_slot_indices, "plan_prev_slots"))
        for mine, theirs in pairs:
            if theirs in a and not np.array_equal(mine[:n], a[theirs][:n]):
                diffs.append(theirs.removeprefix("plan_"))
    bs = int(a["in_req_pool_indices"].shape[0])
    if "write_offsets" in a and not (np.array_equal(wp.write_offsets[: bs + 1], a["write_offsets"][: bs + 1])
                                     and np.array_equal(wp.write_seed_slot_indices[:bs], a["write_seeds"][:bs])):
        diffs.append("write offsets/seeds")
    if diffs:
        return f"plan: recomputed on {backend}, DIFFERS from the recorded plan in {', '.join(diffs)}"
    return f"plan: recomputed on {backend} ({n} verify entries, {bs} batch rows), identical to the recorded plan"


def replay_case(case: ReplayCase, backend: str = "host") -> ReplayOutcome:
    """Rerun the recorded launch on ``backend`` (CPU arrays: ``host`` or ``numpy``)."""
    a, m = case.arrays, case.meta
    sources = tuple(RealKvSource(_aligned(a[f"source_{i}"]), page_size=s["page_size"],
                                 num_bytes_per_token=s["num_bytes_per_token"], read_bytes=s["read_bytes"],
                                 layout=KvByteLayout(**s["layout"]) if "layout" in s else None)
                    for i, s in enumerate(m["sources"]))
    canary = a["canary_buf"]
    ctx = VerifyOrWriteContext.allocate(
        num_slots=int(canary.shape[0]), ring_capacity=max(1, int(m["ring_capacity"])), kernel_kind=int(m["tag"]),
        real_kv_sources=sources, real_kv_hash_mode=RealKvHashMode(m["real_kv_hash_mode"]),
        slot_stride_bytes=int(canary.shape[1]),
        enable_chain_position_assert=bool(m["enable_chain_position_assert"]))
    ctx.canary_buf[...] = canary
    plan_check = _recompute_plan(case, backend)
    if m["op"] == "verify":
        plan = VerifyPlan(verify_slot_indices=a["plan_slots"].copy(),
                          verify_expected_tokens=a["plan_expected_tokens"].copy(),
                          verify_expected_positions=a["plan_expected_positions"].copy(),
                          verify_prev_slot_indices=a["plan_prev_slots"].copy(),
                          verify_num_valid=a["plan_num_valid"].copy(), enable=a["plan_enable"].copy(),
                          status=np.zeros(1, np.int32))
        twin = a.get("twin_canary_buf")
        launch_canary_verify_kernel(context=ctx, plan=plan,
                                    check_verify_expected_token=bool(m["check_verify_expected_token"]),
                                    twin_canary_buf=None if twin is None else _aligned(twin),
                                    backend=backend, on_invalid="flag" if backend == "numpy" else None)
    else:
        write_plan = WritePlan.from_tensors(write_offsets=a["write_offsets"].copy(),
                                            write_seed_slot_indices=a["write_seeds"].copy(),
                                            write_num_valid_reqs=a["write_num_valid_reqs"].copy())
        assert_inputs = bool(m["enable_write_input_assert"])
        launch_canary_write_kernel(
            context=ctx, plan=write_plan, input_ids=a["input_ids"], positions=a["positions"],
            out_cache_loc=a["out_cache_loc"], enable_write_input_assert=assert_inputs,
            expected_input_tokens=a["expected_input_tokens"] if assert_inputs else None,
            expected_input_positions=a["expected_input_positions"] if assert_inputs else None,
            backend=backend, on_invalid="flag" if backend == "numpy" else None)
    report = read_violations(ctx)
    expected = a["expected_rows"].reshape(-1, 8)
    got = sorted(tuple(int(x) for x in r.raw) for r in report.rows)
    want = sorted(tuple(int(x) for x in row) for row in expected)
    return ReplayOutcome(report, expected, got == want and report.total == len(want), plan_check)


SANITIZE_ENV = "KVCANARY_HOST_SANITIZE"
_CHILD_ENV = "KVCANARY_REPLAY_SANITIZED_CHILD"


def run_replay(path: str | Path, backend: str = "host", *, sanitize: bool = False, out: TextIO | None = None) -> int:
    """The ``kvcanary replay`` command: 0 when the recorded rows are reproduced, 1 when not, 2 for bad input.

    ``sanitize=True`` runs the host backend built with AddressSanitizer and UBSan. The sanitizer runtime must
    be loaded before Python starts, so this re-executes the current interpreter with ``LD_PRELOAD`` set to
    the compiler's ``libasan.so``, ``ASAN_OPTIONS=detect_leaks=0`` and ``KVCANARY_HOST_SANITIZE=1``.
    """
    out = out or sys.stdout
    if sanitize and os.environ.get(_CHILD_ENV) != "1":
        if backend != "host":
            print(f"kvcanary replay: --sanitize needs --backend host (got {backend})", file=sys.stderr)
            return 2
        return _reexec_sanitized(path)
    try:
        case = load_case(path)
    except ValueError as exc:
        print(f"kvcanary replay: {exc}", file=sys.stderr)
        return 2
    print(f"replaying {case.path.name}", file=out)
    print(f"  {case.title}", file=out)
    under = " under AddressSanitizer + UBSan" if sanitize else ""
    print(f"  backend: {backend}{under}", file=out)
    try:
        outcome = replay_case(case, backend)
    except CanaryArgumentError as exc:  # a dump that passed the schema but that a launcher refuses
        print(f"kvcanary replay: {case.path}: {exc}", file=sys.stderr)
        return 2
    if outcome.plan_check:
        print(outcome.plan_check, file=out)
    print(outcome.report.table(), file=out)
    n = len(outcome.expected_rows)
    if outcome.reproduced:
        print(f"reproduced: the {n} recorded violation row(s), exactly (compared as a multiset)", file=out)
        return 0
    print(f"NOT reproduced: {outcome.report.total} row(s) now, {n} recorded", file=out)
    return 1


def _reexec_sanitized(path: str | Path) -> int:
    from ..hostcuda import HostBuildError, sanitizer_preload

    try:
        preload = sanitizer_preload()
    except HostBuildError as exc:
        print(f"kvcanary replay: --sanitize needs g++: {exc}", file=sys.stderr)
        return 2
    if not os.path.isfile(preload):
        print(f"kvcanary replay: --sanitize needs the AddressSanitizer runtime, but the compiler has none "
              f"({preload!r})", file=sys.stderr)
        return 2
    env = dict(os.environ)
    env["LD_PRELOAD"] = " ".join(p for p in (preload, env.get("LD_PRELOAD", "")) if p)
    env["ASAN_OPTIONS"] = ":".join(p for p in ("detect_leaks=0", env.get("ASAN_OPTIONS", "")) if p)
    env[SANITIZE_ENV] = "1"
    env[_CHILD_ENV] = "1"
    package_root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH", "")) if p)
    cmd = [sys.executable, "-m", "kvcanary_cupy", "replay", str(path), "--backend", "host", "--sanitize"]
    sys.stdout.flush()
    return subprocess.call(cmd, env=env)
