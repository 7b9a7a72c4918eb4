"""The simulation report: reproducible for a seed, valid against its documented schema, and rendered with or
without the optional ``rich`` and ``matplotlib``."""

from __future__ import annotations

import copy
import io
import json
import sys

import pytest

from kvcanary_cupy.sim import SCHEMA, SimConfig, deterministic_view, parse_inject, run_simulation, validate
from kvcanary_cupy.sim import report as report_mod


@pytest.fixture(scope="module")
def faulty_report() -> dict:
    return run_simulation(SimConfig(preset="mixed", steps=40, requests=10, seed=4, backend="numpy",
                                    inject=parse_inject(["all"])))


def test_the_same_seed_gives_the_same_report(faulty_report):
    again = run_simulation(SimConfig(preset="mixed", steps=40, requests=10, seed=4, backend="numpy",
                                     inject=parse_inject(["all"])))
    assert deterministic_view(again) == deterministic_view(faulty_report)
    other = run_simulation(SimConfig(preset="mixed", steps=40, requests=10, seed=5, backend="numpy",
                                     inject=parse_inject(["all"])))
    assert deterministic_view(other) != deterministic_view(faulty_report)


def test_the_report_matches_its_schema_and_survives_json(faulty_report, tmp_path):
    assert validate(faulty_report) == []
    path = report_mod.write_json(faulty_report, tmp_path / "sub" / "report.json")
    loaded = json.loads(path.read_text())
    assert loaded == faulty_report
    assert validate(loaded) == []
    assert loaded["schema"] == "kvcanary-sim-report/1"
    assert len(loaded["timeline"]["violations"]) == loaded["config"]["steps"] + 1
    assert sum(loaded["timeline"]["injected"]) == len(loaded["faults"])
    assert sum(loaded["timeline"]["detected"]) == sum(f["detected"] for f in loaded["faults"])


def test_every_documented_field_is_in_the_module_docstring():
    doc = report_mod.__doc__
    for key in SCHEMA["properties"]:
        assert f"``{key}``" in doc, key
    for section in ("config", "workload", "violations", "cost"):
        for key in SCHEMA["properties"][section]["properties"]:
            assert f"``{key}``" in doc, f"{section}.{key}"


def test_the_validator_rejects_wrong_reports(faulty_report):
    broken = copy.deepcopy(faulty_report)
    broken["passed"] = "yes"
    del broken["cost"]["verify_entries"]
    broken["kinds"][0]["status"] = "maybe"
    broken["faults"][0]["step"] = 1.5
    errors = validate(broken)
    assert any(e.startswith("$.passed") for e in errors)
    assert any("verify_entries" in e for e in errors)
    assert any(e.startswith("$.kinds[0].status") for e in errors)
    assert any(e.startswith("$.faults[0].step") for e in errors)


def test_the_terminal_table_uses_rich_and_falls_back_to_plain_text(faulty_report, monkeypatch):
    out = io.StringIO()
    report_mod.print_report(faulty_report, out)
    fancy = out.getvalue()
    assert "┃ fault kind" in fancy and "PASS" in fancy
    monkeypatch.setitem(sys.modules, "rich", None)  # as if the report extra were not installed
    assert report_mod._rich() is None
    out = io.StringIO()
    report_mod.print_report(faulty_report, out)
    plain = out.getvalue()
    assert plain.splitlines()[2].startswith("fault kind") and "---------------" in plain
    for kind in faulty_report["kinds"]:
        assert kind["kind"] in plain
    assert plain == report_mod.render_text(faulty_report) + "\n"


def test_the_html_report_embeds_a_plot_and_degrades_without_matplotlib(faulty_report, tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    html = report_mod.write_html(faulty_report, tmp_path / "r.html").read_text()
    assert "data:image/png;base64," in html and "Detection by fault kind" in html
    for kind in faulty_report["kinds"]:
        assert kind["kind"] in html
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    bare = report_mod.render_html(faulty_report)
    assert "data:image/png" not in bare and "install matplotlib" in bare


def test_a_clean_report_says_so():
    report = run_simulation(SimConfig(preset="decode", steps=20, requests=4, seed=1, backend="numpy"))
    assert validate(report) == [] and report["kinds"] == [] and report["faults"] == []
    text = report_mod.render_text(report)
    assert "clean run" in text and text.endswith("PASS: no violation in a clean run")
