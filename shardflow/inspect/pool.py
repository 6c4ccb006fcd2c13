"""The shard pool of :mod:`shardflow.inspect`: one task per shard over worker processes,
with progress counted in samples and passed on at most every ``_TICK_SECONDS``."""

from __future__ import annotations

import multiprocessing
import os
import queue
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from typing import Any

from ..format.keys import codec_extension
from ..sources.source import ShardSet

__all__ = ["Progress", "Ticker", "default_workers", "map_shards", "preload"]

Progress = Callable[[int], None]
_TICK_SECONDS = 0.1  # workers report progress at most this often
_QUEUE: Any = None  # progress queue of a worker process, set by _init_worker


def _init_worker(q: Any) -> None:
    global _QUEUE
    _QUEUE = q


class Ticker:
    """Counts done samples and passes them on at most every ``_TICK_SECONDS``."""

    def __init__(self, sink: Progress | None) -> None:
        self._sink = sink
        self._pending = 0
        self._last = time.monotonic()

    def __call__(self, n: int = 1) -> None:
        self._pending += n
        now = time.monotonic()
        if now - self._last >= _TICK_SECONDS:
            self.flush()
            self._last = now

    def flush(self) -> None:
        if self._pending and self._sink is not None:
            self._sink(self._pending)
        self._pending = 0


def _worker_ticker() -> Ticker:
    return Ticker(_QUEUE.put if _QUEUE is not None else None)


def _drain(q: Any, progress: Progress | None) -> None:
    while True:
        try:
            n = q.get_nowait()
        except queue.Empty:
            return
        if progress is not None:
            progress(n)


_BYTES_PER_WORKER = 32 << 20  # by default, one more process per this many shard bytes


def default_workers(src: ShardSet) -> int:
    """CPU count, fewer for small datasets (a process costs more than it saves there)."""
    cpus = os.cpu_count() or 1
    m = src.manifest
    if m is not None and m.shards and all(s.bytes >= 0 for s in m.shards):
        return max(1, min(cpus, sum(s.bytes for s in m.shards) // _BYTES_PER_WORKER + 1))
    return cpus


def preload(src: ShardSet, workers: int) -> None:
    """Import the graph codec's dependencies once before worker processes fork."""
    m = src.manifest
    if workers > 1 and m is not None and any(codec_extension(f) == "pyg" for f in m.fields):
        try:
            import torch_geometric.data  # noqa: F401
        except ImportError:
            pass  # each graph then fails to decode with a message naming the extra


def map_shards(fn: Callable[[Any, Ticker], Any], tasks: Sequence[Any], workers: int, progress: Progress | None) -> list[Any]:
    """``[fn(t, ticker) for t in tasks]``, over ``workers`` processes (1: in this process).

    ``fn`` reports progress through the ticker it is given.
    """
    if not tasks:
        return []
    workers = max(1, min(workers, len(tasks)))
    if workers == 1:
        global _QUEUE
        saved, _QUEUE = _QUEUE, None
        out = []
        try:
            for t in tasks:
                ticker = Ticker(progress)
                out.append(fn(t, ticker))
                ticker.flush()
        finally:
            _QUEUE = saved
        return out
    ctx = multiprocessing.get_context()
    q = ctx.Queue()
    results: list[Any] = [None] * len(tasks)
    with ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init_worker, initargs=(q,)) as ex:
        futures = {ex.submit(_run_task, fn, t): i for i, t in enumerate(tasks)}
        pending = set(futures)
        while pending:
            done, pending = wait(pending, timeout=_TICK_SECONDS, return_when=FIRST_COMPLETED)
            _drain(q, progress)
            for f in done:
                results[futures[f]] = f.result()
    _drain(q, progress)
    q.close()
    return results


def _run_task(fn: Callable[[Any, Ticker], Any], task: Any) -> Any:
    ticker = _worker_ticker()
    try:
        return fn(task, ticker)
    finally:
        ticker.flush()
