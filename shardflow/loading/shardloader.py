"""A DataLoader with the right settings for a :class:`ShardDataset`."""

from __future__ import annotations

import inspect
import multiprocessing
import weakref
from functools import partial
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from torch.utils.data import DataLoader as TorchDataLoader

from .collation import collate as default_collate
from ..compat.torch import drop_iterator, shutdown_workers
from .dataloader import DataLoader  # torch's, warning once about the worker count
from .batching import Batching, WorkerItem
from ..dataset import EpochRun, ShardDataset
from ..errors import ShardflowError, StateError
from . import transfer
from .report import Insight, Report, predicted_cost

__all__ = ["loader", "ShardLoader", "WORKER_ONLY", "options"]

WORKER_ONLY = ("persistent_workers", "prefetch_factor", "multiprocessing_context")
"""DataLoader keywords that only mean something with workers (ignored with ``num_workers=0``)."""


class ShardLoader(DataLoader):
    """Batches from a :class:`ShardDataset`: a ``torch.utils.data.DataLoader`` whose workers
    read, decode, transform and collate whole batches.

    It is a DataLoader (``isinstance(loader, torch.utils.data.DataLoader)``), as PyG's and
    LitData's loaders are: every DataLoader keyword (``num_workers``, ``pin_memory``,
    ``prefetch_factor``, ``persistent_workers``, ``multiprocessing_context``, ``timeout``,
    ``worker_init_fn``, ``generator``, ...) passes through with torch's meaning and default.
    The loader yields the batches in the DataLoader's order and keeps track of which
    batches the training loop has received, for :meth:`state_dict`.
    :func:`shardflow.loader` builds the same loader with the same defaults.

    With a manifest, ``len(loader)`` is the number of batches every rank
    yields per epoch, the same for every ``num_workers``; ``drop_last`` drops
    each rank's last incomplete batch (one per rank, not one per worker).

    Epochs: each ``iter()`` starts the epoch given to ``dataset.set_epoch``
    since the last iteration, or else the epoch after the previous one.

    Args:
        dataset: the :class:`ShardDataset` to read.
        batch_size: samples per batch (default 64). The workers batch: torch's own
            batching is off (the DataLoader is given ``batch_size=None``), while
            :attr:`batch_size` and :attr:`drop_last` read the loader's.
        drop_last: drop each rank's last incomplete batch.
        collate_fn: ``collate_fn(list of samples) -> batch``, run in the
            workers; default :func:`shardflow.loading.collation.collate` (dicts of
            stacked tensors, PyG ``Batch`` for graphs, lists for strings).
            It is :attr:`batching`'s ``collate``; the DataLoader's own
            ``collate_fn`` attribute stays torch's per-item default.
        max_cost: batch by cost instead of count: a batch takes samples while
            their summed ``cost`` stays within ``max_cost`` (and at most
            ``batch_size`` samples); for graph datasets whose sizes vary by
            orders of magnitude. Every rank still yields the same number of
            batches (see :class:`~shardflow.planning.plan.SplitConfig`).
            Several budgets at once: a mapping of size columns to budgets,
            ``max_cost={"num_nodes": 20000, "num_edges": 80000}``; a batch then
            stays within every one of them.
        cost: the per-sample size an int ``max_cost`` sums, a column of the
            manifest's sizes index: ``"num_nodes"`` or ``"num_edges"`` for graph
            shards.
        accounting: account for where each epoch's time and bytes go (:meth:`report`);
            off, the workers time no stages and send no counters.
        trace: write a Chrome/Perfetto trace of the first epoch's first batches to this
            path (:mod:`shardflow.loading.tracing`).
        report_path: append each finished epoch's report to this file as one JSON line.
        **kwargs: torch ``DataLoader`` keywords. Without workers
            (``num_workers=0``), ``persistent_workers``, ``prefetch_factor`` and
            ``multiprocessing_context`` are ignored (torch would refuse them).

    Raises:
        TypeError: ``dataset`` is not a :class:`ShardDataset`, or a keyword neither
            this loader nor torch's DataLoader takes.
        ValueError: ``batch_size < 1``, ``num_workers < 0``, ``in_order=False`` (the
            batches must arrive in the plan's order), or what torch refuses for an
            iterable dataset (``shuffle``, ``sampler``, ``batch_sampler``).
    """

    def __init__(
        self,
        dataset: ShardDataset,
        batch_size: int = 64,
        *,
        drop_last: bool = False,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        max_cost: int | Mapping[str, int] | None = None,
        cost: str = "num_nodes",
        accounting: bool = True,
        trace: str | None = None,
        report_path: str | None = None,
        **kwargs: Any,
    ) -> None:
        if not isinstance(dataset, ShardDataset):
            raise TypeError(f"shardflow.loader needs a ShardDataset, got {type(dataset).__name__}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        num_workers = kwargs.get("num_workers", 0)
        if num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {num_workers}")
        if kwargs.get("in_order", True) is False:
            raise ValueError("in_order=False is not supported: the loader's position counts batches in plan order")
        if num_workers == 0:
            for name in WORKER_ONLY:
                kwargs.pop(name, None)
        self.batching = Batching(batch_size, drop_last, collate_fn or default_collate, max_cost, cost, accounting)
        self._run: EpochRun | None = None  # the epoch being iterated, or the last one
        self._pending: EpochRun | None = None  # loaded by load_state_dict, not iterated yet
        self._active = False
        self._restart = False  # load_state_dict: the next iter() starts new workers
        self._pools: set[int] = set()  # the workers' batch buffer pools mapped here (shardflow.loading.transfer)
        self._insight = Insight(accounting, trace, report_path)
        super().__init__(dataset, batch_size=None, **kwargs)
        dataset.set_batching(self.batching, num_workers,
                             forked=num_workers > 0 and _start_method(self.multiprocessing_context) == "fork")
        weakref.finalize(self, transfer.forget, self._pools)

    @property  # type: ignore[override]
    def batch_size(self) -> int:
        """Samples per batch (the workers batch; torch's DataLoader batches nothing itself)."""
        return self.batching.batch_size

    @batch_size.setter
    def batch_size(self, value: Any) -> None:
        # torch's __init__ assigns the None given to it (and refuses any later assignment)
        pass

    @property  # type: ignore[override]
    def drop_last(self) -> bool:
        """Whether each rank's last incomplete batch is dropped."""
        return self.batching.drop_last

    @drop_last.setter
    def drop_last(self, value: Any) -> None:
        pass  # as batch_size's

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
        run = self._run if self._active and self._run is not None else self._coming()
        return run.num_batches()

    def _coming(self) -> EpochRun:
        """The epoch the next ``iter()`` starts: a loaded state's, or the dataset's next."""
        if self._pending is not None:
            return self._pending
        return self.dataset.epoch_run(self.workers, after=self._run)

    def _start_workers(self, fresh: bool) -> Iterator[Any]:
        """torch's iterator of worker items; ``fresh``: new workers even when persistent (a
        resumed epoch: they copy its resume point as they start)."""
        if fresh:
            drop_iterator(self)  # the persistent workers stop now
            transfer.forget(self._pools)  # the workers of an earlier iterator send no more
            self._pools.clear()
        return super().__iter__()

    def __iter__(self) -> Iterator[Any]:
        return self._batches()

    def _batches(self) -> Iterator[Any]:
        # The epoch is fixed at the first next(), not at iter(): a set_epoch() in between
        # (Lightning calls iter() first) names both the data read and the run's state.
        run = self._coming()
        self._pending = None
        self._run = run
        world = self.dataset.world()  # the account starts before the epoch's prefetches (storage.staged)
        predict = None if run.resumed else partial(predicted_cost, self.dataset, run.epoch, world.rank, self.num_workers)
        acct = self._insight.begin(run.epoch, world.rank, world.world_size, self.num_workers, predict)
        with run.start():  # the workers start now (forked or pickled) and copy the epoch's start
            it = self._start_workers(fresh=run.resumed or self._restart)
            self._restart = False
        self._active = True
        last: Any = None
        owed = 0  # planned batches whose samples were all dropped, before any batch arrived
        again = 0  # samples yielded again in the repeated batches
        shared = self.num_workers > 0 and self.persistent_workers
        try:
            while True:
                if shared and self._run is not run:  # the one DataLoader iterator serves the later run now
                    raise ShardflowError(
                        f"this iteration of epoch {run.epoch} was superseded by a later iter() of the loader: "
                        "with persistent_workers=True its workers serve one iteration at a time"
                    )
                t0 = acct.before()
                item = next(it, None)
                acct.after(t0, item)
                if item is None:
                    break
                if not isinstance(item, WorkerItem):
                    raise ShardflowError(f"internal: a worker yielded {type(item).__name__}, not a batch")
                if item.pools:
                    self._pools |= item.pools
                run.record(item)
                if item.final:
                    continue
                if item.data is None:
                    # every sample of this batch was dropped (on_error="skip"): repeat the
                    # previous batch so that every rank still takes len(loader) steps
                    run.repeated()
                    if last is None:
                        owed += 1
                        continue
                    again += batch_samples(last)
                    acct.yielded()
                    yield last
                    continue
                last = item.data
                again += owed * batch_samples(item.data)
                for _ in range(owed):
                    acct.yielded()
                    yield item.data
                owed = 0
                acct.yielded()
                yield item.data
            run.finish(owed, again)
        finally:
            if self._run is run:
                self._active = False
            run.close()
            self._insight.end(run.stats, run.finished)
            if self.num_workers > 0 and not self.persistent_workers:
                # Shut the workers down now: an exception's traceback holds the iterator
                # (its frames), which would keep them running until it is collected.
                shutdown_workers(it)
                del it
                transfer.forget(self._pools)  # unmap the stopped workers' batch buffers
                self._pools.clear()

    def report(self, gather: bool = False) -> Report:
        """Where the current (or last) epoch's time and bytes went, and whether the training
        loop waits for data: see :class:`~shardflow.loading.report.Report` and docs/insight.md.

        Args:
            gather: with ``torch.distributed`` initialised, gather every rank's wait (a
                collective: call it on every rank) and name the slowest rank.

        Raises:
            ShardflowError: the loader was not iterated yet.
        """
        return self._insight.report(self._run.stats if self._run is not None else {}, gather)

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
        :mod:`shardflow.planning.elastic`). A different batch size, seed, shuffle or
        set of shards raises :class:`~shardflow.errors.StateError`, as does,
        without a manifest, another world size, rank or worker count.

        The state is the epoch run's (:class:`~shardflow.dataset.epochrun.EpochRun`):
        the loader itself keeps no position.
        """
        run = self._run
        if self._pending is not None or run is None or run.finished:
            return self._coming().state_dict()  # loaded and not iterated yet, or at an epoch's start
        return run.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume at the next ``iter()`` from :meth:`state_dict`.

        Raises:
            StateError: another version or configuration (lists the differences),
                or a different worker count without a manifest.
        """
        if self._active:
            raise StateError("load_state_dict() while an iteration is running; load before iterating")
        self._pending = self.dataset.epoch_run(self.workers, state=state)
        self._restart = True  # persistent workers must restart to see the resume point


