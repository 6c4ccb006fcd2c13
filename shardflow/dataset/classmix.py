"""Whether a dataset's shuffle can use the window shuffle (:mod:`shardflow.planning.window`).

The window shuffle reads every sample on its own through its shard's offset index. That is
cheap for plain ``.tar`` shards on local disk, and costly elsewhere: from a bucket each sample
would be a request of its own (the bytes over the link would stay 1x, the requests would not),
and a compressed shard would decompress a frame per sample. There the shuffle stays the shard
interleave and the shuffle buffer (``window`` set to 0), and the order is that of
``ShuffleConfig(window=0)``. So it is for shards that a converter wrote in a shuffled order
(``meta.order == "shuffled"``): their classes are mixed already, and reading them in order
is faster.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import numpy as np

from .. import storage
from ..errors import ShardflowError
from ..planning.plan import RankPlan, ShuffleConfig
from ..sources.source import ShardSet

__all__ = ["effective_shuffle", "window_readable", "written_mixed", "manifest_labels", "batch_labels", "mix_stats",
           "unmixed_warning", "warn_unmixed", "RUN"]

RUN = 8
"""Consecutive batches of the worst run reported."""

log = logging.getLogger(__name__)


def window_readable(source: ShardSet, io: storage.IOOptions) -> bool:
    """True when every shard is a plain (uncompressed: its first bytes say so, a local read of
    4 bytes per shard) ``.tar`` on local disk with an offset index."""
    if not source.urls or not all(
        storage.is_local(url) and url.endswith(".tar") and index is not None
        for url, index in zip(source.urls, source.index_urls)
    ):
        return False
    try:
        return not any(storage.is_compressed(url, io) for url in source.urls)
    except (OSError, ShardflowError):  # a missing or unreadable shard: reading it will say so
        return False


def written_mixed(source: ShardSet) -> bool:
    """True when the manifest says its converter wrote the samples in a shuffled order
    (``meta.order``, :mod:`shardflow.convert.engine.mixorder`): the shards are mixed already."""
    manifest = source.manifest
    return manifest is not None and isinstance(manifest.meta, dict) and manifest.meta.get("order") == "shuffled"


def effective_shuffle(shuffle: ShuffleConfig, source: ShardSet, io: storage.IOOptions) -> ShuffleConfig:
    """``shuffle``, with the window off (0) when the shards are mixed already (read in order, as
    stored, is as fast as reading gets) or cannot be read by random access cheaply."""
    if shuffle.window <= 1:
        return shuffle
    if written_mixed(source) or shuffle.affinity:  # affinity keeps a rank's shards: no window over all
        return replace(shuffle, window=0)
    if window_readable(source, io):
        return shuffle
    log.debug("window shuffle off: shards that are remote, compressed or without an offset index are read in order")
    return replace(shuffle, window=0)


def manifest_labels(source: ShardSet) -> np.ndarray | None:
    """int64 labels of every sample (shards in manifest order) from ``meta.class_counts`` when the
    samples were written class after class; None when the manifest does not say so."""
    m = source.manifest
    meta = m.meta if m is not None and isinstance(m.meta, dict) else {}
    counts, to_idx = meta.get("class_counts"), meta.get("class_to_idx")
    if meta.get("order", "walk") != "walk" or not isinstance(counts, Mapping) or not isinstance(to_idx, Mapping):
        return None
    if m is None or len(source.urls) != len(m.shards) or sum(counts.values()) != m.num_samples:
        return None  # a sub-selection of the shards, or counts that do not add up
    try:
        return np.repeat(np.asarray([int(to_idx[c]) for c in counts], np.int64), np.asarray(list(counts.values()), np.int64))
    except (KeyError, TypeError, ValueError):
        return None


def batch_labels(plan: RankPlan, labels: np.ndarray, counts: np.ndarray, batches: int) -> list[np.ndarray]:
    """The labels of the plan's first ``batches`` batches (``labels``: per sample, shards concatenated)."""
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    shard_of = np.asarray([s.shard for s in plan.segments], dtype=np.int64)
    sizes, pos = plan.batch_positions(range(min(batches, plan.num_batches)))
    if not sizes:
        return []
    found = labels[starts[shard_of[plan.read_segment[pos].astype(np.int64)]] + plan.read_sample[pos]]
    return np.split(found, np.cumsum(sizes)[:-1])


