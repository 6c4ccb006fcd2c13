"""The storage layer's errors (all :class:`~shardflow.errors.ShardflowError`)."""

from __future__ import annotations

from shardflow.errors import RemoteReadError, ShardflowError

__all__ = [
    "DestinationLockedError", "NotRegularFileError", "RemoteWriteError", "ShardChangedError", "ShardNotFoundError",
    "ShortReadError", "SymlinkError", "UnsafeFolderError", "check_digest",
]


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


class NotRegularFileError(ShardflowError, OSError):
    """A local shard, index or manifest is a FIFO, a device or a socket, not a regular file
    (reading one could block forever, or never end)."""

    default_reason = "not_regular_file"


class SymlinkError(ShardflowError, OSError):
    """A file a writer creates in its destination is a symlink there (it is never followed)."""

    default_reason = "symlink"



class UnsafeFolderError(ShardflowError, PermissionError):
    """A staging area or shard cache folder is not this user's alone (another user made it or
    can write in it, or it is a symbolic link), or a file in it is a symbolic link: refused,
    never followed."""

    default_reason = "unsafe_folder"


def check_digest(url: str, hasher: object | None, sha256: str | None, why: str) -> None:
    """The one guard of a shard read whole against its manifest's sha256 (nothing to check
    without a hasher: the shard was not read whole, or the manifest lists no digest).

    Args:
        url: the shard, as shown.
        hasher: a ``hashlib.sha256()`` fed every byte read, or None.
        sha256: the manifest's hex digest.
        why: what follows from a mismatch where this guard stands (cached or not, no ETag).

    Raises:
        ShardChangedError: the digests differ: the object changed since it was indexed or
            while it was read.
    """
    if hasher is None:
        return
    got = hasher.hexdigest()  # type: ignore[attr-defined]
    if got != sha256:
        raise ShardChangedError(
            f"{url}: read whole, its sha256 is {got} but the manifest lists {sha256}: the object changed "
            f"since it was indexed or while being read{why}"
        )
