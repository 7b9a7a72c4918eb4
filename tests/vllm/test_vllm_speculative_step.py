"""Speculative decoding as the canary reads it, driven without an engine (the stand-in runner of
``test_vllm_step.py``): a decoding row schedules its last sampled token and the scheduler's draft tokens after
it; the sampler keeps the drafts up to the first one the target disagrees with and samples the token for that
position itself, and the next step writes that position (and the rejected ones after it) again.

Each schedule is generated from a seed next to its hand-worked truth (the sequence the target produces): the
canary flags nothing on any of them however many drafts are rejected, and a fault on an accepted draft, a draft
id the forward did not get, or a rejected draft's records left in place is flagged with its reason and step.
"""

from __future__ import annotations

import numpy as np
import pytest
from test_vllm_step import LAYER, Row, Runner, canary_state, indexed_blocks, slots

BS = 4


class Sequence:
    """One request's truth (``truth``: the tokens the target produces, prompt first) and what is accepted so far
    (``n`` tokens: the last of them sampled but not yet written)."""

    def __init__(self, rid: str, rng: np.random.Generator, blocks: list[int], prompt: int) -> None:
        self.rid, self.rng, self.blocks = rid, rng, blocks
        self.truth = rng.integers(10, 30000, BS * len(blocks)).tolist()
        self.n = prompt

    def drafts(self, k: int) -> tuple[list[int], int]:
        """``k`` drafts for the positions after the last sampled token (each the truth with probability 1/2, a
        wrong token else) and how many of them the sampler accepts (those before the first wrong one)."""
        k = min(k, len(self.truth) - self.n - 1)
        out = [t if self.rng.random() < 0.5 else t + 1 for t in self.truth[self.n: self.n + k]]
        accepted = next((j for j, d in enumerate(out) if d != self.truth[self.n + j]), len(out))
        return out, accepted

    def row(self, drafts: list[int]) -> Row:
        return Row(self.rid, self.truth[: self.n] + drafts, self.n - 1, 1 + len(drafts), self.blocks)


