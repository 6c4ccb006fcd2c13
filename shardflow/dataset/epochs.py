"""Which epoch a :class:`~shardflow.dataset.ShardDataset` reads next, and its runs:
:class:`Epochs`, the one holder of the dataset's epoch state.

The dataset holds configuration and one :class:`Epochs`; each epoch's position, resume
point, layout and stats are its :class:`~shardflow.dataset.epochrun.EpochRun`'s. Here: the
epoch clock shared with DataLoader workers, the epoch given to ``set_epoch``, a state loaded
into the dataset and not iterated yet, the run of this process, and the loader's run whose
workers are starting (they copy it with the dataset and yield its batches).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import logging

import numpy as np
import torch

from ..errors import ShardflowError, StateError
from ..state import MAX_EPOCH, build_state
from ..world import World
from .epochrun import EpochRun
from .resumable import check, config, resume_point
from .warmstart import prefetch_first

__all__ = ["Epochs", "MAX_WORKERS"]

MAX_WORKERS = 256
"""DataLoader workers per rank that the epoch clock has slots for."""

log = logging.getLogger(__name__)

_IN_WORKER = (
    "ShardDataset.{what} was called in DataLoader worker {worker} (torchdata's StatefulDataLoader with "
    "num_workers > 0 does this): a worker's copy reads only its share of the rank's stream, so its state "
    "does not describe the rank's position and a run resumed from it repeats samples. Use "
    "shardflow.loader(dataset, ...) and its state_dict() / load_state_dict(), exact for any num_workers "
    "(docs/frameworks.md)"
)
_warned_in_worker = False


class Epochs:
    """The epoch state of one dataset (made by its constructor, copied into its workers).

    Attributes:
        control: shared with DataLoader workers (persistent ones too): ``[epoch,
            iterations per worker...]``, int64; a worker's ``n``-th iteration reads
            ``epoch + n``, so no epoch is replayed silently.
        chosen: the epoch given to ``set_epoch`` since the last loader epoch began, or None.
        loaded: the run of a state loaded into the dataset, not iterated yet, or None.
        current: the run iterating in this process, or the last one (its ``stats`` are the
            dataset's).
        direct: the direct iteration of this process whose position ``state_dict`` names.
        resumed: the run whose layout ``plan()`` and ``num_batches()`` default to for its
            epoch (a resumed epoch's; ``set_epoch`` ends it).
        feeding: the loader's run whose workers are starting, or None.
    """

    def __init__(self) -> None:
        self.control = torch.zeros(1 + MAX_WORKERS, dtype=torch.int64).share_memory_()
        self.chosen: int | None = None
        self.loaded: EpochRun | None = None
        self.current: EpochRun | None = None
        self.direct: EpochRun | None = None
        self.resumed: EpochRun | None = None
        self.feeding: EpochRun | None = None

    @property
    def epoch(self) -> int:
        """The epoch the next iteration (since the last ``set_epoch``) starts from."""
        return int(self.control[0])

    def apply(self, epoch: int) -> None:
        """Make ``epoch`` the next iteration's, in every process (the workers' counts restart)."""
        self.control[0] = epoch
        self.control[1:] = 0

    def choose(self, epoch: int) -> None:
        """``set_epoch``: the next iteration reads ``epoch``, a plain epoch.

        Raises:
            StateError: ``epoch`` is not an int in ``[0, MAX_EPOCH)``.
        """
        if isinstance(epoch, bool) or not isinstance(epoch, (int, np.integer)) or not 0 <= epoch < MAX_EPOCH:
            raise StateError(f"set_epoch: epoch must be an int in [0, 2**62) (shardflow.state.MAX_EPOCH), got {epoch!r}")
        epoch = int(epoch)
        self.resumed = None  # a resumed epoch's layout ends with it
        self.chosen = epoch
        self.apply(epoch)

    def layout(self, epoch: int) -> tuple[tuple[int, int], ...]:
        """The earlier ``(world size, steps)`` stages of ``epoch`` when a loaded or started
        run resumed it elastically, else empty."""
        run = self.resumed
        return run.layout if run is not None and run.epoch == epoch else ()

    def begin(self, worker: int) -> int:
        """The epoch of an iteration starting now in this process (worker ``worker``)."""
        if worker >= MAX_WORKERS:
            raise ShardflowError(f"at most {MAX_WORKERS} DataLoader workers are supported")
        control = self.control
        if not World.in_worker():
            # Iterating in this process: advance the epoch for every worker slot, so that
            # DataLoader workers forked later (each counting its own iterations) agree.
            epoch = int(control[0]) + int(control[1])
            self.apply(epoch + 1)
            return epoch
        n = int(control[1 + worker])
        control[1 + worker] = n + 1
        return int(control[0]) + n

    def iterate(self, ds: Any) -> Iterator[Any]:
        """``iter(ds)``: in a loader's workers (or here without workers) the batch records of
        the run being started; otherwise a direct run's samples under the dataset's own split."""
        world = ds.world()
        epoch = self.begin(world.worker)
        if self.feeding is not None:
            return self.feeding.batches(world, epoch)
        loaded = self.loaded if self.loaded is not None and self.loaded.epoch == epoch else None
        run = EpochRun(ds, epoch, 1, resume=loaded.resume if loaded is not None else None)
        if not World.in_worker():
            self.loaded = None  # used up by this iteration
            self.current = self.direct = run
        return run.samples(world)

    def next_run(self, ds: Any, workers: int, *, after: EpochRun | None, state: Mapping[str, Any] | None) -> EpochRun:
        """The loader epoch that the next loader iteration reads (see ``ShardDataset.epoch_run``)."""
        resume = None
        if state is not None:
            check(ds, state, "ShardLoader", workers)
            epoch = int(state["epoch"])
            resume = resume_point(ds, state, workers)
        elif self.chosen is not None:
            epoch = self.chosen
        else:
            epoch = after.epoch + 1 if after is not None else self.epoch
        return EpochRun(ds, epoch, workers, resume=resume, loaded=state, batching=ds.batching)

    @contextmanager
    def starting(self, ds: Any, run: EpochRun, forked: int) -> Iterator[None]:
        """Start the loader's ``run``: its epoch (the one given to ``set_epoch`` is used up),
        layout and stats become the dataset's; the DataLoader workers started inside copy it
        and yield its batches. ``forked``: workers forked from this process, whose first
        batches' bytes are requested now (:mod:`.warmstart`)."""
        self.chosen = None
        self.loaded = None  # a state loaded into the dataset is replaced by the loader's
        self.resumed = self.current = run
        self.apply(run.epoch)
        ds.world()  # detect the ranks here, in the main process: workers get them with the dataset
        if forked and run.resume is None:
            prefetch_first(ds, run.epoch, forked)
        self.feeding = run
        try:
            yield
        finally:
            self.feeding = None

    def state_dict(self, ds: Any) -> dict[str, Any]:
        """The dataset's ``"ShardDataset"`` state: the direct iteration's position, a loaded
        state's, or the start of the next epoch; in a DataLoader worker, with a warning (once
        per process)."""
        global _warned_in_worker
        if not _warned_in_worker and ds.world().in_worker():
            _warned_in_worker = True  # once per worker process: torchdata asks at every snapshot
            log.warning(_IN_WORKER.format(what="state_dict()", worker=ds.world().worker))
        run = self.direct
        if run is not None and not run.finished:
            return run.state_dict()
        if self.loaded is not None:
            return self.loaded.state_dict()
        return build_state("ShardDataset", int(self.control[0]) + int(self.control[1]), [], 0, config(ds, 1))

    def load_state_dict(self, ds: Any, state: Mapping[str, Any]) -> None:
        """Resume the next iteration from a ``"ShardDataset"`` state (checked here; refused with
        a :class:`~shardflow.errors.StateError` in a DataLoader worker, where no dataset state can
        resume the rank's position)."""
        if ds.world().in_worker():
            raise StateError(_IN_WORKER.format(what="load_state_dict()", worker=ds.world().worker)
                             + "; this resume is refused")  # fmt: skip
        check(ds, state, "ShardDataset", 1)
        epoch = int(state["epoch"])
        run = EpochRun(ds, epoch, 1, resume=resume_point(ds, state, 1))
        self.apply(epoch)
        self.chosen = epoch
        self.loaded = self.resumed = run
        self.direct = None  # an abandoned iteration no longer names the position
