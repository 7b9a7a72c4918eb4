"""The built wheel and sdist: what they hold, their metadata, and a wheel that works outside the source tree.

Both are built offline with setuptools' own PEP 517 hooks (no ``build`` package, no download) from a copy of the
source tree, so the checkout stays clean.
"""

from __future__ import annotations

import email
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

import kvcanary_cupy

ROOT = Path(__file__).resolve().parents[1]
_SKIP = shutil.ignore_patterns(".git", ".venv", ".venv-vllm", "build", "dist", "*.egg-info", "__pycache__", "*.pyc",
                               "report", ".mypy_cache", ".ruff_cache", ".pytest_cache", ".hypothesis", ".benchmarks",
                               "results")


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    src = tmp_path_factory.mktemp("src") / "kvcanary-cupy"
    shutil.copytree(ROOT, src, ignore=_SKIP)
    out = src / "dist"
    built: dict[str, Path] = {"src": src}
    for kind in ("sdist", "wheel"):  # one process each: setuptools keeps state between the two hooks
        code = f"import sys; from setuptools import build_meta as b; print('BUILT=' + b.build_{kind}(sys.argv[1]))"
        done = subprocess.run([sys.executable, "-c", code, str(out)], cwd=src, capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, done.stdout + done.stderr
        built[kind] = out / re.search(r"^BUILT=(\S+)$", done.stdout, re.M).group(1)
        assert built[kind].is_file(), built[kind]
    return built


def _package_files_on_disk() -> set[str]:
    kept = (".py", ".h", ".cpp", ".typed", ".json", ".yml")
    files = {p.relative_to(ROOT).as_posix() for p in (ROOT / "kvcanary_cupy").rglob("*")
             if p.is_file() and "__pycache__" not in p.parts and p.suffix in kept}
    files |= {f"kvcanary_cupy/kernels/{p.name}" for p in (ROOT / "kernels").iterdir() if p.suffix in (".cu", ".cuh")}
    return files


def test_the_wheel_holds_every_module_every_kernel_and_the_type_marker(built):
    names = set(zipfile.ZipFile(built["wheel"]).namelist())
    missing = _package_files_on_disk() - names
    assert not missing, f"not in the wheel: {sorted(missing)}"
    assert "kvcanary_cupy/py.typed" in names and "kvcanary_cupy/kernels/canary_common.cuh" in names
    assert {"kvcanary_cupy/observability/grafana-dashboard.json", "kvcanary_cupy/observability/prometheus-rules.yml"
            } <= names
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    assert not any(n.startswith(("tests/", "bench/")) for n in names)


def test_the_wheel_metadata_is_spdx_licensed_classified_and_versioned_once(built):
    with zipfile.ZipFile(built["wheel"]) as whl:
        meta_name = next(n for n in whl.namelist() if n.endswith(".dist-info/METADATA"))
        meta = email.message_from_bytes(whl.read(meta_name))
    assert meta["License-Expression"] == "Apache-2.0"
    assert meta["Version"] == kvcanary_cupy.__version__
    classifiers = meta.get_all("Classifier")
    for wanted in ("Programming Language :: Python :: 3.10", "Operating System :: POSIX :: Linux",
                   "Environment :: GPU :: NVIDIA CUDA :: 12", "Environment :: GPU :: NVIDIA CUDA :: 13",
                   "Typing :: Typed"):
        assert wanted in classifiers, wanted
    # No project address is published until one is real: an address nothing confirms is worse than none.
    assert meta.get_all("Project-URL") is None


def _requirements(meta: email.message.Message, extra: str) -> list[str]:
    tail = f'; extra == "{extra}"'
    return [r.removesuffix(tail) for r in meta.get_all("Requires-Dist") if r.endswith(tail)]


def test_each_cuda_extra_brings_a_cupy_that_loads_a_wheel_nvrtc_and_that_nvrtc(built):
    with zipfile.ZipFile(built["wheel"]) as whl:
        meta = email.message_from_bytes(whl.read(next(n for n in whl.namelist() if n.endswith("METADATA"))))
    for extra, cupy, toolkit in (("cuda12", "cupy-cuda12x", "12"), ("cuda13", "cupy-cuda13x", "13"),
                                 ("nvrtc12", "cupy-cuda12x", "12")):
        reqs = _requirements(meta, extra)
        floor = next(r for r in reqs if r.startswith(cupy))
        # CuPy 13 cannot load an NVRTC installed from a wheel; 14 finds it through cuda-pathfinder.
        assert re.fullmatch(rf"{cupy}(\[ctk\])?>=(\d+)", floor) and int(floor.rsplit(">=", 1)[1]) >= 14, floor
        assert "[ctk]" in floor or any(
            re.fullmatch(rf"(cuda-toolkit\[nvrtc\]=={toolkit}\.\*|nvidia-cuda-nvrtc-cu{toolkit}.*)", r)
            for r in reqs), reqs


def test_the_sdist_carries_the_tests_benchmarks_examples_kernels_and_makefile(built):
    with tarfile.open(built["sdist"]) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    tracked = {p.relative_to(ROOT).as_posix() for d in ("tests", "bench", "examples", "kernels")
               for p in (ROOT / d).rglob("*")
               if p.is_file() and "__pycache__" not in p.parts and "results" not in p.parts}
    for required in ("tests/conftest.py", "tests/oracle.py", "tests/gpu/test_cuda_backend.py", "bench/conftest.py",
                     "examples/cuda_graph.py", "kernels/canary_common.cuh", "Makefile", "LICENSE", "README.md",
                     "setup.py", "pyproject.toml"):
        assert required in names, required
    assert not tracked - names, f"not in the sdist: {sorted(tracked - names)}"


def test_the_sdist_test_suite_collects(built, tmp_path):
    with tarfile.open(built["sdist"]) as tar:
        tar.extractall(tmp_path, filter="data")
    unpacked = next(tmp_path.iterdir())
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                           "tests/test_oracle_vectors.py", "tests/test_sim_cli.py", "tests/gpu", "bench"],
                          cwd=unpacked, capture_output=True, text=True, timeout=300,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(unpacked), "HOME": str(tmp_path)})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert re.search(r"^\d+ tests collected", done.stdout, re.M), done.stdout[-500:]


def test_the_wheel_works_outside_the_source_tree(built, tmp_path):
    site = tmp_path / "site"
    with zipfile.ZipFile(built["wheel"]) as whl:
        whl.extractall(site)
    code = ("import kvcanary_cupy, kvcanary_cupy.backends.kernel_backend as kb\n"
            "print(kvcanary_cupy.__file__); print(kb.kernels_dir())")
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(site), "HOME": str(tmp_path)})
    assert done.returncode == 0, done.stderr
    module, kernels = done.stdout.split()
    assert module.startswith(str(site)) and kernels == str(site / "kvcanary_cupy" / "kernels")


def test_readme_links_are_relative_and_their_targets_ship_in_the_sdist(built):
    """Relative links work in a checkout, on a fork and offline; each target is in the sdist too."""
    text = (ROOT / "README.md").read_text()
    links = [link.partition("#")[0] for link in re.findall(r"\]\(([^)\s]+)\)", text)]
    assert links, "the README links to the documentation"
    assert not [link for link in links if link.startswith(("https://", "http://"))]
    with tarfile.open(built["sdist"]) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    missing = sorted({link for link in links if link} - names)
    assert not missing, f"linked from the README, not in the sdist: {missing}"
