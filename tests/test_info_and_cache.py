"""``kvcanary info`` and ``kvcanary cache clear``; the cache's location (XDG) and pruning; the table of
environment variables."""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import pytest

from kvcanary_cupy import cache
from kvcanary_cupy.backends import BACKEND_NAMES, unavailable_reason
from kvcanary_cupy.cli import main

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def xdg(tmp_path, monkeypatch) -> Path:
    monkeypatch.delenv("KVCANARY_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    return tmp_path / "xdg" / "kvcanary_cupy" / "hostcuda"


def test_the_cache_follows_kvcanary_cache_dir_then_xdg_then_home(tmp_path, monkeypatch, xdg):
    assert cache.host_module_dir(create=False) == xdg
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/path")  # the XDG spec: a relative value is ignored
    assert cache.host_module_dir(create=False) == Path.home() / ".cache" / "kvcanary_cupy" / "hostcuda"
    monkeypatch.setenv("KVCANARY_CACHE_DIR", str(tmp_path / "mine"))
    assert cache.host_module_dir(create=False) == tmp_path / "mine" / "hostcuda"


def test_info_names_each_backend_with_its_reason_and_the_versions_and_cache_sizes(xdg, capsys):
    xdg.mkdir(parents=True)
    (xdg / "plan-0123.so").write_bytes(b"x" * 3000)
    assert main(["info", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    for name in BACKEND_NAMES:
        assert info["backends"][name] == {"available": unavailable_reason(name) is None,
                                          "reason": unavailable_reason(name)}
    for key in ("cupy", "nvrtc", "cuda_driver", "compiler", "libasan", "torch", "numpy", "kvcanary_cupy"):
        assert key in info["versions"], key
    host = info["caches"][0]
    assert host["path"] == str(xdg) and host["files"] == 1 and host["bytes"] == 3000
    assert main(["info"]) == 0
    text = capsys.readouterr().out
    for name in BACKEND_NAMES:
        reason = unavailable_reason(name)
        assert f"{name} " in text and ("available" if reason is None else reason) in text
    for label in ("CuPy", "NVRTC", "CUDA driver", "g++", "libasan", "torch", str(xdg), "1 files, 2.9 KiB"):
        assert label in text, label


@pytest.mark.parametrize(("cuda", "extra"), [("12.4", "cuda12"), ("13.0", "cuda13"), ("11.8", None), (None, None)])
def test_info_names_the_extra_matching_the_cuda_version_torch_was_built_for(monkeypatch, capsys, cuda, extra):
    torch = pytest.importorskip("torch")
    from kvcanary_cupy import diagnostics

    monkeypatch.setattr(torch.version, "cuda", cuda)
    versions = diagnostics._torch()
    assert (versions["torch_cuda"], versions["cuda_extra"]) == (cuda, extra)
    assert main(["info"]) == 0
    text = capsys.readouterr().out
    if extra is None:
        assert "matching extra" not in text
    else:
        assert f"CUDA {cuda} (matching extra: kvcanary-cupy[{extra}])" in text


def test_cache_clear_removes_the_host_modules_and_says_how_much(xdg, capsys):
    xdg.mkdir(parents=True)
    for i in range(3):
        (xdg / f"m{i}.so").write_bytes(b"x" * 1024)
    assert main(["cache", "clear"]) == 0
    assert "removed 3 files" in capsys.readouterr().out and not xdg.exists()
    assert main(["cache", "clear"]) == 0
    assert "removed 0 files" in capsys.readouterr().out
    assert main(["cache"]) == 2  # an action is required


def test_pruning_drops_the_least_recently_used_files_first_and_spares_recent_and_kept_ones(tmp_path):
    now = time.time()
    ages = {"old.so": 9000, "older.so": 90000, "kept.so": 900000, "recent.so": 60, "mid.so": 3000}
    for name, age in ages.items():
        path = tmp_path / name
        path.write_bytes(b"x" * 1000)
        os.utime(path, (now - age, now - age))
    freed = cache.prune(tmp_path, limit=3500, keep=(tmp_path / "kept.so",))
    left = sorted(p.name for p in tmp_path.iterdir())
    # 5000 bytes, cap 3500: the oldest unprotected files go (older, then old: kept.so is protected) until
    # 3000 remain, so mid.so stays
    assert freed == 2000 and left == ["kept.so", "mid.so", "recent.so"]
    # cap 0: everything goes but the protected file and the one used in the last ten minutes
    assert cache.prune(tmp_path, limit=0, keep=(tmp_path / "kept.so",)) == 1000
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept.so", "recent.so"]
    assert cache.prune(tmp_path, limit=10**9) == 0


def test_a_new_host_build_prunes_the_cache_to_its_cap(tmp_path, monkeypatch):
    if unavailable_reason("host") is not None:
        pytest.skip(f"host backend: {unavailable_reason('host')}")
    from kvcanary_cupy.hostcuda import HostModule

    monkeypatch.setenv("KVCANARY_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("KVCANARY_CACHE_MAX_MB", "0")
    folder = tmp_path / "hostcuda"
    folder.mkdir()
    stale = folder / "stale-0000.so"
    stale.write_bytes(b"x" * 4096)
    os.utime(stale, (time.time() - 86400, time.time() - 86400))
    module = HostModule('extern "C" __global__ void k(int* p) { p[threadIdx.x] = 1; }', name="prune_probe")
    assert not stale.exists() and module.library_path.exists()


def _env_vars_read_by_the_package() -> set[str]:
    names: set[str] = set()
    package = ROOT / "kvcanary_cupy"
    for path in [*package.rglob("*.py"), *package.rglob("*.cpp"), *package.rglob("*.h")]:
        text = path.read_text()
        names |= set(re.findall(r"""(?:environ\.get|getenv|environ\[|setenv)\(?\s*["']([A-Z][A-Z0-9_]+)["']""", text))
        names |= set(re.findall(r"""^_?[A-Z_]*ENV\s*=\s*["']([A-Z][A-Z0-9_]+)["']""", text, re.M))
        names |= set(re.findall(r"""read(?:_setting)?\(\s*["']([A-Z][A-Z0-9_]+)["']""", text))
    return names


def _table_rows() -> dict[str, str]:
    """docs/backends.md's table of environment variables: each variable named in a row's first cell -> the row."""
    page = (ROOT / "docs" / "backends.md").read_text()
    table = page[page.index("| variable |"):].split("\n\n")[0]
    rows = {}
    for line in table.splitlines()[2:]:
        first = line.split("|")[1]
        for name in re.findall(r"`([A-Z][A-Z0-9_]+)`", first):
            rows[name] = line
    return rows


def test_the_backends_page_lists_every_environment_variable_the_package_reads():
    from kvcanary_cupy.settings import SETTINGS

    found = _env_vars_read_by_the_package()
    expected = {"KVCANARY_CACHE_DIR", "XDG_CACHE_HOME", "KVCANARY_HOST_SANITIZE", "CXX", "KVCANARY_HOST_SPIN_US",
                "KVCANARY_HOST_THREADS", "KVCANARY_CACHE_MAX_MB", "KVCANARY_MAX_ALLOCATION_BYTES"}
    assert expected <= found, found
    rows = _table_rows()
    listed = set(rows)
    missing = (found | set(SETTINGS)) - listed
    assert not missing, f"not in docs/backends.md's table: {sorted(missing)}"
    # and the table names no KVCANARY_ variable the package does not check
    assert {n for n in listed if n.startswith("KVCANARY_")} == set(SETTINGS)


def test_the_table_states_each_variables_range_as_the_code_checks_it():
    """Each row of a checked variable names the values the code accepts at its bounds (hand-picked per variable),
    so a range changed in one place and not the other fails here."""
    from kvcanary_cupy.settings import read

    rows = _table_rows()
    bounds = {"KVCANARY_CACHE_MAX_MB": ("0", "1048576"), "KVCANARY_HOST_THREADS": ("1", "256"),
              "KVCANARY_HOST_SPIN_US": ("0", "1000000"), "KVCANARY_VLLM_RING_CAPACITY": ("1", "2147483647"),
              "KVCANARY_VLLM_SWEEP_INTERVAL": ("0", "2147483647")}
    for name, (low, high) in bounds.items():
        plain = rows[name].replace(",", "").replace("–", " ")
        assert re.search(rf"\b{low}\b", plain) and re.search(rf"\b{high}\b", plain), (name, rows[name])
        assert read(name, {name: low}) is not None and read(name, {name: high}) is not None
        for outside in (str(int(high) + 1),) + ((str(int(low) - 1),) if int(low) > 0 else ()):
            with pytest.raises(ValueError, match=rf"^kv-canary: {name}"):
                read(name, {name: outside})
    for name, values in {"KVCANARY_HOST_SANITIZE": ("0", "1", "thread"), "KVCANARY_VLLM": ("log", "raise", "off"),
                         "KVCANARY_VLLM_BACKEND": ("auto", "numpy", "host", "cuda"),
                         "KVCANARY_VLLM_REAL_KV_HASH": ("partial", "all", "none")}.items():
        for value in values:
            assert f"`{value}`" in rows[name], (name, value)
            assert read(name, {name: value}) is not None
