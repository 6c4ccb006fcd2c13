"""A dataset summary: shards, samples, bytes, fields, classes, graph statistics."""

from __future__ import annotations

import logging
import os
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .. import storage
from ..codecs import DecodeOptions, decode_field
from ..errors import SampleError, ShardflowError, redact
from ..format.keys import codec_extension
from ..format.tar import iter_samples
from ..planning.mixing import epoch_quotas
from ..sources.source import ShardSet, resolve_source
from .chunks import HashingChunks, strip_url
from .graph_stats import add_graph, graph_record, graph_summary, merge_graphs, missing_extra
from .peek import head
from .pool import Progress, Ticker, default_workers, map_shards, preload

__all__ = ["class_names", "summarize"]

log = logging.getLogger(__name__)



@dataclass
class _ScanTask:
    url: str
    io: storage.IOOptions
    label: str
    keys: int
    graphs: int | None


@dataclass
class _ScanResult:
    samples: int = 0
    bytes: int = 0
    fields: Counter = field(default_factory=Counter)
    labels: Counter = field(default_factory=Counter)
    keys: list[str] = field(default_factory=list)
    graphs: dict[str, dict[str, Any]] = field(default_factory=dict)
    error: str | None = None
    bad_samples: int = 0
    first_bad: str | None = None


def _scan_shard(task: _ScanTask, tick: Ticker) -> _ScanResult:
    res = _ScanResult()
    raw = HashingChunks(storage.open_chunks(task.url, 0, None, task.io))
    it = iter_samples(storage.decompressing_chunks(raw, task.url), task.url, 0, sample_errors="yield", limits=task.io.limits)
    decode_options = DecodeOptions(image=None)
    try:
        for key, _, fields in it:
            res.samples += 1
            tick(1)
            if len(res.keys) < task.keys:
                res.keys.append(key)
            if isinstance(fields, SampleError):
                res.bad_samples += 1
                if res.first_bad is None:
                    res.first_bad = f"{task.url} key {key!r}: {strip_url(str(fields), task.url)}"
                continue
            res.fields.update(fields.keys())
            if task.label in fields:
                data = fields[task.label]
                try:
                    res.labels[int(data.strip())] += 1
                except ValueError:
                    res.labels[data.decode("utf-8", "replace").strip()] += 1
            for name, data in fields.items():
                if codec_extension(name) != "pyg":
                    continue
                acc = res.graphs.setdefault(name, {})
                if task.graphs is not None and len(acc.get("nodes", ())) >= task.graphs:
                    continue
                try:
                    add_graph(acc, graph_record(decode_field(name, data, decode_options)))
                except ShardflowError as e:
                    acc["errors"] = acc.get("errors", 0) + 1
                    missing = missing_extra(e)
                    if missing:  # torch_geometric is not installed: say so, with the extra
                        acc["missing"] = missing
                    log.debug("%s: sample %r: %s", redact(task.url), key, e)
        raw.drain()
    except ShardflowError as e:
        res.error = f"{task.url}: {strip_url(str(e), task.url)}"
    finally:
        it.close()
        raw.release()
    res.bytes = raw.size
    return res


def _compression(m: Any) -> dict[str, int] | None:
    """Shards per compression the manifest records, and how many of them are framed (seekable)."""
    if m is None or not any(s.compression for s in m.shards):
        return None
    out = dict(Counter(s.compression for s in m.shards if s.compression))
    out["framed"] = sum(1 for s in m.shards if s.frames)
    return out


def class_names(meta: dict[str, Any]) -> dict[Any, str]:
    """Label -> class name from a manifest's ``meta["class_to_idx"]`` (empty if absent)."""
    c2i = meta.get("class_to_idx")
    if not isinstance(c2i, dict):
        return {}
    out = {}
    for name, idx in c2i.items():
        try:
            out[int(idx)] = str(name)
        except (TypeError, ValueError):
            continue
    return out


def _meta_class_counts(meta: dict[str, Any]) -> Counter | None:
    """``meta["class_counts"]`` as label -> count; keys are labels or class names."""
    raw = meta.get("class_counts")
    if not isinstance(raw, dict):
        return None
    c2i = meta.get("class_to_idx") if isinstance(meta.get("class_to_idx"), dict) else {}
    out: Counter = Counter()
    for k, v in raw.items():
        if k in c2i:
            label: Any = int(c2i[k])
        else:
            try:
                label = int(k)
            except (TypeError, ValueError):
                label = str(k)
        out[label] += int(v)
    return out


