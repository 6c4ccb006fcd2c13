"""A full check of a dataset: every shard against the manifest, every sample decoded."""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .. import storage
from ..codecs import DecodeOptions, decode_field
from ..errors import ManifestError, SampleError, ShardflowError
from ..format.keys import IMAGE_EXTENSIONS
from ..format.frames import FrameTable, decode_frames, framed_chunks
from ..format.manifest import ShardInfo, decode_offsets
from ..format.tar import BLOCK, iter_samples
from ..sources.source import resolve_source
from .chunks import HashingChunks, strip_url
from .pool import Progress, Ticker, default_workers, map_shards, preload
from .report import Problem, VerifyReport

__all__ = ["verify"]

_KEYS_PER_FIELD_SET = 20  # keys kept per (shard, field set) to name samples with missing fields


@dataclass
class _VerifyTask:
    url: str
    info: ShardInfo | None
    index_url: str | None
    io: storage.IOOptions
    decode: bool
    frames_url: str | None = None


@dataclass
class _VerifyResult:
    samples: int = 0
    bytes: int = 0
    problems: list[Problem] = field(default_factory=list)
    field_sets: Counter = field(default_factory=Counter)
    keys_by_set: dict[tuple[str, ...], list[str]] = field(default_factory=dict)


def _load_index(task: _VerifyTask) -> tuple[Any, FrameTable | None, Problem | None]:
    """The offset index and the frame table (a framed ``.tar.zst``), or the problem that stops them."""
    if task.index_url is None or task.info is None:
        return None, None, None
    frames = None
    if task.frames_url is not None:
        try:
            data = storage.read_small(task.frames_url, task.io, "frame table")
            frames = decode_frames(data, task.frames_url, task.info.bytes, task.io.limits)
        except ShardflowError as e:
            return None, None, Problem(task.url, None, e.reason, f"frame table {task.frames_url}: {strip_url(str(e), task.frames_url)}")
    try:
        data = storage.read_small(task.index_url, task.io, "offset index")
    except ShardflowError as e:
        return None, frames, Problem(task.url, None, "offset_index", f"offset index {task.index_url} unreadable: {e}")
    try:
        size = task.info.bytes if frames is None else frames.size
        return decode_offsets(data, task.index_url, task.info.samples, size), frames, None
    except ManifestError as e:
        return None, frames, Problem(task.url, None, "offset_index", str(e))


def _verify_shard(task: _VerifyTask, tick: Ticker) -> _VerifyResult:
    res = _VerifyResult()
    url, info = task.url, task.info
    problems = res.problems
    offsets, frames, index_problem = _load_index(task)
    if index_problem is not None:
        problems.append(index_problem)
    options = DecodeOptions(image="numpy")
    starts: list[int] = []
    last_key: str | None = None
    raw = HashingChunks(storage.open_chunks(url, 0, None, task.io))
    # a framed shard is decompressed frame by frame, each frame checked against its table entry
    tar = storage.decompressing_chunks(raw, url) if frames is None else framed_chunks(raw, url, 0, frames.size, frames, task.io.limits)
    it = iter_samples(tar, url, 0, sample_errors="yield", limits=task.io.limits)
    readable = True
    missing = False
    try:
        for key, offset, fields in it:
            res.samples += 1
            tick(1)
            starts.append(offset)
            last_key = key
            if isinstance(fields, SampleError):
                problems.append(Problem(url, key, fields.reason, strip_url(str(fields), url)))
                continue
            names = tuple(sorted(fields))
            res.field_sets[names] += 1
            kept = res.keys_by_set.setdefault(names, [])
            if len(kept) < _KEYS_PER_FIELD_SET:
                kept.append(key)
            if task.decode:
                for name, data in fields.items():
                    try:
                        decode_field(name, data, options)
                    except ShardflowError as e:
                        problems.append(Problem(url, key, e.reason, str(e), name))
        raw.drain()
    except FileNotFoundError:
        readable, missing = False, True
        problems.append(Problem(url, None, "missing_shard", "the shard does not exist"))
    except ShardflowError as e:
        readable = False
        after = f" (after sample {last_key!r})" if last_key is not None else " (before the first sample)"
        problems.append(Problem(url, None, e.reason, strip_url(str(e), url) + after))
        try:
            raw.drain()
        except ShardflowError:
            pass
    finally:
        it.close()
        raw.release()
    res.bytes = raw.size
    if info is None or missing:
        return res
    if info.bytes >= 0 and raw.size != info.bytes:
        problems.append(Problem(url, None, "size", f"the manifest lists {info.bytes} bytes, the shard has {raw.size}"))
    if info.sha256 and raw.sha.hexdigest() != info.sha256:
        problems.append(
            Problem(url, None, "sha256", f"sha256 is {raw.sha.hexdigest()}, the manifest lists {info.sha256}")
        )
    if res.samples != info.samples:
        problems.append(
            Problem(url, None, "sample_count", f"the manifest lists {info.samples} samples, the shard holds {res.samples}")
        )
    if offsets is not None:
        problems.extend(_check_offsets(task, offsets, starts, raw, readable, frames))
    return res


