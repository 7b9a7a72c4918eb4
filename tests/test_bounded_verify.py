"""The bounded verify (``CanaryConfig.max_verify_entries_per_step``): which prefix entries a step verifies,
against a scalar model of the round-robin cursor over many steps; the detection-latency bound that model
implies (:func:`verify_latency_bound`); a fault planted in a live slot reported within that bound; the NumPy
and host backends verifying the same windows and reporting the same rows."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kvcanary_cupy import CanaryArgumentError, RealKvSource
from kvcanary_cupy.backends import unavailable_reason
from kvcanary_cupy.runtime import (
    CanaryConfig,
    CanaryRuntime,
    Capacities,
    KvGroup,
    KvPools,
    LaunchEvent,
    StepBatch,
    verify_latency_bound,
)

BACKENDS = ["numpy", pytest.param("host", marks=pytest.mark.skipif(unavailable_reason("host") is not None,
                                                                   reason=str(unavailable_reason("host"))))]
NUM_SLOTS, ROWS, WIDTH, KV_BYTES = 8192, 7, 1024, 16


def token(rp: int, pos: int) -> int:
    return 100_000 * rp + 13 * pos + 5


class GrowingEngine:
    """Requests that only grow: each step every live row decodes one token (or ``extend`` tokens), and now and
    then a new row joins with a prompt (rows stay in pool-row order, so entries are only ever inserted into
    the plan's verify list, never removed or reordered) unless a test finishes a request (:meth:`finish`: its
    entries leave the list, and a later request may take its row). One full group, a token table, real K
    bytes."""

    def __init__(self, seed: int, *, prompts: tuple[int, int] = (8, 40)) -> None:
        self.rng = np.random.default_rng(seed)
        self.prompts = prompts
        self.req_to_token = np.zeros((ROWS + 1, WIDTH), np.int32)
        self.kv = np.zeros((NUM_SLOTS, KV_BYTES), np.uint8)
        self.lens: dict[int, int] = {}
        self.next_slot = 1

    def pools(self) -> KvPools:
        source = RealKvSource(self.kv, page_size=1, num_bytes_per_token=KV_BYTES, read_bytes=KV_BYTES)
        return KvPools((KvGroup.full("FULL", NUM_SLOTS, (source,)),), req_to_token=self.req_to_token)

    def schedule(self, join: bool, extend: int = 1) -> StepBatch:
        new_rows: dict[int, int] = {rp: extend for rp in self.lens}
        if join and len(self.lens) < ROWS:
            free_row = min(set(range(1, ROWS + 1)) - set(self.lens))  # the lowest row no live request holds
            new_rows[free_row] = int(self.rng.integers(*self.prompts))
        rows, prefix, ext, ids, pos, loc = [], [], [], [], [], []
        for rp in sorted(new_rows):
            p, e = self.lens.get(rp, 0), new_rows[rp]
            slots = np.arange(self.next_slot, self.next_slot + e)
            self.next_slot += e
            self.req_to_token[rp, p : p + e] = slots
            rows.append(rp)
            prefix.append(p)
            ext.append(e)
            ids += [token(rp, q) for q in range(p, p + e)]
            pos += list(range(p, p + e))
            loc += slots.tolist()
            self.lens[rp] = p + e
        a = lambda x: np.asarray(x, np.int64)  # noqa: E731
        return StepBatch(req_pool_indices=a(rows), prefix_lens=a(prefix), extend_seq_lens=a(ext), input_ids=a(ids),
                         positions=a(pos), out_cache_loc=a(loc))

    def finish(self, row: int) -> None:
        """The request of ``row`` finished: it is no longer scheduled (its KV slots are never reused)."""
        del self.lens[row]

    def forward(self, batch: StepBatch) -> None:
        for t, p, s in zip(batch.input_ids.tolist(), batch.positions.tolist(), batch.out_cache_loc.tolist(),
                           strict=True):
            self.kv[s] = np.random.default_rng(t * 7919 + p).integers(0, 256, KV_BYTES, dtype=np.uint8)


class WindowRecorder:
    """What the HEAD verify of each step really read: the window plan's slots (the observer hook)."""

    def __init__(self) -> None:
        self.windows: list[list[int]] = []

    def __call__(self, event: LaunchEvent) -> None:
        if event.when == "before" and event.kind == "verify" and event.endpoint is not None \
                and event.endpoint.role == "HEAD":
            group = event.group
            assert group is not None and group.window_plan is not None
            n = int(group.window_views["verify_num_valid"][0])
            self.windows.append(group.window_views["verify_slot_indices"][:n].tolist())


