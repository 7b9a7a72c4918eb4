"""``backend="auto"`` runs the host kernels on CPU arrays wherever g++ builds and runs the probe module (engines
take flagged statuses), the NumPy reference where the compiler is missing or broken, with the reason in
``kvcanary info`` and in one INFO line; the probe is built once and then comes from the kernel cache."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import kvcanary_cupy.backends as backends

ROOT = Path(__file__).resolve().parent.parent

# Run in a fresh interpreter: the choice is made once per process (and the environment decides it).
CHOOSE = """
import json, logging, sys
from kvcanary_cupy.backends import auto_choice
from kvcanary_cupy.diagnostics import _auto as info_auto  # what `kvcanary info` prints for auto
from kvcanary_cupy.sim.config import resolve_backend as sim_backend
records = []
handler = logging.Handler()
handler.emit = lambda r: records.append((r.levelname, r.name, r.getMessage()))
logging.getLogger("kvcanary_cupy").addHandler(handler)
logging.getLogger("kvcanary_cupy").setLevel(logging.DEBUG)
engine = auto_choice("cpu", "flag")
launcher = auto_choice("cpu", None)
sim = sim_backend("auto")[0]
# the launches of a runtime resolve auto with flagged statuses, every launch (nothing compiled yet)
from kvcanary_cupy.backends import resolve_backend
from kvcanary_cupy.dlpack import CPU
resolved = {resolve_backend("auto", CPU, "flag").name for _ in range(3)}
print(json.dumps({"engine": engine, "launcher": launcher, "sim": sim, "resolved": sorted(resolved),
                  "info": info_auto(), "records": records}))
"""


def choose(env_changes: dict[str, str], cache: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("CXX", "KVCANARY_HOST_SANITIZE")}
    env.update(KVCANARY_CACHE_DIR=str(cache), PYTHONPATH=str(ROOT), **env_changes)
    done = subprocess.run([sys.executable, "-c", CHOOSE], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def auto_lines(out: dict) -> list[str]:
    return [m for level, _, m in out["records"] if level == "INFO" and m.startswith("kv-canary backend auto: ")]


def probe_compiles(out: dict) -> int:
    return sum(1 for _, _, m in out["records"] if m.startswith("compiling host module 'kvc_probe'"))


@pytest.fixture(scope="module")
def host_works() -> None:
    if backends.unavailable_reason("host") is not None:
        pytest.skip(f"this machine has no working g++: {backends.unavailable_reason('host')}")


def test_auto_runs_the_host_kernels_where_gxx_works_and_builds_the_probe_once(host_works, tmp_path):
    # The host runtime and worker pool every module links, from this process's cache (content-keyed, so valid
    # anywhere): the fresh cache then lacks only the probe module itself, which the first process must build.
    from kvcanary_cupy.cache import host_module_dir

    (tmp_path / "hostcuda").mkdir()
    for built in [*host_module_dir().glob("kvc-host-runtime-*.o"), *host_module_dir().glob("kvc-host-pool-*.so")]:
        shutil.copy2(built, tmp_path / "hostcuda" / built.name)
    assert not list((tmp_path / "hostcuda").glob("kvc_probe-*"))
    first = choose({}, tmp_path)
    assert first["engine"][0] == first["sim"] == first["info"]["backend"] == "host"
    assert first["resolved"] == ["host"]
    assert "probe module" in first["engine"][1] and first["info"]["reason"] == first["engine"][1]
    # the launchers' own default raises on invalid device values: the reference, said so
    assert first["launcher"][0] == "numpy" and "on_invalid" in first["launcher"][1]
    # one INFO line per choice and process, however many launches resolve auto
    assert auto_lines(first) == [f"kv-canary backend auto: host ({first['engine'][1]})"]
    assert probe_compiles(first) == 1
    again = choose({}, tmp_path)  # a second process: the probe comes from the kernel cache
    assert again["engine"][0] == "host" and probe_compiles(again) == 0


@pytest.mark.parametrize("compiler", ["missing", "broken"])
def test_auto_falls_back_to_numpy_with_the_reason_where_the_compiler_does_not_work(compiler, tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    if compiler == "missing":
        env = {"PATH": str(bin_dir), "CXX": str(bin_dir / "g++")}  # neither $CXX nor g++ on PATH exists
        want = "no C++ compiler was found"
    else:
        broken = bin_dir / "g++"
        broken.write_text("#!/bin/sh\necho 'g++: internal compiler error' >&2\nexit 1\n")
        broken.chmod(0o755)
        env = {"PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}", "CXX": str(broken)}
        want = f"{broken} could not build and run the probe module"
    out = choose(env, tmp_path / "cache")
    name, reason = out["engine"]
    assert name == out["sim"] == out["info"]["backend"] == "numpy" and out["resolved"] == ["numpy"]
    assert reason.startswith("the host backend is unavailable: ") and want in reason
    assert out["info"]["reason"] == reason
    assert f"kv-canary backend auto: numpy ({reason})" in auto_lines(out)


def test_kvcanary_info_prints_the_auto_choice_and_its_reason(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "CXX"}
    env.update(PATH=str(bin_dir), CXX=str(bin_dir / "g++"), KVCANARY_CACHE_DIR=str(tmp_path / "cache"),
               PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-m", "kvcanary_cupy", "info"], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    line = next(x for x in done.stdout.splitlines() if x.strip().startswith("auto "))
    assert "picks numpy" in line and "no C++ compiler was found" in line


def test_an_engine_install_logs_one_line_naming_the_backend_and_why(caplog):
    import logging

    from kvcanary_cupy.integrations.common.options import EngineCanaryOptions

    name, why = backends.auto_choice("cpu", "flag")
    with caplog.at_level(logging.INFO, logger="kvcanary_cupy.test.install"):
        EngineCanaryOptions(logger="kvcanary_cupy.test.install").log_install("ToyRunner")
        EngineCanaryOptions(logger="kvcanary_cupy.test.install", backend="numpy").log_install("ToyRunner")
    lines = [r.getMessage() for r in caplog.records if r.name == "kvcanary_cupy.test.install"]
    assert lines == [f"kv-canary installed in ToyRunner (mode=log, real_kv_hash=partial, backend={name}: {why})",
                     "kv-canary installed in ToyRunner (mode=log, real_kv_hash=partial, backend=numpy: set by "
                     "CanaryOptions.backend)"]
    assert name == ("host" if backends.unavailable_reason("host") is None else "numpy")
