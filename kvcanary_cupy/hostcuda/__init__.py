"""Run the project's CUDA C++ kernels on the CPU: the host-execution backend's compiler, loader and launcher.

This package owns everything needed to execute the *same* ``.cu`` text that CuPy compiles with NVRTC, on a
machine without a GPU:

* ``kvc_host_cuda.h`` — a CUDA shim included before the kernel text (qualifiers, ``threadIdx`` & co.,
  barriers, warp shuffles and votes, atomics, vector types, ``min``/``max``, ``__ldg``, ``__trap``, ``assert``),
  with CUDA's overload sets so g++ accepts and rejects what NVRTC does;
* ``kvc_host_register.h`` — included after the kernel text: deduces each entry point's parameter types and
  unpacks a ``cuLaunchKernel``-style ``void**`` argument array;
* ``kvc_host_runtime.cpp`` — fibers (an x86-64 assembly context switch, ``ucontext`` elsewhere), the block
  scheduler, block and warp barriers, the warp exchange, shared-memory poisoning and the C ABI used here;
* this module — kernel discovery, source rewriting (``__shared__``), the g++ build with its disk cache,
  ``ctypes`` loading, and :class:`HostModule` / :class:`HostKernel`, which mirror ``cupy.RawModule`` /
  ``cupy.RawKernel``.

Execution model: the blocks of a grid run on a pool of OS threads (each OS thread runs whole blocks; see
:func:`host_threads` and ``docs/host-threads.md``); the threads of a block are cooperative fibers, so
``__syncthreads`` and warp operations behave as on a GPU. Shared memory is filled with a poison pattern
(word ``0x7FF5A5A5``) before every block, and a shuffle that reads a lane that did not take part returns the
same word. Kernel value arguments must be NumPy scalars of the parameter's exact width (``np.int64(5)``,
not ``5``): CuPy does not check widths, so a bare Python int that happens to work on the host could pass a
wrong-sized value on the GPU.

Builds are cached under ``hostcuda/`` of the package cache (:mod:`kvcanary_cupy.cache`: ``$KVCANARY_CACHE_DIR``,
else ``$XDG_CACHE_HOME/kvcanary_cupy``, else ``~/.cache/kvcanary_cupy``; pruned to a size cap), keyed by the
runtime and shim sources, the kernel code, every header it includes from ``include_dirs``, the flags and the
compiler version. ``sanitize=True`` builds with AddressSanitizer and UBSan, ``sanitize="thread"`` with
ThreadSanitizer; such a module loads only into a process started with the sanitizer runtime preloaded (see
:func:`sanitizer_preload`).
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import operator
import os
import posixpath
import re
import shutil
import struct
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .. import settings
from ..cache import host_module_dir, prune, touch

log = logging.getLogger(__name__)

__all__ = [
    "SHARED_MEMORY_POISON_WORD",
    "SPIN_ENV",
    "THREADS_ENV",
    "HostBuildError",
    "HostKernel",
    "HostLaunchError",
    "HostModule",
    "default_host_threads",
    "find_compiler",
    "host_threads",
    "probe_compiler",
    "sanitizer_preload",
    "set_host_threads",
    "threads_on_this_thread",
]

#: Word that fills shared memory before every block (and that a shuffle from a non-participating lane
#: returns): a NaN as float32 and, doubled, as float64; 2146805157 as int32.
SHARED_MEMORY_POISON_WORD = 0x7FF5A5A5

_HERE = Path(__file__).resolve().parent
_RUNTIME_FILES = ("kvc_host_cuda.h", "kvc_host_register.h", "kvc_host_pool.h", "kvc_host_runtime.cpp")
_POOL_FILES = ("kvc_host_pool.h", "kvc_host_pool.cpp")
_CACHE_FORMAT = "kvc-hostcuda-2"

# -fno-strict-aliasing: CUDA kernels routinely reinterpret buffers (a uint4 load from long long storage);
# -fno-threadsafe-statics: the only function statics are the thread_local __shared__ tracking flags, which
#   need no lock (each OS thread initialises its own);
# -Wno-unknown-pragmas: `#pragma unroll` is an NVRTC pragma g++ does not know.
_BASE_FLAGS = (
    "-std=c++17",
    "-O2",
    "-fPIC",
    "-fvisibility=hidden",
    "-fno-gnu-unique",
    "-fno-exceptions",
    "-fno-rtti",
    "-fno-threadsafe-statics",
    "-fno-strict-aliasing",
    "-Werror=vla",
    "-Wall",
    "-Wextra",
    "-Werror",
    "-Wno-unknown-pragmas",
)
_SANITIZE_FLAGS = (
    "-fsanitize=address,undefined",
    "-fno-sanitize-recover=all",
    "-fno-omit-frame-pointer",
    "-g",
)
_TSAN_FLAGS = (
    "-fsanitize=thread",
    "-fno-omit-frame-pointer",
    "-g",
)
_IGNORED_OPTIONS = frozenset({"-std=c++17", "--std=c++17"})

_PARAM_INTEGER, _PARAM_FLOAT, _PARAM_OTHER, _PARAM_POINTER = 0, 1, 2, 3
_DEFAULT_MAX_DYNAMIC_SMEM = 48 * 1024
_MAX_DYNAMIC_SMEM = 232448  # KVC_HOST_MAX_DYNAMIC_SMEM in kvc_host_cuda.h
_ERROR_BUFFER = 4096


# ---- how many OS threads a launch may use -------------------------------------------------------------------

#: Environment variable that sets the default number of OS threads of a host launch.
THREADS_ENV = "KVCANARY_HOST_THREADS"
_threads_setting: int | None = None


def _threads_value(value: Any, name: str) -> int:
    from .._validate import int_arg

    return int_arg(value, name, minimum=1, maximum=256)


def default_host_threads() -> int:
    """Threads a launch uses when nothing else says: ``$KVCANARY_HOST_THREADS`` when set (1 to 256; any other
    value is refused, never clamped), else the number of cores this process may run on
    (``os.sched_getaffinity``, which honours taskset and cgroup cpusets), at most 256."""
    value = settings.read(THREADS_ENV)
    if value is not None:
        return int(value)
    try:
        return max(1, min(len(os.sched_getaffinity(0)), 256))
    except AttributeError:  # no sched_getaffinity on this platform
        return max(1, min(os.cpu_count() or 1, 256))


#: Environment variable: how long an idle pool worker polls before it sleeps (read when the pool loads).
SPIN_ENV = "KVCANARY_HOST_SPIN_US"


def _check_host_settings() -> None:
    """Refuse, before a module build writes anything, every host-backend variable outside its range: the cache
    folder and its cap, the default thread count, and ``$KVCANARY_HOST_SPIN_US``, which the pool library reads
    itself, once, when it loads (and would silently replace by its default)."""
    for name in ("KVCANARY_CACHE_DIR", "KVCANARY_CACHE_MAX_MB", THREADS_ENV, SPIN_ENV):
        settings.read(name)


def set_host_threads(threads: int | None) -> None:
    """Sets, process-wide, how many OS threads a host launch may use (1 to 256); None goes back to
    :func:`default_host_threads`. A ``threads=`` given to a module or a launch still wins."""
    global _threads_setting
    _threads_setting = None if threads is None else _threads_value(threads, "threads")


def host_threads() -> int:
    """The number of OS threads a host launch uses unless its module or the launch says otherwise."""
    return _threads_setting if _threads_setting is not None else default_host_threads()


_calling_thread = threading.local()  # ``cap``: the most OS threads a launch from this thread may use


@contextlib.contextmanager
def threads_on_this_thread(threads: int) -> Any:
    """Inside the block, every host launch the calling thread makes uses at most ``threads`` OS threads (1 to
    256), whatever its module, its bound count or :func:`host_threads` say. For a thread that itself runs beside
    other work (an engine canary's TAIL thread, while the engine's own thread runs Python): waking the pool's
    workers there would take the cores that work needs. Other threads' launches are unchanged."""
    value = _threads_value(threads, "threads")
    before = getattr(_calling_thread, "cap", None)
    _calling_thread.cap = value
    try:
        yield
    finally:
        _calling_thread.cap = before


