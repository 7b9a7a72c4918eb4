"""``kvcanary simulate --engine vllm --connector example``: the producer/consumer run end to end through the
command (each engine a process of its own; token-exact, no false positive, each fault refused with its reason at
the load's step, exit 0, its table, JSON and HTML), and the report's verdict on hand-made phase results (a
refusal with another reason is a miss, a refusal of another request or a row before the fault a false positive,
completions that differ a failure: exit 1)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kvcanary_cupy.integrations.vllm.simulate_connector import (
    ConnectorRun,
    ConnectorSimConfig,
    ConnectorSimulation,
    Phase,
    build_report,
)

# the reason each fault must be refused with, from docs/vllm.md's table (written out here, not read from the code)
EXPECTED = {"wrong-blocks": "LOAD_VERIFY_FAILED", "foreign-files": "LOAD_RECORDS_FOREIGN",
            "records-missing": "LOAD_RECORDS_MISSING"}


def test_the_producer_consumer_run_passes_and_refuses_each_fault_with_its_reason_before_the_forward(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCANARY_VLLM")}
    out_json, out_html = tmp_path / "r.json", tmp_path / "r.html"
    run = subprocess.run([sys.executable, "-m", "kvcanary_cupy", "simulate", "--engine", "vllm", "--connector",
                          "example", "--disaggregated", "--inject", "wrong-blocks,foreign-files", "--seed", "3",
                          "--json", str(out_json), "--html", str(out_html), "--plain"], env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads(out_json.read_text())
    assert report["schema"] == "kvcanary-vllm-connector-report/1" and report["outcome"] == "passed"
    assert report["config"]["disaggregated"] is True and report["config"]["kv_connector"] == "ExampleConnector"
    (w,) = report["workloads"]
    assert w["name"] == "producer-consumer" and w["token_exact"] and w["violations"] == w["findings"] == 0
    assert w["saved_files"] == w["requests"] == 8
    assert w["restored_tokens"] == sum((n - 1) // 32 * 32 for n in (40, 70, 99, 80, 80, 66, 50, 120))
    assert report["violations"]["false_positives"] == 0 and report["violations"]["internal_errors"] == 0
    assert [(k["kind"], k["status"]) for k in report["kinds"]] == [("wrong-blocks", "detected"),
                                                                   ("foreign-files", "detected")]
    for f in report["faults"]:
        assert f["reasons"] == [EXPECTED[f["kind"]]], f
        assert f["detection_step"] == f["step"] and f["latency_steps"] == 0 and f["blocks"], f
    assert report["cost"]["records_bytes_per_kv_byte"] > 0 and report["cost"]["restored_tokens"] > 0
    assert "PASS" in run.stdout and "LOAD_RECORDS_FOREIGN" in run.stdout and "refused at step" in run.stdout
    assert "<h1>kv-canary around a vLLM KV connector</h1>" in out_html.read_text()


# ---- the verdict on hand-made phase results ---------------------------------------------------------------------

def _phase(outputs, findings=(), violations=(), steps=6, step_requests=None, seen=None):
    rids = [str(i) for i in range(len(outputs))]
    return {"outputs": outputs, "request_ids": rids, "findings": list(findings), "violations": list(violations),
            "steps": steps, "wall": 0.1, "internal_errors": 0,
            "step_requests": step_requests or [[f"{i}-x"] for i in range(len(outputs))] + [[]] * (steps - 2),
            "findings_before_forward": seen or [len(findings)] * steps}


def _refusal(step, reason, request="1-x", blocks=(3, 4)):
    return {"step": step, "reason": reason, "request_id": request, "blocks": list(blocks), "positions": [0, 64],
            "detail": ""}


def _row(step, slot, tag="HEAD_K_FULL"):
    return {"step": step, "tag": tag, "slot": slot, "position": 0, "stored_token": 1, "expected_token": 2,
            "reasons": ["VERIFY_TOKEN_MISMATCH"]}


def _report(load, clean_outputs=([1, 2], [3, 4])):
    sim = ConnectorSimulation(ConnectorSimConfig(inject=("records-missing",)))
    sim.prompts = [[5] * 40, [6] * 70]
    ref = [_phase([[1, 2], [3, 4]]), _phase([[1, 2], [3, 4]])]
    sim.reference = ref
    sim.runs = [ConnectorRun(None, [Phase(_phase(list(clean_outputs)), 0), Phase(_phase([[1, 2], [3, 4]]), 7)]),
                ConnectorRun("records-missing", [Phase(load, 0)], target=1)]
    return build_report(sim)


def test_a_refusal_with_the_faults_reason_at_its_load_step_passes():
    r = _report(_phase([[1, 2], [9, 9]], [_refusal(1, "LOAD_RECORDS_MISSING")],
                       [_row(1, 100), _row(0, 3 * 32 + 5, "SWEEP_K_FULL")]))
    assert (r["outcome"], r["exit_code"]) == ("passed", 0)
    (f,) = r["faults"]
    assert f["step"] == f["detection_step"] and f["reasons"] == ["LOAD_RECORDS_MISSING"]
    assert r["violations"] == {**r["violations"], "explained": 3, "false_positives": 0}


@pytest.mark.parametrize(("load", "clean", "problem"), [
    (_phase([[1, 2], [3, 4]], [_refusal(1, "LOAD_RECORDS_DAMAGED")]), None, "missed records-missing"),
    (_phase([[1, 2], [3, 4]], [_refusal(1, "LOAD_RECORDS_MISSING")], seen=[0] * 6), None, "missed"),
    (_phase([[1, 2], [3, 4]], [_refusal(1, "LOAD_RECORDS_MISSING"), _refusal(0, "LOAD_RECORDS_STALE", "0-x")]),
     None, "1 false positive(s)"),
    (_phase([[1, 2], [3, 4]], [_refusal(1, "LOAD_RECORDS_MISSING")], [_row(0, 7 * 32, "SWEEP_K_FULL")]), None,
     "1 false positive(s)"),
    (_phase([[1, 2], [3, 4]], [_refusal(1, "LOAD_RECORDS_MISSING")]), ([1, 2], [3, 5]), "tokens differ"),
])
def test_a_miss_a_false_positive_or_other_completions_fail_the_run(load, clean, problem):
    from kvcanary_cupy.integrations.common.report import verdict

    r = _report(load, *(() if clean is None else (clean,)))
    assert (r["outcome"], r["exit_code"]) == ("failed", 1)
    assert problem in verdict(r), verdict(r)
