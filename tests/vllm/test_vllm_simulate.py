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


HERE = os.path.dirname(os.path.abspath(__file__))


def _simulate(**fields) -> dict:
    """The report of a simulation with ``fields`` (one workload, numpy backend, its own process)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCANARY_VLLM")}
    env.pop("VLLM_CPU_OMP_THREADS_BIND", None)  # the simulation splits the CPUs itself
    run = subprocess.run([sys.executable, os.path.join(HERE, "sim_run.py"), json.dumps(
        {"model_size": "small", "backend": "numpy", "workloads": ["mixed-lengths"], **fields})], env=env,
        capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    result = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
    assert result, run.stderr[-3000:]
    return json.loads(result[-1][len("RESULT "):])


def test_simulate_tensor_parallel_2_injects_each_fault_on_one_rank_and_reports_it_per_rank():
    report = _simulate(tensor_parallel=2, inject=["kv-bitflip", "wrong-token", "rank-kv-bitflip"])
    assert report["outcome"] == "passed", (report["kinds"], report["violations"])
    assert report["config"]["tensor_parallel"] == 2 and report["config"]["thread_binding"].count("|") == 1
    (w,) = report["workloads"]
    assert w["token_exact"] and w["violations_by_rank"] == {"0": 0, "1": 0}
    ranks = {f["kind"]: f["rank"] for f in report["faults"]}
    assert ranks == {"kv-bitflip": 0, "wrong-token": 1, "rank-kv-bitflip": 1}  # the ranks take turns
    for f in report["faults"]:
        assert f["detected"], f
        others = [n for r, n in f["violations_by_rank"].items() if int(r) != f["rank"]]
        assert f["violations_by_rank"][str(f["rank"])] > 0 and others == [0], f
    assert report["violations"]["false_positives"] == 0


def test_simulate_a_hybrid_model_checks_both_groups_and_catches_its_own_fault_kinds():
    report = _simulate(model_arch="gemma3", inject=["wrong-token", "kv-element-size", "window-reuse",
                                                    "group-handover"])
    assert report["config"]["model_arch"] == "gemma3" and report["workloads"][0]["arch"] == "gemma3"
    assert report["outcome"] == "passed", (report["kinds"], report["unchecked"])
    assert report["workloads"][0]["token_exact"] and report["violations"]["false_positives"] == 0
    assert report["canary_disabled"] is None
    assert [f["kind"] for f in report["faults"] if f["detected"]] == ["wrong-token", "kv-element-size",
                                                                      "window-reuse", "group-handover"]
    # both attention groups checked, each sweeping its own cached blocks: nothing left unchecked
    assert report["unchecked"] == []


def test_simulate_with_speculative_decoding_checks_it_and_catches_a_rejected_draft_kept():
    report = _simulate(speculative="ngram", inject=["wrong-token", "draft-rejected-kept"])
    assert report["config"]["speculative"] == "ngram" and report["workloads"][0]["token_exact"]
    assert report["canary_disabled"] is None and report["unchecked"] == []
    assert report["outcome"] == "passed", (report["kinds"], report["violations"])
    assert report["violations"]["false_positives"] == 0
    assert [f["kind"] for f in report["faults"] if f["detected"]] == ["wrong-token", "draft-rejected-kept"]


def test_simulate_an_all_sliding_window_model_puts_block_faults_where_the_window_reads():
    """Every layer sliding-window (window 64 = 2 blocks, prompts up to 150 tokens): a block-table fault on column 0
    of a long request would hit a block the window no longer reads (freed or the null block), and 24 blocks hold
    every request at once; the faults go to a column the window reads, and the budget makes vLLM preempt."""
    report = _simulate(model_arch="mistral-sw", seed=1, inject=["block-table", "preempt-reuse"])
    assert report["outcome"] == "passed", (report["kinds"], report["faults"])
    (w,) = report["workloads"]
    assert w["token_exact"] and w["preemptions"] > 0 and report["violations"]["false_positives"] == 0
    faults = {f["kind"]: f for f in report["faults"]}
    assert faults["block-table"]["detected"] and faults["preempt-reuse"]["detected"], faults
    column = int(faults["block-table"]["detail"].split(":")[0].split()[1])
    assert column > 0  # a request past its window: column 0 is no longer read


def test_simulate_with_a_draft_model_plants_every_fault_on_rows_that_carry_drafts():
    """A draft model proposes at every step, so no decoding row has a query of one token: the faults that target
    a decoding row find it by its sampled token (the drafts after it do not count). The draft model is the
    target's weights plus noise, so drafts are rejected too (draft-rejected-kept needs one), and the KV budget
    counts its layers (they share the target's blocks): the mixed workload fits without preemption."""
    report = _simulate(speculative="draft", inject=["kv-bitflip", "block-table", "rank-kv-bitflip",
                                                    "draft-rejected-kept"])
    assert report["config"]["speculative"] == "draft" and report["canary_disabled"] is None
    assert report["unchecked"] == [] and len(report["notes"]) == 1  # the draft layers: checked, not fingerprinted
    assert "draft_model.model.layers.0.self_attn.attn" in report["notes"][0]
    assert report["outcome"] == "passed", (report["kinds"], report["faults"])
    (w,) = report["workloads"]
    assert w["token_exact"] and w["preemptions"] == 0 and report["violations"]["false_positives"] == 0
    assert [(f["kind"], f["detected"]) for f in report["faults"]] == [
        ("kv-bitflip", True), ("block-table", True), ("rank-kv-bitflip", True), ("draft-rejected-kept", True)]


def test_simulate_a_bf16_hybrid_model_checks_both_groups_token_exact():
    """bf16 (2-byte elements: the element-size fault writes each at a 1-byte offset) in a model with a
    sliding-window group and a full-attention group."""
    report = _simulate(model_arch="gemma3", dtype="bf16", inject=["kv-bitflip", "kv-element-size",
                                                                  "window-reuse", "group-handover"])
    assert report["config"]["dtype"] == "bf16" and report["canary_disabled"] is None
    assert report["outcome"] == "passed", (report["kinds"], report["faults"])
    assert report["workloads"][0]["token_exact"] and report["violations"]["false_positives"] == 0
    assert all(f["detected"] for f in report["faults"]) and len(report["faults"]) == 4
    assert "1-byte element offsets" in next(f["detail"] for f in report["faults"] if f["kind"] == "kv-element-size")
    assert report["unchecked"] == []  # both groups checked, each sweeping its own cached blocks