def make(engine: GrowingEngine, n: int, backend: str, recorder: WindowRecorder | None = None,
         mode: str = "log") -> CanaryRuntime:
    cfg = CanaryConfig(mode=mode, backend=backend, real_kv_hash_mode="all", max_verify_entries_per_step=n,
                       logger="kvcanary_cupy.runtime.test.bounded")
    return CanaryRuntime.create(cfg, engine.pools(), Capacities(max_batch_size=ROWS, max_tokens=64),
                                observer=recorder)


def run_steps(engine: GrowingEngine, rt: CanaryRuntime, steps: int, *, join_every: int = 5, extend: int = 1,
              plant: tuple[int, int] | None = None) -> tuple[list[list[int]], list]:
    """Drive ``steps`` steps; returns each step's verify list (the plan's entries, from the engine's own state:
    rows in batch order, each row's prefix) and every report. ``plant`` = (step, slot): before that step's
    forward, flip a byte of the slot's real K."""
    lists, reports = [], []
    for t in range(steps):
        batch = engine.schedule(join=t % join_every == 0, extend=extend)
        lists.append([int(engine.req_to_token[rp, q]) for rp, p in zip(batch.req_pool_indices.tolist(),
                                                                      batch.prefix_lens.tolist(), strict=True)
                      for q in range(p)])
        if plant is not None and plant[0] == t:
            engine.kv[plant[1], 3] ^= 0x40
        rt.prepare(batch)
        rt.pre_forward()
        engine.forward(batch)
        rt.post_forward()
        reports.append(rt.finish_step())
    reports.append(rt.flush())
    return lists, reports


def cursor_model(lists: list[list[int]], n: int) -> list[list[int]]:
    """The scalar model of the round-robin: a cursor into each step's list; the step verifies the ``n`` entries
    from it (fewer at the end of the list), then the cursor moves ``n`` on and back to 0 past the end."""
    cursor, out = 0, []
    for entries in lists:
        if cursor >= len(entries):
            cursor = 0
        out.append(entries[cursor : cursor + n])
        cursor += n
        if cursor >= len(entries):
            cursor = 0
    return out


def longest_wait(lists: list[list[int]], verified: list[list[int]]) -> int:
    """The most steps any entry waited, from the step it was first live until a step verified it (inclusive),
    over entries live in a step whose wait ended within the run; 0 when every live entry is verified at once."""
    worst, pending = 0, {}  # slot -> first step live and not verified since
    for t, (entries, seen) in enumerate(zip(lists, verified, strict=True)):
        for s in entries:
            pending.setdefault(s, t)
        for s in seen:
            if s in pending:
                worst = max(worst, t - pending.pop(s) + 1)
    return worst


@pytest.mark.parametrize("n", [5, 12, 61])
@pytest.mark.parametrize("seed", [0])
def test_window_is_the_cursor_models_and_its_wait_within_the_bound(n: int, seed: int) -> None:
    engine, recorder = GrowingEngine(seed), WindowRecorder()
    rt = make(engine, n, "numpy", recorder)
    # rows join now and then (a prompt appended to the list), every live row decodes one token a step
    lists, reports = run_steps(engine, rt, 160, join_every=9)
    model = cursor_model(lists, n)
    assert recorder.windows == model
    assert all(not r.new_violations for r in reports)
    live_max = max(len(e) for e in lists)
    # after the last join, a step inserts one entry per row into the list (G = ROWS): the bound holds for N > G
    last_join = 9 * (ROWS - 1)
    decode = slice(last_join + 1, None)
    bound = verify_latency_bound(live_max, n, growth_per_step=ROWS)
    wait = longest_wait(lists[decode], model[decode])
    if n > ROWS:
        assert 0 < wait <= bound, (wait, bound)
    else:
        assert bound == -1
    stats = rt.stats()
    assert stats["verify_live_max"] == live_max
    assert stats["verify_bound_steps"] == math.ceil(live_max / n)


