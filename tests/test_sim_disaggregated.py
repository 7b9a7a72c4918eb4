"""``kvcanary simulate --disaggregated``: one prefill process and two decode workers (gloo on CPU, loopback),
every transfer fault kind caught before its request's first decode step, no false positive; a decode worker
killed mid-run ends the run with a clear error and a non-zero status, quickly.

The two end-to-end runs are separate processes (each starts three more); the rest runs in-process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from kvcanary_cupy.cli import main
from kvcanary_cupy.sim.disagg.faults import (
    TRANSFER_KINDS,
    FaultSchedule,
    differing_positions,
    flip_kv_bit,
    flip_record_bit,
    swap_pages,
)
from kvcanary_cupy.sim.disagg.report import render_html, validate

pytest.importorskip("torch.distributed", reason="torch is not installed")
ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--steps", "30", "--requests", "12", "--seed", "0", "--backend", "numpy", "--plain"]


def kvcanary(*argv: str, timeout: float) -> tuple[subprocess.CompletedProcess[str], float]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "kvcanary_cupy", *argv], capture_output=True, text=True, env=env,
                          timeout=timeout)
    return done, time.monotonic() - start


def assert_every_transfer_fault_caught_at_the_transfer_verify(report):
    """A passing, valid report in which every transfer fault kind was injected and each fault caught by the
    transfer verify at once, on the side its kind names, with every violation explained."""
    assert validate(report) == []
    assert report["passed"]
    assert [k["kind"] for k in report["kinds"]] == list(TRANSFER_KINDS)
    for kind in report["kinds"]:
        assert kind["injected"] >= 1 and kind["status"] == "detected", kind
        assert kind["caught_at"] == {"transfer verify": kind["injected"]}, kind
    for fault in report["faults"]:
        assert fault["detected"] and fault["latency_steps"] == 0, fault
        assert fault["side"] == TRANSFER_KINDS[fault["kind"]].side
    v = report["violations"]
    assert v["false_positives"] == 0 and v["explained"] == v["total"] > 0 and not v["status"]


def test_two_decode_workers_catch_every_transfer_fault_before_the_first_decode_step(tmp_path):
    done, _ = kvcanary("simulate", "--disaggregated", "--decode-workers", "2", "--inject", "all", *SMALL,
                       "--json", str(tmp_path / "r.json"), "--html", str(tmp_path / "r.html"), timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads((tmp_path / "r.json").read_text())
    assert_every_transfer_fault_caught_at_the_transfer_verify(report)
    assert {f["side"] for f in report["faults"]} == {"sender", "receiver"}
    workers = report["disaggregated"]["workers"]
    assert [w["worker"] for w in workers] == [1, 2]
    prefill = report["disaggregated"]["prefill"]
    assert sum(w["requests"] for w in workers) == prefill["requests"] == 12
    assert sum(w["kv_bytes"] for w in workers) == prefill["kv_bytes"]
    for w in workers:
        assert w["requests"] == 6  # round robin
        assert w["accepted"] + w["rejected"] == w["requests"]
        assert w["canary_share"] == pytest.approx(w["canary_bytes"] / w["kv_bytes"])
    # Clean transfers went through: accepted requests were decoded, and none of that raised a violation.
    assert report["workload"]["decode_tokens"] > 0
    assert sum(w["finished"] for w in workers) >= 1
    assert "caught at" in done.stdout and "decode worker 2:" in done.stdout and "PASS" in done.stdout
    assert "Transfers per decode worker" in (tmp_path / "r.html").read_text()


def test_a_killed_decode_worker_is_reported_and_the_run_fails_fast():
    done, seconds = kvcanary("simulate", "--disaggregated", "--decode-workers", "2", *SMALL, "--quiet",
                             "--kill-decode-worker", "2@3", "--transfer-timeout", "20", timeout=120)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "decode worker 2 died (killed by SIGKILL)" in done.stderr
    assert "lost decode worker 2" in done.stderr
    assert "Traceback" not in done.stderr
    assert seconds < 60  # a dead peer is seen at once, not after the transfer timeout (20 s)


@pytest.mark.parametrize(("argv", "message"), [
    (["--preset", "mixed"], "has an SWA or EAGLE group"),
    (["--inject", "kv-bitflip"], "unknown fault kind 'kv-bitflip'"),
    (["--inject", "page-swap:3"], "the rate must be in (0, 1]"),
    (["--kill-decode-worker", "3@1"], "the worker must be in 1..2"),
    (["--kill-decode-worker", "soon"], "expected WORKER@STEP"),
    (["--dump-failures", "x"], "--dump-failures does not apply to --disaggregated"),
    (["--decode-workers", "1000"], "--decode-workers must be in 1..16, got 1000: every worker is a process"),
])
def test_bad_disaggregated_arguments_give_a_message_and_status_2(argv, message, capsys):
    assert main(["simulate", "--disaggregated", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err


def test_the_kill_drill_needs_disaggregated(capsys):
    assert main(["simulate", "--kill-decode-worker", "1@1"]) == 2
    assert "--kill-decode-worker needs --disaggregated" in capsys.readouterr().err


def test_schedule_places_every_kind_once_after_the_warmup_and_retries_what_could_not_be_placed_last():
    schedule = FaultSchedule({"page-drop": 1e-9, "page-swap": 1e-9, "slot-owned": 1e-9}, warmup=2,
                             rng=np.random.default_rng(0))
    assert [schedule.next() for _ in range(3)] == [None, None, "page-drop"]
    schedule.retry("page-drop")  # could not be placed: the other kinds go first
    assert [schedule.next() for _ in range(3)] == ["page-swap", "slot-owned", "page-drop"]
    assert schedule.next() is None


def test_sender_side_damage_changes_exactly_what_it_reports():
    rng = np.random.default_rng(3)
    kv = rng.integers(-(1 << 62), 1 << 62, size=(40, 8), dtype=np.int64)
    records = rng.integers(-(1 << 62), 1 << 62, size=(2, 40, 4), dtype=np.int64)
    swapped = kv.copy()
    i, j = swap_pages(swapped, 16, rng)
    assert sorted(differing_positions(kv, swapped).tolist()) == sorted([*range(16 * i, 16 * i + 16),
                                                                          *range(16 * j, 16 * j + 16)])
    assert swap_pages(kv[:20].copy(), 16, rng) is None  # one whole page: nothing to swap with
    flipped = kv.copy()
    position, word, bit = flip_kv_bit(flipped, 4, partial=True, rng=rng)
    assert differing_positions(kv, flipped).tolist() == [position] and word % 4 < 2  # PARTIAL reads 16 bytes
    assert (kv ^ flipped).view(np.uint64)[position, word] == np.uint64(1 << bit)
    damaged = records.copy()
    buffer, position, field, bit = flip_record_bit(damaged, rng)
    assert differing_positions(records, damaged, axis=1).tolist() == [position]
    assert (records ^ damaged).view(np.uint64)[buffer, position, field] == np.uint64(1 << bit)


class _InProcessGroup:
    """torch.distributed's point-to-point calls between threads of this process: one FIFO per (source,
    destination), each message a copy of the sent tensor; a receive checks the size the protocol announced."""

    def __init__(self, world: int) -> None:
        import queue

        self.pipes = {(a, b): queue.Queue() for a in range(world) for b in range(world) if a != b}

    def rank(self, me: int) -> object:
        import torch

        group = self

        class Distributed:
            @staticmethod
            def send(tensor, dst):
                group.pipes[(me, dst)].put(tensor.detach().clone())

            @staticmethod
            def recv(buf, src):
                got = group.pipes[(src, me)].get(timeout=30)
                if got.numel() != buf.numel():
                    raise RuntimeError(f"rank {me} expected {buf.numel()} words from rank {src}, got {got.numel()}")
                buf.copy_(got.reshape(buf.shape))  # the words in order, as gloo delivers them

        class TorchOfThisRank:  # torch, with this rank's point-to-point calls
            distributed = Distributed

            def __getattr__(self, name):
                return getattr(torch, name)

        return TorchOfThisRank()


def run_sides_in_process(cfg):
    """The disaggregated run's prefill side and decode workers as threads of this process (so that tests see
    them run), joined by :class:`_InProcessGroup`; the merged report."""
    import threading

    from kvcanary_cupy.sim.disagg.processes import _run_role
    from kvcanary_cupy.sim.disagg.report import merge

    cfg.validate()
    world = cfg.decode_workers + 1
    group, results, errors = _InProcessGroup(world), {}, {}

    def side(rank):
        try:
            results[rank] = json.loads(json.dumps(_run_role(cfg, rank, group.rank(rank), "cpu")))  # as the store
        except BaseException as exc:  # reported below, with the rank
            errors[rank] = exc

    threads = [threading.Thread(target=side, args=(rank,), daemon=True) for rank in range(world)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors and len(results) == world, errors
    return merge(cfg, results, 1.0)


def _bytes_per_token(cfg):
    """KV bytes per transferred position (every layer's K, and V with ``with_v``), from the engine's sizes."""
    from kvcanary_cupy.sim.disagg.prefill import workload_of
    from kvcanary_cupy.sim.engine import size_engine

    probe = size_engine(workload_of(cfg), max_running=1)
    return probe.kv_words_per_token * probe.num_layers * (2 if cfg.with_v else 1) * 8


@pytest.mark.parametrize("seed", range(4))
def test_in_one_process_every_transfer_fault_is_caught_at_the_transfer_verify_with_no_false_positive(seed):
    from kvcanary_cupy.sim.disagg import DisaggConfig
    from kvcanary_cupy.sim.disagg.prefill import workload_of

    cfg = DisaggConfig(decode_workers=2, steps=30, requests=12, seed=seed, backend="numpy",
                       inject=dict.fromkeys(TRANSFER_KINDS, 0.2))
    report = run_sides_in_process(cfg)
    assert_every_transfer_fault_caught_at_the_transfer_verify(report)
    assert report["exit_code"] == 0 and all(fault["worker"] in (1, 2) for fault in report["faults"])
    workers, prefill = report["disaggregated"]["workers"], report["disaggregated"]["prefill"]
    assert [(w["worker"], w["requests"]) for w in workers] == [(1, 6), (2, 6)]  # round robin
    # every prompt position travels once: its KV, and 4 int64 words of each of the 2 canary buffers (HEAD, TAIL K)
    positions = sum(s.prompt_len for s in workload_of(cfg))
    assert (prefill["requests"], prefill["kv_bytes"], prefill["canary_bytes"]) == (
        12, positions * _bytes_per_token(cfg), positions * 2 * 4 * 8)
    assert sum(w["kv_bytes"] for w in workers) == prefill["kv_bytes"]
    assert sum(w["canary_bytes"] for w in workers) == prefill["canary_bytes"]
    for w in workers:
        assert w["accepted"] + w["rejected"] == w["requests"]
        # a request whose transfer a fault damaged is rejected (a resident a landing damaged is counted apart)
        damaged = {f["request"] for f in report["faults"] if f["worker"] == w["worker"] and f["kind"] != "slot-owned"}
        assert w["rejected"] >= len(damaged)


@pytest.mark.parametrize("with_v", [False, True])
def test_in_one_process_a_clean_run_accepts_every_transfer_and_decodes_each_request_to_its_end(with_v):
    from kvcanary_cupy.sim.disagg import DisaggConfig
    from kvcanary_cupy.sim.disagg.prefill import workload_of

    cfg = DisaggConfig(decode_workers=3, steps=30, requests=10, seed=5, backend="numpy", with_v=with_v)
    report = run_sides_in_process(cfg)
    specs = workload_of(cfg)
    assert report["passed"] and report["violations"]["total"] == 0 and report["faults"] == []
    workers, prefill = report["disaggregated"]["workers"], report["disaggregated"]["prefill"]
    assert [(w["worker"], w["requests"], w["accepted"], w["rejected"]) for w in workers] == [
        (1, 4, 4, 0), (2, 3, 3, 0), (3, 3, 3, 0)]  # 10 requests round robin over 3 workers
    assert sum(w["finished"] for w in workers) == report["workload"]["requests_finished"] == 10
    # the prefill samples each request's first output token; the decode workers the rest
    assert report["workload"]["decode_tokens"] == sum(s.output_len - 1 for s in specs)
    positions = sum(s.prompt_len for s in specs)
    assert report["workload"]["prefill_tokens"] + report["workload"]["prefix_tokens_reused"] == positions
    buffers = 4 if with_v else 2
    assert (prefill["kv_bytes"], prefill["canary_bytes"]) == (positions * _bytes_per_token(cfg),
                                                              positions * buffers * 4 * 8)
    assert all(w["canary_share"] == pytest.approx(w["canary_bytes"] / w["kv_bytes"]) for w in workers)
    page = render_html(report)
    assert "<title>kv-canary disaggregated simulation report</title>" in page
    assert "<h1>kv-canary disaggregated simulation report</h1>" in page and "Transfers per decode worker" in page


@pytest.mark.parametrize("seed", range(3))
def test_after_the_prefill_stops_a_decode_worker_steps_only_while_it_still_has_requests_decoding(seed, monkeypatch):
    """Once the prefill side sends its stop, a decode worker runs the steps its requests still need and no more:
    each such step finds a request decoding (the drain ends when the last one finishes, not at its step limit)."""
    import threading

    from kvcanary_cupy.sim.disagg import DisaggConfig
    from kvcanary_cupy.sim.disagg.decode import DecodeSide
    from kvcanary_cupy.sim.disagg.wire import OP_STOP, Channel

    stopped: set[int] = set()  # the decode threads whose prefill has sent its stop
    drained: list[tuple[int, int, int]] = []  # (worker, step, requests decoding) of each step after the stop
    recv_tick, drill = Channel.recv_tick, DecodeSide._drill

    def spy_recv_tick(self):
        op, step, count = recv_tick(self)
        if op == OP_STOP:
            stopped.add(threading.get_ident())
        return op, step, count

    def spy_drill(self, t):
        if threading.get_ident() in stopped:
            drained.append((self.worker, t, len(self.engine.decoding)))
        return drill(self, t)

    monkeypatch.setattr(Channel, "recv_tick", spy_recv_tick)
    monkeypatch.setattr(DecodeSide, "_drill", spy_drill)
    report = run_sides_in_process(DisaggConfig(decode_workers=2, steps=12, requests=8, seed=seed, backend="numpy"))
    assert report["passed"] and report["workload"]["requests_finished"] == 8
    assert drained, "no worker had a request left when the prefill stopped: the drain went untested"
    assert [row for row in drained if row[2] == 0] == []
