"""A Chrome/Perfetto trace of a window of batches: each worker's stages and the loop's waits.

``shardflow.loader(..., trace=PATH)`` writes PATH as trace-event JSON (``{"traceEvents": [...]}``,
complete events ``ph="X"`` with ``ts`` and ``dur`` in microseconds, ``pid`` the rank, ``tid`` 0
for the training loop and ``1 + w`` for worker ``w``), which opens in https://ui.perfetto.dev
or chrome://tracing. Workers send cumulative stage timers with each batch
(:mod:`shardflow.accounting`); a batch's slice spans the worker's time from its previous batch to
this one, and its stages are laid out inside it one after the other, in pipeline order, each as
long as the worker spent in it for that batch (the stages of one batch interleave sample by
sample in reality; their lengths are exact, their order within the batch is drawn).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from typing import Any

from ..accounting import STAGES, stage_seconds

__all__ = ["TRACE_BATCHES", "TraceWindow"]

log = logging.getLogger(__name__)

TRACE_BATCHES: int = 200
"""Batches of the first epoch traced (the loop's waits and steps, and the workers' batches)."""


class TraceWindow:
    """Trace events of the first ``batches`` batches, written to ``path`` by :meth:`write`.

    Args:
        path: the JSON file to write (local path).
        rank: the rank (the events' ``pid``).
        batches: batches to trace (default :data:`TRACE_BATCHES`).
    """

    def __init__(self, path: str, rank: int = 0, batches: int | None = None) -> None:
        self.path = os.fspath(path)
        self.rank = rank
        self.limit = TRACE_BATCHES if batches is None else batches
        self.events: list[dict[str, Any]] = []
        self.waits = 0
        self.threads: set[int] = set()
        self.written = False

    @property
    def full(self) -> bool:
        """The window has its batches."""
        return self.waits >= self.limit

    def _slice(self, name: str, tid: int, t0: int, t1: int, args: Mapping[str, Any] | None = None) -> None:
        self.threads.add(tid)
        event: dict[str, Any] = {"name": name, "cat": "shardflow", "ph": "X", "ts": t0 / 1e3,
                                 "dur": max(t1 - t0, 0) / 1e3, "pid": self.rank, "tid": tid}
        if args:
            event["args"] = dict(args)
        self.events.append(event)

    def loop(self, name: str, t0: int, t1: int) -> None:
        """The loop's ``"wait"`` in ``next(loader)`` or its ``"step"`` between calls (clock ns)."""
        if self.full or self.written:
            return
        if name == "wait":
            self.waits += 1
        self._slice(name, 0, t0, t1)

    def worker(self, w: int, index: int, prev: Mapping[str, int] | None, now: Mapping[str, int]) -> None:
        """Worker ``w``'s batch ``index`` (-1: its end of the epoch), from its previous counters
        ``prev`` (None for its first batch) to ``now``."""
        if self.full or self.written:
            return
        start = prev["at"] if prev is not None else now["began"]
        end = now["at"]
        delta = {k: v - (prev or {}).get(k, 0) for k, v in now.items()}
        tid = 1 + w
        self._slice(f"batch {index}" if index >= 0 else "end", tid, start, end,
                    {k: delta[k] for k in ("bytes_network", "bytes_local", "requests") if delta.get(k)})
        at = start
        for stage, seconds in stage_seconds(delta).items():
            ns = min(int(seconds * 1e9), max(end - at, 0))
            if ns > 0 and stage in STAGES:
                self._slice(stage, tid, at, at + ns)
                at += ns

    def write(self) -> None:
        """Write the trace file (once)."""
        if self.written:
            return
        self.written = True
        names = [{"name": "thread_name", "ph": "M", "pid": self.rank, "tid": tid, "ts": 0,
                  "args": {"name": "training loop" if tid == 0 else f"worker {tid - 1}"}} for tid in sorted(self.threads)]
        names.append({"name": "process_name", "ph": "M", "pid": self.rank, "tid": 0, "ts": 0,
                      "args": {"name": f"rank {self.rank}"}})
        with open(self.path, "w", encoding="utf-8") as f:
            json.dump({"traceEvents": names + self.events, "displayTimeUnit": "ms"}, f)
        log.info("wrote a trace of %d events to %s", len(self.events), self.path)
