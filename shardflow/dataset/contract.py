"""The loader's side of the contract with :class:`~shardflow.dataset.ShardDataset`: what
:class:`~shardflow.loading.ShardLoader` calls to batch in workers and to start an epoch."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from ..batching import Batching
from ..state import ResumePoint

__all__ = ["LoaderContract"]


class LoaderContract:
    """The methods :class:`~shardflow.loading.ShardLoader` drives (a mixin: the attributes
    it reads are set by the dataset's constructor)."""

    def set_batching(self, batching: Batching | None) -> None:
        """Let DataLoader workers batch and collate (:func:`shardflow.loader` calls this);
        None: yield samples."""
        self._batching = batching

    @property
    def batching(self) -> Batching | None:
        """The loader's batching, or None when the dataset yields samples."""
        return self._batching

    @property
    def requested_epoch(self) -> int | None:
        """The epoch given to :meth:`set_epoch` (or by a loaded state) since the last
        loader iteration began, or None."""
        return self._user_epoch

    def begin_epoch(self, epoch: int, state: Mapping[str, Any] | None, num_workers: int) -> ResumePoint | None:
        """Start a loader iteration of ``epoch`` (:class:`~shardflow.loading.ShardLoader` calls this).

        Args:
            epoch: the epoch the iteration reads.
            state: a checked state (:meth:`check_state`) to resume, or None.
            num_workers: reading processes per rank.

        Returns:
            Where each worker resumes, or None when the epoch starts afresh.
        """
        if state is not None:
            self._load_resume(state, num_workers)
        self._user_epoch = None
        if self._resume is None or self._resume.epoch != epoch:
            self._resume = None
        self._apply_epoch(epoch)
        return self._resume

    @contextmanager
    def loader_iteration(self) -> Iterator[None]:
        """Within it the dataset yields the loader's batch records (also in workers
        started inside it, which carry the flag)."""
        self._in_loader = True
        try:
            yield
        finally:
            self._in_loader = False

    def workers_started(self) -> None:
        """The workers hold their copy of the resume point: later epochs start afresh."""
        self._resume = None
