"""The canary's read of one vLLM step, driven without an engine: a stand-in for the parts of vLLM's model runner
the canary reads (request state, input batch, KV cache config with vLLM's own ``FullAttentionSpec``) and the
forward's arguments and attention metadata built by hand, so each step's schedule is exactly the one written
in the test. The runtime behind it is the real one (NumPy backend): what it flags is what an engine would flag.

Pinned here: the same-step prefix hit (a row scheduled next to the sibling that writes its prefix) re-stamps exactly
the positions written in the step and verifies the one before (also where its last prefix slot is the highest slot
the step writes, and where its writer completes the block from mid-block, a chunked prefill, or on block 1 alone),
never runs over a prefix slot another request writes now with its own token, and in a row still waiting for
re-stamps also re-stamps its unstamped positions where its table says; past the per-step re-stamp budget the rows
left over are read without a false positive and a fault is still caught; blocks the scheduler lists to zero leave
the sweep's index; a token the forward wrote to another slot than planned is stamped where it went; finished
requests leave the rows waiting for their re-stamps, live ones stay; a step with no token reads as empty and
costs no same-step look-up; the step's block tables are int32 and its slot mappings int64 whatever the runner's;
more requests than the canary was sized for are refused by name; in log mode nothing launches before the forward;
the TAIL write gets the forward's slots only where they differ from the plan's; a candidate of the same-step
look-up with nothing of its own written in the step reads as no re-stamp; in log mode the TAIL work is submitted
to the TAIL thread at once; a full-attention model's steps run no cross-group drop.
"""

from __future__ import annotations

import re
import sys
import threading
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.kv_cache_interface import FullAttentionSpec

from kvcanary_cupy.integrations.common.tail import SWITCH_INTERVAL
from kvcanary_cupy.integrations.vllm import step as step_module
from kvcanary_cupy.integrations.vllm.blocks import BlockIndex
from kvcanary_cupy.integrations.vllm.canary import TAIL_SWITCH_INTERVAL_S, CanaryOptions, VllmCanaryState, build_step
from kvcanary_cupy.integrations.vllm.hooks import VllmCanary

BS = 4  # tokens per block
LAYER = "model.layers.0.self_attn.attn"


def indexed_blocks(state: VllmCanaryState) -> dict[tuple[int, int], int]:
    """The sweep's block index as ``{(group, block): index in its sequence}``."""
    return {(g, b): int(state.block_index.where[g][b]) for g, b in state.block_index}


@dataclass
class Row:
    """One scheduled request of a step: its token history, what is computed (``prefix`` tokens already in the
    cache, ``extend`` new ones) and its block table row."""

    rid: str
    tokens: list[int]
    prefix: int
    extend: int
    blocks: list[int]


