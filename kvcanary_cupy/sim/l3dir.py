"""The L3 tier's directory as a boundary (``kvcanary simulate --tiers host,disk --tier-dir DIR``): every file the
disk tier touches is one it created itself, inside that directory, by name relative to one descriptor of it.

* **nothing outside is written or followed** — files are created with ``O_CREAT | O_EXCL | O_NOFOLLOW`` relative
  to the directory's descriptor (a name already there, a symlink included, is never opened: the next free name
  is taken), opened again with ``O_NOFOLLOW``, and named ``<hex key>[.<n>].kv`` (no separator, no ``..``). Only
  files this run created are ever rewritten or removed.
* **checked at start** (:func:`open_tier_dir`) — the directory is created if needed, a probe file is created
  and removed (a read-only file system or a directory without write permission, root's included, is refused
  there) and the free space must hold the tier's cap: a ``CanaryArgumentError`` naming ``--tier-dir``.
* **failures mid-run** — a full disk, a removed directory, a file replaced or removed by someone else: a
  :class:`TierStorageError` with the file, the operation and the system's reason (the CLI reports it and exits
  with status 1); a partly written file is removed first.
"""

from __future__ import annotations

import os
import re
import secrets

from .._errors import fail

_OPEN_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
_OPEN_EXISTING = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
_KEY = re.compile(r"[0-9a-f]{1,64}")
MAX_NAME_TRIES = 64  # names taken by files this run did not create before a page's file is refused


class TierStorageError(RuntimeError):
    """The L3 directory failed during a run (full disk, directory removed, a file tampered with); the run stops
    and reports it."""


def _reason(exc: OSError) -> str:
    return exc.strerror or type(exc).__name__


class TierDir:
    """An open L3 directory (see the module docstring): create, read, damage (fault injection) and remove the
    files of the run, by name relative to one directory descriptor."""

    def __init__(self, path: str, fd: int) -> None:
        self.path = path
        self._fd = fd
        self.created: set[str] = set()  # names of the files this run created and has not removed

    def _fail(self, what: str, name: str, exc: OSError) -> TierStorageError:
        return TierStorageError(f"--tier-dir {self.path}: cannot {what} the L3 file {name}: {_reason(exc)}")

    def create(self, key: str, data: bytes) -> str:
        """Write ``data`` to a new file named after ``key`` (exclusively: a name already taken, by a file or a
        symlink this run did not create, is skipped) and return its name."""
        if not _KEY.fullmatch(key):
            raise ValueError(f"an L3 key is lowercase hex, got {key!r}")
        for n in range(MAX_NAME_TRIES):
            name = f"{key}.kv" if n == 0 else f"{key}.{n}.kv"
            try:
                fd = os.open(name, _OPEN_NEW, 0o600, dir_fd=self._fd)
            except FileExistsError:
                continue
            except OSError as exc:
                raise self._fail("create", name, exc) from None
            self.created.add(name)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
            except OSError as exc:
                os.close(fd)
                self.remove(name, missing_ok=True)
                raise self._fail("write", name, exc) from None
            os.close(fd)
            return name
        raise TierStorageError(f"--tier-dir {self.path}: {MAX_NAME_TRIES} names for the L3 file of {key} are "
                               "taken by files this run did not create")

    def _open(self, name: str, flags: int, what: str) -> int:
        if name not in self.created:
            raise ValueError(f"{name!r} is not a file this run created")
        try:
            return os.open(name, flags | _OPEN_EXISTING, dir_fd=self._fd)
        except OSError as exc:
            raise self._fail(what, name, exc) from None

    def read(self, name: str) -> bytes:
        fd = self._open(name, os.O_RDONLY, "read")
        try:
            chunks = []
            while chunk := os.read(fd, 1 << 20):
                chunks.append(chunk)
            return b"".join(chunks)
        except OSError as exc:
            raise self._fail("read", name, exc) from None
        finally:
            os.close(fd)

    def size(self, name: str) -> int:
        fd = self._open(name, os.O_RDONLY, "stat")
        try:
            return os.fstat(fd).st_size
        finally:
            os.close(fd)

    def flip_bit(self, name: str, at: int, bit: int) -> None:
        """Flip bit ``bit`` of byte ``at`` of the file (the disk bit-rot fault)."""
        fd = self._open(name, os.O_RDWR, "damage")
        try:
            byte = os.pread(fd, 1, at)
            os.pwrite(fd, bytes([byte[0] ^ (1 << bit)]), at)
        except OSError as exc:
            raise self._fail("damage", name, exc) from None
        finally:
            os.close(fd)

    def truncate(self, name: str, size: int) -> None:
        """Cut the file to ``size`` bytes (the torn-write fault)."""
        fd = self._open(name, os.O_RDWR, "truncate")
        try:
            os.ftruncate(fd, size)
        except OSError as exc:
            raise self._fail("truncate", name, exc) from None
        finally:
            os.close(fd)

    def remove(self, name: str, *, missing_ok: bool = False) -> None:
        """Remove a file this run created (the name itself: a symlink put in its place is removed, never
        followed)."""
        if name not in self.created:
            raise ValueError(f"{name!r} is not a file this run created")
        try:
            os.unlink(name, dir_fd=self._fd)
        except FileNotFoundError as exc:
            if not missing_ok:
                raise self._fail("remove", name, exc) from None
        except OSError as exc:
            raise self._fail("remove", name, exc) from None
        self.created.discard(name)

    def close(self) -> None:
        """Remove every file this run created that is still there (whatever happened to the directory), and
        close the descriptor. Never raises."""
        for name in sorted(self.created):
            try:
                os.unlink(name, dir_fd=self._fd)
            except OSError:
                pass
        self.created.clear()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def open_tier_dir(path: str, need_bytes: int) -> TierDir:
    """Create ``path`` if needed and open it as the L3 directory, after checking that files can be created in it
    and that its file system has ``need_bytes`` free; refused with a ``CanaryArgumentError`` naming
    ``--tier-dir`` (nothing left behind but a directory it created)."""
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        fail(f"--tier-dir {path}: cannot create the directory: {_reason(exc)}")
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        fail(f"--tier-dir {path}: cannot open the directory: {_reason(exc)}")
    try:
        probe = f".kvcanary-probe-{secrets.token_hex(8)}"
        try:
            os.close(os.open(probe, _OPEN_NEW, 0o600, dir_fd=fd))
        except OSError as exc:
            fail(f"--tier-dir {path}: cannot create files in it: {_reason(exc)}")
        try:
            os.unlink(probe, dir_fd=fd)
        except OSError as exc:
            fail(f"--tier-dir {path}: cannot remove files from it: {_reason(exc)}")
        st = os.fstatvfs(fd)
        free = st.f_bavail * st.f_frsize
        if free < need_bytes:
            fail(f"--tier-dir {path}: {free} bytes free; the disk tier needs {need_bytes} (its cap)")
    except BaseException:
        os.close(fd)
        raise
    return TierDir(path, fd)
