"""Map-style random access over shards: :class:`IndexedShardDataset`.

Sample ``i`` (global index, shards in manifest order, samples in file order,
the same order as ``ShardDataset(shuffle=False)``) is found through the
manifest's sample counts and its shard's offset index (the ``.npy`` beside the
shard: sample ``j`` spans bytes ``[idx[j], idx[j+1])``), then read with one
ranged read and parsed as a tar sample. So random access costs one read per
sample, local or remote, however large the shard. A framed ``.tar.zst`` shard
(written with ``compression="zstd"``) is read the same way through its frame
table: one ranged read of the frames that hold the sample (usually one, of a
few hundred KiB), decompressed.

Handles. The offset indexes of the ``max_open`` most recently used shards are
kept (least recently used evicted), and for local shards an open file
descriptor with them, read with ``os.pread`` (no seek, safe to share between
threads). Remote shards are read with :func:`shardflow.storage.read_range`
(fsspec ranged reads, retried on transient errors). Nothing open is pickled:
DataLoader workers (fork, spawn or forkserver) start with an empty cache, and a
forked process never reuses its parent's descriptors.
"""

from __future__ import annotations

import bisect
import logging
import operator
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from torch.utils.data import Dataset

from . import storage
from .codecs import DecodeOptions, with_limits
from .dataset import check_picklable_transform
from .errors import ManifestError, ShardflowError, ShardFormatError, TruncatedShardError
from .format.frames import FrameTable
from .format.compression import COMPRESSED_SUFFIXES
from .format.tar import iter_samples, raw_sample
from .policy import ErrorPolicy
from .reader import Prepare, check_fields, tag_source, transform_error
from .sources.source import ShardSet, resolve_source
from .transforms import map_fields

__all__ = ["IndexedShardDataset"]

log = logging.getLogger(__name__)



@dataclass
class _Shard:
    """One cached shard: its offset index and, for a local shard, an open descriptor."""

    offsets: np.ndarray
    fd: int | None
    frames: FrameTable | None = None
    memo: dict[int, bytes] = field(default_factory=dict)  # the last frame decompressed (framed shards)

    def close(self) -> None:
        if self.fd is not None:
            try:
                os.close(self.fd)
            except OSError:  # pragma: no cover - already closed
                pass
            self.fd = None


def _local_path(url: str) -> str | None:
    """The local path of a URL, or None for a remote one."""
    if "://" not in url:
        return url
    if url.startswith("file://"):
        return url[len("file://") :]
    return None


