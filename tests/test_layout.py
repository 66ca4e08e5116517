"""Packaging and architecture: import names, the built wheel, which package may import which.

The layers, by import name, lowest first. A module may import its own package and the packages of
the layers below its own, never a package beside it or above it. Every import counts: at the top
of a module, inside a function (a lazy import is still a dependency) and under ``TYPE_CHECKING``
(a type is one too).

The kernel (0-5) never imports ``aurora.actors`` or ``aurora.transport``:

0. names: ``aurora.errors``, ``aurora.events`` and ``aurora.rl.types`` — the error tree, the log
   event names, and the RL data contract the work protocol carries (``Prompt``, ``Completion``:
   dataclasses, no torch), which is why ``aurora.protocol`` may import it and nothing else of
   ``aurora.rl``;
1. ``aurora.codec`` — bytes in, bytes out: no I/O (below); beside it ``aurora.vllm_backend``, vLLM's side
   of the weight transfer, which imports nothing of Aurora (vLLM loads it as a plugin in processes
   of its own);
2. ``aurora.protocol`` — the rules as values: no I/O either;
3. ``aurora.config``, ``aurora.runtime``, ``aurora.store``, ``aurora.logs`` — the topology, the actor
   runtime, the version store and the one logging setup, side by side (none needs another);
4. ``aurora.auth`` — keys named by the topology, seals over the codec's layout;
5. ``aurora.rl`` — models, tasks, engines, learners: on the codec, the store and the config.

Above the kernel:

6. ``aurora.transport`` — links between nodes, on the kernel only (not the actors that use them);
   ``aurora.display``, ``aurora.metrics`` and ``aurora.tracking`` — what the composition roots show and
   write, and where a trainer's figures go (TensorBoard, W&B), kernel only; ``aurora.deploy`` — a
   topology as a container engine's files, kernel only;
7. ``aurora.actors`` — the drivers: kernel and transports; ``aurora.testing`` — the product fakes:
   kernel and transports (its fakes implement the transport's interfaces), never the actors they
   are there to test.

The composition roots import anything: ``aurora.cli`` (the command line), ``aurora.run`` (it
launches a cluster and reads its status, like the command line), ``aurora.bench`` (each bench
builds what it measures), ``aurora.__main__`` and the ``aurora`` package itself. Nothing imports
a root but another root.

Besides the table: no two modules import each other, directly or round a cycle; the codec and the
protocol import nothing that does I/O, and importing the protocol loads neither torch nor
asyncio (``aurora.rl.types`` stays pure data); a log event that other code reads is named
through its constant in ``aurora.events``, never as a string; and the drivers (``actors/``,
``transport/``) read time and wait for it only through `aurora.runtime.Clock`, so a virtual clock
drives a whole node: no ``time.monotonic``/``time.time``/``loop.time()``, no ``asyncio.sleep`` but
the zero-second yield, no ``asyncio.timeout``/``wait_for``/``wait(timeout=)``, no loop timers.
``time.perf_counter`` is the stopwatch (how long work took: logs, statistics, the encoder's CPU
slice), which `aurora.runtime.clock`'s docstring allows; `ALLOWED_TIME` lists the other exceptions.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

import aurora.events

ROOT = Path(__file__).resolve().parent.parent
SOURCES = {"aurora": ROOT / "aurora", "aurora.actors": ROOT / "actors", "aurora.transport": ROOT / "transport"}

ANYTHING = 99
LAYER = {
    "aurora.errors": 0,
    "aurora.events": 0,
    "aurora.rl.types": 0,
    "aurora.codec": 1,
    "aurora.vllm_backend": 1,
    "aurora.protocol": 2,
    "aurora.config": 3,
    "aurora.runtime": 3,
    "aurora.store": 3,
    "aurora.logs": 3,
    "aurora.auth": 4,
    "aurora.rl": 5,
    "aurora.transport": 6,
    "aurora.display": 6,
    "aurora.metrics": 6,
    "aurora.tracking": 6,
    "aurora.deploy": 6,
    "aurora.actors": 7,
    "aurora.testing": 7,
    "aurora.cli": ANYTHING,
    "aurora.run": ANYTHING,
    "aurora.node": ANYTHING,
    "aurora.chaos": ANYTHING,
    "aurora.bench": ANYTHING,
    "aurora.__main__": ANYTHING,
    "aurora": ANYTHING,
}
"""Each package's layer (see the module docstring); a package is named by its longest prefix here."""

