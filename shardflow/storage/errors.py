"""The storage layer's errors (all :class:`~shardflow.errors.ShardflowError`)."""

from __future__ import annotations

from shardflow.errors import RemoteReadError, ShardflowError

__all__ = ["DestinationLockedError", "RemoteWriteError", "ShardChangedError", "ShardNotFoundError", "ShortReadError"]


class ShardNotFoundError(RemoteReadError, FileNotFoundError):
    """The object at a URL does not exist."""


class ShardChangedError(RemoteReadError):
    """An object changed (size, ETag, mtime or version) while it was being read."""


class RemoteWriteError(ShardflowError, OSError):
    """Writing an object failed; nothing was left at its final name."""


class DestinationLockedError(ShardflowError, OSError):
    """Another live writer is writing to the same destination folder."""

    default_reason = "destination_locked"


class ShortReadError(OSError):
    """The stream ended before the expected end of the range (transient)."""
