"""What this machine offers the canary (``kvcanary info``): backends and why each is unavailable, the versions
of everything the backends load (CuPy, NVRTC, the CUDA driver, g++, libasan, torch) and the cache folders.

:func:`collect` returns a JSON-ready dict; :func:`render_text` formats it. Nothing here compiles a kernel or
starts a GPU context beyond what CuPy's import and the availability checks already do (the host backend's check
builds and runs its one-line probe module, once per machine: it is cached with the kernel modules).
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import subprocess
import sys
from typing import Any

from . import __version__
from .backends import BACKEND_NAMES, auto_choice, unavailable_reason
from .cache import cupy_kernel_cache_dir, host_module_dir, max_bytes, usage
from .settings import problems

#: The extra to install for each CUDA major version that ``torch.version.cuda`` may report.
CUDA_EXTRAS = {"12": "cuda12", "13": "cuda13"}


def _dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _cupy() -> dict[str, Any]:
    dists = [d for d in ("cupy-cuda13x", "cupy-cuda12x", "cupy") if _dist_version(d)]
    out: dict[str, Any] = {"cupy": None, "cupy_package": dists[0] if dists else None, "nvrtc": None,
                           "cuda_driver": None}
    from .dlpack import cupy_module

    cupy = cupy_module()
    if cupy is None:
        out["nvrtc"] = out["cuda_driver"] = "unknown (CuPy is not installed)"
        return out
    out["cupy"] = str(cupy.__version__)
    from .backends.cuda import nvrtc_version

    try:
        out["nvrtc"] = "{}.{}".format(*nvrtc_version())
    except Exception as exc:
        out["nvrtc"] = f"not loadable ({type(exc).__name__}: {exc})"
    try:
        driver = int(cupy.cuda.runtime.driverGetVersion())
        out["cuda_driver"] = f"{driver // 1000}.{driver % 1000 // 10}" if driver else "none (no NVIDIA driver)"
    except Exception as exc:
        out["cuda_driver"] = f"unknown ({type(exc).__name__}: {exc})"
    return out


def _compiler() -> dict[str, Any]:
    from .hostcuda import find_compiler, sanitizer_preload

    cxx = find_compiler()
    if cxx is None:
        return {"compiler": None, "compiler_path": None, "libasan": None}
    done = subprocess.run([cxx, "-dumpfullversion", "-dumpversion"], capture_output=True, text=True, check=False,
                          env={k: v for k, v in os.environ.items() if k != "LD_PRELOAD"})
    asan = sanitizer_preload()
    return {"compiler": done.stdout.strip() or "unknown", "compiler_path": cxx,
            "libasan": asan if os.path.isfile(asan) else None}


def _torch() -> dict[str, Any]:
    if _dist_version("torch") is None:
        return {"torch": None, "torch_cuda": None, "cuda_extra": None}
    import torch

    cuda = torch.version.cuda
    return {"torch": str(torch.__version__), "torch_cuda": cuda,
            "cuda_extra": CUDA_EXTRAS.get(str(cuda).split(".")[0]) if cuda else None}


def _auto() -> dict[str, str]:
    """What ``auto`` runs for an engine here (flagged statuses, the engine's arrays on a GPU where one is
    reachable), and why."""
    name, why = auto_choice("cuda" if unavailable_reason("cuda") is None else "cpu", "flag")
    return {"backend": name, "reason": why}


def collect() -> dict[str, Any]:
    """Everything ``kvcanary info`` shows, as a JSON-ready dict."""
    bad_settings = problems()
    try:
        cap: int | None = max_bytes()
    except ValueError:  # a wrong KVCANARY_CACHE_MAX_MB: listed under "settings" instead
        cap = None
    host = host_module_dir(create=False)
    host_usage = usage(host)
    cupy_cache = usage(cupy_kernel_cache_dir())
    versions: dict[str, Any] = {"kvcanary_cupy": __version__, "python": platform.python_version(),
                                "numpy": _dist_version("numpy")}
    versions.update(_cupy())
    versions.update(_compiler())
    versions.update(_torch())
    versions.update(rich=_dist_version("rich"), matplotlib=_dist_version("matplotlib"))
    return {
        "platform": f"{platform.system()} {platform.machine()}",
        "python_executable": sys.executable,
        "backends": {name: {"available": unavailable_reason(name) is None, "reason": unavailable_reason(name)}
                     for name in BACKEND_NAMES},
        "auto": _auto(),
        "versions": versions,
        "caches": [
            {"name": "host modules", "path": str(host), "files": host_usage.files, "bytes": host_usage.bytes,
             "cap_bytes": cap, "cleared_by": "kvcanary cache clear"},
            {"name": "CuPy kernels (shared with every CuPy user)", "path": str(cupy_cache.path),
             "files": cupy_cache.files, "bytes": cupy_cache.bytes, "cap_bytes": None, "cleared_by": None},
        ],
        "settings": bad_settings,
    }


def _size(n: int) -> str:
    return f"{n / (1024 * 1024):.1f} MiB" if n >= 1024 * 1024 else f"{n / 1024:.1f} KiB"


def render_text(info: dict[str, Any]) -> str:
    v = info["versions"]
    lines = [f"kvcanary {v['kvcanary_cupy']} on Python {v['python']} ({info['platform']}, "
             f"{info['python_executable']})", "", "backends:"]
    for name, b in info["backends"].items():
        lines.append(f"  {name:<6} {'available' if b['available'] else 'unavailable: ' + str(b['reason'])}")
    auto = info["auto"]
    lines.append(f"  auto   picks {auto['backend']} for an engine here: {auto['reason']}")
    cupy = f"{v['cupy']} ({v['cupy_package']})" if v["cupy"] else "not installed"
    torch = "not installed"
    if v["torch"]:
        torch = f"{v['torch']}, CUDA {v['torch_cuda']}" if v["torch_cuda"] else f"{v['torch']}, CPU only"
        if v["cuda_extra"]:
            torch += f" (matching extra: kvcanary-cupy[{v['cuda_extra']}])"
    compiler = f"{v['compiler']} ({v['compiler_path']})" if v["compiler"] else "not found (set CXX or install g++)"
    lines += ["", "versions:",
              f"  numpy        {v['numpy']}",
              f"  CuPy         {cupy}",
              f"  NVRTC        {v['nvrtc']}",
              f"  CUDA driver  {v['cuda_driver']}",
              f"  g++          {compiler}",
              f"  libasan      {v['libasan'] or 'not found (kvcanary replay --sanitize needs it)'}",
              f"  torch        {torch}",
              f"  rich         {v['rich'] or 'not installed (plain-text tables)'}",
              f"  matplotlib   {v['matplotlib'] or 'not installed (HTML report without a plot)'}",
              "", "caches:"]
    for c in info["caches"]:
        cap = f", capped at {_size(c['cap_bytes'])}" if c["cap_bytes"] is not None else ""
        how = f"; '{c['cleared_by']}' empties it" if c["cleared_by"] else "; not cleared by kvcanary"
        lines.append(f"  {c['name']}: {c['path']}")
        lines.append(f"    {c['files']} files, {_size(c['bytes'])}{cap}{how}")
    lines += ["", "settings:"]
    lines += [f"  {p.removeprefix('kv-canary: ')}" for p in info["settings"]] or \
        ["  every KVCANARY_* variable that is set is valid"]
    return "\n".join(lines)
