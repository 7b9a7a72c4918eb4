"""Shared fixtures: backends available on this machine and small builders for plan inputs."""

from __future__ import annotations

import importlib.util
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, settings

from kvcanary_cupy.backends import unavailable_reason

# The vLLM tests run in vLLM's own environment (`make test-vllm`); an environment without vLLM does not collect them.
# (the real package: tests/vllm itself would pass for a namespace package named vllm when tests/ is on sys.path)
_VLLM = importlib.util.find_spec("vllm")
collect_ignore = [] if _VLLM is not None and _VLLM.origin not in (None, "namespace") else ["vllm"]

settings.register_profile(
    "ci", deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    derandomize=True, print_blob=True,
)
settings.register_profile("dev", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_collection_modifyitems(config, items):
    gpu_reason = unavailable_reason("cuda")
    for item in items:
        if "gpu" in item.keywords and gpu_reason is not None:
            item.add_marker(pytest.mark.skip(reason=f"GPU test: {gpu_reason}"))


def host_backend_reason() -> str | None:
    return unavailable_reason("host")


def i64(values) -> np.ndarray:
    return np.asarray(values, dtype=np.int64)


def i32(values) -> np.ndarray:
    return np.asarray(values, dtype=np.int32)
