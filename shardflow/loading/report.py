"""Is training waiting for data? The loop's side of an epoch's accounting and the verdict.

:class:`LoopAccount` times the training loop around each ``next(loader)`` (waiting) and
between calls (its own step), and keeps each worker's last counters and stage timers
(:mod:`shardflow.accounting`). :class:`Report` is what ``loader.report()`` returns; the rules
behind its sentence are :func:`verdict`'s, written down in docs/insight.md.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .. import accounting
from ..accounting import COUNTERS, STAGES, clock
from ..errors import ShardflowError

__all__ = ["INPUT_BOUND", "ADVICE", "Report", "LoopAccount", "verdict", "gather", "append_jsonl", "Insight", "predicted_cost"]

log = logging.getLogger(__name__)

INPUT_BOUND: float = 0.10
"""The loop is input-bound when it waited for data at least this share of the epoch."""

DOING: dict[str, str] = {
    "fetch": "waiting for shard bytes (network, staging area, cache or disk)",
    "read": "walking tar shards (and decompressing them)",
    "decode": "decoding fields",
    "transform": "in the transform",
    "collate": "collating batches",
    "handover": "handing batches over to the main process",
}

ADVICE: dict[str, str] = {
    "fetch": "more workers (more shards in flight), a cache_dir on local disk (later epochs read no network), "
             "compression='zstd' shards (fewer bytes), or shard affinity (ShuffleConfig(affinity=True))",
    "read": "more workers, or fewer and larger samples (each tar member costs a header to walk)",
    "decode": "more workers, DecodeOptions(jpeg_decoder='simplejpeg'), or smaller images",
    "transform": "more workers, or a cheaper transform (augment on the GPU)",
    "collate": "more workers, or shardflow's default collate instead of a custom collate_fn",
    "handover": "smaller batches or dtypes (uint8 images, normalised on the GPU), or pin_memory=False",
}
"""The knob to turn, by slowest stage, when the loop is input-bound."""


def verdict(wait_fraction: float, stages: Mapping[str, float], workers: int) -> tuple[bool, str, str]:
    """The rules (docs/insight.md): ``(input_bound, slowest_stage, sentence)``.

    Input-bound when ``wait_fraction >= INPUT_BOUND``. The slowest stage is the one with the
    most worker time (the first in :data:`STAGES` on a tie; ``""`` when nothing was timed). The
    sentence gives the wait and the slowest stage's share; when input-bound, the knob for
    that stage (:data:`ADVICE`), led by a worker count when fewer than 2 workers read.
    """
    total = sum(stages.values())
    slowest = max(STAGES, key=lambda s: stages.get(s, 0.0)) if total > 0 else ""
    bound = wait_fraction >= INPUT_BOUND
    head = f"the loop waited for data {wait_fraction:.0%} of the epoch"
    where = f"workers spent {stages[slowest] / total:.0%} of their time {DOING[slowest]}" if slowest else ""
    if not bound:
        tail = f"; {where}" if where else ""
        return False, slowest, f"{head}: not input-bound, the loader needs no change{tail}."
    if not slowest:
        return True, slowest, f"{head}: input-bound; try more workers."
    advice = ADVICE[slowest]
    if workers < 2:
        advice = f"num_workers >= 2 (now {workers}), then {advice}"
    return True, slowest, f"{head}: input-bound; {where}; try {advice}."


@dataclass
class Report:
    """Where one rank's epoch went (``loader.report()``).

    Attributes:
        epoch, rank, world_size, workers: whose epoch (``workers``: DataLoader workers, 0 in-process).
        wait_s: seconds the loop spent inside ``next(loader)``; ``step_s`` between calls.
        batches: batches yielded; ``samples``: samples the workers yielded (exact).
        counters: :data:`shardflow.accounting.COUNTERS`, summed over the rank's processes.
        stages: exclusive seconds per stage, summed over workers.
        worker_stages: the same per worker (DataLoader worker id -> stage -> seconds).
        skipped, retries: samples dropped under ``on_error``; reads retried.
        slowest_rank: with ``report(gather=True)``: ``{"rank", "wait_fraction", "wait_s"}``.
        predicted: what ``shardflow plan`` predicts for this rank's epoch (``requests``,
            ``bytes``, ``requests_max``, ``bytes_max``), beside the measured counters; None
            without a manifest, with a ``cache_dir`` or for a resumed epoch.
    """

    epoch: int
    rank: int
    world_size: int
    workers: int
    wait_s: float
    step_s: float
    batches: int
    samples: int
    skipped: int
    counters: dict[str, int]
    stages: dict[str, float]
    worker_stages: dict[int, dict[str, float]] = field(default_factory=dict)
    slowest_rank: dict[str, Any] | None = None
    predicted: dict[str, int] | None = None
    input_bound: bool = field(init=False)
    slowest_stage: str = field(init=False)
    sentence: str = field(init=False)

    def __post_init__(self) -> None:
        self.input_bound, self.slowest_stage, self.sentence = verdict(self.wait_fraction, self.stages, self.workers)

    @property
    def wait_fraction(self) -> float:
        """Share of the epoch (wait + step) the loop waited for data."""
        total = self.wait_s + self.step_s
        return self.wait_s / total if total > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        """Plain data (JSON-ready): the fields, ``wait_fraction``, ``input_bound``,
        ``slowest_stage``, ``sentence``, ``bytes_read`` (shard bytes, network + local) and
        ``requests`` (shard GETs)."""
        c = self.counters
        out: dict[str, Any] = {
            "epoch": self.epoch, "rank": self.rank, "world_size": self.world_size, "workers": self.workers,
            "wait_fraction": round(self.wait_fraction, 4), "wait_s": round(self.wait_s, 6),
            "step_s": round(self.step_s, 6), "input_bound": self.input_bound,
            "slowest_stage": self.slowest_stage, "stages": {k: round(v, 6) for k, v in self.stages.items()},
            "worker_stages": {str(w): {k: round(v, 6) for k, v in st.items()} for w, st in sorted(self.worker_stages.items())},
            "batches": self.batches, "samples": self.samples, "skipped": self.skipped,
            "bytes_read": c.get("bytes_network", 0) + c.get("bytes_local", 0),
            "bytes_network": c.get("bytes_network", 0), "bytes_local": c.get("bytes_local", 0),
            "requests": c.get("requests", 0), "retries": c.get("retries", 0),
            "cache_hits": c.get("cache_hits", 0), "cache_fills": c.get("cache_fills", 0),
            "staged_reads": c.get("staged_reads", 0), "meta_requests": c.get("meta_requests", 0),
            "meta_bytes": c.get("meta_bytes", 0), "sentence": self.sentence,
        }
        if self.slowest_rank is not None:
            out["slowest_rank"] = self.slowest_rank
        if self.predicted is not None:
            out["predicted"] = dict(self.predicted)
        return out

    def __str__(self) -> str:
        return self.sentence


class LoopAccount:
    """The main process's side of one rank's epoch: the loop's waits and steps, the workers'
    last counters and timers.

    Args:
        epoch, rank, world_size, workers: whose epoch.
        on: accounting is on (off: only the loop's wait is still timed; stages stay 0).
        trace: a :class:`shardflow.loading.tracing.TraceWindow` to feed, or None.
        predict: returns the epoch's predicted GETs and bytes (see :func:`predicted_cost`).
    """

    def __init__(self, epoch: int, rank: int, world_size: int, workers: int, on: bool = True, trace: Any = None,
                 predict: Callable[[], dict[str, int] | None] | None = None) -> None:
        self.epoch, self.rank, self.world_size, self.workers = epoch, rank, world_size, workers
        self.predict = predict
        self.on = on
        self.trace = trace
        self.base = accounting.snapshot()
        self.wait_ns = 0
        self.step_ns = 0
        self.batches = 0
        self.last: int | None = None  # when the previous next() returned
        self.by_worker: dict[int, Mapping[str, int]] = {}

    def before(self) -> int:
        """Just before ``next()`` of the DataLoader: the loop's step since the last one ends."""
        t = clock()
        if self.last is not None:
            self.step_ns += t - self.last
            if self.trace is not None:
                self.trace.loop("step", self.last, t)
        return t

    def after(self, t0: int, item: Any) -> None:
        """Just after ``next()`` returned ``item`` (a WorkerItem or None), begun at ``t0``."""
        t = clock()
        self.wait_ns += t - t0
        self.last = t
        if self.trace is not None:
            self.trace.loop("wait", t0, t)
        acct = getattr(item, "acct", None)
        if acct is not None:
            if self.trace is not None:
                self.trace.worker(item.worker, item.index, self.by_worker.get(item.worker), acct)
            self.by_worker[item.worker] = acct

    def yielded(self) -> None:
        """A batch went to the loop."""
        self.batches += 1

    def totals(self) -> dict[str, int]:
        """Counters and timers of the rank: the workers' last ones, plus what the main
        process itself did (prefetches, copies out of the workers' buffers) when workers read."""
        total: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        parts = list(self.by_worker.values())
        if self.workers > 0 or not parts:
            parts.append(accounting.since(self.base))
        for part in parts:
            for k, v in part.items():
                if k not in ("began", "at"):
                    total[k] = total.get(k, 0) + v
        return total

    def report(self, stats: Mapping[str, int]) -> Report:
        """The report of the epoch so far; ``stats``: the run's merged ``dataset.stats``."""
        total = self.totals()  # before predicting: an offset index read for it is not the epoch's
        stages = accounting.stage_seconds(total) if self.on else dict.fromkeys(STAGES, 0.0)
        return Report(
            epoch=self.epoch, rank=self.rank, world_size=self.world_size, workers=self.workers,
            wait_s=self.wait_ns / 1e9, step_s=self.step_ns / 1e9, batches=self.batches,
            samples=int(stats.get("samples", 0)), skipped=int(stats.get("skipped", 0)),
            counters={k: total[k] for k in COUNTERS}, stages=stages,
            worker_stages={w: accounting.stage_seconds(v) for w, v in self.by_worker.items()} if self.on else {},
            predicted=self.predict() if self.predict is not None else None,
        )


def append_jsonl(path: str, report: Report) -> None:
    """Append ``report.to_dict()`` as one JSON line to ``path`` (a local file)."""
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(report.to_dict(), sort_keys=True) + "\n")


