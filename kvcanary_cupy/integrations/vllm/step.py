"""One runner step read as the canary's plan inputs (:class:`VllmStep`, built by :func:`build_step`), and the
running requests' token histories kept between steps (:class:`RequestHistories`).

A step is read from the forward's own tensors (``input_ids``, ``positions``) and the attention metadata
(``query_start_loc``, ``seq_lens``, ``block_table``, ``slot_mapping``), copied out of vLLM's reused buffers before
the forward, with array operations over the whole batch. The expected tokens come from the runner's request state
(``prompt_token_ids + output_token_ids``), never from the batch; what a request's state gained since the last step
(one token per decoding request) is all a step copies of it. Under speculative decoding a row's last tokens are
the scheduler's draft tokens (``SchedulerOutput.scheduled_spec_decode_tokens``): their expected ids come from
that list, and their positions are provisional (:func:`with_drafts`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from ..._errors import fail
from ..common.state import host_array
from .metadata import attention_metadata

__all__ = ["RequestHistories", "VllmStep", "build_step"]


class GroupGeometry(Protocol):
    """What a step reads of one KV cache group's geometry (:class:`.canary.GroupGeometry`; a protocol here, so
    that this module does not import the one that imports it)."""

    index: int
    block_size: int
    layer_names: list[str]
    window: int  # vLLM's sliding window of the group (0: full attention)

    def window_starts(self, query_starts: np.ndarray) -> np.ndarray: ...

    def slots_of(self, blocks: list[int] | np.ndarray, length: int, start: int = 0) -> np.ndarray: ...


@dataclass
class VllmStep:
    """One runner step as the canary's plan inputs (copied out of vLLM's reused buffers before the forward)."""

    step: int
    request_ids: list[str]
    rows: np.ndarray  # int64 [B]: 1..B
    prefix_lens: np.ndarray  # int64 [B]
    extend_lens: np.ndarray  # int64 [B]
    input_ids: np.ndarray  # int64 [T]
    positions: np.ndarray  # int64 [T]
    expected_input_ids: np.ndarray  # int64 [T]
    expected_positions: np.ndarray  # int64 [T]
    history_ids: np.ndarray  # int64 [sum(valid_lens)]: each row's expected history, one after the other
    valid_lens: np.ndarray  # int64 [B]
    block_tables: dict[int, np.ndarray]  # group index -> int32 [B, max_blocks] (copy of the metadata's)
    slot_mappings: dict[int, np.ndarray]  # group index -> int64 [T']: the canary's out_cache_loc
    source_index: np.ndarray  # int64 [T']: the forward's token behind each canary token, -1 for a re-stamp
    forward_tokens: int  # tokens of the forward the canary stamps this step (all but those of deferred rows)
    restamped: bool  # some canary token is a re-stamp (the canary's token order is not the forward's)
    forward_len: int = 0  # tokens the forward received (the metadata's slot mapping is read up to here)
    deferred: dict[str, int] = field(default_factory=dict)  # request -> first position left unstamped
    # int64 [B]: each row's tokens that are accepted (its history without this step's draft tokens); None: all
    confirmed_lens: np.ndarray | None = None

    @property
    def accepted_lens(self) -> np.ndarray:
        """Each row's tokens that stay whatever the sampler accepts: all it schedules but its draft tokens, whose
        positions are provisional (rewritten by the next step from the first rejected one on)."""
        return self.valid_lens if self.confirmed_lens is None else self.confirmed_lens
    # int64 [B]: each row's first query position in the forward (a sliding-window group's window starts
    # ``window - 1`` before it); equal to ``prefix_lens`` except for rows with re-stamps or deferred ones
    query_starts: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))

    def canary_tokens(self, forward_values: np.ndarray, restamp_values: np.ndarray) -> np.ndarray:
        """A per-token array of the forward (``[T]``) in the canary's token order, re-stamped tokens taken from
        ``restamp_values`` (``[T']``); without re-stamps and deferred rows that order is the forward's, and
        ``forward_values`` comes back as it is."""
        if not self.restamped and not self.deferred:
            return forward_values
        out = restamp_values.copy()
        real = self.source_index >= 0
        out[real] = forward_values[self.source_index[real]]
        return out

    @property
    def size(self) -> int:
        return len(self.request_ids)

    @property
    def expected_pool(self) -> np.ndarray:
        """int32 ``[B+1, width]``: row ``i + 1`` holds row ``i``'s history (row 0 the padding sentinel)."""
        b = self.size
        width = max(int(self.valid_lens.max()) if b else 0, 1)
        pool = np.zeros((b + 1, width), np.int32)
        pool[1:][np.arange(width)[None, :] < self.valid_lens[:, None]] = self.history_ids
        return pool

    def slot(self, geo: GroupGeometry, i: int, position: int) -> int:
        """The slot of ``position`` of batch row ``i`` in group ``geo`` (from this step's block table)."""
        block = int(self.block_tables[geo.index][i, position // geo.block_size])
        return block * geo.block_size + position % geo.block_size


@dataclass
class _Kept:
    state: Any  # the CachedRequestState the history was read from
    prompt: Any  # its prompt_token_ids object
    output: Any  # its output_token_ids object
    tokens: np.ndarray  # int64, capacity >= filled
    filled: int  # tokens of ``tokens`` that hold the history
    prompt_len: int


class RequestHistories:
    """Each request's token history (prompt then output ids) as an int64 array, kept between steps.

    A step copies in only the output tokens a request's state gained since the step before. An entry is read
    afresh whenever it may not be a prefix of the state any more: another state object under the request's id
    (the request was added again), another prompt or output list object (vLLM rebuilds the output list of a
    request resumed under async scheduling), fewer output tokens than kept, or a last kept output token that
    differs from the state's (a placeholder replaced in place). Entries of requests not in the step are dropped.
    """

    def __init__(self) -> None:
        self._kept: dict[str, _Kept] = {}

    def __len__(self) -> int:
        return len(self._kept)

    def history(self, rid: str, state: Any, end: int) -> np.ndarray:
        """The first ``end`` tokens of request ``rid``'s history (a view, valid until the next call for it)."""
        prompt, output = state.prompt_token_ids, state.output_token_ids
        if prompt is None:
            fail(f"request {rid} has no prompt token ids (prompt embeddings are not supported)")
        kept = self._kept.get(rid)
        n_out = len(output)
        if (kept is None or kept.state is not state or kept.prompt is not prompt or kept.output is not output
                or len(prompt) != kept.prompt_len or n_out < kept.filled - kept.prompt_len
                or (kept.filled > kept.prompt_len
                    and output[kept.filled - kept.prompt_len - 1] != kept.tokens[kept.filled - 1])):
            n_prompt = len(prompt)
            tokens = np.empty(max(64, 2 * (n_prompt + n_out)), np.int64)
            tokens[:n_prompt] = prompt
            kept = self._kept[rid] = _Kept(state, prompt, output, tokens, n_prompt, n_prompt)
        have = kept.filled - kept.prompt_len
        if n_out > have:
            total = kept.prompt_len + n_out
            if total > kept.tokens.shape[0]:
                grown = np.empty(2 * total, np.int64)
                grown[: kept.filled] = kept.tokens[: kept.filled]
                kept.tokens = grown
            kept.tokens[kept.filled: total] = output[have:]
            kept.filled = total
        if kept.filled < end:
            fail(f"request {rid} schedules positions up to {end} but its state holds {kept.filled} tokens "
                 "(async scheduling is not supported: use async_scheduling=False)")
        return kept.tokens[:end]

    def keep_only(self, ids: list[str]) -> None:
        """Drop the entries of requests not in ``ids`` (finished, or not scheduled in this step)."""
        if len(self._kept) > len(ids):
            wanted = set(ids)
            for rid in [r for r in self._kept if r not in wanted]:
                del self._kept[rid]


def _host(tensor: Any) -> np.ndarray:
    """A CPU tensor of the runner as a NumPy view (one torch call; the runner is refused at install unless its
    caches are on the CPU), anything else through :func:`host_array`."""
    try:
        return tensor.numpy()
    except (RuntimeError, TypeError):
        return host_array(tensor)


def _row_of_token(extend: np.ndarray, t: int) -> np.ndarray:
    """The batch row of each of the step's ``t`` tokens (rows are request-major runs of ``extend`` tokens)."""
    return np.repeat(np.arange(extend.shape[0], dtype=np.int64), extend) if t else np.zeros(0, np.int64)


def with_drafts(histories: RequestHistories, ids: list[str], requests: Any, ends: np.ndarray, extend: np.ndarray,
                drafts: Mapping[str, Sequence[int]]) -> tuple[list[np.ndarray], np.ndarray]:
    """Each row's expected history up to ``ends`` when some rows end in draft tokens (``drafts``: the scheduler's
    draft tokens of this step, per request; at most the row's ``extend`` new tokens are drafts, the first of a
    longer list), and each row's accepted length.

    A row with ``d`` draft tokens schedules its last sampled token and the ``d`` drafts after it: its request
    state holds the tokens up to ``ends - d``, the drafts are what the scheduler proposed for the positions
    after. The forward writes their K/V and the canary stamps them like any token (an accepted draft is the
    token the sampler keeps, its K/V the target model's); from the first rejected draft on, the next step
    schedules those positions again and its write replaces both the K/V and the records. Until then they are
    provisional: never indexed for the sweep (a block is complete only with accepted tokens), never verified
    (the next step's prefix ends at the last accepted token)."""
    parts: list[np.ndarray] = []
    confirmed = ends.copy()
    for i, (rid, end, new) in enumerate(zip(ids, ends.tolist(), extend.tolist(), strict=True)):
        draft = drafts.get(rid) or ()
        d = min(len(draft), int(new))
        history = histories.history(rid, requests[rid], int(end) - d)
        if d:
            history = np.concatenate([history, np.asarray(list(draft)[:d], np.int64)])
            confirmed[i] = end - d
        parts.append(history)
    return parts, confirmed


def _same_step_rows(prefix: np.ndarray, tables: dict[int, np.ndarray], forward_slots: dict[int, np.ndarray],
                    geos: Sequence[GroupGeometry]) -> np.ndarray:
    """The rows some of whose verified prefix blocks (from the block of ``window_start`` to ``prefix - 1``, in
    some group) the forward writes in this very step, for every row at once; a superset (a block written in
    part counts whole) that :func:`_with_restamps` narrows to slots. Only a row whose prefix ends at a block
    boundary in every group can have one: vLLM shares whole blocks only, so a prefix hit is a whole number of
    blocks, and a row that owns its last, partly filled block writes its own tokens there (anything else
    writing there is a fault the verify sees). Most steps: no such row, or a few; they are looked up as Python
    ints against the set of blocks the step writes (array operations on a handful of values cost more)."""
    sizes = [geo.block_size for geo in geos]
    ends = prefix.tolist()
    rows = [i for i, p in enumerate(ends) if p > 0 and all(p % bs == 0 for bs in sizes)]
    found: list[int] = []
    for geo in geos:
        if len(found) == len(rows):
            break
        written = forward_slots[geo.index]
        table = tables[geo.index]
        if not written.size or not table.shape[1]:
            continue
        bs = geo.block_size
        blocks = set(np.unique(written // bs).tolist())
        for i in rows:
            if i in found:
                continue
            lo = int(geo.window_starts(prefix[i : i + 1])[0]) // bs if geo.window else 0
            if any(block > 0 and block in blocks for block in table[i, lo : ends[i] // bs].tolist()):
                found.append(i)
    return np.array(sorted(found), np.int64)


def _legit_same_step(geo: GroupGeometry, table_row: np.ndarray, past: int, history: np.ndarray,
                     written: np.ndarray, order: np.ndarray, positions: np.ndarray,
                     input_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Of a row's prefix positions ``0 .. past - 1`` in ``geo``: those whose slot the forward writes in this step
    with the same position and the row's own token there (a same-step prefix hit: the row's records are those
    the writing row stamps) and those it writes with anything else (a fault the verify must see). ``order``
    sorts ``written``."""
    slots = geo.slots_of(table_row, past)
    at = order[np.minimum(np.searchsorted(written, slots, sorter=order), written.size - 1)]
    now = (written[at] == slots) & (slots > 0)
    same = now & (positions[at] == np.arange(past)) & (input_ids[at] == history[:past])
    return same, now & ~same


def build_step(step: int, runner: Any, kwargs: dict[str, Any], metadata: dict[str, Any],
               geos: Sequence[GroupGeometry], max_tokens: int, pending: dict[str, int] | None = None,
               histories: RequestHistories | None = None,
               drafts: Mapping[str, Sequence[int]] | None = None) -> VllmStep:
    """Read one step from the forward's arguments, the attention metadata and the runner's request state
    (``pending``: per request, the first position an earlier step left unstamped; ``histories``: the token
    histories kept from the step before, a fresh one reads every request's state; ``drafts``: the step's
    scheduled draft tokens per request, :func:`with_drafts`)."""
    if histories is None:
        histories = RequestHistories()
    batch = runner.input_batch
    b = int(batch.num_reqs)
    ids = list(batch.req_ids[:b])
    first = attention_metadata(metadata[geos[0].layer_names[0]])
    cu = _host(first.query_start_loc)[: b + 1].astype(np.int64)
    seq = _host(first.seq_lens)[:b].astype(np.int64)
    t = int(cu[b])
    input_ids = _host(kwargs["input_ids"]).reshape(-1)[:t].astype(np.int64)
    positions = _host(kwargs["positions"]).reshape(-1)[:t].astype(np.int64)
    extend = cu[1:] - cu[:-1]
    prefix = seq - extend
    ends = prefix + extend
    requests = runner.requests
    confirmed = None
    if drafts:
        parts, confirmed = with_drafts(histories, ids, requests, ends, extend, drafts)
    else:
        # the one loop over requests: a dictionary look-up and the tokens each state gained since the last step
        parts = [histories.history(rid, requests[rid], int(end))
                 for rid, end in zip(ids, ends.tolist(), strict=True)]
    histories.keep_only(ids)
    flat = np.concatenate(parts) if parts else np.zeros(0, np.int64)
    starts = np.zeros(b + 1, np.int64)
    np.cumsum(ends, out=starts[1:])
    row = _row_of_token(extend, t)
    want_pos = np.arange(t, dtype=np.int64) - cu[row] + prefix[row]
    want_ids = flat[starts[row] + want_pos]
    tables, forward_slots = {}, {}
    for geo in geos:
        md = attention_metadata(metadata[geo.layer_names[0]])
        tables[geo.index] = np.array(_host(md.block_table)[:b], np.int32)
        forward_slots[geo.index] = np.array(_host(md.slot_mapping)[:t], np.int64)
    # A same-step prefix hit: vLLM caches a block when it allocates it, so a row scheduled next to the row that
    # writes the block (a parallel-sampling sibling, an identical prompt) starts past it although nothing is
    # written yet; attention is right (every layer writes all rows' K/V before it attends) but the canary's
    # verify and the write's seed would run before the stamp. The canary sees such a row as writing from the
    # first same-step position on: those tokens (the same ids, positions and slots the other row writes) are
    # stamped twice with identical records, and only what was really cached before the step is verified. In a
    # sliding-window group the same-step block may sit inside the window with cached blocks after it (the
    # window's first block, freed by the request that wrote it and written again by another one in this step):
    # every group's verified slots are looked up, for every row at once (most steps: no row, and the canary's
    # tokens are the forward's).
    tail_rows = _same_step_rows(prefix, tables, forward_slots, geos) if b and t else np.zeros(0, np.int64)
    # rows an earlier step left partly unstamped (rare: more same-step re-stamps than its capacity took)
    waiting = {i: pending[rid] for i, rid in enumerate(ids) if rid in pending} if pending else {}
    common = dict(step=step, request_ids=ids, rows=np.arange(1, b + 1, dtype=np.int64), input_ids=input_ids,
                  positions=positions, history_ids=flat, valid_lens=ends, block_tables=tables, forward_len=t,
                  confirmed_lens=confirmed, query_starts=prefix)
    if not tail_rows.size and not waiting:
        return VllmStep(**common, prefix_lens=prefix, extend_lens=extend, expected_input_ids=want_ids,
                        expected_positions=want_pos, slot_mappings=forward_slots,
                        source_index=np.arange(t, dtype=np.int64), forward_tokens=t, restamped=False)
    return _with_restamps(common, prefix, extend, cu, parts, want_ids, want_pos, input_ids, positions, tables,
                          forward_slots, geos, tail_rows, waiting, max_tokens - t)


def _with_restamps(common: dict[str, Any], prefix: np.ndarray, extend: np.ndarray, cu: np.ndarray,
                   histories: list[np.ndarray], want_ids: np.ndarray, want_pos: np.ndarray, input_ids: np.ndarray,
                   positions: np.ndarray, tables: dict[int, np.ndarray], forward_slots: dict[int, np.ndarray],
                   geos: Sequence[GroupGeometry], tail_rows: np.ndarray, waiting: dict[int, int],
                   budget: int) -> VllmStep:
    """The step of :func:`build_step` when some rows (``tail_rows``) may start inside what a sibling writes in
    this very step, or an earlier step left some rows' positions unstamped (``waiting``: batch row -> first
    unstamped position): each such row's tail of same-step (or unstamped) slots goes before its own tokens,
    re-stamped (at most ``budget`` re-stamped tokens in all, what the runtime's token capacity still takes); a
    row whose re-stamps do not fit waits for a later step (``deferred``)."""
    b = prefix.shape[0]
    orders = {g.index: np.argsort(forward_slots[g.index], kind="stable") for g in geos}
    # per sliding-window group, each row's window start (positions below it are out of the row's window: their
    # block-table entries may be stale, they are never verified, nor stamped where the table says)
    windowed = {g.index: g.window_starts(prefix) for g in geos if g.window}
    ids = common["request_ids"]
    new_prefix = prefix.copy()
    new_extend = np.zeros_like(extend)
    deferred: dict[str, int] = {}
    candidates = set(tail_rows.tolist())
    parts_slots: dict[int, list[np.ndarray]] = {g.index: [] for g in geos}
    parts_src: list[np.ndarray] = []
    parts_ids: list[np.ndarray] = []
    parts_pos: list[np.ndarray] = []
    for i in range(b):
        past = int(prefix[i])
        run = 0
        # per group, the positions whose slot the forward writes in this step with this row's token there
        legit: dict[int, np.ndarray] = {}
        if i in candidates:
            foreign = np.zeros(past, bool)
            for geo in geos:
                same, other = _legit_same_step(geo, tables[geo.index][i], past, histories[i],
                                               forward_slots[geo.index], orders[geo.index], positions, input_ids)
                if geo.window:  # below the window: stale entries, never the row's to verify or stamp
                    same[: int(windowed[geo.index][i])] = other[: int(windowed[geo.index][i])] = False
                legit[geo.index] = same
                foreign |= other
            # Re-stamped from the first same-step position after the last slot written with anything else (a
            # block table pointing at what another request writes now is a fault the verify must see)
            after = int(np.flatnonzero(foreign)[-1]) + 1 if foreign.any() else 0
            shared = np.zeros(past, bool)
            for same in legit.values():
                shared |= same
            shared[:after] = False
            run = past - int(np.flatnonzero(shared)[0]) if shared.any() else 0
        # positions an earlier step left unstamped (below) are re-stamped with the tail
        unstamped = min(waiting.get(i, past), past)
        run = max(run, past - unstamped)
        # A re-stamp that starts inside a sliding-window group's stale part (below the row's window) would seed
        # its chain from a slot the group no longer holds: such a row re-stamps from position 0 (no seed), so
        # that its records are those the row writing them stamps (the same chain from position 0). What it
        # re-stamps only to carry the chain (below the window; in every group, what was cached before the step)
        # goes to slot 0, the null block no request reads: the records there are never verified.
        if 0 < past - run and any(past - run <= int(w[i]) for w in windowed.values()):
            run = past
        lo, hi = int(cu[i]), int(cu[i + 1])
        if run > budget:
            # More re-stamps than the runtime takes this step: the row verifies only what was stamped before
            # and stamps nothing; the positions from there on are re-stamped by a later step (from the history,
            # where the block table says), unchecked in between. Never a verify of a slot not yet stamped.
            new_prefix[i] = past - run
            deferred[ids[i]] = past - run
            continue
        budget -= run
        start = past - run
        new_prefix[i] = start
        new_extend[i] = hi - lo + run
        parts_src += [np.full(past - start, -1, np.int64), np.arange(lo, hi, dtype=np.int64)]
        parts_ids += [histories[i][start:past], want_ids[lo:hi]]
        parts_pos += [np.arange(start, past, dtype=np.int64), want_pos[lo:hi]]
        for geo in geos:
            # A re-stamp writes where the table says only what the forward writes there now (identical records)
            # and what an earlier step left unstamped; what was cached before the step, or lies below the
            # window, is re-stamped into slot 0 only to carry the chain: stamping over it would vouch for bytes
            # no verify checked
            slots = geo.slots_of(tables[geo.index][i], past, start)
            real = np.arange(start, past) >= unstamped
            if geo.index in legit:
                real |= legit[geo.index][start:past]
            if geo.window:
                real &= np.arange(start, past) >= int(windowed[geo.index][i])
            slots[~real] = 0
            parts_slots[geo.index] += [slots, forward_slots[geo.index][lo:hi]]
    source = np.concatenate(parts_src) if parts_src else np.zeros(0, np.int64)
    restamp_ids = np.concatenate(parts_ids) if parts_ids else np.zeros(0, np.int64)
    restamp_pos = np.concatenate(parts_pos) if parts_pos else np.zeros(0, np.int64)
    slot_mappings = {g: np.concatenate(p) if p else np.zeros(0, np.int64) for g, p in parts_slots.items()}
    step_batch = VllmStep(**common, prefix_lens=new_prefix, extend_lens=new_extend,
                          expected_input_ids=restamp_ids, expected_positions=restamp_pos,
                          slot_mappings=slot_mappings, source_index=source,
                          forward_tokens=int((source >= 0).sum()), restamped=bool((source < 0).any()),
                          deferred=deferred)
    # what the forward received, in the canary's order (a re-stamped token is what the other row received)
    step_batch.input_ids = step_batch.canary_tokens(input_ids, restamp_ids)
    step_batch.positions = step_batch.canary_tokens(positions, restamp_pos)
    return step_batch
