"""The operators' side: the metric names follow Prometheus' conventions, every engine integration exports the
same series (read back from prometheus_client's registry after real step reports), and every query of the
shipped Grafana dashboard and alerting rules reads a metric and labels the code exports; ``promtool`` validates
the rules and their PromQL, and a rule unit test shows each alert fires with its runbook link."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import yaml

from kvcanary_cupy import CanaryStatus, FailReason, PlanStatus
from kvcanary_cupy.constants import (
    VIOLATION_FIELD_FAIL_REASON_BITS,
    VIOLATION_FIELD_KERNEL_KIND,
    VIOLATION_FIELD_POSITION,
    VIOLATION_FIELD_SLOT_IDX,
)
from kvcanary_cupy.integrations.common import metrics as metrics_module
from kvcanary_cupy.integrations.common.metrics import METRICS, StepMetrics, metric_names
from kvcanary_cupy.integrations.common.state import EngineCanaryState
from kvcanary_cupy.observability import dashboard_path, rules_path
from kvcanary_cupy.runtime import StepReport
from kvcanary_cupy.violations import decode_row

ROOT = Path(__file__).resolve().parent.parent
PROMTOOL = shutil.which("promtool")
SPECS = {m.name: m for m in METRICS}

# PromQL words that are not metric names (functions, aggregations, keywords) and the dashboard's variables.
PROMQL_WORDS = {
    "sum", "min", "max", "avg", "count", "stddev", "stdvar", "topk", "bottomk", "quantile", "count_values", "group",
    "by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "offset", "bool",
    "rate", "irate", "increase", "delta", "idelta", "deriv", "resets", "changes", "vector", "scalar", "absent",
    "absent_over_time", "sum_over_time", "avg_over_time", "max_over_time", "min_over_time", "label_replace",
    "label_values", "histogram_quantile", "clamp_min", "clamp_max", "time", "humanize", "inf", "nan",
}


def expressions_of_rules() -> list[str]:
    return [r["expr"] for r in rules()]


def rules() -> list[dict]:
    return [r for g in yaml.safe_load(rules_path().read_text())["groups"] for r in g["rules"]]


def dashboard() -> dict:
    return json.loads(dashboard_path().read_text())


def expressions_of_dashboard() -> list[str]:
    return [t["expr"] for p in dashboard()["panels"] for t in p.get("targets", [])]


def names_and_labels(expr: str) -> tuple[set[str], set[str]]:
    """The metric names an expression reads and the label names it uses (matchers, by/without, on/ignoring):
    string literals, range selectors and numbers are removed first; what remains that is no PromQL word is a
    metric name."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    labels = set(re.findall(r"([A-Za-z_][A-Za-z0-9_]*)\s*(?:=~|!~|!=|=)", text))
    for clause in re.findall(r"\b(?:by|without|on|ignoring)\s*\(([^)]*)\)", text):
        labels |= {x.strip() for x in clause.split(",") if x.strip()}
    text = re.sub(r"\{[^}]*\}", " ", text)
    text = re.sub(r"\b(?:by|without|on|ignoring)\s*\([^)]*\)", " ", text)
    text = re.sub(r"\[[^\]]*\]", " ", text)
    text = re.sub(r"\$[A-Za-z_]+", " ", text)
    words = set(re.findall(r"(?<![\w.$])([A-Za-z_:][A-Za-z0-9_:]*)", text))
    return words - PROMQL_WORDS, labels


def test_names_labels_and_help_follow_prometheus_conventions():
    assert len(SPECS) == len(METRICS)
    for m in METRICS:
        assert re.fullmatch(r"kvcanary_[a-z][a-z0-9_]*[a-z]", m.name), m.name
        assert m.kind == "counter" and m.name.endswith("_total"), m.name  # counters end in _total
        assert not re.search(r"_(ms|milliseconds|us|minutes|bytes_kb|count)(_|$)", m.name), m.name  # base units
        assert m.labels[0] == "engine" and all(re.fullmatch(r"[a-z][a-z_]*", x) for x in m.labels)
        assert "le" not in m.labels and "quantile" not in m.labels and m.help and not m.help.endswith(".")
    assert SPECS["kvcanary_phase_seconds_total"].labels == ("engine", "phase")  # a time is in seconds


