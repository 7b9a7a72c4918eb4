"""The layout-independent tail of the NumPy plan step, shared by the token table (:mod:`.numpy_plan`) and the
paged layouts (:mod:`.numpy_paged`): SWA translation of seeds and slots, the owner and position of every flat
entry, predecessors, expected tokens and neutralisation of flagged entries.

It imports neither of the two layout modules, so both can import it without a circle.
"""

from __future__ import annotations

import numpy as np

from ..constants import PlanStatus
from .workspace import workspace


def translate(raw: np.ndarray, lut: np.ndarray, out: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """SWA translation T: negatives pass through, others index the LUT. Returns (values, outside_lut)."""
    size = lut.shape[0]
    outside = raw >= size
    if raw.size and raw.min() >= 0 and not outside.any():
        if out is None:
            return lut[raw], outside
        np.take(lut, raw, out=out, mode="clip")
        return out, outside
    return np.where(raw < 0, raw, lut[np.clip(raw, 0, size - 1)]), outside


def pool_rows_of(launch) -> np.ndarray:
    """The expected-token pool row of every batch row: ``req_pool_indices``, or the batch row without it."""
    rpi = launch.req_pool_indices
    return np.arange(launch.bs, dtype=np.int64) if rpi is None else rpi


def translate_seeds(seeds: np.ndarray, seed_reqs: np.ndarray, seed_raw: np.ndarray, lut: np.ndarray | None,
                    flag, describe) -> None:
    """seeds[seed_reqs] = T(seed_raw); a raw value outside the LUT flags and leaves -1 (``describe(k)``
    names the k-th raw value for the message)."""
    if lut is None:
        seeds[seed_reqs] = seed_raw
        return
    seed_vals, outside = translate(seed_raw, lut)
    if outside.any():
        k = int(np.argmax(outside))
        flag(PlanStatus.SWA_SLOT_OUTSIDE_LUT,
             f"{describe(k)}={int(seed_raw[k])} is outside full_to_swa_index_mapping (length {lut.shape[0]})")
        seed_vals = np.where(outside, -1, seed_vals)
    seeds[seed_reqs] = seed_vals


def owner_of(verify_offsets: np.ndarray, k: int) -> int:
    """Batch row owning flat entry ``k``: the largest r with verify_offsets[r] <= k."""
    bs = verify_offsets.shape[0] - 1
    return int(np.searchsorted(verify_offsets[:bs], k, side="right")) - 1


def owners_and_positions(counts, window_start, verify_offsets) -> tuple[np.ndarray, np.ndarray]:
    """Per entry (workspace arrays): the batch row owning it and its logical position."""
    bs = verify_offsets.shape[0] - 1
    total = int(verify_offsets[bs])
    first = verify_offsets[:bs]
    ws = workspace()
    # owner[k]: the batch row of entry k. Per-entry values are then small-table gathers through it.
    owner = ws.repeat("owner", np.arange(bs, dtype=np.int64), counts, first, total)
    pos = ws.array("pos", total, np.int64)
    np.take(first - window_start, owner, out=pos, mode="clip")
    np.subtract(ws.arange(total), pos, out=pos)
    return owner, pos


def finish_entries(launch, verify_offsets, counts, owner, window_start, pos, slot, head_prev, ok, flag, describe):
    """The layout-independent rest of the entries: SWA translation of every slot and predecessor, the
    predecessors themselves, expected tokens and neutralisation of every entry whose ``ok`` is False.

    ``slot``: raw int64 slot per entry (a workspace array, modified in place); ``head_prev``: raw slot before
    each request's window (-1 at position 0); ``ok``: None or a per-entry mask of the layout's own checks;
    ``describe(r, p)`` names the raw slot of batch row r at position p for messages.
    """
    lut = launch.full_to_swa_index_mapping
    bs = verify_offsets.shape[0] - 1
    total = int(verify_offsets[bs])
    first = verify_offsets[:bs]
    has = counts > 0
    heads = first[has]
    ws = workspace()
    if lut is not None:
        slot, slot_outside = translate(slot, lut, ws.array("slot_lut", total, np.int64))
        head_prev, head_outside = translate(head_prev, lut)
        outside = slot_outside.copy()
        outside[1:] |= slot_outside[:-1]
        outside[heads] = slot_outside[heads] | head_outside
        if ok is not None:
            outside &= ok
        if outside.any():
            k = int(np.argmax(outside))
            r = owner_of(verify_offsets, k)
            p = int(pos[k])
            at = p if slot_outside[k] else p - 1
            flag(PlanStatus.SWA_SLOT_OUTSIDE_LUT,
                 f"{describe(r, at)} is outside full_to_swa_index_mapping (length {lut.shape[0]})")
            ok = ~outside if ok is None else ok & ~outside
    prev = ws.array("prev", total, np.int64)
    prev[1:] = slot[:-1]
    prev[heads] = head_prev

    if launch.req_to_verify_expected_tokens is None:
        tokens = ws.array("tokens", total, np.int64)
        tokens.fill(-1)
    else:
        tokens, ok = _expected_tokens(launch, verify_offsets, counts, owner, window_start, pos, ok, flag)
    if ok is not None:
        bad = ~ok
        slot[bad] = 0
        prev[bad] = 0
        tokens[bad] = -1
    return slot, tokens, pos, prev


def _expected_tokens(launch, verify_offsets, counts, owner, window_start, pos, ok, flag):
    """pool[rp, pos + offset] where 0 <= pos + offset < valid_lens[r], else -1; bounds-checked."""
    pool = launch.req_to_verify_expected_tokens
    rpi = pool_rows_of(launch)
    offset = launch.kv_token_id_vs_position_offset
    valid_lens = np.maximum(launch.req_to_verify_expected_tokens_valid_lens, 0)
    pool_rows, pool_width = pool.shape
    bs = rpi.shape[0]
    total = pos.shape[0]
    first = verify_offsets[:bs]
    ws = workspace()
    pool_flat = pool.reshape(-1) if pool.size else np.zeros(1, np.int32)
    sot = ws.array("sot", total, np.int64)
    np.add(pos, offset, out=sot)
    # Unsigned compare: a negative source position is never wanted (valid_lens >= 0 here).
    limit = ws.array("limit", total, np.int64)
    np.take(valid_lens, owner, out=limit, mode="clip")
    unwanted = ws.array("unwanted", total, np.bool_)
    np.greater_equal(sot.view(np.uint64), limit.view(np.uint64), out=unwanted)
    if ok is None:
        # Per request, the wanted source positions form one range [lo, hi): check it instead of each entry.
        lo = np.maximum(window_start + offset, 0)
        hi = np.minimum(np.maximum(launch.prefix_lens, 0) + offset, valid_lens)
        reads = (counts > 0) & (hi > lo)
        if not (reads & ((rpi < 0) | (rpi >= pool_rows) | (hi > pool_width))).any():
            source = ws.array("source", total, np.int64)
            np.take(np.where(reads, rpi, 0) * pool_width + window_start + offset - first, owner, out=source,
                    mode="clip")
            np.add(ws.arange(total), source, out=source)
            gathered = ws.array("gathered", total, np.int32)
            np.take(pool_flat, source, out=gathered, mode="clip")  # unwanted entries may point anywhere
            tokens = ws.array("tokens", total, np.int64)
            np.copyto(tokens, gathered)
            np.copyto(tokens, -1, where=unwanted)
            return tokens, ok
    wanted = ~unwanted if ok is None else ~unwanted & ok
    req_rp = np.repeat(rpi, counts)
    outside = wanted & ((req_rp < 0) | (req_rp >= pool_rows) | (sot >= pool_width))
    if outside.any():
        k = int(np.argmax(outside))
        r = owner_of(verify_offsets, k)
        flag(PlanStatus.EXPECTED_TOKEN_BEYOND_POOL_ROW,
             f"req_to_verify_expected_tokens_valid_lens[{r}]="
             f"{int(launch.req_to_verify_expected_tokens_valid_lens[r])} makes position {int(pos[k])} "
             f"read req_to_verify_expected_tokens[{int(req_rp[k])}, {int(sot[k])}], outside its shape "
             f"{tuple(pool.shape)}")
        wanted &= ~outside
        ok = ~outside if ok is None else ok & ~outside
    tokens = np.full(total, -1, np.int64)
    tokens[wanted] = pool_flat[req_rp[wanted] * pool_width + sot[wanted]]
    return tokens, ok
