"""The L3 directory (``--tier-dir``) is a boundary: a symlink planted under an L3 file's name is never followed
(the file outside keeps its bytes), an unwritable directory (a read-only file system, as root too) or one without
room for the tier's cap is refused at the start with exit status 2, and a directory removed (the run's own too)
or a disk filled mid-run ends the run with a message and exit status 1, not a traceback, with no file of the run
left behind."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvcanary_cupy.cli import main
from kvcanary_cupy.sim import runner, tiers
from kvcanary_cupy.sim.config import SimConfig
from kvcanary_cupy.sim.l3dir import TierDir, TierStorageError, open_tier_dir
from kvcanary_cupy.sim.runner import Simulation

SMALL = ["simulate", "--preset", "decode", "--steps", "60", "--requests", "24", "--backend", "numpy", "--quiet",
         "--tiers", "host,disk"]


def _small_l2(monkeypatch) -> None:
    monkeypatch.setattr(tiers, "L2_SLOTS", 128)  # a small host tier: pages reach the disk within a few steps


@contextlib.contextmanager
def tmpfs(where: Path, options: str) -> Iterator[Path]:
    """A tmpfs mounted at ``where`` with ``options`` (unmounted afterwards); skips with the reason where this
    process cannot mount."""
    where.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root; the chmod variant covers an unprivileged user")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)], capture_output=True,
                          text=True, timeout=30)
    if done.returncode != 0:
        pytest.skip(f"mount -t tmpfs -o {options} failed here: {done.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True, timeout=30, check=True)


def _record_l3_names(monkeypatch) -> list[str]:
    """Names of the L3 files present when a run's store closes (recorded before they are removed)."""
    seen: list[str] = []
    close = tiers.TieredStore.close

    def recording_close(self):
        seen.extend(sorted(os.listdir(self.dir)))
        close(self)

    monkeypatch.setattr(tiers.TieredStore, "close", recording_close)
    return seen


def test_a_symlink_planted_under_an_l3_files_name_is_never_followed(tmp_path, monkeypatch, capsys):
    _small_l2(monkeypatch)
    names = _record_l3_names(monkeypatch)
    assert main([*SMALL, "--tier-dir", str(tmp_path / "first")]) == 0
    assert any(n.endswith(".kv") for n in names)  # the run left files in L3 at its end: their names are known
    # the same run again, with every one of those names taken by a symlink to a file outside the directory
    outside = tmp_path / "outside.txt"
    outside.write_bytes(b"precious")
    trap = tmp_path / "second"
    trap.mkdir()
    for name in names:
        (trap / name).symlink_to(outside)
    names.clear()
    assert main([*SMALL, "--tier-dir", str(trap)]) == 0
    assert outside.read_bytes() == b"precious"  # nothing written through a symlink
    planted = sorted(p.name for p in trap.iterdir())
    assert all((trap / n).is_symlink() and os.readlink(trap / n) == str(outside) for n in planted)
    assert set(names) > set(planted)  # the run used other names next to the planted ones ...
    assert len(planted) == len(set(planted))  # ... and removed its own files but none of the planted links
    assert "error" not in capsys.readouterr().err


def test_only_the_files_a_run_created_are_read_changed_or_removed(tmp_path):
    l3 = open_tier_dir(str(tmp_path), 0)
    (tmp_path / "abc.kv").write_bytes(b"theirs")
    name = l3.create("abc", b"ours")
    assert name == "abc.1.kv" and (tmp_path / name).read_bytes() == b"ours"
    for touch in (l3.read, l3.size, lambda n: l3.truncate(n, 0), l3.remove):
        with pytest.raises(ValueError, match="not a file this run created"):
            touch("abc.kv")
    with pytest.raises(ValueError, match="lowercase hex"):
        l3.create("../escape", b"x")
    l3.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["abc.kv"] and (tmp_path / "abc.kv").read_bytes() == b"theirs"


def test_a_read_only_file_system_is_refused_at_the_start_with_status_2(tmp_path, capsys):
    with tmpfs(tmp_path / "ro", "ro,size=16m") as ro:
        assert main([*SMALL, "--tier-dir", str(ro)]) == 2
        err = capsys.readouterr().err
        assert "--tier-dir" in err and "Read-only file system" in err and "internal error" not in err
        assert main([*SMALL, "--tier-dir", str(ro / "sub")]) == 2  # nor can it be created there
        assert "cannot create the directory" in capsys.readouterr().err
        assert list(ro.iterdir()) == []


