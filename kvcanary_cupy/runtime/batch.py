"""One forward's batch as the engine hands it over (:class:`StepBatch`, SGLang's names, any DLPack producer)
and the runtime's fixed-size copy of it (:class:`StagedBatch`), which the bound launches read.

Phase 1 validates the batch against the capacities and copies it into the staged buffers, padding the rest
(rows: ``req_pool_indices = 0``, ``prefix = extend = 0``; tokens: ``out_cache_loc = -1``), so that the
launches of phases 2 and 3 keep fixed shapes and can be captured in a CUDA graph once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .._errors import fail
from .._validate import array_arg
from ..dlpack import Device, device_of
from .space import ArraySpace


@dataclass
class StepBatch:
    """One forward's batch. Every array is int64 and may be any DLPack producer on the runtime's device.

    Attributes:
        req_pool_indices: ``[bs]`` request rows (0 = padding row). None only when every group of the model
            uses a row-less layout (``BlockTable(batch_rows=True)``, ``PageList``).
        prefix_lens, extend_seq_lens: ``[bs]`` tokens already cached / new this forward, per row.
        input_ids, positions, out_cache_loc: ``[T]`` the new tokens, request-major; ``out_cache_loc`` in the
            full pool's slot space (< 0: skip), SWA groups gather it through their LUT.
        expected_input_ids, expected_positions: ``[T]`` the token oracle; required iff the config's
            ``write_input_assert`` is on.
        valid_lens: ``[bs]`` ``req_to_verify_expected_tokens_valid_lens``; required iff ``verify_token_assert``.
        history_ids, history_offsets, history_req_pool_indices: token histories (``[H]``, ``[k + 1]``, ``[k]``)
            scattered into the expected-token pool before the plan (SPEC §6); only with ``verify_token_assert``,
            all three or none (a forward that adds no token to any history, such as a draft forward, gives none).
    """

    req_pool_indices: Any
    prefix_lens: Any
    extend_seq_lens: Any
    input_ids: Any
    positions: Any
    out_cache_loc: Any
    expected_input_ids: Any = None
    expected_positions: Any = None
    valid_lens: Any = None
    history_ids: Any = None
    history_offsets: Any = None
    history_req_pool_indices: Any = None


@dataclass
class Buffer:
    """A runtime buffer: the owner handed to launchers, its view used by the runtime's own copies."""

    owner: Any
    view: Any


def _arg(batch: StepBatch, name: str, device: Device) -> Any:
    arr = array_arg(getattr(batch, name), f"batch.{name}", dtype=np.int64, ndim=1)
    if device_of(arr) != device:
        fail(f"batch.{name} is on {device_of(arr)} but the runtime is on {device}")
    return arr


