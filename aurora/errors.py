"""Aurora's error tree: one small hierarchy, each error a person can act on.

`AuroraError` is the root; the CLI turns any of them into one line and a
non-zero exit code. Errors raised for bad input change no state.
"""

from __future__ import annotations


class AuroraError(Exception):
    """Root of every error Aurora raises on purpose."""


class ConfigError(AuroraError):
    """A configuration or topology file is invalid; carries the file and YAML path."""

    def __init__(self, message: str, *, file: str | None = None, path: str | None = None) -> None:
        self.file = file
        self.path = path
        self.message = message
        where = ":".join(p for p in (file, path) if p)
        super().__init__(f"{where}: {message}" if where else message)


class CheckpointError(AuroraError):
    """A checkpoint file or directory (safetensors, index JSON) is missing or malformed."""


class DeltaFormatError(AuroraError):
    """A delta, manifest or chunk is malformed, corrupt, or does not fit the base."""


class EngineError(AuroraError):
    """A rollout's engine answered what it cannot have (a ``vllm serve`` that is broken or not ours)."""


class FetchError(AuroraError):
    """A known model could not be fetched: unknown name, download failed, checksum mismatch, or unwritable
    destination."""


class StoreError(AuroraError):
    """The versioned store cannot satisfy a request (missing version, bad layout)."""


class ProtocolError(AuroraError):
    """A protocol rule was broken; `remote` tells a peer's fault from a local bug."""

    def __init__(self, message: str, *, remote: bool) -> None:
        self.remote = remote
        super().__init__(message)


class LearnerError(AuroraError):
    """The learner cannot make a version (it would hold non-finite values)."""


class AuthError(AuroraError):
    """A signature, seal or key does not verify, or a peer is not who it must be."""


class TransportClosed(AuroraError):
    """The channel or transport was closed; carries the reason."""


class ActorDead(AuroraError):
    """The actor a message or request was addressed to has stopped."""


class RestartIntensityExceeded(AuroraError):
    """A supervisor saw more restarts than its intensity allows and gave up."""


def peer_fault(e: BaseException) -> bool:
    """Is ``e`` a peer's fault — what may make a node leave or quarantine a parent, or close a child:
    `DeltaFormatError`, `AuthError`, `ProtocolError` with ``remote``, `TransportClosed`. Anything else
    (a bug, a full disk, an engine error) is this node's own: the actor crashes and its supervisor
    counts it (let it crash)."""
    return isinstance(e, DeltaFormatError | AuthError | TransportClosed) or (isinstance(e, ProtocolError) and e.remote)
