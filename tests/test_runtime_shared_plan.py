"""Groups that share a plan (``KvGroup.plan_of``): an engine's layers split into groups of at most 4 sources per
K/V plan once and keep one set of HEAD records. Against the scalar protocol oracle run with every group on its
own plan, the shared runtime reports every row but the second group's HEAD rows (which repeat the first's),
with one plan launch per step and no HEAD launch for the second group."""

from __future__ import annotations

import numpy as np
import pytest
import runtime_scenario as sc
from runtime_oracle import OracleGroup, ProtocolOracle
from test_runtime import BACKENDS, LOGGER, drive, faults, rows_by_launch

from kvcanary_cupy import CanaryLaunchTag
from kvcanary_cupy.runtime import CanaryConfig, CanaryRuntime, Capacities, KvGroup, KvPools


class TwoGroupEngine(sc.ToyEngine):
    """The toy engine with two groups over one slot space: A fingerprints K then V, B the same bytes the other
    way round (so their TAIL records differ), B sharing A's plan when ``shared``."""

    def __init__(self, shared: bool) -> None:
        super().__init__(with_v=True)
        self.shared = shared

    def groups(self) -> tuple[KvGroup, ...]:
        k, v = self.sources("FULL", "K"), self.sources("FULL", "V")
        return (KvGroup.full("A", sc.NUM_SLOTS, k, v),
                KvGroup("B", sc.NUM_SLOTS, v, k, plan_of="A" if self.shared else None))


