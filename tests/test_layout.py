"""Packaging and architecture: import names, the built wheel, import direction."""

from __future__ import annotations

import ast
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PURE = ["aurora/codec", "aurora/protocol"]
FORBIDDEN = {"asyncio", "zmq", "aiortc", "structlog", "socket", "time"}


def test_import_names_are_under_aurora() -> None:
    import aurora.actors
    import aurora.transport

    assert Path(aurora.actors.__file__).parent == ROOT / "actors"
    assert Path(aurora.transport.__file__).parent == ROOT / "transport"


def _imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module.split(".")[0])
    return out


@pytest.mark.parametrize("pkg", PURE)
def test_pure_layers_do_no_io(pkg: str) -> None:
    files = sorted((ROOT / pkg).glob("*.py"))
    if not files and pkg == "aurora/protocol":
        pytest.skip("aurora.protocol not written yet")
    for f in files:
        bad = _imports(f) & FORBIDDEN
        assert not bad, f"{f.relative_to(ROOT)} imports {sorted(bad)}"


def test_wheel_contains_every_package(tmp_path: Path) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), str(ROOT)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    (wheel,) = tmp_path.glob("aurora_rl-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for want in ["aurora/__init__.py", "aurora/py.typed", "aurora/codec/kernels.py", "aurora/store/store.py",
                 "aurora/actors/__init__.py", "aurora/transport/__init__.py", "aurora/cli.py"]:  # fmt: skip
        assert want in names, want
    assert not any(n.startswith(("actors/", "transport/", "tests/")) for n in names)
    entry = next(n for n in names if n.endswith("entry_points.txt"))
    assert "aurora = aurora.cli:main" in zipfile.ZipFile(wheel).read(entry).decode()