def test_an_unchanging_list_is_covered_every_ceil_live_over_n_steps() -> None:
    engine, recorder = GrowingEngine(3, prompts=(30, 60)), WindowRecorder()
    rt = make(engine, 17, "numpy", recorder)
    lists, _ = run_steps(engine, rt, ROWS * 2, join_every=1)  # every row joins, then no more tokens
    lists2, _ = run_steps(engine, rt, 90, join_every=10_000, extend=0)
    assert all(e == lists2[0] for e in lists2)
    windows = recorder.windows[len(lists):]
    live = len(lists2[0])
    period = verify_latency_bound(live, 17)
    assert period == math.ceil(live / 17) > 3
    last: dict[int, int] = {}
    gaps = []
    for t, seen in enumerate(windows):
        for s in seen:
            if s in last:
                gaps.append(t - last[s])
            last[s] = t
    assert set(last) == set(lists2[0])  # every live slot verified
    assert max(gaps) == period  # and again exactly one period later (the cursor restarted with the pass)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("victim_index", [0, 150])
def test_a_fault_planted_in_a_live_slot_is_reported_within_the_bound(backend: str, victim_index: int) -> None:
    n, plant_step = 20, 60
    engine = GrowingEngine(5)
    # a dry run with the same seed finds the victim slot: the entry at victim_index of the plant step's list
    lists, _ = run_steps(GrowingEngine(5), make(GrowingEngine(5), n, "numpy"), plant_step + 1)
    victim = lists[plant_step][victim_index]
    rt = make(engine, n, backend)
    lists, reports = run_steps(engine, rt, 140, plant=(plant_step, victim))
    hits = [(r.launch_step, v) for r in reports for _, v in r.new_violations]
    assert hits, "the planted fault was never reported"
    first_step, first = hits[0]
    assert first.slot == victim and first.launch_tag.startswith("TAIL_K") and "REAL_KV" in " ".join(first.reasons)
    live_max = max(len(e) for e in lists)
    bound = verify_latency_bound(live_max, n, growth_per_step=ROWS)
    assert 0 <= first_step - plant_step < bound


def test_numpy_and_host_verify_the_same_windows_and_report_the_same_rows() -> None:
    if unavailable_reason("host") is not None:
        pytest.skip(f"host backend: {unavailable_reason('host')}")
    out = {}
    for backend in ("numpy", "host"):
        engine, recorder = GrowingEngine(9), WindowRecorder()
        rt = make(engine, 40, backend, recorder)
        _, reports = run_steps(engine, rt, 60, plant=(20, 57))
        out[backend] = (recorder.windows, [(r.launch_step, tuple(v.raw)) for r in reports
                                           for _, v in r.new_violations], rt.run_counters())
    assert out["numpy"] == out["host"]
    assert out["numpy"][1]  # the planted fault was reported on both


def test_the_default_is_the_full_verify_and_bad_sizes_are_refused() -> None:
    assert CanaryConfig().max_verify_entries_per_step == 0
    engine = GrowingEngine(2)
    rt = CanaryRuntime.create(CanaryConfig(backend="numpy", logger="kvcanary_cupy.runtime.test.bounded"),
                              engine.pools(), Capacities(max_batch_size=ROWS, max_tokens=64))
    assert all(state.window_plan is None for state in rt.groups.values())
    assert rt.stats()["verify_bound_steps"] == 1
    for bad in (-1, 1.5, True, 1 << 31):
        with pytest.raises(CanaryArgumentError, match=r"kv-canary: .*CanaryConfig\.max_verify_entries_per_step"):
            CanaryConfig(max_verify_entries_per_step=bad)


