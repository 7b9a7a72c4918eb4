"""The simulation report: reproducible for a seed, valid against its documented schema, and rendered with or
without the optional ``rich`` and ``matplotlib``."""

from __future__ import annotations

import copy
import io
import json
import re
import sys
import time

import pytest

import kvcanary_cupy
from kvcanary_cupy.sim import SCHEMA, SimConfig, deterministic_view, parse_inject, run_simulation, validate
from kvcanary_cupy.sim import report as report_mod
from kvcanary_cupy.sim.runner import Simulation


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
    pytest.importorskip("rich")
    out = io.StringIO()
    report_mod.print_report(faulty_report, out)
    fancy = out.getvalue()
    assert "─" * 20 in fancy and "fault kind" in fancy and "PASS" in fancy  # rich's header rule
    monkeypatch.setitem(sys.modules, "rich", None)  # as if the report extra were not installed
    assert report_mod._rich() is None
    out = io.StringIO()
    report_mod.print_report(faulty_report, out)
    plain = out.getvalue()
    assert plain.splitlines()[2].startswith("fault kind") and "--------" in plain
    for kind in faulty_report["kinds"]:
        assert kind["kind"] in plain
    assert plain == report_mod.render_text(faulty_report) + "\n"


@pytest.mark.parametrize("plain", [False, True])
def test_the_terminal_report_fits_80_columns_and_keeps_every_word(faulty_report, plain):
    if not plain:
        pytest.importorskip("rich")
    out = io.StringIO()
    report_mod.print_report(faulty_report, out, plain=plain, width=80)
    lines = out.getvalue().splitlines()
    assert max(len(line) for line in lines) <= 80, max(lines, key=len)
    words = out.getvalue().split()
    for kind in faulty_report["kinds"]:  # fault names are never broken
        assert kind["kind"] in words
        for reason in kind["reasons"]:
            label = report_mod.short_reason(reason)
            assert label in words or f"{label}," in words, label
    wide = io.StringIO()
    report_mod.print_report(faulty_report, wide, plain=plain, width=200)
    assert len(wide.getvalue().splitlines()) < len(lines)  # a wider terminal gets fewer, longer lines


def test_a_timestamped_host_stamped_report_keeps_those_out_of_the_deterministic_view(faulty_report):
    gen = faulty_report["generated"]
    assert gen["tool"] == "kvcanary-cupy" and gen["version"] == kvcanary_cupy.__version__ and gen["host"]
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", gen["timestamp"])
    assert "generated" not in deterministic_view(faulty_report)


def test_kernel_compilation_is_timed_apart_from_the_per_step_costs(monkeypatch):
    import kvcanary_cupy.backends as backends
    import kvcanary_cupy.sim.runner as runner

    calls = []

    def slow_prepare(name: str) -> float:  # what a cold compile looks like: one long call before the loop
        calls.append(name)
        time.sleep(0.3)
        return 0.3

    monkeypatch.setattr(runner, "prepare_backend", slow_prepare)
    sim = Simulation(SimConfig(preset="decode", steps=6, requests=2, seed=1, backend="numpy"))
    started = time.perf_counter()
    report = sim.run()
    outside = time.perf_counter() - started
    assert calls == ["numpy"] and report["cost"]["compile_s"] == 0.3
    assert outside - report["cost"]["wall_s"] >= 0.3  # the compile is not inside the timed run
    assert backends.prepare_backend("numpy") == 0.0


def test_prepare_backend_builds_every_host_module_before_any_launch(tmp_path, monkeypatch):
    from kvcanary_cupy.backends import _kernel_backend, prepare_backend, unavailable_reason
    from kvcanary_cupy.backends.kernel_backend import KERNEL_FILES

    if unavailable_reason("host") is not None:
        pytest.skip(f"host backend: {unavailable_reason('host')}")
    monkeypatch.setenv("KVCANARY_CACHE_DIR", str(tmp_path))
    _kernel_backend.cache_clear()
    try:
        seconds = prepare_backend("host")
        libraries = [p.name for p in (tmp_path / "hostcuda").glob("*.so")]
    finally:
        _kernel_backend.cache_clear()
    pools = [name for name in libraries if name.startswith("kvc-host-pool-")]  # the shared worker pool
    built = sorted(name.split("-")[0] for name in libraries if name not in pools)
    assert seconds > 0 and built == sorted(f.removesuffix(".cu") for f in KERNEL_FILES) and len(pools) == 1


