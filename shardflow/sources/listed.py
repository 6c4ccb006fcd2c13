"""Checks of a manifest before a dataset trusts what it lists: a folder still being written (or
left unfinished) is refused unless asked for, and a shard listed without its size cannot size
anything by its sample count alone.

A conversion rewrites its manifest as groups finish, marked ``"conversion": {"complete":
false}`` until the last; a :class:`~shardflow.ShardWriter` or a conversion holds the folder's
writer lock (:class:`~shardflow.storage.writing.locks.DestinationLock`) while it writes. Reading such a
folder gives whatever part was finished at that moment (500 of 12,000 samples, say) and then
shards that change under the reader, so it is refused with :class:`IncompleteDatasetError`,
unless ``IOOptions(allow_incomplete=True)`` asks for the finished part on purpose.
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any

from ..errors import ManifestError, ShardflowError, redact
from ..format.manifest import Manifest, check_counts
from ..storage.backends.metadata import object_size
from ..storage.options import IOOptions
from ..storage.urls import escapes_folder, is_local, join_url, local_path, parent_url
from ..storage.writing.locks import writer_holding

__all__ = ["IncompleteDatasetError", "check_listed", "refuse_unfinished"]


class IncompleteDatasetError(ShardflowError, OSError):
    """A dataset folder is being written, or its conversion did not finish; names the folder,
    the writer (its pid, when known) and ``allow_incomplete``."""

    default_reason = "incomplete_dataset"


_HOW = ("or pass io=IOOptions(allow_incomplete=True) (allow_incomplete: true in a config) to read the part "
        "finished so far on purpose")


def refuse_unfinished(folder: str, manifest: Manifest | None, options: IOOptions) -> None:
    """Refuse a dataset folder that a writer holds now or whose manifest says its conversion is
    not complete (:class:`IncompleteDatasetError`); nothing when ``options.allow_incomplete``.

    Args:
        folder: the manifest's folder (local path or URL; only a local one has a writer lock).
        manifest: the folder's manifest, or None (a folder listed, or a journal replayed).
        options: ``allow_incomplete`` lifts the refusal.

    Raises:
        IncompleteDatasetError: names the folder, the writer (``pid N on host``) and the option.
    """
    if options.allow_incomplete:
        return
    writer = writer_holding(os.path.abspath(local_path(folder))) if is_local(folder) else None
    meta: Any = manifest.meta if manifest is not None else None
    conversion = meta.get("conversion") if isinstance(meta, dict) else None
    unfinished = isinstance(conversion, dict) and conversion.get("complete") is False
    if writer is None and not unfinished:
        return
    so_far = "" if manifest is None else f"; its manifest lists {len(manifest.shards)} shard(s), " \
                                          f"{manifest.num_samples} samples, so far"
    if writer is not None:
        raise IncompleteDatasetError(
            f"{redact(folder)}: a writer ({writer}) is writing this folder now{so_far}: wait for it to finish, {_HOW}"
        )
    raise IncompleteDatasetError(
        f"{redact(folder)}: the conversion that wrote this folder did not finish (its manifest says \"complete\": false "
        f"and no writer holds the folder: it was stopped or crashed){so_far}: re-run the conversion (it resumes "
        f"where it stopped), {_HOW}"
    )


def check_listed(manifest: Manifest, options: IOOptions) -> None:
    """:func:`~shardflow.format.manifest.check_counts` for every shard, those listed without
    ``"bytes"`` checked against their size as stored (a ``stat``, or one ``HEAD`` for a remote
    shard), so that no sample count sizes an array without a bound.

    Raises:
        ManifestError: a shard declares more samples than its size can hold, or a shard
            listed without ``"bytes"`` has no size that can be read (named, with the cause).
    """
    check_counts(manifest, options.limits)
    unsized = [s for s in manifest.shards if s.bytes < 0]
    if not unsized:
        return
    folder = parent_url(manifest.url) if manifest.url else "."
    where = manifest.url or "<manifest>"
    sized = []
    for info in unsized:
        if escapes_folder(info.url) is not None and not options.trust_manifest_urls:
            continue  # never asked for: the dataset refuses the URL by name when it lists it
        try:
            size = object_size(join_url(folder, info.url), options)
        except (OSError, ValueError) as e:
            raise ManifestError(
                f"{where}: shard {info.url!r} is listed with {info.samples} samples but no \"bytes\", and its size "
                f"cannot be read to bound that count ({type(e).__name__}: {redact(str(e))}); add its size (shardflow index "
                "writes a manifest with sizes)"
            ) from e
        sized.append(replace(info, bytes=size))
    check_counts(Manifest(shards=sized, fields={}, meta={}, url=manifest.url), options.limits)