class Runner:
    """The parts of vLLM's V1 model runner the canary reads, one full-attention KV cache group of one layer."""

    def __init__(self, *, num_blocks: int = 64, max_num_reqs: int = 16, max_model_len: int = 64,
                 max_num_tokens: int = 64) -> None:
        spec = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=8, dtype=torch.float32)
        cache = torch.zeros(num_blocks, 1, BS, 16)
        self.kv_caches: list[torch.Tensor] = [cache]  # what the runner holds once its KV cache is built
        self.compilation_config = SimpleNamespace(static_forward_context={LAYER: SimpleNamespace(kv_cache=cache)})
        self.kv_cache_config = SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec,
                                                                                layer_names=[LAYER])])
        self.max_num_reqs, self.max_model_len, self.max_num_tokens = max_num_reqs, max_model_len, max_num_tokens
        self.requests: dict[str, SimpleNamespace] = {}
        self.input_batch = SimpleNamespace(num_reqs=0, req_ids=[])
        self.cache = cache
        self.executed: list[SchedulerOutput] = []

    # the two methods the canary wraps (their presence makes this a model runner to ``find_runner``)
    def execute_model(self, scheduler_output: SchedulerOutput) -> None:
        self.executed.append(scheduler_output)
        for block in scheduler_output.new_block_ids_to_zero or ():  # what vLLM's runner does with the list
            self.cache[block].zero_()

    def _model_forward(self, **kwargs) -> None:
        return None

    def inputs(self, rows: list[Row]) -> tuple[dict, dict]:
        """The forward's keyword arguments and attention metadata of a step scheduling ``rows``."""
        self.input_batch = SimpleNamespace(num_reqs=len(rows), req_ids=[r.rid for r in rows])
        ids, pos, slots, cu = [], [], [], [0]
        for r in rows:
            self.requests[r.rid] = SimpleNamespace(prompt_token_ids=r.tokens[: r.prefix + r.extend],
                                                   output_token_ids=[])
            for p in range(r.prefix, r.prefix + r.extend):
                ids.append(r.tokens[p])
                pos.append(p)
                slots.append(r.blocks[p // BS] * BS + p % BS)
            cu.append(len(ids))
        width = max(len(r.blocks) for r in rows)
        # one padding request past the batch, as vLLM's metadata may carry (num_reqs_padded): never read
        table = torch.zeros(len(rows) + 1, width, dtype=torch.int32)
        for i, r in enumerate(rows):
            table[i, : len(r.blocks)] = torch.tensor(r.blocks, dtype=torch.int32)
        md = SimpleNamespace(query_start_loc=torch.tensor([*cu, cu[-1]], dtype=torch.int32),
                             seq_lens=torch.tensor([*(r.prefix + r.extend for r in rows), 0], dtype=torch.int32),
                             block_table=table, slot_mapping=torch.tensor(slots, dtype=torch.int64))
        kwargs = {"input_ids": torch.tensor(ids, dtype=torch.int64), "positions": torch.tensor(pos)}
        return kwargs, {LAYER: md}


def no_idle_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    """The TAIL thread on the worker's own cores, as where the process may run on every CPU: whatever this
    process's CPU affinity (a process restricted to fewer CPUs than the machine has, such as one forked after a
    vLLM engine bound its threads, would otherwise give the thread the others)."""
    from kvcanary_cupy.integrations.vllm import canary as canary_module

    monkeypatch.setattr(canary_module, "idle_cores", lambda runner: None)


def canary_state(runner: Runner, **opts) -> VllmCanaryState:
    return VllmCanaryState(runner, CanaryOptions(**{"mode": "log", "real_kv_hash": "none", "backend": "numpy",
                                                    "sweep_interval": 0, **opts}))


def run_step(state: VllmCanaryState, runner: Runner, rows: list[Row], seed: int = 0):
    """One engine step through the canary's four phases, the forward writing (random K/V) where its slot mapping
    says."""
    kwargs, md = runner.inputs(rows)
    batch = state.read_step(kwargs, md)  # the hooks' entry point: the rows left waiting, the kept histories
    state.before_forward(batch)
    gen = torch.Generator().manual_seed(seed * 1000 + state.steps)
    for slot in md[LAYER].slot_mapping.tolist():
        runner.cache[slot // BS, :, slot % BS, :] = torch.rand(runner.cache.shape[1], runner.cache.shape[3],
                                                               generator=gen) + 1
    state.after_forward(batch, {0: md[LAYER].slot_mapping.numpy().astype(np.int64)})
    state.settle()  # the TAIL thread's bookkeeping, read by the assertions below
    return batch


def endpoint_counts(state: VllmCanaryState) -> dict[str, tuple[int, int]]:
    """(entries, launches) per operation, the same at each of the four HEAD/TAIL K/V endpoints (asserted)."""
    per_op: dict[str, set[tuple[int, int]]] = {}
    for (_, tag, op), counts in state.rt.run_counters().items():
        if not tag.startswith("SWEEP_"):
            per_op.setdefault(op, set()).add(counts)
    assert all(len(v) == 1 for v in per_op.values()), per_op
    return {op: v.pop() for op, v in per_op.items()}


def slots(blocks: list[int], lo: int, hi: int) -> list[int]:
    """Hand-worked slots of positions ``lo .. hi - 1`` of a block table row."""
    return [blocks[p // BS] * BS + p % BS for p in range(lo, hi)]


def tokens(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(10, 30000, n).tolist()


# -- gap: the same-step prefix tail starts exactly at the first position written in the step ------------------

def sibling_steps(seed: int):
    """Step 0: request A writes an 8-token prompt into blocks 1, 2 (and C, an unrelated request, block 6).
    Step 1: the parallel-sampling siblings B1, B2 of a 14-token prompt that begins with A's: B1 hits blocks 1, 2
    and writes positions 8..13 into blocks 3, 4; B2, scheduled next to it, already hits block 3 (cached when
    B1 was given it, written in this very step) and computes 12..13 into its own block 5."""
    q = tokens(seed, 14)
    a = Row("A", q[:8], 0, 8, [1, 2])
    c = Row("C", tokens(seed + 1000, 5), 0, 4, [6])
    b1 = Row("B1", q, 8, 6, [1, 2, 3, 4])
    b2 = Row("B2", q, 12, 2, [1, 2, 3, 5])
    return q, [a, c], [b1, b2]


@pytest.mark.parametrize("seed", range(6))
def test_same_step_prefix_tail_is_restamped_from_the_first_position_written_in_the_step(seed):
    runner = Runner()
    state = canary_state(runner)
    q, step0, step1 = sibling_steps(seed)
    run_step(state, runner, step0)
    batch = run_step(state, runner, step1)
    state.flush()
    # B2 re-stamps positions 8..11 (block 3, which B1 writes now) and verifies 0..7 (cached before the step)
    assert batch.prefix_lens.tolist() == [8, 8]
    assert batch.extend_lens.tolist() == [6, 6]
    want_slots = slots([1, 2, 3, 4], 8, 14) + slots([1, 2, 3, 5], 8, 12) + slots([1, 2, 3, 5], 12, 14)
    assert batch.slot_mappings[0].tolist() == want_slots == [12, 13, 14, 15, 16, 17, 12, 13, 14, 15, 20, 21]
    assert batch.source_index.tolist() == [0, 1, 2, 3, 4, 5, -1, -1, -1, -1, 6, 7]
    assert batch.expected_input_ids.tolist() == q[8:14] + q[8:12] + q[12:14]
    assert batch.input_ids.tolist() == q[8:14] + q[8:12] + q[12:14]
    assert batch.positions.tolist() == [*range(8, 14), *range(8, 12), 12, 13]
    assert batch.forward_tokens == 8
    assert state.violations == [] and state.health_problems == [] and state.dropped == 0
    # per endpoint: B1 verifies 8 and writes 6; B2 verifies 8 and writes 4 re-stamped + 2; step 0 wrote 12
    assert endpoint_counts(state) == {"verify": (8 + 8, 2), "write": (12 + 6 + 6, 2)}


@pytest.mark.parametrize("seed", range(3))
def test_in_raise_mode_the_tail_phases_run_inline_with_the_same_verifies_and_writes(seed):
    """Raise mode has no TAIL thread: the TAIL phases run in the forward's own thread. The sibling schedule
    above reads, verifies and writes exactly as in log mode (B2 verifies 8 and re-stamps 4), with no
    violation."""
    runner = Runner()
    state = canary_state(runner, mode="raise")
    assert state.tail is None
    _q, step0, step1 = sibling_steps(seed)
    run_step(state, runner, step0)
    batch = run_step(state, runner, step1)
    state.flush()
    assert batch.prefix_lens.tolist() == [8, 8]
    assert state.violations == [] and state.health_problems == [] and state.dropped == 0
    assert endpoint_counts(state) == {"verify": (8 + 8, 2), "write": (12 + 6 + 6, 2)}


@pytest.mark.parametrize("seed", range(3))
def test_a_same_step_tail_in_the_highest_slot_the_step_writes_is_still_restamped(seed):
    """The schedule above with B1's and B2's third block at id 9: B2's last prefix slot (position 11, slot 39) is
    the highest slot of the step's writes. B2 still re-stamps 8..11 and verifies 0..7, with no false positive;
    the step is read the same without the rows-waiting argument (none given: none waits)."""
    runner = Runner()
    state = canary_state(runner)
    _q, step0, (b1, b2) = sibling_steps(seed)
    run_step(state, runner, step0)
    b1.blocks, b2.blocks = [1, 2, 9, 4], [1, 2, 9, 5]
    kwargs, md = runner.inputs([b1, b2])
    alone = build_step(state.steps, runner, kwargs, md, state.geos, state.max_tokens)
    batch = run_step(state, runner, [b1, b2])
    state.flush()
    assert batch.prefix_lens.tolist() == alone.prefix_lens.tolist() == [8, 8]
    want = slots([1, 2, 9, 4], 8, 14) + slots([1, 2, 9, 5], 8, 12) + slots([1, 2, 9, 5], 12, 14)
    assert batch.slot_mappings[0].tolist() == alone.slot_mappings[0].tolist() == want
    assert state.violations == []


@pytest.mark.parametrize("seed", range(4))
def test_a_same_step_tail_whose_block_its_writer_completes_mid_block_is_restamped(seed):
    """A chunked prefill: step 0, A computes the first 10 tokens of a 15-token prompt into blocks 1, 2 and half
    of 3. Step 1: A computes 10..13 (the rest of block 3, then block 4), and B, a request with the same prompt
    scheduled next to it, already hits blocks 1..3 (block 3 cached when A completes it, written in this very
    step from its third slot on) and computes 12, 13 into its own block 5. Worked by hand: B re-stamps positions
    10, 11 (slots 14, 15, what A writes now) and verifies 0..9 (what was stamped before the step); both then
    decode position 14 without a violation."""
    runner = Runner()
    state = canary_state(runner)
    q = tokens(seed, 15)
    a = Row("A", q, 0, 10, [1, 2, 3])
    run_step(state, runner, [a], seed)
    a.prefix, a.extend, a.blocks = 10, 4, [1, 2, 3, 4]
    b = Row("B", q, 12, 2, [1, 2, 3, 5])
    batch = run_step(state, runner, [a, b], seed)
    assert batch.prefix_lens.tolist() == [10, 10]
    assert batch.extend_lens.tolist() == [4, 4]
    assert batch.slot_mappings[0].tolist() == [14, 15, 16, 17, 14, 15, 20, 21]
    assert batch.source_index.tolist() == [0, 1, 2, 3, -1, -1, 4, 5]
    assert batch.expected_input_ids.tolist() == q[10:14] + q[10:14]
    decode([a, b])
    run_step(state, runner, [a, b], seed)
    state.flush()
    assert state.violations == [] and state.health_problems == [] and state.dropped == 0
    # verified: A 10 and B 10 at step 1, A 14 and B 14 at step 2; written: 10, then 4 + (2 + 2), then 1 + 1
    assert endpoint_counts(state) == {"verify": (10 + 10 + 14 + 14, 3), "write": (10 + 8 + 2, 3)}


@pytest.mark.parametrize("seed", range(4))
def test_a_same_step_hit_on_block_one_alone_restamps_the_whole_prefix(seed):
    """One step: A computes a 6-token prompt into blocks 1, 2; B, scheduled next to it with the same prompt,
    already hits block 1 (cached when A was given it, written in this very step) and computes 4, 5 into its own
    block 3. Block 1 is the only block of B's prefix, and the lowest id a request gets. Worked by hand: B
    re-stamps positions 0..3 (slots 4..7, what A writes now) and verifies nothing; both then decode position 6
    without a violation."""
    runner = Runner()
    state = canary_state(runner)
    q = tokens(seed, 7)
    a, b = Row("A", q, 0, 6, [1, 2]), Row("B", q, 4, 2, [1, 3])
    batch = run_step(state, runner, [a, b], seed)
    assert batch.prefix_lens.tolist() == [0, 0]
    assert batch.extend_lens.tolist() == [6, 6]
    assert batch.slot_mappings[0].tolist() == [4, 5, 6, 7, 8, 9, 4, 5, 6, 7, 12, 13]
    assert batch.source_index.tolist() == [0, 1, 2, 3, 4, 5, -1, -1, -1, -1, 6, 7]
    assert batch.expected_input_ids.tolist() == q[:6] + q[:6]
    decode([a, b])
    run_step(state, runner, [a, b], seed)
    state.flush()
    assert state.violations == [] and state.health_problems == [] and state.dropped == 0
    assert endpoint_counts(state) == {"verify": (6 + 6, 2), "write": (12 + 2, 2)}


@pytest.mark.parametrize("seed", range(6))
def test_a_wrong_block_just_before_the_same_step_tail_is_verified_not_restamped(seed):
    """B2's block table points its second block (positions 4..7, the last block before the shared tail) at C's
    block 6: those four positions are read from foreign slots and each is flagged by the verify, and B2's first
    re-stamp (position 8) seeds from slot 27, which holds C's position 3, so the write flags it. A tail one token
    too long would re-stamp position 7 into C's slot 27 instead of verifying it: C's record would be overwritten,
    which C's next step shows."""
    runner = Runner()
    state = canary_state(runner)
    _q, (a, c), (b1, b2) = sibling_steps(seed)
    run_step(state, runner, [a, c])
    b2.blocks = [1, 6, 3, 5]
    batch = run_step(state, runner, [b1, b2])
    assert batch.prefix_lens.tolist() == [8, 8]
    c.prefix, c.extend, c.blocks = 4, 1, [6, 7]
    run_step(state, runner, [c])  # C decodes: its prefix (slots 24..27) must still hold its own records
    state.flush()
    verify_rows = {(v.step, v.violation.slot, v.violation.position) for v in state.violations
                   if "VERIFY_TOKEN_MISMATCH" in v.violation.reasons}
    write_rows = {(v.step, v.violation.slot, v.violation.position) for v in state.violations
                  if "WRITE_POSITION_MISMATCH" in v.violation.reasons}
    assert verify_rows == {(1, 6 * BS + k, k) for k in range(BS)}  # C's records, where B2 expects q[4..7]
    assert write_rows == {(1, 3 * BS, 8)}
    assert len(verify_rows | write_rows) == len({(v.step, v.violation.slot) for v in state.violations})


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("layout", ["foreign-after-shared", "foreign-before-shared"])
def test_a_prefix_slot_another_request_writes_now_with_its_own_token_bounds_the_restamp(seed, layout):
    """Step 0: P writes the first 8 tokens of a prompt into blocks 1, 2. Step 1: A (the same prompt) computes
    8..11 into block 3; C, an unrelated request, writes its own tokens into block 6 (from its position 0); B
    (the same prompt) is scheduled with block 3 and C's block 6 in its prefix, a fault. Worked by hand:
    - foreign-after-shared (B: blocks 1, 2, 3, 6, prefix 16; C writes one token): B's position 12 is written now
      with C's token, after its same-step block 3: nothing is re-stamped (a re-stamp would run over the foreign
      slot), and B's verify flags positions 8..15 (slots 12..15 and 24..27: none holds B's record yet);
    - foreign-before-shared (B: blocks 1, 6, 3, prefix 12; C writes four tokens): B's positions 4..7 are C's
      slots; the same-step block 3 right after them is re-stamped (8..11), and the verify flags exactly 4..7
      (slots 24..27)."""
    runner = Runner()
    state = canary_state(runner)
    q = tokens(seed, 17)
    run_step(state, runner, [Row("P", q, 0, 8, [1, 2])], seed)
    a = Row("A", q, 8, 4, [1, 2, 3])
    if layout == "foreign-after-shared":
        c, b = Row("C", tokens(seed + 1000, 1), 0, 1, [6]), Row("B", q, 16, 1, [1, 2, 3, 6, 7])
        want_prefix, want_flagged = 16, [*range(12, 16), *range(24, 28)]
    else:
        c, b = Row("C", tokens(seed + 1000, 4), 0, 4, [6]), Row("B", q, 12, 1, [1, 6, 3, 7])
        want_prefix, want_flagged = 8, list(range(24, 28))
    batch = run_step(state, runner, [a, c, b], seed)
    state.flush()
    assert batch.prefix_lens.tolist() == [8, 0, want_prefix]
    flagged = sorted({v.violation.slot for v in state.violations
                      if v.step == 1 and "VERIFY_TOKEN_MISMATCH" in v.violation.reasons})
    assert flagged == want_flagged


@pytest.mark.parametrize("seed", range(3))
def test_a_waiting_row_with_a_same_step_hit_restamps_its_unstamped_positions_where_its_table_says(seed):
    """P wrote the first 8 tokens of a prompt into blocks 1, 2. B (the same prompt, prefix 16) waits from
    position 12 (an earlier step left 12..15, block 4, unstamped); in this step A computes 8..11 into block 3,
    which B holds too. Worked by hand: B re-stamps 8..15 (block 3 with A's records, block 4 where its table
    says: slots 12..19) and writes position 16 into block 5; it waits no more, and its next step verifies
    0..16 without a violation."""
    runner = Runner()
    state = canary_state(runner)
    q = tokens(seed, 18)
    run_step(state, runner, [Row("P", q, 0, 8, [1, 2])], seed)
    state.unstamped["B"] = 12
    a, b = Row("A", q, 8, 4, [1, 2, 3]), Row("B", q, 16, 1, [1, 2, 3, 4, 5])
    batch = run_step(state, runner, [a, b], seed)
    assert batch.prefix_lens.tolist() == [8, 8]
    assert batch.extend_lens.tolist() == [4, 9]
    assert batch.slot_mappings[0].tolist() == [12, 13, 14, 15, *range(12, 20), 20]
    assert batch.deferred == {} and state.unstamped == {}
    decode([b])
    run_step(state, runner, [b], seed)
    state.flush()
    assert state.violations == [] and state.health_problems == [] and state.dropped == 0


# -- gap: same-step re-stamps past the step's capacity -------------------------------------------------------

def many_siblings(seed: int, n: int):
    """Step 0: ``n`` parallel-sampling siblings of a 13-token prompt. S1 computes it all into blocks 1..4; every
    other sibling already hits blocks 1..3 (cached when S1 was given them) and computes position 12 into its own
    block ``3 + k``. The forward holds 13 + (n - 1) tokens, which is also max_num_batched_tokens."""
    q = tokens(seed, 16)
    rows = [Row("S1", q, 0, 13, [1, 2, 3, 4])] + [Row(f"S{k}", q, 12, 1, [1, 2, 3, 3 + k]) for k in range(2, n + 1)]
    return q, rows


def decode(rows: list[Row]) -> None:
    for r in rows:
        r.prefix, r.extend = r.prefix + r.extend, 1


@pytest.mark.parametrize("seed", range(4))
def test_same_step_restamps_past_the_step_capacity_wait_for_a_later_step_without_a_false_positive(seed):
    """8 siblings, 20 forward tokens: the canary takes 4 x 20 = 80 tokens a step, so 60 re-stamps. Each sibling
    after S1 re-stamps positions 0..11 (12 tokens): S2..S6 fit (60), S7 and S8 do not. Worked by hand:
    step 0: S7 and S8 verify nothing, stamp nothing and wait; S1..S6 write 13 each (78).
    step 1 (each decodes one token): S1..S6 verify 13 and write 1; S7 and S8 re-stamp 0..12 and write 13 (14
    each, 28 of the 80): 78 verified, 34 written.
    step 2: all eight verify 14 and write 1: 112 verified, 8 written. No violation, nothing dropped."""
    n = 8
    runner = Runner(max_num_tokens=13 + n - 1)
    state = canary_state(runner)
    q, rows = many_siblings(seed, n)
    batch = run_step(state, runner, rows)
    assert batch.prefix_lens.tolist() == [0] * n
    assert batch.extend_lens.tolist() == [13] * 6 + [0, 0]
    assert batch.deferred == {"S7": 0, "S8": 0} and state.unstamped == {"S7": 0, "S8": 0}
    assert batch.forward_tokens == 13 + 5 and batch.forward_len == 20
    decode(rows)
    batch = run_step(state, runner, rows)
    assert batch.prefix_lens.tolist() == [13] * 6 + [0, 0]
    assert batch.extend_lens.tolist() == [1] * 6 + [14, 14]
    assert batch.slot_mappings[0].tolist()[-14:] == slots([1, 2, 3, 3 + 8], 0, 14)
    assert batch.expected_input_ids.tolist()[-14:] == q[:14]
    assert batch.deferred == {} and state.unstamped == {}
    decode(rows)
    run_step(state, runner, rows)
    state.flush()
    assert state.violations == [] and state.health_problems == [] and state.dropped == 0
    assert endpoint_counts(state) == {"verify": (78 + 112, 3), "write": (78 + 34 + 8, 3)}


@pytest.mark.parametrize("seed", range(4))
def test_a_fault_on_a_sibling_that_waited_for_its_restamp_is_still_caught(seed):
    """The same schedule; at step 2 S8's block table points its first block at S2's own block 5 (slot 20 holds
    S2's position 12, slots 21..23 were never written): the verify flags exactly slots 20..23, at step 2."""
    n = 8
    runner = Runner(max_num_tokens=13 + n - 1)
    state = canary_state(runner)
    _q, rows = many_siblings(seed, n)
    run_step(state, runner, rows)
    decode(rows)
    run_step(state, runner, rows)
    decode(rows)
    rows[-1].blocks = [5, 2, 3, 11]
    run_step(state, runner, rows)
    state.flush()
    flagged = {(v.step, v.violation.slot) for v in state.violations if "VERIFY_TOKEN_MISMATCH" in v.violation.reasons}
    assert flagged == {(2, 5 * BS + k) for k in range(BS)}
    assert {v.step for v in state.violations} == {2}


# -- minor: blocks the scheduler lists to zero leave the sweep's index ---------------------------------------

@pytest.mark.parametrize("seed", range(4))
def test_blocks_the_scheduler_lists_to_zero_leave_the_sweeps_index(seed):
    """A writes blocks 1, 2 and C block 6, their K/V hashed into the records. The next scheduler output lists
    blocks 2 and 6 to zero (vLLM does for Mamba and mixed-precision caches) and the runner zeroes them: the
    sweep must check block 1 only (zeroed K/V no longer matches the hash its records hold: a sweep still
    indexing block 2 or 6 would flag every one of their slots)."""
    runner = Runner()
    opts = CanaryOptions(mode="log", real_kv_hash="partial", backend="numpy", sweep_interval=0)
    canary = VllmCanary(runner, opts)
    canary.state = VllmCanaryState(runner, opts)
    _q, (a, c), _ = sibling_steps(seed)
    run_step(canary.state, runner, [a, c], seed)
    assert indexed_blocks(canary.state) == {(0, 1): 0, (0, 2): 1, (0, 6): 0}
    out = SchedulerOutput.make_empty()
    out.new_block_ids_to_zero = [2, 6, 9]  # block 9 was never indexed
    runner.execute_model(out)
    assert runner.executed == [out]  # the runner's own method ran, with the same output
    assert indexed_blocks(canary.state) == {(0, 1): 0}
    # an unrelated request D in the next step (the sweep leaves out the blocks the last step's rows hold: that
    # step's verify has just covered them), so the sweep reaches block 1
    run_step(canary.state, runner, [Row("D", tokens(seed + 2000, 4), 0, 4, [7])], seed)
    assert indexed_blocks(canary.state) == {(0, 1): 0, (0, 7): 0}
    swept = canary.state.rt.sweep()
    canary.state.flush()
    assert canary.state.violations == []
    assert swept == BS  # block 1's four slots
    canary.remove()


# -- the sweep's block index ---------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(3))
def test_the_block_index_keeps_complete_blocks_and_drops_reused_and_unstamped_ones(seed):
    """Worked by hand (4 tokens a block). Step 0: Z writes 8 tokens into blocks 10, 11 (both complete: indexed
    at 0, 1) and Y 6 tokens into blocks 12, 13 (12 complete; 13 holds 2 tokens: not indexed).
    Step 1: W, a new request, gets block 13 back and writes 2 tokens: still incomplete, so nothing new.
    Step 2: the 8 siblings of a 13-token prompt (20 forward tokens, 60 re-stamps a step): S1..S6 index blocks
    1, 2, 3 (complete) and drop their own block (position 12 only); S7 and S8 stamp nothing this step, so their
    own blocks 10 and 11 (Z's, handed out again) leave the index, and the blocks S1 stamps stay."""
    runner = Runner(max_num_tokens=20)
    state = canary_state(runner)
    run_step(state, runner, [Row("Z", tokens(seed, 8), 0, 8, [10, 11]), Row("Y", tokens(seed + 1, 6), 0, 6, [12, 13])])
    assert indexed_blocks(state) == {(0, 10): 0, (0, 11): 1, (0, 12): 0}
    run_step(state, runner, [Row("W", tokens(seed + 2, 2), 0, 2, [13])])
    assert indexed_blocks(state) == {(0, 10): 0, (0, 11): 1, (0, 12): 0}
    _, rows = many_siblings(seed, 8)
    rows[6].blocks, rows[7].blocks = [1, 2, 3, 10], [1, 2, 3, 11]
    batch = run_step(state, runner, rows)
    assert batch.deferred == {"S7": 0, "S8": 0}
    assert indexed_blocks(state) == {(0, 1): 0, (0, 2): 1, (0, 3): 2, (0, 12): 0}


def test_a_block_a_new_request_only_partly_fills_leaves_the_index():
    runner = Runner()
    state = canary_state(runner)
    run_step(state, runner, [Row("Z", tokens(7, 8), 0, 8, [10, 11])])
    assert indexed_blocks(state) == {(0, 10): 0, (0, 11): 1}
    run_step(state, runner, [Row("V", tokens(8, 7), 0, 7, [11, 10])])  # 11 refilled whole, 10 with 3 tokens
    assert indexed_blocks(state) == {(0, 11): 0}


def test_the_forward_token_is_what_the_write_checks_even_for_the_first_token_of_the_step():
    """The forward received a wrong first token (position 0 of A): the canary's token list carries what the
    forward received, not the history, so the write flags it."""
    runner = Runner()
    state = canary_state(runner)
    q, (a, c), _ = sibling_steps(3)
    kwargs, md = runner.inputs([a, c])
    kwargs["input_ids"][0] += 1
    batch = build_step(state.steps, runner, kwargs, md, state.geos, state.max_tokens, state.unstamped)
    assert batch.input_ids.tolist() == [q[0] + 1, *q[1:8], *c.tokens[:4]]
    assert batch.expected_input_ids.tolist() == q[:8] + c.tokens[:4]


@pytest.mark.parametrize(("state_of_a", "message"), [
    ({"prompt_token_ids": None}, "request A has no prompt token ids (prompt embeddings are not supported)"),
    ({"prompt_token_ids": [5, 6, 7]}, "request A schedules positions up to 8 but its state holds 3 tokens (async "
                                      "scheduling is not supported: use async_scheduling=False)"),
], ids=["prompt-embeddings", "async-scheduling"])
def test_a_request_state_the_step_cannot_be_read_from_is_refused_by_name(state_of_a, message):
    runner = Runner()
    state = canary_state(runner)
    _, (a, c), _ = sibling_steps(0)
    kwargs, md = runner.inputs([a, c])
    runner.requests["A"] = SimpleNamespace(**{"prompt_token_ids": a.tokens, "output_token_ids": [], **state_of_a})
    with pytest.raises(ValueError, match="^" + re.escape("kv-canary: " + message) + "$"):
        build_step(state.steps, runner, kwargs, md, state.geos, state.max_tokens, state.unstamped)


def test_a_step_in_which_every_row_waits_stamps_and_verifies_nothing():
    """A's positions 0..19 were left unstamped by an earlier step (pending from 0): 20 re-stamps do not fit the
    16 - 1 the step has left, so A waits again, and the step has no canary token at all; the runtime takes the
    empty step."""
    runner = Runner(max_num_tokens=4)
    state = canary_state(runner)
    a = Row("A", tokens(5, 22), 20, 1, [1, 2, 3, 4, 5, 6])
    state.unstamped["A"] = 0
    batch = run_step(state, runner, [a])
    assert batch.deferred == {"A": 0} and state.unstamped == {"A": 0}
    assert (batch.prefix_lens.tolist(), batch.extend_lens.tolist(), batch.forward_len) == ([0], [0], 1)
    for got in (batch.slot_mappings[0], batch.source_index, batch.expected_input_ids, batch.expected_positions):
        assert got.shape == (0,) and got.dtype == np.int64
    state.flush()
    assert state.violations == [] and endpoint_counts(state) == {"verify": (0, 1), "write": (0, 1)}


# -- the TAIL phases stamp where the forward really wrote -----------------------------------------------------

@pytest.mark.parametrize("seed", range(4))
def test_a_token_the_forward_wrote_to_another_slot_is_stamped_there_and_its_planned_slot_is_flagged(seed):
    """Step 0: A's 8-token prompt is planned into blocks 1, 2 (slots 4..11), but the forward writes position 5
    into slot 30 instead of slot 9 (a slot-mapping fault). The TAIL write follows the forward: slot 30 is stamped
    and slot 9 keeps no record. Step 1 (A decodes position 8 into block 3) verifies positions 0..7 through the
    block table: slot 9 (position 5: no record, so token, position and chain all wrong) and slot 10 (position 6:
    its chain continues from the empty slot 9) are flagged, at step 1, and nothing else. Stamping the planned
    slots instead would have hidden the fault: every verify would pass."""
    runner = Runner()
    state = canary_state(runner)
    a = Row("A", tokens(seed, 9), 0, 8, [1, 2])
    kwargs, md = runner.inputs([a])
    batch = state.read_step(kwargs, md)
    state.before_forward(batch)
    written = md[LAYER].slot_mapping.numpy().astype(np.int64)
    assert written.tolist() == list(range(4, 12))
    written[5] = 30
    for slot in written.tolist():
        runner.cache[slot // BS, :, slot % BS, :] = 1.0
    state.after_forward(batch, {0: written})
    a.prefix, a.extend, a.blocks = 8, 1, [1, 2, 3]
    run_step(state, runner, [a], seed)
    state.flush()
    flagged = {(v.step, v.violation.slot) for v in state.violations}
    assert flagged == {(1, 9), (1, 10)}
    reasons = {v.violation.slot: set(v.violation.reasons) for v in state.violations}
    assert {"VERIFY_TOKEN_MISMATCH", "VERIFY_POSITION_MISMATCH", "VERIFY_CHAIN_HASH_MISMATCH"} <= reasons[9]
    assert "VERIFY_CHAIN_HASH_MISMATCH" in reasons[10]


# -- the rows left waiting: pruned of finished requests, never of live ones -----------------------------------

def test_finished_requests_leave_the_waiting_rows_and_a_live_waiting_request_still_catches_up():
    """Five rounds of 8 parallel-sampling siblings (max_num_reqs 8, 20 forward tokens: S7 and S8 of each round
    wait for their re-stamps, as worked out above); after each round every sibling finishes except, in the last
    round, S7 and S8. The waiting rows never hold more than max_num_reqs requests (without pruning, 10 after
    round 4), and the live ones stay. Round 4's S7 and S8 then decode and
    re-stamp positions 0..12 before their verify: no violation. Dropping them with the finished ones would leave
    position 12 of their own blocks unstamped, and their verify would flag it."""
    n = 8
    runner = Runner(max_num_reqs=n, max_num_tokens=13 + n - 1)
    state = canary_state(runner)
    for round_ in range(5):
        _q, rows = many_siblings(100 * round_, n)
        for r in rows:
            r.rid = f"{r.rid}-{round_}"
        batch = run_step(state, runner, rows)
        assert batch.deferred == {f"S7-{round_}": 0, f"S8-{round_}": 0}
        assert len(state.unstamped) <= n
        if round_ < 4:
            for r in rows:
                del runner.requests[r.rid]  # finished: vLLM's runner drops its state
    # the live ones are kept (how many finished ones stay below the bound is the state's own business)
    assert state.unstamped.items() >= {"S7-4": 0, "S8-4": 0}.items()
    live = rows[-2:]
    decode(live)
    batch = run_step(state, runner, live)
    assert batch.prefix_lens.tolist() == [0, 0] and batch.extend_lens.tolist() == [14, 14]
    decode(live)
    run_step(state, runner, live)
    state.flush()
    assert state.violations == [] and state.health_problems == [] and state.dropped == 0


# -- a step with no token at all -----------------------------------------------------------------------------

def test_a_step_without_any_scheduled_request_reads_as_an_empty_step():
    runner = Runner()
    state = canary_state(runner)
    kwargs = {"input_ids": torch.zeros(0, dtype=torch.int64), "positions": torch.zeros(0, dtype=torch.int64)}
    md = SimpleNamespace(query_start_loc=torch.zeros(1, dtype=torch.int32),
                         seq_lens=torch.zeros(0, dtype=torch.int32), block_table=torch.zeros(0, 1, dtype=torch.int32),
                         slot_mapping=torch.zeros(0, dtype=torch.int64))
    runner.input_batch = SimpleNamespace(num_reqs=0, req_ids=[])
    batch = build_step(state.steps, runner, kwargs, {LAYER: md}, state.geos, state.max_tokens, state.unstamped)
    assert batch.size == 0 and batch.forward_len == 0 and batch.deferred == {}
    for got in (batch.slot_mappings[0], batch.source_index, batch.expected_input_ids, batch.expected_positions,
                batch.input_ids, batch.positions, batch.prefix_lens, batch.extend_lens, batch.history_ids):
        assert got.shape == (0,) and got.dtype == np.int64


def read_rows_without_tokens(runner: Runner, state: VllmCanaryState):
    """The step read of two scheduled rows, A (4 tokens cached, block 1) and B (6 cached, blocks 2 and 3), with no
    token in the forward (``query_start_loc`` all 0)."""
    runner.inputs([Row("A", tokens(1, 4), 4, 0, [1]), Row("B", tokens(2, 6), 6, 0, [2, 3])])
    kwargs = {"input_ids": torch.zeros(0, dtype=torch.int64), "positions": torch.zeros(0, dtype=torch.int64)}
    md = SimpleNamespace(query_start_loc=torch.zeros(3, dtype=torch.int32),
                         seq_lens=torch.tensor([4, 6], dtype=torch.int32),
                         block_table=torch.tensor([[1, 0], [2, 3]], dtype=torch.int32),
                         slot_mapping=torch.zeros(0, dtype=torch.int64))
    return build_step(state.steps, runner, kwargs, {LAYER: md}, state.geos, state.max_tokens, state.unstamped)


def test_a_step_whose_rows_compute_nothing_reads_as_rows_without_tokens():
    """Two scheduled rows with no token in the forward (``query_start_loc`` all 0): both rows are read, with
    their prefix lengths, and no canary token."""
    runner = Runner()
    batch = read_rows_without_tokens(runner, canary_state(runner))
    assert batch.request_ids == ["A", "B"] and batch.extend_lens.tolist() == [0, 0]
    assert batch.prefix_lens.tolist() == [4, 6]
    for got in (batch.slot_mappings[0], batch.expected_input_ids, batch.expected_positions):
        assert got.shape == (0,) and got.dtype == np.int64


@pytest.mark.parametrize("max_model_len", [64, 62])
@pytest.mark.parametrize("seed", range(4))
def test_the_slot_table_holds_every_rows_slots_up_to_its_length_whatever_its_blocks(seed, max_model_len,
                                                                                     monkeypatch):
    """The plan reads a row's slots from the canary's table, rows ``1..B``: each row's positions below its own
    length hold ``block * BS + offset`` of its block table (hand-worked per position), for rows of different
    lengths and scattered blocks, also where the longest row's last block reaches past the table's width
    (``max_model_len`` 62: 16 blocks of 4 cover 64 positions, the table holds 63). The table is filled whole
    blocks at a time; the per-position fill (``slots_of``) runs only in that last case."""
    from kvcanary_cupy.integrations.vllm.canary import GroupGeometry

    per_position: list[int] = []
    slots_of = GroupGeometry.slots_of
    monkeypatch.setattr(GroupGeometry, "slots_of",
                        lambda self, *args: per_position.append(args[1]) or slots_of(self, *args))
    rng = np.random.default_rng(seed)
    runner = Runner(num_blocks=128, max_model_len=max_model_len, max_num_tokens=512)
    state = canary_state(runner)
    lengths = [max_model_len, *rng.integers(1, max_model_len, 3).tolist()]
    rng.shuffle(lengths)
    ids = rng.permutation(np.arange(1, 128))
    rows, used = [], 0
    for i, n in enumerate(lengths):
        blocks = ids[used : used + -(-n // BS)].tolist()
        used += len(blocks)
        rows.append(Row(f"r{i}", tokens(seed * 10 + i, n), 0, n, blocks))
    run_step(state, runner, rows)
    state.flush()
    for i, r in enumerate(rows):
        assert state.tables[0][i + 1, :len(r.tokens)].tolist() == slots(r.blocks, 0, len(r.tokens))
    assert state.violations == [] and state.health_problems == []
    assert per_position == ([] if max_model_len == 64 else [max_model_len])


def test_a_step_whose_rows_compute_nothing_skips_the_same_step_look_up(monkeypatch):
    """The same-step look-up runs only for a step with rows and tokens: rows with no token in the forward (and no
    row at all) cost no look-up, and read as before."""
    calls = []
    look_up = step_module._same_step_rows
    monkeypatch.setattr(step_module, "_same_step_rows", lambda *args: calls.append(args) or look_up(*args))
    runner = Runner()
    state = canary_state(runner)
    batch = read_rows_without_tokens(runner, state)
    assert batch.prefix_lens.tolist() == [4, 6] and batch.slot_mappings[0].size == 0
    assert calls == []
    # a step with tokens does look (the spy is in place)
    a = Row("C", tokens(3, 6), 0, 6, [4, 5])
    build_step(state.steps, runner, *runner.inputs([a]), state.geos, state.max_tokens, state.unstamped)
    assert len(calls) == 1


@pytest.mark.parametrize("seed", range(3))
def test_a_step_holds_int32_block_tables_and_int64_slots_whatever_integer_dtypes_the_runner_hands(seed):
    """The step copies the metadata's block table as int32 and its slot mapping as int64 (the dtypes the plan
    and the slot tables take) also where the runner's tensors are int64 and int32."""
    runner = Runner()
    state = canary_state(runner)
    rng = np.random.default_rng(seed)
    blocks = [int(b) for b in rng.choice(np.arange(1, 64), 3, replace=False)]
    n = int(rng.integers(1, 3 * BS + 1))
    kwargs, md = runner.inputs([Row("A", tokens(seed, n), 0, n, blocks)])
    md[LAYER].block_table = md[LAYER].block_table.to(torch.int64)
    md[LAYER].slot_mapping = md[LAYER].slot_mapping.to(torch.int32)
    batch = state.read_step(kwargs, md)
    assert batch.block_tables[0].dtype == np.int32 and batch.block_tables[0].tolist() == [blocks]
    assert batch.slot_mappings[0].dtype == np.int64 and batch.slot_mappings[0].tolist() == slots(blocks, 0, n)


def test_more_requests_in_a_step_than_the_canary_was_sized_for_are_refused_by_name_before_any_launch():
    runner = Runner(max_num_reqs=2)
    state = canary_state(runner)
    rows = [Row(rid, tokens(i, 4), 0, 4, [i + 1]) for i, rid in enumerate("ABC")]
    batch = state.read_step(*runner.inputs(rows))
    with pytest.raises(ValueError, match=r"^kv-canary: vLLM scheduled 3 requests in one step, more than the 2 the "
                                         r"canary was sized for \(max_num_seqs\)$"):
        state.before_forward(batch)
    state.settle()
    assert set(endpoint_counts(state).values()) <= {(0, 0)} and state.steps == 0


@pytest.mark.parametrize("seed", range(2))
def test_in_log_mode_a_steps_staging_and_head_work_wait_for_the_tail_work(seed, monkeypatch):
    """With the TAIL thread (log mode) on the worker's own cores, ``before_forward`` launches nothing: the staging,
    plan and HEAD phases go with the TAIL work after the forward, which then launches the HEAD and TAIL phases of
    the step's tokens."""
    no_idle_cores(monkeypatch)
    runner = Runner()
    state = canary_state(runner)
    assert state.tail is not None
    n = 5 + seed
    row = Row("A", tokens(seed, n), 0, n, [1, 2])
    kwargs, md = runner.inputs([row])
    batch = state.read_step(kwargs, md)
    state.before_forward(batch)
    assert state.head_deferred and set(endpoint_counts(state).values()) <= {(0, 0)}
    state.after_forward(batch, {0: md[LAYER].slot_mapping.numpy().astype(np.int64)})
    state.settle()
    assert not state.head_deferred and endpoint_counts(state)["write"][0] == n


@pytest.mark.parametrize("seed", range(2))
def test_a_forward_that_wrote_where_planned_hands_the_tail_write_no_slots_of_its_own(seed):
    """The TAIL write is given the forward's slots only when they differ from the plan's (the plan's own are
    already staged): none for a step written as planned, the moved slots for one that was not."""
    runner = Runner()
    state = canary_state(runner, mode="raise")  # the TAIL phases inline: the spy sees them at once
    given = []
    post_forward = state.rt.post_forward

    def spy(*, model, out_cache_loc=None):
        given.append(None if out_cache_loc is None else np.asarray(out_cache_loc).tolist())
        return post_forward(model=model, out_cache_loc=out_cache_loc)

    state.rt.post_forward = spy
    n = 6 + seed
    a = Row("A", tokens(seed, n), 0, n, [1, 2])
    run_step(state, runner, [a], seed)
    assert given == [None]
    b = Row("B", tokens(seed + 1, 3), 0, 3, [3])
    kwargs, md = runner.inputs([b])
    batch = state.read_step(kwargs, md)
    state.before_forward(batch)
    written = np.array([12, 13, 20], np.int64)  # position 2 written into slot 20, not 14
    state.after_forward(batch, {0: written})
    assert given == [None, [12, 13, 20]]


@pytest.mark.parametrize("seed", range(3))
def test_a_prefix_block_another_request_writes_now_with_its_own_tokens_reads_as_no_restamp(seed):
    """A writes its 8-token prompt into blocks 1, 2; B (prefix 4, its own tokens) has block 1 in its table, which A
    writes in the step with A's tokens: a candidate of the same-step look-up, but nothing of it is B's to re-stamp.
    The step reads in the forward's order with no re-stamp (``restamped`` false, every source the forward's own
    token), and B's verify flags its four prefix positions in block 1."""
    runner = Runner()
    state = canary_state(runner)
    a = Row("A", tokens(seed, 8), 0, 8, [1, 2])
    b = Row("B", tokens(seed + 100, 6), 4, 2, [1, 3])
    batch = run_step(state, runner, [a, b], seed)
    assert batch.restamped is False and batch.source_index.tolist() == list(range(10))
    assert batch.prefix_lens.tolist() == [0, 4] and batch.forward_tokens == 10
    state.flush()
    assert {(v.step, v.violation.slot) for v in state.violations} == {(0, BS + k) for k in range(BS)}


@pytest.mark.parametrize("seed", range(2))
def test_in_log_mode_after_forward_hands_the_tail_work_to_the_tail_thread_at_once(seed, monkeypatch):
    """``after_forward`` with its defaults (log mode, the TAIL thread on the worker's own cores): the TAIL work is
    submitted to the TAIL thread, not held for a release and not run on the caller's thread, and it runs there."""
    no_idle_cores(monkeypatch)
    runner = Runner()
    state = canary_state(runner)
    calls: list[str] = []
    for name in ("submit", "hold"):
        method = getattr(state.tail, name)
        setattr(state.tail, name, lambda *args, _name=name, _method=method: calls.append(_name) or _method(*args))
    threads: list[str] = []
    work = state._tail_work
    state._tail_work = lambda *args: threads.append(threading.current_thread().name) or work(*args)
    n = 4 + seed
    run_step(state, runner, [Row("A", tokens(seed, n), 0, n, [1, 2])], seed)
    assert calls == ["submit"]
    assert len(threads) == 1 and threads[0] != threading.current_thread().name


def test_a_full_attention_models_steps_run_no_cross_group_drop(monkeypatch):
    """One full-attention group (no window, no other group): the steps' block indexing never runs the drop of
    blocks claimed by another group or freed below a window, and indexes the complete blocks."""
    calls = []
    monkeypatch.setattr(BlockIndex, "_drop_freed_and_claimed", lambda self, *args: calls.append(args))
    runner = Runner()
    state = canary_state(runner)
    a = Row("A", tokens(0, 9), 0, 8, [1, 2])
    run_step(state, runner, [a])
    a.prefix, a.extend, a.blocks = 8, 1, [1, 2, 3]
    run_step(state, runner, [a])
    assert calls == [] and indexed_blocks(state) == {(0, 1): 0, (0, 2): 1}


@pytest.mark.parametrize("refused", [False, True])
def test_a_tail_thread_on_idle_cores_checks_the_steps_as_on_the_workers_and_falls_back_where_they_are_refused(
        monkeypatch, refused):
    """The sibling schedule with the TAIL thread given cores of its own (as a lone worker's on vLLM's CPU build):
    the same verifies and writes as inline, no violation; where the platform refuses those cores the thread stays
    on its creator's and, once started, the state stops staging beside the forward."""
    import os

    from kvcanary_cupy.integrations.vllm import canary as canary_module

    cpu = (os.cpu_count() or 1) + 64 if refused else max(os.sched_getaffinity(0))
    monkeypatch.setattr(canary_module, "idle_cores", lambda runner: frozenset({cpu}))
    runner = Runner()
    state = canary_state(runner)
    assert state.beside_forward  # until the thread has started, the cores are taken as given
    _q, step0, step1 = sibling_steps(0)
    run_step(state, runner, step0)
    assert state.beside_forward is not refused
    assert state.tail.pinned == (None if refused else {cpu})
    batch = run_step(state, runner, step1)
    state.flush()
    assert batch.prefix_lens.tolist() == [8, 8]
    assert state.violations == [] and state.health_problems == [] and state.dropped == 0
    assert endpoint_counts(state) == {"verify": (8 + 8, 2), "write": (12 + 6 + 6, 2)}
    state.close()


@pytest.mark.parametrize("mode", ["log", "raise"])
def test_the_tail_thread_shortens_the_switch_interval_while_it_runs_and_raise_mode_leaves_it(mode):
    """Log mode's TAIL thread holds the interpreter's switch interval at ``TAIL_SWITCH_INTERVAL_S`` from the first
    step to the state's close, then gives up its claim (the interval is put back once no other TAIL thread of the
    process, such as an engine another test left installed, still asks for it); raise mode (no TAIL thread) never
    changes it."""
    before, others = sys.getswitchinterval(), SWITCH_INTERVAL.claims
    try:
        sys.setswitchinterval(0.005)
        runner = Runner()
        state = canary_state(runner, mode=mode)
        run_step(state, runner, [Row("A", tokens(0, 5), 0, 5, [1, 2])])
        during, claims = sys.getswitchinterval(), SWITCH_INTERVAL.claims
        state.close()
        if mode == "log":
            assert during == pytest.approx(TAIL_SWITCH_INTERVAL_S, rel=1e-3) and claims == others + 1
        else:
            assert during == pytest.approx(0.005, rel=1e-3) and claims == others
        assert SWITCH_INTERVAL.claims == others
        back = TAIL_SWITCH_INTERVAL_S if others and mode == "log" else 0.005
        assert sys.getswitchinterval() == pytest.approx(back, rel=1e-3)
    finally:
        sys.setswitchinterval(before)
