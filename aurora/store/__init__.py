"""The versioned on-disk weight store (anchors + deltas)."""

from aurora.store.store import DeltaStore, VersionInfo

__all__ = ["DeltaStore", "VersionInfo"]