def _capped(nthreads: int) -> int:
    cap = getattr(_calling_thread, "cap", None)
    return nthreads if cap is None or nthreads <= cap else cap


class HostBuildError(RuntimeError):
    """Compiling or loading a host module failed; the message carries the compiler log."""


class HostLaunchError(RuntimeError):
    """A host kernel launch failed (``__trap``, device assert, deadlock, bad warp mask, bad configuration)."""


# ---- compiler discovery ---------------------------------------------------------------------------------------


def find_compiler() -> str | None:
    """Path of the C++ compiler to use: ``$CXX`` when set and found, else ``g++`` on ``PATH``, else None."""
    cxx = os.environ.get("CXX")
    if cxx:
        found = shutil.which(cxx)
        if found:
            return found
    return shutil.which("g++")


_PROBE_SOURCE = """
extern "C" __global__ void kvc_probe(int *out) {
    if (blockIdx.x == 0 && threadIdx.x == 0) out[0] = 42;
}
"""


def probe_compiler(sanitize: bool | str = False) -> str | None:
    """None if the compiler builds, loads and runs a host module here, else why not (no compiler, a failed
    compile or load, a wrong result). The probe is a one-line kernel built like every kernel module, so it
    shares their disk cache: a machine that built it once only loads it again (milliseconds), and the
    runtime object and worker pool it builds on a cold cache are the ones every kernel module links."""
    cxx = find_compiler()
    if cxx is None:
        return "no C++ compiler was found (set CXX or install g++)"
    try:
        module = HostModule(_PROBE_SOURCE, sanitize=sanitize, name="kvc_probe", threads=1)
        out = np.zeros(1, np.int32)
        module.get_function("kvc_probe")((1,), (1,), (out,))
    except (HostBuildError, HostLaunchError, OSError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return f"{cxx} could not build and run the probe module ({first})"
    if int(out[0]) != 42:
        return f"the probe module built by {cxx} returned {int(out[0])} instead of 42"
    return None


def _compiler_env() -> dict[str, str]:
    # A parent running under a preloaded libasan must not hand it to the compiler: g++ would run (and
    # report leaks) under the sanitizer.
    env = dict(os.environ)
    env.pop("LD_PRELOAD", None)
    return env


_version_cache: dict[tuple[str, float], str] = {}
_preload_cache: dict[str, str] = {}


def _require_compiler() -> str:
    cxx = find_compiler()
    if cxx is None:
        raise HostBuildError("no C++ compiler found: install g++ or set $CXX to use the host backend")
    return cxx


def _compiler_version(cxx: str) -> str:
    key = (cxx, os.stat(cxx).st_mtime)
    if key not in _version_cache:
        out = subprocess.run([cxx, "--version"], capture_output=True, text=True, env=_compiler_env(), check=False)
        _version_cache[key] = out.stdout.strip() + "\n" + out.stderr.strip()
    return _version_cache[key]


def sanitizer_preload(sanitizer: str = "address") -> str:
    """Path of the compiler's ``libasan.so`` (``sanitizer="thread"``: ``libtsan.so``), for ``LD_PRELOAD`` in a
    process that loads sanitized modules.

    Run such a process as ``LD_PRELOAD=$(g++ -print-file-name=libasan.so) ASAN_OPTIONS=detect_leaks=0``
    (ThreadSanitizer: ``LD_PRELOAD=$(g++ -print-file-name=libtsan.so)``).
    This is g++'s answer verbatim: when the compiler ships no such runtime it is the bare name
    (``libasan.so``), so callers check ``os.path.isfile``. Raises HostBuildError when there is no compiler.
    """
    if sanitizer not in _SANITIZER_LIBS:
        raise ValueError(f"sanitizer must be 'address' or 'thread', got {sanitizer!r}")
    cxx = _require_compiler()
    key = f"{cxx}\0{sanitizer}"
    if key not in _preload_cache:
        out = subprocess.run(
            [cxx, f"-print-file-name={_SANITIZER_LIBS[sanitizer]}"], capture_output=True, text=True,
            env=_compiler_env(), check=False,
        )
        _preload_cache[key] = out.stdout.strip()
    return _preload_cache[key]


_SANITIZER_LIBS = {"address": "libasan.so", "thread": "libtsan.so"}
_SANITIZER_INIT = {"address": "__asan_init", "thread": "__tsan_init"}


def _sanitizer_runtime_loaded(sanitizer: str) -> bool:
    try:
        ctypes.CDLL(None)[_SANITIZER_INIT[sanitizer]]
    except AttributeError:
        return False
    return True


def _sanitizer_name(sanitize: bool | str) -> str | None:
    if sanitize is True or sanitize == "address":
        return "address"
    if sanitize == "thread":
        return "thread"
    if sanitize is False or sanitize is None:
        return None
    raise ValueError(f"sanitize must be False, True / 'address' or 'thread', got {sanitize!r}")


# ---- source scanning and rewriting ----------------------------------------------------------------------------

# Comments are blanked (newlines kept, so offsets and line numbers stay valid); literals and numbers (whose
# C++14 digit separators look like character literals) are matched only to be skipped.
_LEXEME = re.compile(
    r"//[^\n]*"
    r"|/\*.*?\*/"
    r"|\b\d(?:[\w.]|'(?=\w))*"
    r'|"(?:\\.|[^"\\\n])*"'
    r"|'(?:\\.|[^'\\\n])*'",
    re.S,
)


def _mask_comments(text: str) -> str:
    def blank(m: re.Match[str]) -> str:
        s = m.group(0)
        if s.startswith(("//", "/*")):
            return re.sub(r"[^\n]", " ", s)
        return s

    return _LEXEME.sub(blank, text)


_PARENS = r"\((?:[^()]|\([^()]*\))*\)"
_LAUNCH_BOUNDS = rf"(?:__launch_bounds__\s*{_PARENS}\s*)?"
_KERNEL_RE = re.compile(
    rf'\bextern\s+"C"\s+{_LAUNCH_BOUNDS}__global__\s+{_LAUNCH_BOUNDS}void\s+{_LAUNCH_BOUNDS}([A-Za-z_]\w*)\s*\('
)
_DYNAMIC_SHARED_RE = re.compile(r"\bextern\s+__shared__\s+([^;]*?)\s*\b([A-Za-z_]\w*)\s*\[\s*\]\s*;")
_STATIC_SHARED_RE = re.compile(r"\bstatic(\s+)(?=__shared__\b)|(?<=\b__shared__)(\s+)static\b")
_SHARED_RE = re.compile(r"\b__shared__\b")
_ALIGN_RE = re.compile(rf"\b(?:__align__|alignas|__attribute__)\s*{_PARENS}")
_IDENT_RE = re.compile(r"[A-Za-z_]\w*")
_INCLUDE_RE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*"([^"]+)"', re.M)
_CXX_WORDS = frozenset(
    "alignas const volatile unsigned signed int long short char float double bool void struct class union "
    "enum static extern auto".split()
)


