"""The tests' oracle of one vLLM step: the plan inputs read request by request and token by token, with plain
Python lists and a dictionary of blocks (the straightforward reading the integration's array code must equal),
kept apart from the package so that a change there cannot change the oracle."""

from __future__ import annotations

from typing import Any

import numpy as np

from kvcanary_cupy._errors import fail
from kvcanary_cupy.integrations.common.state import expected_pool, host_array
from kvcanary_cupy.integrations.vllm.step import VllmStep


def note_blocks(index: dict[tuple[int, int], int], geos: list[Any], batch: VllmStep) -> None:
    """The sweep's block index, one block at a time: complete blocks at their place, a block being filled
    dropped, the later row deciding; a row the step left partly unstamped (``deferred``) drops its blocks past
    the stamped ones up to what the forward wrote, except those another row stamps in this step."""
    deferred = getattr(batch, "deferred", {})
    for geo in geos:
        table = batch.block_tables[geo.index]
        stamped = set((batch.slot_mappings[geo.index] // geo.block_size).tolist()) if deferred else set()
        for i in range(batch.size):
            total = int(batch.prefix_lens[i] + batch.extend_lens[i])
            complete = total // geo.block_size
            unstamped_from = deferred.get(batch.request_ids[i])
            if unstamped_from is not None:  # the forward wrote past what the canary stamped
                complete = unstamped_from // geo.block_size
                total = int(batch.valid_lens[i])
            for k in range(-(-total // geo.block_size)):
                block = int(table[i, k])
                if block <= 0 or (k >= complete and unstamped_from is not None and block in stamped):
                    continue
                if k < complete:
                    index[(geo.index, block)] = k
                else:
                    index.pop((geo.index, block), None)


def oracle_step(step: int, runner: Any, kwargs: dict[str, Any], metadata: dict[str, Any],
               geos: list[Any], max_tokens: int, pending: dict[str, int] | None = None) -> dict[str, Any]:
    """Read one step from the forward's arguments, the attention metadata and the runner's request state
    (``pending``: per request, the first position an earlier step left unstamped)."""
    batch = runner.input_batch
    b = int(batch.num_reqs)
    ids = list(batch.req_ids[:b])
    first = metadata[geos[0].layer_names[0]]
    cu = host_array(first.query_start_loc)[: b + 1].astype(np.int64)
    seq = host_array(first.seq_lens)[:b].astype(np.int64)
    t = int(cu[b])
    input_ids = host_array(kwargs["input_ids"]).reshape(-1)[:t].astype(np.int64)
    positions = host_array(kwargs["positions"]).reshape(-1)[:t].astype(np.int64)
    extend = cu[1:] - cu[:-1]
    prefix = seq - extend
    want_ids = np.empty(t, np.int64)
    want_pos = np.empty(t, np.int64)
    histories = []
    for i, rid in enumerate(ids):
        state = runner.requests[rid]
        if state.prompt_token_ids is None:
            fail(f"request {rid} has no prompt token ids (prompt embeddings are not supported)")
        history = list(state.prompt_token_ids) + list(state.output_token_ids)
        end = int(prefix[i] + extend[i])
        if len(history) < end:
            fail(f"request {rid} schedules positions up to {end} but its state holds {len(history)} tokens "
                 "(async scheduling is not supported: use async_scheduling=False)")
        histories.append(history[:end])
        want_ids[cu[i]: cu[i + 1]] = history[int(prefix[i]): end]
        want_pos[cu[i]: cu[i + 1]] = np.arange(prefix[i], end)
    pool, valid = expected_pool(histories)
    tables, forward_slots = {}, {}
    for geo in geos:
        md = metadata[geo.layer_names[0]]
        tables[geo.index] = host_array(md.block_table)[:b].astype(np.int32).copy()
        forward_slots[geo.index] = host_array(md.slot_mapping)[:t].astype(np.int64).copy()
    # A same-step prefix hit: vLLM caches a block when it allocates it, so a row scheduled next to the row that
    # writes the block (a parallel-sampling sibling, an identical prompt) starts past it although nothing is
    # written yet; attention is right (every layer writes all rows' K/V before it attends) but the canary's
    # verify and the write's seed would run before the stamp. The canary sees such a row as writing from the
    # first same-step position on: those tokens (the same ids, positions and slots the other row writes) are
    # stamped twice with identical records, and only what was really cached before the step is verified.
    geo0 = geos[0]
    written_now = forward_slots[geo0.index]
    new_prefix = prefix.copy()
    parts_slots: dict[int, list[np.ndarray]] = {g.index: [] for g in geos}
    parts_src: list[np.ndarray] = []
    parts_ids: list[np.ndarray] = []
    parts_pos: list[np.ndarray] = []
    budget = max_tokens - t  # re-stamped tokens the runtime's capacity still takes this step
    written_set = set(written_now.tolist())
    pending = pending or {}
    deferred: dict[str, int] = {}
    new_extend = np.zeros_like(extend)
    for i in range(b):
        past = int(prefix[i])
        run = 0
        # Only a row whose last prefix slot is written in this very step can have such a tail (most steps: none,
        # so one slot is looked up instead of the whole prefix).
        if past and int(geo0.slots_of(tables[geo0.index][i], past, past - 1)[0]) in written_set:
            # only the tail of the prefix that is written in this very step (a block table pointing elsewhere
            # is a fault the verify must see, not a dependency to re-stamp)
            now = np.isin(geo0.slots_of(tables[geo0.index][i], past), written_now)
            run = past - int(np.flatnonzero(~now)[-1]) - 1 if not now.all() else past
        # positions an earlier step left unstamped are re-stamped with the tail
        run = max(run, past - min(pending.get(ids[i], past), past))
        lo, hi = int(cu[i]), int(cu[i + 1])
        if run > budget:  # the row waits: it verifies what was stamped before and stamps nothing
            new_prefix[i] = past - run
            deferred[ids[i]] = past - run
            continue
        budget -= run
        start = past - run
        new_prefix[i] = start
        new_extend[i] = hi - lo + run
        parts_src += [np.full(past - start, -1, np.int64), np.arange(lo, hi, dtype=np.int64)]
        parts_ids += [np.asarray(histories[i][start:past], np.int64), want_ids[lo:hi]]
        parts_pos += [np.arange(start, past, dtype=np.int64), want_pos[lo:hi]]
        for geo in geos:
            slots = geo.slots_of(tables[geo.index][i], past, start)
            parts_slots[geo.index] += [slots, forward_slots[geo.index][lo:hi]]
    source = np.concatenate(parts_src) if parts_src else np.zeros(0, np.int64)
    restamp_ids = np.concatenate(parts_ids) if parts_ids else np.zeros(0, np.int64)
    restamp_pos = np.concatenate(parts_pos) if parts_pos else np.zeros(0, np.int64)
    slot_mappings = {g: np.concatenate(p) if p else np.zeros(0, np.int64) for g, p in parts_slots.items()}
    # what the forward received, in the canary's order (a re-stamped token is what the other row received)
    real = source >= 0
    ids_out, pos_out = restamp_ids.copy(), restamp_pos.copy()
    ids_out[real] = input_ids[source[real]]
    pos_out[real] = positions[source[real]]
    return dict(step=step, request_ids=ids, rows=np.arange(1, b + 1, dtype=np.int64), prefix_lens=new_prefix,
                extend_lens=new_extend, deferred=deferred, forward_len=t, input_ids=ids_out, positions=pos_out,
                expected_input_ids=restamp_ids, expected_positions=restamp_pos, expected_pool=pool,
                valid_lens=valid, block_tables=tables, slot_mappings=slot_mappings, source_index=source)
