"""The streaming dataset: :class:`ShardDataset`."""

from __future__ import annotations

import copy
import hashlib
import logging
import os
import pickle
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset

from . import stages, storage
from .batching import Batching, Primed, WorkerItem, close_iter, count_good, skip_items, stream_world, tag_sources, take
from .codecs import DecodeOptions, field_alternatives, preload
from .collation import takes_graph_records
from .elastic import resumed_plan
from .errors import MissingFieldError, SampleError, ShardflowError
from .expand import Expand
from .mixing import mixture_of
from .phases import read_planned_in_phases
from .plan import (
    RankPlan,
    ShuffleConfig,
    SplitConfig,
    plan_epoch,
    rank_share,
    shuffle_buffer,
    split_unsized,
    worker_batches,
)
from .source import ShardSet, Source, SourcePart, resolve_source
from .state import STATE_VERSION, ResumePoint, build_state, check_state, parse_layout
from .transforms import map_fields
from .world import World, stable_seed

__all__ = ["ShardDataset", "Batching", "WorkerItem", "STATE_VERSION"]

log = logging.getLogger(__name__)
_MAX_WORKERS = 256


class ShardDataset(IterableDataset):
    """Stream samples from tar shards, locally or from any fsspec URL.

    Each sample is a dict: ``__key__`` (str), ``__url__`` (the shard's URL),
    ``__source__`` (int: the index of its source in a list of sources, 0 for
    one) and one entry per field, decoded by the field's extension (see
    :mod:`shardflow.codecs`). With a manifest, every rank gets exactly the same
    number of samples per epoch, and over an epoch the ranks and DataLoader
    workers together see every sample once (plus declared padding); see
    :mod:`shardflow.plan` for the exact rules, :mod:`shardflow.mixing` for
    weighted mixtures and :mod:`shardflow.elastic` for resuming on another
    world size. Use :func:`shardflow.loader` for batching with workers and for
    resumption with workers.

    Args:
        source: a folder (its ``shardflow.json`` is read first; without one,
            its ``.tar*`` files), a manifest URL, a brace pattern or glob
            (``s3://b/train-{000000..000099}.tar``), parts joined by ``::``,
            a :class:`~shardflow.source.Source`, or a list of sources (each
            entry one source: a folder, manifest or shard URL used as given,
            or a ``Source``): their union, or with weights and
            ``samples_per_epoch`` a weighted mixture.
        shuffle: False keeps the stored order (shards in manifest/URL order,
            samples in file order); True shuffles shards per epoch and samples
            through a 1,000-sample buffer; an int sets the buffer size; or a
            :class:`~shardflow.plan.ShuffleConfig`.
        seed: seed of every shuffle; the order is a function of
            ``(seed, epoch)`` only, the same on every machine.
        decode: ``"numpy"`` (images as uint8 arrays, shape (H, W, 3)),
            ``"torch"`` (uint8 tensors, shape (3, H, W)), ``"pil"`` (RGB images)
            or None (every field stays bytes); or a
            :class:`~shardflow.codecs.DecodeOptions`. Graph fields (``.pyg``)
            decode to ``torch_geometric.data.Data``/``HeteroData``.
        fields: field names to keep (``__key__``/``__url__`` are always kept);
            a sample lacking one is an error under ``on_error``. ``"jpg;png"``
            takes the first present; ``"image"`` stands for whichever image field
            a sample has (``jpg``, ``png``, ``webp``, ...). None keeps all.
        transform: ``transform(sample) -> Any`` applied after decoding; a
            returned None drops the sample (counted as ``filtered``). A mapping
            ``{field: fn}`` applies ``fn`` to that field's value only (a
            torchvision transform, see :func:`shardflow.map_fields`).
        on_error: ``"raise"`` (default), ``"skip"`` or ``"warn"``; see
            :class:`~shardflow.stages.ErrorPolicy`.
        partial: ``"pad"`` (default, as ``DistributedSampler``) or ``"drop"``:
            how ranks get equal counts when ``N`` is not divisible by the world size.
        samples_per_epoch: train by steps: samples per rank per epoch, drawn
            from an endless stream of reshuffled passes (in a weighted mixture,
            shared out by weight: :mod:`shardflow.mixing`).
        rank: this process's rank; default detected (``torch.distributed``,
            else ``RANK``/``WORLD_SIZE``, else 0).
        world_size: number of ranks; give with ``rank``.
        storage_options: passed to fsspec (credentials, endpoint, ...).
        io: retries, read-ahead and cache; a :class:`~shardflow.storage.IOOptions`.
        max_pixels: image decompression-bomb limit in pixels (per dataset).
        expand: one-to-many samples (:mod:`shardflow.expand`): each stored
            sample becomes ``expand.count`` items before the shuffle buffer;
            lengths, splits and resumption count items.

    Raises:
        FileNotFoundError: the source lists no shard.
        ManifestError: the manifest is invalid.
        MissingFieldError: ``fields`` names a field the manifest does not know
            (lists the fields that exist).
        SourceError: the same shard reached twice, or weights that cannot
            make a mixture (on some sources only, without ``samples_per_epoch``,
            on a source without a manifest).
        ShardflowError: a rank would get no data.
    """

    def __init__(
        self,
        source: str | os.PathLike | Source | Sequence[str | os.PathLike | Source],
        *,
        shuffle: bool | int | ShuffleConfig = False,
        seed: int = 0,
        decode: str | DecodeOptions | None = "numpy",
        fields: Sequence[str] | None = None,
        transform: Callable[[dict[str, Any]], Any] | Mapping[str, Callable[[Any], Any]] | None = None,
        on_error: str = "raise",
        partial: str = "pad",
        samples_per_epoch: int | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        storage_options: Mapping[str, Any] | None = None,
        io: storage.IOOptions | None = None,
        max_pixels: int | None = None,
        expand: Expand | None = None,
    ) -> None:
        super().__init__()
        io = storage.io_options(io, storage_options)
        self.io = io
        if isinstance(shuffle, ShuffleConfig):
            self.shuffle = shuffle
        elif shuffle is True:
            self.shuffle = ShuffleConfig()
        elif shuffle is False or shuffle is None:
            self.shuffle = ShuffleConfig.off()
        elif isinstance(shuffle, int) and shuffle >= 0:
            self.shuffle = ShuffleConfig(buffer=shuffle)
        else:
            raise ValueError(f"shuffle must be a bool, a buffer size or a ShuffleConfig, got {shuffle!r}")
        if isinstance(decode, DecodeOptions):
            self.decode = decode
        elif decode is None:
            self.decode = None
        else:
            self.decode = DecodeOptions(image=decode)
        if max_pixels is not None:
            self.decode = DecodeOptions(**{**asdict(self.decode or DecodeOptions(image=None)), "max_pixels": max_pixels})
        preload(self.decode)  # here, once: DataLoader workers forked later inherit the decoders
        self.seed = int(seed)
        self.fields = tuple(fields) if fields is not None else None
        if isinstance(fields, str):
            raise TypeError("fields must be a sequence of names, e.g. ('jpg', 'cls'), not a str")
        self.transform = map_fields(transform) if isinstance(transform, Mapping) else transform
        if expand is not None and not isinstance(expand, Expand):
            raise TypeError(f"expand must be a shardflow.expand.Expand, got {type(expand).__name__}")
        self.expand = expand
        self.on_error = on_error
        stages.ErrorPolicy(on_error)  # validates
        self._split = SplitConfig(partial=partial, samples_per_epoch=samples_per_epoch)  # type: ignore[arg-type]
        self._ranks = (rank, world_size)
        World.detect(rank, world_size)  # validates
        self.source: ShardSet = resolve_source(source, io)
        self._check_fields()
        self._mixture = mixture_of(self.source.parts, self._split.samples_per_epoch)
        if self.source.counts is None:  # fail here, not later inside a DataLoader worker
            split_unsized(len(self.source.urls), World.detect(rank, world_size), self.seed, 0, False)
        self.stats: Counter[str] = Counter()
        self._batching: Batching | None = None
        self._in_loader = False  # True while a shardflow.loader iterates this dataset
        self._resume: ResumePoint | None = None
        self._layout: tuple[int, tuple[tuple[int, int], ...]] | None = None  # (epoch, earlier stages) of a resumed epoch
        self._user_epoch: int | None = None
        self._offset_cache: dict[int, np.ndarray | None] = {}
        self._plan_cache: tuple[tuple[Any, ...], RankPlan] | None = None
        self._cost_cache: tuple[tuple[str, ...], np.ndarray] | None = None
        # shared with DataLoader workers (also persistent ones): [epoch, iterations per worker...]
        self._control = torch.zeros(1 + _MAX_WORKERS, dtype=torch.int64).share_memory_()
        self._progress: list[Any] | None = None
        self._last_epoch = 0

    # ------------------------------------------------------------ properties

    @property
    def manifest(self):  # noqa: ANN201 - Manifest | None
        """The manifest (restricted to the shards read), or None."""
        return self.source.manifest

    @property
    def samples_per_epoch(self) -> int | None:
        """Samples per rank per epoch when training by steps (or a mixture), else None."""
        return self._split.samples_per_epoch

    @property
    def sized(self) -> bool:
        """True when sample counts are known (a manifest), so splits are exact."""
        return self.source.counts is not None

    @property
    def urls(self) -> list[str]:
        """Shard URLs in stream order."""
        return list(self.source.urls)

    def world(self) -> World:
        """The detected rank/world size/worker of the caller.

        In the main process the ranks found are remembered and reach the
        DataLoader workers with the dataset, for workers that cannot detect
        them (``spawn`` workers of a job started with ``torch.multiprocessing``).
        """
        if torch.utils.data.get_worker_info() is None:
            world = World.detect(*self._ranks)
            self._main_ranks = (world.rank, world.world_size)
            return world
        return World.detect(*self._ranks, default=getattr(self, "_main_ranks", None))

    @property
    def sources(self) -> tuple[SourcePart, ...]:
        """The sources, in order: their labels, shard ranges, weights; ``__source__`` indexes them."""
        return self.source.parts

    def _source_index(self) -> dict[str, int] | None:
        """Shard URL -> source index (None for a single source: every sample is 0)."""
        if len(self.source.parts) == 1:
            return None
        return {u: int(i) for u, i in zip(self.source.urls, self.source.source_of.tolist())}

    def _check_fields(self) -> None:
        m = self.source.manifest
        if self.fields is None or m is None or not m.fields:
            return
        for f in self.fields:
            if not any(alt in m.fields for alt in field_alternatives(f)):
                raise MissingFieldError(
                    f"no shard of {m.url} has the field {f!r}; the fields that exist are {sorted(m.fields)}"
                )

    def _split_config(self) -> SplitConfig:
        b = self._batching
        if b is None:
            return self._split
        return SplitConfig(
            partial=self._split.partial,
            batch_size=b.batch_size,
            drop_last=b.drop_last,
            samples_per_epoch=self._split.samples_per_epoch,
            max_cost=b.budget,
        )

    def _costs(self) -> np.ndarray | None:
        """Per-item costs, int64 of shape (items, columns) (the loader's cost columns),
        items in manifest order; None unless batching by cost."""
        b = self._batching
        if b is None or b.budget is None:
            return None
        if self._cost_cache is None or self._cost_cache[0] != b.columns:
            costs = np.stack([self.source.load_costs(c, self.io) for c in b.columns], axis=1)
            if self.expand is not None:
                costs = np.repeat(costs, self.expand.count, axis=0)
            self._cost_cache = (b.columns, costs)
        return self._cost_cache[1]

    def _item_counts(self) -> np.ndarray | None:
        """Items per shard: samples times the one-to-many count; None without a manifest."""
        counts = self.source.counts
        if counts is None or self.expand is None:
            return counts
        return counts * self.expand.count

    def __len__(self) -> int:
        """Samples this rank yields per epoch (independent of the worker count).

        Raises:
            TypeError: no manifest, so the length is unknown (``shardflow index``
                writes one).
        """
        counts = self._item_counts()
        if counts is None:
            raise TypeError(f"this ShardDataset's length is unknown: {self.source.unsized_reason()}")
        world = self.world()
        n, _, _, _ = rank_share(int(counts.sum()), world.world_size, self._split)
        return n

    def num_batches(self, num_workers: int = 1, epoch: int | None = None, state: Mapping[str, Any] | None = None) -> int:
        """Batches per epoch of this rank under the loader's batching (sized only).

        ``epoch`` matters with cost-bounded batches, whose count depends on the
        epoch's order (None: :attr:`epoch`), and for a resumed epoch. ``state``: a
        checked state to be resumed; after an elastic resume (another world
        size), the count is that of the resumed epoch's share."""
        counts = self._item_counts()
        if counts is None:
            raise TypeError(f"unknown number of batches: {self.source.unsized_reason()}")
        split = self._split_config()
        e = self.epoch if epoch is None else epoch
        layout = self._layout[1] if self._layout is not None and self._layout[0] == e else ()
        if state is not None and state.get("remaining") and int(state["epoch"]) == e:
            layout = self._split_layout(parse_layout(state["remaining"], str(state.get("kind"))))[0]
        if split.max_cost is not None or layout:  # cost-bounded batches, or the rest of an elastic epoch
            return self.plan(e, layout=layout).num_batches
        world = self.world()
        _, nb, _, _ = rank_share(int(counts.sum()), world.world_size, split)
        return nb

    def plan(
        self, epoch: int | None = None, rank: int | None = None, *, layout: tuple[tuple[int, int], ...] | None = None
    ) -> RankPlan:
        """The rank's plan for an epoch (see :mod:`shardflow.plan`); sized only.

        ``layout``: the earlier ``(world size, steps)`` stages of a resumed epoch
        (:mod:`shardflow.elastic`); None: those of a loaded state for that epoch, if any."""
        counts = self._item_counts()
        if counts is None:
            raise TypeError("no plan without a manifest (see `shardflow index`)")
        world = self.world()
        r = world.rank if rank is None else rank
        e = int(self._control[0]) if epoch is None else epoch
        if layout is None:
            layout = self._layout[1] if self._layout is not None and self._layout[0] == e else ()
        split = self._split_config()
        key = (r, e, world.world_size, self.shuffle, split, layout)
        if self._plan_cache is not None and self._plan_cache[0] == key:
            return self._plan_cache[1]
        if layout:
            plan = resumed_plan(
                lambda rr, w: plan_epoch(counts, rr, w, self.seed, e, self.shuffle, split, self._costs(), self._mixture),
                layout, r, world.world_size, split, counts, self._costs(),
            )
        else:
            plan = plan_epoch(counts, r, world.world_size, self.seed, e, self.shuffle, split, self._costs(), self._mixture)
        self._plan_cache = (key, plan)
        return plan

    # ------------------------------------------------------------ epochs & state

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch of the next iteration; the one way epochs change.

        Without it, each new iteration advances the epoch by one, so an epoch
        is never replayed silently (also in workers, persistent or not).
        """
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        self._layout = None  # a resumed epoch's layout ends with it: this one is a plain epoch
        self._user_epoch = int(epoch)
        self._apply_epoch(int(epoch))

    def _apply_epoch(self, epoch: int) -> None:
        self._control[0] = epoch
        self._control[1:] = 0

    @property
    def epoch(self) -> int:
        """The epoch the next iteration (since the last ``set_epoch``) starts from."""
        return int(self._control[0])

    def _begin(self, worker: int) -> int:
        """Called at the start of every iteration in the process that iterates."""
        if worker >= _MAX_WORKERS:
            raise ShardflowError(f"at most {_MAX_WORKERS} DataLoader workers are supported")
        if torch.utils.data.get_worker_info() is None:
            # Iterating in this process: advance the epoch for every worker slot, so that
            # DataLoader workers forked later (each counting its own iterations) agree.
            epoch = int(self._control[0]) + int(self._control[1])
            self._apply_epoch(epoch + 1)
            return epoch
        n = int(self._control[1 + worker])
        self._control[1 + worker] = n + 1
        return int(self._control[0]) + n

    def _fingerprint(self, num_workers: int) -> dict[str, Any]:
        world = self.world()
        h = hashlib.sha256()
        for u, c in zip(self.source.urls, self.source.counts if self.source.counts is not None else [None] * len(self.source.urls)):
            h.update(f"{u.rsplit('/', 1)[-1]}:{c};".encode())
        split = self._split_config()
        return {
            "shards": h.hexdigest()[:16],
            "seed": self.seed,
            "shuffle": [self.shuffle.shards, self.shuffle.buffer, self.shuffle.interleave, self.shuffle.initial],
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

    def check_state(self, state: Mapping[str, Any], kind: str, num_workers: int) -> None:
        """Refuse a state this dataset cannot resume (part of the resume contract).

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
        if self.sized:
            parse_layout(state["remaining"], kind)

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
            return self.make_state("ShardDataset", 1, resume.epoch, self.position(resume.layout, resume.step, resume.skip[:1]), 0)
        if progress is None:
            return self.make_state("ShardDataset", 1, int(self._control[0]) + int(self._control[1]), [], 0)
        step0, k, skip, layout = progress
        return self.make_state("ShardDataset", 1, self._last_epoch, self.position(layout, step0 + k, [skip + k]), 0)

    def position(self, layout: Sequence[tuple[int, int]], step: int, skips: Sequence[int] = ()) -> list[Any]:
        """The ``remaining`` entry of a state (:mod:`shardflow.state`).

        Args:
            layout: the epoch's earlier ``(world size, steps)`` stages.
            step: batches (samples, iterated directly) of the current plan taken
                by every rank.
            skips: unsized: the units each worker stream has passed.

        Returns:
            Sized: ``[[W0, k0], ..., [W, step]]``; unsized: ``skips``.
        """
        if not self.sized:
            return [int(x) for x in skips]
        return [[int(w), int(k)] for w, k in layout] + [[self.world().world_size, int(step)]]

    def make_state(self, kind: str, num_workers: int, epoch: int, remaining: list[Any], next_worker: int) -> dict[str, Any]:
        """A state dict of this dataset's configuration (see :mod:`shardflow.state`).

        Args:
            kind: ``"ShardDataset"`` or ``"ShardLoader"``.
            num_workers: reading processes per rank.
            epoch: the epoch the state resumes.
            remaining: per stream, what is left of the epoch (``[]``: all of it).
            next_worker: the stream the next batch comes from.
        """
        return build_state(kind, epoch, remaining, next_worker, self._fingerprint(num_workers))

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from :meth:`state_dict`: the next iteration continues that epoch.

        Raises:
            StateError: another version, or a different configuration (the
                message lists each difference).
        """
        self.check_state(state, "ShardDataset", 1)
        self._load_resume(state, 1)
        self._progress = None  # an abandoned iteration no longer names the position

    # ------------------------------------------------------------ the loader's side of the contract

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

    def _split_layout(self, stages_: list[tuple[int, int]]) -> tuple[tuple[tuple[int, int], ...], int]:
        """``(layout, step)`` of a saved layout at this world size: on the world of its
        last stage, continue that stage's plan at its step; on another, share out what
        remains (:mod:`shardflow.elastic`) from step 0."""
        if stages_[-1][0] == self.world().world_size:
            return tuple(stages_[:-1]), stages_[-1][1]
        return tuple(stages_), 0

    def _load_resume(self, state: Mapping[str, Any], num_workers: int) -> None:
        epoch = int(state["epoch"])
        remaining = state["remaining"]
        self._apply_epoch(epoch)
        self._user_epoch = epoch
        self._layout = None
        if not remaining:  # saved before anything was read: start the epoch afresh
            self._resume = None
            return
        if not self.sized:
            skip = [int(x) for x in remaining]
            j = int(state["next_worker"])
            streams = tuple((i + j) % num_workers for i in range(num_workers))
            self._resume = ResumePoint(epoch, skip=tuple(skip[s] for s in streams), streams=streams)
            return
        stages_ = parse_layout(remaining, str(state.get("kind")))
        layout, step = self._split_layout(stages_)
        if not step and layout:
            log.info("resuming epoch %d on %d ranks after %s (world size, steps)", epoch, self.world().world_size, stages_)
        self._layout = (epoch, layout) if layout else None
        self._resume = ResumePoint(epoch, layout, step)

    # ------------------------------------------------------------ iteration

    def _offsets(self, shard: int) -> np.ndarray | None:
        """The shard's offset index (None without one), loaded once per process.
        (The shard's size is checked against the manifest when it is opened.)"""
        if shard not in self._offset_cache:
            self._offset_cache[shard] = self.source.load_offsets(shard, self.io)
        return self._offset_cache[shard]

    def __iter__(self) -> Iterator[Any]:
        if self._batching is not None and not self._in_loader:
            # Iterated by itself (or by a plain DataLoader) after a shardflow.loader took it:
            # samples under the dataset's own split, not the loader's batch records.
            view = copy.copy(self)
            view._batching = None
            items = iter(view)
            self.stats = view.stats
            return items
        world = self.world()
        epoch = self._begin(world.worker)
        resume = self._resume if (self._resume is not None and self._resume.epoch == epoch) else None
        if world.num_workers == 1 and torch.utils.data.get_worker_info() is None:
            self._resume = None  # consumed by this iteration in the main process
        self._last_epoch = epoch
        policy = stages.ErrorPolicy(self.on_error)
        self.stats = policy.stats
        if self._batching is not None:
            batches = self._iter_batches(world, epoch, resume, policy)
            if torch.utils.data.get_worker_info() is not None:
                return Primed(batches)  # the first batch now, while the DataLoader starts the other workers
            return batches
        return self._iter_samples(world, epoch, resume, policy)

    def _units(self, world: World, epoch: int, resume: ResumePoint | None) -> list[int]:
        """This worker's batch numbers (sized; empty when unsized)."""
        if not self.sized:
            return []
        plan = self.plan(epoch, world.rank)
        step = resume.step if resume is not None else 0
        # whole batches round robin: the DataLoader, taking one from each worker in turn,
        # yields them in plan order, the same sequence for any number of workers
        mine = worker_batches(plan.num_batches - step, world.worker, world.num_workers, True)
        return list(range(step + mine.start, step + mine.stop, mine.step))

    def _pipeline(self, world: World, epoch: int, ids: list[int], skip: int, policy: stages.ErrorPolicy) -> tuple[Iterator[Any], list[int]]:
        """Compose the stages; returns (items, planned batch sizes)."""
        k = self.expand.count if self.expand is not None else 1
        prepare = self._preparer(epoch, policy) if self.expand is not None else None
        tagged = False  # __source__ set by the reader
        if self.sized:
            plan = self.plan(epoch, world.rank)
            sizes, order = plan.batch_positions(ids)
            needed = np.zeros(len(plan.read_sample), dtype=bool)  # read positions (a resumed plan reads more than it yields)
            needed[order] = True
            # read order is the yield order unless a shuffle buffer reorders: then no positions to keep
            # (nor a first batch to read first: see phases.first_phase)
            if order.size < 2 or bool(np.all(order[1:] > order[:-1])):
                tagged = prepare is None  # __source__ set as each sample is made
                items: Iterator[Any] = stages.read_planned(
                    plan, needed, self.source, self.io, policy, self._offsets, k, prepare,
                    sources=self.source.source_of.tolist() if tagged else None, positioned=False,
                )
            else:
                raw = read_planned_in_phases(
                    plan, needed, order, sizes[0] if sizes else 0, self.source, self.io, policy, self._offsets, k, prepare
                )
                items = stages.emit_in_order(raw, order)
        else:
            shards = split_unsized(len(self.source.urls), world, self.seed, epoch, self.shuffle.shards)
            items = stages.read_shards(shards, self.source, self.io, policy)
            if prepare is not None:
                items = stages.expand_each(items, prepare, k)
            items = shuffle_buffer(
                items, self.shuffle.buffer, stable_seed("buffer", self.seed, epoch, world.rank, world.worker), self.shuffle.initial
            )
            sizes = []
            if skip:
                items = skip_items(items, skip * (self._batching.batch_size if self._batching else 1))
        if prepare is None and self.fields is not None:
            items = stages.select_fields(items, self.fields, policy)
        if prepare is None and not tagged:
            items = tag_sources(items, self._source_index())
        if prepare is None and self.decode is not None:
            # The default collate batches graph fields from checked records in one step.
            records = self._batching is not None and self.transform is None and takes_graph_records(self._batching.collate)
            items = stages.decode(items, self.decode, policy, records)
        if self.transform is not None:
            items = stages.apply_transform(items, self.transform, policy)
        return items, sizes

    def _preparer(self, epoch: int, policy: stages.ErrorPolicy) -> Callable[[dict[str, Any]], list[Any] | None]:
        """Select, decode and expand one raw sample into its items (one-to-many samples)."""
        expand = self.expand
        wanted = stages.wanted_fields(self.fields) if self.fields is not None else None
        options = self.decode
        seed = self.seed
        by_url = self._source_index()

        def prepare(sample: dict[str, Any]) -> list[Any] | None:
            s: dict[str, Any] | None = sample
            if wanted is not None:
                s = stages.select_one(sample, wanted, policy)
            if s is not None:
                s["__source__"] = by_url.get(s["__url__"], 0) if by_url else 0
            if s is not None and options is not None:
                s = stages.decode_one(s, options, policy)
            if s is None or expand is None:
                return None
            rng = np.random.Generator(np.random.PCG64(stable_seed("expand", seed, epoch, s["__key__"])))
            try:
                items = list(expand.fn(s, rng))
                if len(items) != expand.count:
                    raise ValueError(f"returned {len(items)} items, expected count={expand.count}")
            except Exception as e:
                err = SampleError(f"{s['__url__']}: sample {s['__key__']!r}: expand raised {type(e).__name__}: {e}", reason="expand")
                if policy.mode == "raise":
                    raise err from e
                policy.handle(err)
                return None
            return items

        return prepare

    def _iter_samples(self, world: World, epoch: int, resume: ResumePoint | None, policy: stages.ErrorPolicy) -> Iterator[Any]:
        ids = self._units(world, epoch, resume)
        skip = resume.skip[world.worker] if (resume is not None and resume.skip) else 0
        in_main = torch.utils.data.get_worker_info() is None
        layout = resume.layout if resume is not None else ()
        progress = [ids[0] if ids else (resume.step if resume is not None else 0), 0, skip, layout]
        if in_main:  # set at iter(), so a state_dict() before the first next() names this epoch
            self._progress = progress
        return self._yield_samples(stream_world(world, resume), epoch, ids, skip, policy, progress, in_main)

    def _yield_samples(
        self, world: World, epoch: int, ids: list[int], skip: int, policy: stages.ErrorPolicy, progress: list[Any], in_main: bool
    ) -> Iterator[Any]:
        items, _ = self._pipeline(world, epoch, ids, skip, policy)
        stats = policy.stats
        try:
            for item in items:
                progress[1] += 1
                if item is None:
                    continue
                stats["samples"] += 1  # policy.good(), without a call per sample
                yield item
            policy.check_end()
        finally:
            close_iter(items)
        if in_main:
            self._progress = None

    def _iter_batches(self, world: World, epoch: int, resume: ResumePoint | None, policy: stages.ErrorPolicy) -> Iterator[WorkerItem]:
        b = self._batching
        if b is None:
            raise ShardflowError("internal: batching requested without a batch configuration")
        ids = self._units(world, epoch, resume)
        skip = resume.skip[world.worker] if (resume is not None and resume.skip) else 0
        items, sizes = self._pipeline(stream_world(world, resume), epoch, ids, skip, policy)
        counted = count_good(items, policy)
        try:
            if self.sized:
                for index, batch in stages.batched(counted, sizes, b.collate):
                    yield WorkerItem(world.worker, ids[index], batch, policy.snapshot())
            else:
                n = skip
                while True:
                    group = [x for x in take(counted, b.batch_size)]
                    full = len(group) == b.batch_size
                    group = [x for x in group if x is not None]
                    if group and (full or not b.drop_last):
                        yield WorkerItem(world.worker, n, b.collate(group), policy.snapshot())
                    n += 1
                    if not full:
                        break
            if world.num_workers == 1 or policy.stats["samples"]:
                policy.check_end()
        finally:
            close_iter(items)
        yield WorkerItem(world.worker, -1, None, policy.snapshot(), final=True)

    def __getstate__(self) -> dict[str, Any]:
        self.world()  # pickled for spawn workers: carry the ranks detected now
        state = self.__dict__.copy()
        state["_offset_cache"] = {}
        state["_plan_cache"] = None
        check_picklable_transform(self.transform)
        return state


def check_picklable_transform(transform: Any) -> None:
    """Raise a clear TypeError if a user transform cannot reach spawned DataLoader workers."""
    if transform is None:
        return
    try:
        pickle.dumps(transform)
    except Exception as e:
        raise TypeError(
            f"the transform {transform!r} cannot be pickled ({e}), so it cannot reach DataLoader "
            "workers started with 'spawn' or 'forkserver'; define it at module level (not a lambda or a "
            "local function), or use the 'fork' start method"
        ) from e
