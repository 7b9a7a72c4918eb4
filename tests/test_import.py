"""``import kvcanary_cupy`` needs NumPy only and imports neither CuPy nor torch."""

from __future__ import annotations

import subprocess
import sys

import pytest


def run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_import_does_not_load_cupy_or_torch():
    result = run("import sys, kvcanary_cupy; print(sorted(m for m in ('cupy', 'torch') if m in sys.modules))")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_import_and_numpy_path_work_when_cupy_and_torch_are_absent():
    code = (
        "import sys; sys.modules['cupy'] = None; sys.modules['torch'] = None\n"
        "import numpy as np, kvcanary_cupy as kc\n"
        "vp = kc.VerifyPlan.allocate(verify_capacity=4); wp = kc.WritePlan.allocate(write_req_capacity=1)\n"
        "kc.launch_canary_plan_kernels(verify_plan_out=vp, write_plan_out=wp,\n"
        "    req_pool_indices=np.array([1]), prefix_lens=np.array([2]), extend_seq_lens=np.array([1]),\n"
        "    req_to_token=np.arange(8, dtype=np.int32).reshape(2, 4), swa_window_size=0,\n"
        "    full_to_swa_index_mapping=None, verify_capacity=4)\n"
        "print(vp.verify_slot_indices[:2].tolist(), 'cuda' in kc.available_backends())\n"
    )
    result = run(code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[4, 5] False"


@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
def test_cuda_allocation_without_cupy_is_a_clear_error(device):
    result = run(
        "import sys; sys.modules['cupy'] = None\n"
        "import kvcanary_cupy as kc\n"
        "try:\n"
        f"    kc.VerifyPlan.allocate(verify_capacity=4, device={device!r})\n"
        "except ValueError as exc:\n"
        "    print(exc)\n"
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("kv-canary: device=") and "needs CuPy" in result.stdout
