"""Speculative decoding in a real vLLM engine (``ngram`` and ``draft_model``, the two methods that run on this CPU
build): the canary checks it without a false positive while drafts are accepted and rejected, and still catches a
rejected draft's K/V read as an accepted token (the shape of vllm#47466) and a bit flipped in an accepted draft's
K/V.

Each method runs in a process of its own (``spec_run.py``: vLLM keeps process-wide state, one engine per
process) over tiny random-weight Llamas saved here; the expectations are independent of the canary's read: the
completions of the same engine without the canary, and the drafts accepted and rejected as the runner's request
state shows them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent


def _run(tmp_path_factory: pytest.TempPathFactory, method: str) -> dict:
    workdir = tmp_path_factory.mktemp(method)
    run = subprocess.run([sys.executable, str(HERE / "spec_run.py"), str(workdir), method],
                         capture_output=True, text=True, timeout=560)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    result = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
    assert result, run.stderr[-4000:]
    return json.loads(result[-1][len("RESULT "):])


@pytest.fixture(scope="module", params=["ngram", "draft_model"])
def spec_result(request, tmp_path_factory) -> tuple[str, dict]:
    return request.param, _run(tmp_path_factory, request.param)


def test_speculative_decoding_is_token_exact_with_zero_violations_while_drafts_are_rejected(spec_result):
    _, result = spec_result
    assert result["exact"] and all(result["exact"].values()), result["exact"]
    assert result["violations"] == [] and not result["health"]
    # the runs are the interesting ones: many drafts rejected (their K/V left for the next step to overwrite),
    # and some accepted (their positions verified as the row's prefix from the next step on)
    assert result["rejected"] >= 100 and result["accepted"] >= 10, (result["rejected"], result["accepted"])
    assert result["steps"] > 0 and result["sweep_interval"] == 2
    assert result["engine_rules"] == ["speculative"]
    assert not [text for level, text in result["install_lines"] if level == "WARNING"]


def test_the_draft_models_layers_are_named_at_install_and_left_unfingerprinted(spec_result):
    method, result = spec_result
    notes = [text for level, text in result["install_lines"] if "draft model's layers" in text]
    if method == "ngram":
        assert result["draft_layers"] == [] and notes == []
        return
    assert result["draft_layers"] == ["draft_model.model.layers.0.self_attn.attn",
                                      "draft_model.model.layers.1.self_attn.attn"]
    assert len(notes) == 1 and "draft_model.model.layers.0.self_attn.attn" in notes[0]
    assert "K/V bytes not fingerprinted" in notes[0]


def test_a_rejected_drafts_kv_read_as_an_accepted_token_is_detected_at_the_next_step(spec_result):
    _, result = spec_result
    fault = result["faults"]["draft-rejected-kept"]
    assert fault["step"] is not None, "no step rejected a draft of a request with tokens left"
    assert fault["violations"], fault
    assert min(v[0] for v in fault["violations"]) >= fault["step"]  # nothing flagged before it
    # flagged where the rejected draft's records were left (the slot the sampled token should have overwritten)
    hits = [v for v in fault["violations"] if "VERIFY_TOKEN_MISMATCH" in v[1] and v[2] == fault["slot"]]
    assert hits and min(v[0] for v in hits) <= fault["step"] + 1, fault


def test_a_bit_flipped_in_an_accepted_drafts_kv_is_detected_in_the_step_that_reads_it(spec_result):
    _, result = spec_result
    fault = result["faults"]["accepted-bitflip"]
    assert fault["step"] is not None, "no step accepted a draft"
    step, slot = fault["step"], fault["slot"]
    hits = [v for v in fault["violations"] if "VERIFY_REAL_KV_HASH_MISMATCH" in v[1] and v[2] == slot]
    assert hits and min(v[0] for v in hits) == step, fault
    assert min(v[0] for v in fault["violations"]) >= step


def test_raise_mode_installs_and_a_healthy_run_is_untouched(spec_result):
    _, result = spec_result
    exact, violations, steps, levels = result["raise"]
    assert exact is True and violations == 0 and steps > 0
    assert "WARNING" not in levels