def _label_sort(label: Any) -> tuple[int, Any]:
    return (0, label) if isinstance(label, int) else (1, str(label))


def _sources_info(src: ShardSet, samples_per_epoch: int | None) -> list[dict[str, Any]]:
    """Each source of the dataset: shards, samples, weight and (weighted) its quota per epoch."""
    counts = src.counts
    weights = src.weights
    quotas = epoch_quotas(weights, samples_per_epoch) if weights and samples_per_epoch else None
    out = []
    for i, p in enumerate(src.parts):
        out.append({
            "label": p.label, "shards": p.stop - p.start,
            "samples": int(counts[p.start : p.stop].sum()) if counts is not None else None,
            "weight": p.weight, "manifest": p.manifest_url, "quota": quotas[i] if quotas else None,
        })
    return out


def summarize(
    source: str | os.PathLike | Sequence[str],
    *,
    keys: int = 10,
    scan: bool | None = None,
    label: str = "cls",
    max_graphs: int | None = None,
    workers: int | None = None,
    io: storage.IOOptions | None = None,
    progress: Progress | None = None,
    samples_per_epoch: int | None = None,
) -> dict[str, Any]:
    """Describe a dataset.

    Without a manifest the shards are scanned (read once, in parallel) to count
    samples, bytes and fields. With a manifest, counts come from it, and the
    shards are scanned only for what it lacks: class counts (when samples carry
    a ``label`` field and ``meta["class_counts"]`` is absent) and graph
    statistics (``pyg`` fields).

    Args:
        source: anything :class:`~shardflow.ShardDataset` accepts, or a resolved
            :class:`~shardflow.sources.source.ShardSet` (a config's sources: each shard is
            read with its source's own storage options merged over ``io``).
        keys: how many of the first keys to list.
        scan: True always scans, False never does (manifest facts only), None
            decides as above.
        label: the field holding integer class labels.
        max_graphs: decode at most this many graphs per shard for the graph
            statistics (None: all).
        workers: scanning processes (default: the CPU count, fewer for a
            dataset under 32 MiB a process; 1 scans in this process).
        io: storage options.
        progress: ``progress(n)``, called as samples are scanned.
        samples_per_epoch: for a weighted mixture, the samples per epoch (of
            one rank) to compute the sources' quotas for.

    Returns:
        A JSON-ready dict:

        - ``source``, ``manifest`` (its URL or None), ``scanned`` (bool);
        - ``shards``; ``samples`` and ``bytes`` (None when unknown);
          ``compression``: ``{"zstd": shards, "framed": shards with a frame
          table}`` from the manifest, or None when it lists none compressed;
        - ``fields``: ``{name: {"codec": ext, "samples": int | None}}``, the
          number of samples holding the field when scanned;
        - ``classes``: ``[{"label", "name", "samples"}]`` sorted by label, or None;
          ``classes_from``: ``"meta"`` or ``"samples"``;
        - ``graphs``: per ``pyg`` field, ``graphs`` (number decoded), ``kinds``,
          ``nodes`` and ``edges`` per graph (``min``/``mean``/``max``/``total``),
          ``node_types`` and ``edge_types`` (``"src|rel|dst"``) with the same
          statistics for ``HeteroData``, ``attributes`` of the first ``Data``;
        - ``first_keys``; ``meta`` (the manifest's, or ``{}``);
        - ``sources``: per source ``label``, ``shards``, ``samples`` (None when
          unknown), ``weight``, ``manifest``, and with weights and
          ``samples_per_epoch`` its ``quota`` per epoch (:mod:`shardflow.planning.mixing`);
        - ``errors``: shards that could not be read while scanning, samples
          whose members could not be read (a member over its limit), and counts
          that disagree with the manifest (run :func:`verify` for details).

    Raises:
        FileNotFoundError: the source lists no shard.
        ManifestError: the manifest is invalid.
    """
    io = io or storage.IOOptions()
    src = resolve_source(source, io)
    m = src.manifest
    meta = dict(m.meta) if m is not None else {}
    field_codecs: dict[str, str] = dict(m.fields) if m is not None else {}
    meta_counts = _meta_class_counts(meta)
    if meta_counts is not None and m is not None and sum(meta_counts.values()) != m.num_samples:
        meta_counts = None  # a subset of the shards, or a stale manifest: count from the samples
    has_label = label in field_codecs
    has_graphs = any(codec_extension(f) == "pyg" for f in field_codecs)
    if scan is None:
        scan = m is None or (has_label and meta_counts is None) or has_graphs
    out = _facts(source, src, meta, bool(scan), samples_per_epoch)
    labels: Counter | None = None
    field_counts: Counter | None = None
    if scan:
        # each shard read with its source's own storage options (a mixture of buckets)
        tasks = [_ScanTask(u, src.options_for(i, io), label, keys, max_graphs) for i, u in enumerate(src.urls)]
        workers = default_workers(src) if workers is None else workers
        preload(src, workers)
        results: list[_ScanResult] = map_shards(_scan_shard, tasks, workers, progress)
        field_counts, labels = _add_scan(out, results, m, keys)
        for name in field_counts:
            field_codecs.setdefault(name, codec_extension(name))
    else:
        out["first_keys"] = [s["__key__"] for s in head(src, keys, io=io)]
        if out["bytes"] is None:
            out["bytes"] = sum(storage.object_size(u, src.options_for(i, io)) for i, u in enumerate(src.urls))
    out["fields"] = {
        name: {"codec": codec, "samples": field_counts.get(name, 0) if field_counts is not None else None}
        for name, codec in sorted(field_codecs.items())
    }
    counts, origin = (meta_counts, "meta") if meta_counts is not None else (labels, "samples")
    if counts:
        out["classes"], out["classes_from"] = _classes(counts, class_names(meta)), origin
    return out