class IndexedShardDataset(Dataset):
    """Random access to the samples of a shard dataset by global index.

    A map-style ``torch.utils.data.Dataset``: use it with any sampler
    (``RandomSampler``, ``DistributedSampler``, ``SubsetRandomSampler``, ...)
    and DataLoader workers. ``ds[i]`` is the same dict :class:`ShardDataset`
    yields for that sample: ``__key__`` (str), ``__url__`` (the shard URL),
    ``__source__`` (int, the source's index in a list of sources; 0 for one) and
    the fields decoded by extension (see :mod:`shardflow.codecs`); ``fields=``
    selects them as :class:`ShardDataset`'s does.

    Bad samples (``on_error``): a map-style dataset has no stream to drop a
    sample from (``len()``, samplers and torch's default collate expect ``ds[i]``
    to be a sample). Under ``"raise"`` (default) ``ds[i]`` raises the error, which
    names the shard, the key and what was wrong; under ``"skip"``/``"warn"`` it
    returns the next sample that reads (``i + 1``, ..., wrapping to 0) in its
    place, never None: the epoch holds that neighbour twice, and :attr:`stats`
    counts the bad one (``"warn"`` also logs it).

    Example::

        ds = shardflow.IndexedShardDataset("data/shards")
        sampler = DistributedSampler(ds, shuffle=True, seed=0)
        dl = DataLoader(ds, batch_size=256, sampler=sampler, num_workers=8)

    Args:
        source: as for :class:`ShardDataset` (folder, manifest URL, pattern or
            list of URLs). A manifest with offset indexes is required.
        decode: ``"numpy"`` (images as uint8 arrays, shape (H, W, 3)),
            ``"torch"`` (uint8 tensors, shape (3, H, W)), ``"pil"``, None (every
            field stays bytes), or a :class:`~shardflow.codecs.DecodeOptions`.
        fields: field names to keep (``__key__``/``__url__`` are always kept);
            a sample lacking one is an error under ``on_error``. ``"jpg;png"``
            takes the first present; ``"image"`` stands for whichever image field
            a sample has (``jpg``, ``png``, ``webp``, ...). None keeps all.
        transform: ``transform(sample) -> Any`` applied to each decoded sample;
            must be picklable for DataLoader workers started with spawn. A
            mapping ``{field: fn}`` transforms single fields (see
            :func:`shardflow.map_fields`). Under ``"skip"``/``"warn"`` a
            transform that raises makes a bad sample (reason ``"transform"``).
        on_error: ``"raise"`` (default), ``"skip"`` or ``"warn"`` (see above and
            :class:`~shardflow.policy.ErrorPolicy`).
        storage_options: fsspec options (credentials, endpoint, ...): a shortcut that
            stays, equal to ``io=IOOptions(storage_options=...)``; ``ValueError`` when
            ``io`` is given too (the options live in one place).
        max_open: shards whose offset index (and local file descriptor) stay
            cached, least recently used evicted.
        io: retries and storage options, a :class:`~shardflow.storage.IOOptions`
            (instead of ``storage_options``).

    Attributes:
        shards: the shards read (a :class:`~shardflow.sources.shardset.ShardSet`: URLs,
            offset indexes, the manifest and per-shard sample counts).
        stats: this process's counters (``samples`` returned, ``skipped`` and one
            per reason; each DataLoader worker counts in its own copy).

    Raises:
        ManifestError: no manifest (so no sample counts), or shards the manifest
            lists without an offset index: run ``shardflow index`` on them.
        MissingFieldError: ``fields`` names a field the manifest does not know
            (lists the fields that exist).
        TypeError: ``fields`` is a str.
        ShardFormatError: a shard is compressed (``.tar.gz``, ``.tar.zst``)
            without a frame table: random access needs plain ``.tar`` shards
            or framed ``.tar.zst`` ones (``compression="zstd"``).
        FileNotFoundError: the source lists no shard.
        ValueError: ``max_open < 1``, both ``io`` and ``storage_options``, or an
            unknown ``on_error``.
    """

    def __init__(
        self,
        source: str | os.PathLike | Sequence[str],
        *,
        decode: str | DecodeOptions | None = "numpy",
        fields: Sequence[str] | None = None,
        transform: Callable[[dict[str, Any]], Any] | None = None,
        on_error: str = "raise",
        storage_options: Mapping[str, Any] | None = None,
        max_open: int = 16,
        io: storage.IOOptions | None = None,
    ) -> None:
        io = storage.io_options(io, storage_options)
        if isinstance(max_open, bool) or not isinstance(max_open, int) or max_open < 1:
            raise ValueError(f"max_open must be an int >= 1, got {max_open!r}")
        if isinstance(decode, DecodeOptions) or decode is None:
            self.decode = decode
        else:
            self.decode = DecodeOptions(image=decode)
        self.decode = with_limits(self.decode, io.limits)  # compressed fields: the members' limits
        self.io = io
        self.transform = map_fields(transform) if isinstance(transform, Mapping) else transform
        self.max_open = max_open
        if isinstance(fields, str):
            raise TypeError("fields must be a sequence of names, e.g. ('jpg', 'cls'), not a str")
        self.fields = tuple(fields) if fields is not None else None
        self.on_error = on_error
        self._policy = ErrorPolicy(on_error)  # validates
        self.shards: ShardSet = resolve_source(source, io)
        manifest = self.shards.manifest
        if manifest is None:
            raise ManifestError(
                f"{self.shards.urls[0]}{' ...' if len(self.shards.urls) > 1 else ''}: no shardflow.json manifest, "
                "so samples cannot be addressed by index; run `shardflow index` on the shards to write the "
                "manifest and offset indexes"
            )
        compressed = [u for u, info in zip(self.shards.urls, manifest.shards)
                      if u.lower().endswith(COMPRESSED_SUFFIXES) and not info.frames]
        if compressed:
            raise ShardFormatError(_compressed_message(compressed[0], len(compressed)), reason="compressed_shard")
        missing = [u for u, ix in zip(self.shards.urls, self.shards.index_urls) if ix is None]
        if missing:
            raise ManifestError(
                f"{len(missing)} of {len(self.shards.urls)} shards have no offset index in {manifest.url} "
                f"(first: {missing[0]}); random access needs one per shard: run `shardflow index` on them "
                "(compressed shards never get one: random access needs uncompressed .tar shards)",
                reason="missing_index",
            )
        check_fields(manifest, self.fields)
        self._sources = self.shards.source_by_url()
        self._prepare = Prepare(self._policy, fields=self.fields, sources=self._sources, decode=self.decode)
        # first global index of each shard, plus the total (a list: bisect on it is faster per call)
        self._starts: list[int] = [0, *np.cumsum(self.shards.counts).tolist()]
        self._reset_cache()

    # ------------------------------------------------------------ cache

    def _reset_cache(self) -> None:
        self._cache: OrderedDict[int, _Shard] = OrderedDict()
        self._lock = threading.Lock()
        self._pid = os.getpid()

    def close(self) -> None:
        """Close the cached file descriptors (they reopen on the next access)."""
        with self._lock:
            for entry in self._cache.values():
                entry.close()
            self._cache.clear()

    def __del__(self) -> None:
        cache = getattr(self, "_cache", None)
        if cache and getattr(self, "_pid", None) == os.getpid():
            for entry in cache.values():
                entry.close()

    def __getstate__(self) -> dict[str, Any]:
        check_picklable_transform(self.transform)
        state = self.__dict__.copy()
        for name in ("_cache", "_lock", "_pid"):
            state.pop(name, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._reset_cache()

    def _shard(self, shard: int) -> _Shard:
        """The cached entry of a shard, loading its offset index (and opening it) if needed."""
        if self._pid != os.getpid():  # forked: the parent's descriptors are not ours to use
            self._reset_cache()
        with self._lock:
            entry = self._cache.get(shard)
            if entry is not None:
                self._cache.move_to_end(shard)
                return entry
        entry = self._open(shard)
        with self._lock:
            other = self._cache.get(shard)
            if other is not None:  # another thread was faster
                entry.close()
                return other
            self._cache[shard] = entry
            while len(self._cache) > self.max_open:
                _, old = self._cache.popitem(last=False)
                old.close()
        return entry

    def _open(self, shard: int) -> _Shard:
        url = self.shards.urls[shard]
        index_url = self.shards.index_urls[shard]
        try:
            offsets = self.shards.load_offsets(shard, self.io)
        except FileNotFoundError as e:
            raise ManifestError(
                f"{url}: its offset index {index_url} is missing; run `shardflow index` to rewrite it",
                reason="missing_index",
            ) from e
        if offsets is None:  # pragma: no cover - checked in __init__
            raise ManifestError(f"{url}: no offset index; run `shardflow index`", reason="missing_index")
        path = _local_path(url)
        try:
            fd = storage.regular_fd(path) if path is not None else None
        except FileNotFoundError as e:
            raise storage.ShardNotFoundError(f"shard not found: {url}") from e
        entry = _Shard(offsets, fd)
        try:
            if fd is not None:
                _check_size(self.shards, shard, os.fstat(fd).st_size)
            entry.frames = self.shards.load_frames(shard, self.io)
            if entry.frames is not None:
                return entry
            head = os.pread(fd, 4, 0) if fd is not None else storage.read_range(url, 0, 4, self.io)
        except BaseException:
            entry.close()
            raise
        if head.startswith((storage.GZIP_MAGIC, storage.ZSTD_MAGIC)):
            entry.close()
            raise ShardFormatError(_compressed_message(url, 1), reason="compressed_shard")
        return entry

    # ------------------------------------------------------------ access

    def __len__(self) -> int:
        """Samples in all shards (from the manifest)."""
        return self._starts[-1]

    @property
    def source(self) -> ShardSet:
        """The same object as :attr:`shards`, under its old name (kept for one release: "source"
        now means one input of several, :class:`~shardflow.Source`, and a sample's
        ``__source__`` says which)."""
        return self.shards

    @property
    def urls(self) -> list[str]:
        """Shard URLs in manifest order."""
        return list(self.shards.urls)

    @property
    def manifest(self):  # noqa: ANN201 - Manifest
        """The dataset's manifest."""
        return self.shards.manifest

    def locate(self, index: int) -> tuple[int, int]:
        """``(shard number, sample number within the shard)`` of a global index.

        Raises:
            IndexError: ``index`` is outside ``[-len(self), len(self))``.
            TypeError: ``index`` is not an integer.
        """
        i = operator.index(index)
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"sample index {index} is out of range for a dataset of {n} samples")
        shard = bisect.bisect_right(self._starts, i) - 1
        return shard, i - self._starts[shard]

    def read_raw(self, index: int) -> dict[str, Any]:
        """Sample ``index`` with its fields as stored bytes (no decoding, no transform)."""
        shard, local = self.locate(index)
        url = self.shards.urls[shard]
        entry = self._shard(shard)
        start, end = int(entry.offsets[local]), int(entry.offsets[local + 1])
        if entry.frames is not None:
            fd = entry.fd
            data = storage.read_framed_range(url, start, end, entry.frames, self.io,
                                             read=None if fd is None else lambda a, b: os.pread(fd, b - a, a),
                                             memo=entry.memo)
        elif entry.fd is not None:
            data = os.pread(entry.fd, end - start, start)
        else:
            data = storage.read_range(url, start, end, self.io)
        if len(data) != end - start:
            raise TruncatedShardError(
                f"{url}: sample {local} should span bytes [{start}, {end}) but the shard ends at byte "
                f"{start + len(data)}; the shard is truncated or its offset index is stale (run `shardflow index`)"
            )
        found = list(iter_samples([data], url, start, end=end, limits=self.io.limits))
        if len(found) != 1:
            raise ManifestError(
                f"{url}: bytes [{start}, {end}) hold {len(found)} samples instead of 1; the offset index does not "
                "match the shard (run `shardflow index` to rewrite it)",
                reason="stale_index",
            )
        key, _, fields = found[0]
        return tag_source(raw_sample(key, url, fields), self._sources)  # type: ignore[arg-type]

    @property
    def stats(self) -> Any:
        """This process's counters (a ``collections.Counter``; see :class:`~shardflow.policy.ErrorPolicy`)."""
        return self._policy.stats

    def __getitem__(self, index: int) -> Any:
        """Sample ``index`` (negative counts from the end), its fields selected, decoded and
        transformed; under ``on_error="skip"``/``"warn"``, in place of a bad one the next
        sample that reads (see the class).

        Raises:
            IndexError: out of range.
            MissingFieldError: the sample lacks a field of ``fields`` (names shard and key).
            DecodeError: a field could not be decoded (names shard and key).
            ShardFormatError, TruncatedShardError, ManifestError: the shard or
                its offset index is unusable (the message says what to run).
            RemoteReadError: reading failed after retries.
            ShardflowError: under skip/warn, no sample could take its place
                (every one bad, or :attr:`~shardflow.policy.ErrorPolicy.max_consecutive` in a row).
        """
        policy = self._policy
        if policy.mode == "raise":
            out = self._item(index)
        else:
            shard, local = self.locate(index)
            start, n = self._starts[shard] + local, len(self)
            for k in range(n):
                out = self._item((start + k) % n)
                if out is not _DROPPED:
                    break
            else:
                raise ShardflowError(f"no sample of the {n} could be read under on_error={self.on_error!r}: "
                                     f"{dict(policy.stats)}")
        policy.good()
        return out

    def _item(self, index: int) -> Any:
        """Sample ``index`` prepared and transformed, or :data:`_DROPPED` when the policy
        dropped it (skip/warn; under raise its error is raised)."""
        policy = self._policy
        try:
            sample = self.read_raw(index)
        except ShardflowError as e:
            if policy.mode == "raise":
                raise
            policy.handle(e)
            return _DROPPED
        if self.fields is not None or self.decode is not None:
            sample = self._prepare.one(sample)
            if sample is None:
                return _DROPPED
        if self.transform is None:
            return sample
        if policy.mode == "raise":
            return self.transform(sample)  # the transform's own exception, as it raised it
        try:
            return self.transform(sample)
        except Exception as e:
            policy.handle(transform_error(sample, self.transform, e), cause=e)
            return _DROPPED


_DROPPED = object()


def _check_size(source: Any, shard: int, size: int) -> None:
    """Refuse a local shard longer than the manifest lists (replaced since it was
    indexed): its offsets would address other samples than the ones listed, as
    the streaming reader refuses it (shorter is a truncation, found on read)."""
    manifest = source.manifest
    listed = manifest.shards[shard].bytes if manifest is not None else -1
    if 0 <= listed < size:
        raise ManifestError(
            f"{source.urls[shard]}: the shard has {size} bytes but the manifest lists {listed}: it changed since "
            "the manifest was written (re-run `shardflow index`, or restore the shard)",
            reason="changed_shard",
        )


def _compressed_message(url: str, n: int) -> str:
    more = f" (and {n - 1} more)" if n > 1 else ""
    return (
        f"{url}{more}: compressed shard; random access needs plain .tar shards (a compressed stream cannot be "
        "entered in the middle). Stream it with ShardDataset, or decompress it (gunzip / zstd -d) and run "
        "`shardflow index` on the .tar"
    )
