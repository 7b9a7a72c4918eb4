"""The on-disk cache this package writes (compiled host modules): where it lives, its size, pruning, clearing.

The root is ``$KVCANARY_CACHE_DIR`` when set, else ``$XDG_CACHE_HOME/kvcanary_cupy``, else
``~/.cache/kvcanary_cupy``. Host modules (``hostcuda/``) are pruned after every new build: the least recently
used files go first until the folder is under ``$KVCANARY_CACHE_MAX_MB`` (default 512 MiB); a file used in the
last ten minutes is never removed, so a process that has just found its module keeps it. The CUDA backend's
NVRTC builds live in CuPy's own kernel cache (``$CUPY_CACHE_DIR``, default ``~/.cupy/kernel_cache``), shared
with every other CuPy user: reported here, never pruned or cleared.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from . import settings

log = logging.getLogger(__name__)

DEFAULT_MAX_MB = 512
_RECENT_S = 600.0


def cache_root() -> Path:
    root = settings.read("KVCANARY_CACHE_DIR")
    if root:
        return Path(root)
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg and Path(xdg).is_absolute() else Path.home() / ".cache"  # XDG: relative = unset
    return base / "kvcanary_cupy"


def host_module_dir(create: bool = True) -> Path:
    path = cache_root() / "hostcuda"
    if create:
        path.mkdir(parents=True, exist_ok=True)
    return path


def cupy_kernel_cache_dir() -> Path:
    return Path(os.environ.get("CUPY_CACHE_DIR") or Path.home() / ".cupy" / "kernel_cache")


def max_bytes() -> int:
    """The cache's size cap in bytes: ``$KVCANARY_CACHE_MAX_MB`` MiB (any other value than a number from 0 to
    1048576 is refused, never replaced by the default), else 512 MiB."""
    mb = settings.read("KVCANARY_CACHE_MAX_MB")
    return int((DEFAULT_MAX_MB if mb is None else mb) * 1024 * 1024)


@dataclass(frozen=True)
class FolderUsage:
    path: Path
    files: int
    bytes: int


def usage(path: Path) -> FolderUsage:
    """Files and bytes under ``path`` (zero when it does not exist)."""
    files = total = 0
    if path.is_dir():
        for entry in path.rglob("*"):
            try:
                if entry.is_file() and not entry.is_symlink():
                    files += 1
                    total += entry.stat().st_size
            except OSError:  # removed meanwhile by a concurrent prune
                continue
    return FolderUsage(path, files, total)


def touch(path: Path) -> None:
    """Mark a cached file as just used (its mtime orders the pruning)."""
    try:
        os.utime(path)
    except OSError:
        pass


def prune(folder: Path, limit: int | None = None, *, keep: tuple[Path, ...] = ()) -> int:
    """Remove the least recently used files of ``folder`` until it holds at most ``limit`` bytes (default
    :func:`max_bytes`); files in ``keep`` and files used in the last ten minutes stay. Returns bytes freed."""
    limit = max_bytes() if limit is None else limit
    entries = []
    for entry in folder.glob("*"):
        try:
            st = entry.stat()
        except OSError:
            continue
        if entry.is_file() and not entry.name.startswith("."):
            entries.append((st.st_mtime, st.st_size, entry))
    total = sum(size for _, size, _ in entries)
    freed = 0
    now = time.time()
    kept = {k.resolve() for k in keep}
    for mtime, size, entry in sorted(entries, key=lambda e: e[0]):
        if total - freed <= limit:
            break
        if entry.resolve() in kept or now - mtime < _RECENT_S:
            continue
        try:
            entry.unlink()
        except OSError:
            continue
        freed += size
        log.debug("pruned %s (%d bytes) from the host module cache", entry.name, size)
    if freed:
        log.info("host module cache %s: pruned %d bytes to stay under %d", folder, freed, limit)
    return freed


def clear() -> FolderUsage:
    """Delete the host module cache; returns what it held."""
    folder = host_module_dir(create=False)
    held = usage(folder)
    if folder.is_dir():
        shutil.rmtree(folder)
    log.info("cleared the host module cache %s (%d files, %d bytes)", folder, held.files, held.bytes)
    return held
