"""The simulator in each slot layout (``--layout token|block|csr``): the synthetic engine hands the plan
SGLang's req_to_token, a batch-row block table (vLLM-style) or CSR page lists (FlashInfer-style), and every
preset catches every applicable fault kind with zero false positives in all three. Dumped launches of the
batch-row layouts carry the layout and replay with it."""

from __future__ import annotations

import pytest
from test_sim_detection import _check_detected

from kvcanary_cupy.backends import unavailable_reason
from kvcanary_cupy.cli import main
from kvcanary_cupy.sim import PRESETS, SimConfig, Simulation, applicable_kinds, load_case, parse_inject, replay_case
from kvcanary_cupy.sim import run_simulation as run

LAYOUTS = ("token", "block", "csr")


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("preset", list(PRESETS))
def test_every_preset_detects_every_applicable_kind_in_each_layout(preset, layout):
    kinds = applicable_kinds(preset)
    report = run(SimConfig(preset=preset, steps=40, requests=10, seed=8, backend="numpy", layout=layout,
                           inject=parse_inject(["all"], kinds)))
    _check_detected(report, kinds)
    assert report["config"]["engine"]["layout"] == layout


def test_the_layouts_read_the_same_violations_where_the_pool_rows_agree():
    """Every kind but stale-expected (whose stale rows depend on how the pool is indexed) produces the very same
    violation rows whichever layout the plan reads: the layouts describe the same slots."""
    kinds = [k for k in applicable_kinds("mixed") if k != "stale-expected"]
    reports = [run(SimConfig(preset="mixed", steps=40, requests=10, seed=4, backend="numpy", layout=layout,
                             inject=parse_inject(["all"], kinds))) for layout in LAYOUTS]
    for report in reports[1:]:
        assert report["violations"] == reports[0]["violations"]
        assert report["faults"] == reports[0]["faults"]


@pytest.mark.skipif(unavailable_reason("host") is not None, reason=f"host backend: {unavailable_reason('host')}")
@pytest.mark.parametrize("layout", ["block", "csr"])
def test_a_clean_host_backend_run_in_a_batch_row_layout_reads_nothing(layout):
    report = run(SimConfig(preset="mixed", steps=20, requests=6, seed=11, backend="host", layout=layout))
    assert report["passed"] and report["violations"]["total"] == 0 and report["violations"]["status"] == []


@pytest.mark.parametrize("layout", ["block", "csr"])
def test_dumped_launches_carry_the_layout_and_replay_with_it(tmp_path, layout):
    sim = Simulation(SimConfig(preset="mixed", steps=30, requests=8, seed=6, backend="numpy", layout=layout,
                               inject=parse_inject(["req-to-token", "double-alloc"]), dump_dir=str(tmp_path)))
    assert sim.run()["passed"]
    assert sim.recorder.dumped
    for path in sim.recorder.dumped.values():
        case = load_case(path)
        if case.meta["role"] != "SWEEP":
            assert "in_req_to_token" not in case.arrays
            assert any(k.startswith("in_layout_") for k in case.arrays)
        outcome = replay_case(case, "numpy")
        assert outcome.reproduced, path.name
        if outcome.plan_check is not None:
            assert "identical" in outcome.plan_check, outcome.plan_check


def test_the_command_line_takes_a_layout(capsys):
    assert main(["simulate", "--preset", "decode", "--steps", "12", "--requests", "3", "--layout", "csr",
                 "--backend", "numpy", "--quiet", "--plain"]) == 0
    assert "backend numpy, csr layout" in " ".join(capsys.readouterr().out.split())  # the table may wrap
    assert main(["simulate", "--layout", "paged"]) == 2
    assert "argument --layout: invalid choice: 'paged'" in capsys.readouterr().err
    assert main(["simulate", "--disaggregated", "--layout", "csr"]) == 2
    assert "--layout does not apply to --disaggregated" in capsys.readouterr().err
