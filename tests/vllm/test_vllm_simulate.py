"""``kvcanary simulate --engine vllm`` end to end (its own process: one vLLM engine per process): every workload
token-exact with zero false positives, the injected kinds detected, the same exit status, table, JSON and HTML
as the other engines."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def test_simulate_engine_vllm_passes_and_writes_its_reports(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCANARY_VLLM")}
    out_json, out_html = tmp_path / "r.json", tmp_path / "r.html"
    run = subprocess.run([sys.executable, "-m", "kvcanary_cupy", "simulate", "--engine", "vllm", "--inject",
                          "wrong-token,kv-bitflip", "--backend", "numpy", "--real-kv-hash", "partial", "--json",
                          str(out_json), "--html", str(out_html)], env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    report = json.loads(out_json.read_text())
    assert report["schema"] == "kvcanary-vllm-report/1" and report["outcome"] == "passed"
    assert report["config"]["model_size"] == "small"  # the --model-size name, as the help and docs give it
    assert "model small (" in run.stdout
    assert all(w["token_exact"] and w["violations"] == 0 for w in report["workloads"])
    assert {w["name"] for w in report["workloads"]} == {"mixed-lengths", "shared-prefix", "preemption",
                                                        "parallel-sampling"}
    assert next(w for w in report["workloads"] if w["name"] == "preemption")["preemptions"] > 0
    assert [(k["kind"], k["status"]) for k in report["kinds"]] == [("wrong-token", "detected"),
                                                                   ("kv-bitflip", "detected")]
    assert report["violations"]["false_positives"] == 0
    assert "fault kind" in run.stdout and "PASS" in run.stdout
    assert "<h1>kv-canary in vLLM</h1>" in out_html.read_text()
