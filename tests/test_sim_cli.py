"""The ``kvcanary`` command line: help with examples, exit codes, files, and clear messages for bad arguments."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvcanary_cupy.cli import main
from kvcanary_cupy.sim import FAULT_KINDS, PRESETS, validate

ROOT = Path(__file__).resolve().parents[1]


def test_help_lists_commands_examples_fault_kinds_and_presets(capsys):
    assert main(["--help"]) == 0
    assert "simulate" in capsys.readouterr().out
    assert main(["simulate", "--help"]) == 0
    out = capsys.readouterr().out
    assert "examples:" in out and "kvcanary simulate --preset mixed --inject all" in out
    for name in (*FAULT_KINDS, *PRESETS, "--backend", "--dump-failures", "--json", "--html", "exit status"):
        assert name in out, name
    assert main(["replay", "--help"]) == 0
    assert "--sanitize" in capsys.readouterr().out


def test_no_command_prints_help_and_fails(capsys):
    assert main([]) == 2
    assert "simulate" in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "message"), [
    (["simulate", "--steps", "0"], "--steps: expected a positive integer"),
    (["simulate", "--steps", "many"], "--steps: expected a positive integer"),
    (["simulate", "--preset", "nope"], "invalid choice: 'nope'"),
    (["simulate", "--backend", "tpu"], "invalid choice: 'tpu'"),
    (["simulate", "--inject", "gremlins"], "unknown fault kind 'gremlins'"),
    (["simulate", "--inject", "kv-bitflip:2"], "the rate must be in (0, 1]"),
    (["simulate", "--inject", "kv-bitflip:often"], "the rate must be a number"),
    (["simulate", "--preset", "decode", "--inject", "swa-early-evict"], "needs an SWA group"),
    (["simulate", "--inject", "all", "--steps", "5", "--warmup", "4"], "no step is left to inject faults"),
    (["simulate", "--seed", "-3"], "the seed must be >= 0"),
    (["simulate", "--requests", "1000000000"], "--requests must lie in [1, 100000]"),
    (["simulate", "--steps", "1000000000"], "--steps must lie in [1, 100000]"),
    (["simulate", "--inject", "kv-bitflip:1e-320"], "the rate must lie in [1e-06, 1]"),
    (["simulate", "--ring-capacity", "99999999999"], "--ring-capacity must lie in [1, 16777216]"),
    (["simulate", "--disaggregated", "--transfer-timeout", "nan"], "--transfer-timeout: expected a number of seconds"),
    (["simulate", "--disaggregated", "--transfer-timeout", "0"], "--transfer-timeout: expected a number of seconds"),
    (["simulate", "--disaggregated", "--transfer-timeout", "1e300"], "in (0, 86400], got '1e300'"),
    (["frobnicate"], "invalid choice: 'frobnicate'"),
    (["replay"], "the following arguments are required: FILE"),
])
def test_bad_arguments_give_a_message_and_status_2(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert "Traceback" not in err


def test_the_transfer_timeout_takes_seconds_in_zero_to_one_day_and_nothing_else():
    import argparse

    from kvcanary_cupy.cli import _seconds, build_parser

    parse = build_parser().parse_args
    for text, seconds in (("0.25", 0.25), ("1", 1.0), ("86400", 86400.0), ("1e-3", 0.001)):
        assert parse(["simulate", "--disaggregated", "--transfer-timeout", text]).transfer_timeout == seconds
    for text in ("0", "-0.5", "86400.5", "inf", "nan", "soon", ""):
        with pytest.raises(argparse.ArgumentTypeError, match=r"^expected a number of seconds in \(0, 86400\], got "):
            _seconds(text)


def test_an_unavailable_backend_is_a_clear_error(capsys):
    from kvcanary_cupy.backends import unavailable_reason

    if unavailable_reason("cuda") is None:
        pytest.skip("a GPU is available here")
    assert main(["simulate", "--backend", "cuda", "--steps", "2"]) == 2
    err = capsys.readouterr().err
    assert "--backend cuda is not available here" in err and "Traceback" not in err


def test_a_small_simulation_writes_its_reports_and_exits_0(tmp_path, capsys):
    argv = ["simulate", "--preset", "mixed", "--inject", "all", "--steps", "30", "--requests", "8", "--seed", "2",
            "--backend", "numpy", "--json", str(tmp_path / "r.json"), "--html", str(tmp_path / "r.html"),
            "--dump-failures", str(tmp_path / "dumps"), "--plain"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert "fault kind" in captured.out and "PASS" in captured.out
    assert "step 30/30" in captured.err  # plain progress lines when stderr is not a terminal
    report = json.loads((tmp_path / "r.json").read_text())
    assert validate(report) == [] and report["passed"]
    assert (tmp_path / "r.html").read_text().startswith("<!doctype html>")
    dumped = sorted(p.name.split("-seed2-step")[0] for p in (tmp_path / "dumps").glob("*.npz"))
    assert dumped == sorted(FAULT_KINDS)
    assert "kvcanary replay" in captured.out


def test_quiet_runs_print_no_progress(capsys):
    assert main(["simulate", "--preset", "decode", "--steps", "10", "--requests", "3", "--quiet",
                 "--backend", "numpy"]) == 0
    assert capsys.readouterr().err == ""


def test_python_dash_m_is_the_same_command():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-m", "kvcanary_cupy", "simulate", "--help"], capture_output=True,
                          text=True, env=env, timeout=120)
    assert done.returncode == 0 and "examples:" in done.stdout
    done = subprocess.run([sys.executable, "-m", "kvcanary_cupy", "simulate", "--steps", "-1"], capture_output=True,
                          text=True, env=env, timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr


TOO_SMALL = ["simulate", "--preset", "decode", "--inject", "stale-expected", "--steps", "10", "--requests", "2",
             "--seed", "1", "--backend", "numpy", "--quiet", "--plain"]


def test_a_kind_the_workload_cannot_host_is_inconclusive_with_status_4_and_a_warning(capsys):
    assert main(TOO_SMALL) == 4
    out = capsys.readouterr().out
    assert "warning: the workload is too small to inject stale-expected" in out
    assert "INCONCLUSIVE: could not inject stale-expected" in out and "FAIL" not in out


def test_help_promises_only_what_the_run_does():
    from kvcanary_cupy.cli import build_parser

    text = " ".join(build_parser()._subparsers._group_actions[0].choices["simulate"].format_help().split())
    assert "is injected at least once" not in text
    assert 'reported as "could not inject"' in text and "4 when nothing failed but a requested kind could not" in text


def test_json_dash_writes_the_report_alone_to_stdout(capsys):
    assert main(["simulate", "--preset", "decode", "--steps", "8", "--requests", "2", "--backend", "numpy",
                 "--quiet", "--json", "-"]) == 0
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert validate(report) == [] and report["outcome"] == "passed"
    assert "PASS" in captured.err and not (ROOT / "-").exists()


def test_an_unwritable_report_path_is_refused_before_the_run(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert main(["simulate", "--steps", "5", "--html", str(blocker / "r.html")]) == 2
    err = capsys.readouterr().err
    assert "--html" in err and "cannot create" in err


def test_a_report_that_cannot_be_written_after_the_run_keeps_the_verdict(tmp_path, monkeypatch, capsys):
    import kvcanary_cupy.sim.report as report_mod

    def disk_full(report, path):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(report_mod, "write_html", disk_full)
    assert main([*TOO_SMALL, "--html", str(tmp_path / "r.html")]) == 4
    assert "cannot write" in capsys.readouterr().err
    assert main(["simulate", "--preset", "decode", "--steps", "8", "--requests", "2", "--backend", "numpy",
                 "--quiet", "--html", str(tmp_path / "r.html")]) == 0


def test_dumps_of_two_seeds_do_not_overwrite_each_other(tmp_path):
    for seed in ("2", "3"):
        assert main(["simulate", "--preset", "decode", "--inject", "kv-bitflip", "--steps", "20", "--requests", "6",
                     "--seed", seed, "--backend", "numpy", "--quiet", "--plain",
                     "--dump-failures", str(tmp_path)]) == 0
    names = sorted(p.name for p in tmp_path.glob("*.npz"))
    assert [n.split("-step")[0] for n in names] == ["kv-bitflip-seed2", "kv-bitflip-seed3"], names