def _line_of(text: str, pos: int) -> int:
    return text.count("\n", 0, pos) + 1


def _find_kernels(masked: str) -> list[str]:
    names: list[str] = []
    for m in _KERNEL_RE.finditer(masked):
        if m.group(1) not in names:
            names.append(m.group(1))
    return names


def _declaration_end(masked: str, start: int, label: str, file_label: str) -> int:
    """Offset of the `;` that ends the declaration starting at `start` (outside brackets)."""
    depth = 0
    for i in range(start, len(masked)):
        c = masked[i]
        if c in "([{":
            depth += 1
        elif c in ")]}":
            if depth == 0:
                break
            depth -= 1
        elif c == ";" and depth == 0:
            return i
        elif c == "=" and depth == 0:
            raise HostBuildError(
                f"{file_label}:{_line_of(masked, start)}: {label} has an initializer; NVRTC rejects initialised "
                "__shared__ variables, so the host backend does too"
            )
    raise HostBuildError(f"{file_label}:{_line_of(masked, start)}: cannot parse the {label} declaration")


def _declared_names(decl: str) -> list[tuple[str, int]]:
    """Names declared by `T a[N], *b, c` (the text between `__shared__` and `;`), each with its offset."""
    decl = _ALIGN_RE.sub(lambda m: " " * len(m.group(0)), decl)
    parts: list[tuple[int, int]] = []
    depth = 0
    start = 0
    for i, c in enumerate(decl):
        if c in "([{<":
            depth += 1
        elif c in ")]}>":
            depth -= 1
        if c == "," and depth == 0:
            parts.append((start, i))
            start = i + 1
    parts.append((start, len(decl)))
    names = []
    for lo, hi in parts:
        head = decl[lo:hi].split("[", 1)[0]
        idents = [m for m in _IDENT_RE.finditer(head) if m.group(0) not in _CXX_WORDS]
        if not idents:
            raise ValueError(decl[lo:hi])
        names.append((idents[-1].group(0), lo + idents[-1].start()))
    return names


