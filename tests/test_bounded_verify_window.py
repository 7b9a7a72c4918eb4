"""The bounded verify's window selection (``select_window``) step by step on a plan filled to its capacity,
against windows worked out by hand; the latency bound at its boundaries; the bound a runtime states before
its first step."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from kvcanary_cupy.runtime import CanaryConfig, CanaryRuntime, Capacities, KvGroup, KvPools, verify_latency_bound
from kvcanary_cupy.runtime.groups import VERIFY_ENTRY_FIELDS, select_window

CAPACITY = 10


def group(n: int, live: int, seed: int) -> SimpleNamespace:
    """A plan of CAPACITY entries (entry i of every field: a distinct value from ``seed``), ``live`` of them
    listed, and a window of ``n``; the words and scratch in the runtime's dtypes (int32 counts, int64 [1]
    words)."""
    base = 1000 * (seed + 1)
    plan = {name: (base + 100 * k + np.arange(CAPACITY)).astype(np.int64) for k, name in enumerate(VERIFY_ENTRY_FIELDS)}
    plan["verify_num_valid"] = np.array([live], np.int32)
    win = {name: np.full(n, -1, np.int64) for name in VERIFY_ENTRY_FIELDS}
    win["verify_num_valid"] = np.zeros(1, np.int32)
    scratch = {"arange": np.arange(n, dtype=np.int64), "index": np.zeros(n, np.int64),
               **{w: np.zeros(1, np.int64) for w in ("cursor", "live", "temp", "flag")}}
    return SimpleNamespace(plan_views=plan, window_views=win, window_scratch=scratch)


def window(state: SimpleNamespace) -> list[int]:
    """The plan entry indices the window holds (read back from the slot field), its first num_valid only."""
    select_window(state, np)
    k = int(state.window_views["verify_num_valid"][0])
    entries = (state.window_views["verify_slot_indices"][:k] - int(state.plan_views["verify_slot_indices"][0]))
    assert len(entries) == k  # a count the window's arrays hold
    for name in VERIFY_ENTRY_FIELDS:  # every field gathered from the same entries
        got = state.window_views[name][:k] - state.plan_views[name][0]
        assert got.tolist() == entries.tolist(), name
    return entries.tolist()


@pytest.mark.parametrize("seed", range(3))
def test_windows_over_a_full_plan_end_at_its_last_entry_and_wrap(seed):
    state = group(4, CAPACITY, seed)
    assert [window(state) for _ in range(5)] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9], [0, 1, 2, 3], [4, 5, 6, 7]]
    assert int(state.window_scratch["cursor"][0]) == 8


@pytest.mark.parametrize("seed", range(3))
def test_a_count_past_the_capacity_is_read_as_the_capacity(seed):
    # an overflowed plan counts the entries it needed, not those it holds
    state = group(4, CAPACITY + 3, seed)
    assert [window(state) for _ in range(4)] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9], [0, 1, 2, 3]]


@pytest.mark.parametrize("seed", range(3))
def test_a_list_that_shrank_below_the_cursor_starts_again_at_entry_0(seed):
    state = group(3, 8, seed)
    assert [window(state) for _ in range(2)] == [[0, 1, 2], [3, 4, 5]]
    state.plan_views["verify_num_valid"][0] = 5  # requests finished: the cursor (6) is past the list
    assert [window(state) for _ in range(3)] == [[0, 1, 2], [3, 4], [0, 1, 2]]


def test_latency_bound_at_its_boundaries():
    assert verify_latency_bound(5, 1) == 5  # one entry a step: five steps
    assert verify_latency_bound(4, 4, growth_per_step=1) == 1  # the whole list fits one window
    assert verify_latency_bound(5, 4, growth_per_step=1) == 2 * 2


def test_a_runtime_states_its_bound_before_any_step():
    pools = KvPools((KvGroup.full("FULL", 64, ()),), req_to_token=np.zeros((3, 16), np.int32))
    rt = CanaryRuntime.create(CanaryConfig(backend="numpy", max_verify_entries_per_step=4,
                                           logger="kvcanary_cupy.runtime.test.window"),
                              pools, Capacities(max_batch_size=2, max_tokens=16))
    assert rt.verify_bound() == {"verify_entries_per_step": 4, "verify_live_max": 0, "verify_growth_max": 0,
                                 "verify_bound_steps": 1, "verify_bound_steps_growing": 1}
