"""One task of a conversion: a group of consecutive inputs written as its own shards.

The rule that makes the output independent of the number of workers and of
the engine (local processes or Dask): the input stream is cut into *groups* of
``group_size`` consecutive inputs (group ``g`` holds inputs ``g * group_size``
to ``(g + 1) * group_size - 1``). A group is one task. Its samples, in input
order and, for one input, in the order they were produced, fill shards that are
cut at ``max_count`` samples or when the next sample would take the shard past
``max_bytes`` (a sample larger than ``max_bytes`` gets a shard of its own).
A group's shards never take samples of another group, so what a task writes
depends on its inputs and the options alone, whoever runs it and whenever.

Names: group ``g``'s first shard is ``<prefix>-%06d.tar % g``, its further shards
``<prefix>-%06d_%04d.tar % (g, k)`` for ``k = 1, 2, ...`` (sorted names are
stream order). With one sample per input and ``group_size == max_count`` (every
converter's default) each group fills exactly one shard, and the shards are
``<prefix>-000000.tar``, ``<prefix>-000001.tar``, ... as before. A group that
yields no sample writes no shard.

An input that ``build`` leaves out (a corrupt image under a skip policy) is
yielded as :class:`Skipped`: it writes nothing, and the engine names it in the
manifest's ``meta.skipped``.

A group's digest (:func:`group_digest`) is a hash of its inputs. Where the inputs name files
whose sizes and versions are learnt only as they are read (a listing without a ``stat`` per
file), ``build`` yields one :class:`Versions` item: what it read, and the recorded digest is
:func:`versioned_digest` of both; a re-run computes the same text in its own process
(``identify`` of :func:`~shardflow.convert.engine.engine.run_conversion`) before it keeps a group.
"""

from __future__ import annotations

import hashlib
import logging
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from ... import storage
from ...errors import ConversionError, ShardflowError
from ...format.manifest import ShardInfo
from ...storage.urls import join_url, local_path
from ...world import exit_with_parent
from ...writing.writer import ShardFile, tar_size

__all__ = ["Build", "GroupPlan", "GroupResult", "Skipped", "Versions", "shard_name", "write_group", "group_digest",
           "versioned_digest"]

log = logging.getLogger(__name__)

# build(inputs, context) yields (key, {field: bytes}) or (key, {field: bytes}, sizes row), or
# Skipped for an input it leaves out
Build = Callable[[list[Any], Any], Iterator[Any]]


@dataclass(frozen=True)
class Skipped:
    """What ``build`` yields for an input it leaves out: where (a path or key) and why."""

    where: str
    reason: str


@dataclass(frozen=True)
class Versions:
    """What ``build`` yields once (after its samples) when the content identity of its inputs
    is known only as they are read: ``text`` stands for every file's size and version, in
    input order, and must equal what the conversion's ``identify`` computes for the same
    inputs (see the module docstring)."""

    text: str


def versioned_digest(digest: str, versions: str) -> str:
    """The digest recorded for a group whose ``build`` yielded :class:`Versions`: ``digest`` (of
    its inputs) and ``versions`` (their content) hashed together."""
    return hashlib.sha256(f"{digest}\n{versions}".encode()).hexdigest()[:32]


def shard_name(prefix: str, group: int, part: int, compression: str | None = None) -> str:
    """The name of part ``part`` of group ``group`` (see the module docstring); ``.tar.zst``
    for ``compression="zstd"``."""
    name = f"{prefix}-{group:06d}.tar" if part == 0 else f"{prefix}-{group:06d}_{part:04d}.tar"
    return name + ".zst" if compression == "zstd" else name


@dataclass(frozen=True)
class GroupPlan:
    """What every task of one conversion shares (picklable; sent to every worker).

    Attributes:
        dest: destination folder URL.
        prefix: shard name prefix.
        max_count: most samples per shard.
        max_bytes: shard size limit in bytes (tar bytes, estimated as the writer
            does); None for no limit.
        index: write per-shard offset indexes.
        io: storage options for the destination.
        sync_dir: a task fsyncs the destination folder after its last shard
            (the folder's renames durable when it returns); False where the
            engine does it before each record that lists new shards.
        staged: (local destinations) a task leaves its shards written at
            temporary names (:attr:`GroupResult.staged`) for the engine to make
            durable and name while the worker writes the next group.
        compression: ``"zstd"`` for framed ``.tar.zst`` shards (see
            :class:`~shardflow.writing.shardfile.ShardFile`), None for plain ``.tar``.
    """

    dest: str
    prefix: str
    max_count: int
    max_bytes: int | None
    index: bool
    io: storage.IOOptions
    sync_dir: bool = True
    staged: bool = False
    compression: str | None = None