def _start_method(context: Any) -> str:
    """How the DataLoader starts its workers: the context given (a name or a context), else
    the default one (the platform's first, unless the program set one)."""
    if context is None:
        return multiprocessing.get_start_method(allow_none=True) or multiprocessing.get_all_start_methods()[0]
    return context if isinstance(context, str) else context.get_start_method()


def batch_samples(batch: Any) -> int:
    """Samples in a collated batch: its ``__key__`` list (0 when a custom collate kept none)."""
    keys = batch.get("__key__") if isinstance(batch, Mapping) else None
    return len(keys) if isinstance(keys, (list, tuple)) else 0


def loader(dataset: ShardDataset, batch_size: int = 64, **options: Any) -> ShardLoader:
    """Build a :class:`ShardLoader`: ``ShardLoader(dataset, batch_size, **options)``, the
    same defaults.

    Args:
        dataset: the :class:`ShardDataset` to read.
        batch_size: samples per batch.
        **options: the keyword arguments of :class:`ShardLoader` (``drop_last``,
            ``collate_fn``, ``max_cost``, ``cost``) and of torch's ``DataLoader``
            (``num_workers``, ``pin_memory``, ``prefetch_factor``, ...).

    Returns:
        The loader; iterate it, ``len()`` it, ``state_dict()`` it.
    """
    return ShardLoader(dataset, batch_size, **options)


def options() -> frozenset[str]:
    """The keyword names :class:`ShardLoader` takes: its own and torch ``DataLoader``'s
    (without ``dataset``)."""
    own = set(inspect.signature(ShardLoader.__init__).parameters) - {"self", "kwargs"}
    torch_ = set(inspect.signature(TorchDataLoader.__init__).parameters) - {"self"}
    return frozenset((own | torch_) - {"dataset"})
