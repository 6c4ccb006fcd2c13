"""A DataLoader with the right settings for a :class:`ShardDataset`."""

from __future__ import annotations

import logging
import weakref
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from .collation import collate as default_collate
from .compat.torch import shutdown_workers
from .dataloader import DataLoader  # torch's, warning once about the worker count
from .batching import Batching, WorkerItem
from .dataset import ShardDataset
from .errors import ShardflowError, StateError
from . import transfer

__all__ = ["loader", "ShardLoader"]

log = logging.getLogger(__name__)


class ShardLoader:
    """Batches from a :class:`ShardDataset` through a ``torch.utils.data.DataLoader``.

    Workers read, decode, transform and collate whole batches; the loader
    yields them in the DataLoader's order and keeps track of which batches the
    training loop has received, for :meth:`state_dict`.

    With a manifest, ``len(loader)`` is the number of batches every rank
    yields per epoch, the same for every ``num_workers``; ``drop_last`` drops
    each rank's last incomplete batch (one per rank, not one per worker).

    Epochs: each ``iter()`` starts the epoch given to ``dataset.set_epoch``
    since the last iteration, or else the epoch after the previous one.

    Args:
        dataset: the :class:`ShardDataset` to read.
        batch_size: samples per batch.
        num_workers: DataLoader worker processes per rank (0: read in this process).
        drop_last: drop each rank's last incomplete batch.
        collate_fn: ``collate_fn(list of samples) -> batch``, run in the
            workers; default :func:`shardflow.collation.collate` (dicts of
            stacked tensors, PyG ``Batch`` for graphs, lists for strings).
        persistent_workers: keep workers alive between epochs.
        pin_memory: pin batches in page-locked memory (for CUDA copies).
        prefetch_factor: batches prefetched per worker (DataLoader's default 2).
        multiprocessing_context: ``"fork"``, ``"spawn"`` or ``"forkserver"``.
        timeout: seconds to wait for a batch from a worker (0: forever).
        max_cost: batch by cost instead of count: a batch takes samples while
            their summed ``cost`` stays within ``max_cost`` (and at most
            ``batch_size`` samples); for graph datasets whose sizes vary by
            orders of magnitude. Every rank still yields the same number of
            batches (see :class:`~shardflow.plan.SplitConfig`).
            Several budgets at once: a mapping of size columns to budgets,
            ``max_cost={"num_nodes": 20000, "num_edges": 80000}``; a batch then
            stays within every one of them.
        cost: the per-sample size an int ``max_cost`` sums, a column of the
            manifest's sizes index: ``"num_nodes"`` or ``"num_edges"`` for graph
            shards.
    """

    def __init__(
        self,
        dataset: ShardDataset,
        batch_size: int,
        *,
        num_workers: int = 0,
        drop_last: bool = False,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        persistent_workers: bool = False,
        pin_memory: bool = False,
        prefetch_factor: int | None = None,
        multiprocessing_context: Any = None,
        timeout: float = 0,
        max_cost: int | Mapping[str, int] | None = None,
        cost: str = "num_nodes",
    ) -> None:
        if not isinstance(dataset, ShardDataset):
            raise TypeError(f"shardflow.loader needs a ShardDataset, got {type(dataset).__name__}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {num_workers}")
        self.dataset = dataset
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.drop_last = drop_last
        self.collate_fn = collate_fn or default_collate
        dataset.set_batching(Batching(batch_size, drop_last, self.collate_fn, max_cost, cost))
        if drop_last and num_workers > 1 and not dataset.sized:
            log.warning(
                "without a manifest, drop_last drops each DataLoader worker's last incomplete batch (up to %d "
                "per epoch, or everything when a worker holds less than one batch); write a manifest with "
                "`shardflow index` for one drop per rank",
                num_workers,
            )
        self._dl_kwargs: dict[str, Any] = {
            "batch_size": None,
            "num_workers": num_workers,
            "pin_memory": pin_memory,
            "timeout": timeout,
        }
        if num_workers > 0:
            self._dl_kwargs["persistent_workers"] = persistent_workers
            if prefetch_factor is not None:
                self._dl_kwargs["prefetch_factor"] = prefetch_factor
            if multiprocessing_context is not None:
                self._dl_kwargs["multiprocessing_context"] = multiprocessing_context
        self._dl: DataLoader | None = None
        self._epoch: int | None = None
        self._pending: Mapping[str, Any] | None = None
        self._lists: list[list[int]] = []
        self._taken: list[int] = []
        self._streams: list[int] = []
        self._layout: tuple[tuple[int, int], ...] = ()
        self._next_worker = 0
        self._active = False
        self._pools: set[int] = set()  # the workers' batch buffer pools mapped here (shardflow.transfer)
        weakref.finalize(self, transfer.forget, self._pools)

    @property
    def workers(self) -> int:
        """Reading processes per rank (1 when reading in the main process)."""
        return max(self.num_workers, 1)

    def __len__(self) -> int:
        """Batches per epoch of this rank: of the epoch being iterated, or else of
        the one the next ``iter()`` starts (they differ only under ``max_cost``).

        Raises:
            TypeError: the dataset has no manifest (unsized stream).
        """
        epoch = self._epoch if self._active and self._epoch is not None else self._coming_epoch()
        return self.dataset.num_batches(self.workers, epoch, self._pending)

    def _coming_epoch(self) -> int:
        """The epoch the next ``iter()`` starts."""
        ds = self.dataset
        if self._pending is not None:
            return int(self._pending["epoch"])
        if ds.requested_epoch is not None:
            return ds.requested_epoch
        return ds.epoch if self._epoch is None else self._epoch + 1

    def _dataloader(self, fresh: bool) -> DataLoader:
        if self._dl is None or fresh:
            transfer.forget(self._pools)  # the workers of an earlier DataLoader send no more
            self._pools.clear()
            self._dl = DataLoader(self.dataset, **self._dl_kwargs)
        return self._dl

    def __iter__(self) -> Iterator[Any]:
        ds = self.dataset
        epoch = self._coming_epoch()
        pending, self._pending = self._pending, None
        resume = ds.begin_epoch(epoch, pending, self.workers)
        self._epoch = epoch
        k = self.workers
        if ds.sized:  # one sequence of batches (plan order), whatever the worker count
            self._lists = [[resume.step if resume is not None else 0]]
            self._layout = resume.layout if resume is not None else ()
        else:
            base = list(resume.skip) if resume is not None else [0] * k
            self._lists = [[b] for b in base]
            self._streams = list(resume.streams) if resume is not None else list(range(k))
        self._taken = [0] * k
        self._next_worker = 0
        return self._run(resume is not None)

    def _run(self, resuming: bool) -> Iterator[Any]:
        ds = self.dataset
        ds.world()  # detect the ranks here, in the main process: workers get them with the dataset
        with ds.loader_iteration():  # (workers started now, forked or pickled, carry the flag)
            yield from self._batches(resuming)

    def _batches(self, resuming: bool) -> Iterator[Any]:
        ds = self.dataset
        it = iter(self._dataloader(fresh=resuming))
        ds.workers_started()  # the workers have their copy; later epochs start afresh
        stats: dict[int, dict[str, int]] = {}
        self._active = True
        last: Any = None
        owed = 0  # planned batches whose samples were all dropped, before any batch arrived
        repeated = 0
        again = 0  # samples yielded again in the repeated batches
        try:
            for item in it:
                if not isinstance(item, WorkerItem):
                    raise ShardflowError(f"internal: a worker yielded {type(item).__name__}, not a batch")
                stats[item.worker] = item.stats
                if item.pools:
                    self._pools |= item.pools
                ds.stats = _merge_stats(stats)
                if repeated:
                    ds.stats["repeated_batches"] = repeated
                if item.final:
                    continue
                self._taken[item.worker] += 1
                self._next_worker = (item.worker + 1) % self.workers
                if item.data is None:
                    # every sample of this batch was dropped (on_error="skip"): repeat the
                    # previous batch so that every rank still takes len(loader) steps
                    repeated += 1
                    ds.stats["repeated_batches"] = repeated
                    if last is None:
                        owed += 1
                        continue
                    again += batch_samples(last)
                    yield last
                    continue
                last = item.data
                again += owed * batch_samples(item.data)
                for _ in range(owed):
                    yield item.data
                owed = 0
                yield item.data
            if repeated:
                warn_repeated(ds, self._epoch, repeated, again)
            if owed:
                raise ShardflowError(
                    f"every sample of the epoch's batches was dropped under on_error={ds.on_error!r} "
                    f"({dict(ds.stats)}): there is no batch to yield"
                )
            if self.num_workers > 1 and ds.stats["skipped"] and not ds.stats["samples"]:
                # each worker only knows its own share; the pass as a whole yielded nothing
                raise ShardflowError(
                    f"the pass yielded no sample: all {ds.stats['skipped']} were dropped under "
                    f"on_error={ds.on_error!r} ({dict(ds.stats)}); set on_error='raise' to see the first error"
                )
        finally:
            self._active = False
            if self.num_workers > 0 and not self._dl_kwargs.get("persistent_workers"):
                # Shut the workers down now: an exception's traceback holds the iterator
                # (its frames), which would keep them running until it is collected.
                shutdown_workers(it)
                del it
                transfer.forget(self._pools)  # unmap the stopped workers' batch buffers
                self._pools.clear()
        self._lists = []

    def state_dict(self) -> dict[str, Any]:
        """Position in the epoch: which batches the training loop has received.

        Loaded into a fresh dataset and loader (same configuration), the next
        iteration yields exactly the batches not yet received, in the same
        order as the uninterrupted run. With a manifest, ranks step in
        lock-step, so the state of any one rank loads on every rank; the worker
        count may change (the batch sequence does not depend on it), and so may
        the world size: the samples the saved ranks had not taken are then
        shared equally among the new ranks, each exactly once (plus declared
        padding), and later epochs are plain epochs of the new world (see
        :mod:`shardflow.elastic`). A different batch size, seed, shuffle or
        set of shards raises :class:`~shardflow.errors.StateError`, as does,
        without a manifest, another world size, rank or worker count.
        """
        ds = self.dataset
        if self._pending is not None:  # loaded, not iterated yet: keep that position
            return dict(self._pending)
        if not self._lists:
            return ds.make_state("ShardLoader", self.workers, self._coming_epoch(), [], 0)
        if ds.sized:  # the layout of the epoch: the same on every rank (see shardflow.elastic)
            remaining = ds.position(self._layout, self._lists[0][0] + sum(self._taken))
            next_worker = 0
        else:  # by stream: worker w may continue another stream after a resume
            remaining = [0] * len(self._lists)
            for w, (lst, t) in enumerate(zip(self._lists, self._taken)):
                remaining[self._streams[w]] = lst[0] + t
            next_worker = self._streams[self._next_worker]
        return ds.make_state("ShardLoader", self.workers, int(self._epoch or 0), remaining, next_worker)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume at the next ``iter()`` from :meth:`state_dict`.

        Raises:
            StateError: another version or configuration (lists the differences),
                or a different worker count without a manifest.
        """
        if self._active:
            raise StateError("load_state_dict() while an iteration is running; load before iterating")
        self.dataset.check_state(state, "ShardLoader", self.workers)
        self._pending = dict(state)
        self._dl = None  # persistent workers must restart to see the resume point


def _merge_stats(per_worker: Mapping[int, Mapping[str, Any]]) -> Counter[str]:
    """Sum the workers' counters; shard-level problems count each shard once
    (several workers may read parts of the same bad shard)."""
    total: Counter[str] = Counter()
    shards: dict[str, set[str]] = {}
    for stats in per_worker.values():
        for key, value in stats.items():
            if key == "bad_shards":
                for reason, urls in value.items():
                    shards.setdefault(reason, set()).update(urls)
            else:
                total[key] += value
    for reason, urls in shards.items():
        total[reason] = len(urls)
    return total


def batch_samples(batch: Any) -> int:
    """Samples in a collated batch: its ``__key__`` list (0 when a custom collate kept none)."""
    keys = batch.get("__key__") if isinstance(batch, Mapping) else None
    return len(keys) if isinstance(keys, (list, tuple)) else 0


def warn_repeated(ds: Any, epoch: int | None, batches: int, samples: int) -> None:
    """The once-per-epoch warning that batches were repeated to keep the ranks' batch counts equal."""
    log.warning(
        "epoch %s: %d batch(es) of this rank had every sample dropped (%d filtered by the transform returning "
        "None, %d skipped under on_error=%r) and were replaced by a repeat of a batch: %d sample(s) seen again "
        "this epoch, so that every rank takes len(loader) steps. To select samples without repeats, plan the "
        "selection: ShardDataset(select=...)",
        epoch, batches, ds.stats.get("filtered", 0), ds.stats.get("skipped", 0), ds.on_error, samples,
    )


def loader(dataset: ShardDataset, batch_size: int = 64, **options: Any) -> ShardLoader:
    """Build a :class:`ShardLoader`: a DataLoader with the right settings.

    Args:
        dataset: the :class:`ShardDataset` to read.
        batch_size: samples per batch.
        **options: the keyword arguments of :class:`ShardLoader` (``num_workers``,
            ``drop_last``, ``collate_fn``, ``max_cost``, ...).

    Returns:
        The loader; iterate it, ``len()`` it, ``state_dict()`` it.
    """
    return ShardLoader(dataset, batch_size, **options)
