"""The conversion engine every converter and :func:`shardflow.write_shards` share.

A conversion is

- a stream of *inputs* (small picklable values: a key and a file path, a row
  number, a graph index, ...), produced lazily by walking the source and never
  listed whole, and
- a module-level ``build(inputs, context) -> Iterator[(key, {field: bytes}[, sizes])]``
  that turns a list of inputs into encoded samples, in a worker.

The engine cuts the inputs into groups of ``group_size`` consecutive inputs
(one task each; see :mod:`shardflow.convert.engine.groups` for the rule that fixes the
shard boundaries and names whatever runs the tasks), runs the tasks in this
process, in local worker processes or on a Dask cluster (``client=``), and
records every finished group: the manifest lists only complete shards, and the
conversion record beside it (:mod:`shardflow.convert.engine.destination`) holds a hash
of each group's inputs. A re-run keeps every finished group whose hash is
unchanged and whose shards are still there at their size, and writes the rest,
so a crashed conversion resumes where it stopped and a finished one is a no-op.
The client holds the inputs of the tasks in flight (``2 x workers`` groups) and
one small entry per shard, whatever the source size; workers write their shards
straight to the destination.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from itertools import islice
from typing import Any

from ... import storage
from ...errors import ConversionError, ShardflowError, redact, redact_data
from ...format.manifest import MANIFEST_NAME, Manifest, ShardInfo, fields_of
from ...storage.writing.locks import DestinationLock
from ...writing.shardfile import ShardFile
from ...storage.urls import join_url, local_path, protocol_of
from . import destination
from .destination import Previous, prepare_destination, remove_files, remove_temporaries, write_state
from .executors import Executor, make_executor
from .groups import Build, GroupPlan, GroupResult, group_digest, versioned_digest, write_group

__all__ = ["ConvertOptions", "run_conversion", "Build", "Identify"]

log = logging.getLogger(__name__)

# identify(group, context): the text the build's Versions item carries for these inputs, computed
# in the converting process (raises OSError when a file is gone)
Identify = Callable[[list[Any], Any], str]


@dataclass(frozen=True)
class ConvertOptions:
    """Options shared by every converter.

    Attributes:
        max_count: samples per shard.
        max_bytes: shard size limit in bytes (None: no limit); a sample that would
            cross it starts a new shard of its group.
        group_size: inputs per task; None = ``max_count``. Shards never span two
            groups, so with one sample per input the default gives full shards.
        prefix: shard names are ``<prefix>-%06d.tar``.
        workers: writer processes; None = ``os.cpu_count()``; 1 writes in this
            process. Not used with a Dask client (its workers run the tasks).
        resume: keep finished shards of an earlier run whose inputs are unchanged.
        overwrite: replace a destination that holds another dataset instead of
            refusing it.
        storage_options: fsspec options for a remote source or destination.
        index: write per-shard offset indexes.
        compression: ``"zstd"``: framed ``.tar.zst`` shards (see
            :class:`~shardflow.ShardWriter`); None: plain ``.tar``.
    """

    max_count: int = 10_000
    max_bytes: int | None = None
    group_size: int | None = None
    prefix: str = "train"
    workers: int | None = None
    resume: bool = True
    overwrite: bool = False
    storage_options: Mapping[str, Any] = field(default_factory=dict)
    index: bool = True
    compression: str | None = None

    def __post_init__(self) -> None:
        ShardFile.check_compression(self.compression)
        if self.max_count < 1:
            raise ValueError(f"max_count must be >= 1, got {self.max_count}")
        if self.max_bytes is not None and self.max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1 or None, got {self.max_bytes}")
        if self.group_size is not None and self.group_size < 1:
            raise ValueError(f"group_size must be >= 1 or None, got {self.group_size}")
        if self.workers is not None and self.workers < 1:
            raise ValueError(f"workers must be >= 1, got {self.workers}")
        if not self.prefix or "/" in self.prefix or "%" in self.prefix:
            raise ValueError(f"invalid shard prefix {self.prefix!r}")

    @property
    def io(self) -> storage.IOOptions:
        return storage.IOOptions(storage_options=dict(self.storage_options))


class _Run:
    """The client side of one conversion: finished groups, records, progress."""

    def __init__(self, dest: str, identity: Mapping[str, Any], meta: dict[str, Any], io: storage.IOOptions,
                 progress: Callable[[int], None] | None) -> None:  # fmt: skip
        self.dest = dest
        self.identity = identity
        self.meta = meta
        self.io = io
        self.progress = progress
        self.done: dict[int, tuple[str, list[ShardInfo], list[str]]] = {}
        self.skipped: dict[int, list[tuple[str, str]]] = {}  # group -> inputs its build skipped
        self.kept = 0
        self._last = 0.0

    def finish(self, group: int, digest: str, shards: list[ShardInfo], fields: list[str],
               skipped: Iterable[tuple[str, str]] = ()) -> None:  # fmt: skip
        self.done[group] = (digest, shards, fields)
        if skipped:
            self.skipped[group] = list(skipped)
        if self.progress is not None:
            self.progress(sum(s.samples for s in shards))

    def manifest(self, *, complete: bool) -> Manifest:
        order = sorted(self.done)
        names: dict[str, str] = {}
        for g in order:
            names.update(fields_of(self.done[g][2]))
        meta = dict(self.meta)
        skipped = [s for g in order for s in self.skipped.get(g, ())]
        if skipped:  # inputs build left out (corrupt images): counted, the first SKIPPED_NAMED named
            meta["skipped_count"] = len(skipped)
            meta["skipped"] = [{"path": w, "reason": r} for w, r in skipped[:SKIPPED_NAMED]]
        return Manifest(
            shards=[s for g in order for s in self.done[g][1]],
            fields=names,
            meta={**meta, "conversion": {"complete": complete}},
            url=join_url(self.dest, MANIFEST_NAME),
        )

    def record(self, *, force: bool = False) -> None:
        """Write the record and the manifest of the finished groups (at most once a second
        unless forced: rewriting both after every group would cost O(groups^2) bytes)."""
        now = time.monotonic()
        if force or now - self._last >= 1.0:
            self._last = now
            self.write(self.manifest(complete=False))

    def write(self, manifest: Manifest) -> None:
        if storage.is_local(self.dest):
            # the shards' renames durable before a record lists them (local tasks leave the
            # folder's fsync to this, once per record instead of once per shard)
            storage.sync_directory(os.path.abspath(local_path(self.dest)))
        groups = {g: (d, shards) for g, (d, shards, _) in self.done.items()}
        write_state(self.dest, self.identity, groups, manifest, self.io, self.skipped)


SKIPPED_NAMED = 1000
"""Skipped inputs the manifest names (``meta.skipped``); ``meta.skipped_count`` counts them all."""

COMMIT_THREADS = 4
"""Threads of a local conversion that make finished shards durable and name them."""


def _commit(staged: Iterable[tuple[str, str]]) -> None:
    for tmp, path in staged:
        storage.commit_staged(tmp, path)
        destination.checkpoint("shard:committed")


class _Tasks:
    """The groups in flight: being written by the executor, then (local destinations)
    committed by this process's threads (each file fsynced, then renamed) while the
    workers write the next ones. A group is finished when its shards are at their names;
    the record (and its fsync of the folder) lists only finished groups."""

    def __init__(self, executor: Executor, run: _Run, staged: bool) -> None:
        self.executor = executor
        self.run = run
        self.writing: dict[Any, tuple[int, str]] = {}
        self.committing: dict[Future, tuple[int, str, GroupResult]] = {}
        self.committer = ThreadPoolExecutor(COMMIT_THREADS, thread_name_prefix="shardflow-commit") if staged else None

    def submit(self, number: int, digest: str, *args: Any) -> None:
        self.writing[self.executor.submit(write_group, number, *args)] = (number, digest)
        while len(self.writing) >= self.executor.slots:
            self.collect()

    def drain(self) -> None:
        while self.writing or self.committing:
            self.collect()

    def collect(self) -> None:
        """Wait for a write or a commit to end; take every one that has."""
        if self.committing:  # local executors only: their futures and the commits' are alike
            done = list(wait([*self.writing, *self.committing], return_when=FIRST_COMPLETED)[0])
        else:
            done = self.executor.wait_any(list(self.writing))
        finished = len(self.run.done)
        for fut in done:
            if fut in self.committing:
                group, digest, result = self.committing.pop(fut)
                try:
                    fut.result()
                except OSError as e:
                    raise ConversionError(f"making the shards of group {group} of {self.run.dest} durable failed: "
                                          f"{type(e).__name__}: {e}") from e  # fmt: skip
                self.run.finish(group, _recorded(digest, result), list(result.shards), list(result.fields),
                                result.skipped)  # fmt: skip
                continue
            group, digest = self.writing.pop(fut)
            try:
                result: GroupResult = fut.result()
            except ShardflowError:
                raise  # names the shard and the input already
            except Exception as e:  # the task itself was lost (a worker died too often, ...)
                raise ConversionError(f"group {group} of {self.run.dest} failed: {type(e).__name__}: {e}") from e
            if result.staged and self.committer is not None:
                self.committing[self.committer.submit(_commit, result.staged)] = (group, digest, result)
            else:
                self.run.finish(group, _recorded(digest, result), list(result.shards), list(result.fields),
                                result.skipped)  # fmt: skip
        if len(self.run.done) > finished:
            self.run.record()

    def settle(self) -> None:
        """After a failure: let the commits in flight end and finish their groups (complete
        shards stay recorded for the re-run; a failed commit's files stay temporaries)."""
        for fut, (group, digest, result) in list(self.committing.items()):
            try:
                fut.result()
            except Exception:  # noqa: BLE001 - the failure being raised says what went wrong
                continue
            self.run.finish(group, _recorded(digest, result), list(result.shards), list(result.fields), result.skipped)
        self.committing.clear()

    def close(self) -> None:
        """Cancel the writes not started; let the commits running end."""
        try:
            self.executor.close()
        finally:
            if self.committer is not None:
                self.committer.shutdown(wait=True, cancel_futures=True)


def _recorded(digest: str, result: GroupResult) -> str:
    """The digest recorded for a finished group: its inputs' digest, with what its build read
    (:class:`~shardflow.convert.engine.groups.Versions`) where it yielded that."""
    return digest if result.versions is None else versioned_digest(digest, result.versions)


def _kept_digest(digest: str, group: list[Any], identify: Identify | None, context: Any) -> str | None:
    """The digest a finished group of an earlier run must have been recorded with to be kept:
    ``digest``, or with ``identify``'s text for the group (None: a file of it is gone)."""
    if identify is None:
        return digest
    try:
        return versioned_digest(digest, identify(group, context))
    except OSError:
        return None  # written again: its build names what is missing


def _groups(inputs: Iterable[Any], size: int) -> Iterable[tuple[int, list[Any]]]:
    it = iter(inputs)
    number = 0
    while True:
        group = list(islice(it, size))
        if not group:
            return
        yield number, group
        number += 1


def _still_there(shards: list[ShardInfo], dest: str, io: storage.IOOptions) -> bool:
    for s in shards:
        try:
            if storage.object_size(join_url(dest, s.url), io) != s.bytes:
                return False
        except OSError:
            return False
    return True


def run_conversion(
    dest: str,
    inputs: Iterable[Any],
    build: Build,
    *,
    context: Any = None,
    meta: Mapping[str, Any] | None = None,
    meta_at_end: Callable[[], Mapping[str, Any]] | None = None,
    options: ConvertOptions = ConvertOptions(),
    progress: Callable[[int], None] | None = None,
    identity: Mapping[str, Any] | None = None,
    client: Any = None,
    skipped_meta: Callable[[list[str]], Mapping[str, Any]] | None = None,
    identify: Identify | None = None,
) -> Manifest:
    """Convert an input stream into shards plus ``shardflow.json`` in ``dest``.

    Args:
        dest: destination folder (local or fsspec URL); created if needed.
        inputs: the inputs in output order (consumed lazily, one group at a time).
        build: module-level function run in workers, see the module docstring.
        context: picklable value passed to every ``build`` call (paths, options).
        meta: the manifest's ``meta`` (``class_to_idx``, source, schema, ...).
        meta_at_end: called after the last group; its result is merged into ``meta``.
        options: shard size, group size, workers, resume, overwrite, storage options.
        progress: ``progress(n)`` is called with the number of samples of
            every finished (or kept) group; if it has a ``kept(shards)`` method,
            that is called once with the number of finished shards of an
            earlier run that were kept.
        identity: what makes this dataset (converter, source), JSON values; a
            destination holding a dataset of another identity is refused unless
            ``options.overwrite``. Default: ``meta["converter"]`` and ``meta["source"]``.
        client: a ``dask.distributed.Client``: run the tasks on its cluster
            (its workers must reach the source and ``dest``).
        skipped_meta: called after ``meta_at_end`` with the ``where`` of every input
            ``build`` skipped (those of kept groups too); its result is merged into
            ``meta`` (counts that must leave the skipped inputs out).
        identify: for a ``build`` that yields a :class:`~shardflow.convert.engine.groups.Versions`
            item (sizes and versions of the files read, see :mod:`~shardflow.convert.engine.groups`):
            ``identify(group, context)`` computes the same text here, called only for groups an
            earlier run finished, before keeping them.

    Returns:
        The final manifest, shards in order.

    Raises:
        DestinationExistsError: ``dest`` holds another dataset (see
            :mod:`shardflow.convert.engine.destination`).
        DestinationLockedError: another live writer (a conversion or a
            :class:`~shardflow.ShardWriter`) holds the local ``dest``.
        ConversionError: a task failed; names the shard (and ``build``'s error
            names the input). Finished groups stay recorded, so a re-run resumes.
    """
    # the manifest and the record never hold a source URL's credentials or signature: a resumed
    # run with a fresh token has the same (redacted) identity
    meta = redact_data(dict(meta or {}))
    identity = redact_data(json.loads(json.dumps(
        identity if identity is not None else {k: meta.get(k) for k in ("converter", "source")}, default=str
    )))  # fmt: skip
    hooks = (meta_at_end, skipped_meta, identify)
    if not storage.is_local(dest):
        return _convert(dest, inputs, build, context, meta, hooks, options, progress, identity, client)
    # one writer per local destination: a second conversion (or ShardWriter) into it is
    # refused while this one runs; the kernel releases the lock however this process ends
    with DestinationLock(os.path.abspath(local_path(dest))):
        return _convert(dest, inputs, build, context, meta, hooks, options, progress, identity, client)


def _convert(dest: str, inputs: Iterable[Any], build: Build, context: Any, meta: dict[str, Any],
             hooks: tuple[Callable[[], Mapping[str, Any]] | None, Callable[[list[str]], Mapping[str, Any]] | None,
                          Identify | None],
             options: ConvertOptions,
             progress: Callable[[int], None] | None, identity: Any, client: Any) -> Manifest:
    """:func:`run_conversion` once the destination is locked (local) or known remote."""
    io = options.io
    local = storage.is_local(dest)
    previous = prepare_destination(dest, identity, prefix=options.prefix, resume=options.resume, overwrite=options.overwrite, io=io)
    if not previous.recorded:
        # the record first, before any shard: a run killed at any later point is recognised as this one
        destination.write_record(dest, identity, {}, io)
        destination.checkpoint("record:start")
    workers = options.workers or os.cpu_count() or 1
    if protocol_of(dest) == "memory":
        if client is not None:
            raise ValueError(f"{dest}: a memory:// destination lives in this process; Dask workers cannot write it")
        workers = 1  # shards written by worker processes would be lost
    # local tasks stage their shards for this process to commit, and leave the folder's fsync
    # to the records (_Run.write); a Dask task makes its shards durable and named itself
    staged = local and client is None
    plan = GroupPlan(dest, options.prefix, options.max_count, options.max_bytes, options.index, io,
                     sync_dir=client is not None, staged=staged, compression=options.compression)  # fmt: skip
    run = _Run(dest, identity, meta, io, progress)
    meta_at_end, skipped_meta, identify = hooks
    tasks = _Tasks(make_executor(workers, client), run, staged)
    failed = True
    try:
        for number, group in _groups(inputs, options.group_size or options.max_count):
            digest = group_digest(group, plan)
            old = previous.groups.get(number)
            if (old is not None and old[0] == _kept_digest(digest, group, identify, context)
                    and _still_there(old[1], dest, io)):  # fmt: skip
                run.kept += len(old[1])
                run.finish(number, old[0], old[1], previous.fields, previous.skipped.get(number, ()))
                continue
            tasks.submit(number, digest, group, build, context, plan)
        tasks.drain()
        failed = False
    except BaseException:
        tasks.settle()
        if run.done:
            run.record(force=True)  # keep every finished group recorded for the re-run
        raise
    finally:
        tasks.close()
        if failed and staged:
            remove_temporaries(dest, options.prefix, io)  # shards staged by groups that did not finish
    if run.kept:
        log.info("%s: kept %d finished shard(s) of an earlier run", redact(dest), run.kept)
        kept = getattr(progress, "kept", None)
        if callable(kept):
            kept(run.kept)
    if meta_at_end is not None:
        meta.update(redact_data(dict(meta_at_end())))
    if skipped_meta is not None:
        meta.update(redact_data(dict(skipped_meta([w for g in sorted(run.done) for w, _ in run.skipped.get(g, ())]))))
    manifest = run.manifest(complete=True)
    run.write(manifest)
    _remove_replaced(dest, previous, manifest, io)
    if client is not None and local:
        remove_temporaries(dest, options.prefix, io)  # left by workers the cluster lost
    return manifest


def _remove_replaced(dest: str, previous: Previous, manifest: Manifest, io: storage.IOOptions) -> None:
    """Remove the shards of an earlier run that this one did not write again (other options)."""
    now = {s.url for s in manifest.shards}
    gone = sorted(previous.names - now)
    if gone:
        log.info("%s: removing %d shard(s) of the earlier run that this one replaced", redact(dest), len(gone))
        remove_files(dest, [n + ext for n in gone for ext in ("", ".idx.npy", ".sizes.npy", ".frames.npy")], io)
