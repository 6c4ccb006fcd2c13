"""The streaming dataset: :class:`ShardDataset`, its configuration, size and plan. Its epochs
are :class:`~shardflow.dataset.epochs.Epochs` and their runs
(:class:`~shardflow.dataset.epochrun.EpochRun`), which hold every position."""

from __future__ import annotations

import logging
import os
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any

import numpy as np
from torch.utils.data import IterableDataset

from .. import storage
from ..loading.batching import Batching
from ..codecs import DecodeOptions, preload
from ..planning.elastic import resumed_plan
from ..expand import Expand
from ..planning.mixing import mixture_of
from ..planning.plan import RankPlan, ShuffleConfig, SplitConfig, plan_epoch, rank_share, select_plan, split_unsized
from ..seeding import generators
from ..planning.selection import Select, resolve_selection
from ..policy import ErrorPolicy
from ..reader import check_fields
from ..sources.source import ShardSet, Source, SourcePart, resolve_source
from .classmix import effective_shuffle, warn_unmixed
from ..transforms import map_fields
from ..world import World
from .epochrun import EpochRun
from .epochs import Epochs
from .options import check_picklable_transform, decode_options, shuffle_config

__all__ = ["ShardDataset", "check_picklable_transform"]

log = logging.getLogger(__name__)


