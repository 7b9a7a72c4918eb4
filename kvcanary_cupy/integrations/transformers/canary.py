"""The canary's side of transformers' continuous batching: the engine's KV cache described to
:class:`kvcanary_cupy.runtime.CanaryRuntime` (groups, real-KV sources, layouts, capacities), and one engine step
driven through the runtime's four phases.

Slot numbering is the engine's own: ``slot = block_id * block_physical_stride + offset`` per attention group, so
``write_index`` (the engine's ``out_cache_loc``) and the canary agree with no translation. The real-KV sources are
byte views over ``PagedAttentionCache.cache_tensor`` (no copy): for the ``i``-th layer of a group, K of slot ``s``
lives at byte ``(s + 2 i page_size) row_bytes`` and V at ``(s + (2 i + 1) page_size) row_bytes`` of the flat
cache, which is a :class:`RealKvSource` with ``page_size=1`` over the view starting at the layer's offset. A
runtime group takes at most 4 sources per K/V, so an attention group of more layers becomes one runtime group
per 4 layers (same slots and plan inputs, separate buffers).

Each transformers attention group is a runtime *model* of its own (its forward writes through its own
``write_index``). Sliding-window groups follow the engine's ring: position ``p`` lives at ring slot
``p % window``; after a step only positions ``[past + query - window, past + query)`` still own their slot, every
other position maps to slot 0 in the group's token table (verify skips it, and a predecessor in slot 0 disables
that entry's chain check, as an evicted SWA slot does in SGLang); the group's LUT is the identity.

The TAIL write stamps where the forward really wrote each token (``written``, from the per-layer write hook), not
where the batch said it would: ``post_forward(out_cache_loc=written)`` with -1 for a token whose layers did not all
write one slot, so the scheduled slot keeps its stale TAIL record and the next verify flags it.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..._errors import fail
from ..._validate import bool_arg, int_arg
from ...backends import BACKEND_NAMES
from ...constants import MAX_REAL_KV_SOURCES
from ...context import RealKvSource
from ...layouts import BlockTable, TokenTable
from ...runtime import CanaryConfig, CanaryRuntime, Capacities, KvGroup, KvPools, StepBatch, StepReport
from ...violations import Violation
from .batch import StepBatch as EngineStep


@dataclass(frozen=True)
class StepViolation:
    """One ring row with the engine step whose launch appended it and the attention group it belongs to."""

    step: int
    group: str
    violation: Violation


@dataclass
class GroupGeometry:
    """One transformers cache allocator (attention group) as the canary sees it."""

    name: str  # "FULL" or "SWA" (the launch-tag regime)
    index: int  # the allocator's index: write_index[index], read_index[index]
    allocator: Any
    page_size: int
    stride: int  # block_physical_stride
    window: int  # 0 for full attention
    layer_indices: list[int]
    row_bytes: int
    num_slots: int
    write_trash_index: int

    @classmethod
    def of(cls, allocator: Any, cache: Any) -> GroupGeometry:
        window = int(getattr(allocator, "sliding_window", 0) or 0)
        ps, stride = int(allocator.tokens_per_page), int(allocator.block_physical_stride)
        row_bytes = int(allocator.num_key_value_heads) * int(allocator.head_dim) * cache.dtype.itemsize
        num_blocks = int(cache.cache_tensor.numel()) // int(allocator.bytes_per_block)
        return cls(name="SWA" if window else "FULL", index=int(allocator.index), allocator=allocator,
                   page_size=ps, stride=stride, window=window, layer_indices=list(allocator.layer_indices),
                   row_bytes=row_bytes, num_slots=(num_blocks - 1) * stride + ps,
                   write_trash_index=int(allocator.write_trash_index))

    def slots_of(self, blocks: list[int], length: int) -> np.ndarray:
        """Slots of positions ``[0, length)`` of a request whose block table is ``blocks`` (full attention)."""
        pos = np.arange(length, dtype=np.int64)
        table = np.asarray(blocks, dtype=np.int64)
        return table[pos // self.page_size] * self.stride + pos % self.page_size

    def ring_slots(self, blocks: list[int], length: int, live_from: int) -> np.ndarray:
        """Slots of positions ``[0, length)`` in a sliding group's ring; positions before ``live_from`` -> 0."""
        pos = np.arange(length, dtype=np.int64)
        ring = pos % self.window
        table = np.asarray(blocks, dtype=np.int64)
        slots = np.zeros(length, np.int64)
        live = pos >= live_from
        slots[live] = table[ring[live] // self.page_size] * self.stride + ring[live] % self.page_size
        return slots

    def kv_sources(self, cache: Any, kv: int, read_bytes: int) -> list[RealKvSource]:
        """One source per layer of the group over the flat cache: ``kv`` 0 for K, 1 for V. No copy."""
        flat = cache.cache_tensor
        out = []
        for i, _layer in enumerate(self.layer_indices):
            start = (2 * i + kv) * self.page_size * self.row_bytes
            rows = self.num_slots
            view = flat[start: start + rows * self.row_bytes].view(rows, self.row_bytes)
            tensor = view.numpy() if view.device.type == "cpu" else view
            out.append(RealKvSource(tensor, page_size=1, num_bytes_per_token=self.row_bytes,
                                    read_bytes=read_bytes))
        return out


@dataclass
class CanaryOptions:
    """What the canary does in the engine (turned into a runtime :class:`CanaryConfig`).

    ``mode``: ``log`` (one warning per violation), ``raise`` (the runtime's ``CanaryViolationError`` one step
    later, which stops the engine's loop) or ``off`` (hooks in place, nothing allocated or launched); every
    violation is also kept in ``violations``.
    ``real_kv_hash``: ``partial`` (first 16 bytes of every layer's K/V row) or ``all``; ``with_v`` adds V
    endpoints next to K; ``backend`` as for the launchers (``auto``, ``numpy``, ``host``); the write-input and
    verify-token asserts compare with the engine's request state (prompt + generated ids). ``sweep_interval``:
    every N steps verify every slot of the blocks the engine keeps cached for prefix reuse (0: never).
    ``max_verify_entries_per_step``: the runtime's bounded verify (0, the default: every prefix slot every step).
    """

    mode: str = "log"
    real_kv_hash: str = "partial"
    with_v: bool = True
    backend: str = "auto"
    ring_capacity: int = 4096
    sweep_interval: int = 8
    logger: str = "kvcanary_cupy.transformers"
    max_verify_entries_per_step: int = 0

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Every field strictly (a ``kv-canary: `` error naming ``CanaryOptions.<field>``): no truthiness, no
        arrays, no conversion. Run at construction and again by :meth:`config` (the fields are mutable)."""
        for name, choices in (("mode", ("off", "log", "raise")), ("real_kv_hash", ("partial", "all")),
                              ("backend", ("auto", *BACKEND_NAMES))):
            value = getattr(self, name)
            # isinstance first: `in` on an array or an object with an odd __eq__ would not give a bool
            if not isinstance(value, str) or value not in choices:
                fail(f"CanaryOptions.{name} must be one of {', '.join(choices)}, got {value!r}")
        bool_arg(self.with_v, "CanaryOptions.with_v")
        int_arg(self.ring_capacity, "CanaryOptions.ring_capacity", minimum=1, maximum=(1 << 31) - 1)
        int_arg(self.sweep_interval, "CanaryOptions.sweep_interval", minimum=0)
        if not isinstance(self.logger, str) or not self.logger:
            fail(f"CanaryOptions.logger must be a non-empty str, got {self.logger!r}")

    def config(self) -> CanaryConfig:
        self.validate()
        return CanaryConfig(mode=self.mode, ring_capacity=self.ring_capacity, real_kv_hash_mode=self.real_kv_hash,
                            write_input_assert=True, verify_token_assert=True, backend=self.backend,
                            sweep_interval=self.sweep_interval, logger=self.logger,
                            max_verify_entries_per_step=self.max_verify_entries_per_step)


class TransformersCanaryState:
    """The runtime over one PagedAttentionCache, and the engine step driven through its phases."""

    def __init__(self, cache: Any, opts: CanaryOptions, max_requests: int | None) -> None:
        import torch

        self.opts = opts
        self.cache = cache
        self.device = cache.cache_tensor.device
        self.geos = [GroupGeometry.of(a, cache) for a in cache.cache_allocators.values()]
        self.max_requests = max(1, min(max_requests or int(cache.max_batch_tokens), int(cache.max_batch_tokens)))
        # The longest sequence any table row must describe: every position a request can reach.
        self.max_len = int(max(cache.max_tokens_read, cache.max_batch_tokens)) + 1
        rows = self.max_requests + 1
        # Layout buffers: filled on the host each step (rows 1..B); the runtime reads the device copy, which on
        # a CPU cache is the same memory.
        self.tables = {geo.index: np.zeros((rows, self.max_len if geo.window else -(-self.max_len // geo.page_size)),
                                           np.int32) for geo in self.geos}
        self.device_tables = {i: self._dev(t) if self.device.type == "cpu" else torch.zeros(
            t.shape, dtype=torch.int32, device=self.device) for i, t in self.tables.items()}
        self.luts = {geo.index: torch.arange(geo.num_slots, dtype=torch.int64, device=self.device)
                     for geo in self.geos if geo.window}
        self.model_of = {geo.index: geo.allocator.layer_type for geo in self.geos}
        groups = []
        for geo in self.geos:
            k = geo.kv_sources(cache, 0, geo.row_bytes)
            v = geo.kv_sources(cache, 1, geo.row_bytes) if opts.with_v else None
            for lo in range(0, len(k), MAX_REAL_KV_SOURCES):
                hi = min(len(k), lo + MAX_REAL_KV_SOURCES)
                layers = geo.layer_indices[lo:hi]
                name = geo.name if len(k) <= MAX_REAL_KV_SOURCES else f"{geo.name}:L{layers[0]}-{layers[-1]}"
                common = dict(name=name, num_slots=geo.num_slots, k_sources=tuple(k[lo:hi]),
                              v_sources=None if v is None else tuple(v[lo:hi]), model=self.model_of[geo.index],
                              layout=self._layout(geo))
                if geo.window:
                    groups.append(KvGroup(swa_window=geo.window, full_to_swa_index_mapping=self.luts[geo.index],
                                          **common))
                else:
                    groups.append(KvGroup(**common))
        self.seconds: dict[str, float] = defaultdict(float)  # wall time per canary phase
        caps = Capacities(max_batch_size=self.max_requests, max_tokens=int(cache.max_batch_tokens),
                          max_context_len=self.max_len, pool_rows=self.max_requests + 1,
                          max_history_tokens=self.max_requests * self.max_len)
        device = str(self.device) if self.device.type != "cuda" or self.device.index is not None else "cuda:0"
        # Where each complete full-attention block sits in the table of the request that wrote it: the sweep
        # needs the positions of cached blocks, which the engine does not keep.
        self.block_index: dict[int, int] = {}
        self.rt = CanaryRuntime.create(opts.config(), KvPools(tuple(groups), layout=None), caps, device=device,
                                       framework="torch", timer=self._timer, sweep_source=self._cached_slots)
        # The default engine runs no warm-up forward (a compile warm-up's fake requests would come through here
        # and were not checked), so the write's chain-position assert goes on at once, for full-attention groups only:
        # a sliding-window chunk of q >= window tokens overwrites its own predecessor's ring slot (and sends its
        # first q - window tokens to trash), so its seed is slot 0 and the "+1 after the seed" rule would fail
        # on every such chunk of a clean run.
        self.rt.mark_init_finished(groups=[g.name for g in groups if g.swa_window == 0])
        self.violations: list[StepViolation] = []
        self.health_problems: list[tuple[int, str]] = []
        self.status_bits = 0
        self.dropped = 0
        self.steps = 0

    def _layout(self, geo: GroupGeometry) -> Any:
        """Full attention: the block table itself. Sliding window: a per-position ring table (a slot depends on
        ``position % window`` and on what the window evicted, which no block table expresses)."""
        table = self.device_tables[geo.index]
        if geo.window:
            return TokenTable(table)
        return BlockTable(table, geo.page_size, block_stride=geo.stride, num_slots=geo.num_slots)

    def _dev(self, arr: np.ndarray) -> Any:
        """A host array as a torch tensor on the cache's device (no copy on a CPU cache)."""
        import torch

        return torch.from_numpy(arr).to(self.device)

    @contextlib.contextmanager
    def _timer(self, phase: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] += time.perf_counter() - start

    # -- the step --------------------------------------------------------------------------------------------

    def before_forward(self, batch: EngineStep) -> None:
        """Phases 1 and 2 of every group: stage the batch, then plan, HEAD verify and HEAD write."""
        b = batch.size
        if b > self.max_requests:
            fail(f"the engine scheduled {b} requests in one step, more than the {self.max_requests} the canary "
                 "was sized for (ContinuousBatchingConfig.max_requests_per_batch)")
        history = np.concatenate([batch.expected_pool[i + 1, : int(n)] for i, n in enumerate(batch.valid_lens)]
                                 ).astype(np.int64) if b else np.zeros(0, np.int64)
        offsets = np.zeros(b + 1, np.int64)
        np.cumsum(batch.valid_lens, out=offsets[1:])
        dev = self._dev
        rows, prefix, extend = dev(batch.rows), dev(batch.prefix_lens), dev(batch.extend_lens)
        ids, pos, valid = dev(batch.input_ids), dev(batch.positions), dev(batch.valid_lens)
        want_ids, want_pos = dev(batch.expected_input_ids), dev(batch.expected_positions)
        for n, geo in enumerate(self.geos):
            if self.device.type != "cpu":
                self.device_tables[geo.index][: b + 1].copy_(dev(self.tables[geo.index][: b + 1]))
            first = n == 0  # the expected-token pool is shared: one scatter per step
            step = StepBatch(
                req_pool_indices=rows, prefix_lens=prefix, extend_seq_lens=extend, input_ids=ids, positions=pos,
                out_cache_loc=dev(batch.head_locs[geo.index]), expected_input_ids=want_ids,
                expected_positions=want_pos, valid_lens=valid, history_ids=dev(history) if first else None,
                history_offsets=dev(offsets) if first else None, history_req_pool_indices=rows if first else None)
            self.rt.prepare(step, model=self.model_of[geo.index])
            self.rt.pre_forward(model=self.model_of[geo.index])

    def after_forward(self, batch: EngineStep, written: dict[int, np.ndarray]) -> None:
        """Phases 3 and 4: TAIL verify (re-hashing every prefix slot's real K/V) and TAIL write (fingerprints
        of the new K/V, stamped where the forward really wrote), then the one-step-late read of the rings and,
        when due, the sweep of the cached blocks."""
        self._note_complete_blocks(batch)
        for geo in self.geos:
            loc = written[geo.index]
            moved = not np.array_equal(loc, batch.head_locs[geo.index])
            self.rt.post_forward(model=self.model_of[geo.index], out_cache_loc=self._dev(loc) if moved else None)
        self._collect(self.rt.finish_step())
        self.steps += 1

    def copy_blocks(self, group: int, sources: list[int], dests: list[int]) -> None:
        """The engine copied whole blocks (a fork): copy their canary records too, in every buffer of the group,
        so the copies verify as what they are (the TAIL fingerprints then check the engine's byte copy)."""
        geo = next(g for g in self.geos if g.index == group)
        offsets = np.arange(geo.page_size, dtype=np.int64)
        src = (np.asarray(sources, np.int64)[:, None] * geo.stride + offsets).reshape(-1)
        dst = (np.asarray(dests, np.int64)[:, None] * geo.stride + offsets).reshape(-1)
        self.rt.copy_slots(src, dst, model=self.model_of[group])

    def _note_complete_blocks(self, batch: EngineStep) -> None:
        geo = self.geos[0]
        if len(self.geos) != 1 or geo.window:
            return  # prefix reuse needs full attention only (transformers turns it off otherwise)
        for i, rid in enumerate(batch.request_ids):
            complete = int(batch.prefix_lens[i] + batch.extend_lens[i]) // geo.page_size
            for k, block in enumerate(batch.block_tables[geo.index][rid][:complete]):
                self.block_index[int(block)] = k

    def _cached_slots(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The sweep source: every slot of every block the engine keeps cached for reuse, with its position;
        predecessors inside a block, none across blocks (a cached block's parent may be gone: prev 0 skips
        that one chain check, a block at the start of a sequence anchors at -1)."""
        geo = self.geos[0]
        blocks = [b for b in geo.allocator.ledger.cached_blocks if b in self.block_index] if not geo.window else []
        ps = geo.page_size
        offsets = np.arange(ps, dtype=np.int64)
        slots, positions, prevs = [], [], []
        for b in blocks:
            k = self.block_index[b]
            first = b * geo.stride
            slots.append(first + offsets)
            positions.append(k * ps + offsets)
            prev = first + offsets - 1
            prev[0] = -1 if k == 0 else 0
            prevs.append(prev)
        if not slots:
            empty = np.zeros(0, np.int64)
            return empty, empty, empty
        return np.concatenate(slots), np.concatenate(positions), np.concatenate(prevs)

    def flush(self) -> None:
        """Read everything still pending (the last step's launches)."""
        self._collect(self.rt.flush())

    def _collect(self, report: StepReport) -> None:
        for group, violation in report.new_violations:
            self.violations.append(StepViolation(report.launch_step, group, violation))
        self.health_problems += [(report.launch_step, p) for p in report.health_problems]
        self.status_bits |= report.status_bits
        self.dropped += report.dropped

    def counters(self) -> dict[str, int]:
        """Entries verified and written and kernels launched by the HEAD and TAIL endpoints (not the sweep)."""
        out = {"verify_entries": 0, "write_entries": 0, "launches": 0}
        for (_, tag, op), (slots, kernels) in self.rt.run_counters().items():
            if not tag.startswith("SWEEP_"):
                out[f"{op}_entries"] += slots
                out["launches"] += kernels
        return out