def test_the_html_report_inlines_an_svg_plot_and_degrades_without_matplotlib(faulty_report, tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    html = report_mod.write_html(faulty_report, tmp_path / "r.html").read_text()
    assert "<svg" in html and "<?xml" not in html and "data:image" not in html and "Detection by fault kind" in html
    for kind in faulty_report["kinds"]:
        assert f'<td class="name">{kind["kind"]}</td>' in html
    for label in ("chain", "write-position", "real-kv"):
        assert f"<dt>{label}</dt>" in html  # the legend of reason labels
    assert faulty_report["generated"]["timestamp"] in html and faulty_report["generated"]["host"] in html
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    bare = report_mod.render_html(faulty_report)
    assert "<svg" not in bare and "install matplotlib" in bare


def test_a_clean_report_says_so():
    report = run_simulation(SimConfig(preset="decode", steps=20, requests=4, seed=1, backend="numpy"))
    assert validate(report) == [] and report["kinds"] == [] and report["faults"] == []
    text = report_mod.render_text(report)
    assert "clean run" in text and text.endswith("PASS: no violation in a clean run")


def test_the_warning_names_each_kind_the_workload_could_not_host_as_it_or_them():
    def kinds(**status):
        return {"kinds": [{"kind": kind.replace("_", "-"), "status": s} for kind, s in status.items()]}

    assert report_mod.warnings(kinds(kv_bitflip="detected")) == []
    assert report_mod.warnings(kinds(kv_bitflip="detected", stale_expected="not injected")) == [
        "warning: the workload is too small to inject stale-expected (no target was found for it); run more "
        "--steps or --requests"]
    assert report_mod.warnings(kinds(stale_expected="not injected", kv_bitflip="missed",
                                     double_alloc="not injected")) == [
        "warning: the workload is too small to inject stale-expected, double-alloc (no target was found for them); "
        "run more --steps or --requests"]


def test_each_reason_has_a_short_label_without_its_verify_prefix_and_mismatch_suffix():
    from kvcanary_cupy import FailReason

    labels = {reason.name: report_mod.short_reason(str(reason.name)) for reason in FailReason}
    assert labels == {"VERIFY_CHAIN_HASH_MISMATCH": "chain", "VERIFY_POSITION_MISMATCH": "position",
                      "VERIFY_REAL_KV_HASH_MISMATCH": "real-kv", "WRITE_TOKEN_MISMATCH": "write-token",
                      "WRITE_POSITION_MISMATCH": "write-position", "VERIFY_TOKEN_MISMATCH": "token"}


def test_the_plot_joins_each_detected_fault_to_its_detection_and_leaves_a_missed_one_alone():
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    zeros = [0] * 10
    report = {"timeline": {"violations": zeros, "explained": zeros, "false_positives": zeros},
              "kinds": [{"kind": "kv-bitflip"}, {"kind": "wrong-token"}],
              "faults": [{"kind": "kv-bitflip", "step": 2, "detection_step": 5},
                         {"kind": "kv-bitflip", "step": 7, "detection_step": None},
                         {"kind": "wrong-token", "step": 3, "detection_step": 4}]}
    fig = report_mod.plot_figure(report)
    try:
        bottom = fig.axes[1]
        # rows top to bottom in the table's order: wrong-token at y 0, kv-bitflip at y 1
        assert [tick.get_text() for tick in bottom.get_yticklabels()] == ["wrong-token", "kv-bitflip"]
        joined = sorted((tuple(line.get_xdata()), tuple(line.get_ydata())) for line in bottom.lines)
        assert joined == [((2, 5), (1, 1)), ((3, 4), (0, 0))]
    finally:
        plt.close(fig)


def test_the_false_positive_lines_list_the_first_ones_and_nothing_without_any():
    fp = {"launch_step": 7, "launch_tag": "TAIL_K_FULL", "group": "FULL", "slot": 12, "position": 3,
          "stored_token": 40, "expected_token": 41, "reasons": ["VERIFY_TOKEN_MISMATCH", "VERIFY_CHAIN_HASH_MISMATCH"]}
    assert report_mod._fp_lines({"false_positives": [], "violations": {"false_positives": 0}}) == []
    assert report_mod._fp_lines({"false_positives": [fp, {**fp, "slot": 13}], "violations": {"false_positives": 5}},
                                limit=1) == [
        "first false positives (of 5):",
        "  step 7 TAIL_K_FULL (FULL) slot 12 position 3 token 40 expected 41: token, chain"]


def test_the_html_false_positive_table_right_aligns_its_numbers_and_keeps_tags_whole(faulty_report, monkeypatch):
    monkeypatch.setattr(report_mod, "plot_svg", lambda report: None)  # the table is the subject, not the plot
    report = copy.deepcopy(faulty_report)
    report["false_positives"] = [{"read_step": 9, "launch_tag": "TAIL_K_FULL", "group": "FULL", "slot": 12,
                                  "position": 3, "stored_token": 40, "expected_token": 41,
                                  "reasons": ["VERIFY_TOKEN_MISMATCH"]}]
    page = report_mod.render_html(report)
    assert ('<thead><tr><th class="num">read step</th><th class="name">tag</th><th>group</th><th class="num">slot'
            '</th><th class="num">position</th><th class="num">stored token</th><th class="num">expected token</th>'
            '<th>reasons</th></tr></thead><tbody><tr><td class="num">9</td><td class="name">TAIL_K_FULL</td>'
            '<td>FULL</td><td class="num">12</td><td class="num">3</td><td class="num">40</td><td class="num">41'
            '</td><td><span class="name">token</span></td></tr></tbody>') in page
