"""The streaming dataset: :class:`ShardDataset` (its constructor, size, plan and epochs;
iteration, resumption and the loader's side are in the sibling modules)."""

from __future__ import annotations

import logging
import os
import pickle
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset

from .. import storage
from ..batching import Batching
from ..codecs import DecodeOptions, field_alternatives, preload, with_limits
from ..elastic import resumed_plan
from ..errors import MissingFieldError, ShardflowError
from ..expand import Expand
from ..mixing import mixture_of
from ..plan import RankPlan, ShuffleConfig, SplitConfig, plan_epoch, rank_share, select_plan, split_unsized
from ..seeding import generators
from ..selection import Select, resolve_selection
from ..policy import ErrorPolicy
from ..source import ShardSet, Source, SourcePart, resolve_source
from .classmix import effective_shuffle
from ..state import ResumePoint
from ..transforms import map_fields
from ..world import World
from .contract import LoaderContract
from .iteration import Iteration
from .resumable import Resumable

__all__ = ["ShardDataset", "check_picklable_transform"]

log = logging.getLogger(__name__)
_MAX_WORKERS = 256


class ShardDataset(Iteration, Resumable, LoaderContract, IterableDataset):
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
            :class:`~shardflow.policy.ErrorPolicy`.
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
        sample_seeding: seed the global generators from ``(seed, epoch, key)``
            before each per-sample transform and ``expand`` (and from the batch
            before ``collate_fn``), so draws follow the sample (:mod:`shardflow.seeding`).
            True (all three), False, or the names to seed out of ``"torch"``,
            ``"numpy"``, ``"python"`` (``("torch",)`` suits torchvision v2).
        select: keep only some samples, decided at plan time: a key predicate
            ``select(key) -> bool`` or a collection of keys. Exact on every
            rank (equal sample and batch counts, each selected sample once per
            epoch, no repeats; ``len()`` counts the selection). Reads every
            shard's tar headers once, here; needs a manifest and offset indexes
            (see :mod:`shardflow.selection`).

    Raises:
        FileNotFoundError: the source lists no shard.
        ManifestError: the manifest is invalid.
        MissingFieldError: ``fields`` names a field the manifest does not know
            (lists the fields that exist).
        SourceError: the same shard reached twice, or weights that cannot
            make a mixture (on some sources only, without ``samples_per_epoch``,
            on a source without a manifest).
        ShardflowError: a rank would get no data.
        ValueError: ``sample_seeding`` names an unknown generator.
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
        sample_seeding: bool | str | Sequence[str] = True,
        select: Select | None = None,
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
            self.decode = replace(self.decode or DecodeOptions(image=None), max_pixels=max_pixels)
        self.decode = with_limits(self.decode, io.limits)  # compressed fields: the members' limits
        self.seed = int(seed)
        self.sample_seeding = generators(sample_seeding)  # the names; () when off
        self.fields = tuple(fields) if fields is not None else None
        if isinstance(fields, str):
            raise TypeError("fields must be a sequence of names, e.g. ('jpg', 'cls'), not a str")
        self.transform = map_fields(transform) if isinstance(transform, Mapping) else transform
        if expand is not None and not isinstance(expand, Expand):
            raise TypeError(f"expand must be a shardflow.expand.Expand, got {type(expand).__name__}")
        self.expand = expand
        self.on_error = on_error
        ErrorPolicy(on_error)  # validates
        self._split = SplitConfig(partial=partial, samples_per_epoch=samples_per_epoch)  # type: ignore[arg-type]
        self._ranks = (rank, world_size)
        World.detect(rank, world_size)  # validates
        self.source: ShardSet = resolve_source(source, io)
        self._selection = resolve_selection(self.source, select, io) if select is not None else None
        self._check_fields()
        self.shuffle = effective_shuffle(self.shuffle, self.source, io)
        m = self.source.manifest  # here, once: DataLoader workers forked later inherit the decoders (graphs too)
        preload(self.decode, self.fields or (m.fields if m is not None else ()))
        self._mixture = mixture_of(self.source.parts, self._split.samples_per_epoch)
        if self.source.counts is None:  # fail here, not later inside a DataLoader worker
            split_unsized(len(self.source.urls), World.detect(rank, world_size), self.seed, 0, False)
        self.stats: Counter[str] = Counter()
        self._batching: Batching | None = None
        self._forked_workers = 0  # set_batching: DataLoader workers forked from this process
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
        if not World.in_worker():
            world = World.detect(*self._ranks)
            self._main_ranks = (world.rank, world.world_size)
            return world
        return World.detect(*self._ranks, default=getattr(self, "_main_ranks", None))

    @property
    def sources(self) -> tuple[SourcePart, ...]:
        """The sources, in order: their labels, shard ranges, weights; ``__source__`` indexes them."""
        return self.source.parts

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
            if self._selection is not None:  # the selected samples' costs, shards in manifest order
                starts = np.concatenate([[0], np.cumsum(self.source.counts)[:-1]])
                costs = costs[np.concatenate([starts[i] + c for i, c in enumerate(self._selection)])]
            if self.expand is not None:
                costs = np.repeat(costs, self.expand.count, axis=0)
            self._cost_cache = (b.columns, costs)
        return self._cost_cache[1]

    def _item_counts(self) -> np.ndarray | None:
        """Items per shard: samples times the one-to-many count; None without a manifest."""
        counts = self.source.counts
        if counts is not None and self._selection is not None:
            counts = np.asarray([len(c) for c in self._selection], dtype=np.int64)
        if counts is None or self.expand is None:
            return counts
        return counts * self.expand.count

    def __len__(self) -> int:
        """Samples this rank yields per epoch (independent of the worker count).

        Exact with ``select=`` (the selection's share). A transform that returns
        None, or ``on_error="skip"``, drops samples after the plan: ``len()`` is
        then the planned count, an upper bound of what arrives, while
        ``len(loader)`` stays exact (batches left empty repeat a batch; warned
        once per epoch with the count).

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

    def num_batches(
        self, num_workers: int = 1, epoch: int | None = None, *, layout: tuple[tuple[int, int], ...] | None = None
    ) -> int:
        """Batches per epoch of this rank under the loader's batching (sized only); the
        same for every ``num_workers``.

        ``epoch`` matters with cost-bounded batches, whose count depends on the
        epoch's order (None: :attr:`epoch`), and for a resumed epoch. ``layout``: the
        earlier ``(world size, steps)`` stages of a resumed epoch (an elastic resume,
        :mod:`shardflow.elastic`: the count is that of the resumed share); None: those
        of a state loaded for that epoch, if any.

        Raises:
            TypeError: no manifest.
        """
        counts = self._item_counts()
        if counts is None:
            raise TypeError(f"unknown number of batches: {self.source.unsized_reason()}")
        split = self._split_config()
        e = self.epoch if epoch is None else epoch
        if layout is None:
            layout = self._layout[1] if self._layout is not None and self._layout[0] == e else ()
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
        if self._selection is not None:
            plan = select_plan(plan, self._selection, self.expand.count if self.expand is not None else 1)
        self._plan_cache = (key, plan)
        return plan

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
        if not World.in_worker():
            # Iterating in this process: advance the epoch for every worker slot, so that
            # DataLoader workers forked later (each counting its own iterations) agree.
            epoch = int(self._control[0]) + int(self._control[1])
            self._apply_epoch(epoch + 1)
            return epoch
        n = int(self._control[1 + worker])
        self._control[1 + worker] = n + 1
        return int(self._control[0]) + n

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
