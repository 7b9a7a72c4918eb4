"""A model with more layers than one runtime group takes (4 real-KV sources per K and per V): the canary splits
the KV cache group into runtime groups that share one plan and one set of HEAD records, each fingerprinting its
own layers. A corruption of one layer's bytes is reported by the group of that layer, at the step that reads it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvcanary_cupy.integrations.vllm.workloads import MODEL_SIZES

# the tests' small model with 6 layers: more than one runtime group takes (4 sources per K and per V)
DEEP_LAYERS = 6


@pytest.fixture(scope="module")
def deep_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    directory = tmp_path_factory.mktemp("deep-llama")
    torch.manual_seed(0)
    dims = {**MODEL_SIZES["small"], "num_hidden_layers": DEEP_LAYERS}
    config = LlamaConfig(max_position_embeddings=2048, initializer_range=0.2, **dims)
    LlamaForCausalLM(config).save_pretrained(directory)
    return directory


def deep_run(model: Path, layer: int, seed: int) -> dict:
    run = subprocess.run([sys.executable, str(Path(__file__).parent / "deep_run.py"), str(model), str(layer),
                          str(seed)], capture_output=True, text=True, timeout=500)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    result = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
    assert result, run.stderr[-4000:]
    return json.loads(result[-1][len("RESULT "):])


@pytest.mark.parametrize(("layer", "seed"), [(1, 0), (5, 1)])
def test_layers_past_the_first_four_share_the_plan_and_report_their_own_corruption(deep_model, layer, seed):
    got = deep_run(deep_model, layer, seed)
    assert got["groups"] == ["G0:0", "G0:1"] and got["leaders"] == {"G0:0": "G0:0", "G0:1": "G0:0"}
    assert got["exact"] and got["clean_rows"] == []
    owner = "G0:0" if layer < 4 else "G0:1"
    bs, block = got["block_size"], got["block"]
    rows = got["rows"]
    # the hit's first step verifies the flipped block; the layer's own group reports it, TAIL K real KV only
    assert rows and {r[1] for r in rows} == {owner}
    assert min(r[0] for r in rows) == got["start"]
    first = [r for r in rows if r[0] == got["start"]]
    assert {r[2] for r in first} == set(range(block * bs, block * bs + bs))
    assert all(r[3].startswith("TAIL_K") and r[4] == ["VERIFY_REAL_KV_HASH_MISMATCH"] for r in rows)
