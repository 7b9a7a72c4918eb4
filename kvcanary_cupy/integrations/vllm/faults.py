"""Faults injected into vLLM's real structures at the canary's hook points (the bugs of vLLM's own history).

Each injector is a :class:`~.hooks.StepObserver` armed at a step; it fires once, at the first step from then on
where it finds a target, and records what it did (:class:`InjectedFault`). What each one touches is what the
attention kernels of that step read or write (the forward context's metadata, the forward's inputs, a layer's
KV cache tensor), so the engine really runs with the fault:

* ``kv-bitflip`` -- one bit of a live request's V bytes flipped in a layer's KV cache tensor (within the first
  16 bytes of the token's row, so PARTIAL hashing sees it), after the step that wrote it;
* ``block-table`` -- a decoding request's block-table entry (``attn_metadata.block_table``) sent to another
  request's block for one step, then put back;
* ``slot-mapping`` -- one new token's ``slot_mapping`` entry sent to a slot another live request holds: its K/V
  land there (the victim's KV is overwritten, its own slot is never written);
* ``prefix-unwritten`` -- a prefix-cache hit on a block whose KV was never written: the hitting request's cached
  block is swapped for a fresh block for its first step (vllm#37152, blocks registered before the forward
  wrote them);
* ``prefix-foreign`` -- a prefix-cache hit on a block that holds another sequence (vllm#44701, a cross-tenant
  hit from colliding block-hash keys);
* ``preempt-reuse`` -- a block freed on preemption and handed to another request while a resumed request still
  maps it: the resumed request's block-table entry points at its old block, now another request's;
* ``wrong-token`` -- a token id in the forward's ``input_ids`` replaced by another id;
* ``position-shift`` -- one token's position in the forward's ``positions`` shifted by one;
* ``draft-rejected-kept`` (speculative decoding only) -- a rejected draft token's K/V left in place and read as
  the token sampled for its position (vllm#47466);
* ``window-reuse`` -- a sliding-window block freed and handed to another request while a request still attends
  to it: the other request's write goes into the block holding the first request's last cached position;
* ``group-handover`` -- a block handed from one KV cache group of a hybrid model to the other while the first
  group's request still reads it: the other group's layers write their K/V over its bytes (the groups alias).
* ``kv-element-size`` -- the K/V a step wrote written again by a kernel that takes the cache's elements for half
  their size (the geometry of vLLM CPU's unsupported ``kv_cache_dtype`` bug, mirrored so that it stays inside the
  tensor): every element lands at half its byte offset, over other tokens' K/V;
* ``rank-kv-bitflip`` -- ``kv-bitflip`` on the last tensor-parallel rank only: the other ranks' shards stay intact
  and must stay silent.

Any injector can be confined to one rank (``rank=``; the plugin's ``KVCANARY_VLLM_FAULT=<kind>@<step>:rank<R>``):
it fires only in the worker of that rank (:func:`.distributed.worker_rank`).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any

import numpy as np

from .metadata import attention_metadata

FAULT_KINDS: dict[str, str] = {
    "kv-bitflip": "a bit flips in a live request's V bytes in a layer's KV cache tensor",
    "block-table": "a decoding request's block-table entry points at another request's block for a step",
    "slot-mapping": "one token's slot-mapping entry sends its K/V into another request's slot",
    "prefix-unwritten": "a prefix-cache hit maps a block whose KV was never written (vllm#37152)",
    "prefix-foreign": "a prefix-cache hit maps a block holding another sequence (vllm#44701)",
    "preempt-reuse": "a resumed request still maps a block freed on preemption and now another request's",
    "wrong-token": "the forward receives a wrong token id",
    "position-shift": "one token's position is shifted by one",
    "kv-element-size": "a step's K/V written at the wrong element size, over other tokens' K/V (vLLM CPU's "
                       "unsupported kv_cache_dtype bug)",
    "rank-kv-bitflip": "a bit flips in the KV shard of one tensor-parallel rank only (the last)",
}
# Faults that need a model kind of their own (a sliding-window group; two KV cache groups): they find no target
# in a full-attention model, so they are not among the kinds every model runs.
MODEL_FAULT_KINDS: dict[str, str] = {
    "window-reuse": "a sliding-window block is handed to another request while a request's window still reads it",
    "group-handover": "a block moves to the other KV cache group of a hybrid model while still referenced",
}


@dataclass
class InjectedFault:
    kind: str
    step: int  # the canary step in which the fault takes effect
    request: str
    position: int | None
    slot: int | None
    detail: str


@dataclass
class _Row:
    rid: str
    start: int  # first token of the row in the batch
    query: int
    past: int


def _rows(canary: Any, metadata: dict[str, Any]) -> tuple[list[_Row], Any]:
    batch = canary.runner.input_batch
    n = int(batch.num_reqs)
    # the attention metadata of a layer the canary checks (a hybrid model's Mamba/GDN layers carry other kinds)
    state = getattr(canary, "state", None)
    md = attention_metadata(metadata[state.geos[0].layer_names[0]] if state is not None and state.geos
                            else next(iter(metadata.values())))
    cu = md.query_start_loc[: n + 1].tolist()
    seq = md.seq_lens[:n].tolist()
    rows = [_Row(rid, int(cu[i]), int(cu[i + 1] - cu[i]), int(seq[i] - (cu[i + 1] - cu[i])))
            for i, rid in enumerate(batch.req_ids[:n])]
    return rows, md


class Injector:
    """Base: armed at ``at``, fires once; subclasses override the hook they need."""

    kind = ""

    def __init__(self, at: int = 0, seed: int = 0, rank: int | None = None) -> None:
        self.at = at
        self.rank = rank  # None: every worker; else only the worker of that rank fires
        self.rng = np.random.default_rng(seed)
        self.fault: InjectedFault | None = None
        self._restore: list[tuple[Any, int, int, int]] = []  # (tensor, row, col, value) put back after the step

    @property
    def armed(self) -> bool:
        return self.fault is None

    def here(self, canary: Any) -> bool:
        """This worker is the one the injector fires in (its rank, or any worker)."""
        from .distributed import worker_rank

        return self.rank is None or worker_rank(canary.runner)[0] == self.rank

    def before_forward(self, canary: Any, step: int, kwargs: dict[str, Any], metadata: dict[str, Any]) -> None:
        if self.armed and step >= self.at and self.here(canary):
            rows, md = _rows(canary, metadata)
            self.fire(canary, step, kwargs, metadata, rows, md)

    def fire(self, canary: Any, step: int, kwargs: dict[str, Any], metadata: dict[str, Any], rows: list[_Row],
             md: Any) -> None:
        pass

    def after_forward(self, canary: Any, step: int, batch: Any) -> None:
        for tensor, row, col, value in self._restore:
            tensor[row, col] = value
        self._restore.clear()

    def _set_block(self, metadata: dict[str, Any], row: int, col: int, block: int,
                   layer_names: list[str] | None = None) -> int:
        """Point ``block_table[row, col]`` at ``block`` in every distinct metadata table (of ``layer_names``'
        layers only, when given: one KV cache group's), put back after the step; the old id."""
        seen: set[int] = set()
        old = -1
        for md in metadata.values() if layer_names is None else (metadata[name] for name in layer_names):
            for table, r in _table_rows(md, row):
                if id(table) in seen:
                    continue
                seen.add(id(table))
                old = int(table[r, col])
                self._restore.append((table, r, col, old))
                table[r, col] = block
        return old


def _table_rows(md: Any, row: int) -> list[tuple[Any, int]]:
    """Where row ``row`` of the step's batch sits in a layer's block table(s): the table itself, or for vLLM's
    MLA metadata (decodes first, then prefills; :func:`.layers.attention_metadata`) the half that holds it."""
    table = getattr(md, "block_table", None)
    if table is not None:
        return [(table, row)]
    decode, prefill = getattr(md, "decode", None), getattr(md, "prefill", None)
    decodes = 0 if decode is None else int(decode.block_table.shape[0])
    if decode is not None and row < decodes:
        return [(decode.block_table, row)]
    return [] if prefill is None else [(prefill.block_table, row - decodes)]


def _target_group(geos: list[Any]) -> Any:
    """The group a block-table fault goes into: a sliding-window one if the model has one (its window decides
    which columns are read), else the first."""
    return next((g for g in geos if g.window), geos[0])


def _read_column(geo: Any, past: int) -> int:
    """The first block column ``geo``'s attention still reads for a row whose first query is at ``past`` (0 for
    full attention; below a sliding window, blocks are freed or stand for the null block and are never read, so a
    fault there could not be seen)."""
    return int(geo.window_starts(np.array([past]))[0]) // geo.block_size


def _other_block(canary: Any, rows: list[_Row], md: Any, me: int, geo: Any, col: int) -> int | None:
    """A complete block of another row of this step that its attention still reads and whose tokens differ from
    those of ``me``'s column ``col`` (without prefix caching, two requests with a common prefix hold it in two
    blocks with equal content: pointing one at the other changes nothing attention reads)."""
    bs = geo.block_size
    mine = _tokens(canary, rows[me].rid, col * bs, col * bs + bs)
    for j, other in enumerate(rows):
        other_col = _read_column(geo, other.past)
        if j == me or (other_col + 1) * bs > other.past:
            continue
        if other_col == col and _tokens(canary, other.rid, col * bs, col * bs + bs) == mine:
            continue
        return int(md.block_table[j, other_col])
    return None


def _sampled_tokens(canary: Any, rid: str, query: int) -> int:
    """The tokens of a row's ``query`` that are not the scheduler's draft tokens of this step (1 for a decoding
    row, with or without speculative decoding; a draft model proposes at every step, so no row of its engine has
    a query of 1)."""
    drafts = getattr(canary.state, "drafts", None) or {}
    return query - len(drafts.get(rid) or ())


def _tokens(canary: Any, rid: str, start: int, end: int) -> list[int]:
    """Token ids ``start .. end - 1`` of a request (its prompt, then what it generated)."""
    state = canary.runner.requests[rid]
    return (list(state.prompt_token_ids or []) + list(state.output_token_ids))[start:end]


class KvBitflip(Injector):
    kind = "kv-bitflip"

    def after_forward(self, canary: Any, step: int, batch: Any) -> None:
        super().after_forward(canary, step, batch)
        if not self.armed or step < self.at or not self.here(canary):
            return
        import torch

        geo = canary.state.geos[0]
        for i, rid in enumerate(batch.request_ids):
            # a decoding row: its one sampled token (and, under speculative decoding, the drafts after it, whose
            # positions are provisional and not targeted)
            done = int(batch.prefix_lens[i]) + 1
            if _sampled_tokens(canary, rid, int(batch.extend_lens[i])) != 1 or done < 2:
                continue
            # a position the next step still reads (a sliding-window group's window ends there)
            low = min(int(geo.window_starts(np.array([done]))[0]), done - 2)
            position = int(self.rng.integers(low, done - 1))
            slot = batch.slot(geo, i, position)
            cache = geo.caches[0]
            block, offset = divmod(slot, geo.block_size)
            if cache.dim() == 3:  # an MLA latent cache [blocks, block_size, row]: the token's row, element 0
                element, where = cache[block, offset, 0:1], "latent row element 0"
            else:
                half = cache.shape[-1] // 2  # V row-major after K's [D, block_size]: head 0, element 0..3 of V
                flat = cache[block, 0].reshape(-1)
                index = half * geo.block_size + offset * half
                element, where = flat[index: index + 1], "V[head 0, element 0]"
            bit = int(self.rng.integers(0, 8 * element.element_size()))
            as_bytes = element.view(torch.uint8)  # the element's bytes, in place
            as_bytes[bit // 8] ^= 1 << (bit % 8)
            self.fault = InjectedFault(self.kind, step + 1, rid, position, slot,
                                       f"bit {bit} of {where} in {geo.layer_names[0]}")
            return


class BlockTableRedirect(Injector):
    kind = "block-table"

    def fire(self, canary, step, kwargs, metadata, rows, md):
        geo = _target_group(canary.state.geos)
        md = attention_metadata(metadata[geo.layer_names[0]])
        bs = geo.block_size
        for i, row in enumerate(rows):
            col = _read_column(geo, row.past)
            if _sampled_tokens(canary, row.rid, row.query) == 1 and (col + 1) * bs <= row.past:
                other = _other_block(canary, rows, md, i, geo, col)
                if other is None or other == int(md.block_table[i, col]):
                    continue
                old = self._set_block(metadata, i, col, other, geo.layer_names)
                self.fault = InjectedFault(self.kind, step, row.rid, col * bs, old * bs,
                                           f"block {col}: {old} -> {other}")
                return


class SlotMappingRedirect(Injector):
    kind = "slot-mapping"

    def fire(self, canary, step, kwargs, metadata, rows, md):
        bs = canary.state.geos[0].block_size
        for i, row in enumerate(rows):
            if row.query < 1:
                continue
            for j, other in enumerate(rows):
                if j == i or other.past < 2:
                    continue
                victim = int(md.block_table[j, 0]) * bs + 1  # position 1 of the other request
                token = row.start + row.query - 1
                seen: set[int] = set()
                tensors = _slot_mappings(metadata)
                from vllm.forward_context import get_forward_context

                ctx = get_forward_context()
                if isinstance(getattr(ctx, "slot_mapping", None), dict):
                    tensors += list(ctx.slot_mapping.values())
                old = -1
                for t in tensors:
                    if id(t) in seen:
                        continue
                    seen.add(id(t))
                    old = int(t[token])
                    t[token] = victim
                self.fault = InjectedFault(self.kind, step, row.rid, row.past + row.query - 1, old,
                                           f"slot {old} -> {victim} ({other.rid}'s position 1)")
                return


class PrefixUnwritten(Injector):
    kind = "prefix-unwritten"

    def fire(self, canary, step, kwargs, metadata, rows, md):
        st = canary.state
        geo = _target_group(st.geos)
        md = attention_metadata(metadata[geo.layer_names[0]])
        bs = geo.block_size
        used = {int(b) for b in md.block_table[: len(rows)].reshape(-1).tolist()} | {b for (_, b) in st.block_index}
        for i, row in enumerate(rows):
            col = _read_column(geo, row.past)
            if row.query > 1 and (col + 1) * bs <= row.past:  # a prefill whose read blocks came from the cache
                fresh = next(b for b in range(geo.num_blocks - 1, 0, -1) if b not in used)
                old = self._set_block(metadata, i, col, fresh, geo.layer_names)
                self.fault = InjectedFault(self.kind, step, row.rid, col * bs, old * bs,
                                           f"cached block {old} (column {col}) -> never-written block {fresh}")
                return


class PrefixForeign(Injector):
    kind = "prefix-foreign"

    def fire(self, canary, step, kwargs, metadata, rows, md):
        st = canary.state
        geo = _target_group(st.geos)
        md = attention_metadata(metadata[geo.layer_names[0]])
        bs = geo.block_size
        for i, row in enumerate(rows):
            col = _read_column(geo, row.past)
            if row.query > 1 and (col + 1) * bs <= row.past:
                mine = set(md.block_table[i].tolist())
                foreign = [b for (g, b) in st.block_index if g == geo.index and b not in mine]
                if not foreign:
                    continue
                old = self._set_block(metadata, i, col, foreign[0], geo.layer_names)
                self.fault = InjectedFault(self.kind, step, row.rid, col * bs, old * bs,
                                           f"cached block {old} (column {col}) -> block {foreign[0]} of another "
                                           "sequence")
                return


class PreemptReuse(Injector):
    kind = "preempt-reuse"

    def __init__(self, at: int = 0, seed: int = 0, rank: int | None = None) -> None:
        super().__init__(at, seed, rank)
        self.history: dict[str, list[int]] = {}  # request -> its first block list (before any preemption)

    def fire(self, canary, step, kwargs, metadata, rows, md):
        geo = _target_group(canary.state.geos)
        md = attention_metadata(metadata[geo.layer_names[0]])
        bs = geo.block_size
        owner: dict[int, str] = {}
        for i, row in enumerate(rows):
            for b in md.block_table[i, _read_column(geo, row.past): -(-(row.past + row.query) // bs)].tolist():
                owner[int(b)] = row.rid
        for i, row in enumerate(rows):
            blocks = md.block_table[i, : -(-(row.past + row.query) // bs)].tolist()
            before = self.history.setdefault(row.rid, [int(b) for b in blocks])
            if row.past < bs:
                continue
            for k in range(_read_column(geo, row.past), min(len(before), len(blocks), row.past // bs)):
                old = before[k]
                if old != blocks[k] and owner.get(old, row.rid) != row.rid:
                    self._set_block(metadata, i, k, old, geo.layer_names)
                    self.fault = InjectedFault(self.kind, step, row.rid, k * bs, old * bs,
                                               f"resumed request maps its pre-preemption block {old}, now "
                                               f"{owner[old]}'s (its own is {blocks[k]})")
                    return
            if len(blocks) > len(before):
                self.history[row.rid] = before + [int(b) for b in blocks[len(before):]]


def _slot_mappings(metadata: dict[str, Any]) -> list[Any]:
    """Every layer's ``slot_mapping`` in the step's metadata (a Mamba/GDN layer's metadata has none)."""
    return [m.slot_mapping for m in metadata.values() if getattr(m, "slot_mapping", None) is not None]


def _vocab_size(runner: Any) -> int:
    """The model's vocabulary size, from the runner's model configuration."""
    return int(runner.model_config.get_vocab_size())


class WrongToken(Injector):
    kind = "wrong-token"

    def fire(self, canary, step, kwargs, metadata, rows, md):
        row = rows[int(self.rng.integers(0, len(rows)))]
        j = row.start + row.query - 1
        ids = kwargs["input_ids"]
        old = int(ids[j])
        vocab = _vocab_size(canary.runner)  # an id past the vocabulary would fail the embedding, not the KV
        ids[j] = (old + 1 + int(self.rng.integers(0, min(100, vocab - 1)))) % vocab
        self.fault = InjectedFault(self.kind, step, row.rid, row.past + row.query - 1, None,
                                   f"token {old} -> {int(ids[j])}")


class PositionShift(Injector):
    kind = "position-shift"

    def fire(self, canary, step, kwargs, metadata, rows, md):
        row = rows[int(self.rng.integers(0, len(rows)))]
        j = row.start + row.query - 1
        positions = kwargs["positions"]
        old = int(positions[j])
        positions[j] = old + 1
        self.fault = InjectedFault(self.kind, step, row.rid, old, None, f"position {old} -> {old + 1}")


class RejectedDraftKept(Injector):
    """A rejected draft's K/V left in place and read as an accepted token (the shape of vllm#47466: the target
    attends to the KV of a draft token the previous step rejected). Armed on a speculative-decoding engine, it
    remembers each row's draft positions after a step; at the next step of a row whose drafts were rejected from
    position ``q`` on, the write of the token sampled for ``q`` (the row's first token now) is sent to a block no
    request holds, so slot ``q`` keeps the rejected draft's K/V and records while attention reads it."""

    kind = "draft-rejected-kept"

    def __init__(self, at: int = 0, seed: int = 0, rank: int | None = None) -> None:
        super().__init__(at, seed, rank)
        self.drafted: dict[str, tuple[int, list[int]]] = {}  # request -> (its first draft position, the drafts)

    def after_forward(self, canary: Any, step: int, batch: Any) -> None:
        super().after_forward(canary, step, batch)
        drafts = canary.state.drafts
        self.drafted = {rid: (int(batch.valid_lens[i]) - len(drafts[rid]), list(drafts[rid]))
                        for i, rid in enumerate(batch.request_ids) if drafts.get(rid)}

    def fire(self, canary, step, kwargs, metadata, rows, md):
        st = canary.state
        geo = st.geos[0]
        bs = geo.block_size
        for row in rows:
            first, drafts = self.drafted.get(row.rid, (-1, []))
            accepted = row.past - first
            if row.query < 1 or not 0 <= accepted < len(drafts):
                continue  # no draft of this row was rejected in the step before
            state = canary.runner.requests[row.rid]
            max_tokens = getattr(getattr(state, "sampling_params", None), "max_tokens", None)
            if max_tokens is not None and max_tokens - len(state.output_token_ids) < 3:
                continue  # the request ends before a later step reads the position
            used = {int(b) for b in md.block_table[: len(rows)].reshape(-1).tolist()} | {b for (_, b) in
                                                                                        st.block_index}
            spare = next((b for b in range(geo.num_blocks - 1, 0, -1) if b not in used), None)
            if spare is None:
                return
            token = row.start
            old = -1
            seen: set[int] = set()
            tensors = _slot_mappings(metadata)
            from vllm.forward_context import get_forward_context

            ctx = get_forward_context()
            if isinstance(getattr(ctx, "slot_mapping", None), dict):
                tensors += list(ctx.slot_mapping.values())
            for t in tensors:
                if id(t) in seen:
                    continue
                seen.add(id(t))
                old = int(t[token])
                t[token] = spare * bs + row.past % bs
            self.fault = InjectedFault(self.kind, step, row.rid, row.past, old,
                                       f"rejected draft {drafts[accepted]} kept at position {row.past} (slot {old}); "
                                       f"the sampled token's K/V went to block {spare}")
            return


class _Handover(Injector, abc.ABC):
    """Hands the block that holds a request's last cached position (inside any window: a window reads at least
    the position before the query) to another request of the step, in ``writer``'s group: that request's block
    table entry and the slot mapping of its tokens in that block point there, so its layers write their K/V over
    the victim's (offsets at or below the victim's last cached one, so the victim's own positions are hit)."""

    @abc.abstractmethod
    def groups(self, geos: list[Any]) -> tuple[Any, Any] | None:
        """(the victim's group, the writer's group), or None when the model has no such pair."""

    def fire(self, canary, step, kwargs, metadata, rows, md):
        st = canary.state
        pair = self.groups(st.geos) if st is not None else None
        if pair is None:
            return
        victim_geo, writer_geo = pair
        bs = victim_geo.block_size
        vmd, wmd = metadata[victim_geo.layer_names[0]], metadata[writer_geo.layer_names[0]]
        for i, victim in enumerate(rows):
            if victim.past < 1:
                continue
            last = victim.past - 1
            block = int(vmd.block_table[i, last // bs])
            for j, writer in enumerate(rows):
                if j == i or writer.query < 1:
                    continue
                first = writer.past
                col = first // bs
                # the writer's tokens that land in that block column, at offsets the victim has filled
                hits = [t for t in range(writer.query) if (first + t) // bs == col and (first + t) % bs <= last % bs]
                if not hits or int(wmd.block_table[j, col]) == block:
                    continue
                old = self._set_block(metadata, j, col, block, writer_geo.layer_names)
                for t in hits:
                    self._set_group_slot(metadata, writer_geo, writer.start + t, block * bs + (first + t) % bs)
                self.fault = InjectedFault(self.kind, step, victim.rid, last, block * bs + last % bs,
                                           f"{writer.rid}'s {writer_geo.name} block {old} -> {victim.rid}'s "
                                           f"{victim_geo.name} block {block} (positions "
                                           f"{col * bs}..{col * bs + bs - 1} of {victim.rid} still read)")
                return

    @staticmethod
    def _set_group_slot(metadata: dict[str, Any], geo: Any, token: int, slot: int) -> None:
        """Send one token's K/V to ``slot`` in the group's layers (the metadata's and the forward context's slot
        mapping, which the KV write reads)."""
        from vllm.forward_context import get_forward_context

        tensors = [metadata[name].slot_mapping for name in geo.layer_names]
        ctx_slots = getattr(get_forward_context(), "slot_mapping", None)
        if isinstance(ctx_slots, dict):
            tensors += [ctx_slots[name] for name in geo.layer_names if name in ctx_slots]
        seen: set[int] = set()
        for t in tensors:
            if id(t) not in seen:
                seen.add(id(t))
                t[token] = slot


class WindowReuse(_Handover):
    kind = "window-reuse"

    def groups(self, geos):
        sw = next((g for g in geos if g.window), None)
        return None if sw is None else (sw, sw)


class GroupHandover(_Handover):
    kind = "group-handover"

    def groups(self, geos):
        if len(geos) < 2:
            return None
        victim = next((g for g in geos if g.window), geos[0])
        return victim, next(g for g in geos if g is not victim)


def _vec_elements(cache: Any, block: int, offset: int) -> np.ndarray:
    """The flat element indices of one token's K and V, every head, in a CPU ``vec`` cache ``[blocks, heads,
    block_size, 2 * head_size]`` (per block and head: K column-major ``[head_size, block_size]``, then V
    row-major ``[block_size, head_size]``)."""
    _, heads, bs, width = (int(n) for n in cache.shape)
    d = width // 2
    planes = (block * heads + np.arange(heads, dtype=np.int64))[:, None] * bs * width
    dims = np.arange(d, dtype=np.int64)[None, :]
    k = planes + dims * bs + offset
    v = planes + bs * d + offset * d + dims
    return np.concatenate([k.reshape(-1), v.reshape(-1)])


def _row_elements(cache: Any, block: int, offset: int) -> np.ndarray:
    """The flat element indices of one token's row in an MLA latent cache ``[blocks, block_size, row]``."""
    _, bs, width = (int(n) for n in cache.shape)
    return (block * bs + offset) * width + np.arange(width, dtype=np.int64)


class KvElementSize(Injector):
    """After a step's forward, the K/V the step wrote in the group's first layer written again as a kernel would
    that takes the cache's elements for half their size: element ``e``'s first half lands at byte ``e * size / 2``.
    It fires at a step whose misplaced bytes cover fingerprinted bytes (with ``real_kv_hash="partial"`` the first
    elements of head 0, with ``"all"`` any) of a token written before the step that the request's window still
    reads, of a request with tokens still to generate: the victim (detected when that request's next step verifies
    it). Two cache layouts: vLLM CPU's ``vec`` ``[blocks, heads, block_size, 2 * head_size]`` and MLA's latent
    ``[blocks, block_size, row]`` (one row per token, no V)."""

    kind = "kv-element-size"

    def after_forward(self, canary: Any, step: int, batch: Any) -> None:
        super().after_forward(canary, step, batch)
        if not self.armed or step < self.at or not self.here(canary):
            return
        import torch

        st = canary.state
        geo = st.geos[0]
        if not st.support.checked_groups[0].real_kv or canary.options.real_kv_hash == "none":
            return  # no K/V bytes fingerprinted: the canary could not see this fault, so it is not injected
        cache = geo.caches[0]
        size = cache.element_size()
        if size < 2 or not cache.is_contiguous() or cache.dim() not in (3, 4):
            return
        half = size // 2
        bs = geo.block_size
        # every token written before this step that the request's next query still reads, of a request that runs
        # on after it (so its next step verifies it): slot -> (request, position)
        live: dict[int, tuple[str, int]] = {}
        for i, rid in enumerate(batch.request_ids):
            if _runs_on(canary, rid):
                done = int(batch.prefix_lens[i] + batch.extend_lens[i])
                for position in range(int(geo.window_starts(np.array([done]))[0]), int(batch.prefix_lens[i])):
                    live[int(batch.slot(geo, i, position))] = (rid, position)
        fingerprinted = 16 // size  # the first elements of head 0 the partial real-KV hash reads (its 16 bytes)
        written = [int(batch.slot(geo, i, p)) for i in range(len(batch.request_ids))
                   for p in range(int(batch.prefix_lens[i]), int(batch.prefix_lens[i] + batch.extend_lens[i]))]
        if not written:
            return
        # the kernel with the wrong element size writes every token of the step misplaced
        if cache.dim() == 3:
            width = int(cache.shape[2])
            elements = np.concatenate([_row_elements(cache, *divmod(slot, bs)) for slot in written])
            landing = (elements * half) // size  # the element each misplaced first half falls in
            slot_hit, dim = np.divmod(landing, width)
            # the row is all K: every byte with "all", its first bytes with "partial"
            hit = np.ones_like(dim, bool) if canary.options.real_kv_hash == "all" else dim < fingerprinted
            hit_slots = slot_hit[hit]
        else:
            heads, width = int(cache.shape[1]), int(cache.shape[3])
            elements = np.concatenate([_vec_elements(cache, *divmod(slot, bs)) for slot in written])
            landing = (elements * half) // size
            plane, within = np.divmod(landing, bs * width)
            k_side = within < bs * (width // 2)
            dim = np.where(k_side, within // bs, (within - bs * (width // 2)) % (width // 2))
            offset = np.where(k_side, within % bs, (within - bs * (width // 2)) // (width // 2))
            if canary.options.real_kv_hash == "all":  # every byte of every head is fingerprinted
                hit = k_side | bool(canary.options.with_v)
            else:  # the first bytes of head 0
                hit = (plane % heads == 0) & (dim < fingerprinted) & (k_side | bool(canary.options.with_v))
            hit_slots = (plane[hit] // heads) * bs + offset[hit]
        victims = sorted({int(v) for v in hit_slots.tolist()} & set(live) - set(written))
        if not victims:
            return  # no token of this step would land on one the canary can see: tried again next step
        flat = cache.view(torch.uint8).reshape(-1)
        src = torch.from_numpy((elements[:, None] * size + np.arange(half)).reshape(-1))
        dst = torch.from_numpy((elements[:, None] * half + np.arange(half)).reshape(-1))
        flat[dst] = flat[src].clone()
        rid, position = live[victims[0]]
        self.fault = InjectedFault(self.kind, step + 1, rid, position, victims[0],
                                   f"the step's {len(written)} token(s) written at {half}-byte element offsets in "
                                   f"{geo.layer_names[0]} ({size}-byte elements), over {len(victims)} "
                                   f"fingerprinted token(s) written before")


def _runs_on(canary: Any, rid: str) -> bool:
    """The request has at least one more step after this one (it has tokens left to generate)."""
    state = canary.runner.requests.get(rid)
    params = getattr(state, "sampling_params", None)
    limit = getattr(params, "max_tokens", None)
    if state is None or not isinstance(limit, int):
        return False
    return len(state.output_token_ids) + 1 < limit


class RankKvBitflip(KvBitflip):
    """``kv-bitflip`` confined to the last tensor-parallel rank (any ``rank`` given overrides it)."""

    kind = "rank-kv-bitflip"

    def here(self, canary: Any) -> bool:
        from .distributed import worker_rank

        rank, world = worker_rank(canary.runner)
        return rank == (world - 1 if self.rank is None else self.rank)


INJECTORS: dict[str, type[Injector]] = {cls.kind: cls for cls in (
    KvBitflip, BlockTableRedirect, SlotMappingRedirect, PrefixUnwritten, PrefixForeign, PreemptReuse, WrongToken,
    PositionShift, KvElementSize, RankKvBitflip, WindowReuse, GroupHandover)}

# Faults that need an engine with speculative decoding (``speculative_config``: ngram or draft_model).
SPECULATIVE_FAULT_KINDS: dict[str, str] = {
    "draft-rejected-kept": "a rejected draft's K/V stays in place and is read as the token sampled for its position "
                           "(vllm#47466)",
}
SPECULATIVE_INJECTORS: dict[str, type[Injector]] = {RejectedDraftKept.kind: RejectedDraftKept}


# the model kinds with a sliding-window group, and those with two attention groups that alias each other
WINDOWED_ARCHS = ("mistral-sw", "gemma3")
HYBRID_ARCHS = ("gemma3",)


# Fault kinds whose target the engine of a model kind never produces, and why (measured on vLLM 0.32's CPU build
# with these models and budgets): they are not among that model kind's kinds.
_QWEN3_NEXT_BLOCKS = ("vLLM sizes the attention group's blocks to the Mamba state's page: 288 tokens, more than the "
                      "256-token max_model_len, so no block is ever complete")
_NO_PREEMPTION = "the KV budget this model kind needs to run holds every workload: vLLM never preempts"
NO_TARGET: dict[str, dict[str, str]] = {
    "deepseek-mla": {
        "prefix-unwritten": "vLLM's CPU build turns prefix caching off for an MLA model: no prefix-cache hit",
        "prefix-foreign": "vLLM's CPU build turns prefix caching off for an MLA model: no prefix-cache hit",
        "preempt-reuse": _NO_PREEMPTION,
    },
    "qwen3-next": {
        "block-table": f"{_QWEN3_NEXT_BLOCKS}: no complete block of another request to point at",
        "prefix-unwritten": f"{_QWEN3_NEXT_BLOCKS}: no prefix-cache hit",
        "prefix-foreign": f"{_QWEN3_NEXT_BLOCKS}: no prefix-cache hit",
        "preempt-reuse": _NO_PREEMPTION,
    },
}


def fault_kinds(model_arch: str = "llama", speculative: str | None = None) -> dict[str, str]:
    """The fault kinds a run of ``model_arch`` (with ``speculative`` decoding or not) can inject, what
    ``--inject all`` stands for: every kind of :data:`FAULT_KINDS` but those the model kind's engine gives
    no target (:data:`NO_TARGET`), the window faults where the model has a sliding-window group
    (``group-handover`` where it also has a second group), the rejected-draft fault with speculative decoding."""
    kinds = {k: v for k, v in FAULT_KINDS.items() if k not in NO_TARGET.get(model_arch, {})}
    if model_arch in WINDOWED_ARCHS:
        kinds["window-reuse"] = MODEL_FAULT_KINDS["window-reuse"]
    if model_arch in HYBRID_ARCHS:
        kinds["group-handover"] = MODEL_FAULT_KINDS["group-handover"]
    if speculative is not None:
        kinds.update(SPECULATIVE_FAULT_KINDS)
    return kinds


def injector(kind: str, at: int = 0, seed: int = 0, rank: int | None = None) -> Injector:
    """An armed injector of ``kind`` (one of :data:`FAULT_KINDS`, :data:`MODEL_FAULT_KINDS`, or of
    :data:`SPECULATIVE_FAULT_KINDS` on an engine with speculative decoding), firing in every worker or in the
    worker of ``rank`` only."""
    from ..._errors import fail

    kinds = {**INJECTORS, **SPECULATIVE_INJECTORS}
    if kind not in kinds:
        fail(f"fault kind must be one of {sorted(kinds)}, got {kind!r}")
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or rank < 0):
        fail(f"rank must be a non-negative integer or None, got {rank!r}")
    return kinds[kind](at, seed, rank)