@dataclass(frozen=True)
class GroupResult:
    """What one task wrote: its shards in order, with the field names each holds,
    (``GroupPlan.staged``) the ``(temporary, final path)`` of each file still to commit,
    the ``(where, reason)`` of each input ``build`` skipped, and the text of the
    :class:`Versions` it yielded (None: none)."""

    group: int
    shards: tuple[ShardInfo, ...]
    fields: tuple[str, ...]
    staged: tuple[tuple[str, str], ...] = ()
    skipped: tuple[tuple[str, str], ...] = ()
    versions: str | None = None


def group_digest(inputs: Sequence[Any], plan: GroupPlan) -> str:
    """A hash of a group's inputs (their ``repr``) and the options that shape its shards.

    A re-run keeps a finished group only if this hash is unchanged.
    """
    comp = f":{plan.compression}" if plan.compression else ""  # (plain shards keep their digests)
    h = hashlib.sha256(f"{plan.prefix}:{plan.max_count}:{plan.max_bytes}:{plan.index}{comp}\n".encode())
    if inputs:  # each input's repr and a newline, hashed in one call
        h.update(("\n".join(map(repr, inputs)) + "\n").encode("utf-8", "surrogateescape"))
    return h.hexdigest()[:32]


def write_group(group: int, inputs: list[Any], build: Build, context: Any, plan: GroupPlan) -> GroupResult:
    """Worker: turn one group's inputs into samples and write its shards.

    Raises:
        ConversionError: ``build`` failed (the error names the group's first
            shard; ``build`` itself names the input) or a shard could not be
            written. Nothing is left at the name of an unfinished shard.
    """
    infos: list[ShardInfo] = []
    fields: set[str] = set()
    staged: list[tuple[str, str]] = []
    skipped: list[tuple[str, str]] = []
    versions: str | None = None
    shard: ShardFile | None = None
    part = 0
    url = join_url(plan.dest, shard_name(plan.prefix, group, 0, plan.compression))
    max_count, max_bytes = plan.max_count, plan.max_bytes
    try:
        for item in build(inputs, context):
            if type(item) is not tuple:  # (a sample is a tuple: one check for nearly every item)
                if isinstance(item, Skipped):
                    skipped.append((item.where, item.reason))
                    continue
                if isinstance(item, Versions):
                    versions = item.text
                    continue
            key, data = item[0], item[1]
            sizes = item[2] if len(item) > 2 else None
            if shard is not None and (
                len(shard.offsets) >= max_count or (max_bytes is not None and shard.size + tar_size(data) > max_bytes)
            ):
                shard.__exit__(None, None, None)
                infos.append(shard.info)  # type: ignore[arg-type]
                fields.update(shard.fields)
                staged += shard.staged
                shard = None
                part += 1
            if shard is None:
                url = join_url(plan.dest, shard_name(plan.prefix, group, part, plan.compression))
                shard = ShardFile(url, url + ".idx.npy" if plan.index else None, plan.io, sync_dir=False,
                                  staged=plan.staged, compression=plan.compression).__enter__()
            shard.write(key, data, sizes)
        if shard is not None:
            shard.__exit__(None, None, None)
            infos.append(shard.info)  # type: ignore[arg-type]
            fields.update(shard.fields)
            staged += shard.staged
            shard = None
        if infos and plan.sync_dir and storage.is_local(plan.dest):
            storage.sync_directory(local_path(plan.dest))
    except ShardflowError as e:  # the same kind of error, saying which shard
        raise type(e)(f"writing shard {url} failed: {e}", reason=e.reason) from e
    except Exception as e:
        raise ConversionError(f"writing shard {url} failed: {type(e).__name__}: {e}") from e
    finally:
        if shard is not None:  # an error mid-shard: drop it (nothing appears at its name)
            shard.__exit__(ConversionError, ConversionError("aborted"), None)
    return GroupResult(group, tuple(infos), tuple(sorted(fields)), tuple(staged), tuple(skipped), versions)


def writer_init(parent: int) -> None:
    """Local worker initializer: exit once the converting process ``parent`` is gone
    (:func:`shardflow.world.exit_with_parent`, checked every half second), one torch thread.

    A worker blocks on the executor's call queue, whose write end every forked
    worker also holds, so it never sees EOF: without this, ``kill -9`` of a
    conversion left its writer processes running forever.
    """
    exit_with_parent(parent, poll=0.5)
    torch = sys.modules.get("torch")
    if torch is not None:
        # a process forked after torch ran multi-threaded ops can hang in its first large
        # tensor copy (seen converting PyG graphs); each writer is one process, one thread
        torch.set_num_threads(1)