def test_latency_bound_formula() -> None:
    assert verify_latency_bound(100, 0) == 1
    assert verify_latency_bound(100, 100) == 1
    assert verify_latency_bound(101, 100) == 2
    assert verify_latency_bound(1000, 64) == 16
    assert verify_latency_bound(1000, 64, growth_per_step=8) == 2 * 18
    assert verify_latency_bound(1000, 8, growth_per_step=8) == -1


def test_the_simulators_fault_runs_detect_every_kind_within_the_bound() -> None:
    from kvcanary_cupy.sim import SimConfig, Simulation
    from kvcanary_cupy.sim.config import applicable_kinds
    from kvcanary_cupy.sim.report import summary_lines, validate

    kinds = applicable_kinds("prefill")
    cfg = SimConfig(preset="prefill", steps=120, requests=24, backend="numpy", max_verify_entries=256,
                    inject={k: 0.05 for k in kinds})
    report = Simulation(cfg).run()
    assert validate(report) == []
    assert report["outcome"] == "passed"
    assert all(k["status"] == "detected" for k in report["kinds"])
    vb = report["verify_bound"]
    assert vb["entries_per_step"] == 256 and vb["live_max"] > 256  # the window really bounded the verify
    assert vb["bound_steps"] == math.ceil(vb["live_max"] / 256)
    assert vb["bound_steps_growing"] == verify_latency_bound(vb["live_max"], 256, growth_per_step=vb["growth_max"])
    assert 0 < vb["slowest_steps"] <= vb["bound_steps_growing"]
    assert max(k["latency_steps"]["max"] for k in report["kinds"]) == vb["slowest_steps"]
    assert any(line.startswith("bounded verify: 256 entries/step/group") for line in summary_lines(report))


def step(engine: GrowingEngine, rt: CanaryRuntime, *, join: bool, extend: int = 1) -> list[int]:
    """One step of ``engine`` under ``rt``; returns its verify list (rows in batch order, each row's prefix)."""
    batch = engine.schedule(join=join, extend=extend)
    entries = [int(engine.req_to_token[rp, q]) for rp, p in zip(batch.req_pool_indices.tolist(),
                                                               batch.prefix_lens.tolist(), strict=True)
               for q in range(p)]
    rt.prepare(batch)
    rt.pre_forward()
    engine.forward(batch)
    rt.post_forward()
    assert not rt.finish_step().new_violations
    return entries


def slots(first: int, last: int) -> list[int]:
    return list(range(first, last + 1))


@pytest.mark.parametrize("backend", BACKENDS)
def test_after_requests_finish_below_the_cursor_the_next_window_starts_again_at_entry_0(backend: str) -> None:
    """Three requests of 20 prompt tokens (slots 1-20, 21-40, 41-60, listed in row order), a window of 10, no
    new tokens after the prompts: the cursor walks to entry 40; then requests 2 and 3 finish and the list is
    request 1's 20 entries, below the cursor. Worked by hand: the next window is entries 0-9 again."""
    engine, recorder = GrowingEngine(0, prompts=(20, 21)), WindowRecorder()
    rt = make(engine, 10, backend, recorder)
    for t in range(5):  # requests join at steps 0, 1 and 2; each one's entries are listed from the next step
        step(engine, rt, join=t < 3, extend=0)
    engine.finish(2)
    engine.finish(3)
    for _ in range(3):
        assert step(engine, rt, join=False, extend=0) == slots(1, 20)
    assert recorder.windows == [[], slots(1, 10), slots(11, 20), slots(21, 30), slots(31, 40),
                                slots(1, 10), slots(11, 20), slots(1, 10)]
    assert not rt.flush().new_violations


