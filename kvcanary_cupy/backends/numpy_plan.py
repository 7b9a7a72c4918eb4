"""The vectorized NumPy reference of the plan step (SPEC §3.3), bit for bit what the kernels produce.

No Python loop runs over requests or entries: per-request quantities are bs-sized array expressions and the
flat verify entries come from one ``np.repeat`` of per-request bases. Results are computed into temporaries
first; only when every check passed (or ``on_invalid="flag"``) are the caller's buffers written, so a call
that raises leaves every output byte as it was.

Device-value checks follow :class:`~kvcanary_cupy.constants.PlanStatus`: per entry, in order, request row,
position inside the ``req_to_token`` row, LUT coverage, expected-token pool bounds; the first failing check
sets its bit and neutralises the entry to (slot 0, expected -1, position, prev 0). Seeds check the first
three and become -1. Entry checks run only when entries are written (no overflow). The paged layouts' own
gathers and checks live in :mod:`.numpy_paged`; everything after the raw slots is shared with them in
:mod:`.numpy_plan_entries`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .._errors import fail
from ..constants import PlanStatus
from . import numpy_paged
from .numpy_plan_entries import finish_entries, owner_of, owners_and_positions, translate_seeds
from .workspace import workspace


@dataclass
class _PlanResult:
    verify_offsets: np.ndarray  # int64 [bs+1], saturated counts
    total: int
    entries: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None  # slot, token, position, prev
    write_offsets: np.ndarray  # int64 [bs+1]
    seeds: np.ndarray  # int64 [bs]
    status: int
    problem: str  # description of the first problem of the lowest status bit, "" when status == 0


def compute_plan(launch) -> _PlanResult:
    rpi = launch.req_pool_indices
    prefix = launch.prefix_lens
    extend = launch.extend_seq_lens
    window = launch.swa_window_size
    capacity = launch.verify_capacity
    bs = launch.bs
    status = 0
    problems: dict[int, str] = {}

    def flag(bit: PlanStatus, message: str) -> None:
        nonlocal status
        status |= int(bit)
        problems.setdefault(int(bit), message)

    # --- per-request counts and offsets ---------------------------------------------------------------
    # Without req_pool_indices there is no padding sentinel: rows with nothing to do contribute nothing.
    active = np.ones(bs, np.bool_) if rpi is None else rpi != 0
    clamped_prefix = np.maximum(prefix, 0)
    counts = np.minimum(clamped_prefix, window) if window > 0 else clamped_prefix.copy()
    counts[~active] = 0
    window_start = clamped_prefix - counts
    # Saturating at C+1 keeps the sum far from int64 overflow and changes nothing observable: a request
    # that large already forces overflow, and then no entry is written.
    counts = np.minimum(counts, capacity + 1)
    verify_offsets = np.zeros(bs + 1, np.int64)
    np.cumsum(counts, out=verify_offsets[1:])
    total = int(verify_offsets[bs])

    # Write offsets wrap modulo 2**64 exactly as the kernels' unsigned sums do.
    write_counts = np.where(active, np.maximum(extend, 0), 0)
    write_offsets = np.zeros(bs + 1, np.uint64)
    np.cumsum(write_counts.view(np.uint64), out=write_offsets[1:])
    write_offsets = write_offsets.view(np.int64)

    needs_seed = active & (extend > 0) & (prefix > 0)
    if launch.paged is not None:
        if total <= capacity:
            seeds, entries = numpy_paged.seeds_and_entries(launch, needs_seed, counts, window_start, verify_offsets,
                                                           flag)
        else:
            seeds, entries = numpy_paged.seeds(launch, needs_seed, flag), None
    else:
        seeds, entries = _token_seeds_and_entries(launch, needs_seed, counts, window_start, verify_offsets,
                                                  flag)
    problem = problems[min(problems)] if problems else ""
    return _PlanResult(verify_offsets, total, entries, write_offsets, seeds, status, problem)


def _token_seeds_and_entries(launch, needs_seed, counts, window_start, verify_offsets, flag):
    rpi = launch.req_pool_indices
    prefix = launch.prefix_lens
    rtt = launch.req_to_token
    rows, width = rtt.shape
    row_ok = (rpi >= 0) & (rpi < rows)

    # --- seeds ------------------------------------------------------------------------------------------
    seeds = np.full(rpi.shape[0], -1, np.int64)
    bad_row = needs_seed & ~row_ok
    if bad_row.any():
        r = int(np.argmax(bad_row))
        flag(PlanStatus.REQ_POOL_INDEX_OUT_OF_RANGE,
             f"req_pool_indices[{r}]={int(rpi[r])} is outside req_to_token's {rows} rows")
    beyond = needs_seed & row_ok & (prefix > width)
    if beyond.any():
        r = int(np.argmax(beyond))
        flag(PlanStatus.PREFIX_BEYOND_REQ_TO_TOKEN_ROW,
             f"{launch.prefix_name}[{r}]={int(prefix[r])} reaches beyond req_to_token's row width {width}")
    seed_reqs = np.flatnonzero(needs_seed & row_ok & (prefix <= width))
    seed_raw = rtt[rpi[seed_reqs], prefix[seed_reqs] - 1].astype(np.int64)
    translate_seeds(seeds, seed_reqs, seed_raw, launch.full_to_swa_index_mapping, flag,
                    lambda k: f"req_to_token[{int(rpi[seed_reqs[k]])}, {int(prefix[seed_reqs[k]]) - 1}]")

    # --- entries ----------------------------------------------------------------------------------------
    entries = None
    if int(verify_offsets[-1]) <= launch.verify_capacity:
        entries = _entries(launch, counts, window_start, verify_offsets, row_ok, flag)
    return seeds, entries


def _entries(launch, counts, window_start, verify_offsets, row_ok, flag):
    """(slot, expected token, position, prev slot) of every entry; ``counts`` are exact here (no overflow).

    The common case, where every gather is in bounds, takes a fast path: one gather from ``req_to_token``
    per entry, predecessors read off the previous entry of the same request (entries of a request are
    consecutive positions of one row), one clipped gather from the pool, all into workspace arrays. Any
    out-of-range request sends the batch through per-entry masks instead. The arrays returned may live in
    the thread's workspace: copy them out before the next reference call.
    """
    rpi = launch.req_pool_indices
    prefix = launch.prefix_lens
    rtt = launch.req_to_token
    rows, width = rtt.shape
    bs = rpi.shape[0]
    total = int(verify_offsets[bs])
    first = verify_offsets[:bs]
    has = counts > 0
    ws = workspace()
    index = ws.arange(total)
    owner, pos = owners_and_positions(counts, window_start, verify_offsets)

    ok = None  # None: no entry neutralised so far
    bad_row = has & ~row_ok
    beyond = has & row_ok & (prefix > width)
    # An empty table gets a 1-element stand-in: neutralised entries gather index 0.
    rtt_flat = rtt.reshape(-1) if rtt.size else np.zeros(1, np.int32)
    if bad_row.any() or beyond.any():
        bad_row_e = np.repeat(bad_row, counts)
        beyond_e = ~bad_row_e & (pos >= width)
        ok = ~(bad_row_e | beyond_e)
        if bad_row_e.any():
            r = owner_of(verify_offsets, int(np.argmax(bad_row_e)))
            flag(PlanStatus.REQ_POOL_INDEX_OUT_OF_RANGE,
                 f"req_pool_indices[{r}]={int(rpi[r])} is outside req_to_token's {rows} rows")
        if beyond_e.any():
            r = owner_of(verify_offsets, int(np.argmax(beyond_e)))
            flag(PlanStatus.PREFIX_BEYOND_REQ_TO_TOKEN_ROW,
                 f"{launch.prefix_name}[{r}]={int(prefix[r])} reaches beyond req_to_token's row width {width}")
        flat = np.where(ok, np.repeat(np.where(row_ok, rpi, 0) * width, counts) + pos, 0)
    else:
        flat = ws.array("flat", total, np.int64)
        np.take(np.where(has, rpi, 0) * width + window_start - first, owner, out=flat, mode="clip")
        np.add(index, flat, out=flat)
    raw = ws.array("raw", total, np.int32)
    np.take(rtt_flat, flat, out=raw, mode="clip")  # in bounds; "clip" only avoids the buffered "raise" mode
    slot = ws.array("slot", total, np.int64)
    np.copyto(slot, raw)

    # Predecessors: the previous entry, except at each request's first entry, whose predecessor is the
    # slot just before the window (or -1 at position 0): the window does not reset the chain.
    head_reqs = np.flatnonzero(has)
    head_ws = window_start[head_reqs]
    head_prev = np.full(head_reqs.shape[0], -1, np.int64)
    readable = (head_ws > 0) & row_ok[head_reqs] & (head_ws <= width)
    head_prev[readable] = rtt[rpi[head_reqs[readable]], head_ws[readable] - 1]
    return finish_entries(launch, verify_offsets, counts, owner, window_start, pos, slot, head_prev, ok, flag,
                          lambda r, at: f"req_to_token[{int(rpi[r])}, {at}]={int(rtt[rpi[r], at])}")


def plan_reference(launch, on_invalid: str) -> None:
    """Fill the launch's plan buffers in place; with ``on_invalid="raise"`` refuse flagged inputs first."""
    result = compute_plan(launch)
    if result.status and on_invalid == "raise":
        fail(result.problem)
    vp, wp = launch.verify, launch.write
    bs = result.seeds.shape[0]
    capacity = launch.verify_capacity
    if result.entries is not None and result.total:
        slot, tokens, pos, prev = result.entries
        n = result.total
        vp.verify_slot_indices[:n] = slot
        vp.verify_expected_tokens[:n] = tokens
        vp.verify_expected_positions[:n] = pos
        vp.verify_prev_slot_indices[:n] = prev
    vp.verify_num_valid[0] = min(result.total, capacity)
    vp.enable[0] = 1 if result.total <= capacity else 0
    vp.status[0] = result.status
    wp.write_offsets[: bs + 1] = result.write_offsets
    wp.write_offsets[bs + 1 :] = 0
    wp.write_seed_slot_indices[:bs] = result.seeds
    wp.write_num_valid_reqs[0] = bs
    wp.verify_offsets[: bs + 1] = result.verify_offsets