PURE = ["aurora/codec", "aurora/protocol"]
IO = {"asyncio", "zmq", "aiortc", "structlog", "socket", "time", "os", "subprocess", "selectors"}
DATA_ONLY = {"__future__", "dataclasses", "typing", "collections", "enum"}
"""All that `aurora.rl.types` may import: it is pure data."""
HEAVY = {"torch", "numpy", "asyncio", "zmq", "aiortc", "structlog", "socket"}
"""What importing the protocol must not load (``os`` and ``time`` come with the interpreter)."""


def test_import_names_are_under_aurora() -> None:
    import aurora.actors
    import aurora.transport

    assert Path(aurora.actors.__file__).parent == ROOT / "actors"
    assert Path(aurora.transport.__file__).parent == ROOT / "transport"


def _modules() -> dict[str, Path]:
    """Every module of the package by import name (``actors/`` and ``transport/`` install under ``aurora``)."""
    out = {}
    for prefix, folder in SOURCES.items():
        for f in folder.rglob("*.py"):
            parts = [*prefix.split("."), *f.relative_to(folder).with_suffix("").parts]
            if prefix == "aurora" and parts[1] in ("actors", "transport"):
                continue
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


MODULES = _modules()


def _aurora_imports(name: str, path: Path) -> Iterator[tuple[str, int]]:
    """The ``aurora`` modules ``name`` imports (a package where a name is not a module), with lines."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from ((a.name, node.lineno) for a in node.names if a.name.split(".")[0] == "aurora")
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            if module.split(".")[0] != "aurora":
                continue
            for a in node.names:
                sub = f"{module}.{a.name}"
                yield (sub if sub in MODULES else module), node.lineno


def _imported_roots(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module.split(".")[0])
    return out


def _package(module: str) -> str:
    return max((p for p in LAYER if module == p or module.startswith(p + ".")), key=len)


def test_every_module_has_a_layer() -> None:
    unplaced = [m for m in MODULES if not any(m == p or m.startswith(p + ".") for p in LAYER)]
    assert not unplaced, f"modules in no layer of tests/test_layout.py's table: {unplaced}"


def test_imports_go_down_the_layers() -> None:
    bad = []
    for name, path in sorted(MODULES.items()):
        src = _package(name)
        for target, line in _aurora_imports(name, path):
            dst = _package(target)
            if dst != src and LAYER[src] != ANYTHING and LAYER[dst] >= LAYER[src]:
                bad.append(
                    f"{path.relative_to(ROOT)}:{line}: {src} (layer {LAYER[src]}) imports {target} (layer {LAYER[dst]})"
                )
    assert not bad, "imports against the layers (tests/test_layout.py):\n" + "\n".join(bad)


def test_no_import_cycles() -> None:
    graph = {m: {t for t, _ in _aurora_imports(m, p) if t in MODULES and t != m} for m, p in MODULES.items()}
    done: set[str] = set()

    def visit(m: str, path: list[str]) -> None:
        if m in path:
            cycle = [*path[path.index(m) :], m]
            pytest.fail("import cycle: " + " -> ".join(cycle))
        if m in done:
            return
        for t in sorted(graph[m]):
            visit(t, [*path, m])
        done.add(m)

    for m in sorted(graph):
        visit(m, [])


@pytest.mark.parametrize("pkg", PURE)
def test_pure_layers_do_no_io(pkg: str) -> None:
    for f in sorted((ROOT / pkg).glob("*.py")):
        bad = _imported_roots(f) & IO
        assert not bad, f"{f.relative_to(ROOT)} imports {sorted(bad)}"


def test_the_rl_data_contract_is_pure_data() -> None:
    for f in (ROOT / "aurora/rl/types.py", ROOT / "aurora/rl/__init__.py", ROOT / "aurora/__init__.py"):
        bad = _imported_roots(f) - DATA_ONLY
        assert not bad, f"{f.relative_to(ROOT)} imports {sorted(bad)} (the protocol imports it: data only)"
    probe = "import sys, aurora.protocol; print(' '.join(m for m in {mods!r} if m in sys.modules))"
    r = subprocess.run(
        [sys.executable, "-c", probe.format(mods=sorted(HEAVY))], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [], f"importing aurora.protocol loads {r.stdout.split()}"


DRIVERS = [ROOT / "actors", ROOT / "transport"]
SCHEDULING = {
    "time": {"monotonic", "monotonic_ns", "time", "time_ns", "sleep", "clock_gettime", "clock_gettime_ns"},
    "asyncio": {"sleep", "timeout", "timeout_at", "wait_for"},
}
"""Calls that read time or wait for it behind the clock's back (``asyncio.sleep(0)``, a yield, is fine)."""
ALLOWED_TIME = {
    ("transport/base.py", "time.time_ns"): "an incarnation must grow across restarts of a process: wall-clock time",
    ("actors/node.py", "time.time"): "a pool member's certificate expires at a wall-clock time (Unix seconds)",
}


