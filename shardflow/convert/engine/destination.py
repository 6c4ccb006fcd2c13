"""The destination of a conversion: what an earlier run left there, and whether it is ours.

Beside the manifest, a conversion keeps its record, ``.shardflow-convert.json``:
which converter and source made the dataset (its *identity*) and, per finished
group of inputs (see :mod:`shardflow.convert.engine.groups`), the hash of its inputs
and the names of its shards. The record is written before the manifest, so a
shard listed in the manifest is always in the record. The manifest itself holds
only what describes the dataset, so the same inputs give the same manifest
bytes, wherever they were read from and however often the run was resumed.

A destination is taken as it is when it is empty or holds an earlier run of
the same conversion (same identity: then its finished groups are kept when
resuming). The record is what says so: a conversion writes it, with its identity
and no group, before its first shard, so a run killed at any point (shards
renamed but not yet recorded, a record written but not its manifest) is
recognised as the same conversion and resumed; shards that no manifest lists
yet are written again, to the same bytes. :func:`checkpoint` marks each of
these points (tests kill a conversion at every one). Anything else that is a dataset (a manifest of another source or
converter, or tar files) is refused with :class:`DestinationExistsError`
unless ``overwrite``, which removes the old dataset's manifest, record, shards
and their index files first; so is an earlier run of the same conversion whose
manifest also lists shards of another writer (a :class:`~shardflow.ShardWriter`
that added ``val-*.tar``): a conversion never drops them silently. The error
names the shards. A journal a crashed :class:`~shardflow.ShardWriter` left is
replayed into the manifest before anything else. Other files are left alone.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import posixpath
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ... import storage
from ...errors import DestinationExistsError, ManifestError
from ...format.compression import SHARD_SUFFIXES
from ...format.manifest import MANIFEST_NAME, Manifest, ShardInfo
from ...errors import redact
from ...storage.writing.folder import replay_journal, shard_names
from ...storage.urls import join_url
from ...writing.writer import write_manifest

__all__ = [
    "STATE_NAME", "Previous", "checkpoint", "prepare_destination", "remove_files", "remove_temporaries", "write_record",
    "write_state",
]

log = logging.getLogger(__name__)

STATE_NAME = ".shardflow-convert.json"
"""The conversion record beside the manifest."""

_STATE_FORMAT = "shardflow-conversion"
_STATE_VERSION = 1


@dataclass
class Previous:
    """What an earlier run of the same conversion finished.

    Attributes:
        groups: group number -> (input hash, its shard entries in order).
        fields: field names of the earlier dataset.
        names: every shard name the earlier manifest listed (to remove the ones
            this run does not write again).
        recorded: the destination holds this conversion's record already.
    """

    groups: dict[int, tuple[str, list[ShardInfo]]] = field(default_factory=dict)
    fields: list[str] = field(default_factory=list)
    names: set[str] = field(default_factory=set)
    skipped: dict[int, list[tuple[str, str]]] = field(default_factory=dict)
    recorded: bool = False


def _read_json(url: str, io: storage.IOOptions) -> bytes | None:
    try:
        if not storage.exists(url, io):
            return None
        return storage.read_small(url, io)
    except FileNotFoundError:
        return None


def _entries(dest: str, io: storage.IOOptions) -> list[str]:
    """Names of the files directly in ``dest`` ([] when it does not exist)."""
    if storage.is_local(dest):
        path = dest[len("file://") :] if dest.startswith("file://") else dest
        try:
            with os.scandir(path) as it:
                return sorted(e.name for e in it if e.is_file())
        except FileNotFoundError:
            return []
    fs, path = storage.filesystem(dest, io)
    try:
        infos = fs.ls(path, detail=True)
    except FileNotFoundError:
        return []
    return sorted(posixpath.basename(i["name"].rstrip("/")) for i in infos if i.get("type") != "directory")


def _describe(identity: Mapping[str, Any] | None) -> str:
    if not identity:
        return "a dataset not written by a shardflow converter"
    return "a dataset converted by " + ", ".join(f"{k} {v}" for k, v in identity.items())


def _dataset_files(names: Iterable[str]) -> list[str]:
    """Shard files and their index sidecars among ``names``."""
    return [n for n in names if not n.startswith(".") and (n.endswith(".tar") or ".tar." in n)]


def remove_files(dest: str, names: Iterable[str], io: storage.IOOptions) -> None:
    """Remove the files ``names`` of ``dest`` that exist (missing ones are fine)."""
    for name in names:
        url = join_url(dest, name)
        with contextlib.suppress(FileNotFoundError):
            if storage.is_local(url):
                os.remove(url[len("file://") :] if url.startswith("file://") else url)
            else:
                fs, path = storage.filesystem(url, io)
                if fs.exists(path):
                    fs.rm(path)


def _shard_names(names: Iterable[str]) -> list[str]:
    """Shard files (not their index sidecars) among ``names``."""
    return [n for n in names if not n.startswith(".") and n.endswith(SHARD_SUFFIXES)]


def _old_dataset_files(manifest: Manifest | None, names: list[str]) -> list[str]:
    out = set(_dataset_files(names))
    for s in manifest.shards if manifest is not None else []:
        out.update(n for n in (s.url, s.index, s.sizes, s.frames) if n and "/" not in n and "://" not in n)
    return sorted(out)


def remove_temporaries(dest: str, prefix: str, io: storage.IOOptions) -> None:
    """Remove what a lost worker left half-written in a local ``dest`` (temporary shard files)."""
    _remove_temporaries(dest, _entries(dest, io), prefix)


def _remove_temporaries(dest: str, names: list[str], prefix: str) -> list[str]:
    """Remove temporary files a crashed local run left (``.<prefix>-NNNNNN.tar*.tmp``, and the
    record's and manifest's ``.<name>.<token>.tmp``); the caller holds the destination's lock."""
    left = []
    for name in names:
        ours = name.startswith((f".{prefix}-", f".{STATE_NAME}.", f".{MANIFEST_NAME}."))  # shards, record, manifest
        if ours and name.endswith(".tmp") and storage.is_local(dest):
            path = os.path.join(dest[len("file://") :] if dest.startswith("file://") else dest, name)
            log.info("removing %s, left by an interrupted conversion", redact(path))
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)
        else:
            left.append(name)
    return left