def _rewrite_shared(text: str, masked: str, file_label: str, heap: bool = False) -> str:
    """Applies the host meaning of `__shared__` (see kvc_host_cuda.h) without moving any line.

    ``heap`` (AddressSanitizer builds): each variable's thread_local storage is renamed and the variable
    becomes a thread_local reference to a heap copy, because ASan puts redzones around heap blocks but not
    around thread_local variables, and an overflow of `__shared__` must still be reported.
    """
    edits: list[tuple[int, int, str]] = []
    dynamic_spans: list[tuple[int, int]] = []
    for m in _DYNAMIC_SHARED_RE.finditer(masked):
        ctype = _ALIGN_RE.sub(" ", m.group(1)).strip()
        if not ctype:
            raise HostBuildError(f"{file_label}:{_line_of(masked, m.start())}: cannot parse extern __shared__")
        name = m.group(2)
        newlines = "\n" * m.group(0).count("\n")
        edits.append(
            (
                m.start(),
                m.end(),
                f"thread_local {ctype}* const {name} __attribute__((unused)) = "
                f"reinterpret_cast<{ctype}*>(kvc_host_dynamic_smem);{newlines}",
            )
        )
        dynamic_spans.append((m.start(), m.end()))
    for m in _STATIC_SHARED_RE.finditer(masked):
        gap = m.group(1) if m.group(1) is not None else m.group(2)
        edits.append((m.start(), m.end(), "\n" * gap.count("\n") + (" " if m.group(1) is not None else "")))
    for m in _SHARED_RE.finditer(masked):
        if any(a <= m.start() < b for a, b in dynamic_spans):
            continue
        end = _declaration_end(masked, m.end(), "__shared__ variable", file_label)
        line_start = masked.rfind("\n", 0, m.start()) + 1
        if masked[line_start:m.start()].lstrip().startswith("#") and "\n" in masked[m.end():end]:
            raise HostBuildError(
                f"{file_label}:{_line_of(masked, m.start())}: a __shared__ declaration in a macro must end on "
                "the #define line"
            )
        decl = re.sub(r"^\s*static\b", lambda s: " " * len(s.group(0)), masked[m.end():end])
        try:
            names = _declared_names(decl)
        except ValueError:
            raise HostBuildError(
                f"{file_label}:{_line_of(masked, m.start())}: cannot find the name declared by __shared__"
            ) from None
        if heap:
            for n, offset in names:
                at = m.end() + offset
                edits.append((at, at + len(n), f"kvc_host_shared_storage_{n}"))
            edits.append((end + 1, end + 1, "".join(f" KVC_HOST_HEAP_SHARED({n})" for n, _ in names)))
        else:
            edits.append((end + 1, end + 1, "".join(f" KVC_HOST_TRACK_SHARED({n})" for n, _ in names)))
    out = text
    for start, stop, replacement in sorted(edits, key=lambda e: (e[0], e[1]), reverse=True):
        out = out[:start] + replacement + out[stop:]
    return out


def _included_headers(code: str, include_dirs: Sequence[Path]) -> dict[str, tuple[str | None, str]]:
    """Every quoted include reachable from `code`: resolved path -> (path as seen from the build dir, text).

    Resolution follows the compiler: the including file's own directory first (for `code` itself, the
    build directory, which holds nothing else), then `include_dirs` in order.
    """
    found: dict[str, tuple[str | None, str]] = {}

    def visit(text: str, own_dir: Path | None, own_vdir: str | None) -> None:
        for m in _INCLUDE_RE.finditer(_mask_comments(text)):
            name = m.group(1)
            candidates: list[tuple[Path, str | None]] = []
            if own_dir is not None:
                candidates.append((own_dir, own_vdir))
            candidates += [(d, "") for d in include_dirs]
            for base, vbase in candidates:
                path = (base / name).resolve()
                if not path.is_file():
                    continue
                vpath = None if vbase is None else posixpath.normpath(posixpath.join(vbase, name))
                if vpath is not None and (vpath.startswith("..") or posixpath.isabs(vpath)):
                    vpath = None  # outside the mirrored tree: compiled from its original place
                key = str(path)
                if key not in found:
                    content = path.read_text(encoding="utf-8", errors="replace")
                    found[key] = (vpath, content)
                    visit(content, path.parent, None if vpath is None else posixpath.dirname(vpath))
                break

    visit(code, None, "")
    return found


# ---- building ---------------------------------------------------------------------------------------------


def _runtime_sources() -> dict[str, str]:
    return {name: (_HERE / name).read_text(encoding="utf-8") for name in _RUNTIME_FILES}


def _digest(*parts: str) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(len(part.encode()).to_bytes(8, "little"))
        h.update(part.encode())
    return h.hexdigest()


def _run_compiler(cmd: list[str], what: str) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_compiler_env(), check=False)
    if proc.returncode != 0:
        log = (proc.stderr + proc.stdout).strip()
        raise HostBuildError(f"{what} failed (exit {proc.returncode}):\n{log}\n\ncommand: {' '.join(cmd)}")


