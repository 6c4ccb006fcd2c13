"""The class mix of the batches a dataset will give, known before training: :func:`planned_mix`.

The labels come without the image bytes: from the manifest when its converter wrote the classes
one after the other (``meta.class_counts`` in walk order: ``meta.order == "walk"``, or no
``order`` at all, as converters wrote before the shuffled order), else from the label member of
each sample alone: through the shard's offset index, the first 1 KiB of the sample (its first
member's header and data; the writer sorts members by field, so ``cls`` comes before ``jpg``), the
whole sample only when the label is not its first member. A shard without an offset index is read
whole. The batches are those of the dataset's own plan (:mod:`shardflow.plan`), so the figures
are those the loader's batches will show.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from .. import storage
from ..format.tar import iter_samples
from ..plan import RankPlan
from ..source import ShardSet

__all__ = ["manifest_labels", "read_labels", "batch_labels", "mix_stats", "planned_mix", "RUN"]

RUN = 8
"""Consecutive batches of the worst run reported."""

_HEAD = 1024


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


def _label_of(head: bytes, label: str) -> int | None:
    """The label when it is the first member of a sample starting with ``head`` (a plain ustar
    member), else None."""
    if len(head) < 512 or head[156:157] not in (b"0", b"\0"):
        return None
    name = head[:100].split(b"\0", 1)[0].decode("utf-8", "replace").rsplit("/", 1)[-1]
    field = name.split(".", 1)[1].lower() if "." in name else ""
    try:
        size = int(head[124:136].split(b"\0", 1)[0].strip() or b"0", 8)
        return int(head[512 : 512 + size]) if field == label and 0 < size <= len(head) - 512 else None
    except ValueError:
        return None


def _shard_labels(source: ShardSet, shard: int, io: storage.IOOptions, label: str) -> list[int]:
    url = source.urls[shard]
    offsets = source.load_offsets(shard, io)
    if offsets is None:  # read whole: the label of every sample
        raw = storage.open_chunks(url, 0, None, source.options_for(shard, io))
        return [int(f[label]) for _, _, f in iter_samples(storage.decompressing_chunks(raw, url), url, 0)]
    path = url[len("file://") :] if url.startswith("file://") else url
    fd = storage.regular_fd(path) if storage.is_local(url) else None
    opts = source.options_for(shard, io)

    def read(lo: int, hi: int) -> bytes:
        return os.pread(fd, hi - lo, lo) if fd is not None else storage.read_range(url, lo, hi, opts)

    out = []
    try:
        for lo, hi in zip(offsets[:-1].tolist(), offsets[1:].tolist()):
            got = _label_of(read(lo, min(hi, lo + _HEAD)), label)
            if got is None:  # not the first member: the whole sample, parsed and checked
                got = next(int(f[label]) for _, _, f in iter_samples([read(lo, hi)], url, lo, end=hi))
            out.append(got)
    finally:
        if fd is not None:
            os.close(fd)
    return out


def read_labels(source: ShardSet, io: storage.IOOptions, label: str = "cls") -> tuple[np.ndarray, str]:
    """int64 labels of every sample (shards in manifest order) and where they came from
    (``"manifest"`` or ``"label members"``)."""
    known = manifest_labels(source)
    if known is not None:
        return known, "manifest"
    parts = [_shard_labels(source, s, io, label) for s in range(len(source.urls))]
    return np.asarray([x for p in parts for x in p], dtype=np.int64), "label members"


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


def planned_mix(dataset: Any, batches: int, label: str = "cls", seed: int = 0) -> dict[str, Any]:
    """The class mix of epoch 0 of rank 0 of ``dataset`` (a ``ShardDataset`` with its batch size
    set by a loader), and a uniform permutation's over the same batch size and count.

    Returns:
        :func:`mix_stats` of the planned batches, with ``batch_size``, ``labels_from``,
        ``permutation`` (the same figures for a permutation of the labels, seeded by ``seed``)
        and ``ratio`` (mean distinct over the permutation's).
    """
    counts = np.asarray(dataset.source.counts, dtype=np.int64)
    labels, where = read_labels(dataset.source, dataset.io, label)
    plan = dataset.plan(0, 0)
    got = mix_stats(batch_labels(plan, labels, counts, batches))
    size = plan.batch_size
    perm = labels[np.random.default_rng(seed).permutation(len(labels))][: min(batches, plan.num_batches) * size]
    base = mix_stats([perm[i : i + size] for i in range(0, len(perm), size)])
    ratio = got["mean_distinct"] / base["mean_distinct"] if base["mean_distinct"] else None
    return {**got, "batch_size": size, "labels_from": where, "permutation": base, "ratio": ratio}