def mix_stats(batches: list[np.ndarray], run: int = RUN) -> dict[str, Any]:
    """Mean distinct labels per batch, the largest label's mean share, the worst batch and the
    worst run of ``run`` consecutive batches (the lowest mean distinct); full batches only."""
    full = [b for b in batches if len(b) == len(batches[0])] if batches else []
    if not full:
        return {"batches": 0, "mean_distinct": 0.0, "largest_share": 0.0, "worst_distinct": 0, "worst_run": None}
    distinct = np.asarray([len(np.unique(b)) for b in full], dtype=np.float64)
    largest = [np.unique(b, return_counts=True)[1].max() / len(b) for b in full]
    r = min(run, len(full))
    means = np.convolve(distinct, np.ones(r) / r, mode="valid")
    at = int(np.argmin(means))
    return {
        "batches": len(full), "mean_distinct": float(distinct.mean()), "largest_share": float(np.mean(largest)),
        "worst_distinct": int(distinct.min()), "worst_run": {"first": at, "batches": r, "mean_distinct": float(means[at])},
    }  # fmt: skip


WARN_RATIO = 0.5
"""Batches with fewer distinct classes than this share of a permutation's are warned about."""

WARN_BATCHES = 64
"""Planned batches the warning looks at (epoch 0)."""


def unmixed_warning(dataset: Any, rank: int) -> str | None:
    """The warning for a dataset whose batches would be far less mixed than a permutation's, or
    None. Looked at only when the labels are known from the manifest alone (classes written one
    after the other, :func:`manifest_labels`) and shuffling is on: no byte is read."""
    shuffle: ShuffleConfig = dataset.shuffle
    if not shuffle.enabled or not dataset.sized or dataset.batching is None:
        return None
    labels = manifest_labels(dataset.shards)
    if labels is None or len(labels) == 0:
        return None
    plan = dataset.plan(0, rank)
    counts = np.asarray(dataset.shards.counts, dtype=np.int64)
    got = mix_stats(batch_labels(plan, labels, counts, WARN_BATCHES))
    size, n = plan.batch_size, min(WARN_BATCHES, plan.num_batches)
    perm = labels[np.random.default_rng(0).permutation(len(labels))][: n * size]
    base = mix_stats([perm[i : i + size] for i in range(0, len(perm), size)])
    if not base["mean_distinct"] or got["mean_distinct"] >= WARN_RATIO * base["mean_distinct"]:
        return None
    why = ("the window shuffle is off (ShuffleConfig(window=0))" if window_readable(dataset.shards, dataset.io)
           else "the shards are not local plain .tar files with an offset index, where the window shuffle works")
    return (
        f"batches of {size} will hold {got['mean_distinct']:.1f} distinct classes on average, against "
        f"{base['mean_distinct']:.1f} for a uniform permutation (`shardflow inspect --batches`): the manifest says "
        f"the classes were written one after the other, and {why}. Convert with `--order shuffled` (the default), "
        "or set ShuffleConfig(window=...) on local shards"
    )


def warn_unmixed(dataset: Any) -> None:
    """Log :func:`unmixed_warning` once per dataset (at the loader's ``set_batching``; the
    dataset's ``mix_warned`` attribute remembers it)."""
    if getattr(dataset, "mix_warned", False):
        return
    message = unmixed_warning(dataset, dataset.world().rank)
    if message:
        dataset.mix_warned = True
        log.warning("%s", message)