def test_a_directory_without_write_permission_is_refused_at_the_start(tmp_path, capsys):
    if os.geteuid() == 0:
        pytest.skip("root writes through permission bits; the read-only mount test covers root")
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    assert main([*SMALL, "--tier-dir", str(locked)]) == 2
    assert "--tier-dir" in capsys.readouterr().err and list(locked.iterdir()) == []


def test_too_little_free_space_for_the_cap_is_refused_at_the_start(tmp_path, capsys):
    with tmpfs(tmp_path / "tiny", "size=256k") as tiny:
        assert main([*SMALL, "--tier-dir", str(tiny)]) == 2
        err = capsys.readouterr().err
        assert "--tier-dir" in err and "bytes free" in err and str(tiers.L3_BYTES) in err
        assert list(tiny.iterdir()) == []


def _during_run(monkeypatch, at_step: int, action) -> None:
    """Run ``action()`` once the run has done ``at_step`` steps (between two steps)."""
    run = runner.Simulation.run

    def run_with(self, progress=None):
        def step_done(t, counts):
            if t == at_step:
                action()
            if progress is not None:
                progress(t, counts)

        return run(self, step_done)

    monkeypatch.setattr(runner.Simulation, "run", run_with)


def test_a_directory_removed_mid_run_ends_it_with_status_1_and_a_message(tmp_path, monkeypatch, capsys):
    _small_l2(monkeypatch)
    l3 = tmp_path / "l3"
    _during_run(monkeypatch, 20, lambda: shutil.rmtree(l3))
    assert main([*SMALL, "--tier-dir", str(l3)]) == 1
    err = capsys.readouterr().err
    assert "the disk tier failed" in err and f"--tier-dir {l3}" in err and "No such file or directory" in err
    assert "Traceback" not in err and "internal error" not in err
    assert not l3.exists()  # nothing recreated


def test_the_runs_own_directory_removed_mid_run_ends_it_with_status_1_and_a_message(tmp_path, monkeypatch, capsys):
    """Without ``--tier-dir`` the store makes its own directory (under ``tmp_path`` here) and removes it at the end;
    removed mid-run, it is already gone then: the run still ends with the disk tier's error, not another."""
    _small_l2(monkeypatch)
    made: list[str] = []
    mkdtemp = tiers.tempfile.mkdtemp

    def recording_mkdtemp(**kwargs):
        made.append(mkdtemp(dir=tmp_path, **kwargs))
        return made[-1]

    monkeypatch.setattr(tiers.tempfile, "mkdtemp", recording_mkdtemp)
    _during_run(monkeypatch, 20, lambda: shutil.rmtree(made[0]))
    assert main(SMALL) == 1
    err = capsys.readouterr().err
    assert "the disk tier failed" in err and "No such file or directory" in err
    assert "Traceback" not in err and "internal error" not in err
    assert len(made) == 1 and os.listdir(tmp_path) == []  # nothing recreated


def test_a_full_disk_mid_run_ends_it_with_status_1_and_leaves_no_file(tmp_path, monkeypatch, capsys):
    _small_l2(monkeypatch)
    with tmpfs(tmp_path / "fs", f"size={tiers.L3_BYTES + (1 << 20)}") as fs:
        def fill() -> None:
            with open(fs / "filler", "wb") as f, contextlib.suppress(OSError):
                while True:
                    f.write(b"\0" * (1 << 16))

        _during_run(monkeypatch, 20, fill)
        assert main([*SMALL, "--tier-dir", str(fs / "l3")]) == 1
        err = capsys.readouterr().err
        assert "the disk tier failed" in err and "No space left on device" in err and "Traceback" not in err
        assert list((fs / "l3").iterdir()) == []  # the partly written file and every other one removed


def test_a_store_error_names_the_file_and_the_operation(tmp_path):
    cfg = SimConfig(preset="decode", steps=40, requests=16, backend="numpy", tiers=("host", "disk"),
                    tier_dir=str(tmp_path / "l3"))
    sim = Simulation(cfg)
    sim.tiers.l2_slots = 64
    l3dir = sim.tiers.l3dir
    assert isinstance(l3dir, TierDir)
    shutil.rmtree(tmp_path / "l3")
    with pytest.raises(TierStorageError, match=r"--tier-dir .*l3: cannot create the L3 file [0-9a-f]+\.kv: No such"):
        sim.run()
    assert not (tmp_path / "l3").exists()
