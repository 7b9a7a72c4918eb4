"""The canary's side of one transformers step: per attention group, plan -> HEAD verify/write before the forward,
TAIL verify/write with real-KV fingerprints after it, and the violation ring read one step late.

Slot numbering is the engine's own: ``slot = block_id * block_physical_stride + offset`` per attention group, so
``write_index`` (the engine's ``out_cache_loc``) and the canary agree with no translation. The real-KV sources are
byte views over ``PagedAttentionCache.cache_tensor`` (no copy): for the ``i``-th layer of a group, K of slot ``s``
lives at byte ``(s + 2 i page_size) row_bytes`` and V at ``(s + (2 i + 1) page_size) row_bytes`` of the flat
cache, which is a :class:`RealKvSource` with ``page_size=1`` over the view starting at the layer's offset.

Sliding-window groups follow the engine's ring: position ``p`` lives at ring slot ``p % window``; after a step
only positions ``[past + query - window, past + query)`` still own their slot, every other position of the
request maps to slot 0 (verify skips it, and a predecessor in slot 0 disables that entry's chain check, as an
evicted SWA slot does in SGLang).
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ...constants import MAX_REAL_KV_SOURCES, CanaryLaunchTag, RealKvHashMode
from ...context import RealKvSource, VerifyOrWriteContext
from ...plan import VerifyPlan, WritePlan, launch_canary_plan_kernels
from ...verify import launch_canary_verify_kernel
from ...violations import Violation, read_violations
from ...write import launch_canary_write_kernel
from .batch import StepBatch

logger = logging.getLogger("kvcanary_cupy.transformers")


class CanaryViolationError(RuntimeError):
    """Raised (mode ``raise``) in the step after the one whose launches found violations."""

    def __init__(self, violations: list[StepViolation]) -> None:
        self.violations = violations
        lines = [f"step {v.step} {v.group}: {v.violation.log_line()}" for v in violations[:20]]
        super().__init__(f"kv-canary: {len(violations)} KV-cache violation(s)\n" + "\n".join(lines))


@dataclass(frozen=True)
class StepViolation:
    """One ring row with the engine step whose launch appended it and the attention group it belongs to."""

    step: int
    group: str
    violation: Violation


@dataclass
class _Endpoint:
    tag: CanaryLaunchTag
    verify: VerifyOrWriteContext
    write: VerifyOrWriteContext


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
    """What the canary does in the engine.

    ``mode``: ``log`` (one warning per violation) or ``raise`` (:class:`CanaryViolationError` from the next
    step's hook, which stops the engine's loop); every violation is also kept in ``violations`` either way.
    ``real_kv_hash``: ``partial`` (first 16 bytes of every layer's K/V row) or ``all``; ``with_v`` adds V
    endpoints next to K; ``backend`` as for the launchers (``auto``, ``numpy``, ``host``, ``cuda``).
    """

    mode: str = "log"
    real_kv_hash: str = "partial"
    with_v: bool = True
    backend: str = "auto"
    ring_capacity: int = 4096
    warmup_steps: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    def validate(self) -> None:
        from ..._errors import fail

        if self.mode not in ("log", "raise"):
            fail(f"mode must be 'log' or 'raise', got {self.mode!r}")
        if self.real_kv_hash not in ("partial", "all"):
            fail(f"real_kv_hash must be 'partial' or 'all', got {self.real_kv_hash!r}")
        if self.ring_capacity < 1:
            fail(f"ring_capacity must be >= 1, got {self.ring_capacity}")


class _GroupCanary:
    """HEAD and TAIL buffers, endpoints and plans of one attention group."""

    def __init__(self, geo: GroupGeometry, cache: Any, state: VerifyOrWriteContext, opts: CanaryOptions,
                 max_requests: int) -> None:
        self.geo = geo
        regime = geo.name
        n = geo.num_slots
        mode = RealKvHashMode.PARTIAL if opts.real_kv_hash == "partial" else RealKvHashMode.ALL
        # Sliding groups seed from slot 0 when a chunk longer than the window evicted its predecessor: the
        # chain-position assert would misfire there, and the write-input assert already checks positions.
        self.chain_flag = np.zeros(1, np.int32)

        def ctx(buf: np.ndarray, tag: CanaryLaunchTag, sources: tuple[RealKvSource, ...]) -> VerifyOrWriteContext:
            return state.for_endpoint(canary_buf=buf, kernel_kind=int(tag), real_kv_sources=sources,
                                      real_kv_hash_mode=mode if sources else RealKvHashMode.NONE,
                                      slot_run_counter=np.zeros(1, np.int64),
                                      kernel_run_counter=np.zeros(1, np.int64),
                                      enable_chain_position_assert=self.chain_flag)

        head = np.zeros((n, 32), np.uint8)
        self.head = [_Endpoint(CanaryLaunchTag[f"HEAD_K_{regime}"], ctx(head, CanaryLaunchTag[f"HEAD_K_{regime}"], ()),
                               ctx(head, CanaryLaunchTag[f"HEAD_K_{regime}"], ()))]
        self.tail: list[_Endpoint] = []
        read_bytes = geo.row_bytes
        for kv, name in ((0, "K"), (1, "V")) if opts.with_v else ((0, "K"),):
            sources = geo.kv_sources(cache, kv, read_bytes)
            tag = CanaryLaunchTag[f"TAIL_{name}_{regime}"]
            for lo in range(0, len(sources), MAX_REAL_KV_SOURCES):
                chunk = tuple(sources[lo: lo + MAX_REAL_KV_SOURCES])
                buf = np.zeros((n, 32), np.uint8)
                self.tail.append(_Endpoint(tag, ctx(buf, tag, chunk), ctx(buf, tag, chunk)))
        self.lut = np.arange(n, dtype=np.int64) if geo.window else None
        self.verify_capacity = 0
        self.verify_plan: VerifyPlan | None = None
        self.write_plan = WritePlan.allocate(write_req_capacity=max(1, max_requests))

    def ensure_capacity(self, entries: int, requests: int) -> None:
        if entries > self.verify_capacity or self.verify_plan is None:
            self.verify_capacity = max(1024, 2 * entries)
            self.verify_plan = VerifyPlan.allocate(verify_capacity=self.verify_capacity)
        if requests > self.write_plan.write_offsets.shape[0] - 1:
            self.write_plan = WritePlan.allocate(write_req_capacity=2 * requests)


class TransformersCanaryState:
    """Every canary buffer of one PagedAttentionCache, and the per-step launches over it."""

    def __init__(self, cache: Any, opts: CanaryOptions, max_requests: int) -> None:
        self.opts = opts
        self.cache = cache
        self.state = VerifyOrWriteContext.allocate(num_slots=1, ring_capacity=opts.ring_capacity)
        self.groups = [_GroupCanary(GroupGeometry.of(a, cache), cache, self.state, opts, max_requests)
                       for a in cache.cache_allocators.values()]
        self.violations: list[StepViolation] = []
        self.status_bits = 0
        self.dropped = 0
        self.steps = 0
        self.seconds: dict[str, float] = defaultdict(float)  # wall time per canary phase

    def _timed(self, phase: str, start: float) -> float:
        now = time.perf_counter()
        self.seconds[phase] += now - start
        return now

    # -- launches --------------------------------------------------------------------------------------------

    def before_forward(self, batch: StepBatch) -> None:
        """Plan, HEAD verify and HEAD write of every group (content chain only, no real KV)."""
        if self.steps == self.opts.warmup_steps:
            for g in self.groups:
                g.chain_flag.fill(0 if g.geo.window else 1)
        backend = self.opts.backend
        t = time.perf_counter()
        for g in self.groups:
            table = batch.tables[g.geo.index]
            g.ensure_capacity(batch.verify_entries(g.geo), batch.size)
            assert g.verify_plan is not None
            launch_canary_plan_kernels(
                verify_plan_out=g.verify_plan, write_plan_out=g.write_plan, req_pool_indices=batch.rows,
                prefix_lens=batch.prefix_lens, extend_seq_lens=batch.extend_lens, req_to_token=table,
                swa_window_size=g.geo.window, full_to_swa_index_mapping=g.lut,
                verify_capacity=g.verify_capacity, req_to_verify_expected_tokens=batch.expected_pool,
                req_to_verify_expected_tokens_valid_lens=batch.valid_lens, backend=backend)
            t = self._timed("plan", t)
            for ep in g.head:
                launch_canary_verify_kernel(context=ep.verify, plan=g.verify_plan, check_verify_expected_token=True,
                                            backend=backend)
                t = self._timed("verify", t)
                launch_canary_write_kernel(
                    context=ep.write, plan=g.write_plan, input_ids=batch.input_ids, positions=batch.positions,
                    out_cache_loc=batch.head_locs[g.geo.index], enable_write_input_assert=True,
                    expected_input_tokens=batch.expected_input_ids, expected_input_positions=batch.expected_positions,
                    backend=backend)
                t = self._timed("write", t)

    def after_forward(self, batch: StepBatch, written: dict[int, np.ndarray]) -> None:
        """TAIL verify (re-hashing every prefix slot's real K/V) and TAIL write (fingerprints of the new K/V) of
        every group; ``written[g]`` is where the forward actually wrote each token (-1: not stamped)."""
        backend = self.opts.backend
        t = time.perf_counter()
        for g in self.groups:
            assert g.verify_plan is not None
            loc = written[g.geo.index]
            for ep in g.tail:
                launch_canary_verify_kernel(context=ep.verify, plan=g.verify_plan, check_verify_expected_token=True,
                                            backend=backend)
                t = self._timed("verify", t)
                launch_canary_write_kernel(context=ep.write, plan=g.write_plan, input_ids=batch.input_ids,
                                           positions=batch.positions, out_cache_loc=loc,
                                           enable_write_input_assert=False, backend=backend)
                t = self._timed("write", t)
        self.steps += 1

    # -- violations ------------------------------------------------------------------------------------------

    def read(self, launch_step: int) -> list[StepViolation]:
        """Decode what the launches of ``launch_step`` appended and drain the ring (the engine reads one step
        late); log or queue them for raising per the mode."""
        state = self.state
        if int(state.violation_write_index[0]) == 0 and int(state.status[0]) == 0:
            return []
        start = time.perf_counter()
        report = read_violations(state)
        state.violation_write_index.fill(0)
        if report.status:
            self.status_bits |= report.status
            logger.warning("kv-canary: kernel status %s at step %d", ",".join(report.status_names), launch_step)
            state.status.fill(0)
        self.dropped += report.dropped
        new = [StepViolation(launch_step, "SWA" if v.launch_tag.endswith("_SWA") else "FULL", v) for v in report.rows]
        self.violations.extend(new)
        if self.opts.mode == "log":
            for v in new:
                logger.warning("step=%d group=%s %s", v.step, v.group, v.violation.log_line())
        self._timed("read", start)
        return new

    def counters(self) -> dict[str, int]:
        out = {"verify_entries": 0, "write_entries": 0, "launches": 0}
        for g in self.groups:
            for ep in g.head + g.tail:
                out["verify_entries"] += int(ep.verify.slot_run_counter[0])
                out["write_entries"] += int(ep.write.slot_run_counter[0])
                out["launches"] += int(ep.verify.kernel_run_counter[0]) + int(ep.write.kernel_run_counter[0])
        return out
