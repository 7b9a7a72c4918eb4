"""The README's in-process vLLM block runs as written and reports a healthy engine as clean.

The block is taken from README.md (the python block marked "run by tests/vllm/test_readme_vllm.py") and run in a
fresh process, since vLLM keeps process-wide state (one engine per process). Only the model changes: the
README's ``"path/to/model"`` becomes a random-weight model saved for the test (no tokenizer, so the engine is told
to skip it), with a small KV cache so the run fits a shared machine.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from kvcanary_cupy.integrations.vllm.workloads import KV_BLOCKS, kv_cache_bytes

README = Path(__file__).resolve().parents[2] / "README.md"
MARK = "<!-- run by tests/vllm/test_readme_vllm.py"


def readme_block() -> str:
    text = README.read_text()
    start = text.index("```python\n", text.index(MARK)) + len("```python\n")
    return text[start:text.index("```", start)]


def test_the_readme_in_process_block_runs_and_finds_a_healthy_engine_clean(tiny_model: Path):
    code = readme_block()
    placeholder = 'model="path/to/model"'
    assert code.count(placeholder) == 1, "the README block names its model as path/to/model"
    code = code.replace(placeholder, f"model={str(tiny_model)!r}, skip_tokenizer_init=True, dtype='float32', "
                                     f"max_model_len=256, enforce_eager=True, "
                                     f"kv_cache_memory_bytes={kv_cache_bytes('small', KV_BLOCKS)}")
    # after the block: how many engine steps the canary checked (0 would mean it never ran)
    code += "\nprint('canary steps:', canary.steps, 'installed:', canary.installed)\n"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVCANARY_VLLM", "VLLM_CPU_KVCACHE"))}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    # the block's own print: one request, and no violation on a healthy engine
    assert lines[-2] == "1 requests, []", done.stdout[-2000:]
    steps = re.fullmatch(r"canary steps: (\d+) installed: (\w+)", lines[-1])
    assert steps and int(steps[1]) > 0 and steps[2] == "False", lines[-1]  # it checked steps, then came out
