"""The vLLM tests' environment: vLLM's engine in-process, one small random-weight model, one engine for the
in-process tests. These tests run in vLLM's own environment (``make test`` builds ``.venv-vllm``); the main
environment does not collect this folder (tests/conftest.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)  # it would override kv_cache_memory_bytes
os.environ.pop("KVCANARY_VLLM", None)  # the plugin stays out of the in-process engine

from kvcanary_cupy.integrations.vllm.workloads import engine, save_llama


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_llama(tmp_path_factory.mktemp("tiny-llama"), "small")


@pytest.fixture(scope="session")
def llm(tiny_model: Path):
    """One in-process engine for every in-process test (vLLM keeps process-wide state: one LLM per process)."""
    yield engine(tiny_model)