def test_every_engine_state_exports_under_its_own_engine_label():
    from kvcanary_cupy.integrations.transformers.canary import TransformersCanaryState

    assert TransformersCanaryState._collect is EngineCanaryState._collect
    assert TransformersCanaryState._finish_step is EngineCanaryState._finish_step
    state = TransformersCanaryState.__new__(TransformersCanaryState)
    EngineCanaryState.__init__(state)
    assert state.metrics.engine == "transformers"
    vllm_canary = ROOT / "kvcanary_cupy" / "integrations" / "vllm" / "canary.py"
    source = vllm_canary.read_text()
    # the vLLM state derives from the same base and overrides neither hook (checked in its own env too)
    assert "class VllmCanaryState(EngineCanaryState):" in source
    assert "def _collect" not in source and "def _finish_step" not in source


def _row(reasons: int, slot: int, kind: int = 2) -> np.ndarray:
    raw = np.zeros(8, np.int64)
    raw[VIOLATION_FIELD_KERNEL_KIND], raw[VIOLATION_FIELD_SLOT_IDX] = kind, slot
    raw[VIOLATION_FIELD_POSITION], raw[VIOLATION_FIELD_FAIL_REASON_BITS] = slot % 7, reasons
    return raw


class _Runtime:
    """Stands in for the runtime behind an engine state: hands out the step reports it was given."""

    def __init__(self, reports: list[StepReport]) -> None:
        self.reports = list(reports)

    def finish_step(self) -> StepReport:
        return self.reports.pop(0)

    flush = finish_step


class ToyCanaryState(EngineCanaryState):
    def __init__(self, reports: list[StepReport]) -> None:
        super().__init__()
        self.rt = _Runtime(reports)  # type: ignore[assignment]


def test_the_status_flags_of_a_step_are_every_groups_plan_bits_and_the_status_bits_each_named_once():
    from kvcanary_cupy.runtime.reporting import status_flag_names

    plan_status = {"FULL": int(PlanStatus.REQ_POOL_INDEX_OUT_OF_RANGE | PlanStatus.SWA_SLOT_OUTSIDE_LUT),
                   "SWA": int(PlanStatus.BLOCK_ID_OUTSIDE_SLOTS), "DRAFT": int(PlanStatus.SWA_SLOT_OUTSIDE_LUT)}
    report = StepReport(4, 3, scatter_status=int(CanaryStatus.SCATTER_OUT_OF_RANGE), plan_status=plan_status)
    names = status_flag_names(report)
    assert sorted(names) == ["BLOCK_ID_OUTSIDE_SLOTS", "REQ_POOL_INDEX_OUT_OF_RANGE", "SCATTER_OUT_OF_RANGE",
                             "SWA_SLOT_OUTSIDE_LUT"]
    assert status_flag_names(StepReport(1, 0)) == []


@pytest.mark.parametrize("seed", range(3))
def test_the_exported_series_count_what_the_step_reports_hold(seed):
    prometheus_client = pytest.importorskip("prometheus_client", reason="prometheus_client is not installed")
    registry = prometheus_client.REGISTRY
    rng = np.random.default_rng(seed)
    write = int(FailReason.WRITE_TOKEN_MISMATCH | FailReason.WRITE_POSITION_MISMATCH)
    reports, want_rows, want_reasons = [], {"FULL": 0, "SWA": 0}, {}
    for step in range(4):
        n_full, n_swa = (int(x) for x in rng.integers(0, 40, 2))
        rows = [("FULL", decode_row(i, _row(write, 100 + i))) for i in range(n_full)]
        rows += [("SWA", decode_row(i, _row(int(FailReason.VERIFY_CHAIN_HASH_MISMATCH), 500 + i))) for i in
                 range(n_swa)]
        want_rows["FULL"] += n_full
        want_rows["SWA"] += n_swa
        for key, n in ((("FULL", "WRITE_TOKEN_MISMATCH"), n_full), (("FULL", "WRITE_POSITION_MISMATCH"), n_full),
                       (("SWA", "VERIFY_CHAIN_HASH_MISMATCH"), n_swa)):
            want_reasons[key] = want_reasons.get(key, 0) + n
        scatter = int(CanaryStatus.SLOT_OUT_OF_RANGE) if step == 1 else 0
        plan = {"FULL": int(PlanStatus.SWA_SLOT_OUTSIDE_LUT)} if step == 2 else {}
        reports.append(StepReport(step + 1, step, new_violations=rows, scatter_status=scatter, plan_status=plan,
                                  dropped=3 * step, health_problems=["x"] * (step == 3), swept_slots=10 * step))
    engine = f"toy{seed}"

    def value(name: str, **labels: str) -> float:
        return registry.get_sample_value(name, {"engine": engine, **labels}) or 0.0

    state = ToyCanaryState(reports)
    assert state.metrics.engine == "toy"  # the label is the state class's engine name
    state.metrics = StepMetrics(engine)  # a label of its own per seed: the registry is the process's
    for _ in range(4):
        state.seconds["write"] += 0.25
        state._finish_step()
    assert value("kvcanary_steps_total") == 4
    for group, n in want_rows.items():
        assert value("kvcanary_violation_rows_total", group=group) == n
    for (group, reason), n in want_reasons.items():
        assert value("kvcanary_violations_total", group=group, reason=reason) == n
    assert value("kvcanary_status_flags_total", flag="SLOT_OUT_OF_RANGE") == 1
    assert value("kvcanary_status_flags_total", flag="SWA_SLOT_OUTSIDE_LUT") == 1
    assert value("kvcanary_ring_dropped_rows_total") == 0 + 3 + 6 + 9
    assert value("kvcanary_health_problems_total") == 1
    assert value("kvcanary_swept_slots_total") == 0 + 10 + 20 + 30
    assert value("kvcanary_phase_seconds_total", phase="write") == pytest.approx(1.0)
    # what the exposition holds for this engine is exactly the documented list
    text = prometheus_client.generate_latest(registry).decode()
    exposed = {m.group(1) for m in re.finditer(r'^(kvcanary_[a-z_]+)\{engine="' + engine + '"', text, re.M)}
    # (prometheus_client adds a `_created` timestamp next to each counter unless told not to)
    assert {n for n in exposed if not n.endswith("_created")} == metric_names()
    assert {n for n in exposed if n.endswith("_created")} <= {n.removesuffix("_total") + "_created"
                                                              for n in metric_names()}


