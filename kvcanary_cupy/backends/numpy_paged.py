"""The paged layouts' part of the NumPy plan reference: block tables and CSR page lists.

Per batch row a paged layout gives a *span*: a run of block ids inside one flat int32 array (a row of the
block table, or the row's pages in ``kv_page_indices``). Position ``pos`` of the row lives in block
``pos // block_size`` of its span, at slot ``id * block_stride + pos % block_size``. Checks, in the order of
the kernels: the row (table row in range, or a valid indptr range), the position inside the span, the block
id inside the slot space, then (shared with the token table, :func:`.numpy_plan_entries.finish_entries`) the LUT and
the expected-token pool.

Entries are built per *block*, not per entry: the requests' windows are cut into block runs (about
``total / block_size`` of them), every run gathers its block id once, and an entry's slot is its position
plus its run's constant (``id * stride - first position of the block``), one ``np.repeat`` and one add.
That keeps the block table as cheap as the token table, whose entries need one gather each.
"""

from __future__ import annotations

import numpy as np

from ..constants import PlanStatus
from . import numpy_plan_entries
from .workspace import workspace


def _spans(launch, reqs: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(base, block count, row-check bit) of the batch rows ``reqs``; bad rows get an empty span."""
    paged = launch.paged
    if paged.is_page_list:
        a = paged.indptr[reqs].astype(np.int64)
        b = paged.indptr[reqs + 1].astype(np.int64)
        bad = (a < 0) | (b < a) | (b > paged.ids.shape[0])
        bit = int(PlanStatus.PAGE_INDPTR_INVALID)
        if not bad.any():
            return a, b - a, np.zeros(reqs.shape[0], np.int64)
    else:
        rows, width = paged.ids.shape
        row = reqs if paged.batch_rows else launch.req_pool_indices[reqs]
        if not row.size or (int(row.min()) >= 0 and int(row.max()) < rows):
            return row * width, np.full(row.shape[0], width, np.int64), np.zeros(row.shape[0], np.int64)
        bad = (row < 0) | (row >= rows)
        a, b = row * width, (row + 1) * width
        bit = int(PlanStatus.REQ_POOL_INDEX_OUT_OF_RANGE)
    return np.where(bad, 0, a), np.where(bad, 0, b - a), np.where(bad, bit, 0)


def _flat_ids(paged) -> np.ndarray:
    # An empty id array gets a 1-element stand-in: flagged gathers read index 0.
    return paged.ids.reshape(-1) if paged.ids.size else np.zeros(1, np.int32)


def _block_bits(paged, beyond: np.ndarray, block_id: np.ndarray) -> np.ndarray:
    outside = (block_id < 0) | (block_id >= paged.num_blocks)
    return np.where(beyond, int(PlanStatus.POSITION_BEYOND_BLOCKS),
                    np.where(outside, int(PlanStatus.BLOCK_ID_OUTSIDE_SLOTS), 0))


def _ids_inside(paged, block_id: np.ndarray) -> bool:
    return not block_id.size or (int(block_id.min()) >= 0 and int(block_id.max()) < paged.num_blocks)


def _gather(paged, base: np.ndarray, blocks: np.ndarray, pos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Raw slot and check bit (0 = fine) of position ``pos >= 0`` in each span."""
    j = pos // paged.block_size
    beyond = j >= blocks
    any_beyond = bool(beyond.any())
    block_id = _flat_ids(paged).take(base + (np.minimum(j, blocks) if any_beyond else j), mode="clip")
    block_id = block_id.astype(np.int64)
    raw = block_id * paged.block_stride + (pos - j * paged.block_size)
    if not any_beyond and _ids_inside(paged, block_id):
        return raw, np.zeros(raw.shape[0], np.int64)
    return raw, _block_bits(paged, beyond, block_id)


def _slot_at(launch, r: int, pos: int) -> int:
    base, blocks, _ = _spans(launch, np.array([r]))
    return int(_gather(launch.paged, base, blocks, np.array([pos]))[0][0])


def _explain(launch, bit: int, r: int, pos: int) -> str:
    """The message of the first entry or seed (batch row r, position pos) that failed with ``bit``."""
    paged = launch.paged
    if bit == PlanStatus.PAGE_INDPTR_INVALID:
        a, b = int(paged.indptr[r]), int(paged.indptr[r + 1])
        return (f"layout.kv_page_indptr[{r}:{r + 2}]=({a}, {b}) is not a page range inside "
                f"layout.kv_page_indices ({paged.ids.shape[0]} pages)")
    if bit == PlanStatus.REQ_POOL_INDEX_OUT_OF_RANGE:
        return (f"req_pool_indices[{r}]={int(launch.req_pool_indices[r])} is outside layout.block_table's "
                f"{paged.ids.shape[0]} rows")
    base, blocks, _ = _spans(launch, np.array([r]))
    if bit == PlanStatus.POSITION_BEYOND_BLOCKS:
        return (f"{launch.prefix_name}[{r}]={int(launch.prefix_lens[r])} makes position {pos} reach beyond the row's "
                f"{int(blocks[0])} blocks of {paged.block_size} tokens")
    j = pos // paged.block_size
    block_id = int(_flat_ids(paged)[int(base[0]) + j])
    limit = "" if paged.num_blocks >= 1 << 31 else f", {paged.num_blocks} blocks"
    return (f"block id {block_id} (batch row {r}, position {pos}) is outside the slot space "
            f"(ids must be >= 0{limit}; layout.num_slots)")


def _flag_first(launch, bits: np.ndarray, rows: np.ndarray, pos: np.ndarray, flag) -> None:
    for bit in np.unique(bits[bits != 0]):
        k = int(np.argmax(bits == bit))
        flag(PlanStatus(int(bit)), _explain(launch, int(bit), int(rows[k]), int(pos[k])))


def seeds(launch, needs_seed: np.ndarray, flag) -> np.ndarray:
    """Seed slot per batch row: T(slot at prefix - 1) where a seed is needed and every check passes, else -1.
    (Without overflow, :func:`seeds_and_entries` reads them off the entries instead.)"""
    out = np.full(launch.bs, -1, np.int64)
    reqs = np.flatnonzero(needs_seed)
    pos = launch.prefix_lens[reqs] - 1
    base, blocks, bits = _spans(launch, reqs)
    raw, gather_bits = _gather(launch.paged, base, blocks, pos)
    bits = np.where(bits != 0, bits, gather_bits) if bits.any() else gather_bits
    seed_reqs, seed_pos = reqs, pos
    if bits.any():
        _flag_first(launch, bits, reqs, pos, flag)
        ok = bits == 0
        seed_reqs, seed_pos, raw = reqs[ok], pos[ok], raw[ok]
    numpy_plan_entries.translate_seeds(out, seed_reqs, raw, launch.full_to_swa_index_mapping, flag,
                               lambda k: f"the seed slot of batch row {int(seed_reqs[k])} (position "
                                         f"{int(seed_pos[k])})")
    return out


def seeds_and_entries(launch, needs_seed, counts, window_start, verify_offsets, flag):
    """(seeds, (slot, expected token, position, prev slot) of every entry); ``counts`` are exact (no overflow).

    Valid batches (every row, position and block id in range: a few reductions over requests and runs
    tell) skip the per-run status bits altogether. A request that needs a seed has entries (prefix > 0), and
    its last entry is at position prefix - 1: the seed is that entry's raw slot, refused by the same checks
    as the block of that entry (the run's own bits), then translated.
    """
    paged = launch.paged
    size = paged.block_size
    total = int(verify_offsets[-1])
    owner, pos = numpy_plan_entries.owners_and_positions(counts, window_start, verify_offsets)

    # Block runs: for each request with entries, the blocks its window [lo, hi) touches.
    reqs = np.flatnonzero(counts > 0)
    base, blocks, req_bits = _spans(launch, reqs)
    lo = window_start[reqs]
    hi = lo + counts[reqs]
    first_block = lo // size
    last_block = (hi - 1) // size
    runs_per_req = last_block - first_block + 1
    run_offsets = np.zeros(reqs.shape[0] + 1, np.int64)
    np.cumsum(runs_per_req, out=run_offsets[1:])
    req_of_run = np.repeat(np.arange(reqs.shape[0]), runs_per_req)
    block = np.arange(run_offsets[-1]) + np.repeat(first_block - run_offsets[:-1], runs_per_req)
    start = block * size
    run_len = np.minimum(hi[req_of_run] - start, size) - np.maximum(lo[req_of_run] - start, 0)
    rows_fine = not (req_bits.any() or (last_block >= blocks).any())
    index = base[req_of_run] + (block if rows_fine else np.minimum(block, blocks[req_of_run]))
    block_id = _flat_ids(paged).take(index, mode="clip").astype(np.int64)
    # Inside a run, slot - position is one constant: id * stride - (first position of the block).
    slot = workspace().array("slot", total, np.int64)
    np.add(np.repeat(block_id * paged.block_stride - start, run_len), pos, out=slot)

    # Predecessor of each request's first entry: the slot just before its window (-1 at position 0).
    head_prev = np.full(reqs.shape[0], -1, np.int64)
    head_bits = np.zeros(reqs.shape[0], np.int64)
    readable = (lo > 0) & (req_bits == 0)
    if readable.any():
        raw, bits = _gather(paged, base[readable], blocks[readable], lo[readable] - 1)
        head_prev[readable] = raw
        head_bits[readable] = bits

    ok = None
    seeded = needs_seed[reqs]
    seed_reqs = reqs[seeded]
    seed_raw = slot[verify_offsets[seed_reqs + 1] - 1]  # before finish_entries neutralises or translates
    if not (rows_fine and _ids_inside(paged, block_id) and not head_bits.any()):
        ok, run_bits = _entry_checks(launch, owner, pos, req_bits, blocks, req_of_run, block, block_id, run_len,
                                     run_offsets, head_bits, flag)
        fine = run_bits[run_offsets[1:] - 1][seeded] == 0
        seed_reqs, seed_raw = seed_reqs[fine], seed_raw[fine]
    out = np.full(launch.bs, -1, np.int64)
    numpy_plan_entries.translate_seeds(out, seed_reqs, seed_raw, launch.full_to_swa_index_mapping, flag,
                               lambda k: f"the seed slot of batch row {int(seed_reqs[k])} (position "
                                         f"{int(launch.prefix_lens[seed_reqs[k]]) - 1})")
    return out, numpy_plan_entries.finish_entries(
        launch, verify_offsets, counts, owner, window_start, pos, slot, head_prev, ok, flag,
        lambda r, at: f"slot {_slot_at(launch, r, at)} (batch row {r}, position {at})")


def _entry_checks(launch, owner, pos, req_bits, blocks, req_of_run, block, block_id, run_len, run_offsets,
                  head_bits, flag) -> tuple[np.ndarray, np.ndarray]:
    """Per-entry mask of the layout's checks (True = fine) and each run's own bits (its block's checks);
    flags the first failure of each bit."""
    paged = launch.paged
    run_bits = np.where(req_bits[req_of_run] != 0, req_bits[req_of_run],
                        _block_bits(paged, block >= blocks[req_of_run], block_id))
    # A run's first entry also reads its predecessor's block: the previous run's, or the head's.
    prev_bits = np.zeros_like(run_bits)
    if prev_bits.shape[0]:
        prev_outside = (block_id[:-1] < 0) | (block_id[:-1] >= paged.num_blocks)
        prev_bits[1:] = np.where(prev_outside, int(PlanStatus.BLOCK_ID_OUTSIDE_SLOTS), 0)
        prev_bits[run_offsets[:-1]] = head_bits
    first_bits = np.where(run_bits != 0, run_bits, prev_bits)
    bits = np.repeat(run_bits, run_len)
    run_starts = np.zeros(run_len.shape[0], np.int64)
    np.cumsum(run_len[:-1], out=run_starts[1:])
    bits[run_starts] = first_bits
    if bits.any():
        _flag_first(launch, bits, owner, pos, flag)
    return bits == 0, run_bits
