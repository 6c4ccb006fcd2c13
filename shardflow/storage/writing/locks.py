"""One writer per local destination folder, and the temporaries a crashed writer left.

A writer holds an exclusive ``flock`` on ``<folder>/.shardflow.lock`` (its pid and
host written in it, for the error another writer gets). The kernel releases the
lock when the process dies, however it dies, so a crashed run never leaves the
folder held; the file is removed when the writer finishes. The lock is its
process's own: a forked child (a conversion's writer worker) closes its copy of
the descriptor at once, so a worker that outlives a killed run does not hold the
folder for it. Temporaries written
by :func:`~shardflow.storage.writing.output.open_output` are ``flock``-ed while being
written, so one whose lock can be taken belongs to no live writer and is
removed by :func:`remove_stale_temporaries`. (A conversion's staged shards,
:func:`~shardflow.storage.writing.output.open_staged`, are unlocked between their writing
and their commit; the conversion holds the folder's lock meanwhile, and writers
take that lock before they sweep.) POSIX only; ``flock`` is not reliable on NFS.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import socket
import time

from ..errors import DestinationLockedError
from .output import create_file

__all__ = ["LOCK_NAME", "DestinationLock", "remove_stale_temporaries", "writer_holding"]

log = logging.getLogger(__name__)
LOCK_NAME = ".shardflow.lock"
TEMPORARY = re.compile(r"^\..+\.[0-9a-f]{12}\.tmp$")  # open_output's names: .<name>.<token>.tmp


_HELD: set[DestinationLock] = set()  # the locks this process holds (until released)


def _drop_in_child() -> None:
    """After a fork, in the child: close its copies of the held locks' descriptors (an ``flock``
    stays held while any copy of its descriptor is open) and forget them, so that the lock
    goes with the process that took it."""
    for lock in list(_HELD):
        fd, lock._fd = lock._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)
    _HELD.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_drop_in_child)


class DestinationLock:
    """An exclusive lock on a local folder for one writer (see the module docstring).

    Args:
        folder: the destination folder (created if missing).

    Raises:
        DestinationLockedError: from :meth:`acquire`, when another live writer holds it.
    """

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self.path = os.path.join(folder, LOCK_NAME)
        self._fd: int | None = None

    def acquire(self) -> DestinationLock:
        os.makedirs(self.folder, exist_ok=True)
        while True:
            fd = create_file(self.path, truncate=False)  # never through a symlink planted there
            try:
                _lock_soon(fd)
            except BlockingIOError:
                owner = os.pread(fd, 200, 0).decode("utf-8", "replace").strip() or "another process"
                os.close(fd)
                raise DestinationLockedError(
                    f"{self.folder}: another writer ({owner}) is writing to this folder (it holds {self.path}); "
                    "wait for it to finish, or write elsewhere"
                ) from None
            # the file may have been removed by the writer that released it just before: lock the one at the path
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        self._fd = fd
        _HELD.add(self)
        return self

    def release(self) -> None:
        fd, self._fd = self._fd, None
        _HELD.discard(self)
        if fd is None:
            return
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)  # while still held: a waiting writer then locks a new file
        os.close(fd)

    def __enter__(self) -> DestinationLock:
        return self.acquire()

    def __exit__(self, *exc_info: object) -> None:
        self.release()


_PROBE_WAIT = 0.2
"""Seconds a writer keeps trying a held lock: a reader's probe (:func:`writer_holding`) holds it
shared for a moment, and a writer must not be refused for that."""


def _lock_soon(fd: int) -> None:
    """``flock(LOCK_EX)`` without blocking, tried again for :data:`_PROBE_WAIT` seconds.

    Raises:
        BlockingIOError: still held (by a writer).
    """
    deadline = time.monotonic() + _PROBE_WAIT
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.01)


def writer_holding(folder: str) -> str | None:
    """Who holds the writer lock of the local ``folder`` now: the line it wrote there (``pid N
    on host``, or ``"another process"``), or None when no live writer does.

    Probes with a shared ``flock`` taken and dropped at once (never through a symlink, never
    blocking); a lock file that cannot be opened is no writer's.
    """
    try:
        fd = os.open(os.path.join(folder, LOCK_NAME),
                     os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return os.pread(fd, 200, 0).decode("utf-8", "replace").strip() or "another process"
        except OSError:
            return None  # not a file flock works on (planted there): no writer's lock
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def remove_stale_temporaries(folder: str) -> list[str]:
    """Remove the temporaries in ``folder`` that no live writer holds.

    Returns:
        The names removed.
    """
    removed: list[str] = []
    try:
        entries = list(os.scandir(folder))
    except FileNotFoundError:
        return removed
    for entry in entries:
        if not TEMPORARY.match(entry.name) or not entry.is_file(follow_symlinks=False):
            continue
        try:
            fd = os.open(entry.path, os.O_RDONLY)
        except FileNotFoundError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            continue  # being written
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(entry.path)
                removed.append(entry.name)
        finally:
            os.close(fd)
    if removed:
        log.info("%s: removed %d temporary file(s) of a writer that did not finish: %s", folder, len(removed),
                 ", ".join(removed[:5]))
    return removed
