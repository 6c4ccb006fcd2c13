"""The staging area of a rank: where its DataLoader workers share remote fetches.

A rank's batches go to its workers round robin (so that the batch order does not
depend on ``num_workers``), so with small samples every worker reads nearly every
byte of the rank's shards. Without sharing, each worker would stream them all
itself: ``num_workers`` times the bytes and requests. Instead, the workers of one
rank in one epoch share a folder on local disk (the staging area): the first
worker to need a part of a shard streams it there, the others read it from there
as it grows (:mod:`shardflow.storage.sharing.staged`).

Layout of the folder ``<base>/shardflow-staging-<key>``, ``key`` from the job (the
DataLoader's process, by pid and start time: :func:`~shardflow.storage.sharing.areas.job_id`),
the dataset's shards, the rank and the epoch. ``<base>`` is ``staging_dir`` when only
this user can write it, else ``<staging_dir>/shardflow-<uid>`` (0700) in a shared folder
with the sticky bit such as the system's temporary folder
(:func:`~shardflow.storage.sharing.areas.staging_base`). The area is made 0700 and checked
(a folder, this user's, nobody else's to use) whenever a worker enters it; its files are
opened with ``O_NOFOLLOW``:

- ``.users``: every worker inside holds a shared ``flock`` on it;
- ``.prefetch``: the job (:func:`~shardflow.storage.sharing.areas.job_id`) whose main process
  fetched the first batches' bytes into the area before its workers started; removed by the
  first worker to enter. While that job runs, no sweep removes the area, though nobody holds
  it between the end of those fetches and the workers' arrival;
- ``.done-<worker>``: made by each worker at the end of its epoch; the worker that
  finds them all (and nobody inside) removes the folder;
- per shard (``<h>``: a digest of its URL) ``<h>.meta`` (its size and identity,
  from the first open), ``<h>.<j>`` (block ``j``: bytes ``[j*B, (j+1)*B)``),
  ``<h>.<j>.claim`` (locked by the worker writing block ``j``) and ``<h>.<j>.done``
  (one byte per worker that read past block ``j``).

A folder left by a crashed job (nobody holds its ``.users`` lock, no running job's
``.prefetch`` in it) is never read (a
new job has another key) and is removed by the next worker that enters a staging area
in the same folder, when it is this user's.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import shutil
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from ..errors import UnsafeFolderError
from ..options import IOOptions
from ..urls import is_local
from .areas import check_folder, job_alive, open_private, private_folder, same_file, staging_base

logger = logging.getLogger(__name__)

__all__ = ["PREFIX", "StagingScope", "StagedOptions", "scope_of", "unstaged", "enter_area", "held_here", "let_go", "leave_prefetch",
           "staged_epoch", "staging_for"]

PREFIX = "shardflow-staging-"
_PREFETCH = ".prefetch"  # in an area the main process fetched into: the job waiting for its workers
_LEAVE_TRIES = 20  # attempts of the last worker out to find the area unused (others leaving at once)
_LEAVE_PAUSE = 0.005  # seconds between them


# Descriptors that lock something in a staging area for this process's own use (a fetch's
# claims and block file, the main process's hold on an area while it prefetches). A forked
# child (a DataLoader worker) closes its copies at once: a flock belongs to the open file,
# so a copy kept by a child would hold the claim for as long as that child lives, and the
# rank's other workers would wait on it after the parent's fetch had ended or failed.
_HELD: set[int] = set()


def held_here(fd: int) -> int:
    """Register ``fd`` as this process's own (closed in forked children); returns it."""
    _HELD.add(fd)
    return fd


def let_go(fd: int) -> None:
    """Close a descriptor registered with :func:`held_here`."""
    _HELD.discard(fd)
    os.close(fd)


def _close_held_in_child() -> None:
    for fd in list(_HELD):
        with contextlib.suppress(OSError):
            os.close(fd)
    _HELD.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_close_held_in_child)


@dataclass(frozen=True)
class StagingScope:
    """Where one DataLoader worker shares its rank's fetches.

    Attributes:
        root: the staging area's folder (one per job, dataset, rank and epoch).
        worker: this worker's id, ``0 <= worker < num_workers``.
        num_workers: the rank's DataLoader workers (the readers of each block).
    """

    root: str
    worker: int
    num_workers: int


