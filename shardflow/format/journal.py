"""The writer's journal: one line per finished shard, replayed into a manifest after a crash.

A local :class:`~shardflow.ShardWriter` appends to ``shardflow.json.journal`` as it
goes, so the cost of a shard does not grow with the shard count; the manifest is
written once, at close.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from ..errors import ManifestError
from .manifest import FORMAT_VERSION, JOURNAL_SUFFIX, Manifest, ShardInfo

__all__ = ["journal_header", "journal_entry", "journal_commit", "manifest_from_journal"]

# ------------------------------------------------------------------ journal
#
# A ShardWriter writes the manifest once, at close. While it runs, every finished shard is
# appended to the journal as one JSON line, so the cost per shard stays constant however many
# shards there are (rewriting the manifest after every shard costs O(N) per shard). A reader
# that finds a journal and no manifest (the writer was killed) replays it.
#
# A shard's line is written while its files still lie at temporary names, and a commit line
# follows once they are at their names (durable): so a shard at its name is always in the
# journal. Only the last entry can lack its commit line (killed between the two); a replay
# keeps it only if ``verify`` finds the shard complete at its name (size and sha256). Shards
# kept from the folder's earlier manifest are entered first, committed.
#
#   {"format": "shardflow-journal", "version": 1, "meta": {...}, "commits": true}
#   {"shard": {"url": ..., "samples": ..., ...}, "fields": {"jpg": "jpg"}, "meta": {...}}   (meta: if changed)
#   {"committed": "train-000000.tar"}
#   {"shard": {...}, "fields": {...}, "committed": true}      (a kept shard of an earlier dataset)
#
# A journal without "commits" in its header (an older writer's) lists committed shards only.


def journal_header(meta: dict[str, Any]) -> bytes:
    """The journal's first line."""
    return _line({"format": "shardflow-journal", "version": FORMAT_VERSION, "meta": meta, "commits": True})


def journal_entry(shard: ShardInfo, fields: dict[str, str], meta: dict[str, Any] | None = None,
                  *, committed: bool = False) -> bytes:
    """One shard's line; ``meta`` only when it changed since the previous line; ``committed``
    for a shard already at its name (one kept from an earlier manifest)."""
    entry: dict[str, Any] = {"shard": shard.to_json(), "fields": fields}
    if meta is not None:
        entry["meta"] = meta
    if committed:
        entry["committed"] = True
    return _line(entry)


def journal_commit(url: str) -> bytes:
    """The line that follows a shard's entry once its files are at their names."""
    return _line({"committed": url})


def _line(obj: dict[str, Any]) -> bytes:
    return (json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n").encode("utf-8")


def manifest_from_journal(data: bytes, url: str, verify: Callable[[ShardInfo], bool] | None = None) -> Manifest:
    """The manifest a journal describes (its shards in order, fields and last meta).

    A last line cut short by a crash is ignored. A last entry without its commit
    line (the writer was killed between the two) is kept only if ``verify(shard)``
    says the shard is complete at its name; without ``verify`` it is left out.

    Args:
        data: the journal's bytes.
        url: the manifest URL this stands for (shard URLs resolve against its folder).
        verify: checks an uncommitted shard against its files (see
            :func:`shardflow.storage.writing.folder.verify_shard`).

    Raises:
        ManifestError: the first line is not a shardflow journal header, or a
            complete line is not valid.
    """
    lines = data.split(b"\n")
    if data.endswith(b"\n"):
        lines.pop()
    elif lines:
        lines.pop()  # torn by a crash
    try:
        header = json.loads(lines[0]) if lines else None
    except (ValueError, RecursionError):
        header = None
    if not isinstance(header, dict) or header.get("format") != "shardflow-journal":
        raise ManifestError(f"{url}{JOURNAL_SUFFIX}: not a shardflow writer journal")
    meta = header.get("meta", {})
    shards: list[Any] = []
    fields: dict[str, Any] = {}
    pending = False  # the last entry waits for its commit line
    for n, line in enumerate(lines[1:], 2):
        try:
            entry = json.loads(line)
            if "committed" in entry and "shard" not in entry:
                if not shards or not pending or entry["committed"] != shards[-1]["url"]:
                    raise ValueError(f"a commit of {entry['committed']!r} that follows no entry of it")
                pending = False
                continue
            if pending:
                raise ValueError(f"an entry follows the uncommitted {shards[-1]['url']!r}")
            shards.append(entry["shard"])
            fields.update(entry.get("fields", {}))
            meta = entry.get("meta", meta)
            pending = bool(header.get("commits")) and not entry.get("committed")
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
            raise ManifestError(f"{url}{JOURNAL_SUFFIX}: line {n} is not a journal entry: {e}") from e
    obj = {"format": "shardflow", "version": header.get("version"), "shards": shards, "fields": fields, "meta": meta}
    manifest = Manifest.loads(json.dumps(obj), url=url)
    if pending and (verify is None or not verify(manifest.shards[-1])):
        manifest.shards.pop()  # its files never reached their names (or not whole)
    return manifest
