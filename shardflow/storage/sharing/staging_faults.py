"""Faults of the staging area itself, told apart from the store's.

A staging area that has no room left (``ENOSPC``, a quota's ``EDQUOT``, a file size limit's
``EFBIG``) is a fault of the local disk: retrying the remote read would fail the same way
until ``part_deadline``, so it is named at once (:class:`StagingFullError`, a
:class:`~shardflow.errors.ShardflowError` that ``on_error="skip"`` counts) with the ways to
give the area room. A block whose claim a live worker holds but does not fill for
:func:`stall_seconds` is read straight from the store by the reader that waits for it
(:mod:`shardflow.storage.sharing.staged`): a stalled holder costs its rank's other workers bytes
fetched twice, never ``part_deadline`` of waiting.
"""

from __future__ import annotations

import errno

from shardflow.errors import ShardflowError

from ..options import IOOptions

__all__ = ["StagingFullError", "disk_full", "stall_seconds"]

_DISK_FULL = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})


class StagingFullError(ShardflowError, OSError):
    """The staging area's disk has no room left for a fetched block; names the shard, the
    area and what to change."""

    default_reason = "staging_full"


def disk_full(exc: BaseException, url: str, root: str, options: IOOptions) -> StagingFullError | None:
    """The named error for ``exc`` when it says that the staging area's disk is full, else None.

    Args:
        exc: what a write into the area raised (errors of shardflow's own, such as a
            remote read's, are never taken for the disk's).
        url: the shard being staged.
        root: the staging area.
        options: for the limit the message names.
    """
    if isinstance(exc, ShardflowError) or not isinstance(exc, OSError) or exc.errno not in _DISK_FULL:
        return None
    return StagingFullError(
        f"staging {url}: the staging area {root} has no room left ({exc.strerror or errno.errorcode[exc.errno]}); "
        "a full disk is not a network failure and is not retried: free space there, set IOOptions.staging_dir to a "
        f"folder with room, lower IOOptions.staging_limit (now {options.staging_limit} bytes), or turn staging off "
        "(IOOptions(staging=False))"
    )


def stall_seconds(options: IOOptions) -> float:
    """Seconds a reader waits for a block whose claim a live worker holds, without a byte
    written, before it reads the bytes from the store itself: ``request_timeout`` (a fetch
    that waits longer on one request retries it, so its holder is stalled), at most
    ``part_deadline``."""
    return min(options.request_timeout, options.part_deadline)