def prepare_destination(
    dest: str, identity: Mapping[str, Any], *, prefix: str, resume: bool, overwrite: bool, io: storage.IOOptions
) -> Previous:
    """Check ``dest`` before a conversion writes into it (one listing); returns what can be kept.

    Temporary files of a crashed local run are removed.

    Raises:
        DestinationExistsError: ``dest`` holds another dataset and ``overwrite``
            is False (the message says which dataset and how to replace it).
    """
    murl = join_url(dest, MANIFEST_NAME)
    replay_journal(murl, io)  # a crashed ShardWriter's shards, listed before anything is decided
    names = _remove_temporaries(dest, _entries(dest, io), prefix)
    if not names:
        return Previous()
    manifest = None
    raw = _read_json(murl, io) if MANIFEST_NAME in names else None
    if raw is not None:
        try:
            manifest = Manifest.loads(raw, url=murl)
        except ManifestError as e:
            log.warning("%s", e)
    state = _load_state(join_url(dest, STATE_NAME), io) if STATE_NAME in names else None
    foreign: list[ShardInfo] = []
    if state is not None and state.get("identity") == dict(identity):
        foreign = _foreign_shards(manifest, state) if manifest is not None else []
        if not foreign:
            # ours, however the earlier run ended: shards it renamed but did not list are its own too
            # (written again, or removed when this run no longer writes them)
            listed = {s.url for s in manifest.shards} if manifest is not None else set()
            previous = Previous(names=listed | set(_shard_names(names)),
                                fields=sorted(manifest.fields) if manifest is not None else [], recorded=True)
            if resume and manifest is not None:
                previous.groups = _finished_groups(manifest, state)
                previous.skipped = _skipped_inputs(state, previous.groups)
            return previous
    old = _old_dataset_files(manifest, names)
    if manifest is None and not old:
        return Previous()  # other files only (notes, a README): not a dataset
    if foreign:
        what = f"an earlier run of this conversion and {len(foreign)} shard(s) of another writer ({shard_names(foreign)})"
    elif manifest is not None:
        what = f"{_describe(state.get('identity') if state else None)} ({shard_names(manifest.shards) or 'no shards'})"
    else:
        what = f"{len(old)} tar file(s) ({', '.join(old[:4])}{' and more' if len(old) > 4 else ''})"
    if not overwrite:
        raise DestinationExistsError(
            f"{dest} already holds {what}; a conversion of {', '.join(f'{k} {v}' for k, v in identity.items())} "
            "would mix with it. Choose an empty folder, or pass overwrite=True (--overwrite) to replace it"
        )
    log.warning("%s: replacing %s (overwrite): removing %d file(s)", redact(dest), redact(what), len(old) + 2)
    remove_files(dest, [MANIFEST_NAME, MANIFEST_NAME + ".journal", STATE_NAME, *old], io)
    return Previous()