@dataclass(frozen=True, repr=False)
class StagedOptions(IOOptions):
    """The storage options of one DataLoader worker whose remote fetches go through its rank's
    staging area: the dataset's :class:`~shardflow.storage.IOOptions` and the worker's
    :class:`StagingScope` (made by :func:`staging_for`; the user's options never hold it)."""

    staging_scope: StagingScope | None = field(default=None, repr=False)


def scope_of(options: IOOptions) -> StagingScope | None:
    """The staging scope ``options`` read in (a :class:`StagedOptions`), or None."""
    return options.staging_scope if isinstance(options, StagedOptions) else None


def unstaged(options: IOOptions) -> IOOptions:
    """``options`` without a staging scope (plain :class:`~shardflow.storage.IOOptions`): a
    staged fetch's own request reads the store itself."""
    if not isinstance(options, StagedOptions):
        return options
    return IOOptions(**{f.name: getattr(options, f.name) for f in fields(IOOptions)})


def staging_for(options: IOOptions, urls: Sequence[str], key: Sequence[Any], worker: int,
                num_workers: int) -> IOOptions:
    """``options`` for DataLoader worker ``worker`` of ``num_workers`` (0 of 1 in the
    main process), sharing its rank's remote fetches through a staging area (or
    ``options`` as they are: staging off, a ``cache_dir``, or no remote URL).

    With one reader there is nothing to share, but a stream closed early and
    opened again (the first batch's samples read first, then the rest from the
    shard's start) reads the staged bytes again instead of fetching them again.

    Args:
        options: the dataset's storage options.
        urls: the dataset's shard URLs.
        key: what names this rank's epoch among others on the machine: the
            job (:func:`~shardflow.storage.sharing.areas.job_id`), rank, world size,
            epoch; the URLs are added.
        worker: this worker's id.
        num_workers: the rank's DataLoader workers.

    Raises:
        UnsafeFolderError: the folder of the areas, or this area, is not this user's
            alone (see :mod:`shardflow.storage.areas`).
    """
    if not options.staging or options.cache_dir is not None or all(is_local(u) for u in urls):
        return options
    wanted = options.staging_dir
    try:
        base = staging_base(wanted)
        digest = hashlib.sha256(repr((tuple(urls), num_workers, *key)).encode()).hexdigest()[:24]
        scope = StagingScope(os.path.join(base, PREFIX + digest), int(worker), int(num_workers))
        private_folder(scope.root, "staging area")
    except UnsafeFolderError:
        raise
    except OSError as exc:
        logger.warning("no staging area in %s (%s): each DataLoader worker streams the shards it reads itself",
                       wanted or "the temporary folder", exc)
        return options
    return StagedOptions(**{f.name: getattr(options, f.name) for f in fields(IOOptions)}, staging_scope=scope)


def staged_epoch(items: Iterator[Any], options: IOOptions) -> Iterator[Any]:
    """``items``, read inside ``options.staging_scope``'s staging area: entered at
    the first ``next()``, left when ``items`` ends or is closed (the last worker out
    removes the area)."""
    scope = scope_of(options)
    if scope is None:  # nothing to enter: no generator frame per sample on the read path
        return items
    return _staged(items, scope)


def _staged(items: Iterator[Any], scope: StagingScope) -> Iterator[Any]:
    """``items`` inside ``scope``'s staging area (see :func:`staged_epoch`)."""
    fd = _enter(scope)
    with contextlib.suppress(OSError):  # held by this worker now: the main process's mark is not needed
        os.unlink(os.path.join(scope.root, _PREFETCH))
    try:
        yield from items
    finally:  # ended, closed (the batches are all made) or failed: this worker is done with it
        _mark_done(scope)
        _leave(scope, fd)


