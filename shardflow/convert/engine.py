"""The conversion engine every converter shares: parallel, streaming, resumable.

A converter supplies

- a stream of *sample descriptors* (small picklable values: a key and a file
  path, a row number, a graph index, ...), produced lazily by walking the
  source, and
- a module-level ``build(descriptors, context) -> Iterator[(key, {field: bytes})]``
  that turns one shard's descriptors into encoded samples in a worker process.

The engine cuts the descriptor stream into shards of ``max_count`` (so shard
boundaries never depend on the number of workers), writes each shard in a
worker process (atomic: temporary name, then rename), and rewrites the
manifest after every finished shard, listing only complete shards. The
manifest's ``meta.conversion`` records a hash of each shard's descriptors; a
re-run keeps every finished shard whose hash and size still match and
rewrites the rest, so a crashed conversion resumes where it stopped and a
finished one is a no-op. Memory stays at the descriptors of the shards in
flight (``2 x workers`` at most) whatever the source size.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass, field
from itertools import islice
from typing import Any

from .. import storage
from ..errors import ConversionError, ManifestError
from ..format.manifest import MANIFEST_NAME, Manifest, ShardInfo, fields_of
from ..urls import join_url, protocol_of
from ..writer import ShardFile, write_manifest

__all__ = ["ConvertOptions", "run_conversion", "Build"]

log = logging.getLogger(__name__)

# build(descriptors, context) yields (key, {field: bytes}) or (key, {field: bytes}, sizes row)
Build = Callable[[list[Any], Any], Iterator[tuple[Any, ...]]]


@dataclass(frozen=True)
class ConvertOptions:
    """Options shared by every converter.

    Attributes:
        max_count: samples per shard.
        prefix: shard names are ``<prefix>-%06d.tar``.
        workers: writer processes; None = ``os.cpu_count()``; 1 writes in this process.
        resume: keep finished shards of an earlier run whose inputs are unchanged.
        storage_options: fsspec options for a remote destination.
        index: write per-shard offset indexes.
    """

    max_count: int = 10_000
    prefix: str = "train"
    workers: int | None = None
    resume: bool = True
    storage_options: Mapping[str, Any] = field(default_factory=dict)
    index: bool = True

    def __post_init__(self) -> None:
        if self.max_count < 1:
            raise ValueError(f"max_count must be >= 1, got {self.max_count}")
        if self.workers is not None and self.workers < 1:
            raise ValueError(f"workers must be >= 1, got {self.workers}")
        if not self.prefix or "/" in self.prefix or "%" in self.prefix:
            raise ValueError(f"invalid shard prefix {self.prefix!r}")

    @property
    def io(self) -> storage.IOOptions:
        return storage.IOOptions(storage_options=dict(self.storage_options))


def _digest(descriptors: list[Any]) -> str:
    h = hashlib.sha256()
    for d in descriptors:
        h.update(repr(d).encode("utf-8", "surrogateescape"))
        h.update(b"\n")
    return h.hexdigest()[:32]


def _write_shard(
    url: str, index_url: str | None, build: Build, descriptors: list[Any], context: Any, io: storage.IOOptions
) -> tuple[ShardInfo, list[str]]:
    """Worker: write one shard; returns its manifest entry and field names."""
    with ShardFile(url, index_url, io) as shard:
        for item in build(descriptors, context):
            shard.write(*item)  # (key, fields) or (key, fields, sizes)
    if shard.info is None:  # pragma: no cover - set by a clean exit
        raise ConversionError(f"{url}: shard was not finished")
    return shard.info, sorted(shard.fields)


def _exit_with_parent(parent: int) -> None:
    """Worker initializer: exit once the converting process is gone.

    A worker blocks on the executor's call queue, whose write end every forked
    worker also holds, so it never sees EOF: without this, ``kill -9`` of a
    conversion left its writer processes running forever.
    """

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="shardflow-parent-watch", daemon=True).start()
    torch = sys.modules.get("torch")
    if torch is not None:
        # a process forked after torch ran multi-threaded ops can hang in its first large
        # tensor copy (seen converting PyG graphs); each writer is one process, one thread
        torch.set_num_threads(1)


def _previous(dest_manifest: str, io: storage.IOOptions) -> tuple[dict[str, tuple[ShardInfo, str]], list[str]]:
    """Finished shards of an earlier run (name -> (entry, descriptor hash)) and its field names."""
    if not storage.exists(dest_manifest, io):
        return {}, []
    try:
        m = Manifest.loads(b"".join(storage.iter_chunks(dest_manifest, 0, None, io)), url=dest_manifest)
    except ManifestError as e:
        log.warning("not resuming: %s", e)
        return {}, []
    hashes = m.meta.get("conversion", {}).get("hashes", {})
    return {s.url: (s, hashes[s.url]) for s in m.shards if s.url in hashes}, sorted(m.fields)


def run_conversion(
    dest: str,
    descriptors: Iterable[Any],
    build: Build,
    *,
    context: Any = None,
    meta: Mapping[str, Any] | None = None,
    meta_at_end: Callable[[], Mapping[str, Any]] | None = None,
    options: ConvertOptions = ConvertOptions(),
    progress: Callable[[int], None] | None = None,
) -> Manifest:
    """Convert a descriptor stream into shards plus ``shardflow.json`` in ``dest``.

    Args:
        dest: destination folder (local or fsspec URL); created if needed.
        descriptors: sample descriptors in output order (consumed lazily).
        build: module-level function run in workers, see the module docstring.
        context: picklable value passed to every ``build`` call (paths, options).
        meta: the manifest's ``meta`` (``class_to_idx``, source, schema, ...).
        meta_at_end: called after the last shard; its result is merged into ``meta``.
        options: shard size, workers, resume, storage options.
        progress: ``progress(n)`` is called with the number of samples of
            every finished (or kept) shard.

    Returns:
        The final manifest, shards in order.

    Raises:
        ConversionError: a worker failed; names the shard. Finished shards stay
            listed, so a re-run resumes.
    """
    io = options.io
    if "://" not in dest:
        os.makedirs(dest, exist_ok=True)
        _remove_stale_temporaries(dest, options.prefix)
    murl = join_url(dest, MANIFEST_NAME)
    previous, previous_fields = _previous(murl, io) if options.resume else ({}, [])
    done: dict[int, tuple[ShardInfo, list[str], str]] = {}
    meta = dict(meta or {})
    kept = 0

    last_record = [0.0]

    def record(force: bool = False) -> None:
        # The progress manifest lists every finished shard so that a crash loses at most the
        # shards of the last second; rewriting it after every shard would cost O(shards^2) bytes.
        now = time.monotonic()
        if not force and now - last_record[0] < 1.0:
            return
        last_record[0] = now
        write_manifest(murl, _manifest(done, meta, complete=False, url=murl), io)

    workers = options.workers or os.cpu_count() or 1
    if protocol_of(dest) == "memory":
        workers = 1  # memory:// lives in this process: shards written by worker processes would be lost
    pool = ProcessPoolExecutor(workers, initializer=_exit_with_parent, initargs=(os.getpid(),)) if workers > 1 else None
    pending: dict[Future, tuple[int, str, str]] = {}

    def collect(block: bool) -> None:
        if not pending:
            return
        finished, _ = wait(list(pending), return_when=FIRST_COMPLETED) if block else (
            [f for f in pending if f.done()],
            None,
        )
        for fut in finished:
            n, url, digest = pending.pop(fut)
            try:
                info, names = fut.result()
            except Exception as e:
                raise ConversionError(f"writing shard {url} failed: {type(e).__name__}: {e}") from e
            done[n] = (info, names, digest)
            if progress:
                progress(info.samples)
        if finished:
            record()

    it = iter(descriptors)
    n = 0
    try:
        while True:
            group = list(islice(it, options.max_count))
            if not group:
                break
            name = f"{options.prefix}-{n:06d}.tar"
            url = join_url(dest, name)
            digest = _digest(group)
            old = previous.get(name)
            if old is not None and old[1] == digest and _same_size(url, old[0].bytes, io):
                done[n] = (old[0], previous_fields, digest)
                kept += 1
                if progress:
                    progress(old[0].samples)
            else:
                index_url = url + ".idx.npy" if options.index else None
                if pool is None:
                    try:
                        info, names = _write_shard(url, index_url, build, group, context, io)
                    except Exception as e:
                        raise ConversionError(f"writing shard {url} failed: {type(e).__name__}: {e}") from e
                    done[n] = (info, names, digest)
                    if progress:
                        progress(info.samples)
                    record()
                else:
                    pending[pool.submit(_write_shard, url, index_url, build, group, context, io)] = (n, url, digest)
                    while len(pending) >= 2 * workers:
                        collect(block=True)
            n += 1
        while pending:
            collect(block=True)
    except BaseException:
        if done:
            record(force=True)  # keep every finished shard listed for the re-run
        raise
    finally:
        if pool is not None:
            for f in pending:
                f.cancel()
            pool.shutdown(wait=True, cancel_futures=True)
    if kept:
        log.info("kept %d finished shard(s) from an earlier run", kept)
    if meta_at_end is not None:
        meta.update(meta_at_end())
    manifest = _manifest(done, meta, complete=True, url=murl)
    write_manifest(murl, manifest, io)
    return manifest


def _manifest(done: Mapping[int, tuple[ShardInfo, list[str], str]], meta: Mapping[str, Any], *, complete: bool, url: str) -> Manifest:
    """The manifest of the finished shards, in shard order, with the conversion record."""
    order = sorted(done)
    fields: dict[str, str] = {}
    for n in order:
        fields.update(fields_of(done[n][1]))
    return Manifest(
        shards=[done[n][0] for n in order],
        fields=fields,
        meta={**meta, "conversion": {"complete": complete, "hashes": {done[n][0].url: done[n][2] for n in order}}},
        url=url,
    )


def _remove_stale_temporaries(dest: str, prefix: str) -> None:
    """Remove temporary shard files a crashed run left (``.<prefix>-NNNNNN.tar*.tmp``)."""
    for entry in os.scandir(dest):
        if entry.name.startswith(f".{prefix}-") and entry.name.endswith(".tmp") and entry.is_file():
            log.info("removing %s, left by an interrupted conversion", entry.path)
            os.remove(entry.path)


def _same_size(url: str, size: int, io: storage.IOOptions) -> bool:
    try:
        return storage.object_size(url, io) == size
    except OSError:
        return False