@pytest.mark.parametrize("seed", range(8))
def test_windows_follow_the_cursor_model_while_requests_join_and_finish(seed: int) -> None:
    rng = np.random.default_rng(1000 + seed)
    n = int(rng.integers(3, 30))
    engine, recorder = GrowingEngine(seed, prompts=(4, 30)), WindowRecorder()
    rt = make(engine, n, "numpy", recorder)
    lists = []
    for _ in range(60):
        if len(engine.lens) > 1 and rng.random() < 0.3:  # a request finishes: its entries leave the list
            engine.finish(int(rng.choice(sorted(engine.lens))))
        lists.append(step(engine, rt, join=rng.random() < 0.4))
    assert recorder.windows == cursor_model(lists, n)
    # the case under test happened: a list that shrank to or below where the cursor stood
    cursor, restarts = 0, 0
    for entries in lists:
        restarts += 0 < len(entries) <= cursor
        cursor = 0 if cursor >= len(entries) else cursor
        cursor = 0 if cursor + n >= len(entries) else cursor + n
    assert restarts > 0
    assert not rt.flush().new_violations


def test_the_bound_is_one_step_when_the_live_entries_equal_the_window_even_with_growth() -> None:
    # live entries L equal to the window N: every entry is in every window, whatever G entries a step adds
    for n, growth in ((64, 8), (64, 63), (64, 64), (64, 200), (1, 1)):
        assert verify_latency_bound(n, n, growth_per_step=growth) == 1
    # one entry more: a pass may take ceil(65 / (64 - 8)) = 2 steps, so the bound is twice that; none for N <= G
    assert verify_latency_bound(65, 64, growth_per_step=8) == 4
    assert verify_latency_bound(65, 64, growth_per_step=64) == -1
    # a run at the boundary: two requests of 20 prompt tokens (20 entries added by a step), a window of 40
    engine, recorder = GrowingEngine(0, prompts=(20, 21)), WindowRecorder()
    rt = make(engine, 40, "numpy", recorder)
    for t in range(4):
        step(engine, rt, join=t < 2, extend=0)
    rt.flush()
    assert recorder.windows == [[], slots(1, 20), slots(1, 40), slots(1, 40)]
    stats = rt.stats()
    assert (stats["verify_live_max"], stats["verify_growth_max"]) == (40, 20)
    assert (stats["verify_bound_steps"], stats["verify_bound_steps_growing"]) == (1, 1)
    assert "every live slot verified within 1 steps (40 live entries), within 1 while 20 entries" in rt.stats_line()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("prompt", [12, 20, 33])
def test_an_overflowed_plan_counts_neither_in_the_live_maximum_nor_in_the_bound(backend: str, prompt: int) -> None:
    """Three requests of ``prompt`` tokens against a verify capacity between two and three prompts: the lists
    hold P, 2P, then 3P entries (the plan overflows, twice), then 2P again once request 3 finished. Worked by
    hand: the most live entries are 2P and the bound ceil(2P / N); the overflowed plans' counts are not."""
    n, capacity = prompt // 2 + 1, 2 * prompt + prompt // 2
    engine = GrowingEngine(0, prompts=(prompt, prompt + 1))
    cfg = CanaryConfig(mode="log", backend=backend, real_kv_hash_mode="all", max_verify_entries_per_step=n,
                       logger="kvcanary_cupy.runtime.test.bounded")
    rt = CanaryRuntime.create(cfg, engine.pools(), Capacities(max_batch_size=ROWS, max_tokens=64,
                                                              verify_capacity=capacity))
    lengths = [len(step(engine, rt, join=t < 3, extend=0)) for t in range(5)]
    engine.finish(3)
    lengths += [len(step(engine, rt, join=False, extend=0)) for _ in range(3)]
    rt.flush()
    assert lengths == [0, prompt, 2 * prompt, 3 * prompt, 3 * prompt, 2 * prompt, 2 * prompt, 2 * prompt]
    stats = rt.stats()
    assert stats["overflows"] == {"FULL": 2}
    assert stats["verify_live_max"] == 2 * prompt
    assert stats["verify_bound_steps"] == math.ceil(2 * prompt / n)
    assert f"within {math.ceil(2 * prompt / n)} steps ({2 * prompt} live entries)" in rt.stats_line()