def gather(report: Report) -> Report:
    """Every rank's wait, gathered with ``torch.distributed`` (a collective: every rank
    calls it); ``report.slowest_rank`` names the rank that waited longest. Without an
    initialised process group the report comes back as it is.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return report
    mine = {"rank": dist.get_rank(), "wait_fraction": round(report.wait_fraction, 4), "wait_s": round(report.wait_s, 6)}
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    report.slowest_rank = max(every, key=lambda r: (r["wait_s"], -r["rank"]))
    return report


class Insight:
    """A loader's accounting across epochs: the current epoch's :class:`LoopAccount`, the
    per-epoch JSON lines and the trace window.

    Args:
        on: accounting on (the loader's ``accounting``).
        trace: path of a trace file for the first epoch's first batches (None: no trace).
        report_path: a JSON-lines file to which each epoch's report is appended (None: none).
    """

    def __init__(self, on: bool = True, trace: str | None = None, report_path: str | None = None) -> None:
        self.on = on
        self.trace_path = trace
        self.report_path = report_path
        self.current: LoopAccount | None = None
        self.window: Any = None

    def begin(self, epoch: int, rank: int, world_size: int, workers: int,
              predict: Callable[[], dict[str, int] | None] | None = None) -> LoopAccount:
        """A new epoch's account (an ``iter()`` of the loader); ``predict``: see :class:`LoopAccount`."""
        if self.trace_path is not None and self.window is None:
            from .tracing import TraceWindow

            self.window = TraceWindow(self.trace_path, rank)
        trace = self.window if self.window is not None and not self.window.written else None
        self.current = LoopAccount(epoch, rank, world_size, workers, self.on, trace, predict)
        return self.current

    def end(self, stats: Mapping[str, int], finished: bool) -> None:
        """The epoch's iteration ended (``finished``: it reached its end): write its line and the trace."""
        if self.current is None:
            return
        if self.window is not None and not self.window.written:
            self.window.write()
        if finished and self.report_path is not None:
            append_jsonl(self.report_path, self.current.report(stats))

    def report(self, stats: Mapping[str, int], gathered: bool = False) -> Report:
        """The current (or last) epoch's report; ``gathered``: with every rank's wait (a collective)."""
        if self.current is None:
            raise ShardflowError("no report yet: iterate the loader first")
        out = self.current.report(stats)
        return gather(out) if gathered else out


def predicted_cost(dataset: Any, epoch: int, rank: int, workers: int) -> dict[str, int] | None:
    """What ``shardflow plan`` predicts for one rank's epoch of ``dataset`` (a ShardDataset):
    ``{"requests", "bytes", "requests_max", "bytes_max"}``; None without a manifest or with
    a ``cache_dir`` (what a cache holds is not in the plan)."""
    from ..reader.epochcost import rank_cost

    if not dataset.sized or dataset.io.cache_dir is not None:
        return None
    interleave = dataset.shuffle.interleave if dataset.shuffle.enabled else 1
    cost = rank_cost(dataset.plan(epoch, rank), dataset.shards, dataset.io, workers, interleave)
    return {"requests": cost.requests, "bytes": cost.bytes, "requests_max": cost.requests_max, "bytes_max": cost.bytes_max}
