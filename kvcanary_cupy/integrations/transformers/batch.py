"""One transformers continuous-batching step as the canary's plan inputs: per request past and query lengths,
the engine's block tables, the tokens the forward receives and the tokens the engine's request state says it
should receive.

Everything is copied out of the engine's static buffers (they are reused every step) before the forward runs.
Requests are keyed by ``request_id``; the batch rows here are ``1..B`` in the engine's row order of this step
(row 0 is the canary's padding sentinel), so nothing persists across steps and block tables are re-read each time.
Full-attention groups hand the plan the block ids themselves (a ``BlockTable`` layout, one row per request);
sliding-window groups a per-position ring table (their slot depends on ``position % window`` and on eviction).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..._errors import fail
from ..common.state import expected_pool, host_array


@dataclass
class StepBatch:
    step: int
    request_ids: list[str]
    rows: np.ndarray  # int64 [B]: 1..B
    prefix_lens: np.ndarray  # int64 [B]: tokens already in the cache (past)
    extend_lens: np.ndarray  # int64 [B]: tokens of this step (query)
    cu_seq_lens: np.ndarray  # int64 [B+1]
    input_ids: np.ndarray  # int64 [T]: what the forward receives
    positions: np.ndarray  # int64 [T]
    expected_input_ids: np.ndarray  # int64 [T]: from the request state (prompt + generated)
    expected_positions: np.ndarray  # int64 [T]
    expected_pool: np.ndarray  # int32 [B+1, width]: each request's full history
    valid_lens: np.ndarray  # int64 [B]
    tables: dict[int, np.ndarray]  # group index -> the layout buffer filled for this step (rows 1..B)
    head_locs: dict[int, np.ndarray]  # group index -> int64 [T]: the write_index of the batch (-1 = trash)
    block_tables: dict[int, dict[str, list[int]]]  # group index -> request id -> block ids (copies)

    @property
    def size(self) -> int:
        return len(self.request_ids)

    def slot(self, geo: Any, i: int, position: int) -> int:
        """The slot of ``position`` of batch row ``i`` in group ``geo`` (from this step's block tables)."""
        blocks = self.block_tables[geo.index][self.request_ids[i]]
        total = int(self.prefix_lens[i] + self.extend_lens[i])
        slots = geo.ring_slots(blocks, total, 0) if geo.window else geo.slots_of(blocks, total)
        return int(slots[position])


def build_step_batch(step: int, kwargs: dict[str, Any], requests: list[Any], geos: list[Any],
                     tables: dict[int, np.ndarray], host: Callable[[Any], np.ndarray] = host_array) -> StepBatch:
    """Read one step from the forward's keyword arguments and the engine's ``requests_in_batch``; fill rows
    ``1..B`` of each group's layout buffer in ``tables`` (block ids for full attention, ring slots per position
    for sliding windows) in place. ``host``: how an engine tensor becomes a NumPy array (a ``HostViews``)."""
    b = len(requests)
    cu = host(kwargs["cu_seq_lens_q"])[: b + 1].astype(np.int64)
    t = int(cu[b])
    input_ids = host(kwargs["input_ids"]).reshape(-1)[:t].astype(np.int64)
    positions = host(kwargs["position_ids"]).reshape(-1)[:t].astype(np.int64)
    ids, prefix, extend, histories = [], np.zeros(b, np.int64), np.zeros(b, np.int64), []
    want_ids = np.empty(t, np.int64)
    want_pos = np.empty(t, np.int64)
    for i, future in enumerate(requests):
        state = future.state
        q = int(future.query_length)
        past = int(state.position_offset) - q  # position_offset is advanced before the forward
        if int(cu[i + 1] - cu[i]) != q:
            fail(f"batch row {i} ({state.request_id}) has {int(cu[i + 1] - cu[i])} query tokens in "
                 f"cu_seq_lens_q but query_length {q}: the engine's batch layout is not the one this "
                 "integration was written for")
        history = list(state.initial_tokens) + list(state.generated_tokens)
        ids.append(state.request_id)
        prefix[i], extend[i] = past, q
        histories.append(history)
        want_ids[cu[i]: cu[i + 1]] = history[past: past + q]
        want_pos[cu[i]: cu[i + 1]] = np.arange(past, past + q)
    pool, valid = expected_pool(histories)
    block_tables, head_locs = {}, {}
    write_index = kwargs["write_index"]
    for geo in geos:
        table = tables[geo.index]
        snapshot = {}
        for i, rid in enumerate(ids):
            blocks = list(geo.allocator.block_table.get(rid, []))
            snapshot[rid] = blocks
            total = int(prefix[i] + extend[i])
            if not blocks:
                continue
            if geo.window:
                table[i + 1, :total] = geo.ring_slots(blocks, total, total - geo.window)
            else:
                table[i + 1, : len(blocks)] = blocks
        block_tables[geo.index] = snapshot
        loc = host(write_index[geo.index]).reshape(-1)[:t].astype(np.int64)
        loc[loc == geo.write_trash_index] = -1
        head_locs[geo.index] = loc
    return StepBatch(step=step, request_ids=ids, rows=np.arange(1, b + 1, dtype=np.int64), prefix_lens=prefix,
                     extend_lens=extend, cu_seq_lens=cu, input_ids=input_ids, positions=positions,
                     expected_input_ids=want_ids, expected_positions=want_pos, expected_pool=pool, valid_lens=valid,
                     tables=tables, head_locs=head_locs, block_tables=block_tables)
