"""Selecting samples at plan time: ``ShardDataset(select=...)``.

A selection is a key predicate (``select=lambda key: ...``) or a collection of keys
(``select=val_keys``). It is resolved once, when the dataset is built, into the
selected sample numbers of every shard: the keys are read from each shard's tar
headers (one streaming pass per shard, in threads), checked against the manifest's
sample counts and offset index, and matched. The epoch is then planned over the
selected samples only (:func:`shardflow.planning.plan.select_plan`): every rank gets the same
number of samples and batches, the ranks together see each selected sample exactly
once per epoch (plus the declared padding), nothing repeats, and resumption works as
for any plan. Readers seek over the samples left out with the offset index.

It needs a manifest (sample counts) and an offset index for every shard; without
them it is a :class:`~shardflow.errors.ShardflowError` that says so (``shardflow
index`` writes both). A transform that returns None also filters, but after the
plan: the loader then repeats batches to keep ranks equal, and warns.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Collection
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Union

import numpy as np

from .. import storage
from ..errors import ManifestError, ShardflowError
from ..format.tar import scan_shard
from ..sources.shardset import ShardSet

__all__ = ["Select", "resolve_selection", "selection_digest"]

log = logging.getLogger(__name__)

Select = Union[Callable[[str], Any], Collection[str]]
"""A key predicate, or the keys to keep (a set, list, tuple or frozenset of str)."""


def _keys_of(url: str, samples: int, io: storage.IOOptions) -> list[str]:
    chunks = storage.decompressing_chunks(storage.iter_chunks(url, 0, None, io), url)
    keys, _, _ = scan_shard(chunks, url, limits=io.limits)
    if len(keys) != samples:
        raise ManifestError(f"{url}: holds {len(keys)} samples, the manifest says {samples}; select= cannot "
                            "match keys to the offset index (re-run `shardflow index`)")
    return keys


def resolve_selection(source: ShardSet, select: Select, io: storage.IOOptions, workers: int = 8) -> list[np.ndarray]:
    """The selected sample numbers of every shard (manifest order), sorted int64 arrays.

    Args:
        source: the dataset's shards (with a manifest and offset indexes).
        select: a predicate ``select(key) -> bool`` or a collection of keys.
        io: how shards are read.
        workers: shards read at once (threads).

    Raises:
        ShardflowError: no manifest, or a shard without an offset index (named).
        TypeError: ``select`` is a str or neither callable nor a collection.
        ManifestError: a shard's sample count differs from the manifest's.
    """
    if isinstance(select, (str, bytes)) or not (callable(select) or isinstance(select, Collection)):
        raise TypeError(f"select must be a key predicate or a collection of keys, got {type(select).__name__}")
    counts = source.counts
    if counts is None:
        raise ShardflowError(
            f"select= plans the selected samples exactly, which needs sample counts: {source.unsized_reason()}. "
            "Write a manifest with `shardflow index`, or filter with a transform that returns None (batches "
            "then repeat to keep ranks equal)"
        )
    missing = [u for u, i in zip(source.urls, source.index_urls) if i is None]
    if missing:
        raise ShardflowError(
            f"select= seeks over the samples it leaves out, which needs an offset index per shard; "
            f"{len(missing)} shard(s) have none ({', '.join(missing[:3])}). Re-write the manifest with "
            "`shardflow index`"
        )
    if callable(select):
        keep: Callable[[str], Any] = select
    else:
        wanted = frozenset(select)
        keep = wanted.__contains__

    def one(shard: int) -> tuple[np.ndarray, set[str]]:
        keys = _keys_of(source.urls[shard], int(counts[shard]), io)
        picked = [i for i, k in enumerate(keys) if keep(k)]
        return np.asarray(picked, dtype=np.int64), ({keys[i] for i in picked} if not callable(select) else set())

    with ThreadPoolExecutor(max(1, min(workers, len(source.urls)))) as pool:
        results = list(pool.map(one, range(len(source.urls))))
    chosen = [c for c, _ in results]
    log.info("select=: %d of %d samples in %d shards", sum(len(c) for c in chosen), int(counts.sum()), len(chosen))
    if not callable(select):
        found = set().union(*(f for _, f in results))
        if len(found) < len(wanted):
            log.warning("select=: %d of the %d keys given are in no shard (e.g. %r)", len(wanted) - len(found),
                        len(wanted), sorted(wanted - found)[:3])
    return chosen


def selection_digest(chosen: list[np.ndarray]) -> str:
    """A short digest of a selection (a resumed state must select the same samples)."""
    h = hashlib.sha256()
    for c in chosen:
        h.update(np.asarray(c, dtype=np.int64).tobytes())
        h.update(b";")
    return h.hexdigest()[:16]
