"""Everything a user sets is checked before vLLM serves: the plugin's ``KVCANARY_VLLM*`` variables when vLLM
registers the plugin, ``install()``'s backend against the device of the engine's KV cache; a refusal leaves the
engine untouched, and a step the canary fails (``raise`` mode) leaves it serving."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from kvcanary_cupy.integrations import vllm as kv
from kvcanary_cupy.integrations.vllm import plugin
from kvcanary_cupy.integrations.vllm.faults import injector
from kvcanary_cupy.integrations.vllm.workloads import workloads

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).parent
LOAD = workloads()["mixed-lengths"]
_baseline: list[list[int]] = []


def baseline(llm) -> list[list[int]]:
    if not _baseline:
        assert llm.reset_prefix_cache()
        _baseline.extend(LOAD.run(llm))
    return _baseline


def _plugin_env(monkeypatch, **values: str) -> None:
    for name in [k for k in os.environ if k.startswith("KVCANARY_VLLM")]:
        monkeypatch.delenv(name)
    for name, value in values.items():
        monkeypatch.setenv(name, value)


# (variable, bad value): each refused by register(), naming the variable, before anything is hooked
BAD_PLUGIN_SETTINGS = [
    ("KVCANARY_VLLM", "loud"), ("KVCANARY_VLLM", "LOG"),
    ("KVCANARY_VLLM_FAULT", "junk"), ("KVCANARY_VLLM_FAULT", "wrong-token@x"),
    ("KVCANARY_VLLM_FAULT", "wrong-token@"), ("KVCANARY_VLLM_FAULT", "wrong-token@-1"), ("KVCANARY_VLLM_FAULT", "@3"),
    ("KVCANARY_VLLM_FAULT", "wrong-token@3.5"),
    ("KVCANARY_VLLM_BACKEND", "cuda"), ("KVCANARY_VLLM_BACKEND", "gpu"),
    ("KVCANARY_VLLM_RING_CAPACITY", "0"), ("KVCANARY_VLLM_RING_CAPACITY", "4096.0"),
    ("KVCANARY_VLLM_RING_CAPACITY", "2147483648"), ("KVCANARY_VLLM_SWEEP_INTERVAL", "-1"),
    ("KVCANARY_VLLM_SWEEP_INTERVAL", "often"), ("KVCANARY_VLLM_WITH_V", "maybe"),
    ("KVCANARY_VLLM_REAL_KV_HASH", "some"), ("KVCANARY_VLLM_BACKNED", "numpy"),
    ("KVCANARY_VLLM_CONNECTOR", "CanaryConnector"), ("KVCANARY_VLLM_CONNECTOR", "a.b:C"),
    ("KVCANARY_VLLM_CONNECTOR_ON_REFUSED", "recompute"),
]


@pytest.mark.parametrize(("name", "value"), BAD_PLUGIN_SETTINGS)
def test_register_refuses_a_wrong_plugin_variable_naming_it_and_hooks_nothing(monkeypatch, name, value):
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    extra = {} if name == "KVCANARY_VLLM" else {"KVCANARY_VLLM": "log"}
    _plugin_env(monkeypatch, **extra, **{name: value})
    before = dict(vars(GPUModelRunner))
    with pytest.raises(ValueError, match=rf"^kv-canary: {name}\b"):
        plugin.register()
    assert "original" not in plugin._state and dict(vars(GPUModelRunner)) == before


def test_a_wrong_plugin_variable_stops_vllm_before_it_serves(tiny_model):
    """Through vLLM's own plugin loading: the engine is never built, and the refusal names the variable."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCANARY_VLLM")}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    env.update(KVCANARY_VLLM="log", KVCANARY_VLLM_FAULT="wrong-token@soon", PYTHONPATH=str(ROOT))
    run = subprocess.run([sys.executable, str(HERE / "plugin_run.py"), str(tiny_model), "mixed-lengths"], env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode != 0 and "RESULT " not in run.stdout
    assert "kv-canary: KVCANARY_VLLM_FAULT must be <kind>[@<step>]" in run.stderr, run.stderr[-3000:]
    assert "Loading safetensors" not in run.stderr  # refused before any weight was read


def test_install_refuses_a_backend_the_engines_device_cannot_run_and_the_engine_still_generates(llm):
    want = baseline(llm)
    runner = kv.find_runner(llm)
    before = dict(vars(runner))
    for mode in ("log", "off"):
        with pytest.raises(ValueError, match=r"^kv-canary: backend='cuda': backend 'cuda' cannot check this "
                                             r"engine's KV cache, which is on cpu"):
            kv.install(llm, backend="cuda", mode=mode)
        assert vars(runner) == before
    assert LOAD.run(llm) == want


def test_an_engine_with_async_scheduling_is_refused_in_raise_mode_and_left_unchecked_in_log_mode(llm):
    """The runner's own flag is read at install (vLLM's CPU platform turns async scheduling off, so the flag is set by
    hand here): raise mode refuses with what to set and touches nothing; log mode hooks no step, says so in one
    line, and the engine generates as without the canary."""
    want = baseline(llm)
    runner = kv.find_runner(llm)
    assert runner.use_async_scheduling is False
    runner.use_async_scheduling = True
    try:
        before = dict(vars(runner))
        with pytest.raises(ValueError, match=r"^kv-canary: mode='raise' refuses this engine at install: .*"
                                             r"async_scheduling=False"):
            kv.install(llm, mode="raise", backend="numpy")
        assert vars(runner) == before
        canary = kv.install(llm, mode="log", backend="numpy")
        try:
            assert canary.disabled is not None and "async scheduling" in canary.disabled
            assert "execute_model" not in vars(runner) and "_model_forward" not in vars(runner)
            assert LOAD.run(llm) == want
        finally:
            canary.remove()
        # every name the canary set is gone (the generate above renewed vLLM's own async copy stream)
        assert set(vars(runner)) == set(before) and "_kvcanary" not in vars(runner)
    finally:
        runner.use_async_scheduling = False


def test_a_step_the_canary_fails_leaves_the_engine_serving_installed_and_removed(llm):
    want = baseline(llm)
    canary = kv.install(llm, mode="raise", backend="numpy", sweep_interval=0)
    try:
        fault = injector("wrong-token", at=3, seed=1)
        canary.observers.append(fault)
        with pytest.raises(kv.CanaryViolationError):
            LOAD.run(llm)
        assert fault.fault is not None
        found = len(canary.violations)
        assert found >= 1 and any("WRITE_TOKEN_MISMATCH" in v.violation.reasons for v in canary.violations)
        # nothing of the failed call is left waiting in the engine (a request stranded there hangs every later
        # generate): checked before generating, so a regression fails here instead of hanging
        assert llm.llm_engine.get_num_unfinished_requests() == 0
        assert llm.llm_engine.engine_core.engine_core.scheduler.get_num_unfinished_requests() == 0
        assert LOAD.run(llm) == want  # still installed, the fault spent: token-exact and clean
        canary.finish()
        assert len(canary.violations) == found
    finally:
        canary.remove()
    assert LOAD.run(llm) == want


def test_the_plugin_logs_a_runner_it_cannot_check_and_leaves_it_unhooked(caplog):
    """What the canary cannot check is decided when the runner's KV cache is built: one ERROR line, no hook, no
    exception into vLLM's startup."""
    runner = types.SimpleNamespace(_model_forward=lambda **kw: None, execute_model=lambda *a: None, kv_caches=[])
    before = dict(vars(runner))
    with caplog.at_level(logging.ERROR, logger="kvcanary_cupy.vllm"):
        plugin._install_after_kv_cache(runner, kv.CanaryOptions(logger="kvcanary_cupy.vllm"), ("wrong-token", 3))
    assert vars(runner) == before
    assert [r.getMessage() for r in caplog.records] == [
        "kv-canary not installed in SimpleNamespace, its KV cache is left unchecked: this model runner has no KV "
        "cache yet; install the canary once the engine is built"]