def _build_atomically(target: Path, build: Any) -> None:
    """Runs build(tmpdir) -> file and renames the file onto target, so concurrent builders never collide."""
    tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=target.parent))
    try:
        produced = build(tmp)
        os.replace(produced, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


_build_lock = threading.Lock()
_loaded: dict[str, ctypes.CDLL] = {}


def _runtime_object(cxx: str, version: str, flags: tuple[str, ...], sources: dict[str, str]) -> Path:
    key = _digest(_CACHE_FORMAT, "runtime", version, *flags, *(f"{k}\n{v}" for k, v in sorted(sources.items())))
    target = host_module_dir() / f"kvc-host-runtime-{key[:32]}.o"
    if not target.exists():

        def build(tmp: Path) -> Path:
            out = tmp / "runtime.o"
            _run_compiler(
                [cxx, *flags, "-c", str(_HERE / "kvc_host_runtime.cpp"), "-o", str(out)],
                "compiling the host runtime",
            )
            return out

        _build_atomically(target, build)
    touch(target)
    return target


_pools: dict[str, tuple[ctypes.CDLL, int]] = {}


def _pool_library(cxx: str, version: str, flags: tuple[str, ...]) -> Path:
    """The shared worker pool (kvc_host_pool.cpp) for modules built with ``flags``: built once per flavour
    into the module cache."""
    sources = {name: (_HERE / name).read_text(encoding="utf-8") for name in _POOL_FILES}
    key = _digest(_CACHE_FORMAT, "pool", version, *flags, *(f"{k}\n{v}" for k, v in sorted(sources.items())))
    target = host_module_dir() / f"kvc-host-pool-{key[:32]}.so"
    if not target.exists():

        def build(tmp: Path) -> Path:
            out = tmp / "pool.so"
            _run_compiler([cxx, *flags, "-shared", "-Wl,-z,defs", f"-I{_HERE}", str(_HERE / "kvc_host_pool.cpp"),
                           "-o", str(out), "-lpthread"], "compiling the host worker pool")
            return out

        _build_atomically(target, build)
    touch(target)
    return target


def _open_library(path: Path, what: str) -> ctypes.CDLL:
    try:
        return ctypes.CDLL(str(path), mode=os.RTLD_NOW | os.RTLD_LOCAL)
    except OSError as exc:
        raise HostBuildError(f"cannot load {what} {path}: {exc}") from exc


def _pool_table(path: Path) -> int:
    """Loads the pool library at ``path`` once per process; the address of its function table."""
    with _build_lock:
        loaded = _pools.get(str(path))
        if loaded is None:
            lib = _open_library(path, "the host worker pool")
            lib.kvc_host_pool_api_get.restype = ctypes.c_void_p
            lib.kvc_host_pool_api_get.argtypes = []
            loaded = _pools[str(path)] = (lib, lib.kvc_host_pool_api_get())
        return loaded[1]


def _check_options(options: Sequence[str]) -> list[str]:
    kept = []
    for opt in options:
        if not isinstance(opt, str):
            raise TypeError(f"compiler options must be strings, got {opt!r}")
        if opt in _IGNORED_OPTIONS:
            continue
        if not (opt.startswith(("-D", "-U")) and len(opt) > 2):
            raise ValueError(f"unsupported host compiler option {opt!r}: only -D/-U (and --std=c++17) are accepted")
        kept.append(opt)
    return kept


# ---- modules and kernels ----------------------------------------------------------------------------------


class HostModule:
    """Host counterpart of ``cupy.RawModule``: compiles CUDA C++ with g++ and loads it with ctypes.

    Entry points are the ``extern "C" __global__ void NAME(...)`` functions of ``code``. ``options`` takes
    ``-D``/``-U`` flags; ``include_dirs`` resolves ``#include "x.cuh"``. With ``sanitize=True`` (or
    ``"address"``) the module and its runtime are built with AddressSanitizer and UBSan, and loading needs
    libasan preloaded; ``sanitize="thread"`` builds with ThreadSanitizer and needs libtsan preloaded.
    ``threads`` is how many OS threads this module's launches may use (None: :func:`host_threads` at each
    launch); a launch's own ``threads=`` wins.
    """

    def __init__(
        self,
        code: str,
        *,
        options: Sequence[str] = (),
        include_dirs: Sequence[str | os.PathLike[str]] = (),
        sanitize: bool | str = False,
        name: str = "module",
        threads: int | None = None,
    ) -> None:
        if not isinstance(code, str):
            raise TypeError("code must be a str of CUDA C++ source")
        if isinstance(options, str):
            raise TypeError("options must be a sequence of strings, not a single string")
        self.name = name
        #: "address" (ASan + UBSan), "thread" (TSan) or None.
        self.sanitizer = _sanitizer_name(sanitize)
        self.sanitize = self.sanitizer is not None
        self.threads = None if threads is None else _threads_value(threads, "threads")
        stem = re.sub(r"[^A-Za-z0-9_.-]", "_", name) or "module"
        if stem.endswith(".cu"):
            stem = stem[:-3]
        file_label = f"{stem}.cu"
        extra = _check_options(options)
        dirs = [Path(d).resolve() for d in include_dirs]

        masked = _mask_comments(code)
        kernels = _find_kernels(masked)
        if not kernels:
            raise HostBuildError(f'{file_label}: no `extern "C" __global__ void NAME(` entry point found')
        heap_shared = self.sanitizer == "address"
        kernel_text = f'#line 1 "{file_label}"\n' + _rewrite_shared(code, masked, file_label, heap_shared) + "\n"
        unit = "".join(
            [
                "// Generated host translation unit.\n",
                '#include "kvc_host_cuda.h"\n',
                f'#include "{file_label}"\n',
                '#include "kvc_host_register.h"\n',
                "KVC_HOST_BEGIN_KERNELS\n",
                *(f"KVC_HOST_KERNEL({k})\n" for k in kernels),
                "KVC_HOST_END_KERNELS\n",
            ]
        )
        headers = _included_headers(code, dirs)

        _check_host_settings()
        cxx = _require_compiler()
        version = _compiler_version(cxx)
        flags = _BASE_FLAGS + {None: (), "address": _SANITIZE_FLAGS, "thread": _TSAN_FLAGS}[self.sanitizer]
        runtime_flags = flags + tuple(o for o in extra if o[2:].startswith("KVC_HOST_"))
        sources = _runtime_sources()
        key = _digest(
            _CACHE_FORMAT,
            "module",
            version,
            *flags,
            *extra,
            *(str(d) for d in dirs),
            *(f"{k}\n{v}" for k, v in sorted(sources.items())),
            *(f"{k}\n{v[0]}\n{v[1]}" for k, v in sorted(headers.items())),
            *runtime_flags,
            kernel_text,
            unit,
        )
        flavour = "" if self.sanitizer is None else f"-{self.sanitizer[0]}san"  # -asan / -tsan
        target = host_module_dir() / f"{stem}-{key[:32]}{flavour}.so"
        self.library_path = target
        self.from_cache = target.exists()
        pool = _pool_library(cxx, version, flags)
        if self.from_cache:
            touch(target)
            log.debug("host module %r: cached build %s", name, target)
        else:
            log.info("compiling host module %r with %s%s", name, cxx,
                     f" ({self.sanitizer} sanitizer)" if self.sanitize else "")
            started = time.perf_counter()
            runtime = _runtime_object(cxx, version, runtime_flags, sources)

            def build(tmp: Path) -> Path:
                (tmp / file_label).write_text(kernel_text, encoding="utf-8")
                # Headers get the same __shared__ rewriting: their copies in the build directory are found
                # before the originals, and #line keeps diagnostics (and __FILE__) on the original files.
                for path, (vpath, content) in headers.items():
                    if vpath is None:
                        continue
                    copy = tmp / vpath
                    copy.parent.mkdir(parents=True, exist_ok=True)
                    rewritten = _rewrite_shared(content, _mask_comments(content), path, heap_shared)
                    quoted = path.replace("\\", "\\\\").replace('"', '\\"')
                    copy.write_text(f'#line 1 "{quoted}"\n{rewritten}\n', encoding="utf-8")
                (tmp / "unit.cpp").write_text(unit, encoding="utf-8")
                out = tmp / "module.so"
                cmd = [
                    cxx,
                    *flags,
                    *extra,
                    "-shared",
                    "-Wl,-z,defs",
                    f"-I{_HERE}",
                    *(f"-I{d}" for d in dirs),
                    str(tmp / "unit.cpp"),
                    str(runtime),
                    "-o",
                    str(out),
                ]
                _run_compiler(cmd, f"compiling host module {name!r}")
                return out

            _build_atomically(target, build)
            log.info("compiled host module %r in %.2f s: %s", name, time.perf_counter() - started, target)
            prune(target.parent, keep=(target, runtime, pool))

        if self.sanitizer == "address" and not _sanitizer_runtime_loaded("address"):
            raise HostBuildError(
                f"host module {name!r} was built with sanitize=True; AddressSanitizer must be loaded first. Run "
                "the process as: LD_PRELOAD=$(g++ -print-file-name=libasan.so) ASAN_OPTIONS=detect_leaks=0 "
                "python ... (kvcanary_cupy.hostcuda.sanitizer_preload() gives the path)"
            )
        if self.sanitizer == "thread" and not _sanitizer_runtime_loaded("thread"):
            raise HostBuildError(
                f"host module {name!r} was built with sanitize='thread'; ThreadSanitizer must be loaded first. "
                "Run the process as: LD_PRELOAD=$(g++ -print-file-name=libtsan.so) python ... "
                "(kvcanary_cupy.hostcuda.sanitizer_preload('thread') gives the path)"
            )
        self._lib = _load_library(target)
        if self._lib.kvc_host_abi_attach_pool(_pool_table(pool)) != 0:
            raise HostBuildError(f"host module {name!r}: its runtime does not match the worker pool's interface")
        count = self._lib.kvc_host_abi_kernel_count()
        self.kernel_names = tuple(self._lib.kvc_host_abi_kernel_name(i).decode() for i in range(count))
        self._kernels: dict[str, HostKernel] = {}

    def get_function(self, name: str) -> HostKernel:
        """The kernel called `name` (ValueError if the module has none)."""
        if name not in self._kernels:
            if name not in self.kernel_names:
                raise ValueError(
                    f"host module {self.name!r} has no kernel {name!r}; kernels: {', '.join(self.kernel_names)}"
                )
            self._kernels[name] = HostKernel(self, self.kernel_names.index(name), name)
        return self._kernels[name]

    def runtime_stats(self) -> dict[str, int]:
        """Counters of this module's runtime, over every OS thread that ran its blocks: context switches, fiber
        starts, blocks, launches, fiber stacks mapped, pool workers started, blocks run by pool workers."""
        names = ("switches", "fiber_starts", "blocks", "launches", "stacks", "workers", "worker_blocks")
        out = (ctypes.c_ulonglong * len(names))()
        self._lib.kvc_host_abi_stats(out)
        return dict(zip(names, out, strict=True))

    def __repr__(self) -> str:
        return f"<HostModule {self.name!r} kernels={list(self.kernel_names)} sanitizer={self.sanitizer}>"


def _load_library(path: Path) -> ctypes.CDLL:
    with _build_lock:
        lib = _loaded.get(str(path))
        if lib is None:
            lib = _open_library(path, "host module")
            lib.kvc_host_abi_kernel_count.restype = ctypes.c_int
            lib.kvc_host_abi_kernel_name.restype = ctypes.c_char_p
            lib.kvc_host_abi_kernel_name.argtypes = [ctypes.c_int]
            lib.kvc_host_abi_kernel_params.restype = ctypes.c_int
            lib.kvc_host_abi_kernel_params.argtypes = [
                ctypes.c_int,
                ctypes.POINTER(ctypes.c_int),
                ctypes.POINTER(ctypes.c_int),
                ctypes.c_int,
            ]
            lib.kvc_host_abi_launch.restype = ctypes.c_int
            lib.kvc_host_abi_launch.argtypes = [
                ctypes.c_int,
                ctypes.POINTER(ctypes.c_uint),
                ctypes.POINTER(ctypes.c_uint),
                ctypes.c_ulonglong,
                ctypes.POINTER(ctypes.c_void_p),
                ctypes.c_int,
                ctypes.c_char_p,
                ctypes.c_ulonglong,
            ]
            lib.kvc_host_abi_attach_pool.restype = ctypes.c_int
            lib.kvc_host_abi_attach_pool.argtypes = [ctypes.c_void_p]
            lib.kvc_host_abi_stats.restype = None
            lib.kvc_host_abi_stats.argtypes = [ctypes.POINTER(ctypes.c_ulonglong)]
            _loaded[str(path)] = lib
        return lib


def _dims(value: Any, what: str) -> tuple[int, int, int]:
    if isinstance(value, tuple | list):
        if not 1 <= len(value) <= 3:
            raise ValueError(f"{what} must have 1 to 3 dimensions, got {value!r}")
        dims = [operator.index(v) for v in value]
    else:
        dims = [operator.index(value)]
    dims += [1] * (3 - len(dims))
    for d in dims:
        if not 0 <= d < 2**32:
            raise ValueError(f"{what} dimension out of range: {value!r}")
    return dims[0], dims[1], dims[2]


_KIND_NAMES = {_PARAM_INTEGER: "integer", _PARAM_FLOAT: "floating-point", _PARAM_OTHER: "struct"}


class _ArgumentBlock:
    """One OS thread's launch buffers for one kernel: the argv table and value slots, grid, block, error."""

    def __init__(self, size: int, offsets: Sequence[int], count: int) -> None:
        self.buffer = ctypes.create_string_buffer(size + 16)
        base = ctypes.addressof(self.buffer)
        self.shift = (-base) % 16
        self.table_bytes = (8 * max(count, 1) + 15) // 16 * 16
        start = base + self.shift
        table = (ctypes.c_void_p * max(count, 1)).from_address(start)
        for i, offset in enumerate(offsets):
            table[i] = start + offset
        self.argv = ctypes.cast(start, ctypes.POINTER(ctypes.c_void_p))
        self.grid = (ctypes.c_uint * 3)()
        self.block = (ctypes.c_uint * 3)()
        self.error = ctypes.create_string_buffer(_ERROR_BUFFER)


class HostKernel:
    """Host counterpart of ``cupy.RawKernel``: ``kern(grid, block, args, shared_mem=0)``.

    ``args`` holds, per parameter, a ``numpy.ndarray`` or None for pointer parameters (the array's data
    pointer is passed) and a NumPy scalar of exactly the parameter's size for value parameters.
    """

    def __init__(self, module: HostModule, index: int, name: str) -> None:
        self.module = module
        self.name = name
        self._index = index
        lib = module._lib
        count = lib.kvc_host_abi_kernel_params(index, None, None, 0)
        sizes = (ctypes.c_int * max(count, 1))()
        kinds = (ctypes.c_int * max(count, 1))()
        lib.kvc_host_abi_kernel_params(index, sizes, kinds, count)
        self.num_params = count
        self.param_sizes = tuple(sizes[i] for i in range(count))
        self._kinds = tuple(kinds[i] for i in range(count))
        self.param_is_pointer = tuple(k == _PARAM_POINTER for k in self._kinds)
        self._max_dynamic_smem = _DEFAULT_MAX_DYNAMIC_SMEM
        # The argument block: the argv table (one address per parameter), then a 16-byte aligned slot per
        # parameter (kernels may take 16-aligned structs). One block per calling OS thread, reused: the
        # table never changes, a launch packs only the values (one struct.pack_into).
        offset = (8 * max(count, 1) + 15) // 16 * 16
        self._offsets: list[int] = []
        for size in self.param_sizes:
            self._offsets.append(offset)
            offset += max(16, (size + 15) // 16 * 16)
        self._block_bytes = offset
        self._values_format = struct.Struct(self._format())
        self._per_thread = threading.local()

    def _format(self) -> str:
        parts = ["<"]
        at = (8 * max(self.num_params, 1) + 15) // 16 * 16
        for offset, size, kind in zip(self._offsets, self.param_sizes, self._kinds, strict=True):
            if offset > at:
                parts.append(f"{offset - at}x")
            parts.append("Q" if kind == _PARAM_POINTER else f"{size}s")
            at = offset + (8 if kind == _PARAM_POINTER else size)
        return "".join(parts)

    def _thread_block(self) -> _ArgumentBlock:
        block: _ArgumentBlock | None = getattr(self._per_thread, "block", None)
        if block is None:
            block = _ArgumentBlock(self._block_bytes, self._offsets, self.num_params)
            self._per_thread.block = block
        return block

    def __repr__(self) -> str:
        return f"<HostKernel {self.name!r} params={self.num_params}>"

    @property
    def max_dynamic_shared_size_bytes(self) -> int:
        """Mirrors ``cupy.RawKernel.max_dynamic_shared_size_bytes``: launches asking for more dynamic shared
        memory fail, as they do on the GPU until the attribute is raised (48 KiB by default)."""
        return self._max_dynamic_smem

    @max_dynamic_shared_size_bytes.setter
    def max_dynamic_shared_size_bytes(self, value: int) -> None:
        value = operator.index(value)
        if not 0 <= value <= _MAX_DYNAMIC_SMEM:
            raise ValueError(f"max_dynamic_shared_size_bytes must be within [0, {_MAX_DYNAMIC_SMEM}], got {value}")
        self._max_dynamic_smem = value

    def _thread_count(self, threads: int | None) -> int:
        """OS threads for one launch: ``threads``, else the module's ``threads``, else :func:`host_threads`."""
        if threads is not None:
            return _threads_value(threads, "threads")
        if self.module.threads is not None:
            return self.module.threads
        return host_threads()

    def _marshal(self, args: Sequence[Any], block: _ArgumentBlock | None = None) -> _ArgumentBlock:
        """Checks ``args`` and packs them into ``block`` (None: this thread's argument block), which it
        returns."""
        if not isinstance(args, tuple | list):
            raise TypeError(f"kernel {self.name!r}: args must be a tuple, got {type(args).__name__}")
        if len(args) != self.num_params:
            raise TypeError(f"kernel {self.name!r} takes {self.num_params} arguments, {len(args)} given")
        values: list[Any] = []
        for i, arg in enumerate(args):
            size = self.param_sizes[i]
            kind = self._kinds[i]
            if kind == _PARAM_POINTER:
                if arg is None:
                    values.append(0)
                elif isinstance(arg, np.ndarray):
                    values.append(arg.ctypes.data)
                else:
                    raise TypeError(f"kernel {self.name!r} argument {i} is a pointer parameter: pass a "
                                    f"numpy.ndarray or None, not {type(arg).__name__}")
                continue
            where = f"kernel {self.name!r} argument {i}"
            if isinstance(arg, np.ndarray):
                raise TypeError(f"{where} is a {size}-byte value parameter: pass a NumPy scalar, not an array")
            if not isinstance(arg, np.generic):
                raise TypeError(
                    f"{where} is a {size}-byte {_KIND_NAMES[kind]} value parameter: pass a NumPy scalar of "
                    f"that width (e.g. np.int64(...) / np.float32(...)), not a bare {type(arg).__name__}"
                )
            if arg.itemsize != size:
                raise TypeError(f"{where}: the parameter is {size} bytes but {arg.dtype} is {arg.itemsize} bytes")
            np_kind = arg.dtype.kind
            if (kind == _PARAM_INTEGER and np_kind not in "biu") or (kind == _PARAM_FLOAT and np_kind != "f"):
                raise TypeError(f"{where} is a {_KIND_NAMES[kind]} parameter, got {arg.dtype}")
            values.append(arg.tobytes())
        if block is None:
            block = self._thread_block()
        self._values_format.pack_into(block.buffer, block.shift + block.table_bytes, *values)
        return block

    def __call__(
        self,
        grid: int | tuple[int, ...],
        block: int | tuple[int, ...],
        args: tuple[Any, ...],
        *,
        shared_mem: int = 0,
        stream: object = None,
        threads: int | None = None,
    ) -> None:
        """Runs the kernel to completion on up to ``threads`` OS threads (None: the module's ``threads``, else
        :func:`host_threads`). ``stream`` is accepted for CuPy compatibility and ignored."""
        del stream
        nthreads = _capped(self._thread_count(threads))
        grid3 = _dims(grid, "grid")
        block3 = _dims(block, "block")
        shared = operator.index(shared_mem)
        if shared < 0:
            raise ValueError(f"shared_mem must be >= 0, got {shared}")
        if shared > self.max_dynamic_shared_size_bytes:
            raise HostLaunchError(
                f"kernel {self.name!r}: {shared} bytes of dynamic shared memory exceed "
                f"max_dynamic_shared_size_bytes={self.max_dynamic_shared_size_bytes} (raise it as on CuPy, up to "
                f"{_MAX_DYNAMIC_SMEM})"
            )
        packed = self._marshal(args)
        packed.grid[0], packed.grid[1], packed.grid[2] = grid3
        packed.block[0], packed.block[1], packed.block[2] = block3
        rc = self.module._lib.kvc_host_abi_launch(
            self._index, packed.grid, packed.block, shared, packed.argv, nthreads, packed.error, _ERROR_BUFFER
        )
        if rc != 0:
            raise HostLaunchError(packed.error.value.decode(errors="replace"))

    def prepared(self, grid: int | tuple[int, ...], block: int | tuple[int, ...], args: tuple[Any, ...], *,
                 shared_mem: int = 0, threads: int | None = None,
                 threads_of: Callable[[], int] | None = None) -> Callable[[], None]:
        """A launch of fixed shape and arguments, marshalled once: calling it runs the kernel to completion
        like ``kern(grid, block, args)``, without re-packing the argument block (for launches bound once and
        called every step; the arrays in ``args`` are kept alive and read afresh by every call). The thread
        count is resolved at each call, as for ``kern(...)``; ``threads_of``, when given, is asked for it at
        each call instead (e.g. by the work the call really has). A one-block launch runs on one thread."""
        if operator.index(shared_mem) != 0:
            raise ValueError("prepared launches take no dynamic shared memory")
        packed = self._marshal(args, _ArgumentBlock(self._block_bytes, self._offsets, self.num_params))
        grid3 = _dims(grid, "grid")
        packed.grid[0], packed.grid[1], packed.grid[2] = grid3
        packed.block[0], packed.block[1], packed.block[2] = _dims(block, "block")
        launch, index, held = self.module._lib.kvc_host_abi_launch, self._index, tuple(args)
        fixed = None if threads is None else _threads_value(threads, "threads")  # checked once, not per call
        if grid3[0] * grid3[1] * grid3[2] == 1:
            fixed, threads_of = 1, None  # no block for a helper thread: no per-call look-up either

        def run() -> None:
            if threads_of is not None:
                nthreads = threads_of()
            else:
                nthreads = fixed if fixed is not None else self._thread_count(None)
            nthreads = _capped(nthreads)
            if launch(index, packed.grid, packed.block, 0, packed.argv, nthreads, packed.error, _ERROR_BUFFER) != 0:
                raise HostLaunchError(packed.error.value.decode(errors="replace"))

        run.held = held  # type: ignore[attr-defined]  # the arrays the packed pointers name stay alive
        return run