def step(state, runner, rows: list[Row], drafts: dict[str, list[int]], seed: int, fault=None):
    """One engine step through the canary's phases: the request state holds each row's tokens but its drafts
    (the scheduler's ``scheduled_spec_decode_tokens``, handed to the canary as its step hook does), the forward
    writes random K/V where its slot mapping says; ``fault(kwargs, md)`` may change the forward's inputs."""
    kwargs, md = runner.inputs(rows)
    for r in rows:
        runner.requests[r.rid].prompt_token_ids = r.tokens[: len(r.tokens) - len(drafts.get(r.rid, ()))]
    if fault is not None:
        fault(kwargs, md)
    state.drafts = drafts
    batch = state.read_step(kwargs, md)
    state.before_forward(batch)
    gen = np.random.default_rng(seed * 1000 + state.steps)
    for slot in md[LAYER].slot_mapping.tolist():
        runner.cache[slot // BS, :, slot % BS, :] = float(gen.random()) + 1
    state.after_forward(batch, {0: md[LAYER].slot_mapping.numpy().astype(np.int64)})
    state.settle()  # the TAIL thread's bookkeeping, read by the assertions below
    return batch


def speculative_run(seed: int, steps: int = 10, fault_at: tuple[int, str] | None = None):
    """Two requests, A drafting up to 3 tokens a step and B decoding plainly, over ``steps`` steps; ``fault_at``
    plants one fault. What it returns: the canary state, the drafts and acceptances of each step, the fault."""
    rng = np.random.default_rng(seed)
    runner = Runner(max_model_len=96)
    state = canary_state(runner, sweep_interval=1)
    ids = rng.permutation(np.arange(1, 40))
    a = Sequence("A", rng, ids[:12].tolist(), int(rng.integers(3, 14)))
    b = Sequence("B", rng, ids[12:24].tolist(), int(rng.integers(3, 14)))
    step(state, runner, [Row("A", a.truth[: a.n], 0, a.n, a.blocks), Row("B", b.truth[: b.n], 0, b.n, b.blocks)],
         {}, seed)
    a.n += 1
    b.n += 1  # each prompt's first sampled token
    log, planted = [], None
    for _ in range(steps):
        if a.n >= len(a.truth):
            break
        drafts, accepted = a.drafts(int(rng.integers(0, 4)))
        rows = [a.row(drafts), b.row([])]
        fault = None
        if fault_at is not None and len(log) + 1 >= fault_at[0] and planted is None:
            fault, planted = _fault(fault_at[1], a, b, drafts, log, rows)
        batch = step(state, runner, rows, {"A": drafts} if drafts else {}, seed, fault)
        log.append((drafts, accepted, batch, a.n))
        a.n += accepted + 1
        b.n += 1
    state.flush()
    return state, log, planted


def _fault(kind: str, a: Sequence, b: Sequence, drafts: list[int], log, rows):
    """A fault for this step, if this step has a target for ``kind``: the callable that plants it and what it
    plants (step, slot, the token the canary expects there)."""
    step_no = len(log) + 1
    last = log[-1] if log else None
    if kind == "draft-input" and drafts:
        def wrong_draft(kwargs, md):
            kwargs["input_ids"][1] += 7  # A's first draft, as the forward receives it
        return wrong_draft, (step_no, a.blocks[a.n // BS] * BS + a.n % BS, drafts[0])
    if kind == "rejected-kept" and last is not None and last[1] < len(last[0]):
        # A's drafts from position a.n - 1 on were rejected: the token sampled for it goes to block 50 (free)
        q = a.n - 1
        def kept(kwargs, md):
            md[LAYER].slot_mapping[0] = 50 * BS + q % BS
        return kept, (step_no, a.blocks[q // BS] * BS + q % BS, a.truth[q])
    if kind == "accepted-record" and last is not None and last[1] > 0:
        # B's new token is written over the record (and K/V) of A's last accepted draft
        q = last[3] + last[1] - 1
        target = a.blocks[q // BS] * BS + q % BS
        def stray(kwargs, md):
            md[LAYER].slot_mapping[len(rows[0].tokens) - rows[0].prefix] = target
        return stray, (step_no, target, a.truth[q])
    return None, None


@pytest.mark.parametrize("seed", range(12))
def test_draft_tokens_are_stamped_and_rejected_ones_rewritten_without_a_false_positive(seed):
    state, log, _ = speculative_run(seed)
    assert state.violations == [] and state.health_problems == [] and state.dropped == 0
    assert any(d for d, _, _, _ in log)
    for drafts, _accepted, batch, n in log:
        # the row's expected ids: its accepted history, then the scheduler's drafts (never the forward's)
        if drafts:
            assert batch.expected_input_ids[1: 1 + len(drafts)].tolist() == drafts
            assert batch.accepted_lens.tolist() == [n, batch.valid_lens[1]]
            assert batch.valid_lens[0] == n + len(drafts)


def test_the_seeds_reject_and_accept_drafts():
    """The schedules above are the interesting ones: over the seeds, drafts are rejected (in most steps) and
    accepted, and some step accepts every draft it was given."""
    rejected = accepted = whole = 0
    for seed in range(12):
        _, log, _ = speculative_run(seed)
        for drafts, n_ok, _, _ in log:
            rejected += len(drafts) - n_ok
            accepted += n_ok
            whole += bool(drafts) and n_ok == len(drafts)
    assert rejected > 30 and accepted > 10 and whole > 3


@pytest.mark.parametrize(("kind", "reason", "delay"), [
    ("draft-input", "WRITE_TOKEN_MISMATCH", 0),  # the forward writes an id the scheduler did not draft
    ("rejected-kept", "VERIFY_TOKEN_MISMATCH", 1),  # vllm#47466: a rejected draft's K/V read as the sampled token
    ("accepted-record", "VERIFY_TOKEN_MISMATCH", 1),  # an accepted draft's record and K/V overwritten
])
@pytest.mark.parametrize("seed", range(6))
def test_a_fault_around_draft_tokens_is_flagged_at_its_slot_with_its_reason(seed, kind, reason, delay):
    state, _, planted = speculative_run(seed, steps=12, fault_at=(2, kind))
    assert planted is not None, "no step of this schedule had a target for the fault"
    step_no, slot, token = planted
    assert min(v.step for v in state.violations) >= step_no  # nothing flagged before it
    hits = [v for v in state.violations if reason in v.violation.reasons and v.violation.slot == slot]
    assert hits and min(v.step for v in hits) == step_no + delay
    assert hits[0].violation.expected_token == token


def test_a_block_completed_only_by_draft_tokens_stays_out_of_the_sweeps_index():
    """Hand-worked (4 tokens a block): A's 3-token prompt in block 7, its first sampled token at position 3.
    Step 1 writes position 3 and drafts for 4..7: block 7 is complete with accepted tokens (indexed), block 8
    only by drafts (not indexed). The sampler rejects the draft for 5: step 2 writes 5 and drafts for 6, 7,
    both accepted, but only 4 and 5 are sure yet (block 8 still out); step 3 writes the token sampled for 8:
    block 8 is complete with accepted tokens and indexed at its place."""
    runner = Runner()
    state = canary_state(runner)
    truth = list(range(100, 112))
    step(state, runner, [Row("A", truth[:3], 0, 3, [7, 8, 9])], {}, 0)
    drafts = [truth[4], truth[5] + 1, truth[6], truth[7]]
    batch = step(state, runner, [Row("A", truth[:4] + drafts, 3, 5, [7, 8, 9])], {"A": drafts}, 0)
    assert batch.slot_mappings[0].tolist() == slots([7, 8, 9], 3, 8)
    assert indexed_blocks(state) == {(0, 7): 0}
    drafts = [truth[6], truth[7]]
    step(state, runner, [Row("A", truth[:6] + drafts, 5, 3, [7, 8, 9])], {"A": drafts}, 0)
    assert indexed_blocks(state) == {(0, 7): 0}
    step(state, runner, [Row("A", truth[:9], 8, 1, [7, 8, 9])], {}, 0)
    assert indexed_blocks(state) == {(0, 7): 0, (0, 8): 1}
    state.flush()
    assert state.violations == []


@pytest.mark.parametrize("seed", range(4))
def test_a_drafting_rows_reused_block_leaves_the_index_next_to_rows_whose_restamps_wait(seed):
    """Step 0: S writes 8 tokens into blocks 20, 21 (indexed as its blocks 0 and 1); R its 4-token prompt into
    block 30. Step 1: S has finished and block 21 is handed to R, which writes position 4 and drafts 5, 6 there,
    next to eight parallel-sampling siblings of which two wait for their re-stamps (a step with deferred rows).
    R's only stamp in block 21 is its own: the block is R's partly filled one and leaves the index, as it does in
    a step without waiting rows. Were R's own stamp taken for another row's, block 21 would stay indexed as S's
    block 1, and once R is gone the sweep would flag its chain at slot 87 (position 7): a false positive."""
    from test_vllm_step import many_siblings, tokens

    n = 8
    runner = Runner(max_num_tokens=13 + n - 1 + 3, max_num_reqs=16, num_blocks=64)
    state = canary_state(runner, sweep_interval=1)
    s_tok, r_tok = tokens(100 * seed + 1, 8), tokens(100 * seed + 2, 12)
    step(state, runner, [Row("S", s_tok, 0, 8, [20, 21]), Row("R", r_tok[:4], 0, 4, [30])], {}, seed)
    assert indexed_blocks(state)[(0, 21)] == 1
    _q, siblings = many_siblings(seed, n)
    for r in siblings:
        r.blocks = [b + 40 for b in r.blocks]
    drafts = [r_tok[5], r_tok[6]]
    batch = step(state, runner, [Row("R", r_tok[:5] + drafts, 4, 3, [30, 21]), *siblings], {"R": drafts}, seed)
    assert batch.deferred  # the step this case is about
    assert (0, 21) not in indexed_blocks(state)
    step(state, runner, [Row("D", tokens(100 * seed + 3, 4), 0, 4, [50])], {}, seed)
    step(state, runner, [Row("D", tokens(100 * seed + 3, 5), 4, 1, [50, 51])], {}, seed)
    state.flush()
    assert state.violations == []
