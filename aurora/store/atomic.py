"""Crash-safe writes, made here and nowhere else: a file or a whole directory appears complete or
not at all.

* a file: `atomic_writer` (a file object), `write_bytes`, or `atomic_path` (a path, for a library
  that writes by name: safetensors, a GGUF extractor) — written to a hidden temporary sibling,
  fsynced, renamed onto the destination, then the folder fsynced;
* a directory: `publish_dir` — filled in a hidden temporary sibling; every file and folder in it
  is fsynced, then it takes the destination's place in one step and the parent is fsynced;
* a file that must not exist yet: `create_new` — created with its final mode (0600 for a secret)
  from the first byte, written whole under a temporary name, then linked into place, which fails
  rather than overwrite.

Invariants: after a crash at any point, a destination holds its old content or the complete new
content, never a torn file or a half-filled directory; a destination directory that existed is
never absent (replacing one swaps the two in one step, ``renameat2(RENAME_EXCHANGE)``, where the
file system offers it; elsewhere the old one is moved aside for the instant between two renames);
on any exception, KeyboardInterrupt included, the temporary file or directory is removed (a
process killed outright can leave one, hidden: ``.NAME.tmp-PID-RANDOM``). Blocking; run off the
event loop.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2
"""Flags of renameat2(2) (linux/fcntl.h, linux/fs.h)."""
_renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)


def _sibling(dest: Path) -> Path:
    """A fresh hidden name beside ``dest`` (process and random token: two writers never share one)."""
    return dest.with_name(f".{dest.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")


def fsync_path(path: Path) -> None:
    """fsync a file's data, or a folder's entries."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_path(dest: Path) -> Iterator[Path]:
    """A temporary path beside ``dest`` for the caller to write (it does not exist yet); on a clean
    exit it is fsynced and renamed onto ``dest``, and the folder fsynced."""
    tmp = _sibling(dest)
    try:
        yield tmp
        fsync_path(tmp)
        os.replace(tmp, dest)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_path(dest.parent)


@contextlib.contextmanager
def atomic_writer(dest: Path) -> Iterator[BinaryIO]:
    """A file object whose content replaces ``dest`` whole when the block ends cleanly."""
    with atomic_path(dest) as tmp, tmp.open("xb") as f:
        yield f


def write_bytes(dest: Path, data: bytes) -> None:
    with atomic_writer(dest) as f:
        f.write(data)


def create_new(dest: Path, data: bytes, mode: int) -> None:
    """Write ``dest``, which must not exist (`FileExistsError` otherwise, and nothing changes),
    with permissions ``mode`` from its first byte, whatever the umask."""
    tmp = _sibling(dest)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), mode)
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.link(tmp, dest)  # unlike rename, link never replaces what is there
    finally:
        tmp.unlink(missing_ok=True)
    fsync_path(dest.parent)


@contextlib.contextmanager
def publish_dir(dest: Path, *, replace: bool = False) -> Iterator[Path]:
    """A new, empty temporary directory beside ``dest`` for the caller to fill; on a clean exit it
    becomes ``dest`` (see the module docstring). ``dest`` may be absent or an empty directory; a
    directory with something in it is replaced when ``replace``, else `FileExistsError` (and the
    temporary directory is removed)."""
    tmp = _sibling(dest)
    tmp.mkdir()
    try:
        yield tmp
        _fsync_tree(tmp)
        _move_in(tmp, dest, replace)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_path(dest.parent)


def _fsync_tree(root: Path) -> None:
    for folder, _, files in os.walk(root, topdown=False):
        for name in files:
            fsync_path(Path(folder, name))
        fsync_path(Path(folder))


def _move_in(tmp: Path, dest: Path, replace: bool) -> None:
    """Rename ``tmp`` onto ``dest``: in one step where ``dest`` is absent or empty (rename(2)), else
    (``replace``) by swapping the two, then removing the old one, now at ``tmp``."""
    try:
        os.replace(tmp, dest)
        return
    except OSError as e:
        if e.errno not in (errno.ENOTEMPTY, errno.EEXIST) or not dest.is_dir():
            raise
        if not replace:
            raise FileExistsError(errno.EEXIST, "exists and is not empty", str(dest)) from None
    if not _exchange(tmp, dest):  # no RENAME_EXCHANGE here: the old one steps aside for an instant
        aside = _sibling(dest)
        os.replace(dest, aside)
        os.replace(tmp, dest)
        tmp = aside
    shutil.rmtree(tmp, ignore_errors=True)


def _exchange(a: Path, b: Path) -> bool:
    """Swap ``a`` and ``b`` in one step; False where the kernel or file system cannot."""
    if _renameat2 is None:
        return False
    if _renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))
