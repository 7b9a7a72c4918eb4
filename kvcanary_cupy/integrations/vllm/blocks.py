"""The sweep's record of vLLM's cached blocks (:class:`BlockIndex`): where each complete block the runner has
seen written sits in the sequence that wrote it, one array per KV cache group, updated for a whole step at once,
and the part of it one sweep verifies (at most ``blocks_per_sweep`` blocks, taken round-robin, none of those the
step's own verify has just covered).

The runner does not keep a block's position in its sequence, and vLLM's block pool is not visible in every
process layout, so the index is what the sweep knows: a block a step writes to completion is indexed at its place
in the sequence, a block still being filled is dropped (vLLM may have handed it out again since it was last
complete; it does not zero reused blocks on this build), a block vLLM hands out fresh
(``new_block_ids_to_zero``) is dropped, and a sliding-window group's block-table entries below a row's window
(freed blocks whose ids the worker keeps, or the null block) are left out, and dropped where they were indexed
(vLLM frees them and hands them out again at once). The groups of a hybrid model share one block pool and a layer
of one group addresses the same bytes as a layer of another, so a block one group's rows hold is dropped from
every other group's index in the same step.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

import numpy as np

from ..common.state import block_slots

__all__ = ["BlockIndex", "sweep_latency_steps"]


def sweep_latency_steps(indexed_blocks: int, blocks_per_sweep: int, sweep_interval: int) -> int:
    """Steps within which every block indexed when a pass starts is swept once (the sweep's detection latency
    for a cached block corrupted at rest): ``sweep_interval * ceil(indexed_blocks / blocks_per_sweep)``; 0 when
    the sweep is off."""
    if sweep_interval <= 0:
        return 0
    return sweep_interval * max(1, -(-indexed_blocks // max(1, blocks_per_sweep)))


class BlockIndex:
    """Per KV cache group, each block's index in the sequence that wrote it (-1: not indexed). Groups are named
    by ``group_ids`` (vLLM's KV cache group indices, only the checked ones; default ``0 .. n - 1``)."""

    def __init__(self, num_blocks: Sequence[int], block_sizes: Sequence[int], blocks_per_sweep: int,
                 group_ids: Sequence[int] | None = None) -> None:
        ids = list(range(len(num_blocks))) if group_ids is None else [int(g) for g in group_ids]
        self.where = {g: np.full(n, -1, np.int64) for g, n in zip(ids, num_blocks, strict=True)}
        self.block_sizes = dict(zip(ids, block_sizes, strict=True))
        self.blocks_per_sweep = max(1, int(blocks_per_sweep))
        self._cursor = dict.fromkeys(ids, 0)  # the first block id the next sweep of a group looks at
        # per group, the last step's table and per-row block counts: a step that repeats them (a decode step
        # inside blocks) would index exactly what is indexed already, unless blocks were forgotten since
        self._last: dict[int, tuple[int, bytes, bytes, bytes, bytes | None] | None] = dict.fromkeys(ids)
        # per group, the blocks the last step's rows hold: that step verified every one of them (they are its
        # rows' prefixes), so the sweep after it skips them
        self.live = {g: np.zeros(n, bool) for g, n in zip(ids, num_blocks, strict=True)}

    def forget(self, block_ids: Iterable[int] | None) -> None:
        """vLLM handed these blocks out fresh (and zeroed them): they hold nothing the sweep may check."""
        ids = np.fromiter((int(b) for b in block_ids or ()), np.int64)
        if not ids.size:
            return
        for gi, where in self.where.items():
            where[ids[(ids >= 0) & (ids < where.shape[0])]] = -1
            self._last[gi] = None

    def note_step(self, gi: int, table: np.ndarray, totals: np.ndarray, written: np.ndarray | None = None,
                  stamped: np.ndarray | None = None, first: np.ndarray | None = None,
                  stamped_rows: np.ndarray | None = None) -> None:
        """Index every block the step's rows (``table``: ``[B, max_blocks]``, ``totals``: each row's tokens the
        canary has stamped after the step) hold of group ``gi``: complete blocks at their place, a block still
        being filled dropped. Where two rows disagree about a block, the later row decides (the order of the
        runner's rows). ``written``: each row's tokens the forward wrote, more than ``totals`` for a row the step
        left partly unstamped (deferred re-stamps); such a row's blocks past its complete stamped ones are
        dropped, except those another row stamps in this step (``stamped``: the block ids of the step's canary
        slots; ``stamped_rows``: the row that stamps each, so that a row's own stamps never count as another
        row's, as a drafting row's own accepted token in its partly filled block; without it every stamp counts),
        which are that row's to index. ``first``: per row, the first block column the row still holds (a
        sliding-window group: the columns before it are out of the window, their ids stale or the null block,
        and are neither indexed nor taken as held; a block they name that no row of the step holds inside its
        window is dropped: vLLM has freed it). Every block the rows hold inside their windows is dropped from the
        other groups' indexes (one block pool: it is this group's now, and its layers write the bytes the other
        groups' layers read)."""
        where, bs = self.where[gi], self.block_sizes[gi]
        if not totals.size:
            self.live[gi][:] = False
            self._last[gi] = None
            return
        complete = totals // bs
        ends = totals if written is None else np.maximum(written, totals)
        reach = -(-ends // bs)
        partial = written is not None and bool((ends > totals).any())
        # most steps (decodes inside a block) change nothing here: as few array operations as can tell
        key = (table.shape[1], table.tobytes(), complete.tobytes(), reach.tobytes(),
               None if first is None else np.asarray(first, np.int64).tobytes())
        if key == self._last[gi] and not partial:
            return
        self._last[gi] = None if partial else key
        started = complete + (totals % bs > 0)
        lower = np.zeros_like(complete) if first is None else np.asarray(first, np.int64)
        cols = np.arange(table.shape[1], dtype=np.int64)
        inside = cols[None, :] >= lower[:, None]
        held = (cols[None, :] < started[:, None]) & inside
        blocks = table[held].astype(np.int64)
        live = self.live[gi]
        live[:] = False
        live[blocks[(blocks >= 0) & (blocks < live.shape[0])]] = True
        used = (cols[None, :] < reach[:, None]) & inside
        if first is not None or len(self.where) > 1:
            self._drop_freed_and_claimed(gi, table, used, (cols[None, :] < reach[:, None]) & ~inside)
        if partial:
            others = self._stamped_by_others(table, stamped, stamped_rows)
            used &= ~((ends > totals)[:, None] & (cols[None, :] >= complete[:, None]) & others)
        blocks = table[used].astype(np.int64)
        ks = np.broadcast_to(cols, table.shape)[used]
        value = np.where((cols[None, :] < complete[:, None])[used], ks, -1)
        keep = (blocks > 0) & (blocks < where.shape[0])
        blocks, value = blocks[keep], value[keep]
        # the last occurrence of a block decides: unique over the reversed list keeps each block's last value
        last, first_in_reversed = np.unique(blocks[::-1], return_index=True)
        where[last] = value[::-1][first_in_reversed]

    @staticmethod
    def _stamped_by_others(table: np.ndarray, stamped: np.ndarray | None, rows: np.ndarray | None) -> np.ndarray:
        """Per table entry: whether a row other than the entry's own stamps that block in this step."""
        if stamped is None or not np.asarray(stamped).size:
            return np.zeros(table.shape, bool)
        stamped = np.asarray(stamped, np.int64)
        if rows is None:
            return np.isin(table, stamped)
        blocks = table.astype(np.int64)
        span = int(max(blocks.max(initial=0), stamped.max(initial=0))) + 1
        pairs = np.unique(np.asarray(rows, np.int64) * span + stamped)  # (row, block), each once
        ids, stampers = np.unique(pairs % span, return_counts=True)  # per block, how many rows stamp it
        at = np.minimum(np.searchsorted(ids, blocks), ids.size - 1)
        count = np.where(ids[at] == blocks, stampers[at], 0)
        own = np.arange(table.shape[0], dtype=np.int64)[:, None] * span + blocks
        mine = pairs[np.minimum(np.searchsorted(pairs, own), pairs.size - 1)] == own
        return count - mine > 0

    def _drop_freed_and_claimed(self, gi: int, table: np.ndarray, used: np.ndarray, below: np.ndarray) -> None:
        """Group ``gi``'s rows hold the blocks at ``used`` (inside their windows): drop them from every other
        group's index; the blocks at ``below`` (out of a sliding window) that no row holds are dropped from
        ``gi``'s own."""
        held = np.unique(table[used])
        held = held[held > 0]
        for other, where in self.where.items():
            if other == gi:
                continue
            ids = held[held < where.shape[0]]
            where[ids[where[ids] >= 0]] = -1
        if below.any():
            where = self.where[gi]
            freed = np.setdiff1d(table[below], held)
            where[freed[(freed > 0) & (freed < where.shape[0])]] = -1

    def indexed(self, gi: int) -> np.ndarray:
        """The block ids group ``gi`` has indexed, ascending."""
        return np.flatnonzero(self.where[gi] >= 0)

    def __iter__(self) -> Iterator[tuple[int, int]]:
        """Every indexed ``(group index, block id)``."""
        for gi in self.where:
            for block in self.indexed(gi).tolist():
                yield gi, block

    def __len__(self) -> int:
        return sum(int((w >= 0).sum()) for w in self.where.values())

    def sweep_entries(self, gi: int, page_size: int, stride: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The next sweep's slots of group ``gi``: at most ``blocks_per_sweep`` indexed blocks that the last
        step's rows do not hold (those it has just verified), from the block id the previous sweep stopped at,
        wrapping around (every such block is swept within :func:`sweep_latency_steps`)."""
        blocks = np.flatnonzero((self.where[gi] >= 0) & ~self.live[gi])
        if blocks.size > self.blocks_per_sweep:
            start = int(np.searchsorted(blocks, self._cursor[gi]))
            blocks = np.roll(blocks, -start)[: self.blocks_per_sweep]
            self._cursor[gi] = int(blocks[-1]) + 1
        return block_slots(blocks, self.where[gi][blocks], page_size, stride)
