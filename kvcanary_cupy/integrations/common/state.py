"""The per-step side of a canary installed in an engine: what each step's read of the rings adds up to.

:class:`EngineCanaryState` is the base of every engine's canary state (one runtime over the engine's KV cache):
the violations read so far with the engine step whose launch appended them (:class:`StepViolation`), the health
problems, status bits and ring drops (each read also fed to the Prometheus metrics of :mod:`.metrics`), the wall
time per canary phase, the HEAD/TAIL endpoint counters, the runtime
``StepBatch`` of every group built from one engine step, and the slots of cached blocks the sweep verifies. Reading
a step uses :func:`host_array` (:class:`HostViews` for the tensors read every step) and :func:`expected_pool`. How
an engine's cache maps onto runtime groups and how its step is read stay in the engine's package.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from ...runtime import CanaryRuntime, StepBatch, StepReport
from ...violations import Violation
from .metrics import StepMetrics


@dataclass(frozen=True)
class StepViolation:
    """One ring row with the engine step whose launch appended it and the canary group it belongs to."""

    step: int
    group: str
    violation: Violation


class EngineStep(Protocol):
    """The plan inputs of one engine step that every engine's batch carries (rows ``1..B``, tokens ``[T]``)."""

    rows: np.ndarray
    prefix_lens: np.ndarray
    extend_lens: np.ndarray
    input_ids: np.ndarray
    positions: np.ndarray
    expected_input_ids: np.ndarray
    expected_positions: np.ndarray
    valid_lens: np.ndarray

    @property
    def expected_pool(self) -> np.ndarray: ...  # int32 [B+1, width]: row i+1 holds row i's history

    @property
    def size(self) -> int: ...


class PhaseClock:
    """Adds the wall time of a ``with`` block to ``seconds[phase]``. A plain class, not a generator context
    manager: the runtime times every launch (about 20 a step), and entering a generator-based one costs
    several times more."""

    __slots__ = ("phase", "seconds", "start")

    def __init__(self, seconds: dict[str, float], phase: str) -> None:
        self.seconds, self.phase, self.start = seconds, phase, 0.0

    def __enter__(self) -> None:
        self.start = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        self.seconds[self.phase] += time.perf_counter() - self.start


class EngineCanaryState:
    """The tallies of one runtime in an engine; the engine's state class creates ``rt`` (with :meth:`_timer` as
    its timer) and drives the steps, calling :meth:`_finish_step` after each and :meth:`flush` at the end."""

    rt: CanaryRuntime
    device: Any  # the torch device of the engine's KV cache

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)  # wall time per canary phase
        self.violations: list[StepViolation] = []
        self.health_problems: list[tuple[int, str]] = []
        self.status_bits = 0
        self.dropped = 0
        self.steps = 0
        # the same Prometheus series from every engine: the engine's name is its state class's
        self.metrics = StepMetrics(type(self).__name__.removesuffix("CanaryState").lower() or "engine")

    def _timer(self, phase: str) -> PhaseClock:
        return PhaseClock(self.seconds, phase)

    def _dev(self, arr: np.ndarray) -> Any:
        """A host array on the cache's device: on a CPU cache the array itself (the runtime takes NumPy arrays
        as they are, where a torch tensor would cost a DLPack import per array and step), else a torch copy."""
        if self.device.type == "cpu":
            return arr
        import torch

        return torch.from_numpy(arr).to(self.device)

    def _step_batches(self, batch: EngineStep, out_cache_locs: Sequence[np.ndarray],
                      history: np.ndarray | None = None) -> list[StepBatch]:
        """The runtime's :class:`StepBatch` of each group of one engine step (``out_cache_locs``: the group's write
        slots); the expected-token history (``history``: the rows' histories one after the other, int64; by
        default read from ``batch.expected_pool``) goes with the first group only (the pool is shared: one
        scatter)."""
        b = batch.size
        if history is None:
            # rows 1..B of the pool, each up to its valid length, one after the other (a row-major mask)
            pool = batch.expected_pool
            history = (pool[1 : b + 1][np.arange(pool.shape[1])[None, :] < np.asarray(batch.valid_lens)[:, None]]
                       .astype(np.int64) if b else np.zeros(0, np.int64))
        offsets = np.zeros(b + 1, np.int64)
        np.cumsum(batch.valid_lens, out=offsets[1:])
        dev = self._dev
        rows, prefix, extend = dev(batch.rows), dev(batch.prefix_lens), dev(batch.extend_lens)
        ids, pos, valid = dev(batch.input_ids), dev(batch.positions), dev(batch.valid_lens)
        want_ids, want_pos = dev(batch.expected_input_ids), dev(batch.expected_positions)
        steps = []
        for n, loc in enumerate(out_cache_locs):
            first = n == 0
            steps.append(StepBatch(
                req_pool_indices=rows, prefix_lens=prefix, extend_seq_lens=extend, input_ids=ids, positions=pos,
                out_cache_loc=dev(loc), expected_input_ids=want_ids, expected_positions=want_pos,
                valid_lens=valid, history_ids=dev(history) if first else None,
                history_offsets=dev(offsets) if first else None, history_req_pool_indices=rows if first else None))
        return steps

    def _post_forward(self, model: str, written: np.ndarray, planned: np.ndarray) -> None:
        """The TAIL phases of one group, stamped at ``written`` (where the forward really wrote) when that is not
        where the batch said it would write (``planned``)."""
        moved = not np.array_equal(written, planned)
        self.rt.post_forward(model=model, out_cache_loc=self._dev(written) if moved else None)

    def _finish_step(self) -> None:
        """The one-step-late read of the rings (and, when due, the sweep) after the step's TAIL launches."""
        self._collect(self.rt.finish_step())
        self.steps += 1
        self.metrics.step(self.seconds)

    def flush(self) -> None:
        """Read everything still pending (the last step's launches)."""
        self._collect(self.rt.flush())

    def _collect(self, report: StepReport) -> None:
        for group, violation in report.new_violations:
            self.violations.append(StepViolation(report.launch_step, group, violation))
        self.health_problems += [(report.launch_step, p) for p in report.health_problems]
        self.status_bits |= report.status_bits
        self.dropped += report.dropped
        self.metrics.report(report)

    def counters(self) -> dict[str, int]:
        """Entries verified and written and kernels launched by the HEAD and TAIL endpoints (not the sweep)."""
        out = {"verify_entries": 0, "write_entries": 0, "launches": 0}
        for (_, tag, op), (slots, kernels) in self.rt.run_counters().items():
            if not tag.startswith("SWEEP_"):
                out[f"{op}_entries"] += slots
                out["launches"] += kernels
        return out