class StagedBatch:
    """The fixed-size buffers one model's launches are bound to, and the phase-1 copy into them."""

    ROW_FIELDS = ("req_pool_indices", "prefix_lens", "extend_seq_lens", "valid_lens")
    TOKEN_FIELDS = ("input_ids", "positions", "out_cache_loc", "expected_input_ids", "expected_positions")

    def __init__(self, space: ArraySpace, *, model: str, max_batch_size: int, max_tokens: int,
                 with_oracle: bool, with_valid_lens: bool, needs_rows: bool) -> None:
        self.space, self.model = space, model
        self.max_batch_size, self.max_tokens = max_batch_size, max_tokens
        self.with_oracle, self.with_valid_lens, self.needs_rows = with_oracle, with_valid_lens, needs_rows
        self.buffers: dict[str, Buffer] = {}
        self._used: dict[str, int] = {}  # entries the last stage() wrote; everything after them is padding
        for name in self.ROW_FIELDS:
            if name != "valid_lens" or with_valid_lens:
                self.buffers[name] = Buffer(*space.alloc(max_batch_size, np.int64, 0,
                                                         name="Capacities.max_batch_size"))
        for name in self.TOKEN_FIELDS:
            if not name.startswith("expected_") or with_oracle:
                self.buffers[name] = Buffer(*space.alloc(max_tokens, np.int64, -1 if name == "out_cache_loc" else 0,
                                                         name="Capacities.max_tokens"))

    def owner(self, name: str) -> Any:
        buf = self.buffers.get(name)
        return None if buf is None else buf.owner

    def view(self, name: str) -> Any:
        return self.buffers[name].view

    def staged_tokens(self, name: str) -> int:
        """Entries of ``name`` the last :meth:`stage` wrote (the rest of the buffer is padding)."""
        return self._used.get(name, 0)

    def validate(self, batch: StepBatch) -> dict[str, Any]:
        """Views of the batch's arrays after every host-visible check (nothing is written here)."""
        if not isinstance(batch, StepBatch):
            fail(f"batch must be a StepBatch, got {type(batch).__name__}")
        dev = self.space.device
        out: dict[str, Any] = {}
        for name in ("prefix_lens", "extend_seq_lens", "input_ids", "positions", "out_cache_loc"):
            out[name] = _arg(batch, name, dev)
        bs, tokens = int(out["prefix_lens"].shape[0]), int(out["input_ids"].shape[0])
        if batch.req_pool_indices is not None:
            out["req_pool_indices"] = _arg(batch, "req_pool_indices", dev)
        elif self.needs_rows:
            fail(f"batch.req_pool_indices is required: a group of model {self.model!r} reads its slots through "
                 "request rows (req_to_token or a BlockTable with batch_rows=False)")
        oracle = (batch.expected_input_ids, batch.expected_positions)
        if self.with_oracle:
            if any(a is None for a in oracle):
                fail("batch.expected_input_ids and batch.expected_positions are required when "
                     "CanaryConfig.write_input_assert is on")
            out["expected_input_ids"] = _arg(batch, "expected_input_ids", dev)
            out["expected_positions"] = _arg(batch, "expected_positions", dev)
        elif any(a is not None for a in oracle):
            fail("batch.expected_input_ids / expected_positions are given but CanaryConfig.write_input_assert is off")
        if self.with_valid_lens:
            if batch.valid_lens is None:
                fail("batch.valid_lens is required when CanaryConfig.verify_token_assert is on")
            out["valid_lens"] = _arg(batch, "valid_lens", dev)
        elif batch.valid_lens is not None:
            fail("batch.valid_lens is given but CanaryConfig.verify_token_assert is off")
        for name, arr in out.items():
            want = bs if name in self.ROW_FIELDS else tokens
            if int(arr.shape[0]) != want:
                other = "prefix_lens" if name in self.ROW_FIELDS else "input_ids"
                fail(f"batch.{name} has {arr.shape[0]} entries but batch.{other} has {want}")
        if bs > self.max_batch_size:
            fail(f"batch holds {bs} rows, more than Capacities.max_batch_size={self.max_batch_size}")
        if tokens > self.max_tokens:
            fail(f"batch holds {tokens} new tokens, more than Capacities.max_tokens={self.max_tokens}")
        return out

    def stage(self, views: dict[str, Any]) -> None:
        """Copy validated views into the staged buffers and pad the tails (device copies, no host sync). Only
        the entries the previous batch used are re-padded: the cost follows the batch, not the capacity."""
        for name, buf in self.buffers.items():
            src = views.get(name)
            n = 0 if src is None else int(src.shape[0])
            if n:
                buf.view[:n] = src
            used = self._used.get(name, 0)
            if used > n:
                buf.view[n:used] = -1 if name == "out_cache_loc" else 0
            self._used[name] = n


class StagedHistory:
    """The expected-token scatter's fixed-size inputs (token histories of up to ``max_batch_size`` rows)."""

    def __init__(self, space: ArraySpace, *, max_rows: int, max_tokens: int) -> None:
        self.space, self.max_rows, self.max_tokens = space, max_rows, max_tokens
        self.flat = Buffer(*space.alloc(max_tokens, np.int64, 0, name="Capacities.max_history_tokens"))
        self.offsets = Buffer(*space.alloc(max_rows + 1, np.int64, 0, name="Capacities.max_batch_size"))
        self.rows = Buffer(*space.alloc(max_rows, np.int64, 0, name="Capacities.max_batch_size"))
        self._rows_used = 0

    def validate(self, batch: StepBatch) -> tuple[Any, Any, Any] | None:
        parts = (batch.history_ids, batch.history_offsets, batch.history_req_pool_indices)
        if all(p is None for p in parts):
            return None
        if any(p is None for p in parts):
            fail("batch.history_ids, history_offsets and history_req_pool_indices go together (all or none)")
        dev = self.space.device
        flat, offsets, rows = (_arg(batch, n, dev) for n in ("history_ids", "history_offsets",
                                                            "history_req_pool_indices"))
        k = int(rows.shape[0])
        if int(offsets.shape[0]) != k + 1:
            fail(f"batch.history_offsets must hold len(history_req_pool_indices) + 1 = {k + 1} entries, "
                 f"got {offsets.shape[0]}")
        if k > self.max_rows:
            fail(f"batch.history_req_pool_indices holds {k} rows, more than Capacities.max_batch_size="
                 f"{self.max_rows}")
        if int(flat.shape[0]) > self.max_tokens:
            fail(f"batch.history_ids holds {flat.shape[0]} tokens, more than Capacities.max_history_tokens="
                 f"{self.max_tokens}")
        return flat, offsets, rows

    def stage(self, views: tuple[Any, Any, Any] | None) -> bool:
        """Copy the histories in; False (nothing staged, nothing to scatter) when the batch has none."""
        if views is None:
            return False
        flat, offsets, rows = views
        n, k = int(flat.shape[0]), int(rows.shape[0])
        if n:
            self.flat.view[:n] = flat
        self.offsets.view[: k + 1] = offsets
        # padding rows (pool row 0) get empty segments at the end
        self.offsets.view[k + 1 :] = self.offsets.view[k : k + 1]
        self.rows.view[:k] = rows
        if self._rows_used > k:
            self.rows.view[k : self._rows_used] = 0
        self._rows_used = k
        return True
