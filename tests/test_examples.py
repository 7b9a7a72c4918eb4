"""``examples/cuda_graph.py`` runs as written: on CPU tensors the bound launches are called directly (the
capture itself runs in tests/gpu), and the verify of the step after the allocator bug catches it."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "cuda_graph.py"


def load_example():
    pytest.importorskip("torch")
    spec = importlib.util.spec_from_file_location("cuda_graph_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_cuda_graph_example_catches_the_slot_it_gives_away_on_cpu_tensors():
    example = load_example()
    report = example.run("cpu")
    stolen = 1 + example.WIDTH * 1 + 2  # request 1's slot at position 2, handed to request 2 at step 2
    assert report.total == 2 and report.status == 0
    first, second = report.rows
    # request 2's token (100 * 2 + 3) now sits in request 1's slot: the position and the chain no longer fit,
    # and the chain into request 1's next slot breaks too
    assert (first.slot, first.stored_token) == (stolen, 203)
    assert set(first.reasons) == {"VERIFY_CHAIN_HASH_MISMATCH", "VERIFY_POSITION_MISMATCH"}
    assert (second.slot, tuple(second.reasons)) == (stolen + 1, ("VERIFY_CHAIN_HASH_MISMATCH",))


def test_the_cuda_graph_example_runs_as_a_script():
    pytest.importorskip("torch")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, str(EXAMPLE), "cpu"], capture_output=True, text=True, env=env,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.rstrip().endswith("2 violation(s), 2 shown from a ring of 64")


def test_the_docs_show_an_excerpt_of_the_example_line_for_line():
    readme = (ROOT / "docs" / "cuda-graphs.md").read_text()
    start = readme.index("This is an excerpt of")
    block = readme[readme.rindex("```python\n", 0, start) + len("```python\n"):readme.rindex("```", 0, start)]
    shown = [line.strip() for line in block.splitlines() if line.strip() and line.strip() != "..."]
    source = [line.strip() for line in EXAMPLE.read_text().splitlines()]
    at = 0
    for line in shown:  # every line of the excerpt, in the example's order
        assert line in source[at:], line
        at = source.index(line, at) + 1
