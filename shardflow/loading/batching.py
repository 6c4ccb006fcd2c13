"""Batching in DataLoader workers: the loader's batch options, what a worker yields, and the
small generators the dataset composes its per-worker pipeline from."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from . import transfer
from .. import accounting
from ..compat.torch import pin_memory
from ..planning.costs import cost_budgets
from ..policy import ErrorPolicy
from ..state import ResumePoint
from ..world import World

__all__ = [
    "Batching",
    "WorkerItem",
    "stream_world",
    "count_good",
    "take",
    "skip_items",
    "close_iter",
    "Primed",
]

@dataclass(frozen=True)
class Batching:
    """How DataLoader workers batch a dataset (set by :func:`shardflow.loader`).

    Attributes:
        batch_size: samples per batch.
        drop_last: drop each rank's last incomplete batch.
        collate: ``collate(list of samples) -> batch``, run in the workers.
        max_cost: batch by summed ``cost`` instead of count (None: by count): an
            int, or a mapping of size columns to budgets (see
            :func:`shardflow.planning.plan.cost_budgets`).
        cost: the per-sample size column an int ``max_cost`` sums (``"num_nodes"``, ``"num_edges"``).
        account: time the workers' stages and send their counters with each batch
            (:mod:`shardflow.accounting`).

    Raises:
        TypeError, ValueError: a ``max_cost``/``cost`` that is not allowed (the message says what is).
    """

    batch_size: int
    drop_last: bool
    collate: Callable[[list[Any]], Any]
    max_cost: int | Mapping[str, int] | None = None
    cost: str = "num_nodes"
    account: bool = True
    budgets: tuple[tuple[str, ...], tuple[int, ...]] | None = field(default=None, init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        budgets = cost_budgets(self.max_cost, self.cost)
        if budgets is not None and self.drop_last:
            raise ValueError("max_cost cannot be combined with drop_last (cost batches have no fixed size to drop)")
        object.__setattr__(self, "budgets", budgets)

    @property
    def columns(self) -> tuple[str, ...]:
        """The size columns batched by (empty when batching by count)."""
        return self.budgets[0] if self.budgets is not None else ()

    @property
    def budget(self) -> tuple[int, ...] | None:
        """One budget per :attr:`columns`, or None when batching by count."""
        return self.budgets[1] if self.budgets is not None else None


@dataclass
class WorkerItem:
    """What a worker yields under :func:`shardflow.loader`: a batch and its origin."""

    worker: int
    index: int
    data: Any
    stats: dict[str, int] = field(default_factory=dict)
    final: bool = False
    acct: dict[str, int] | None = None
    """The worker's counters and stage timers since its epoch began (:mod:`shardflow.accounting`)."""

    pools: frozenset[int] = frozenset()
    """In the main process: the worker buffer pools the batch came through (see
    :mod:`shardflow.loading.transfer`)."""

    sent: threading.Event | None = field(default=None, repr=False, compare=False)
    """In a worker: set once the item is pickled to cross (see :class:`Primed`); not sent."""

    def pin_memory(self, device: Any = None) -> WorkerItem:
        """Pin the batch (the DataLoader calls this under ``pin_memory=True``; without it,
        torch's pinning returns an object of another type as it is, unpinned).

        Returns:
            This item, its ``data`` pinned as the DataLoader pins a batch (tensors, and the
            values of mappings, sequences and objects with a ``pin_memory`` method).
        """
        if self.data is not None:
            self.data = pin_memory(self.data, device)  # what the DataLoader itself runs
        return self

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        # Pickled by the DataLoader to cross from a worker (see shardflow.loading.transfer).
        t = accounting.clock()
        wire = transfer.to_wire(self.data)
        accounting.add_ns("handover", accounting.clock() - t)  # sent with the next batch
        if self.sent is not None:
            self.sent.set()
        return (_rebuild_item, (self.worker, self.index, wire, self.stats, self.final, self.acct))


def _rebuild_item(worker: int, index: int, data: Any, stats: dict[str, int], final: bool,
                  acct: dict[str, int] | None = None) -> WorkerItem:
    freed: list[Any] = []
    t = accounting.clock()
    item = WorkerItem(worker, index, transfer.from_wire(data, freed), stats, final, acct)
    transfer.release(freed)  # the whole batch is out of the worker's buffers
    accounting.add_ns("handover", accounting.clock() - t)  # in the main process
    item.pools = frozenset(token for token, _, _ in freed)
    return item


def stream_world(world: World, resume: ResumePoint | None) -> World:
    """The worker position whose stream (shards, shuffle seed) this worker reads:
    its own, or after an unsized resume the saved run's (see :class:`ResumePoint`)."""
    if resume is None or not resume.streams or world.worker >= len(resume.streams):
        return world
    return world.with_workers(resume.streams[world.worker], world.num_workers)


def count_good(items: Iterator[Any], policy: ErrorPolicy) -> Iterator[Any]:
    """Count every item that is not None (a dropped sample) as good under ``policy``."""
    for x in items:
        if x is not None:
            policy.good()
        yield x


def take(it: Iterator[Any], n: int) -> list[Any]:
    """Up to ``n`` next items of ``it`` (fewer at its end)."""
    out = []
    for _ in range(n):
        x = next(it, _SENTINEL)
        if x is _SENTINEL:
            break
        out.append(x)
    return out


_SENTINEL = object()


def skip_items(items: Iterator[Any], n: int) -> Iterator[Any]:
    """The items after the first ``n``."""
    for i, x in enumerate(items):
        if i >= n:
            yield x


def close_iter(it: Any) -> None:
    """Close a generator (or anything with ``close``) now, releasing its files."""
    close = getattr(it, "close", None)
    if close is not None:
        close()


SENT_WAIT = 0.5
"""Seconds at most that a worker waits for its first batch to be pickled before it makes the next."""


class Primed:
    """``items`` with its first item computed at construction.

    A DataLoader worker calls ``iter(dataset)`` as soon as it starts, but asks for
    the first item only when the main process sends the first request, which it does
    once it has started every worker; priming does the first batch's work
    (planning, opening shards, reading, decoding, collating) in that wait.
    Iteration is otherwise unchanged: an exception raised while priming is raised
    by the first ``next()``, and ``close()`` closes ``items``.

    The DataLoader pickles a worker's items in a thread of its queue, which needs the
    interpreter lock that making the next batch holds (handed over every 5 ms at best, later
    when the machine is busy). The training loop waits for the first batch, so the worker
    makes its second only once the first is pickled (a :class:`WorkerItem`'s ``sent``; at
    most :data:`SENT_WAIT` seconds).
    """

    def __init__(self, items: Iterator[Any]) -> None:
        self._items = items
        self._first: Any = _SENTINEL
        self._error: Exception | None = None
        self._sent: threading.Event | None = None
        try:
            self._first = next(items)
        except StopIteration:
            pass
        except Exception as e:  # noqa: BLE001 - raised at the first next(), where it would have been
            self._error = e
        if isinstance(self._first, WorkerItem):
            self._sent = self._first.sent = threading.Event()

    def __iter__(self) -> Primed:
        return self

    def __next__(self) -> Any:
        if self._error is not None:
            error, self._error = self._error, None
            self._first = _SENTINEL
            raise error
        if self._first is not _SENTINEL:
            first, self._first = self._first, _SENTINEL
            return first
        if self._sent is not None:
            sent, self._sent = self._sent, None
            sent.wait(SENT_WAIT)
        return next(self._items)

    def close(self) -> None:
        self._first = _SENTINEL
        close_iter(self._items)
