"""Who is reading: rank, world size, DataLoader worker.

:meth:`World.detect` is the one place that looks at ``torch.distributed``,
the ``RANK``/``WORLD_SIZE`` environment variables (set by ``torchrun``) and
``torch.utils.data.get_worker_info()``. Everything else takes a :class:`World`
value, so splitting and shuffling are pure functions that tests call directly.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from dataclasses import dataclass, replace
from typing import Any

__all__ = ["World", "stable_seed", "exit_with_parent", "PARENT_POLL_S"]

PARENT_POLL_S = 1.0
"""Seconds between two checks, in a DataLoader worker, that the process that started it lives."""

_watching = 0  # the pid that watches its parent (a forked child has no watching thread)


@dataclass(frozen=True)
class World:
    """Position of one reader among all readers of an epoch.

    Attributes:
        rank: this process's rank, ``0 <= rank < world_size``.
        world_size: number of ranks (DDP processes).
        worker: DataLoader worker id in this rank, ``0 <= worker < num_workers``.
        num_workers: DataLoader workers per rank (1 when loading in the main process).
    """

    rank: int = 0
    world_size: int = 1
    worker: int = 0
    num_workers: int = 1

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"invalid rank {self.rank} for world size {self.world_size}")
        if self.num_workers < 1 or not 0 <= self.worker < self.num_workers:
            raise ValueError(f"invalid worker {self.worker} for {self.num_workers} workers")

    @classmethod
    def detect(
        cls, rank: int | None = None, world_size: int | None = None, default: tuple[int, int] | None = None
    ) -> World:
        """Detect rank, world size and DataLoader worker.

        Explicit ``rank``/``world_size`` win; else an initialized
        ``torch.distributed`` process group; else the ``RANK`` and
        ``WORLD_SIZE`` environment variables (as set by torchrun); else
        ``default`` (the ranks the main process detected: a DataLoader worker
        started with ``spawn`` sees no process group); else 0 / 1.

        Raises:
            ValueError: only one of ``rank``/``world_size`` is given, or
                they are inconsistent.
        """
        if (rank is None) != (world_size is None):
            raise ValueError("pass both rank and world_size, or neither")
        if rank is None or world_size is None:
            rank, world_size = _detect_ranks(default or (0, 1))
        worker, num_workers = 0, 1
        info = _worker_info()
        if info is not None:
            worker, num_workers = info.id, info.num_workers
            exit_with_parent()
        return cls(rank=rank, world_size=world_size, worker=worker, num_workers=num_workers)

    @staticmethod
    def in_worker() -> bool:
        """Whether this process is a DataLoader worker (``get_worker_info()`` is not None)."""
        return _worker_info() is not None

    def with_workers(self, worker: int, num_workers: int) -> World:
        """The same ranks with another worker position."""
        return replace(self, worker=worker, num_workers=num_workers)


def _worker_info() -> Any:
    try:
        from torch.utils.data import get_worker_info
    except ImportError:  # pragma: no cover - torch is a hard dependency
        return None
    return get_worker_info()


def _detect_ranks(default: tuple[int, int]) -> tuple[int, int]:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
    except ImportError:  # pragma: no cover
        pass
    if "WORLD_SIZE" in os.environ:
        return int(os.environ.get("RANK", "0")), int(os.environ["WORLD_SIZE"])
    return default


def stable_seed(*parts: object) -> int:
    """A 64-bit seed derived from the parts with SHA-256 (stable across runs,
    machines and Python versions, unlike ``hash()``)."""
    text = "/".join(str(p) for p in parts).encode()
    return int.from_bytes(hashlib.sha256(text).digest()[:8], "little")


def exit_with_parent(parent: int | None = None, poll: float = PARENT_POLL_S) -> None:
    """Make this process (a DataLoader worker, a conversion's writer) end when the process
    that started it dies.

    A worker blocked in a read (a stalled request, a read-ahead thread) would
    outlive a main process that was killed. A daemon thread checks the parent
    pid every :data:`PARENT_POLL_S` seconds and exits the process once it
    changed (the worker was re-parented: its parent process is gone). Not
    ``prctl(PR_SET_PDEATHSIG)``: Linux sends that signal when the parent
    *thread* exits, which kills the healthy persistent workers of a loader
    iterated first from a thread that has since ended.
    Idempotent: the first call per process sets it up. Called by
    :meth:`World.detect` inside DataLoader workers, and as the initializer of a
    conversion's local writer processes (:mod:`shardflow.convert.engine.executors`).

    Args:
        parent: the pid whose end ends this process (default: this one's parent now).
        poll: seconds between checks.
    """
    global _watching
    if _watching == os.getpid():
        return
    _watching = os.getpid()
    parent = os.getppid() if parent is None else parent

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll)
        os._exit(1)

    threading.Thread(target=watch, name="shardflow-parent-watch", daemon=True).start()