def _classes(counts: Mapping[Any, int], names: Mapping[Any, str]) -> list[dict[str, Any]]:
    """``[{"label", "name", "samples"}]`` sorted by label."""
    return [
        {"label": lab, "name": names.get(lab), "samples": int(c)}
        for lab, c in sorted(counts.items(), key=lambda kv: _label_sort(kv[0]))
    ]


def _facts(
    source: Any, src: ShardSet, meta: dict[str, Any], scanned: bool, samples_per_epoch: int | None
) -> dict[str, Any]:
    """The summary's keys with what the manifest (if any) says (``meta``: its meta); a scan
    fills in the rest."""
    m = src.manifest
    out: dict[str, Any] = {
        "source": os.fspath(source) if isinstance(source, (str, os.PathLike)) else [p.label for p in src.parts],
        "sources": _sources_info(src, samples_per_epoch),
        "manifest": (m.url or ", ".join(p.manifest_url or "?" for p in src.parts)) if m is not None else None,
        "scanned": scanned,
        "shards": len(src.urls),
        "samples": m.num_samples if m is not None else None,
        "bytes": None,
        "fields": {},
        "classes": None,
        "classes_from": None,
        "graphs": None,
        "first_keys": [],
        "meta": meta,
        "errors": [],
    }
    if m is not None and all(s.bytes >= 0 for s in m.shards):
        out["bytes"] = sum(s.bytes for s in m.shards)
    out["compression"] = _compression(m)
    return out


def _add_scan(out: dict[str, Any], results: list[_ScanResult], m: Any, keys: int) -> tuple[Counter, Counter]:
    """Put what the shard scans found into the summary ``out``; return the field
    and label counts."""
    field_counts: Counter = Counter()
    labels: Counter = Counter()
    graphs: dict[str, dict[str, Any]] = {}
    for r in results:
        field_counts.update(r.fields)
        labels.update(r.labels)
        for name, acc in r.graphs.items():
            merge_graphs(graphs.setdefault(name, {}), acc)
        if len(out["first_keys"]) < keys:
            out["first_keys"].extend(r.keys[: keys - len(out["first_keys"])])
        if r.bad_samples:
            many = f"{r.bad_samples} samples" if r.bad_samples != 1 else "1 sample"
            out["errors"].append(f"{many} could not be read, the first: {r.first_bad}")
        if r.error is not None:
            out["errors"].append(r.error)
    scanned_samples = sum(r.samples for r in results)
    scanned_bytes = sum(r.bytes for r in results)
    if m is None:
        out["samples"] = scanned_samples
        out["bytes"] = scanned_bytes
    else:
        if scanned_samples != m.num_samples and not out["errors"]:
            out["errors"].append(f"the manifest lists {m.num_samples} samples, the shards hold {scanned_samples}")
        if out["bytes"] is None:
            out["bytes"] = scanned_bytes
    if graphs:
        out["graphs"] = {name: graph_summary(acc) for name, acc in sorted(graphs.items())}
    return field_counts, labels
