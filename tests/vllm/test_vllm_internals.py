"""The vLLM internals the integration patches or reads are all still there, with the signatures it relies on,
and the version gate refuses other vLLM releases (no engine started here)."""

from __future__ import annotations

import pytest

from kvcanary_cupy.integrations.vllm import CanaryOptions, check_version
from kvcanary_cupy.integrations.vllm.internals import INTERNALS, problems


def test_every_internal_the_integration_uses_is_present_in_the_installed_vllm():
    assert problems() == []


def test_a_missing_internal_a_changed_signature_or_a_missing_field_is_reported(monkeypatch):
    """The check would fail for a vLLM that dropped or changed what the integration relies on: a hooked method
    removed, a called method's parameters renamed, a read config field gone (each planted here)."""
    from vllm.entrypoints.llm import LLM
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from kvcanary_cupy.integrations.vllm import internals

    monkeypatch.delattr(GPUModelRunner, "_model_forward")
    monkeypatch.setattr(LLM, "collective_rpc", lambda self, func, timeout=None: [])
    monkeypatch.setattr(internals, "INTERNALS", (*internals.INTERNALS, internals.Internal(
        "vllm.config:ParallelConfig", "planted", attributes=("rank", "no_such_field"))))
    found = problems()
    assert any(p.startswith(f"{internals.RUNNER}._model_forward: missing") for p in found), found
    assert any(p.startswith("vllm.entrypoints.llm:LLM.collective_rpc: parameters ('self', 'func', 'timeout')")
               for p in found), found
    assert "vllm.config:ParallelConfig: attributes ['no_such_field'] missing" in found
    assert len(found) == 3


def test_the_internals_list_names_the_methods_the_hooks_patch():
    targets = {i.target.rsplit(".", 1)[-1] for i in INTERNALS}
    assert {"execute_model", "_model_forward", "sample_tokens", "get_forward_context"} <= {
        t.split(":")[-1] for t in targets}


def test_installed_vllm_is_in_the_supported_range():
    import vllm

    assert check_version() == vllm.__version__


@pytest.mark.parametrize("version", ["0.31.2", "0.33.0", "1.0.0"])
def test_other_vllm_versions_are_refused_naming_the_range(version):
    with pytest.raises(ValueError, match=r"^kv-canary: vllm .* not supported.*vllm>=0\.32,<0\.33"):
        check_version(version)


def test_options_come_from_the_environment():
    assert CanaryOptions.from_env({}) is None
    opts = CanaryOptions.from_env({"KVCANARY_VLLM": "raise", "KVCANARY_VLLM_SWEEP_INTERVAL": "3",
                                   "KVCANARY_VLLM_WITH_V": "0", "KVCANARY_VLLM_BACKEND": "numpy"})
    assert opts == CanaryOptions(mode="raise", sweep_interval=3, with_v=False, backend="numpy")
    with pytest.raises(ValueError, match=r"^kv-canary: KVCANARY_VLLM must be log, raise or off, got 'loud'"):
        CanaryOptions.from_env({"KVCANARY_VLLM": "loud"})
    with pytest.raises(ValueError, match=r"^kv-canary: KVCANARY_VLLM_SWEEP_INTERVAL must be an integer"):
        CanaryOptions.from_env({"KVCANARY_VLLM": "log", "KVCANARY_VLLM_SWEEP_INTERVAL": "often"})


@pytest.mark.parametrize(("field", "value"), [
    ("mode", "LOG"), ("mode", None), ("real_kv_hash", "some"), ("with_v", "no"), ("with_v", 1),
    ("backend", "gpu"), ("ring_capacity", 0), ("ring_capacity", True), ("sweep_interval", -1),
    ("sweep_interval", 1.5), ("logger", ""),
])
def test_every_option_field_is_checked_strictly(field, value):
    with pytest.raises(ValueError, match=rf"^kv-canary: CanaryOptions\.{field} "):
        CanaryOptions(**{field: value})
