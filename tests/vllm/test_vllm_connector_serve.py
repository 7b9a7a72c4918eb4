"""Disaggregated prefill through vLLM's real servers: a ``kv_producer`` and a ``kv_consumer`` OpenAI-compatible
server on 127.0.0.1 sharing an ExampleConnector store, each with the canary connector (``KVCANARY_VLLM=log``,
``KVCANARY_VLLM_CONNECTOR=ExampleConnector``), and a small router of this test that sends each request to the
prefill server (one token) and then to the decode server. Queried with the ``openai`` client through the
router: the answers are token-exact against the clean save run of the same prompts, the decode server restored
the producer's records with every load and reports no row and no refused load."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np

from kvcanary_cupy.integrations.vllm.workloads import ENGINE_ARGS, KV_BLOCKS, kv_cache_bytes

HERE = Path(__file__).resolve().parent
BLOCK = 32


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())


def _server(model: Path, store: Path, role: str, log: Path) -> tuple[subprocess.Popen, int]:
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCANARY_VLLM")}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    env.update(PYTHONPATH=str(HERE.parents[1]), KVCANARY_VLLM="log", KVCANARY_VLLM_CONNECTOR="ExampleConnector",
               KVCANARY_VLLM_REAL_KV_HASH="all")
    transfer = {"kv_connector": "ExampleConnector", "kv_role": role,
                "kv_connector_extra_config": {"shared_storage_path": str(store)}}
    args = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--host", "127.0.0.1",
            "--port", str(port), "--skip-tokenizer-init", "--dtype", "float32", "--max-model-len",
            str(ENGINE_ARGS["max_model_len"]), "--enforce-eager", "--block-size", str(ENGINE_ARGS["block_size"]),
            "--seed", "0", "--max-num-batched-tokens", "512", "--max-num-seqs", str(ENGINE_ARGS["max_num_seqs"]),
            "--no-async-scheduling", "--kv-cache-memory-bytes", str(kv_cache_bytes("small", KV_BLOCKS)),
            "--served-model-name", "tiny", "--kv-transfer-config", json.dumps(transfer)]
    with open(log, "w") as out:
        proc = subprocess.Popen(args, env=env, stdout=out, stderr=subprocess.STDOUT)
    return proc, port


def _wait_healthy(proc: subprocess.Popen, port: int, log: Path, deadline: float) -> None:
    while True:
        assert proc.poll() is None, log.read_text()[-3000:]
        assert time.time() < deadline, "vllm serve did not come up in time"
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10):
                return
        except OSError:
            time.sleep(2)


class Router(ThreadingHTTPServer):
    """POST /v1/completions: the request with max_tokens 1 to the prefill server, then as asked to the decode
    server, whose answer goes back (loopback only; one request at a time)."""

    def __init__(self, prefill: int, decode: int) -> None:
        self.prefill, self.decode = prefill, decode
        self.lock = threading.Lock()
        super().__init__(("127.0.0.1", 0), RouterHandler)


class RouterHandler(BaseHTTPRequestHandler):
    server: Router

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with self.server.lock:
            _post(f"http://127.0.0.1:{self.server.prefill}{self.path}", {**body, "max_tokens": 1})
            answer = _post(f"http://127.0.0.1:{self.server.decode}{self.path}", body)
        data = json.dumps(answer).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        return


def test_a_prefill_server_hands_its_kv_and_records_to_a_decode_server_through_a_router(tiny_model, tmp_path):
    import openai

    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, 512, int(n)).tolist() for n in (40, 70, 99, 120)]
    # the same prompts computed without any handoff: one kv_both engine in a process of its own
    from test_vllm_connector import run_engine

    want = run_engine({"model": str(tiny_model), "store": str(tmp_path / "alone"), "prompts": prompts,
                       "max_tokens": 6, "engine": {"max_num_batched_tokens": 512}})["outputs"]
    store = tmp_path / "store"
    servers = []
    try:
        for role in ("kv_producer", "kv_consumer"):
            servers.append((*_server(tiny_model, store, role, tmp_path / f"{role}.log"), tmp_path / f"{role}.log"))
        deadline = time.time() + 420
        for proc, port, log in servers:
            _wait_healthy(proc, port, log, deadline)
        router = Router(servers[0][1], servers[1][1])
        threading.Thread(target=router.serve_forever, daemon=True).start()
        try:
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{router.server_address[1]}/v1", api_key="none")
            got = []
            for p in prompts:
                answer = client.completions.create(model="tiny", prompt=p, max_tokens=6, temperature=0,
                                                   extra_body={"ignore_eos": True, "return_token_ids": True})
                got.append(list(answer.choices[0].model_extra["token_ids"]))
        finally:
            router.shutdown()
            router.server_close()
        assert got == want
        producer, consumer = (log.read_text() for _, _, log in servers)
        assert "the canary connector wraps ExampleConnector" in producer and "kv_canary=" not in producer
        assert "the canary connector wraps ExampleConnector" in consumer
        assert consumer.count("External Cache Hit!") >= len(prompts)
        assert "kv_canary=" not in consumer and "connector load refused" not in consumer  # no row, no refusal
        assert all((p_dir / "kvcanary-records.npz").exists() for p_dir in store.iterdir() if any(p_dir.iterdir()))
    finally:
        for proc, _, _ in servers:
            proc.terminate()
        for proc, _, _ in servers:
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
