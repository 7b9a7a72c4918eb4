"""MLA (DeepSeek-style latent attention; fp32 and bf16 on vLLM's CPU_MLA backend) checked end to end in vLLM's CPU
engine: the group is checked with every byte of each layer's latent cache fingerprinted, the workloads are
token-exact against the same engine without the canary with zero violations, and one bit flipped in a finished
token's latent row is caught at that slot and position, in the step the corrupted row is first read, with the
real-KV reason (``mla_run.py``, a process of its own per dtype: one engine per process)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
SEEDS = {"float32": [0, 1, 2, 3, 4, 5], "bfloat16": [6, 7, 8]}


@pytest.fixture(scope="module", params=list(SEEDS))
def mla(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict:
    dtype = request.param
    model_dir = tmp_path_factory.mktemp(f"deepseek-mla-{dtype}") / "model"
    run = subprocess.run([sys.executable, str(HERE / "mla_run.py"), str(model_dir),
                          ",".join(map(str, SEEDS[dtype])), dtype], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    result = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
    assert result, run.stderr[-4000:]
    return {**json.loads(result[-1][len("RESULT "):]), "dtype": dtype}


def test_an_mla_model_is_checked_whole_token_exact_with_zero_violations(mla):
    assert mla["runner"] == "CPUModelRunner"
    assert mla["groups"] == [["MLAAttentionSpec", True, True]]
    assert mla["cache_shapes"] == [[mla["cache_shapes"][0][0], 16, 576]] * mla["layers"] and mla["layers"] == 2
    assert mla["exact"] == {"mixed-lengths": True, "shared-prefix": True, "preemption": True}
    assert mla["violations"] == [] and mla["steps"] > 50


def test_a_bit_flipped_in_a_latent_row_is_caught_at_its_slot_and_step(mla):
    assert [run["seed"] for run in mla["faults"]] == SEEDS[mla["dtype"]]
    for run in mla["faults"]:
        fault = run["fault"]
        assert fault is not None, f"seed {run['seed']}: no decoding request to corrupt"
        assert run["violations"], fault
        step, reasons, slot, position = run["violations"][0]
        assert (step, reasons, slot, position) == (fault["step"], ["VERIFY_REAL_KV_HASH_MISMATCH"], fault["slot"],
                                                   fault["position"]), run
        assert {(v[2], v[3]) for v in run["violations"]} == {(fault["slot"], fault["position"])}, run
