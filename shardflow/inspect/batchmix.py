"""The class mix of the batches a dataset will give, known before training: :func:`planned_mix`.

The labels come without the image bytes: from the manifest when its converter wrote the classes
one after the other (``meta.class_counts`` in walk order: ``meta.order == "walk"``, or no
``order`` at all, as converters wrote before the shuffled order), else from the label member of
each sample alone: through the shard's offset index, the first 1 KiB of the sample (its first
member's header and data; the writer sorts members by field, so ``cls`` comes before ``jpg``), the
whole sample only when the label is not its first member. A shard without an offset index is read
whole. The batches are those of the dataset's own plan (:mod:`shardflow.planning.plan`), so the figures
are those the loader's batches will show.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from .. import storage
from ..format.tar import iter_samples
from ..dataset.classmix import batch_labels, manifest_labels, mix_stats
from ..sources.source import ShardSet

__all__ = ["read_labels", "planned_mix"]

_HEAD = 1024


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


def planned_mix(dataset: Any, batches: int, label: str = "cls", seed: int = 0) -> dict[str, Any]:
    """The class mix of epoch 0 of rank 0 of ``dataset`` (a ``ShardDataset`` with its batch size
    set by a loader), and a uniform permutation's over the same batch size and count.

    Returns:
        :func:`mix_stats` of the planned batches, with ``batch_size``, ``labels_from``,
        ``permutation`` (the same figures for a permutation of the labels, seeded by ``seed``)
        and ``ratio`` (mean distinct over the permutation's).
    """
    counts = np.asarray(dataset.shards.counts, dtype=np.int64)
    labels, where = read_labels(dataset.shards, dataset.io, label)
    plan = dataset.plan(0, 0)
    got = mix_stats(batch_labels(plan, labels, counts, batches))
    size = plan.batch_size
    perm = labels[np.random.default_rng(seed).permutation(len(labels))][: min(batches, plan.num_batches) * size]
    base = mix_stats([perm[i : i + size] for i in range(0, len(perm), size)])
    ratio = got["mean_distinct"] / base["mean_distinct"] if base["mean_distinct"] else None
    return {**got, "batch_size": size, "labels_from": where, "permutation": base, "ratio": ratio}
