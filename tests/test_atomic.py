"""The one crash-safe writer (`aurora.store.atomic`): whole or not at all, nothing left behind,
a directory that existed never absent, a new file never overwritten and 0600 from its first byte."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from aurora.store import atomic
from aurora.store.atomic import atomic_path, atomic_writer, create_new, publish_dir, write_bytes


class Crash(Exception):
    pass


def _hidden(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir() if p.name.startswith("."))


def test_a_file_is_replaced_whole_or_not_at_all(tmp_path: Path) -> None:
    f = tmp_path / "f.json"
    write_bytes(f, b"old")

    def crash_writing() -> None:
        with atomic_writer(f) as w:
            w.write(b"half of the new")
            raise Crash

    with pytest.raises(Crash):
        crash_writing()
    assert f.read_bytes() == b"old"
    with atomic_path(f) as tmp:
        assert not tmp.exists()  # the caller (a library writing by name) makes it
        tmp.write_bytes(b"new")
        assert f.read_bytes() == b"old"
    assert f.read_bytes() == b"new"
    assert _hidden(tmp_path) == []


def _fill(d: Path, tag: str) -> None:
    (d / "model.safetensors").write_text(tag)
    (d / "sub").mkdir()
    (d / "sub" / "meta.json").write_text(tag)


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2", "aside"])
def test_a_directory_appears_whole_and_one_that_existed_is_swapped_never_absent(
    tmp_path: Path, exchange: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not exchange:
        monkeypatch.setattr(atomic, "_renameat2", None)
    dest = tmp_path / "v00000004"
    with publish_dir(dest) as tmp:
        _fill(tmp, "first")
        assert not dest.exists()
    assert (dest / "sub" / "meta.json").read_text() == "first"
    with publish_dir(dest, replace=True) as tmp:
        _fill(tmp, "second")
        assert (dest / "model.safetensors").read_text() == "first"  # the old one until the swap
    assert (dest / "model.safetensors").read_text() == (dest / "sub" / "meta.json").read_text() == "second"

    def crash_filling() -> None:
        with publish_dir(dest, replace=True) as tmp:
            _fill(tmp, "third")
            raise Crash

    with pytest.raises(Crash):
        crash_filling()
    assert (dest / "model.safetensors").read_text() == "second"
    assert _hidden(tmp_path) == []


def test_a_directory_is_published_only_onto_an_absent_or_empty_one_unless_replacing(tmp_path: Path) -> None:
    dest = tmp_path / "model"
    dest.mkdir()
    with publish_dir(dest) as tmp:  # empty: rename(2) takes its place
        (tmp / "config.json").write_text("{}")
    with pytest.raises(FileExistsError), publish_dir(dest) as tmp:
        (tmp / "config.json").write_text('{"other": 1}')
    assert (dest / "config.json").read_text() == "{}"
    assert _hidden(tmp_path) == []


@pytest.mark.parametrize("umask", [0o000, 0o022, 0o077])
def test_a_new_file_has_its_mode_from_the_first_byte_and_is_never_overwritten(tmp_path: Path, umask: int) -> None:
    secret = tmp_path / "trainer.key_secret"
    old = os.umask(umask)
    try:
        create_new(secret, b"secret", 0o600)
        with pytest.raises(FileExistsError):
            create_new(secret, b"another", 0o600)
    finally:
        os.umask(old)
    assert secret.read_bytes() == b"secret"
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    assert secret.stat().st_nlink == 1  # the temporary name is gone
    assert _hidden(tmp_path) == []
