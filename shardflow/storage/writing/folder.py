"""A dataset folder as a writer finds it: a crashed writer's journal replayed first, then
the manifest that writer and the next one share.

Several writers may fill one folder (``train-%06d.tar`` then ``val-%06d.tar``, the usual
webdataset layout): each keeps the shards the folder's manifest already lists, except the
earlier shards of its own series (its pattern, from its ``start_shard`` on), which it
replaces. See ``docs/getting-data-in.md``.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import posixpath
import re
from collections.abc import Sequence

from ...errors import ManifestError
from ...format.journal import manifest_from_journal
from ...format.manifest import JOURNAL_SUFFIX, Manifest, ShardInfo
from ..backends.filesystems import filesystem
from ..options import IOOptions
from .output import open_output
from ..urls import is_local, local_path

__all__ = ["verify_shard", "replay_journal", "folder_manifest", "series_number", "shard_names"]

log = logging.getLogger(__name__)

_PLACEHOLDER = re.compile(r"%[-+ #0]*\d*([diuxXo])")
_BASES = {"d": 10, "i": 10, "u": 10, "x": 16, "X": 16, "o": 8}


def verify_shard(folder: str, info: ShardInfo) -> bool:
    """Whether a shard listed relative to the local ``folder`` is complete at its name: its
    size and sha256 are those listed, and its offset and sizes index files are there."""
    path = os.path.join(folder, info.url)
    try:
        if os.path.getsize(path) != info.bytes:
            return False
        for rel in (info.index, info.sizes):
            if rel and not os.path.isfile(os.path.join(folder, rel)):
                return False
        if info.sha256 is None:
            return True
        sha = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                sha.update(block)
        return sha.hexdigest() == info.sha256
    except OSError:
        return False


def _read(url: str, io: IOOptions) -> bytes | None:
    fs, path = filesystem(url, io)
    try:
        with fs.open(path, "rb") as f:
            return f.read()
    except (FileNotFoundError, NotADirectoryError):
        return None


def replay_journal(manifest_url: str, io: IOOptions) -> Manifest | None:
    """Turn a crashed writer's journal beside a local manifest into the manifest, before
    anything else touches the folder; None when there is no journal.

    The journal's committed shards (and its last, uncommitted one if
    :func:`verify_shard` finds it complete) become ``shardflow.json``, written
    atomically, then the journal is removed. A journal supersedes a manifest beside it
    (a writer starts its journal from that manifest, so the journal is the newer).

    Raises:
        ManifestError: the journal is not a shardflow writer journal (named).
    """
    if not is_local(manifest_url):
        return None
    journal = local_path(manifest_url) + JOURNAL_SUFFIX
    try:
        with open(journal, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return None
    folder = os.path.dirname(os.path.abspath(local_path(manifest_url)))
    manifest = manifest_from_journal(data, manifest_url, lambda info: verify_shard(folder, info))
    with open_output(manifest_url, io) as f:
        f.write(manifest.dumps())
    with contextlib.suppress(FileNotFoundError):
        os.remove(journal)
    log.warning("%s: replayed the journal of an interrupted writer into the manifest (%d shards, %d samples)",
                manifest_url, len(manifest.shards), manifest.num_samples)
    return manifest


def folder_manifest(manifest_url: str, io: IOOptions) -> Manifest | None:
    """The manifest a new writer of the folder starts from: a crashed writer's journal
    replayed first (:func:`replay_journal`), else ``shardflow.json``; None when neither.

    Raises:
        ManifestError: the manifest (or journal) cannot be read as one; the message
            names it and the ``overwrite=True`` way to start a new one.
    """
    try:
        manifest = replay_journal(manifest_url, io)
        if manifest is not None:
            return manifest
        data = _read(manifest_url, io)
        return None if data is None else Manifest.loads(data, url=manifest_url)
    except ManifestError as e:
        raise ManifestError(
            f"{e}; a writer keeps the shards a folder's manifest lists and cannot read this one: fix or "
            "remove it, or pass overwrite=True (--overwrite) to start a new manifest"
        ) from e


def series_number(name: str, pattern: str) -> int | None:
    """The shard number of ``name`` in the series of a ``%``-pattern's basename, or None
    when ``name`` is not one of its shards (``series_number("val-000003.tar",
    "val-%06d.tar") == 3``; a pattern whose placeholder is not an integer one owns only
    the names it writes)."""
    base = posixpath.basename(pattern)
    m = _PLACEHOLDER.search(base)
    if m is None or "/" in name:
        return None
    head, tail = base[: m.start()], base[m.end() :]
    if not (name.startswith(head) and name.endswith(tail)) or len(name) <= len(head) + len(tail):
        return None
    try:
        number = int(name[len(head) : len(name) - len(tail)].strip(), _BASES[m.group(1)])
    except ValueError:
        return None
    return number if number >= 0 and base % number == name else None


def shard_names(shards: Sequence[ShardInfo]) -> str:
    """A short list of shard names for a message: up to four, then a count."""
    names = [s.url for s in shards]
    return ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")