class ShardDataset(IterableDataset):
    """Stream samples from tar shards, locally or from any fsspec URL.

    Each sample is a dict: ``__key__`` (str), ``__url__`` (the shard's URL),
    ``__source__`` (int: the index of its source in a list of sources, 0 for
    one) and one entry per field, decoded by the field's extension (see
    :mod:`shardflow.codecs`). With a manifest, every rank gets exactly the same
    number of samples per epoch, and over an epoch the ranks and DataLoader
    workers together see every sample once (plus declared padding); see
    :mod:`shardflow.planning.plan` for the exact rules, :mod:`shardflow.planning.mixing` for
    weighted mixtures and :mod:`shardflow.planning.elastic` for resuming on another
    world size. Use :func:`shardflow.loader` for batching with workers and for
    resumption with workers.

    Args:
        source: a folder (its ``shardflow.json`` is read first; without one,
            its ``.tar*`` files), a manifest URL, a brace pattern or glob
            (``s3://b/train-{000000..000099}.tar``), parts joined by ``::``,
            a :class:`~shardflow.sources.source.Source`, or a list of sources (each
            entry one source: a folder, manifest or shard URL used as given,
            or a ``Source``): their union, or with weights and
            ``samples_per_epoch`` a weighted mixture.
        shuffle: False keeps the stored order (shards in manifest/URL order,
            samples in file order); True shuffles shards per epoch and samples
            through a 1,000-sample buffer; an int sets the buffer size; or a
            :class:`~shardflow.planning.plan.ShuffleConfig`.
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
            shared out by weight: :mod:`shardflow.planning.mixing`).
        rank: this process's rank; default detected (``torch.distributed``,
            else ``RANK``/``WORLD_SIZE``, else 0).
        world_size: number of ranks; give with ``rank``.
        storage_options: fsspec options (credentials, endpoint, ...): a shortcut for
            ``io=IOOptions(storage_options=...)`` (``ValueError`` with ``io`` too).
        io: retries, read-ahead and cache; a :class:`~shardflow.storage.IOOptions`.
        max_pixels: image decompression-bomb limit in pixels: a shortcut for ``decode=
            DecodeOptions(max_pixels=...)``, applied over one given (``ds.decode.max_pixels``).
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
            (see :mod:`shardflow.planning.selection`).

    Attributes:
        shards: the shards read (:class:`~shardflow.sources.shardset.ShardSet`: URLs, offset
            indexes, manifest, counts, each shard's :class:`~shardflow.Source`).

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
        self.shuffle = shuffle_config(shuffle)
        self.decode = decode_options(decode, max_pixels, io)
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
        self.shards: ShardSet = resolve_source(source, io)
        self._selection = resolve_selection(self.shards, select, io) if select is not None else None
        check_fields(self.shards.manifest, self.fields)
        self.shuffle = effective_shuffle(self.shuffle, self.shards, io)  # (local, class-sorted shards: the window)
        m = self.shards.manifest  # here, once: DataLoader workers forked later inherit the decoders (graphs too)
        preload(self.decode, self.fields or (m.fields if m is not None else ()))
        self._mixture = mixture_of(self.shards.parts, self._split.samples_per_epoch)
        if self.shards.counts is None:  # fail here, not later inside a DataLoader worker
            split_unsized(len(self.shards.urls), World.detect(rank, world_size), self.seed, 0, False)
        self._batching: Batching | None = None
        self._forked_workers = 0  # set_batching: DataLoader workers forked from this process
        self._offset_cache: dict[int, np.ndarray | None] = {}
        self._plan_cache: tuple[tuple[Any, ...], RankPlan] | None = None
        self._cost_cache: tuple[tuple[str, ...], np.ndarray] | None = None
        self._epochs = Epochs()  # the epoch clock and the runs: every position is a run's

    @property
    def source(self) -> ShardSet:
        """:attr:`shards` under its old name, kept for one release."""
        return self.shards

    @property
    def manifest(self):  # noqa: ANN201 - Manifest | None
        """The manifest (restricted to the shards read), or None."""
        return self.shards.manifest

    @property
    def samples_per_epoch(self) -> int | None:
        """Samples per rank per epoch when training by steps (or a mixture), else None."""
        return self._split.samples_per_epoch

    @property
    def sized(self) -> bool:
        """True when sample counts are known (a manifest), so splits are exact."""
        return self.shards.counts is not None

    @property
    def urls(self) -> list[str]:
        """Shard URLs in stream order."""
        return list(self.shards.urls)

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
        return self.shards.parts

    @property
    def selection(self) -> list[np.ndarray] | None:
        """The selected sample numbers of each shard (``select=``), or None."""
        return self._selection

    def split_config(self, batched: bool = True) -> SplitConfig:
        """How the plans split an epoch: ``partial``, ``samples_per_epoch`` and, ``batched``,
        the loader's batch size, ``drop_last`` and cost budget."""
        b = self._batching if batched else None
        if b is None:
            return self._split
        split = self._split
        return SplitConfig(partial=split.partial, batch_size=b.batch_size, drop_last=b.drop_last,
                           samples_per_epoch=split.samples_per_epoch, max_cost=b.budget)

    def _costs(self) -> np.ndarray | None:
        """Per-item costs, int64 of shape (items, columns) (the loader's cost columns),
        items in manifest order; None unless batching by cost."""
        b = self._batching
        if b is None or b.budget is None:
            return None
        if self._cost_cache is None or self._cost_cache[0] != b.columns:
            costs = np.stack([self.shards.load_costs(c, self.io) for c in b.columns], axis=1)
            if self._selection is not None:  # the selected samples' costs, shards in manifest order
                starts = np.concatenate([[0], np.cumsum(self.shards.counts)[:-1]])
                costs = costs[np.concatenate([starts[i] + c for i, c in enumerate(self._selection)])]
            if self.expand is not None:
                costs = np.repeat(costs, self.expand.count, axis=0)
            self._cost_cache = (b.columns, costs)
        return self._cost_cache[1]

    def item_counts(self) -> np.ndarray | None:
        """Items per shard (int64, shape (shards,)): samples (selected ones with ``select=``)
        times the one-to-many count; None without a manifest."""
        counts = self.shards.counts
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
        counts = self.item_counts()
        if counts is None:
            raise TypeError(f"this ShardDataset's length is unknown: {self.shards.unsized_reason()}")
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
        :mod:`shardflow.planning.elastic`: the count is that of the resumed share); None: those
        of a state loaded for that epoch, if any.

        Raises:
            TypeError: no manifest.
        """
        counts = self.item_counts()
        if counts is None:
            raise TypeError(f"unknown number of batches: {self.shards.unsized_reason()}")
        split = self.split_config()
        e = self.epoch if epoch is None else epoch
        if layout is None:
            layout = self._epochs.layout(e)
        if split.max_cost is not None or layout:  # cost-bounded batches, or the rest of an elastic epoch
            return self.plan(e, layout=layout).num_batches
        world = self.world()
        _, nb, _, _ = rank_share(int(counts.sum()), world.world_size, split)
        return nb

    def plan(
        self, epoch: int | None = None, rank: int | None = None, *, layout: tuple[tuple[int, int], ...] | None = None,
        batched: bool = True,
    ) -> RankPlan:
        """The rank's plan for an epoch (see :mod:`shardflow.planning.plan`); sized only.

        ``layout``: the earlier ``(world size, steps)`` stages of a resumed epoch
        (:mod:`shardflow.planning.elastic`); None: those of a loaded state for that epoch, if any.
        ``batched``: under the loader's batching, if any; False: one sample a step (the
        plan a direct iteration reads)."""
        counts = self.item_counts()
        if counts is None:
            raise TypeError("no plan without a manifest (see `shardflow index`)")
        world = self.world()
        r = world.rank if rank is None else rank
        e = self.epoch if epoch is None else epoch
        if layout is None:
            layout = self._epochs.layout(e)
        split = self.split_config(batched)
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

        Raises:
            StateError: ``epoch`` is not an int in ``[0, 2**62)`` (:data:`~shardflow.state.MAX_EPOCH`;
                seeds are derived from the epoch in 64 bits).
        """
        self._epochs.choose(epoch)

    @property
    def epoch(self) -> int:
        """The epoch the next iteration (since the last ``set_epoch``) starts from."""
        return self._epochs.epoch

    @property
    def stats(self) -> Counter[str]:
        """The counters of the last epoch run in this process (see :class:`~shardflow.policy.ErrorPolicy`;
        a loader's merged from its workers, with ``repeated_batches``)."""
        run = self._epochs.current
        return run.stats if run is not None else Counter()

    def __iter__(self) -> Iterator[Any]:
        """A pass over this rank's (and DataLoader worker's) share of the next epoch: its
        samples, under the dataset's own split (also after a loader took the dataset)."""
        return self._epochs.iterate(self)

    def shard_offsets(self, shard: int) -> np.ndarray | None:
        """A shard's offset index (None without one), loaded once per process.
        (The shard's size is checked against the manifest when it is opened.)"""
        if shard not in self._offset_cache:
            self._offset_cache[shard] = self.shards.load_offsets(shard, self.io)
        return self._offset_cache[shard]

    def state_dict(self) -> dict[str, Any]:
        """Position in the current epoch when iterating in this process.

        Taken mid-epoch and loaded into a fresh dataset, iteration continues
        with exactly the samples not yet yielded, in the same order. With
        DataLoader workers use the state of :func:`shardflow.loader` instead:
        the dataset in the main process cannot see what workers yielded.
        """
        return self._epochs.state_dict(self)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from :meth:`state_dict`: the next iteration continues that epoch.

        Raises:
            StateError: another version, or a different configuration (the
                message lists each difference).
        """
        self._epochs.load_state_dict(self, state)

    def set_batching(self, batching: Batching | None, num_workers: int = 1, *, forked: bool = False) -> None:
        """Let DataLoader workers batch and collate (:func:`shardflow.loader` calls this);
        None: yield samples. ``num_workers``: the loader's workers per rank; ``forked``: they
        are forked from this process, which requests their first batches' bytes as they
        start (:mod:`.warmstart`)."""
        self._batching = batching
        self._forked_workers = num_workers if forked and batching is not None else 0
        warn_unmixed(self)
        if batching is not None and batching.drop_last and num_workers > 1 and not self.sized:
            log.warning(
                "without a manifest, drop_last drops each DataLoader worker's last incomplete batch (up to %d "
                "per epoch, or everything when a worker holds less than one batch); write a manifest with "
                "`shardflow index` for one drop per rank",
                num_workers,
            )

    @property
    def batching(self) -> Batching | None:
        """The loader's batching, or None when the dataset yields samples."""
        return self._batching

    def epoch_run(
        self, num_workers: int, *, after: EpochRun | None = None, state: Mapping[str, Any] | None = None
    ) -> EpochRun:
        """The loader epoch that the next loader iteration reads, not started yet: that of
        ``state``, else the one given to :meth:`set_epoch` since the last loader epoch
        began, else the one after ``after`` (the loader's previous run), else :attr:`epoch`.

        Raises:
            StateError: ``state`` (a ``"ShardLoader"`` state) is of another kind, version or
                configuration (each difference named), or holds values no run could save.
        """
        return self._epochs.next_run(self, num_workers, after=after, state=state)

    def starting(self, run: EpochRun) -> AbstractContextManager[None]:
        """The context to start a loader run's DataLoader workers in (``run.start()``): they
        copy the run with the dataset and yield its batch records."""
        return self._epochs.starting(self, run, self._forked_workers)

    def __getstate__(self) -> dict[str, Any]:
        self.world()  # pickled for spawn workers: carry the ranks detected now
        state = self.__dict__.copy()
        state["_offset_cache"] = {}
        state["_plan_cache"] = None
        check_picklable_transform(self.transform)
        return state