def _check_offsets(task: _VerifyTask, offsets: Any, starts: list[int], raw: HashingChunks, readable: bool,
                   frames: FrameTable | None) -> list[Problem]:
    url = task.url
    if raw.compressed and frames is None:
        return [Problem(url, None, "offset_index", "the shard is compressed, so byte offsets into it cannot seek samples; "
                        "drop its offset index from the manifest")]
    idx = offsets.tolist()
    n = min(len(starts), len(idx) - 1)
    wrong = [i for i in range(n) if idx[i] != starts[i]]
    out = []
    if wrong:
        i = wrong[0]
        out.append(Problem(
            url, None, "offset_index",
            f"{len(wrong)} of {n} offset index entries differ from the sample offsets; the first is entry {i}: "
            f"index says byte {idx[i]}, sample {i} starts at byte {starts[i]}",
        ))
    if readable and len(starts) == len(idx) - 1:
        end = idx[-1]
        size = raw.size if frames is None else frames.size  # (tar bytes)
        if end > size:
            out.append(Problem(url, None, "offset_index", f"the last offset index entry {end} is past the end of the shard ({size} bytes)"))
        elif end < size:
            if frames is None:
                after = storage.read_range(url, end, min(end + BLOCK, size), task.io)
            else:
                after = storage.read_framed_range(url, end, min(end + BLOCK, size), frames, task.io)
            if after.strip(b"\0"):
                out.append(Problem(
                    url, None, "offset_index",
                    f"the last offset index entry {end} is not the end of the last sample (no end-of-archive marker there)",
                ))
    return out


def _unlisted_problems(manifest_url: str, listed: dict[str, str], seen: Iterable[str]) -> list[Problem]:
    extra = sorted(set(seen) - set(listed))
    if not listed or not extra:
        return []
    return [Problem(manifest_url, None, "unlisted_field",
                    f"fields {extra} occur in the shards but the manifest lists only {sorted(listed)}")]


def _is_image(field: str) -> bool:
    return field.rsplit(".", 1)[-1] in IMAGE_EXTENSIONS


def _missing_field_problems(urls: Sequence[str], results: Sequence[_VerifyResult]) -> list[Problem]:
    """Samples lacking a field that the most common field set has."""
    total: Counter = Counter()
    for r in results:
        total.update(r.field_sets)
    if len(total) <= 1:
        return []
    common = set(total.most_common(1)[0][0])
    out = []
    for url, r in zip(urls, results):
        for names, count in r.field_sets.items():
            # image fields stand in for each other (an ImageFolder of .jpg and .png files)
            missing = sorted(f for f in common - set(names) if not (_is_image(f) and any(_is_image(n) for n in names)))
            if not missing:
                continue
            keys = r.keys_by_set[names]
            for key in keys:
                out.append(Problem(url, key, "missing_field",
                                   f"lacks the field(s) {missing} that most samples have (it has {list(names)})",
                                   missing[0]))
            if count > len(keys):
                out.append(Problem(url, None, "missing_field",
                                   f"{count - len(keys)} more samples with the fields {list(names)} lack {missing}"))
    return out


def verify(
    source: str | os.PathLike | Sequence[str],
    *,
    decode: bool = True,
    uniform_fields: bool = True,
    workers: int | None = None,
    io: storage.IOOptions | None = None,
    progress: Progress | None = None,
) -> VerifyReport:
    """Read every shard and report what is wrong.

    Per shard, against the manifest when there is one: the sha256 and byte size
    of the file, the sample count, and every offset index entry against the
    actual sample offsets (and its last entry against the end-of-archive
    marker). Per sample: the tar structure (headers, truncation, adjacent
    members, repeated fields) and, with ``decode``, every field decoded by its
    codec (images fully, graphs into ``Data``/``HeteroData``). With
    ``uniform_fields``, a sample lacking a field that the most common field set
    has is a problem too (the default collate needs equal fields), as is a
    field the manifest does not list.

    Args:
        source: anything :class:`~shardflow.ShardDataset` accepts, or a resolved
            :class:`~shardflow.sources.source.ShardSet` (each shard is read with its
            source's own storage options merged over ``io``).
        decode: decode every field (False: structure and manifest checks only).
        uniform_fields: report samples missing fields that most samples have.
        workers: processes, one shard each at a time (default: the CPU
            count, fewer for a dataset under 32 MiB a process).
        io: storage options.
        progress: ``progress(n)``, called as samples are read.

    Returns:
        A :class:`VerifyReport`: the list of :class:`Problem` (empty when the
        dataset is sound), with counts of what was checked.

    Raises:
        FileNotFoundError: the source lists no shard.
        ManifestError: the manifest itself is invalid.
    """
    started = time.perf_counter()
    io = io or storage.IOOptions()
    src = resolve_source(source, io)
    m = src.manifest
    infos: list[ShardInfo | None] = list(m.shards) if m is not None else [None] * len(src.urls)
    tasks = [_VerifyTask(u, info, idx, src.options_for(i, io), decode, src.frames_url(i, io))  # its source's options
             for i, (u, info, idx) in enumerate(zip(src.urls, infos, src.index_urls))]  # fmt: skip
    workers = default_workers(src) if workers is None else workers
    preload(src, workers)
    results: list[_VerifyResult] = map_shards(_verify_shard, tasks, workers, progress)
    report = VerifyReport()
    for r in results:
        report.extend(r.problems)
    if uniform_fields:
        report.extend(_missing_field_problems(src.urls, results))
    if m is not None:
        seen: set[str] = set()
        for r in results:
            for names in r.field_sets:
                seen.update(names)
        report.extend(_unlisted_problems(m.url or "shardflow.json", m.fields, seen))
    report.shards = len(src.urls)
    report.samples = sum(r.samples for r in results)
    report.bytes = sum(r.bytes for r in results)
    report.manifest = m.url if m is not None else None
    report.decoded = decode
    report.seconds = time.perf_counter() - started
    return report
