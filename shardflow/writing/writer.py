"""Writing samples into tar shards with a manifest.

:class:`ShardWriter` packs sample dicts into shards named by a ``%``-pattern,
rotating by sample count and byte size. Each shard is written under a temporary
name and appears at its final name only when complete. The manifest
``shardflow.json`` beside the shards is written once, atomically, when the writer
closes (or aborts after an exception: it then lists the finished shards). While
it runs, a local writer appends one line per finished shard to
``shardflow.json.journal`` (constant cost per shard), so that a writer killed at
any point leaves a journal that lists every shard at its name and nothing else;
a dataset opened on a folder with a journal and no manifest replays it, and the
next writer of the folder replays it into the manifest before anything else. A
killed remote writer leaves complete shards and no manifest (``shardflow index``
writes one).

A folder may hold several writers' shards (``train-%06d.tar`` and ``val-%06d.tar``):
a writer keeps every shard the folder's manifest lists except the earlier ones of its
own series (its pattern, numbers from ``start_shard`` on), which it replaces; the
manifest lists the kept shards, then its own (see ``docs/getting-data-in.md``).
"""

from __future__ import annotations

import copy
import hashlib
import logging
import os
import posixpath
from collections.abc import Iterable, Mapping, Sequence
from contextlib import ExitStack
from typing import Any, BinaryIO

from .. import storage
from ..codecs import encode_field
from ..errors import DestinationExistsError, SampleError
from ..format.keys import check_field, check_key
from ..format.manifest import (
    JOURNAL_SUFFIX,
    MANIFEST_NAME,
    Manifest,
    ShardInfo,
    encode_offsets,
    fields_of,
)
from ..format.journal import journal_commit, journal_entry, journal_header
from ..graph import is_graph
from .shardfile import ShardFile
from ..storage.writing.folder import folder_manifest, series_number, shard_names
from ..storage.writing.locks import DestinationLock, remove_stale_temporaries
from ..storage.urls import join_url, local_path, parent_url

__all__ = ["ShardWriter", "ShardFile", "encode_sample_dict", "write_manifest", "tar_size"]

log = logging.getLogger(__name__)


def encode_sample_dict(sample: Mapping[str, Any]) -> tuple[str, dict[str, bytes]]:
    """Turn a sample dict into ``(key, {field: bytes})``.

    ``__key__`` is required; other keys starting with ``__`` (``__url__``, ...)
    are metadata and are not written. Values are encoded by the codec of the
    field's last extension (see :mod:`shardflow.codecs`).

    Raises:
        SampleError: no ``__key__``, an invalid key or field name, a None value,
            no fields, or a value no codec can encode.
    """
    if "__key__" not in sample:
        raise SampleError(f"sample has no '__key__' (fields: {sorted(sample)})")
    key = check_key(sample["__key__"])
    fields: dict[str, bytes] = {}
    for name, value in sample.items():
        if name.startswith("__"):
            continue
        check_field(key, name)
        if value is None:
            raise SampleError(f"sample {key!r}: field {name!r} is None")
        fields[name] = encode_field(key, name, value)
    if not fields:
        raise SampleError(f"sample {key!r} has no fields")
    return key, fields


def tar_size(fields: Mapping[str, bytes]) -> int:
    """The bytes an encoded sample takes in a shard, as shard size limits count them:
    a 512-byte header per field plus its data padded to 512 bytes (long names and
    PAX headers not counted)."""
    return sum(512 + len(v) + 511 for v in fields.values())


SIZE_COLUMNS = ("num_nodes", "num_edges")


def graph_sizes(sample: Mapping[str, Any]) -> tuple[int, int] | None:
    """``(num_nodes, num_edges)`` summed over the sample's graph fields, or None
    when it has none; recorded in the sizes index so loaders can batch by cost."""
    nodes = edges = 0
    found = False
    for name, value in sample.items():
        if name.startswith("__") or isinstance(value, (bytes, bytearray, memoryview)):
            continue
        if is_graph(value):  # any BaseData, user subclasses included
            found = True
            nodes += int(value.num_nodes or 0)
            edges += int(value.num_edges or 0)
    return (nodes, edges) if found else None


def write_manifest(url: str, manifest: Manifest, io: storage.IOOptions | None = None) -> None:
    """Write a manifest atomically (temporary name, then rename)."""
    with storage.open_output(url, io or storage.IOOptions()) as f:
        f.write(manifest.dumps())