def host_array(tensor: Any) -> np.ndarray:
    """A torch tensor of the engine as a host NumPy array (a copy only when it lives on a device)."""
    return tensor.detach().to("cpu").numpy()


class HostViews:
    """:func:`host_array` for the engine tensors read every step, with the NumPy view of a CPU tensor kept.

    Engines hand their forward the same static buffers step after step (input ids, positions, write indices),
    and importing one into NumPy takes several torch calls, tens of microseconds each on a busy engine thread,
    several times per layer and step. A kept view is reused only for the very tensor object it was taken from
    while that tensor still starts at the same address with the same shape; anything else (a new tensor, a
    storage that moved, a device tensor, which is copied every time) goes through :func:`host_array`. The views
    are read, never written, and hold their tensors (at most ``limit``; the oldest half goes when full)."""

    def __init__(self, limit: int = 64) -> None:
        self.limit = limit
        self._kept: dict[int, tuple[Any, int, Any, np.ndarray]] = {}

    def __call__(self, tensor: Any) -> np.ndarray:
        kept = self._kept.get(id(tensor))
        if kept is not None and kept[0] is tensor and kept[1] == tensor.data_ptr() and kept[2] == tensor.shape:
            return kept[3]
        arr = host_array(tensor)
        if tensor.is_cpu:
            if len(self._kept) >= self.limit:
                for key in list(self._kept)[: self.limit // 2]:
                    del self._kept[key]
            self._kept[id(tensor)] = (tensor, tensor.data_ptr(), tensor.shape, arr)
        return arr

    def clear(self) -> None:
        self._kept.clear()


def expected_pool(histories: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Each batch row's token history (what the engine's request state says it holds) as rows ``1..B`` of an
    int32 pool (row 0 is the padding sentinel), and each history's length."""
    width = max([len(h) for h in histories] + [1])
    pool = np.zeros((len(histories) + 1, width), np.int32)
    for i, h in enumerate(histories):
        pool[i + 1, : len(h)] = h
    valid = np.array([len(h) for h in histories], np.int64)
    return pool, valid


def cached_block_slots(blocks: Iterable[tuple[int, int]], page_size: int, stride: int
                       ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The sweep source over cached blocks, each given as ``(block id, its index in the sequence that wrote it)``:
    :func:`block_slots` of those blocks."""
    pairs = np.array(list(blocks), np.int64).reshape(-1, 2)
    return block_slots(pairs[:, 0], pairs[:, 1], page_size, stride)


def block_slots(blocks: np.ndarray, indices: np.ndarray, page_size: int, stride: int
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The sweep source over cached blocks (``blocks``, each at index ``indices`` of the sequence that wrote it):
    every slot (``block * stride + offset``) with its position and its predecessor, inside a block only (a cached
    block's parent may be gone: prev 0 skips that one chain check, a block at the start of a sequence anchors
    at -1). Block-major, offsets ascending."""
    blocks = np.asarray(blocks, np.int64).reshape(-1, 1)
    indices = np.asarray(indices, np.int64).reshape(-1, 1)
    offsets = np.arange(page_size, dtype=np.int64)[None, :]
    slots = blocks * stride + offsets
    prevs = slots - 1
    prevs[:, 0] = np.where(indices[:, 0] == 0, -1, 0)
    return slots.reshape(-1), (indices * page_size + offsets).reshape(-1), prevs.reshape(-1)
