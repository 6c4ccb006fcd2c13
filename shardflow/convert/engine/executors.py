"""Where the tasks of a conversion run: in this process, in local processes, or on Dask.

An executor has three methods: ``submit(fn, *args)`` returns a future,
``wait_any(futures)`` blocks until at least one is done and returns the done
ones, ``close()`` cancels what is left. Tasks are pure (the same arguments
write the same bytes to the same names), so an engine may run a task again
when a worker is lost: Dask does so by itself, and the result is the same.
"""

from __future__ import annotations

import collections
import gc
import logging
import os
import pickle
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from typing import Any

from ...errors import ConversionError, missing_dependency
from .groups import writer_init

__all__ = ["Executor", "InlineExecutor", "LocalExecutor", "DaskExecutor", "make_executor"]

log = logging.getLogger(__name__)

_LOG_LENGTH = 10  # messages the Dask client's comm keeps for debugging while converting


class Executor:
    """The interface; see the module docstring."""

    slots: int = 1
    """Tasks worth keeping in flight (twice the workers)."""

    def submit(self, fn: Callable[..., Any], *args: Any) -> Any:
        raise NotImplementedError

    def wait_any(self, futures: Iterable[Any]) -> list[Any]:
        raise NotImplementedError

    def close(self) -> None:
        """Cancel the tasks not started and release the workers."""


class InlineExecutor(Executor):
    """Run each task in this process when it is submitted (``workers=1``, ``memory://``)."""

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        fut: Future = Future()
        try:
            fut.set_result(fn(*args))
        except Exception as e:  # the caller reads it from the future, as from a pool
            fut.set_exception(e)
        return fut

    def wait_any(self, futures: Iterable[Any]) -> list[Any]:
        return list(futures)


class LocalExecutor(Executor):
    """A pool of ``workers`` local processes (they exit if this process dies)."""

    def __init__(self, workers: int) -> None:
        self.slots = 2 * workers
        # The workers start now (forked while the caller lists its inputs), with this
        # process's objects frozen out of the garbage collector: a collection in a forked
        # worker walks every object it inherited and so copies each page it touches (14 ms
        # of CPU per worker per full collection with the CLI's imports, 0.4 ms frozen).
        gc.freeze()
        try:
            self.pool = ProcessPoolExecutor(workers, initializer=writer_init, initargs=(os.getpid(),))
            self.pool.submit(os.getpid)  # (a pool that forks starts all its workers at the first task)
        finally:
            gc.unfreeze()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        """Check here that the task pickles, so that what cannot travel to a worker process is
        an error now (the pool's own feeder thread would drop it, and its shutdown then hangs).

        Raises:
            ConversionError: ``fn`` or an argument (the build function, an input) does not
                pickle: a lambda, a nested function, an open file, a lock.
        """
        try:
            task = pickle.dumps((fn, args), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as e:  # noqa: BLE001 - pickle raises PicklingError, TypeError, AttributeError, ...
            raise ConversionError(
                f"a conversion task cannot be sent to a worker process: {type(e).__name__}: {e}. With workers > 1 "
                "the build function and the inputs must pickle (a module-level function, plain values); "
                "or convert with workers=1"
            ) from e
        return self.pool.submit(run_pickled, task)  # pickled once: the pool sends these bytes as they are

    def wait_any(self, futures: Iterable[Any]) -> list[Any]:
        done, _ = wait(list(futures), return_when=FIRST_COMPLETED)
        return list(done)

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


class DaskExecutor(Executor):
    """Tasks on a Dask cluster through a ``dask.distributed.Client``.

    Each task is submitted with ``pure=False`` under a key of its own, so a
    task lost with its worker is run again by the scheduler on another worker
    (Dask's ``allowed-failures`` bounds how often); the client holds only the
    futures and the small results (shard entries), never shard bytes.
    """

    def __init__(self, client: Any) -> None:
        try:
            import distributed
        except ImportError as e:  # pragma: no cover - a client implies distributed
            raise missing_dependency("distributed", "dask", "converting on a Dask cluster") from e
        self.client = client
        self._wait = distributed.wait
        workers = len(client.scheduler_info().get("workers", {})) or 1
        self.slots = 2 * workers
        self._futures: set[Any] = set()
        # The client's comm to the scheduler keeps its last messages under 1 MB, 1,000 by
        # default (distributed.admin.low-level-log-length), for debugging; every write task is
        # one such message carrying a group's inputs, so the client grew with the tree (56 MiB
        # at 1,000,000 files). Keep a short log while converting; close() puts it back.
        comm = getattr(client, "scheduler_comm", None)
        self._log = getattr(comm, "recent_message_log", None)
        if isinstance(self._log, collections.deque) and (self._log.maxlen or 0) > _LOG_LENGTH:
            comm.recent_message_log = collections.deque(self._log, maxlen=_LOG_LENGTH)
        else:
            self._log = None

    def submit(self, fn: Callable[..., Any], *args: Any) -> Any:
        fut = self.client.submit(fn, *args, pure=False)
        self._futures.add(fut)
        return fut

    def wait_any(self, futures: Iterable[Any]) -> list[Any]:
        done, _ = self._wait(list(futures), return_when="FIRST_COMPLETED")
        self._futures.difference_update(done)
        return list(done)

    def close(self) -> None:
        if self._futures:
            self.client.cancel(list(self._futures))
            self._futures.clear()
        comm = getattr(self.client, "scheduler_comm", None)
        if self._log is not None and comm is not None:
            comm.recent_message_log = collections.deque(comm.recent_message_log, maxlen=self._log.maxlen)
            self._log = None


def run_pickled(task: bytes) -> Any:
    """Worker: run ``fn(*args)`` of a task :meth:`LocalExecutor.submit` pickled: bytes made by
    the converting process for its own worker, as ``ProcessPoolExecutor`` would send them (the
    user's build function and inputs, trusted as docs/security.md says), never data read from a
    source or a shard."""
    fn, args = pickle.loads(task)
    return fn(*args)


def make_executor(workers: int, client: Any = None) -> Executor:
    """The executor for ``workers`` local processes, or for ``client``'s Dask cluster."""
    if client is not None:
        return DaskExecutor(client)
    if workers > 1:
        return LocalExecutor(workers)
    return InlineExecutor()
