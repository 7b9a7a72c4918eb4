"""Reading a vLLM step with array operations and histories kept between steps gives exactly the plan inputs of
the request-by-request reading (:mod:`step_oracle`) on every step of every workload, fault runs included; the
kept histories and the block index follow their state under every change; the bounded sweep reaches every
indexed block the running requests do not hold within its stated latency."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
from step_oracle import note_blocks, oracle_step

from kvcanary_cupy.integrations import vllm as kv
from kvcanary_cupy.integrations.common.state import cached_block_slots
from kvcanary_cupy.integrations.vllm.blocks import BlockIndex, sweep_latency_steps
from kvcanary_cupy.integrations.vllm.faults import injector
from kvcanary_cupy.integrations.vllm.step import RequestHistories
from kvcanary_cupy.integrations.vllm.workloads import workloads

WORKLOADS = workloads()


class CompareWithOracle:
    """A step observer: reads each step with the oracle before the canary does, compares after the forward;
    keeps the oracle's block dictionary next to the canary's index."""

    def __init__(self) -> None:
        self.want: dict[str, Any] | None = None
        self.blocks: dict[tuple[int, int], int] = {}
        self.steps = 0
        self.restamped_steps = 0

    def before_forward(self, canary, step, kwargs, metadata) -> None:
        st = canary.state
        self.want = oracle_step(step, canary.runner, kwargs, metadata, st.geos, st.max_tokens, st.unstamped)

    def after_forward(self, canary, step, batch) -> None:
        want, st = self.want, canary.state
        assert want is not None
        for name in ("step", "request_ids"):
            assert getattr(batch, name) == want[name], name
        for name in ("rows", "prefix_lens", "extend_lens", "input_ids", "positions", "expected_input_ids",
                     "expected_positions", "expected_pool", "valid_lens", "source_index"):
            got = getattr(batch, name)
            np.testing.assert_array_equal(got, want[name], err_msg=f"step {step}: {name}")
            assert got.dtype == want[name].dtype, name
        for name in ("block_tables", "slot_mappings"):
            assert set(getattr(batch, name)) == set(want[name])
            for g, arr in want[name].items():
                np.testing.assert_array_equal(getattr(batch, name)[g], arr, err_msg=f"step {step}: {name}")
        assert batch.forward_tokens == int((want["source_index"] >= 0).sum())
        assert (batch.deferred, batch.forward_len) == (want["deferred"], want["forward_len"])
        assert batch.restamped == bool((want["source_index"] < 0).any())
        self.restamped_steps += batch.restamped
        note_blocks(self.blocks, st.geos, batch)
        assert set(st.block_index) == set(self.blocks)
        for (gi, block), k in self.blocks.items():
            assert st.block_index.where[gi][block] == k
        self.steps += 1


@pytest.mark.parametrize(("name", "fault"), [(n, None) for n in sorted(WORKLOADS)]
                         + [("shared-prefix", "prefix-foreign"), ("mixed-lengths", "slot-mapping"),
                            ("preemption", "preempt-reuse")])
def test_every_step_reads_as_the_request_by_request_oracle(llm, name, fault):
    canary = kv.install(llm, backend="numpy", sweep_interval=2)
    compare = CompareWithOracle()
    if fault is not None:
        canary.observers.append(injector(fault, at=1 if fault.startswith("prefix") else 3, seed=1))
    canary.observers.append(compare)
    try:
        WORKLOADS[name].run(llm)
        canary.finish()
    finally:
        canary.remove()
    assert compare.steps == canary.steps > 3
    if name == "parallel-sampling":
        assert compare.restamped_steps > 0  # the same-step prefix tail was really exercised


@dataclass
class FakeState:
    prompt_token_ids: list[int] | None
    output_token_ids: list[int] = field(default_factory=list)


@pytest.mark.parametrize("seed", range(20))
def test_kept_histories_follow_every_change_of_the_request_state(seed):
    rng = np.random.default_rng(seed)
    hist = RequestHistories()
    states = {f"r{i}": FakeState(rng.integers(0, 1000, int(rng.integers(1, 90))).tolist()) for i in range(4)}
    for _ in range(60):
        rid = f"r{int(rng.integers(0, 4))}"
        st = states[rid]
        action = int(rng.integers(0, 8))
        if action <= 3:  # decode: one token, or a few (a prefill chunk's sample, a spec step)
            st.output_token_ids.extend(rng.integers(0, 1000, 1 + (action == 3) * 5).tolist())
        elif action == 4:  # the last token replaced in place (a placeholder filled)
            if st.output_token_ids:
                st.output_token_ids[-1] += 1
        elif action == 5:  # output trimmed (rejected tokens dropped)
            del st.output_token_ids[len(st.output_token_ids) // 2:]
        elif action == 6:  # the request added again under its id: another state object
            states[rid] = FakeState(rng.integers(0, 1000, int(rng.integers(1, 50))).tolist())
        else:  # another output list object (rebuilt on resume)
            st.output_token_ids = list(st.output_token_ids)
            if st.output_token_ids:
                st.output_token_ids[0] += 7
        st = states[rid]
        full = st.prompt_token_ids + st.output_token_ids
        end = int(rng.integers(0, len(full) + 1))
        np.testing.assert_array_equal(hist.history(rid, st, end), np.array(full[:end], np.int64))
        with pytest.raises(ValueError, match=r"^kv-canary: request r\d schedules positions up to"):
            hist.history(rid, st, len(full) + 1)
    with pytest.raises(ValueError, match=r"^kv-canary: request x has no prompt token ids"):
        hist.history("x", FakeState(None), 0)
    hist.keep_only(["r0"])
    assert len(hist) <= 1


def test_a_decode_step_extends_the_kept_history_in_place_and_a_rebuilt_output_list_is_read_afresh():
    """What a step copies of a request's state is only what it gained: the second read (one token more) is the
    same buffer, extended, and so is a third with nothing gained; an output list vLLM rebuilt (another object)
    is read again into a new one."""
    hist = RequestHistories()
    st = FakeState([1, 2, 3], [4])
    first = hist.history("a", st, 4)
    st.output_token_ids.append(5)
    second = hist.history("a", st, 5)
    assert second.tolist() == [1, 2, 3, 4, 5] and np.shares_memory(first, second)
    again = hist.history("a", st, 5)  # nothing gained: nothing read
    assert again.tolist() == [1, 2, 3, 4, 5] and np.shares_memory(second, again)
    st.output_token_ids = list(st.output_token_ids)
    third = hist.history("a", st, 5)
    assert third.tolist() == [1, 2, 3, 4, 5] and not np.shares_memory(second, third)


def test_a_history_longer_than_its_kept_buffer_grows_and_a_long_state_read_afresh_is_whole():
    """A 3-token prompt decoding 292 tokens one a step, then 5 at once: its kept buffer (64 tokens at first)
    grows on the way, a few times, not once a step, and every read is the state's tokens. A request read first
    with a 70-token prompt and 40 output tokens comes back whole."""
    hist = RequestHistories()
    st = FakeState([7, 8, 9])
    last, buffers = hist.history("a", st, 3), 1
    for new in [[1000 + t] for t in range(292)] + [[2000, 2001, 2002, 2003, 2004]]:
        st.output_token_ids += new
        got = hist.history("a", st, 3 + len(st.output_token_ids))
        np.testing.assert_array_equal(got, [7, 8, 9, *st.output_token_ids])
        assert got.dtype == np.int64
        buffers += not np.shares_memory(got, last)
        last = got
    assert 2 <= buffers <= 4
    long = FakeState(list(range(70)), list(range(100, 140)))
    np.testing.assert_array_equal(hist.history("b", long, 110), [*range(70), *range(100, 140)])


@pytest.mark.parametrize("seed", range(30))
def test_block_index_matches_the_block_by_block_oracle(seed):
    rng = np.random.default_rng(seed)
    bs, nblocks = 4, 40
    index = BlockIndex([nblocks], [bs], blocks_per_sweep=nblocks)
    oracle: dict[tuple[int, int], int] = {}

    @dataclass
    class Batch:
        block_tables: dict[int, np.ndarray]
        prefix_lens: np.ndarray
        extend_lens: np.ndarray
        valid_lens: np.ndarray
        slot_mappings: dict[int, np.ndarray]
        deferred: dict[str, int]

        @property
        def request_ids(self) -> list[str]:
            return [f"r{i}" for i in range(self.size)]

        @property
        def size(self) -> int:
            return len(self.prefix_lens)

    @dataclass
    class Geo:
        index: int = 0
        block_size: int = bs

    table, prefix, extend = np.zeros((0, 8), np.int32), np.zeros(0, np.int64), np.zeros(0, np.int64)
    valid, stamped, deferred = prefix, np.zeros(0, np.int64), {}
    for _ in range(25):
        if rng.random() < 0.6:  # a new step; else the last one again (a decode step inside its blocks)
            b = int(rng.integers(0, 6))
            table = rng.integers(0, nblocks, (b, 8)).astype(np.int32)  # repeated blocks across and within rows
            prefix = rng.integers(0, 20, b)
            extend = rng.integers(0, 12, b)
            valid = prefix + extend
            # some rows left partly unstamped (deferred re-stamps): they stamp nothing, the forward wrote on
            waits = rng.random(b) < 0.3
            deferred = {f"r{i}": int(prefix[i]) for i in np.flatnonzero(waits)}
            extend = np.where(waits, 0, extend)
            valid = np.where(waits, prefix + rng.integers(1, 12, b), valid)
            stamped = rng.integers(0, nblocks, 6) * bs  # the step's canary slots (a few blocks)
        if rng.random() < 0.3:
            fresh = rng.integers(0, nblocks + 5, 3).tolist()  # ids past the pool are ignored
            index.forget(fresh)
            for block in fresh:
                oracle.pop((0, int(block)), None)
        batch = Batch({0: table}, prefix, extend, valid, {0: stamped}, deferred)
        index.note_step(0, table, prefix + extend, valid, stamped // bs if deferred else None)
        note_blocks(oracle, [Geo()], batch)
        assert dict(((g, blk), int(index.where[g][blk])) for g, blk in index) == oracle
    # the sweep leaves out the blocks the last step's rows hold (that step's verify covered them)
    held = {int(blk) for i in range(b) for blk in table[i, : -(-int(prefix[i] + extend[i]) // bs)]}
    slots, pos, prev = index.sweep_entries(0, bs, bs)
    want = cached_block_slots(((blk, k) for (_, blk), k in sorted(oracle.items()) if blk not in held), bs, bs)
    for got, w in zip((slots, pos, prev), want, strict=True):
        np.testing.assert_array_equal(got, w)


@pytest.mark.parametrize("seed", range(20))
def test_bounded_sweep_reaches_every_indexed_block_within_its_latency(seed):
    rng = np.random.default_rng(seed)
    bs, nblocks = 2, 50
    per = int(rng.integers(1, 12))
    index = BlockIndex([nblocks], [bs], blocks_per_sweep=per)
    index.where[0][rng.choice(np.arange(1, nblocks), int(rng.integers(1, nblocks - 1)), replace=False)] = 0
    indexed = set(index.indexed(0).tolist())
    interval = int(rng.integers(1, 5))
    latency = sweep_latency_steps(len(indexed), per, interval)
    seen: set[int] = set()
    for step in range(latency):
        if step % interval == 0:
            slots, _, _ = index.sweep_entries(0, bs, bs)
            assert slots.size <= per * bs
            seen |= set((slots // bs).tolist())
    assert seen == indexed
    assert sweep_latency_steps(len(indexed), per, 0) == 0
