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

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..._errors import fail
from ..._validate import int_arg
from ...constants import MAX_REAL_KV_SOURCES
from ...context import RealKvSource
from ...layouts import BlockTable, TokenTable
from ...runtime import CanaryConfig, CanaryRuntime, Capacities, KvGroup, KvPools
from ..common.options import EngineCanaryOptions
from ..common.state import EngineCanaryState, StepViolation, cached_block_slots
from .batch import StepBatch as EngineStep

__all__ = ["CanaryOptions", "GroupGeometry", "StepViolation", "TransformersCanaryState"]

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
class CanaryOptions(EngineCanaryOptions):
    """What the canary does in the engine (turned into a runtime :class:`CanaryConfig`).

    ``mode``: ``log`` (per step one warning per group with violations, ``log_rows`` of its rows spelled out),
    ``raise`` (the runtime's ``CanaryViolationError`` one step later, which stops the engine's loop) or ``off``
    (hooks in place, nothing allocated or launched); every violation is also kept in ``violations``.
    ``real_kv_hash``: ``partial`` (first 16 bytes of every layer's K/V row) or ``all``; ``with_v`` adds V
    endpoints next to K; ``backend`` as for the launchers (``auto``, ``numpy``, ``host``); the write-input and
    verify-token asserts compare with the engine's request state (prompt + generated ids). ``sweep_interval``:
    every N steps verify every slot of the blocks the engine keeps cached for prefix reuse (0: never).
    ``max_verify_entries_per_step``: the runtime's bounded verify (0, the default: every prefix slot every step).
    """

    logger: str = "kvcanary_cupy.transformers"
    max_verify_entries_per_step: int = 0

    REAL_KV_HASH_CHOICES = ("partial", "all")

    def validate(self) -> None:
        super().validate()
        int_arg(self.max_verify_entries_per_step, "CanaryOptions.max_verify_entries_per_step", minimum=0)

    def config(self) -> CanaryConfig:
        self.validate()
        return self.runtime_config(max_verify_entries_per_step=self.max_verify_entries_per_step)


class TransformersCanaryState(EngineCanaryState):
    """The runtime over one PagedAttentionCache, and the engine step driven through its phases."""

    def __init__(self, cache: Any, opts: CanaryOptions, max_requests: int | None) -> None:
        import torch

        super().__init__()
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

    def _layout(self, geo: GroupGeometry) -> Any:
        """Full attention: the block table itself. Sliding window: a per-position ring table (a slot depends on
        ``position % window`` and on what the window evicted, which no block table expresses)."""
        table = self.device_tables[geo.index]
        if geo.window:
            return TokenTable(table)
        return BlockTable(table, geo.page_size, block_stride=geo.stride, num_slots=geo.num_slots)

    # -- the step --------------------------------------------------------------------------------------------

    def before_forward(self, batch: EngineStep) -> None:
        """Phases 1 and 2 of every group: stage the batch, then plan, HEAD verify and HEAD write."""
        b = batch.size
        if b > self.max_requests:
            fail(f"the engine scheduled {b} requests in one step, more than the {self.max_requests} the canary "
                 "was sized for (ContinuousBatchingConfig.max_requests_per_batch)")
        steps = self._step_batches(batch, [batch.head_locs[geo.index] for geo in self.geos])
        for geo, step in zip(self.geos, steps, strict=True):
            if self.device.type != "cpu":
                self.device_tables[geo.index][: b + 1].copy_(self._dev(self.tables[geo.index][: b + 1]))
            self.rt.prepare(step, model=self.model_of[geo.index])
            self.rt.pre_forward(model=self.model_of[geo.index])

    def after_forward(self, batch: EngineStep, written: dict[int, np.ndarray]) -> None:
        """Phases 3 and 4: TAIL verify (re-hashing every prefix slot's real K/V) and TAIL write (fingerprints
        of the new K/V, stamped where the forward really wrote), then the one-step-late read of the rings and,
        when due, the sweep of the cached blocks."""
        self._note_complete_blocks(batch)
        for geo in self.geos:
            self._post_forward(self.model_of[geo.index], written[geo.index], batch.head_locs[geo.index])
        self._finish_step()

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
        return cached_block_slots(((b, self.block_index[b]) for b in blocks), geo.page_size, geo.stride)
