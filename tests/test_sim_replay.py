"""Dumped failing launches replay to the same violation rows, on the host backend (the CUDA kernels on the CPU)
and on the NumPy reference, also from the command line and under AddressSanitizer."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvcanary_cupy.backends import unavailable_reason
from kvcanary_cupy.cli import main
from kvcanary_cupy.sim import FAULT_KINDS, SimConfig, Simulation, load_case, parse_inject, replay_case

HOST = unavailable_reason("host")
needs_host = pytest.mark.skipif(HOST is not None, reason=f"host backend: {HOST}")
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def dumps(tmp_path_factory) -> dict[str, Path]:
    directory = tmp_path_factory.mktemp("dumps")
    sim = Simulation(SimConfig(preset="mixed", steps=40, requests=10, seed=6, backend="numpy",
                               inject=parse_inject(["all"]), dump_dir=str(directory)))
    report = sim.run()
    assert report["passed"]
    return dict(sim.recorder.dumped)


def test_the_first_failing_launch_of_every_kind_is_dumped(dumps):
    assert set(dumps) == set(FAULT_KINDS)
    for kind, path in dumps.items():
        case = load_case(path)
        assert case.meta["kind"] == kind and case.meta["op"] in ("verify", "write")
        assert case.arrays["expected_rows"].shape[0] >= 1
        assert "canary_buf" in case.arrays
        if case.meta["role"] != "SWEEP":
            assert "in_req_to_token" in case.arrays  # the plan inputs travel with the launch


@pytest.mark.parametrize("backend", ["numpy", pytest.param("host", marks=needs_host)])
def test_replay_reproduces_the_dumped_violations(dumps, backend):
    for path in dumps.values():
        case = load_case(path)
        outcome = replay_case(case, backend)
        assert outcome.reproduced, (path.name, outcome.rows, case.arrays["expected_rows"].tolist())
        assert sorted(outcome.rows) == sorted(map(tuple, case.arrays["expected_rows"].tolist()))
        if outcome.plan_check is not None:
            assert "identical" in outcome.plan_check, outcome.plan_check


@needs_host
def test_dumps_recorded_on_the_host_backend_replay_exactly(tmp_path):
    sim = Simulation(SimConfig(preset="swa", steps=30, requests=8, seed=2, backend="host",
                               inject={"kv-bitflip": 0.1, "position-shift": 0.1}, dump_dir=str(tmp_path)))
    assert sim.run()["passed"]
    assert set(sim.recorder.dumped) == {"kv-bitflip", "position-shift"}
    for path in sim.recorder.dumped.values():
        assert replay_case(load_case(path), "host").reproduced


def test_replay_notices_a_changed_launch(dumps, tmp_path):
    path = dumps["kv-bitflip"]
    case = load_case(path)
    arrays = dict(case.arrays)
    arrays["expected_rows"] = arrays["expected_rows"][:0]  # pretend the launch had been clean
    arrays["meta"] = np.array(json.dumps(case.meta))
    forged = tmp_path / "forged.npz"
    np.savez(forged, **arrays)
    assert not replay_case(load_case(forged), "numpy").reproduced
    assert main(["replay", str(forged), "--backend", "numpy"]) == 1


def test_the_replay_command_prints_the_violations(dumps, capsys):
    backend = "host" if HOST is None else "numpy"
    assert main(["replay", str(dumps["double-alloc"]), "--backend", backend]) == 0
    out = capsys.readouterr().out
    assert "double-alloc" in out and "reproduced" in out and "violation(s)" in out
    assert "slot" in out and "reasons" in out


def test_the_replay_command_refuses_bad_files(tmp_path, capsys):
    assert main(["replay", str(tmp_path / "missing.npz"), "--backend", "numpy"]) == 2
    junk = tmp_path / "junk.npz"
    junk.write_bytes(b"not a zip")
    assert main(["replay", str(junk), "--backend", "numpy"]) == 2
    np.savez(tmp_path / "other.npz", x=np.zeros(3))
    assert main(["replay", str(tmp_path / "other.npz"), "--backend", "numpy"]) == 2
    err = capsys.readouterr().err
    assert "no such file" in err and "not a kvcanary replay file" in err and "Traceback" not in err


@needs_host
def test_replay_under_address_sanitizer(dumps):
    from kvcanary_cupy.hostcuda import sanitizer_preload

    if not os.path.isfile(sanitizer_preload()):
        pytest.skip("the compiler has no AddressSanitizer runtime")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-m", "kvcanary_cupy", "replay", str(dumps["kv-misdirect"]),
                           "--backend", "host", "--sanitize"], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "AddressSanitizer + UBSan" in done.stdout and "reproduced" in done.stdout
