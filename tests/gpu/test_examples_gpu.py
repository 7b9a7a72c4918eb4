"""``examples/cuda_graph.py`` on a GPU: the step captured in a CUDA graph and replayed finds exactly what the
same bound launches find when called directly on CPU tensors."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "cuda_graph.py"


def test_the_captured_example_replays_to_the_same_violations_as_on_cpu():
    pytest.importorskip("torch")
    spec = importlib.util.spec_from_file_location("cuda_graph_example", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    on_gpu, on_cpu = example.run("cuda"), example.run("cpu")
    assert on_gpu.total == on_cpu.total == 2 and on_gpu.status == 0
    assert [(v.slot, v.position, v.stored_token, v.reasons) for v in on_gpu.rows] == \
        [(v.slot, v.position, v.stored_token, v.reasons) for v in on_cpu.rows]
