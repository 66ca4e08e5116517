"""Crash-safe file writes: temp file in the same directory, fsync, rename, fsync dir.

Invariant: after a crash at any point, the destination holds either its old
content or the complete new content, never a torn file.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO


@contextlib.contextmanager
def atomic_writer(dest: Path) -> Iterator[BinaryIO]:
    tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}")
    try:
        with tmp.open("wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, dest)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(dest.parent)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_bytes(dest: Path, data: bytes) -> None:
    with atomic_writer(dest) as f:
        f.write(data)