def _load_state(url: str, io: storage.IOOptions) -> dict[str, Any] | None:
    raw = _read_json(url, io)
    if raw is None:
        return None
    try:
        state = json.loads(raw)
    except (ValueError, RecursionError):
        log.warning("%s: not valid JSON, ignored", redact(url))
        return None
    if not isinstance(state, dict) or state.get("format") != _STATE_FORMAT or state.get("version") != _STATE_VERSION:
        log.warning("%s: not a conversion record this version reads, ignored", redact(url))
        return None
    return state


def _foreign_shards(manifest: Manifest, state: Mapping[str, Any]) -> list[ShardInfo]:
    """The manifest's shards that no group of the conversion record lists (another writer's)."""
    groups = state.get("groups")
    recorded: set[str] = set()
    for entry in groups.values() if isinstance(groups, dict) else []:
        with contextlib.suppress(KeyError, TypeError):
            recorded.update(str(n) for n in entry["shards"])
    return [s for s in manifest.shards if s.url not in recorded]


def _finished_groups(manifest: Manifest, state: Mapping[str, Any]) -> dict[int, tuple[str, list[ShardInfo]]]:
    by_name = {s.url: s for s in manifest.shards}
    out: dict[int, tuple[str, list[ShardInfo]]] = {}
    groups = state.get("groups")
    for key, entry in (groups.items() if isinstance(groups, dict) else []):
        try:
            names = [str(n) for n in entry["shards"]]
            digest = str(entry["digest"])
            number = int(key)
        except (KeyError, TypeError, ValueError):
            continue
        if names and all(n in by_name for n in names):
            out[number] = (digest, [by_name[n] for n in names])
    return out


def _skipped_inputs(state: Mapping[str, Any], groups: Mapping[int, Any]) -> dict[int, list[tuple[str, str]]]:
    """The inputs each kept group's ``build`` skipped (named again in the re-run's manifest)."""
    out: dict[int, list[tuple[str, str]]] = {}
    for number in groups:
        entry = state["groups"].get(str(number))
        skipped = entry.get("skipped") if isinstance(entry, dict) else None
        if isinstance(skipped, list):
            out[number] = [(str(s[0]), str(s[1])) for s in skipped if isinstance(s, list) and len(s) == 2]
    return out


def checkpoint(point: str) -> None:
    """A point where a conversion has made something durable (``record:start``,
    ``shard:committed``, ``record:written``, ``manifest:written``); nothing happens
    here. Tests replace it to kill a conversion at each point in turn."""


def write_record(
    dest: str,
    identity: Mapping[str, Any],
    groups: Mapping[int, tuple[str, Iterable[ShardInfo]]],
    io: storage.IOOptions,
    skipped: Mapping[int, Iterable[tuple[str, str]]] | None = None,
) -> None:
    """Write the conversion record alone (atomically): the identity and the finished groups.

    ``skipped``: per group, the ``(where, reason)`` of the inputs its ``build`` skipped.
    """
    entries: dict[str, dict[str, Any]] = {}
    for g, (d, shards) in sorted(groups.items()):
        entries[str(g)] = {"digest": d, "shards": [s.url for s in shards]}
        if skipped and skipped.get(g):
            entries[str(g)]["skipped"] = [list(s) for s in skipped[g]]
    state = {"format": _STATE_FORMAT, "version": _STATE_VERSION, "identity": dict(identity), "groups": entries}
    with storage.open_output(join_url(dest, STATE_NAME), io) as f:
        f.write((json.dumps(state, indent=1, sort_keys=True, default=str) + "\n").encode())


def write_state(
    dest: str,
    identity: Mapping[str, Any],
    groups: Mapping[int, tuple[str, Iterable[ShardInfo]]],
    manifest: Manifest,
    io: storage.IOOptions,
    skipped: Mapping[int, Iterable[tuple[str, str]]] | None = None,
) -> None:
    """Write the conversion record, then the manifest (both atomically): a shard the
    manifest lists is always in the record. ``skipped``: as :func:`write_record`."""
    write_record(dest, identity, groups, io, skipped)
    checkpoint("record:written")
    write_manifest(join_url(dest, MANIFEST_NAME), manifest, io)
    checkpoint("manifest:written")