def oracle(engine: TwoGroupEngine, rt: CanaryRuntime) -> ProtocolOracle:
    def src(kv: str) -> list:
        return [(engine.kv["FULL"][kv].reshape(sc.NUM_SLOTS // sc.PAGE, -1), sc.PAGE, sc.TOKEN_BYTES,
                 sc.TOKEN_BYTES)]

    groups = [OracleGroup("A", sc.NUM_SLOTS, ("K", "V"), {"K": src("K"), "V": src("V")}),
              OracleGroup("B", sc.NUM_SLOTS, ("K", "V"), {"K": src("V"), "V": src("K")})]
    cfg = rt.config
    return ProtocolOracle(groups, mode=int(cfg.real_kv_hash_mode), check_tokens=cfg.verify_token_assert,
                          write_assert=cfg.write_input_assert, req_to_token=engine.req_to_token,
                          pool_shape=engine.req_to_token.shape)


def make(engine: TwoGroupEngine, backend: str, **config) -> CanaryRuntime:
    return CanaryRuntime.create(CanaryConfig(backend=backend, logger=LOGGER, **config), engine.pools(),
                                Capacities(max_batch_size=sc.MAX_BS, max_tokens=sc.MAX_TOKENS),
                                sweep_source=engine.held)


def is_head(row: tuple[int, ...]) -> bool:
    return CanaryLaunchTag(row[0]).name.startswith("HEAD")


CONFIGS = {"plain": dict(), "tokens-sweep": dict(write_input_assert=True, verify_token_assert=True, sweep_interval=2),
           "bounded": dict(max_verify_entries_per_step=5, sweep_interval=1)}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("inject", [False, True], ids=["clean", "faults"])
def test_a_group_sharing_a_plan_reports_every_oracle_row_but_its_repeated_head_rows(backend, config, inject):
    engine = TwoGroupEngine(shared=True)
    rt = make(engine, backend, **CONFIGS[config])
    want_oracle = oracle(engine, rt)
    if config == "bounded":  # the oracle verifies every entry: compare with the same runtime, plans unshared
        twin = TwoGroupEngine(shared=False)
        twin_rt = make(twin, backend, **CONFIGS[config])
        want = rows_by_launch(drive(twin, twin_rt, hooks=faults(twin) if inject else None))
        want = {k: sorted(r for r in v if not (k[0] == "B" and is_head(r))) for k, v in want.items()}
        want = {k: v for k, v in want.items() if v}
        reports = drive(engine, rt, hooks=faults(engine) if inject else None)
    else:
        reports = drive(engine, rt, want_oracle, hooks=faults(engine) if inject else None)
        want = {k: sorted(tuple(r) for r in v if not (k[0] == "B" and is_head(tuple(r))))
                for k, v in want_oracle.rows.items()}
        want = {k: v for k, v in want.items() if v}
    got = {k: sorted(v) for k, v in rows_by_launch(reports).items()}
    assert got == want
    if inject:
        # the faults reach both groups, B through the verify of the plan it shares
        assert any(k[0] == "B" for k in got) and any(k[0] == "A" for k in got)
    else:
        assert not want
    for rep in reports:
        assert rep.health_problems == [] and rep.status_bits == 0 and not rep.plan_status and not rep.overflowed


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_group_sharing_a_plan_launches_no_plan_and_no_head_and_counts_no_protected_token(backend):
    engine, alone = TwoGroupEngine(shared=True), TwoGroupEngine(shared=False)
    rt, rt_alone = make(engine, backend), make(alone, backend)
    kinds: list[tuple[str, str, str]] = []
    rt._observer = lambda ev: kinds.append((ev.kind, ev.group.name, ev.endpoint.role if ev.endpoint else "-")) \
        if ev.when == "before" else None
    drive(engine, rt)
    drive(alone, rt_alone)
    steps = len(sc.SCHEDULE)
    assert kinds.count(("plan", "A", "-")) == steps and not any(k[0] == "plan" and k[1] == "B" for k in kinds)
    assert not any(k[1] == "B" and k[2] == "HEAD" for k in kinds)
    assert sum(1 for k in kinds if k[1] == "B" and k[2] == "TAIL") == 4 * steps  # verify + write, K and V
    counters = rt.run_counters()
    assert not any(name == "B" and tag.startswith("HEAD") for name, tag, _ in counters)
    stats, stats_alone = rt.stats(), rt_alone.stats()
    # every token is protected once (A's HEAD K writes), not once per group as with two plans
    assert stats["protected_tokens"] * 2 == stats_alone["protected_tokens"] > 0
    assert stats["verified_entries"] < stats_alone["verified_entries"]


def test_plan_of_is_refused_unless_it_names_an_earlier_group_with_the_same_plan_inputs():
    engine = sc.ToyEngine(with_v=True)
    k, v = engine.sources("FULL", "K"), engine.sources("FULL", "V")
    table = engine.req_to_token
    lut = np.zeros(sc.NUM_SLOTS + 1, np.int64)
    a = KvGroup.full("A", sc.NUM_SLOTS, k, v)
    cases = {
        "must name an earlier group": (KvGroup("B", sc.NUM_SLOTS, k, v, plan_of="C"), a),
        "plans would differ": (KvGroup("B", sc.NUM_SLOTS - 4, k, v, plan_of="A"),),
        "plans would differ ": (KvGroup("B", sc.NUM_SLOTS, k, v, model="draft", plan_of="A"),),
        "plans would differ  ": (KvGroup("B", sc.NUM_SLOTS, k, v, swa_window=3, full_to_swa_index_mapping=lut,
                                         plan_of="A"),),
        "shares another's plan itself": (KvGroup("B", sc.NUM_SLOTS, k, v, plan_of="A"),
                                         KvGroup("C", sc.NUM_SLOTS, k, v, plan_of="B")),
    }
    for message, tail in cases.items():
        groups = (a, *tail) if tail[-1] is not a else (tail[0], a)
        with pytest.raises(ValueError, match=r"^kv-canary: .*plan_of.*" + message.strip()):
            KvPools(groups, req_to_token=table)
    with pytest.raises(ValueError, match=r"^kv-canary: KvGroup 'A'.plan_of must name another group"):
        KvGroup.full("A", sc.NUM_SLOTS, k, v).__class__("A", sc.NUM_SLOTS, k, v, plan_of="A")
    from kvcanary_cupy.layouts import TokenTable

    other = KvGroup("B", sc.NUM_SLOTS, k, v, plan_of="A", layout=TokenTable(table.copy()))
    with pytest.raises(ValueError, match="plans would differ"):
        KvPools((a, other), req_to_token=table)
    KvPools((a, KvGroup("B", sc.NUM_SLOTS, v, k, plan_of="A")), req_to_token=table)  # accepted


def test_a_group_with_its_own_plan_after_a_sharing_one_still_plans_and_runs_its_head():
    """A, then B sharing A's plan, then C with its own: A and C each launch their plan and HEAD endpoints."""
    engine = sc.ToyEngine(with_v=True)
    k, v = engine.sources("FULL", "K"), engine.sources("FULL", "V")
    pools = KvPools((KvGroup.full("A", sc.NUM_SLOTS, k, v), KvGroup("B", sc.NUM_SLOTS, v, k, plan_of="A"),
                     KvGroup.full("C", sc.NUM_SLOTS, v, k)), req_to_token=engine.req_to_token)
    launches: list[tuple[str, str, str]] = []
    rt = CanaryRuntime.create(CanaryConfig(logger=LOGGER), pools,
                              Capacities(max_batch_size=sc.MAX_BS, max_tokens=sc.MAX_TOKENS),
                              observer=lambda ev: launches.append((ev.group.name, ev.kind, ev.endpoint.role
                                                                   if ev.endpoint else "-"))
                              if ev.when == "before" else None)
    batch = engine.schedule(0)
    rt.prepare(engine.step_batch(batch))
    rt.pre_forward()
    assert launches == [(g, kind, role) for g in ("A", "C")
                        for kind, role in (("plan", "-"), ("verify", "HEAD"), ("verify", "HEAD"), ("write", "HEAD"),
                                           ("write", "HEAD"))]