class ShardWriter:
    """Write samples into numbered tar shards plus a ``shardflow.json`` manifest.

    Example::

        with shardflow.ShardWriter("out/train-%06d.tar", max_count=1000) as sink:
            sink.write({"__key__": "cat/0001", "jpg": jpeg_bytes, "cls": 3})

    Members of each sample are written adjacent and sorted by field, with
    deterministic headers, so the same input gives byte-identical shards.

    Args:
        pattern: shard URL with one ``%d``-style placeholder for the shard
            number, local (``out/train-%06d.tar``) or fsspec
            (``s3://bucket/train-%06d.tar``).
        max_count: most samples per shard.
        max_bytes: shard size limit in bytes; a sample that would cross it
            starts a new shard (a single larger sample gets a shard of its own).
        start_shard: number of the first shard.
        manifest: manifest URL; default ``shardflow.json`` beside the shards;
            False writes none.
        meta: the manifest's ``meta`` object.
        index: write a per-shard offset index (``<shard>.idx.npy``).
        overwrite: start a new manifest, listing this writer's shards only (the
            folder's earlier manifest or journal is dropped; its files stay).
            Without it, the shards the folder's manifest lists are kept, except
            the earlier shards of this writer's own series, which it replaces.
        storage_options: passed to fsspec for remote destinations.
        io: how shards are written, a :class:`~shardflow.storage.IOOptions`
            (instead of ``storage_options``).
        compression: ``"zstd"`` writes ``.tar.zst`` shards (``.zst`` is added to
            the pattern unless it ends so): plain tar inside, stored as
            independent zstd frames with a frame table beside the offset
            index, so that seeking, random access and resumption work as on
            plain shards (see :mod:`shardflow.format.frames`); ``max_bytes``
            counts tar bytes. None (default): plain ``.tar``.

    Raises:
        ValueError: bad ``pattern``, ``max_count`` or ``max_bytes``, or both
            ``io`` and ``storage_options``.
        SampleError: from :meth:`write`, for an invalid sample.
        ManifestError: from the first :meth:`write`, when the folder's manifest
            or journal cannot be read (and ``overwrite`` is False).
        DestinationExistsError: from the first :meth:`write`, when this writer's
            series would replace shards of a conversion (the folder's manifest has
            ``meta.conversion``; and ``overwrite`` is False): nothing is changed.
    """

    def __init__(
        self,
        pattern: str,
        max_count: int = 10_000,
        max_bytes: int = 1 << 30,
        *,
        start_shard: int = 0,
        manifest: str | bool = True,
        meta: Mapping[str, Any] | None = None,
        index: bool = True,
        overwrite: bool = False,
        storage_options: Mapping[str, Any] | None = None,
        io: storage.IOOptions | None = None,
        compression: str | None = None,
    ) -> None:
        if compression is not None and not pattern.endswith(".zst"):
            pattern += ".zst"
        try:
            pattern % 0
        except TypeError:
            raise ValueError(f"shard pattern {pattern!r} needs one %d-style placeholder, e.g. 'out/train-%06d.tar'") from None
        if max_count < 1 or max_bytes < 1:
            raise ValueError(f"max_count and max_bytes must be positive, got {max_count}, {max_bytes}")
        self.pattern = pattern
        self.max_count = max_count
        self.max_bytes = max_bytes
        self.io = storage.io_options(io, storage_options)
        self.index = index
        self.compression = compression
        ShardFile.check_compression(compression)
        self.overwrite = overwrite
        self.start_shard = start_shard
        self._replaced: list[ShardInfo] = []  # shards of this series an earlier run left listed
        folder = parent_url(pattern)
        self.manifest_url: str | None
        if manifest is True:
            self.manifest_url = join_url(folder, MANIFEST_NAME)
        else:
            self.manifest_url = manifest or None
        self.manifest = Manifest(shards=[], meta=dict(meta or {}))
        self._next = start_shard
        self._journal: Any = None  # the open journal file (local destinations)
        self._journal_meta: dict[str, Any] | None = None  # meta as of the journal's last line
        self._started = False
        self._lock: DestinationLock | None = None  # held from the first shard to close/abort
        self._shard: ShardFile | None = None
        self._closed = False
        self.count = 0

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    def write(self, sample: Mapping[str, Any]) -> None:
        """Encode and append one sample dict (``__key__`` plus fields).

        Raises:
            SampleError: invalid sample; nothing of it is written.
            ValueError: the writer is closed.
        """
        if self._closed:
            raise ValueError("write() on a closed ShardWriter")
        key, fields = encode_sample_dict(sample)
        self.write_encoded(key, fields, graph_sizes(sample))

    def write_encoded(self, key: str, fields: Mapping[str, bytes], sizes: Sequence[int] | None = None) -> None:
        """Append one already encoded sample ``(key, {field: bytes})``.

        ``sizes`` is the sample's row of the sizes index (see :class:`ShardFile`).
        """
        size = tar_size(fields)
        shard = self._shard
        if shard is not None and (len(shard.offsets) >= self.max_count or (shard.offsets and shard.size + size > self.max_bytes)):
            self._finish_shard()
            shard = None
        if shard is None:
            if not self._started:
                self._start()
            url = self.pattern % self._next
            self._next += 1
            # with a journal, the shard's files stay at temporary names until its line is written
            staged = self._journal is not None
            shard = ShardFile(url, url + ".idx.npy" if self.index else None, self.io, staged=staged,
                              compression=self.compression).__enter__()
            self._shard = shard
        shard.write(key, fields, sizes)
        if sizes is not None:
            self.manifest.meta.setdefault("size_columns", list(SIZE_COLUMNS))
        self.count += 1

    def _finish_shard(self) -> None:
        shard, self._shard = self._shard, None
        if shard is None:
            return
        shard.__exit__(None, None, None)
        info: ShardInfo = shard.info  # type: ignore[assignment]
        fields = fields_of(shard.fields)
        if self._journal is not None:
            # entry, then the files at their names, then the commit line: a shard at its name
            # is always in the journal (a replay verifies an entry without its commit line)
            meta = None if self.manifest.meta == self._journal_meta else self.manifest.meta
            self._journal.write(journal_entry(info, fields, meta))
            self._journal.flush()
            if meta is not None:
                self._journal_meta = copy.deepcopy(meta)
            for tmp, path in reversed(shard.staged):  # index files first, the shard last
                storage.commit_staged(tmp, path)
            if shard.staged:
                storage.sync_directory(os.path.dirname(os.path.abspath(shard.staged[0][1])))
            self._journal.write(journal_commit(info.url))
            self._journal.flush()
        self.manifest.shards.append(info)
        self.manifest.fields.update(fields)
        log.debug("finished shard %s (%d samples, %d bytes)", shard.url, shard.info.samples, shard.info.bytes)

    def _start(self) -> None:
        """Before the first shard: at a local destination, take the folder's lock, replay a
        crashed writer's journal, sweep its temporaries; then keep the shards the folder's
        manifest lists (see :meth:`_keep`) and, locally, start the journal with them."""
        self._started = True
        if self.manifest_url and storage.is_local(self.manifest_url):
            # one writer of a folder's manifest at a time; a crashed one holds nothing (taken
            # before the sweep below: a live conversion's staged shards are unlocked files)
            self._lock = DestinationLock(os.path.dirname(os.path.abspath(local_path(self.manifest_url)))).acquire()
        folder = parent_url(self.pattern)
        if not self.manifest_url:
            if storage.is_local(folder):
                remove_stale_temporaries(local_path(folder) or ".")
            return
        import fsspec

        fs, path = fsspec.core.url_to_fs(self.manifest_url, **self.io.storage_options)
        local = storage.is_local(self.manifest_url)
        if local:  # never read or write through a link planted at the manifest's or journal's name
            storage.refuse_symlink(path)
            storage.refuse_symlink(path + JOURNAL_SUFFIX)
        if self.overwrite:
            for stale in (path, path + JOURNAL_SUFFIX):
                if fs.exists(stale):
                    fs.rm_file(stale)
        else:
            try:
                self._keep(folder_manifest(self.manifest_url, self.io))
            except BaseException:
                self._closed = True  # refused before anything changed: nothing more is written,
                self._release()  # and the folder is free again
                raise
        if storage.is_local(folder):
            # the temporaries of a writer that crashed here are nobody's (storage.locks)
            remove_stale_temporaries(local_path(folder) or ".")
        if local:
            fs.makedirs(posixpath.dirname(path), exist_ok=True)
            # never through a symlink planted at the journal's name (it would truncate the target)
            self._journal = os.fdopen(storage.create_file(path + JOURNAL_SUFFIX, truncate=True), "wb")
            self._journal.write(journal_header(self.manifest.meta))
            for n, info in enumerate(self.manifest.shards):
                self._journal.write(journal_entry(info, dict(self.manifest.fields) if n == 0 else {}, committed=True))
            self._journal.flush()
            os.fsync(self._journal.fileno())
            self._journal_meta = copy.deepcopy(self.manifest.meta)
        elif self.manifest.shards:  # remote: the kept shards stay listed if this writer dies
            write_manifest(self.manifest_url, self.manifest, self.io)
            return
        if fs.exists(path):  # the journal (or, remote, the manifest at close) now says it all
            fs.rm_file(path)

    def _keep(self, old: Manifest | None) -> None:
        """Start from the folder's manifest: its shards stay listed, first, except the earlier
        ones of this writer's series (from ``start_shard`` on), which this run replaces."""
        if old is None:
            return
        mine = [info for info in old.shards if (n := series_number(info.url, self.pattern)) is not None
                and n >= self.start_shard]  # shards are listed by their basename
        if mine and isinstance(old.meta, dict) and "conversion" in old.meta:
            raise DestinationExistsError(
                f"{self.manifest_url}: the folder holds a conversion's shards of this series ({shard_names(mine)}: "
                f"{sum(s.samples for s in mine)} samples); a ShardWriter never replaces shards it did not write: "
                "write another series beside them (another pattern, or start_shard after them), write elsewhere, "
                "or pass overwrite=True to start a new manifest (its shards' names are then written over)"
            )
        for info in old.shards:
            (self._replaced if any(info is m for m in mine) else self.manifest.shards).append(info)
        self.manifest.fields.update(old.fields)
        changed = sorted(k for k in self.manifest.meta if k in old.meta and old.meta[k] != self.manifest.meta[k])
        if changed:
            log.warning("%s: meta %s of the folder's manifest replaced by this writer's", self.manifest_url, changed)
        self.manifest.meta = {**old.meta, **self.manifest.meta}
        if self.manifest.shards:
            log.info("%s: keeping the %d shard(s) the folder's manifest lists (%s)", self.manifest_url,
                     len(self.manifest.shards), shard_names(self.manifest.shards))
        if self._replaced:
            log.info("%s: replacing %d shard(s) of this series from an earlier run (%s)", self.manifest_url,
                     len(self._replaced), shard_names(self._replaced))

    def _drop_replaced(self) -> None:
        """Remove the files of this series' earlier shards that this run did not write again
        (they would mix an earlier run's samples into this one's; named in the log)."""
        written = {s.url for s in self.manifest.shards}
        gone = [s for s in self._replaced if s.url not in written]
        if not gone:
            return
        import fsspec

        log.warning("%s: removing %d shard(s) of an earlier run of this series that this run did not write "
                    "again (%s)", self.manifest_url, len(gone), shard_names(gone))
        base = parent_url(self.pattern)
        for info in gone:
            for rel in (info.url, info.index, info.sizes):
                if rel:
                    fs, p = fsspec.core.url_to_fs(join_url(base, rel), **self.io.storage_options)
                    if fs.exists(p):
                        fs.rm_file(p)

    def _write_manifest(self) -> None:
        """The manifest, then the journal removed (the manifest now says what it said)."""
        if self.manifest_url:
            write_manifest(self.manifest_url, self.manifest, self.io)
        if self._journal is not None:
            self._journal.close()
            self._journal = None
            import fsspec

            fs, path = fsspec.core.url_to_fs(self.manifest_url + JOURNAL_SUFFIX)  # type: ignore[operator]
            fs.rm_file(path)
        self._drop_replaced()

    def close(self) -> Manifest:
        """Finish the current shard and write the manifest; returns it."""
        if not self._closed:
            try:
                self._finish_shard()
                self._write_manifest()
                self._closed = True
            finally:
                if self._closed:
                    self._release()
        return self.manifest

    def _release(self) -> None:
        lock, self._lock = self._lock, None
        if lock is not None:
            lock.release()

    def abort(self) -> None:
        """Drop the shard in progress (nothing appears at its name); the manifest lists the
        finished shards (written only if there is one, or a journal was started)."""
        shard, self._shard = self._shard, None
        if shard is not None:
            shard.__exit__(SampleError, SampleError("aborted"), None)
        if not self._closed:
            self._closed = True
            try:
                if self.manifest.shards or self._journal is not None or self._replaced:
                    self._write_manifest()
            finally:
                self._release()

    def write_all(self, samples: Iterable[Mapping[str, Any]]) -> Manifest:
        """Write every sample, then close."""
        for s in samples:
            self.write(s)
        return self.close()
