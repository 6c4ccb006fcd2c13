"""Fork hooks: filesystems inherited by a forked child are kept alive there, and the
shared S3 session drops its loop-bound credentials.

Importing this module registers the hooks (once per process)."""

from __future__ import annotations

import os
import sys
from typing import Any

from .filesystems import s3_session_after_fork

# Filesystems that exist when the process forks (a DataLoader starting its workers)
# hold the parent's event-loop state, and the child shares the kernel objects behind
# it (the epoll set, the sockets of pooled connections). fsspec empties its instance
# caches in the child; were the parent's instances then garbage collected there, their
# finalizers would close those connections through the shared epoll set, and the
# parent's next request on one would hang. So each child keeps them, unused, for its
# life (DataLoader and process-pool workers end with os._exit, which runs no finalizer).
_INHERITED: list[Any] = []


def filesystem_instances() -> list[Any]:
    """Every fsspec filesystem instance cached in this process (none before fsspec is imported)."""
    found: list[Any] = []
    fsspec = sys.modules.get("fsspec")
    if fsspec is None:
        return found
    seen: set[type] = set()
    pending: list[type] = [fsspec.AbstractFileSystem]
    while pending:
        cls = pending.pop()
        for sub in cls.__subclasses__():
            if sub not in seen:
                seen.add(sub)
                pending.append(sub)
        cache = cls.__dict__.get("_cache")
        if cache:
            for _attempt in range(3):  # another thread may add an instance meanwhile
                try:
                    found.extend(cache.values())
                    break
                except RuntimeError:
                    continue
    return found


def before_fork() -> None:
    """Keep the filesystems alive across the fork (the child never collects them)."""
    _INHERITED.extend(filesystem_instances())


def after_fork_in_parent() -> None:
    """The parent lets go of the references taken for the child."""
    _INHERITED.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=before_fork, after_in_parent=after_fork_in_parent,
                        after_in_child=s3_session_after_fork)
