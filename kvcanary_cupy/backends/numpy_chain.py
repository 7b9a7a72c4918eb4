"""The vectorized NumPy references of write, verify (SPEC §4, §5) and the expected-token scatter (SPEC §6).

Verify and scatter are loop-free. Write is loop-free except for the hash chain itself, which is serial by
definition: it advances all requests together, one step per rank (the j-th written entry of every request),
so a decode step (one token per request) is a single vector step.

Like the plan reference, each function computes everything first and writes the caller's buffers last, so a
call that raises (``on_invalid="raise"``, the default, for device values a kernel would refuse) changes
nothing. Violation rows are appended in request/entry order; the kernels append the same rows in atomic order.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._errors import fail
from ..constants import CanaryStatus, FailReason
from ..hashing import chain_hash, fold_real_kv, mix3

_I32 = 1 << 32


def _wrap_i32(value: np.ndarray | int) -> Any:
    return (value + (1 << 31)) % _I32 - (1 << 31)


def append_violations(ctx: Any, rows: np.ndarray) -> None:
    """Fill-once ring append: row k takes sequence number ``write_index + k`` (int32 arithmetic, as the
    kernels' atomicAdd) and lands iff ``0 <= seq < capacity``; the index advances by every row."""
    n = rows.shape[0]
    base = int(ctx.write_index[0])
    if n:
        seq = _wrap_i32(base + np.arange(n, dtype=np.int64))
        lands = (seq >= 0) & (seq < ctx.ring.shape[0])
        ctx.ring[seq[lands]] = rows[lands]
    ctx.write_index[0] = _wrap_i32(base + n)


def _rows(columns: list[Any], n: int) -> np.ndarray:
    out = np.empty((n, len(columns)), np.int64)
    for k, column in enumerate(columns):
        out[:, k] = column
    return out


def verify_reference(launch: Any, on_invalid: str) -> None:
    ctx = launch.context
    fields = ctx.canary
    num_slots = ctx.num_slots
    if int(launch.enable[0]) == 0:
        ctx.kernel_run_counter[0] += 1
        return
    active = min(max(int(launch.num_valid[0]), 0), launch.capacity)
    slots = launch.slots[:active]
    nonzero = slots != 0
    outside = nonzero & ((slots < 0) | (slots >= num_slots))
    checked = nonzero & ~outside
    if checked.all():  # the common case: no slot-0 padding, nothing out of range; no compaction needed
        idx = None
        s, prevs = slots, launch.prev_slots[:active]
    else:
        idx = np.flatnonzero(checked)
        s, prevs = slots[idx], launch.prev_slots[:active][idx]
    prev_outside = prevs >= num_slots
    status = 0
    if outside.any() or prev_outside.any():
        status = int(CanaryStatus.SLOT_OUT_OF_RANGE)
        if on_invalid == "raise":
            if outside.any():
                k = int(np.argmax(outside))
                fail(f"plan.verify_slot_indices[{k}]={int(slots[k])} is outside canary_buf's {num_slots} slots")
            k = int(np.argmax(prev_outside))
            k = k if idx is None else int(idx[k])
            fail(f"plan.verify_prev_slot_indices[{k}]={int(launch.prev_slots[k])} is outside canary_buf's "
                 f"{num_slots} slots")

    # Stored fields: one gather of whole slot rows (a slot's fields share a cache line), then columns.
    stored = fields.take(s, axis=0)
    stored_token, stored_pos, stored_chain, stored_rkv = (stored[:, f] for f in range(4))

    reachable = (prevs != 0) & ~prev_outside
    expected_chain = chain_hash(fields, np.where(reachable, prevs, -1)).view(np.int64)
    np.copyto(expected_chain, stored_chain, where=~reachable)  # unreachable: the check is skipped
    expected_pos = launch.expected_positions[:active]
    if idx is not None:
        expected_pos = expected_pos[idx]

    bits = np.zeros(s.shape[0], np.int64)
    bits[stored_chain != expected_chain] |= int(FailReason.VERIFY_CHAIN_HASH_MISMATCH)
    bits[stored_pos != expected_pos] |= int(FailReason.VERIFY_POSITION_MISMATCH)
    if ctx.mode and ctx.sources:
        expected_rkv = fold_real_kv(s, ctx.sources, ctx.mode).view(np.int64)
    else:
        expected_rkv = np.zeros(1, np.int64)  # broadcasts: NONE mode, or no sources, expects 0
    bits[stored_rkv != expected_rkv] |= int(FailReason.VERIFY_REAL_KV_HASH_MISMATCH)
    if launch.check_verify_expected_token:
        expected_token = launch.expected_tokens[:active]
        if idx is not None:
            expected_token = expected_token[idx]
        bits[(expected_token != -1) & (stored_token != expected_token)] |= int(FailReason.VERIFY_TOKEN_MISMATCH)
    if launch.twin is not None:  # entries whose words match the twin's got their verdict there
        twin = launch.twin
        same = (fields[s, :4] == twin[s, :4]).all(axis=1) & ~prev_outside
        linked = same & (prevs > 0)
        same[linked] = (fields[prevs[linked], :4] == twin[prevs[linked], :4]).all(axis=1)
        bits[same] = 0
    bad = np.flatnonzero(bits)
    if launch.check_verify_expected_token:
        bad_expected_token = expected_token[bad]
    else:
        bad_expected_token = np.full(bad.shape[0], -1, np.int64)
    rows = _rows([ctx.kernel_kind, s[bad], stored_pos[bad], stored_token[bad], bad_expected_token,
                  stored_chain[bad], expected_chain[bad], bits[bad]], bad.shape[0])

    ctx.kernel_run_counter[0] += 1
    ctx.slot_run_counter[0] += active
    append_violations(ctx, rows)
    ctx.status[0] |= status


def write_reference(launch: Any, on_invalid: str) -> None:
    ctx = launch.context
    num_slots = ctx.num_slots
    num_tokens = int(launch.input_ids.shape[0])
    active = min(max(int(launch.write_num_valid_reqs[0]), 0), launch.write_req_capacity)
    lo = launch.write_offsets[:active]
    hi = launch.write_offsets[1 : active + 1]
    # From the first request whose offsets run backwards on, every request is skipped (CanaryStatus): the
    # ranges written are then disjoint, and the work stays proportional to the tokens passed.
    backwards = hi < lo
    first_backward = int(np.argmax(backwards)) if backwards.any() else active
    has_entries = (hi > lo) & (np.arange(active) < first_backward)  # compared, never subtracted
    range_bad = has_entries & ((lo < 0) | (hi > num_tokens))
    reqs = np.flatnonzero(has_entries & ~range_bad)
    req_lo, req_hi = lo[reqs], hi[reqs]
    seeds = launch.write_seed_slot_indices[reqs]
    seed_outside = seeds >= num_slots
    entries = _entries(launch, req_lo, req_hi)  # at most num_tokens: the ranges are disjoint
    outside = entries[0][entries[2] >= num_slots]  # token indices of out-of-range slots

    status = 0
    if range_bad.any():
        status |= int(CanaryStatus.TOKEN_RANGE_OUT_OF_BOUNDS)
    if backwards.any():
        status |= int(CanaryStatus.WRITE_OFFSETS_OUT_OF_ORDER)
    if seed_outside.any() or outside.size:
        status |= int(CanaryStatus.SLOT_OUT_OF_RANGE)
    if status and on_invalid == "raise":
        if range_bad.any():
            r = int(np.argmax(range_bad))
            fail(f"plan.write_offsets[{r}:{r + 2}]=({int(lo[r])}, {int(hi[r])}) leaves the {num_tokens} "
                 "tokens of input_ids")
        if backwards.any():
            r = first_backward
            fail(f"plan.write_offsets[{r}:{r + 2}]=({int(lo[r])}, {int(hi[r])}) runs backwards (the offsets must "
                 "not decrease: later token ranges could overlap earlier ones)")
        if seed_outside.any():
            r = int(reqs[np.argmax(seed_outside)])
            fail(f"plan.write_seed_slot_indices[{r}]={int(launch.write_seed_slot_indices[r])} is outside "
                 f"canary_buf's {num_slots} slots")
        i = int(outside[0])
        fail(f"out_cache_loc[{i}]={int(launch.out_cache_loc[i])} is outside canary_buf's {num_slots} slots")

    # Nothing raises from here on. An out-of-range seed is treated as a chain head (anchor, no position check).
    seeds = np.where(seed_outside, -1, seeds)
    written = _write_requests(launch, entries, seeds)
    ctx.kernel_run_counter[0] += 1
    ctx.slot_run_counter[0] += written
    ctx.status[0] |= status


def _entries(launch: Any, lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(token index, request, slot) of every entry of requests with token ranges ``[lo, hi)``, in order."""
    counts = hi - lo
    entry_req = np.repeat(np.arange(lo.shape[0]), counts)
    first_entry = np.zeros(lo.shape[0] + 1, np.int64)
    np.cumsum(counts, out=first_entry[1:])
    flat = np.arange(first_entry[-1], dtype=np.int64) - np.repeat(first_entry[:-1] - lo, counts)
    return flat, entry_req, launch.out_cache_loc[flat]


def _write_requests(launch: Any, entries: tuple[np.ndarray, np.ndarray, np.ndarray], seeds: np.ndarray) -> int:
    """Write consecutive requests (their ``entries`` from :func:`_entries`, in-range ``seeds``) in batch order,
    as SGLang's reference does: a request whose seed slot an earlier request of the launch wrote seeds from
    that write. Appends the violation rows; returns the number of entries written."""
    ctx = launch.context
    fields = ctx.canary
    num_slots = ctx.num_slots
    flat, entry_req, slot = entries
    live_idx = np.flatnonzero((slot >= 0) & (slot < num_slots))
    i = flat[live_idx]
    req = entry_req[live_idx]
    s = slot[live_idx]
    token = launch.input_ids[i]
    pos = launch.positions[i]
    n = live_idx.shape[0]
    if n == 0:
        return 0

    # Rank of each live entry among its request's live entries; live entries of one request are adjacent.
    new_req = np.ones(n, bool)
    new_req[1:] = req[1:] != req[:-1]
    starts = np.flatnonzero(new_req)
    rank = np.arange(n, dtype=np.int64) - np.repeat(starts, np.diff(np.append(starts, n)))

    by_slot = np.argsort(s, kind="stable")  # entries of one slot stay in batch order
    s_sorted = s[by_slot]
    dependencies = _seed_dependencies(seeds, s_sorted, req[by_slot], by_slot)

    # The serial part: the running hash before each live entry, all requests advancing together, one
    # vector step per rank. A request that seeds from an earlier request's write in this launch (a double
    # allocation; nearly never) waits for that request: requests run in levels, level 0 seeding from the
    # canary as it was, level L + 1 from the writes of level L.
    running = chain_hash(fields, seeds)
    seed_pos = fields[np.maximum(seeds, 0), 1]
    prev_hash = np.empty(n, np.uint64)
    if dependencies is None:
        _advance(np.argsort(rank, kind="stable"), rank, req, token, pos, running, prev_hash)
    else:
        level, dependency = dependencies
        entry_level = level[req]
        order = np.lexsort((rank, entry_level))
        level_bounds = np.searchsorted(entry_level[order], np.arange(int(level.max()) + 2))
        req_order = np.argsort(level, kind="stable")
        req_bounds = np.searchsorted(level[req_order], np.arange(int(level.max()) + 2))
        for lvl in range(level_bounds.shape[0] - 1):
            if lvl:
                waiting = req_order[req_bounds[lvl]:req_bounds[lvl + 1]]
                source = dependency[waiting]  # the entry that last wrote the seed slot before the request
                running[waiting] = mix3(prev_hash[source], token[source].view(np.uint64),
                                        pos[source].view(np.uint64))
                seed_pos[waiting] = pos[source]
            _advance(order[level_bounds[lvl]:level_bounds[lvl + 1]], rank, req, token, pos, running, prev_hash)
    prev_hash_i64 = prev_hash.view(np.int64)

    rkv = fold_real_kv(s, ctx.sources, ctx.mode).view(np.int64)

    # Violation rows in (entry, input-assert before chain-position) order.
    keys, blocks = [], []
    if launch.enable_write_input_assert:
        expected_token = launch.expected_input_tokens[i]
        expected_pos = launch.expected_input_positions[i]
        bits = np.where(token != expected_token, int(FailReason.WRITE_TOKEN_MISMATCH), 0)
        bits |= np.where(pos != expected_pos, int(FailReason.WRITE_POSITION_MISMATCH), 0)
        bad = np.flatnonzero(bits)
        keys.append(2 * bad)
        blocks.append(_rows([ctx.kernel_kind, s[bad], pos[bad], token[bad], expected_token[bad],
                             prev_hash_i64[bad], expected_pos[bad], bits[bad]], bad.shape[0]))
    chain_check = (seeds >= 0) & (int(ctx.chain_assert[0]) != 0)
    if chain_check.any():
        before = np.empty(n, np.int64)
        before[1:] = pos[:-1]
        before[new_req] = seed_pos[req[new_req]]
        want = before + 1  # int64 wrap-around, as the kernels' unsigned arithmetic
        bad = np.flatnonzero(chain_check[req] & (pos != want))
        keys.append(2 * bad + 1)
        blocks.append(_rows([ctx.kernel_kind, s[bad], pos[bad], token[bad], token[bad], prev_hash_i64[bad],
                             want[bad], int(FailReason.WRITE_POSITION_MISMATCH)], bad.shape[0]))
    if blocks:
        rows = np.concatenate(blocks)
        rows = rows[np.argsort(np.concatenate(keys), kind="stable")]
    else:
        rows = np.empty((0, 8), np.int64)

    # A slot written twice keeps its last write (batch order); NumPy does not promise which of two
    # assignments to one element of a fancy index wins, so only the last of each slot is assigned.
    last = np.ones(n, bool)
    last[:-1] = s_sorted[1:] != s_sorted[:-1]
    if not last.all():
        keep = by_slot[last]
        s, token, pos, prev_hash_i64, rkv = s[keep], token[keep], pos[keep], prev_hash_i64[keep], rkv[keep]
    fields[s, 0] = token
    fields[s, 1] = pos
    fields[s, 2] = prev_hash_i64
    fields[s, 3] = rkv
    append_violations(ctx, rows)
    return n


def _advance(entries: np.ndarray, rank: np.ndarray, req: np.ndarray, token: np.ndarray, pos: np.ndarray,
             running: np.ndarray, prev_hash: np.ndarray) -> None:
    """Chain ``entries`` (sorted by rank) forward: ``prev_hash`` of each entry, ``running`` per request."""
    if entries.size == 0:
        return
    step_bounds = np.searchsorted(rank[entries], np.arange(int(rank[entries[-1]]) + 2))
    for step in range(step_bounds.shape[0] - 1):
        sel = entries[step_bounds[step]:step_bounds[step + 1]]
        r = req[sel]
        prev_hash[sel] = running[r]
        running[r] = mix3(running[r], token[sel].view(np.uint64), pos[sel].view(np.uint64))


def _seed_dependencies(seeds: np.ndarray, s_sorted: np.ndarray, req_sorted: np.ndarray,
                       by_slot: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """For requests in batch order: ``level`` (0 when no earlier request of the launch writes the request's
    seed slot, else one more than the level of the last request that does) and ``dependency`` (that last
    write's entry index, -1 at level 0); None when every request is at level 0. ``s_sorted`` and
    ``req_sorted`` are the written slots and their requests sorted by slot, batch order kept within a slot;
    ``by_slot`` maps them back to entry indices."""
    nreq = seeds.shape[0]
    at = np.searchsorted(s_sorted, seeds)
    probe = np.minimum(at, s_sorted.shape[0] - 1)
    # The first write of a slot is by its earliest writer: the seed is written earlier iff that one precedes.
    earlier = (seeds >= 0) & (s_sorted[probe] == seeds) & (req_sorted[probe] < np.arange(nreq))
    if not earlier.any():
        return None
    level = np.zeros(nreq, np.int64)
    dependency = np.full(nreq, -1, np.int64)
    for q in np.flatnonzero(earlier).tolist():  # rare: a double allocation, or a hostile plan
        first = int(at[q])
        stop = int(np.searchsorted(s_sorted, seeds[q], side="right"))
        j = first + int(np.searchsorted(req_sorted[first:stop], q)) - 1  # the last write before request q
        dependency[q] = by_slot[j]
        level[q] = level[req_sorted[j]] + 1
    return level, dependency


def scatter_reference(launch: Any, on_invalid: str) -> None:
    pool = launch.pool_out
    rows, width = pool.shape
    total = int(launch.flat_in.shape[0])
    start = launch.offsets[:-1]
    end = launch.offsets[1:]
    rp = launch.req_pool_indices
    nonempty = end > start
    bad = nonempty & ((rp < 0) | (rp >= rows) | (start < 0) | (end > total))
    if bad.any() and on_invalid == "raise":
        r = int(np.argmax(bad))
        fail(f"request {r}: req_pool_indices[{r}]={int(rp[r])} with offsets[{r}:{r + 2}]=({int(start[r])}, "
             f"{int(end[r])}) lies outside pool_out {tuple(pool.shape)} or flat_in ({total} tokens)")
    good = np.flatnonzero(nonempty & ~bad)
    n = np.minimum(end[good] - start[good], width)
    # Requests sharing a row overwrite each other in batch order: a request keeps only the columns no later
    # request of its row rewrites, [max n of the later ones, n). The copy then touches each pool element at
    # most once, so it stays within the pool's size whatever the offsets (they may overlap or repeat).
    order = np.lexsort((-good, rp[good]))  # by row, later requests first
    row_sorted = rp[good][order]
    # Running max of n within each row, as one maximum.accumulate: rows are made disjoint by adding
    # row * (width + 1), which stays below the pool's element count plus its row count.
    key = row_sorted * (width + 1) + n[order]
    later_max = np.empty_like(key)
    if key.shape[0]:
        later_max[0] = row_sorted[0] * (width + 1)
        np.maximum.accumulate(key[:-1], out=later_max[1:])
        later_max[1:] = np.maximum(later_max[1:], row_sorted[1:] * (width + 1))
    kept_from = np.empty_like(n)
    kept_from[order] = later_max - row_sorted * (width + 1)
    begin = np.minimum(kept_from, n)
    keep = n - begin
    first = np.zeros(good.shape[0] + 1, np.int64)
    np.cumsum(keep, out=first[1:])
    within = np.arange(first[-1], dtype=np.int64) - np.repeat(first[:-1] - begin, keep)
    dest = np.repeat(rp[good] * width, keep) + within
    src = np.repeat(start[good], keep) + within
    # int64 -> int32 two's-complement truncation, spelled out so it never depends on cast rules.
    pool.reshape(-1)[dest] = (launch.flat_in[src] & 0xFFFFFFFF).astype(np.uint32).view(np.int32)
    if bad.any() and launch.status is not None:
        launch.status[0] |= int(CanaryStatus.SCATTER_OUT_OF_RANGE)