def test_without_prometheus_client_the_metrics_are_a_no_op(monkeypatch):
    monkeypatch.setattr(metrics_module, "_registered", {})  # what _counters() keeps when the import failed
    m = StepMetrics("none")
    assert m.counters is None
    m.report(StepReport(1, 0, dropped=5))
    m.step({"verify": 1.0})


@pytest.mark.parametrize("source", ["rules", "dashboard"])
def test_every_query_reads_exported_metrics_with_their_labels(source):
    exprs = expressions_of_rules() if source == "rules" else expressions_of_dashboard()
    assert exprs
    used = set()
    for expr in exprs:
        names, labels = names_and_labels(expr)
        assert names, f"no metric in {expr!r}"
        assert names <= metric_names(), f"{expr!r} reads {sorted(names - metric_names())}, not exported"
        allowed = set().union(*(SPECS[n].labels for n in names))
        assert labels <= allowed, f"{expr!r} uses labels {sorted(labels - allowed)} its metrics lack"
        used |= names
    if source == "dashboard":
        assert used == metric_names()  # every exported metric has a panel


def test_the_name_parser_finds_a_wrong_name_and_a_wrong_label():
    names, labels = names_and_labels('sum by (reason) (rate(kvcanary_violation_total{engine=~"$engine"}[5m]))')
    assert names == {"kvcanary_violation_total"} and not names <= metric_names()
    names, labels = names_and_labels('sum by (slot) (increase(kvcanary_steps_total[$__range])) or vector(0)')
    assert names == {"kvcanary_steps_total"} and labels == {"slot"}


def test_the_dashboard_is_an_importable_grafana_dashboard():
    d = dashboard()
    assert d["uid"] == "kvcanary" and d["title"] and isinstance(d["schemaVersion"], int)
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids))
    variables = {v["name"] for v in d["templating"]["list"]}
    assert {"datasource", "engine"} <= variables
    for p in d["panels"]:
        assert p["type"] in ("stat", "timeseries") and p["targets"] and set(p["gridPos"]) == {"x", "y", "w", "h"}
        for t in p["targets"]:
            assert 'engine=~"$engine"' in t["expr"]  # every panel follows the engine selector
            assert t["datasource"]["uid"] == "${datasource}"


def test_every_alert_links_its_runbook_section():
    alerts = {r["alert"]: r for r in rules()}
    assert set(alerts) == {"KvCanaryViolation", "KvCanaryStatusFlag", "KvCanaryRingDropped",
                           "KvCanaryHealthCheckFailed", "KvCanaryCostHigh"}
    for name, rule in alerts.items():
        url = rule["annotations"]["runbook_url"]
        if name in ("KvCanaryViolation", "KvCanaryStatusFlag"):
            assert url.startswith("docs/violations.md#")
        else:  # the other alerts are explained on the observability page, under a heading of their name
            page = (ROOT / "docs" / "observability.md").read_text()
            assert url == f"docs/observability.md#{name.lower()}" and f"### {name}\n" in page
        assert rule["labels"]["severity"] in ("critical", "warning", "info")


needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool is missing (Debian package prometheus; "
                                    "`make test` installs it where it runs as root with apt)")


@needs_promtool
def test_promtool_accepts_the_rules_and_every_dashboard_query(tmp_path):
    done = subprocess.run([PROMTOOL, "check", "rules", str(rules_path())], capture_output=True, text=True,
                          check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    # the dashboard's PromQL, with Grafana's variables filled in, as recording rules: promtool parses each one
    exprs = [e.replace("$__rate_interval", "5m").replace("$__range", "1h").replace("$engine", ".*")
             for e in expressions_of_dashboard()]
    recorded = {"groups": [{"name": "dashboard", "rules": [{"record": f"kvcanary:panel{i}", "expr": e}
                                                           for i, e in enumerate(exprs)]}]}
    path = tmp_path / "dashboard-queries.yml"
    path.write_text(yaml.safe_dump(recorded))
    done = subprocess.run([PROMTOOL, "check", "rules", str(path)], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    # and a broken query is refused (the check can fail)
    path.write_text(yaml.safe_dump({"groups": [{"name": "x", "rules": [{"record": "x:y", "expr": "sum by (("}]}]}))
    assert subprocess.run([PROMTOOL, "check", "rules", str(path)], capture_output=True, check=False).returncode != 0


@needs_promtool
def test_each_alert_fires_on_its_metric_with_the_runbook_link_filled_in(tmp_path):
    series = [
        {"series": 'kvcanary_violations_total{engine="vllm",group="G0",reason="WRITE_TOKEN_MISMATCH"}',
         "values": "0x5 3x10"},
        {"series": 'kvcanary_status_flags_total{engine="vllm",flag="SLOT_OUT_OF_RANGE"}', "values": "0x5 1x10"},
        {"series": 'kvcanary_ring_dropped_rows_total{engine="vllm"}', "values": "0x5 7x10"},
        {"series": 'kvcanary_health_problems_total{engine="vllm"}', "values": "0x15"},
    ]
    tests = {"rule_files": [str(rules_path())], "evaluation_interval": "1m", "tests": [{
        "interval": "1m", "input_series": series, "alert_rule_test": [
            {"eval_time": "8m", "alertname": "KvCanaryViolation", "exp_alerts": [{
                "exp_labels": {"severity": "critical", "engine": "vllm", "group": "G0",
                               "reason": "WRITE_TOKEN_MISMATCH"},
                "exp_annotations": {
                    "summary": "kv-canary: 3 WRITE_TOKEN_MISMATCH violation(s) in KV group G0 (vllm) in the last 5 "
                               "minutes",
                    "description": rules()[0]["annotations"]["description"],
                    "runbook_url": "docs/violations.md#reason-write-token-mismatch"}}]},
            {"eval_time": "8m", "alertname": "KvCanaryStatusFlag", "exp_alerts": [{
                "exp_labels": {"severity": "critical", "engine": "vllm", "flag": "SLOT_OUT_OF_RANGE"},
                "exp_annotations": {
                    "summary": "kv-canary: status flag SLOT_OUT_OF_RANGE reported 1 time(s) (vllm)",
                    "description": rules()[1]["annotations"]["description"],
                    "runbook_url": "docs/violations.md#status-slot-out-of-range"}}]},
            {"eval_time": "8m", "alertname": "KvCanaryHealthCheckFailed", "exp_alerts": []},
            {"eval_time": "3m", "alertname": "KvCanaryViolation", "exp_alerts": []},
        ]}]}
    path = tmp_path / "rules_test.yml"
    path.write_text(yaml.safe_dump(tests, sort_keys=False))
    done = subprocess.run([PROMTOOL, "test", "rules", str(path)], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_docs_metrics_table_is_the_exported_list():
    page = (ROOT / "docs" / "observability.md").read_text()
    rows = re.findall(r"^\| `(kvcanary_[a-z_]+)` \| (\w+) \| ([^|]+) \|", page, re.M)
    assert [(name, kind, tuple(re.findall(r"`(\w+)`", labels))) for name, kind, labels in rows] == [
        (m.name, m.kind, m.labels) for m in METRICS]
