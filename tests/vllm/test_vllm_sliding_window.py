"""Sliding-window KV cache groups (Mistral: every layer; Gemma2/3: alternating with full attention), driven without
an engine: a stand-in for the parts of vLLM's model runner the canary reads, with vLLM's own ``SlidingWindowSpec``
and ``FullAttentionSpec``, and each step's block tables written by hand the way vLLM 0.32 builds them (fact sheet
Q2): the scheduler frees a request's blocks once they are wholly below its window (``q - window + 1`` for a query at
``q``) and hands them out again at once, while the worker's block table keeps their ids; a prefix hit puts the null
block (id 0) where the window does not reach; the groups of a hybrid model share one block pool, and a layer of
one group and a layer of the other address the same bytes. The runtime behind it is the real one (NumPy backend).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

from kvcanary_cupy.integrations.vllm.canary import CanaryOptions, VllmCanaryState, build_step

# vLLM's CPU attention, as a layer names it (``layer.attn_backend.get_name()``): the layers' cache is read with
# the CPU layout of their ``isa``
CPU_ATTENTION = SimpleNamespace(get_name=lambda: "CPU_ATTN")

BS = 4  # tokens per block
WINDOW = 6  # a query at q reads q - 5 .. q
SW, FULL = 0, 1  # the hybrid model's group indices (vLLM's order for Gemma3: sliding-window first)
LAYERS = {SW: "model.layers.0.self_attn.attn", FULL: "model.layers.1.self_attn.attn"}


@dataclass
class Row:
    """One scheduled request: its token history, ``prefix`` tokens cached, ``extend`` new ones, and its block
    table row per group (as the worker holds it: stale ids kept, the null block 0 where a hit skipped)."""

    rid: str
    tokens: list[int]
    prefix: int
    extend: int
    blocks: dict[int, list[int]] = field(default_factory=dict)


class Runner:
    """The parts of vLLM's V1 model runner the canary reads: a sliding-window group and, for a hybrid model, a
    full-attention group whose layer aliases the same KV tensor (one backing buffer, as vLLM allocates it)."""

    def __init__(self, *, hybrid: bool, num_blocks: int = 32, max_num_tokens: int = 64) -> None:
        self.cache = torch.zeros(num_blocks, 1, BS, 16)
        specs = {SW: SlidingWindowSpec(block_size=BS, num_kv_heads=1, head_size=8, dtype=torch.float32,
                                       sliding_window=WINDOW)}
        if hybrid:
            specs[FULL] = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=8, dtype=torch.float32)
        self.groups = sorted(specs)
        self.kv_caches = [self.cache] * len(specs)
        self.compilation_config = SimpleNamespace(static_forward_context={
            LAYERS[g]: SimpleNamespace(kv_cache=self.cache, isa="vec", attn_backend=CPU_ATTENTION)
            for g in specs})
        self.kv_cache_config = SimpleNamespace(kv_cache_groups=[
            SimpleNamespace(kv_cache_spec=specs[g], layer_names=[LAYERS[g]]) for g in self.groups])
        self.max_num_reqs, self.max_model_len, self.max_num_tokens = 8, 64, max_num_tokens
        self.requests: dict[str, SimpleNamespace] = {}
        self.input_batch = SimpleNamespace(num_reqs=0, req_ids=[])

    # the two methods the canary wraps (their presence makes this a V1 model runner)
    def execute_model(self, scheduler_output) -> None:
        return None

    def _model_forward(self, **kwargs) -> None:
        return None

    def inputs(self, rows: list[Row]) -> tuple[dict, dict]:
        self.input_batch = SimpleNamespace(num_reqs=len(rows), req_ids=[r.rid for r in rows])
        ids, pos, cu = [], [], [0]
        slot_maps: dict[int, list[int]] = {g: [] for g in self.groups}
        for r in rows:
            self.requests[r.rid] = SimpleNamespace(prompt_token_ids=r.tokens[: r.prefix + r.extend],
                                                   output_token_ids=[])
            for p in range(r.prefix, r.prefix + r.extend):
                ids.append(r.tokens[p])
                pos.append(p)
                for g in self.groups:
                    slot_maps[g].append(r.blocks[g][p // BS] * BS + p % BS)
            cu.append(len(ids))
        metadata = {}
        for g in self.groups:
            width = max(len(r.blocks[g]) for r in rows)
            table = torch.zeros(len(rows), width, dtype=torch.int32)
            for i, r in enumerate(rows):
                table[i, : len(r.blocks[g])] = torch.tensor(r.blocks[g], dtype=torch.int32)
            metadata[LAYERS[g]] = SimpleNamespace(
                query_start_loc=torch.tensor(cu, dtype=torch.int32),
                seq_lens=torch.tensor([r.prefix + r.extend for r in rows], dtype=torch.int32),
                block_table=table, slot_mapping=torch.tensor(slot_maps[g], dtype=torch.int64))
        return {"input_ids": torch.tensor(ids, dtype=torch.int64), "positions": torch.tensor(pos)}, metadata


def canary_state(runner: Runner, **opts) -> VllmCanaryState:
    return VllmCanaryState(runner, CanaryOptions(**{"mode": "log", "real_kv_hash": "partial", "backend": "numpy",
                                                    "sweep_interval": 0, **opts}))


def write_token(cache: torch.Tensor, slot: int, kv: torch.Tensor) -> None:
    """One token's K (``kv[:8]``) and V (``kv[8:]``) written as vLLM's CPU attention (``vec``) stores them: per
    (block, head) K column-major ``[head_size, block_size]``, then V row-major ``[block_size, head_size]``."""
    block, t = divmod(slot, BS)
    plane = cache[block, 0].reshape(-1)  # a view: [BS * 16]
    plane[torch.arange(8) * BS + t] = kv[:8]
    plane[8 * BS + t * 8: 8 * BS + t * 8 + 8] = kv[8:]


def run_step(state: VllmCanaryState, runner: Runner, rows: list[Row], seed: int = 0):
    """One engine step through the canary's four phases; each group's layer writes random K/V where its slot
    mapping says (the groups in vLLM's layer order, so an aliased block holds the last group's bytes)."""
    kwargs, md = runner.inputs(rows)
    batch = build_step(state.steps, runner, kwargs, md, state.geos, state.max_tokens, state.unstamped,
                       state.histories)
    state.before_forward(batch)
    gen = torch.Generator().manual_seed(seed * 1000 + state.steps)
    for g in runner.groups:
        for slot in md[LAYERS[g]].slot_mapping.tolist():
            write_token(runner.cache, slot, torch.rand(16, generator=gen) + 1)
    state.after_forward(batch, {g: md[LAYERS[g]].slot_mapping.numpy().astype(np.int64) for g in runner.groups})
    state.settle()  # the TAIL thread's bookkeeping, read by the assertions below
    return batch


def verified(state: VllmCanaryState) -> dict[str, int]:
    """Entries the HEAD K verify of each runtime group checked so far."""
    return {tag_group: slots for (tag_group, tag, op), (slots, _) in state.rt.run_counters().items()
            if op == "verify" and tag.startswith("HEAD_K")}


def flagged(state: VllmCanaryState) -> set[tuple[int, str, int, tuple[str, ...]]]:
    state.flush()
    return {(v.step, v.group, v.violation.slot, tuple(sorted(v.violation.reasons))) for v in state.violations}


def tokens(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(10, 30000, n).tolist()


def both(sw: list[int], full: list[int] | None, hybrid: bool) -> dict[int, list[int]]:
    return {SW: sw, FULL: full if full is not None else sw} if hybrid else {SW: sw}


def window_reuse(seed: int, hybrid: bool) -> tuple[list[list[Row]], dict[str, int]]:
    """Hand-worked schedule (blocks of 4, window 6).
    step 0: A prefills 12 tokens: SW blocks 1, 2, 3 (hybrid: full blocks 11, 12, 13).
    step 1: A decodes position 12 (window 7..12): its SW block 1 (positions 0..3) was freed and B, a new
      request, gets it at once and writes 4 tokens there; A's row still lists block 1 and its new block 4.
    step 2: A decodes 13 (window 8..13): block 2 (positions 4..7) freed and handed to C; B decodes position 4
      (window 0..4, everything) into block 5 (hybrid: B's full blocks 14, 15, C's 16).
    The verify of each step, per request, covers exactly its window before the query:
    A: 5 (7..11) at step 1, 5 (8..12) at step 2; B: 4 (0..3) at step 2."""
    a_tok, b_tok, c_tok = tokens(seed, 20), tokens(seed + 1, 8), tokens(seed + 2, 8)
    a_full = [11, 12, 13, 10]
    step0 = [Row("A", a_tok, 0, 12, both([1, 2, 3], a_full[:3], hybrid))]
    step1 = [Row("A", a_tok, 12, 1, both([1, 2, 3, 4], a_full, hybrid)),
             Row("B", b_tok, 0, 4, both([1], [14], hybrid))]
    step2 = [Row("A", a_tok, 13, 1, both([1, 2, 3, 4], a_full, hybrid)),
             Row("B", b_tok, 4, 1, both([1, 5], [14, 15], hybrid)),
             Row("C", c_tok, 0, 4, both([2], [16], hybrid))]
    return [step0, step1, step2], {"G0": 5 + 5 + 4}


@pytest.mark.parametrize("hybrid", [False, True], ids=["mistral", "gemma"])
@pytest.mark.parametrize("seed", range(4))
def test_a_window_group_verifies_exactly_the_positions_its_window_reads_and_never_a_freed_block(seed, hybrid):
    runner = Runner(hybrid=hybrid)
    state = canary_state(runner)
    steps, want = window_reuse(seed, hybrid)
    for rows in steps:
        run_step(state, runner, rows, seed)
    assert flagged(state) == set()
    got = verified(state)
    assert got["G0"] == want["G0"]
    if hybrid:  # the full-attention group verifies every cached position: A 12 + 13, B 4
        assert got["G1"] == 12 + 13 + 4


@pytest.mark.parametrize("hybrid", [False, True], ids=["mistral", "gemma"])
@pytest.mark.parametrize("seed", range(4))
def test_a_block_freed_while_the_window_still_reads_it_is_caught(seed, hybrid):
    """The same schedule, but at step 2 C is given A's SW block 3 (positions 8..11, inside A's window 8..13)
    instead of the freed block 2. Worked by hand: C's K/V land on A's positions 8..11, so step 2's TAIL verify
    of A flags slots 12..15 by their bytes; C's records replace A's there, so at step 3 (A's window 9..13) slots
    13..15 show C's tokens and positions and slot 16 (position 12) a broken chain. Slot 12 has left the window
    by then and is not read again; the full-attention group is untouched."""
    runner = Runner(hybrid=hybrid)
    state = canary_state(runner)
    steps, _ = window_reuse(seed, hybrid)
    steps[2][2].blocks[SW] = [3]
    a_tok = steps[0][0].tokens
    step3 = [Row("A", a_tok, 14, 1, both([1, 2, 3, 4], [11, 12, 13, 10], hybrid))]
    for rows in [*steps, step3]:
        run_step(state, runner, rows, seed)
    real_kv, records = ("VERIFY_REAL_KV_HASH_MISMATCH",), ("VERIFY_POSITION_MISMATCH", "VERIFY_TOKEN_MISMATCH")
    assert flagged(state) == ({(2, "G0", 3 * BS + k, real_kv) for k in range(BS)}
                              | {(3, "G0", 3 * BS + k, records) for k in (1, 2, 3)}
                              | {(3, "G0", 4 * BS, ("VERIFY_CHAIN_HASH_MISMATCH",))})


@pytest.mark.parametrize("seed", range(4))
def test_null_blocks_of_a_prefix_hit_are_never_verified(seed):
    """B repeats A's 12-token prompt plus 4 tokens: a prefix hit on 12 tokens whose window (7..11 for the query
    at 12) leaves the first block out: vLLM puts the null block 0 there. The canary verifies 7..11 only (5), from
    A's blocks 2 and 3, and the null block's slots, never written, are never read."""
    runner = Runner(hybrid=False)
    state = canary_state(runner)
    q = tokens(seed, 16)
    run_step(state, runner, [Row("A", q[:12], 0, 12, {SW: [1, 2, 3]})], seed)
    run_step(state, runner, [Row("B", q, 12, 4, {SW: [0, 2, 3, 4]})], seed)
    assert flagged(state) == set()
    assert verified(state)["G0"] == 5
    # nor is the null block indexed for the sweep (A's block 1 stays: no row of the step shows it freed)
    assert state.block_index.indexed(SW).tolist() == [1, 2, 3, 4]


def hybrid_handover(seed: int, fault: bool) -> tuple[Runner, VllmCanaryState]:
    """A hybrid model: A prefills 12 tokens (SW blocks 1, 2, 3; full blocks 4, 5, 6), then decodes. At step 1
    its SW window (7..12) has left block 1, which vLLM frees and hands to B's *full-attention* group: B's full
    layer writes block 1's bytes, which are the SW layer's bytes too. With ``fault`` the block handed over is
    A's SW block 2 (positions 4..7, position 7 still in A's window at step 1), still referenced."""
    runner = Runner(hybrid=True)
    state = canary_state(runner)
    q, b_tok = tokens(seed, 20), tokens(seed + 1, 8)
    run_step(state, runner, [Row("A", q, 0, 12, {SW: [1, 2, 3], FULL: [4, 5, 6]})], seed)
    given = 2 if fault else 1
    run_step(state, runner, [Row("A", q, 12, 1, {SW: [1, 2, 3, 7], FULL: [4, 5, 6, 8]}),
                             Row("B", b_tok, 0, 4, {SW: [9], FULL: [given]})], seed)
    run_step(state, runner, [Row("A", q, 13, 1, {SW: [1, 2, 3, 7], FULL: [4, 5, 6, 8]}),
                             Row("B", b_tok, 4, 1, {SW: [9, 10], FULL: [given, 11]})], seed)
    return runner, state


@pytest.mark.parametrize("seed", range(4))
def test_a_block_that_left_the_window_and_moved_to_the_other_group_is_not_verified(seed):
    _, state = hybrid_handover(seed, fault=False)
    assert flagged(state) == set()


@pytest.mark.parametrize("seed", range(4))
def test_a_block_handed_to_the_other_group_while_still_referenced_is_caught(seed):
    """B's full-attention layer writes block 2 in step 1, whose bytes are A's SW positions 4..7; A's window at
    step 1 (7..12) still reads position 7 (slot 11): step 1's TAIL verify flags exactly that slot, by its bytes
    (the SW group's records are its own and unchanged). At step 2 the window has left block 2."""
    _, state = hybrid_handover(seed, fault=True)
    assert flagged(state) == {(1, "G0", 2 * BS + 3, ("VERIFY_REAL_KV_HASH_MISMATCH",))}


# -- a same-step prefix hit whose re-stamps reach below a window ---------------------------------------------

@pytest.mark.parametrize("hybrid", [False, True], ids=["mistral", "gemma"])
@pytest.mark.parametrize("seed", range(4))
def test_a_same_step_hit_reaching_below_the_window_restamps_from_zero_and_skips_the_stale_part(seed, hybrid):
    """Step 0: A writes an 8-token prompt (SW blocks 1, 2; full 11, 12). Step 1: the siblings B1, B2 of a
    20-token prompt beginning with A's: B1 hits A's blocks and writes 8..19 (SW blocks 3, 4, 5); B2, next to
    it, hits 16 tokens (blocks 3 and 4 cached when B1 was given them, written in this very step) and writes
    16..19 into block 6. B2's window (11..16) leaves its first two SW blocks out: the null block there. B2's
    same-step tail starts at 8, inside the SW group's stale part, so B2 re-stamps from 0: 8..15 where each
    group's table says, except the SW group's 8..10 (below its window), and 0..7 (cached before the step, not
    to be re-stamped over) into slot 0 (the null block, never verified: the records there only carry the chain
    from position 0 on, so that B2's records equal B1's). Nothing is flagged, then or when both decode."""
    runner = Runner(hybrid=hybrid)
    state = canary_state(runner)
    q = tokens(seed, 24)
    run_step(state, runner, [Row("A", q[:8], 0, 8, both([1, 2], [11, 12], hybrid))], seed)
    b1 = Row("B1", q[:20], 8, 12, both([1, 2, 3, 4, 5], [11, 12, 13, 14, 15], hybrid))
    b2 = Row("B2", q[:20], 16, 4, both([0, 0, 3, 4, 6], [11, 12, 13, 14, 16], hybrid))
    batch = run_step(state, runner, [b1, b2], seed)
    assert batch.prefix_lens.tolist() == [8, 0] and batch.extend_lens.tolist() == [12, 20]
    sw = [b * BS + k for b in (1, 2, 3, 4, 5) for k in range(BS)]
    assert batch.slot_mappings[SW].tolist() == sw[8:20] + [0] * 11 + sw[11:16] + [6 * BS + k for k in range(4)]
    if hybrid:
        full = [b * BS + k for b in (11, 12, 13, 14, 15, 16) for k in range(BS)]
        assert batch.slot_mappings[FULL].tolist() == full[8:20] + [0] * 8 + full[8:16] + full[20:24]
    # then both decode: B2's window 12..20 reads its re-stamped slots and the step-1 writes
    b1.prefix, b1.extend, b2.prefix, b2.extend = 20, 1, 20, 1
    b1.tokens = b2.tokens = q[:21]
    b1.blocks = both([1, 2, 3, 4, 5, 7], [11, 12, 13, 14, 15, 17], hybrid)
    b2.blocks = both([0, 0, 3, 4, 6, 8], [11, 12, 13, 14, 16, 18], hybrid)
    run_step(state, runner, [b1, b2], seed)
    assert flagged(state) == set()


@pytest.mark.parametrize("seed", range(4))
def test_a_restamp_from_zero_does_not_launder_a_corrupted_cached_block(seed):
    """The hybrid schedule above, with a byte of A's full-attention block 11 (position 0's K) flipped between
    step 0 and step 1: B1 verifies it at step 1 and both siblings at step 2, each time flagged, because B2's
    re-stamp from 0 carries its chain through slot 0 instead of stamping the corrupted bytes' hash over
    position 0's records."""
    runner = Runner(hybrid=True)
    state = canary_state(runner)
    q = tokens(seed, 24)
    run_step(state, runner, [Row("A", q[:8], 0, 8, {SW: [1, 2], FULL: [11, 12]})], seed)
    runner.cache[11, 0].reshape(-1)[0] += 1.0  # K[element 0] of slot 44 (column-major: token 0 first)
    b1 = Row("B1", q[:20], 8, 12, {SW: [1, 2, 3, 4, 5], FULL: [11, 12, 13, 14, 15]})
    b2 = Row("B2", q[:20], 16, 4, {SW: [0, 0, 3, 4, 6], FULL: [11, 12, 13, 14, 16]})
    run_step(state, runner, [b1, b2], seed)
    b1.prefix, b1.extend, b2.prefix, b2.extend = 20, 1, 20, 1
    b1.tokens = b2.tokens = q[:21]
    b1.blocks = {SW: [1, 2, 3, 4, 5, 7], FULL: [11, 12, 13, 14, 15, 17]}
    b2.blocks = {SW: [0, 0, 3, 4, 6, 8], FULL: [11, 12, 13, 14, 16, 18]}
    run_step(state, runner, [b1, b2], seed)
    assert {(step, group, slot) for step, group, slot, _ in flagged(state)} == {(1, "G1", 44), (2, "G1", 44)}


@pytest.mark.parametrize("hybrid", [False, True], ids=["mistral", "gemma"])
@pytest.mark.parametrize("seed", range(4))
def test_a_same_step_hit_inside_the_window_verifies_nothing_below_the_window(seed, hybrid):
    """Step 0: A writes 12 tokens (SW blocks 1, 2, 3; full 11, 12, 13). Step 1: B1 hits A's 12 and writes
    12..19 (SW blocks 4, 5); B2, next to it, hits 16 (block 4 written in this very step) and writes 16..19
    into block 6. vLLM's SW rows: B1 ``[0, 2, 3, 4, 5]`` (its window 7..12 leaves block 0 out), B2
    ``[0, 0, 3, 4, 6]`` (window 11..16). B2 re-stamps 12..15 and its canary prefix is 12, so the runtime's
    window reaches back to 7: positions 7..10 are below B2's real window (the null block and A's block 3, not
    B2's to vouch for) and must read as slot 0, unverified. Nothing is flagged."""
    runner = Runner(hybrid=hybrid)
    state = canary_state(runner)
    q = tokens(seed, 24)
    run_step(state, runner, [Row("A", q[:12], 0, 12, both([1, 2, 3], [11, 12, 13], hybrid))], seed)
    b1 = Row("B1", q[:20], 12, 8, both([0, 2, 3, 4, 5], [11, 12, 13, 14, 15], hybrid))
    b2 = Row("B2", q[:20], 16, 4, both([0, 0, 3, 4, 6], [11, 12, 13, 14, 16], hybrid))
    batch = run_step(state, runner, [b1, b2], seed)
    assert batch.prefix_lens.tolist() == [12, 12] and batch.extend_lens.tolist() == [8, 8]
    assert state.tables[SW][2, :16].tolist() == [0] * 11 + [15, 16, 17, 18, 19]
    assert flagged(state) == set()


def window_block_taken_in_step(seed: int, b_token_7: int | None = None):
    """The schedule vLLM's engine core gave a Gemma3-style model when a shared prompt's requests arrived while the
    first one was running (blocks of 4, window 6). Step 0: A prefills a 12-token prompt (SW blocks 1, 2, 3; full
    11, 12, 13). Step 1: A decodes 12 (window 7..12; SW block 1 freed). Step 2: A decodes 13 (window 8..13: SW
    block 2, positions 4..7, freed and handed out again); B, with the same prompt and no hit, prefills 16
    tokens into SW blocks 5, 6, 7, 8 (full 15..18), its SW block 6 (positions 4..7) cached as it is given out;
    C, the same prompt again, hits 12 tokens: its window (7..12) reads position 7 from B's block 6, written in
    this very step, and 8..11 from A's block 3, cached before; its full-attention hit is A's. With
    ``b_token_7``, B's prompt differs at position 7: C's table then points at a slot B writes with another
    token, a fault."""
    q = tokens(seed, 20)
    a_tok, c_tok = q[:15], q[:12] + tokens(seed + 1, 5)
    b_tok = q[:12] + tokens(seed + 2, 5)
    if b_token_7 is not None:
        b_tok[7] = b_token_7
    step0 = [Row("A", a_tok, 0, 12, {SW: [1, 2, 3], FULL: [11, 12, 13]})]
    step1 = [Row("A", a_tok, 12, 1, {SW: [1, 2, 3, 4], FULL: [11, 12, 13, 14]})]
    step2 = [Row("A", a_tok, 13, 1, {SW: [1, 2, 3, 4], FULL: [11, 12, 13, 14]}),
             Row("B", b_tok, 0, 16, {SW: [5, 6, 7, 8], FULL: [15, 16, 17, 18]}),
             Row("C", c_tok, 12, 4, {SW: [0, 6, 3, 9], FULL: [11, 12, 13, 19]})]
    step3 = [Row("A", a_tok, 14, 1, {SW: [1, 2, 3, 4], FULL: [11, 12, 13, 14]}),
             Row("B", b_tok, 16, 1, {SW: [5, 6, 7, 8, 10], FULL: [15, 16, 17, 18, 20]}),
             Row("C", c_tok, 16, 1, {SW: [0, 6, 3, 9, 21], FULL: [11, 12, 13, 19, 22]})]
    return [step0, step1, step2, step3]


@pytest.mark.parametrize("seed", range(4))
def test_a_window_block_another_request_writes_in_the_step_is_restamped_not_verified(seed):
    """``window_block_taken_in_step``: C's same-step slot is the first of its window, with cached blocks after it
    (the last prefix slot, which an anchor group's tail would show, is not written in the step). C re-stamps from
    0 (its same-step position is its window's first): position 7 into B's slot 27 (B stamps the identical
    record), everything cached before the step or below the window into slot 0, in both groups; A's window
    (8..13) verifies A's block 3 in this step, and C's own window verifies it from step 3 on. Nothing is
    flagged."""
    runner = Runner(hybrid=True)
    state = canary_state(runner)
    steps = window_block_taken_in_step(seed)
    for rows in steps[:2]:
        run_step(state, runner, rows, seed)
    batch = run_step(state, runner, steps[2], seed)
    assert batch.prefix_lens.tolist() == [13, 0, 0] and batch.extend_lens.tolist() == [1, 16, 16]
    sw_b = [b * BS + k for b in (5, 6, 7, 8) for k in range(BS)]
    assert batch.slot_mappings[SW].tolist() == [4 * BS + 1] + sw_b + [0] * 7 + [6 * BS + 3] + [0] * 4 + [
        9 * BS + k for k in range(BS)]
    full_b = [b * BS + k for b in (15, 16, 17, 18) for k in range(BS)]
    assert batch.slot_mappings[FULL].tolist() == [14 * BS + 1] + full_b + [0] * 12 + [19 * BS + k for k in range(BS)]
    run_step(state, runner, steps[3], seed)
    assert flagged(state) == set()


@pytest.mark.parametrize("seed", range(4))
def test_a_window_slot_another_request_writes_with_another_token_is_verified_and_flagged(seed):
    """The same schedule, but B's prompt differs at position 7: C's table points at slot 27, which B writes with
    another token in this step. That slot is not C's to re-stamp: C verifies its window 7..11 at step 2 and the
    verify flags slot 27 (not stamped when the step's verify reads it) and, by its chain, slot 12 (position 8,
    whose predecessor it is)."""
    runner = Runner(hybrid=True)
    state = canary_state(runner)
    steps = window_block_taken_in_step(seed, b_token_7=7)
    batches = [run_step(state, runner, rows, seed) for rows in steps]
    assert batches[2].prefix_lens.tolist() == [13, 0, 12]
    assert {(step, group, slot) for step, group, slot, _ in flagged(state)} == {(2, "G0", 27), (2, "G0", 12)}


# -- the sweep's block index of a window group ----------------------------------------------------------------

@pytest.mark.parametrize("seed", range(3))
def test_the_sweep_index_leaves_out_block_ids_below_a_window_and_follows_a_reused_block(seed):
    """The schedule of ``window_reuse`` (one SW group): after step 0 A's blocks 1, 2, 3 are indexed at 0, 1, 2.
    Step 1: A's row still lists block 1 below its window; B fills block 1 completely: it is B's block 0 now
    (a stale entry taken for A's would put it back at 0 of A's sequence only by chance: B's index is asserted
    by the sweep finding nothing wrong). Step 2: C fills block 2: C's block 0. A sweep then verifies every
    indexed block not held by the last step's rows without a finding."""
    runner = Runner(hybrid=False)
    state = canary_state(runner, sweep_interval=1)
    steps, _ = window_reuse(seed, False)
    run_step(state, runner, steps[0], seed)
    assert {b: int(state.block_index.where[0][b]) for b in state.block_index.indexed(0)} == {1: 0, 2: 1, 3: 2}
    run_step(state, runner, steps[1], seed)
    assert {b: int(state.block_index.where[0][b]) for b in state.block_index.indexed(0)} == {1: 0, 2: 1, 3: 2}
    assert state.block_index.live[0].nonzero()[0].tolist() == [1, 2, 3, 4]  # A's 1 is B's now: held by B
    run_step(state, runner, steps[2], seed)
    assert {b: int(state.block_index.where[0][b]) for b in state.block_index.indexed(0)} == {1: 0, 2: 0, 3: 2}
    # A holds 3, 4 (its window 8..13), B 1, 5, C 2; A's stale ids 1, 2 are not taken as A's
    assert state.block_index.live[0].nonzero()[0].tolist() == [1, 2, 3, 4, 5]
    assert flagged(state) == set()


@pytest.mark.parametrize("seed", range(3))
def test_blocks_listed_to_zero_leave_every_groups_index(seed):
    """A hybrid model (vLLM sends ``new_block_ids_to_zero`` for Mamba and mixed-precision caches): a block id
    is global across groups, so each listed id leaves the index of every group that holds it."""
    runner = Runner(hybrid=True)
    state = canary_state(runner)
    run_step(state, runner, [Row("A", tokens(seed, 8), 0, 8, {SW: [1, 2], FULL: [3, 4]})], seed)
    assert sorted(state.block_index) == [(SW, 1), (SW, 2), (FULL, 3), (FULL, 4)]
    state.forget_blocks([2, 3, 30])
    assert sorted(state.block_index) == [(SW, 1), (FULL, 4)]


# -- the sweep of a hybrid model: each group's own blocks, a block leaves every other group's index -------------

def swept(state: VllmCanaryState) -> set[tuple[str, str, int, tuple[str, ...]]]:
    """What the sweeps found: (canary group, launch tag, slot, reasons) of each SWEEP row."""
    state.flush()
    return {(v.group, v.violation.launch_tag, v.violation.slot, tuple(v.violation.reasons))
            for v in state.violations if v.violation.launch_tag.startswith("SWEEP")}


def flip_k(runner: Runner, slot: int) -> None:
    """One bit of a token's K element 0 (column-major: token ``t`` of a block is element ``t`` of the plane);
    the groups' layers share the tensor, so this is the token's K in whichever group holds the block."""
    block, t = divmod(slot, BS)
    plane = runner.cache[block, 0].reshape(-1).view(torch.int32)
    plane[t] ^= 1 << 20


@pytest.mark.parametrize("seed", range(4))
def test_the_hybrid_sweep_verifies_each_groups_own_cached_blocks_and_finds_a_flip_in_each(seed):
    """A (12 tokens: SW blocks 1, 2, 3; full 4, 5, 6) finishes; C, unrelated (SW 7, full 8), runs two steps, each
    with a sweep. Worked by hand: the SW group holds A's blocks 1, 2, 3 (A's last step, queries from 8, read from
    3 on: block 1 still in its window), the full group 4, 5, 6; the first sweep finds nothing. Then one bit of A's
    SW block 3 (slot 13) and one of its full block 5 (slot 21) flip: the second sweep finds each in its own group
    by its bytes, and nothing else (a sweep of one slot list on both groups would verify the SW blocks' slots
    on the full group, whose records there are empty, and miss the full group's blocks)."""
    runner = Runner(hybrid=True)
    state = canary_state(runner, sweep_interval=1)
    q = tokens(seed, 13)
    run_step(state, runner, [Row("A", q[:12], 0, 8, {SW: [1, 2], FULL: [4, 5]})], seed)
    run_step(state, runner, [Row("A", q[:12], 8, 4, {SW: [1, 2, 3], FULL: [4, 5, 6]})], seed)
    c = Row("C", tokens(seed + 1, 8), 0, 2, {SW: [7], FULL: [8]})
    run_step(state, runner, [c], seed)
    assert swept(state) == set() and not state.violations
    assert sorted(state.block_index) == [(SW, 1), (SW, 2), (SW, 3), (FULL, 4), (FULL, 5), (FULL, 6)]
    flip_k(runner, 3 * BS + 1)
    flip_k(runner, 5 * BS + 1)
    c.prefix, c.extend = 2, 1
    run_step(state, runner, [c], seed)
    real_kv = ("VERIFY_REAL_KV_HASH_MISMATCH",)
    assert swept(state) == {("G0", "SWEEP_K_SWA", 3 * BS + 1, real_kv), ("G1", "SWEEP_K_FULL", 5 * BS + 1, real_kv)}
    assert {(v.group, v.violation.slot) for v in state.violations} == {("G0", 13), ("G1", 21)}


@pytest.mark.parametrize("seed", range(4))
def test_a_cached_block_taken_by_the_other_group_leaves_the_first_groups_sweep(seed):
    """A (8 tokens: SW blocks 1, 2; full 3, 4) finishes: its SW blocks 1, 2 are cached and indexed. vLLM then
    evicts block 2 and hands it to B's full-attention group, whose layer writes its bytes (the SW layer's bytes
    too). B's SW row never names block 2, so only the full group's table shows the move: the SW group's index
    must drop it in that step, and the sweeps then find nothing (a sweep of block 2 as A's SW block would read
    B's bytes against A's records)."""
    runner = Runner(hybrid=True)
    state = canary_state(runner, sweep_interval=1)
    run_step(state, runner, [Row("A", tokens(seed, 8), 0, 8, {SW: [1, 2], FULL: [3, 4]})], seed)
    b = Row("B", tokens(seed + 1, 8), 0, 4, {SW: [5], FULL: [2]})
    run_step(state, runner, [b], seed)
    assert sorted(state.block_index) == [(SW, 1), (SW, 5), (FULL, 2), (FULL, 3), (FULL, 4)]
    b.prefix, b.extend, b.blocks = 4, 1, {SW: [5, 6], FULL: [2, 7]}
    run_step(state, runner, [b], seed)  # block 2 is no longer held by the step: the sweep reads it in G1 only
    assert flagged(state) == set()


@pytest.mark.parametrize("seed", range(4))
def test_the_sweep_index_keeps_only_blocks_a_window_still_reads(seed):
    """One SW group. A prefills 12 tokens (blocks 1, 2, 3). Step 1: A decodes 12 (window 7..12: block 1 left
    it) next to B, a prefix hit on A's first 8 tokens writing 8 into block 5 (window 3..8: B still reads blocks 1
    and 2), so block 1 stays indexed. Step 2: A alone decodes 13 (window 8..13): A's row shows blocks 1 and 2
    below its window and no row of the step holds them: both leave the index (vLLM frees a block once no window
    reads it and may hand it out at once; the index cannot see B's claim while B is not scheduled, and drops).
    Step 3: B decodes 9 (window 4..9): its block 2 is indexed again, block 1 stays out. No sweep reads a block
    outside the index, and nothing is flagged."""
    runner = Runner(hybrid=False)
    state = canary_state(runner, sweep_interval=1)
    q = tokens(seed, 16)
    b_tok = q[:8] + tokens(seed + 1, 4)
    run_step(state, runner, [Row("A", q, 0, 12, {SW: [1, 2, 3]})], seed)
    assert state.block_index.indexed(SW).tolist() == [1, 2, 3]
    run_step(state, runner, [Row("A", q, 12, 1, {SW: [1, 2, 3, 4]}), Row("B", b_tok, 8, 1, {SW: [1, 2, 5]})], seed)
    assert state.block_index.indexed(SW).tolist() == [1, 2, 3]
    run_step(state, runner, [Row("A", q, 13, 1, {SW: [1, 2, 3, 4]})], seed)
    assert state.block_index.indexed(SW).tolist() == [3]
    run_step(state, runner, [Row("B", b_tok, 9, 1, {SW: [1, 2, 5]})], seed)
    assert state.block_index.indexed(SW).tolist() == [2, 3]
    assert flagged(state) == set()


@pytest.mark.parametrize("foreign_in", [SW, FULL], ids=["window-group", "full-group"])
@pytest.mark.parametrize("seed", range(3))
def test_a_slot_one_group_alone_reads_from_another_request_now_bounds_the_hybrid_restamp(seed, foreign_in):
    """Gemma-like (window 6). Step 1 (P wrote positions 0..3 into blocks 1 and 11 before): A computes 4..7
    into blocks 2 (window group) and 12 (full group); C, an unrelated request, writes its positions 0..3 into
    blocks 5 and 15; B (A's prompt, prefix 12) holds A's blocks for 4..7, and for 8..11, in one group only,
    C's block (a fault), in the other a block nothing writes now. Worked by hand: B's same-step positions
    4..7 lie before a slot written now with another request's token, in whichever group: B re-stamps nothing
    (prefix 12) and its verify must see that slot."""
    q = tokens(seed, 13)
    other = {SW: [1, 2, 5, 7], FULL: [11, 12, 13, 17]} if foreign_in == SW else \
        {SW: [1, 2, 3, 7], FULL: [11, 12, 15, 17]}
    rows = [Row("A", q, 4, 4, {SW: [1, 2], FULL: [11, 12]}),
            Row("C", tokens(seed + 1000, 4), 0, 4, {SW: [5], FULL: [15]}),
            Row("B", q, 12, 1, other)]
    runner = Runner(hybrid=True)
    state = canary_state(runner)
    kwargs, md = runner.inputs(rows)
    batch = build_step(state.steps, runner, kwargs, md, state.geos, state.max_tokens, state.unstamped)
    assert batch.prefix_lens.tolist() == [4, 0, 12]
    assert batch.extend_lens.tolist() == [4, 4, 1]
    assert not batch.restamped