def _time_reads(path: Path) -> list[tuple[int, str]]:
    """Where ``path`` reads time or waits for it other than through a `Clock`: (line, what), in order.
    A forbidden function counts wherever it is named (``_now = time.monotonic`` too), not only called."""
    tree = ast.parse(path.read_text(), str(path))
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)]
    yields = {
        id(c.func)
        for c in calls
        if ast.unparse(c.func) == "asyncio.sleep" and [ast.unparse(a) for a in c.args] == ["0"]
    }
    out: list[tuple[int, int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module in SCHEDULING and node.level == 0:
            out += [
                (node.lineno, node.col_offset, f"from {node.module} import {a.name}")
                for a in node.names
                if a.name in SCHEDULING[node.module]
            ]
        elif isinstance(node, ast.Attribute) and id(node) not in yields:
            recv = ast.unparse(node.value)
            if recv in SCHEDULING and node.attr in SCHEDULING[recv]:
                out.append((node.lineno, node.col_offset, f"{recv}.{node.attr}"))
    for c in calls:
        name = ast.unparse(c.func)
        recv, _, attr = name.rpartition(".")
        timed = [k.arg for k in c.keywords if k.arg == "timeout"]
        if attr == "time" and recv not in ("", "time") and not c.args:
            out.append((c.lineno, c.col_offset, f"{name}()"))  # an event loop's clock
        elif attr in ("call_later", "call_at") and "clock" not in recv:
            out.append((c.lineno, c.col_offset, name))  # a loop timer
        elif name == "asyncio.wait" and timed:
            out.append((c.lineno, c.col_offset, f"{name}({timed[0]}=...)"))
    return [(line, what) for line, _, what in sorted(out)]


def test_drivers_read_time_only_through_the_clock() -> None:
    bad = []
    for folder in DRIVERS:
        for f in sorted(folder.rglob("*.py")):
            rel = str(f.relative_to(ROOT))
            for line, what in _time_reads(f):
                if (rel, what) not in ALLOWED_TIME:
                    bad.append(f"{rel}:{line}: {what}")
    assert not bad, "time read or waited for behind aurora.runtime.Clock (tests/test_layout.py):\n" + "\n".join(bad)


def test_the_time_check_finds_what_it_forbids(tmp_path: Path) -> None:
    f = tmp_path / "driver.py"
    f.write_text(
        "import asyncio, time\nfrom time import monotonic\n"
        "async def f(loop, ev):\n"
        "    t0 = time.perf_counter()\n    await asyncio.sleep(0)\n    await asyncio.sleep(0.1)\n"
        "    now = time.monotonic() + loop.time() + asyncio.get_running_loop().time()\n"
        "    async with asyncio.timeout(1):\n        await ev.wait()\n"
        "    await asyncio.wait([ev.wait()], timeout=1)\n"
        "    loop.call_later(1, print)\n    self.clock.call_later(1, print)\n_now = time.monotonic\n"
    )
    assert [what for _, what in _time_reads(f)] == [
        "from time import monotonic",
        "asyncio.sleep",
        "time.monotonic",
        "loop.time()",
        "asyncio.get_running_loop().time()",
        "asyncio.timeout",
        "asyncio.wait(timeout=...)",
        "loop.call_later",
        "time.monotonic",
    ]


def test_drivers_hand_work_to_threads_only_through_in_thread() -> None:
    """`asyncio.to_thread` lets a cancelled caller go while its thread runs on (aurora/runtime/threads.py):
    the drivers use `in_thread` / `to_the_end`, which wait for the thread, and so does the node's
    composition root (`aurora/node.py`: the trainer's restore, the store's opening)."""
    bad = []
    for folder in [*DRIVERS, ROOT / "aurora/node.py"]:
        for f in sorted(folder.rglob("*.py")) if folder.is_dir() else [folder]:
            for node in ast.walk(ast.parse(f.read_text(), str(f))):
                name = ast.unparse(node) if isinstance(node, ast.Attribute | ast.Name) else ""
                if name in ("asyncio.to_thread", "to_thread") or (
                    isinstance(node, ast.ImportFrom) and any(a.name == "to_thread" for a in node.names)
                ):
                    bad.append(f"{f.relative_to(ROOT)}:{node.lineno}")
    assert not bad, "asyncio.to_thread in a driver (use aurora.runtime.in_thread):\n" + "\n".join(sorted(set(bad)))


EVENTS = {v: k for k, v in vars(aurora.events).items() if k.isupper()}
NOT_EVENTS = {ROOT / "tests/golden_inputs.py", ROOT / "tests/test_golden.py"}
"""Files where a word that is also an event's name means something else ("step" is a tensor there)."""


def test_event_names_are_only_constants() -> None:
    """An event that other code reads is logged and matched through `aurora.events`: a string
    spelling its name anywhere else would silently stop matching after a rename."""
    assert all(v == k.lower() for v, k in EVENTS.items())
    logged: set[str] = set()
    spelled = []
    files = [*MODULES.values(), *sorted((ROOT / "tests").glob("*.py"))]
    for f in files:
        if f == ROOT / "aurora/events.py" or f in NOT_EVENTS:
            continue
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if isinstance(node, ast.Constant) and node.value in EVENTS:
                spelled.append(
                    f"{f.relative_to(ROOT)}:{node.lineno}: {node.value!r} (aurora.events.{EVENTS[node.value]})"
                )
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
                first = node.args[0]
                if node.func.attr in ("debug", "info", "warning", "error", "exception") and isinstance(first, ast.Name):
                    logged.add(first.id)
    assert not spelled, "event names spelled as strings:\n" + "\n".join(spelled)
    assert set(EVENTS.values()) <= logged, f"events nothing logs: {sorted(set(EVENTS.values()) - logged)}"


def test_wheel_contains_every_package(tmp_path: Path) -> None:
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(ROOT),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    (wheel,) = tmp_path.glob("aurora_rl-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for want in [
        "aurora/__init__.py",
        "aurora/py.typed",
        "aurora/codec/kernels.py",
        "aurora/store/store.py",
        "aurora/actors/__init__.py",
        "aurora/transport/__init__.py",
        "aurora/cli.py",
    ]:
        assert want in names, want
    assert not any(n.startswith(("actors/", "transport/", "tests/")) for n in names)
    entry = next(n for n in names if n.endswith("entry_points.txt"))
    assert "aurora = aurora.cli:main" in zipfile.ZipFile(wheel).read(entry).decode()
