"""The resume side of :class:`~shardflow.dataset.ShardDataset`: its state dict, checked
and loaded (see :mod:`shardflow.state` for the format)."""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from ..selection import selection_digest
from ..state import MAX_STREAMS, ResumePoint, build_state, check_bounds, check_state, layout_position, parse_layout

__all__ = ["Resumable"]

log = logging.getLogger(__name__)


class Resumable:
    """``state_dict``/``load_state_dict`` of :class:`~shardflow.dataset.ShardDataset` and the
    state helpers its loader runs use (a mixin: the attributes it reads are set by the
    dataset's constructor)."""

    def _fingerprint(self, num_workers: int) -> dict[str, Any]:
        world = self.world()
        h = hashlib.sha256()
        for u, c in zip(self.source.urls, self.source.counts if self.source.counts is not None else [None] * len(self.source.urls)):
            h.update(f"{u.rsplit('/', 1)[-1]}:{c};".encode())
        if self._selection is not None:
            h.update(selection_digest(self._selection).encode())
        split = self._split_config()
        return {
            "shards": h.hexdigest()[:16],
            "seed": self.seed,
            "shuffle": [self.shuffle.shards, self.shuffle.buffer, self.shuffle.interleave, self.shuffle.initial]
            + ([self.shuffle.window] if self.shuffle.window > 1 else []),
            "partial": split.partial,
            "samples_per_epoch": split.samples_per_epoch,
            "batch_size": split.batch_size,
            "drop_last": split.drop_last,
            "max_cost": [list(x) for x in zip(*self._batching.budgets)] if self._batching and self._batching.budgets else None,
            "world_size": world.world_size,
            "rank": world.rank,
            "num_workers": num_workers,
            "expand": self.expand.count if self.expand is not None else 1,
        }

    def _check_state(self, state: Mapping[str, Any], kind: str, num_workers: int) -> None:
        """Refuse a state this dataset cannot resume.

        Args:
            state: a state dict (:mod:`shardflow.state`).
            kind: ``"ShardDataset"`` or ``"ShardLoader"``.
            num_workers: reading processes per rank of the loading side.

        Raises:
            StateError: another kind or version, or another configuration; the
                message names each difference.
        """
        extra = []
        saved = state.get("config") if isinstance(state, Mapping) else None
        if not self.sized and isinstance(saved, Mapping) and saved.get("num_workers") != num_workers:
            extra.append(
                f"num_workers: saved {saved.get('num_workers')}, now {num_workers} "
                "(without a manifest the worker count must match)"
            )
        ignored = ("num_workers", "rank", "world_size") if self.sized else ("num_workers",)
        check_state(state, kind, self._fingerprint(num_workers), ignored=ignored, extra=extra)
        counts = self._item_counts() if self.sized else None
        items = None if counts is None else max(int(counts.sum()), self._split.samples_per_epoch or 0)
        check_bounds(state, kind, items=items, world_size=self.world().world_size, max_streams=MAX_STREAMS)

    def state_dict(self) -> dict[str, Any]:
        """Position in the current epoch when iterating in this process.

        Taken mid-epoch and loaded into a fresh dataset, iteration continues
        with exactly the samples not yet yielded, in the same order. With
        DataLoader workers use the state of :func:`shardflow.loader` instead:
        the dataset in the main process cannot see what workers yielded.
        """
        progress = getattr(self, "_progress", None)
        resume = self._resume
        if progress is None and resume is not None:  # loaded, not iterated yet: keep that position
            return self._state(resume.epoch, self._position(resume.layout, resume.step, resume.skip[:1]))
        if progress is None:
            return self._state(int(self._control[0]) + int(self._control[1]), [])
        step0, k, skip, layout = progress
        return self._state(self._last_epoch, self._position(layout, step0 + k, skip + k))

    def _position(self, layout: Sequence[tuple[int, int]], step: int, skip: Sequence[int] | int) -> list[Any]:
        """The ``remaining`` entry of a direct iteration's state: sized, the layout and the
        samples taken (``step``); unsized, the samples passed (``skip``)."""
        if not self.sized:
            return [int(x) for x in ([skip] if isinstance(skip, int) else skip)]
        return layout_position(layout, self.world().world_size, step)

    def _state(self, epoch: int, remaining: list[Any]) -> dict[str, Any]:
        """A ``"ShardDataset"`` state dict of this dataset's configuration (:mod:`shardflow.state`)."""
        return build_state("ShardDataset", epoch, remaining, 0, self._fingerprint(1))

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from :meth:`state_dict`: the next iteration continues that epoch.

        Raises:
            StateError: another version, or a different configuration (the
                message lists each difference).
        """
        self._check_state(state, "ShardDataset", 1)
        self._load_resume(state, 1)
        self._progress = None  # an abandoned iteration no longer names the position

    def _split_layout(self, stages_: list[tuple[int, int]]) -> tuple[tuple[tuple[int, int], ...], int]:
        """``(layout, step)`` of a saved layout at this world size: on the world of its
        last stage, continue that stage's plan at its step; on another, share out what
        remains (:mod:`shardflow.elastic`) from step 0."""
        if stages_[-1][0] == self.world().world_size:
            return tuple(stages_[:-1]), stages_[-1][1]
        return tuple(stages_), 0

    def _resume_of(self, state: Mapping[str, Any], num_workers: int) -> ResumePoint | None:
        """Where a checked state resumes on this world with ``num_workers`` workers per rank
        (None: saved before anything was read, the epoch starts afresh)."""
        epoch = int(state["epoch"])
        remaining = state["remaining"]
        if not remaining:
            return None
        if not self.sized:
            skip = [int(x) for x in remaining]
            j = int(state["next_worker"])
            streams = tuple((i + j) % num_workers for i in range(num_workers))
            return ResumePoint(epoch, skip=tuple(skip[s] for s in streams), streams=streams)
        stages_ = parse_layout(remaining, str(state.get("kind")))
        layout, step = self._split_layout(stages_)
        if not step and layout:
            log.info("resuming epoch %d on %d ranks after %s (world size, steps)", epoch, self.world().world_size, stages_)
        return ResumePoint(epoch, layout, step)

    def _load_resume(self, state: Mapping[str, Any], num_workers: int) -> None:
        epoch = int(state["epoch"])
        resume = self._resume_of(state, num_workers)
        self._apply_epoch(epoch)
        self._user_epoch = epoch
        self._layout = (epoch, resume.layout) if resume is not None and resume.layout else None
        self._resume = resume