def enter_area(scope: StagingScope, job: str) -> int:
    """Hold ``scope``'s area as a user that is not one of its workers (the main process
    fetching the first batches' bytes before its DataLoader workers start): nobody sweeps
    it meanwhile. :func:`let_go` the returned descriptor once those fetches are over (the
    last worker out removes the area only when nobody else holds it).

    The area is marked as awaiting the workers of ``job`` (:func:`~shardflow.storage.sharing.areas.job_id`
    of this process): no sweep (another rank's or job's worker entering an area of this user)
    removes the fetched bytes after this hold ends and before the first worker enters.
    """
    fd = held_here(_enter(scope))
    try:
        mark = open_private(os.path.join(scope.root, _PREFETCH), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    except OSError:
        let_go(fd)
        raise
    try:
        os.write(mark, job.encode())
    finally:
        os.close(mark)
    return fd


def leave_prefetch(scope: StagingScope, fd: int) -> None:
    """Let go of the hold :func:`enter_area` returned, once the main process's fetches are over.
    When every worker is done already (they can finish first, on a loaded machine or a short
    epoch), remove the area as the last worker out would have, had this hold not kept it."""
    _HELD.discard(fd)
    _leave(scope, fd)


def _enter(scope: StagingScope) -> int:
    """Make the area, hold its ``.users`` lock shared, and remove areas left by dead jobs.

    Returns:
        The descriptor holding the lock.
    """
    _sweep(os.path.dirname(scope.root), keep=scope.root)
    users = os.path.join(scope.root, ".users")
    for _attempt in range(100):
        private_folder(scope.root, "staging area")  # (again: removed meanwhile by the last worker out)
        try:
            fd = open_private(users, os.O_RDWR | os.O_CREAT)
        except FileNotFoundError:  # removed meanwhile by a sweep or the last worker out
            continue
        fcntl.flock(fd, fcntl.LOCK_SH)
        if same_file(fd, users):
            return fd
        os.close(fd)
    raise OSError(f"staging area {scope.root}: removed 100 times while entering it")


def _mark_done(scope: StagingScope) -> None:
    with contextlib.suppress(OSError):
        os.close(open_private(os.path.join(scope.root, f".done-{scope.worker}"), os.O_WRONLY | os.O_CREAT))


def _leave(scope: StagingScope, fd: int) -> None:
    """Release the area; the last worker out, once every worker is done, removes it."""
    try:
        for _attempt in range(_LEAVE_TRIES):
            try:
                done = sum(1 for name in os.listdir(scope.root) if name.startswith(".done-"))
            except FileNotFoundError:
                return
            if done < scope.num_workers:
                return  # a worker still to finish removes it
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                # Others are leaving too. Drop this one's shared hold before trying again: two
                # holders that each keep theirs while asking for the exclusive lock block each
                # other until both give up, and nobody removes the area.
                fcntl.flock(fd, fcntl.LOCK_UN)
                time.sleep(_LEAVE_PAUSE * (1 + (os.getpid() + _attempt) % 4))
                continue
            shutil.rmtree(scope.root, ignore_errors=True)
            logger.debug("staging area %s removed: every worker is done", scope.root)
            return
    finally:
        os.close(fd)


def _sweep(base: str, keep: str) -> None:
    """Remove this user's staging areas under ``base`` that nobody holds (left by dead jobs)."""
    try:
        names = [n for n in os.listdir(base) if n.startswith(PREFIX)]
    except FileNotFoundError:
        return
    for name in names:
        root = os.path.join(base, name)
        if root == keep or job_alive(_awaited_by(root)):
            continue  # its job's main process fetched into it, its workers are still to enter
        try:
            check_folder(root, private=False, what="staging area")  # ours (made 0700 since, 0755 before)
            fd = open_private(os.path.join(root, ".users"), os.O_RDWR)
        except (OSError, UnsafeFolderError):
            continue  # not an area of ours (yet), or removed meanwhile
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue  # in use
        try:
            shutil.rmtree(root, ignore_errors=True)
            logger.info("removed the staging area %s: left by a job that is gone", root)
        finally:
            os.close(fd)



def _awaited_by(root: str) -> str | None:
    """The job named by ``root``'s ``.prefetch`` mark, or None (no mark, or unreadable)."""
    try:
        fd = open_private(os.path.join(root, _PREFETCH), os.O_RDONLY)
    except (OSError, UnsafeFolderError):
        return None
    try:
        return os.read(fd, 64).decode("ascii", "replace")
    except OSError:
        return None
    finally:
        os.close(fd)
