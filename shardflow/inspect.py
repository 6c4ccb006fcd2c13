"""Looking at a dataset before training: a summary, the first samples, a full check.

- :func:`summarize` describes a dataset (shards, samples, bytes, fields and their
  codecs, class counts, graph statistics, the first keys, the manifest's meta) as
  a JSON-ready dict.
- :func:`head` reads the first samples (or samples spread over the dataset) as
  raw field bytes.
- :func:`verify` reads every shard, checks it against the manifest (sha256, byte
  size, sample count, offset index) and decodes every field, returning the
  problems found, each naming the shard, the key and the reason.

Shards are scanned in parallel by worker processes. Nothing here prints: the
command line (:mod:`shardflow.cli.inspect`, :mod:`shardflow.cli.verify`) formats
the results and draws the progress bar, which reaches this module as a
``progress(n)`` callback counting samples.
"""

from __future__ import annotations

import hashlib
import logging
import math
import multiprocessing
import os
import queue
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

from . import storage
from .codecs import DecodeOptions, decode_field
from .errors import ManifestError, ShardflowError, SampleError
from .format.keys import codec_extension
from .format.manifest import ShardInfo, decode_offsets
from .format.tar import BLOCK, iter_samples
from .source import Source, resolve_source

__all__ = ["Problem", "VerifyReport", "summarize", "head", "verify", "class_names"]

log = logging.getLogger(__name__)

Progress = Callable[[int], None]

_KEYS_PER_FIELD_SET = 20  # keys kept per (shard, field set) to name samples with missing fields
_TICK_SECONDS = 0.1  # workers report progress at most this often


# ------------------------------------------------------------------ shard pool


_QUEUE: Any = None  # progress queue of a worker process, set by _init_worker


def _init_worker(q: Any) -> None:
    global _QUEUE
    _QUEUE = q


class _Ticker:
    """Counts done samples and passes them on at most every ``_TICK_SECONDS``."""

    def __init__(self, sink: Progress | None) -> None:
        self._sink = sink
        self._pending = 0
        self._last = time.monotonic()

    def __call__(self, n: int = 1) -> None:
        self._pending += n
        now = time.monotonic()
        if now - self._last >= _TICK_SECONDS:
            self.flush()
            self._last = now

    def flush(self) -> None:
        if self._pending and self._sink is not None:
            self._sink(self._pending)
        self._pending = 0


def _worker_ticker() -> _Ticker:
    return _Ticker(_QUEUE.put if _QUEUE is not None else None)


def _drain(q: Any, progress: Progress | None) -> None:
    while True:
        try:
            n = q.get_nowait()
        except queue.Empty:
            return
        if progress is not None:
            progress(n)


_BYTES_PER_WORKER = 32 << 20  # by default, one more process per this many shard bytes


def _default_workers(src: Source) -> int:
    """CPU count, fewer for small datasets (a process costs more than it saves there)."""
    cpus = os.cpu_count() or 1
    m = src.manifest
    if m is not None and m.shards and all(s.bytes >= 0 for s in m.shards):
        return max(1, min(cpus, sum(s.bytes for s in m.shards) // _BYTES_PER_WORKER + 1))
    return cpus


def _preload(src: Source, workers: int) -> None:
    """Import the graph codec's dependencies once before worker processes fork."""
    m = src.manifest
    if workers > 1 and m is not None and any(codec_extension(f) == "pyg" for f in m.fields):
        try:
            import torch_geometric.data  # noqa: F401
        except ImportError:
            pass  # each graph then fails to decode with a message naming the extra


def _map_shards(fn: Callable[[Any, _Ticker], Any], tasks: Sequence[Any], workers: int, progress: Progress | None) -> list[Any]:
    """``[fn(t, ticker) for t in tasks]``, over ``workers`` processes (1: in this process).

    ``fn`` reports progress through the ticker it is given.
    """
    if not tasks:
        return []
    workers = max(1, min(workers, len(tasks)))
    if workers == 1:
        global _QUEUE
        saved, _QUEUE = _QUEUE, None
        out = []
        try:
            for t in tasks:
                ticker = _Ticker(progress)
                out.append(fn(t, ticker))
                ticker.flush()
        finally:
            _QUEUE = saved
        return out
    ctx = multiprocessing.get_context()
    q = ctx.Queue()
    results: list[Any] = [None] * len(tasks)
    with ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init_worker, initargs=(q,)) as ex:
        futures = {ex.submit(_run_task, fn, t): i for i, t in enumerate(tasks)}
        pending = set(futures)
        while pending:
            done, pending = wait(pending, timeout=_TICK_SECONDS, return_when=FIRST_COMPLETED)
            _drain(q, progress)
            for f in done:
                results[futures[f]] = f.result()
    _drain(q, progress)
    q.close()
    return results


def _run_task(fn: Callable[[Any, _Ticker], Any], task: Any) -> Any:
    ticker = _worker_ticker()
    try:
        return fn(task, ticker)
    finally:
        ticker.flush()


# ------------------------------------------------------------------ reading


class _HashingChunks:
    """Pass a chunk stream through, counting its bytes and hashing them (sha256).

    Deliberately has no ``close``: :func:`storage.decompressing_chunks` closes its
    input when it stops, and the rest must still be drained into the hash;
    :meth:`release` closes the underlying stream.
    """

    def __init__(self, chunks: Iterator[bytes]) -> None:
        self._chunks = chunks
        self.sha = hashlib.sha256()
        self.size = 0
        self.head = b""

    def __iter__(self) -> _HashingChunks:
        return self

    def __next__(self) -> bytes:
        chunk = next(self._chunks)
        if len(self.head) < 4:
            self.head += chunk[:4]
        self.sha.update(chunk)
        self.size += len(chunk)
        return chunk

    def drain(self) -> None:
        """Read (and hash) the rest of the stream."""
        for _ in self:
            pass

    def release(self) -> None:
        """Close the underlying stream (its read-ahead thread and file handle)."""
        close = getattr(self._chunks, "close", None)
        if close is not None:
            close()

    @property
    def compressed(self) -> bool:
        return self.head.startswith(storage.GZIP_MAGIC) or self.head.startswith(storage.ZSTD_MAGIC)


def _strip_url(message: str, url: str) -> str:
    """Drop a leading ``"<url>: "`` from a library error message (the shard is reported apart)."""
    prefix = f"{url}: "
    return message[len(prefix) :] if message.startswith(prefix) else message


def head(
    source: str | os.PathLike | Sequence[str] | Source,
    n: int = 10,
    *,
    spread: bool = False,
    io: storage.IOOptions | None = None,
) -> list[dict[str, Any]]:
    """Read ``n`` samples as raw field bytes.

    Args:
        source: anything :class:`~shardflow.ShardDataset` accepts, or a resolved
            :class:`~shardflow.source.Source`.
        n: number of samples (fewer when the dataset is smaller).
        spread: pick samples evenly spaced over the whole dataset (needs sample
            counts from a manifest; without one the first ``n`` are taken).
            With an offset index only those samples' bytes are read.
        io: storage options.

    Returns:
        Sample dicts in dataset order: ``__key__``, ``__url__`` and ``{field: bytes}``.

    Raises:
        ShardFormatError, SampleError, RemoteReadError: a shard read is unreadable.
    """
    io = io or storage.IOOptions()
    src = source if isinstance(source, Source) else resolve_source(source, io)
    if n <= 0:
        return []
    counts = src.counts
    if spread and counts is not None and int(counts.sum()) > n:
        return _spread(src, n, io)
    out: list[dict[str, Any]] = []
    for url in src.urls:
        chunks = storage.decompressing_chunks(storage.open_chunks(url, 0, None, io), url)
        it = iter_samples(chunks, url, 0, limit=n - len(out), limits=io.limits)
        try:
            for key, _, fields in it:
                out.append({"__key__": key, "__url__": url, **fields})
        finally:
            it.close()
            chunks.close()
        if len(out) >= n:
            break
    return out


def _spread(src: Source, n: int, io: storage.IOOptions) -> list[dict[str, Any]]:
    counts = src.counts
    total = int(counts.sum())
    wanted = sorted({(i * total) // n for i in range(n)})
    out: list[dict[str, Any]] = []
    first = 0
    for shard, (url, count) in enumerate(zip(src.urls, counts.tolist())):
        mine = [g - first for g in wanted if first <= g < first + count]
        first += count
        if not mine:
            continue
        offsets = src.load_offsets(shard, io)
        if offsets is not None:
            for i in mine:
                lo, hi = int(offsets[i]), int(offsets[i + 1])
                data = storage.read_range(url, lo, hi, io)
                for key, _, fields in iter_samples([data], url, lo, end=hi, limits=io.limits):
                    out.append({"__key__": key, "__url__": url, **fields})
            continue
        chunks = storage.decompressing_chunks(storage.open_chunks(url, 0, None, io), url)
        it = iter_samples(chunks, url, 0, limit=mine[-1] + 1, limits=io.limits)
        take = set(mine)
        try:
            for i, (key, _, fields) in enumerate(it):
                if i in take:
                    out.append({"__key__": key, "__url__": url, **fields})
        finally:
            it.close()
            chunks.close()
    return out


# ------------------------------------------------------------------ summarize


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


def _graph_record(graph: Any) -> dict[str, Any]:
    """Nodes, edges and types of one decoded graph."""
    rec: dict[str, Any] = {"nodes": int(graph.num_nodes or 0), "edges": int(graph.num_edges)}
    if hasattr(graph, "node_types") and hasattr(graph, "edge_types") and type(graph).__name__ == "HeteroData":
        rec["kind"] = "HeteroData"
        rec["node_types"] = {t: int(graph[t].num_nodes or 0) for t in graph.node_types}
        rec["edge_types"] = {"|".join(t): int(graph[t].num_edges) for t in graph.edge_types}
    else:
        rec["kind"] = type(graph).__name__
        attrs = {}
        for key in sorted(graph.keys()):
            value = graph[key]
            if hasattr(value, "dtype") and hasattr(value, "shape"):
                attrs[key] = f"{str(value.dtype).replace('torch.', '')} {list(value.shape)}"
            else:
                attrs[key] = type(value).__name__
        rec["attributes"] = attrs
    return rec


def _add_graph(acc: dict[str, Any], rec: dict[str, Any]) -> None:
    acc.setdefault("nodes", []).append(rec["nodes"])
    acc.setdefault("edges", []).append(rec["edges"])
    acc.setdefault("kinds", Counter())[rec["kind"]] += 1
    for t, c in rec.get("node_types", {}).items():
        acc.setdefault("node_types", {}).setdefault(t, []).append(c)
    for t, c in rec.get("edge_types", {}).items():
        acc.setdefault("edge_types", {}).setdefault(t, []).append(c)
    if "attributes" in rec and "attributes" not in acc:
        acc["attributes"] = rec["attributes"]


def _scan_shard(task: _ScanTask, tick: _Ticker) -> _ScanResult:
    res = _ScanResult()
    raw = _HashingChunks(storage.open_chunks(task.url, 0, None, task.io))
    it = iter_samples(storage.decompressing_chunks(raw, task.url), task.url, 0, sample_errors="yield", limits=task.io.limits)
    decode_options = DecodeOptions(image=None)
    try:
        for key, _, fields in it:
            res.samples += 1
            tick(1)
            if len(res.keys) < task.keys:
                res.keys.append(key)
            if isinstance(fields, SampleError):
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
                    _add_graph(acc, _graph_record(decode_field(name, data, decode_options)))
                except ShardflowError as e:
                    acc["errors"] = acc.get("errors", 0) + 1
                    log.debug("%s: sample %r: %s", task.url, key, e)
        raw.drain()
    except ShardflowError as e:
        res.error = f"{task.url}: {_strip_url(str(e), task.url)}"
    finally:
        it.close()
        raw.release()
    res.bytes = raw.size
    return res


def _stats(values: Sequence[int]) -> dict[str, Any]:
    if not values:
        return {"min": 0, "mean": 0.0, "max": 0, "total": 0}
    total = int(sum(values))
    return {"min": int(min(values)), "mean": round(total / len(values), 3), "max": int(max(values)), "total": total}


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
) -> dict[str, Any]:
    """Describe a dataset.

    Without a manifest the shards are scanned (read once, in parallel) to count
    samples, bytes and fields. With a manifest, counts come from it, and the
    shards are scanned only for what it lacks: class counts (when samples carry
    a ``label`` field and ``meta["class_counts"]`` is absent) and graph
    statistics (``pyg`` fields).

    Args:
        source: anything :class:`~shardflow.ShardDataset` accepts.
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

    Returns:
        A JSON-ready dict:

        - ``source``, ``manifest`` (its URL or None), ``scanned`` (bool);
        - ``shards``; ``samples`` and ``bytes`` (None when unknown);
        - ``fields``: ``{name: {"codec": ext, "samples": int | None}}``, the
          number of samples holding the field when scanned;
        - ``classes``: ``[{"label", "name", "samples"}]`` sorted by label, or None;
          ``classes_from``: ``"meta"`` or ``"samples"``;
        - ``graphs``: per ``pyg`` field, ``graphs`` (number decoded), ``kinds``,
          ``nodes`` and ``edges`` per graph (``min``/``mean``/``max``/``total``),
          ``node_types`` and ``edge_types`` (``"src|rel|dst"``) with the same
          statistics for ``HeteroData``, ``attributes`` of the first ``Data``;
        - ``first_keys``; ``meta`` (the manifest's, or ``{}``);
        - ``errors``: shards that could not be read while scanning, and counts
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
    out: dict[str, Any] = {
        "source": os.fspath(source) if isinstance(source, (str, os.PathLike)) else list(source),
        "manifest": m.url if m is not None else None,
        "scanned": bool(scan),
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
    labels: Counter | None = None
    field_counts: Counter | None = None
    if scan:
        tasks = [_ScanTask(u, io, label, keys, max_graphs) for u in src.urls]
        workers = _default_workers(src) if workers is None else workers
        _preload(src, workers)
        results: list[_ScanResult] = _map_shards(_scan_shard, tasks, workers, progress)
        field_counts = Counter()
        labels = Counter()
        graphs: dict[str, dict[str, Any]] = {}
        for url, r in zip(src.urls, results):
            field_counts.update(r.fields)
            labels.update(r.labels)
            for name, acc in r.graphs.items():
                _merge_graphs(graphs.setdefault(name, {}), acc)
            if len(out["first_keys"]) < keys:
                out["first_keys"].extend(r.keys[: keys - len(out["first_keys"])])
            if r.error is not None:
                out["errors"].append(r.error)
        scanned_samples = sum(r.samples for r in results)
        scanned_bytes = sum(r.bytes for r in results)
        if m is None:
            out["samples"] = scanned_samples
            out["bytes"] = scanned_bytes
        else:
            if scanned_samples != m.num_samples and not out["errors"]:
                out["errors"].append(
                    f"the manifest lists {m.num_samples} samples, the shards hold {scanned_samples}"
                )
            if out["bytes"] is None:
                out["bytes"] = scanned_bytes
        for name in field_counts:
            field_codecs.setdefault(name, codec_extension(name))
        if graphs:
            out["graphs"] = {name: _graph_summary(acc) for name, acc in sorted(graphs.items())}
    else:
        out["first_keys"] = [s["__key__"] for s in head(src, keys, io=io)]
        if out["bytes"] is None:
            out["bytes"] = sum(storage.object_size(u, io) for u in src.urls)
    out["fields"] = {
        name: {"codec": codec, "samples": field_counts.get(name, 0) if field_counts is not None else None}
        for name, codec in sorted(field_codecs.items())
    }
    counts, origin = (meta_counts, "meta") if meta_counts is not None else (labels, "samples")
    if counts:
        names = class_names(meta)
        out["classes"] = [
            {"label": lab, "name": names.get(lab), "samples": int(c)}
            for lab, c in sorted(counts.items(), key=lambda kv: _label_sort(kv[0]))
        ]
        out["classes_from"] = origin
    return out


def _merge_graphs(into: dict[str, Any], acc: dict[str, Any]) -> None:
    into.setdefault("nodes", []).extend(acc.get("nodes", []))
    into.setdefault("edges", []).extend(acc.get("edges", []))
    into.setdefault("kinds", Counter()).update(acc.get("kinds", Counter()))
    into["errors"] = into.get("errors", 0) + acc.get("errors", 0)
    for part in ("node_types", "edge_types"):
        for t, values in acc.get(part, {}).items():
            into.setdefault(part, {}).setdefault(t, []).extend(values)
    if "attributes" in acc and "attributes" not in into:
        into["attributes"] = acc["attributes"]


def _graph_summary(acc: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {
        "graphs": len(acc.get("nodes", [])),
        "kinds": dict(sorted(acc.get("kinds", Counter()).items())),
        "nodes": _stats(acc.get("nodes", [])),
        "edges": _stats(acc.get("edges", [])),
    }
    if acc.get("node_types"):
        out["node_types"] = {t: _stats(v) for t, v in sorted(acc["node_types"].items())}
    if acc.get("edge_types"):
        out["edge_types"] = {t: _stats(v) for t, v in sorted(acc["edge_types"].items())}
    if acc.get("attributes"):
        out["attributes"] = acc["attributes"]
    if acc.get("errors"):
        out["undecodable"] = acc["errors"]
    return out


# ------------------------------------------------------------------ verify


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a dataset.

    Attributes:
        shard: the shard URL (or the manifest URL for dataset-level problems).
        key: the sample key, or None for a shard-level problem.
        reason: a constant tag: ``missing_shard``, ``sha256``, ``size``,
            ``sample_count``, ``offset_index``, ``truncated_shard``,
            ``bad_shard``, ``duplicate_field``, ``non_adjacent``, ``decode``,
            ``missing_field``, ``unlisted_field``, ``remote_read``, ...
        message: what was expected and what was found.
        field: the field concerned, if any.
    """

    shard: str
    key: str | None
    reason: str
    message: str
    field: str | None = None

    def __str__(self) -> str:
        where = self.shard if self.key is None else f"{self.shard} key {self.key!r}"
        return f"{where}: {self.reason}: {self.message}"

    def to_json(self) -> dict[str, Any]:
        return {"shard": self.shard, "key": self.key, "reason": self.reason, "field": self.field, "message": self.message}


class VerifyReport(list):
    """The problems :func:`verify` found (a ``list[Problem]``, empty when all is well).

    Attributes:
        shards: shards checked.
        samples: samples read.
        bytes: shard bytes read.
        manifest: the manifest URL checked against, or None.
        decoded: whether every field was decoded.
        seconds: wall time.
    """

    shards: int = 0
    samples: int = 0
    bytes: int = 0
    manifest: str | None = None
    decoded: bool = True
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self

    def bad_shards(self) -> list[str]:
        """Shards with at least one problem, in first-seen order."""
        return list(dict.fromkeys(p.shard for p in self if p.shard != self.manifest))


@dataclass
class _VerifyTask:
    url: str
    info: ShardInfo | None
    index_url: str | None
    io: storage.IOOptions
    decode: bool


@dataclass
class _VerifyResult:
    samples: int = 0
    bytes: int = 0
    problems: list[Problem] = field(default_factory=list)
    field_sets: Counter = field(default_factory=Counter)
    keys_by_set: dict[tuple[str, ...], list[str]] = field(default_factory=dict)


def _load_index(task: _VerifyTask) -> tuple[Any, Problem | None]:
    if task.index_url is None or task.info is None:
        return None, None
    try:
        data = b"".join(storage.iter_chunks(task.index_url, 0, None, task.io))
    except ShardflowError as e:
        return None, Problem(task.url, None, "offset_index", f"offset index {task.index_url} unreadable: {e}")
    try:
        return decode_offsets(data, task.index_url, task.info.samples), None
    except ManifestError as e:
        return None, Problem(task.url, None, "offset_index", str(e))


def _verify_shard(task: _VerifyTask, tick: _Ticker) -> _VerifyResult:
    res = _VerifyResult()
    url, info = task.url, task.info
    problems = res.problems
    offsets, index_problem = _load_index(task)
    if index_problem is not None:
        problems.append(index_problem)
    options = DecodeOptions(image="numpy")
    starts: list[int] = []
    last_key: str | None = None
    raw = _HashingChunks(storage.open_chunks(url, 0, None, task.io))
    it = iter_samples(storage.decompressing_chunks(raw, url), url, 0, sample_errors="yield", limits=task.io.limits)
    readable = True
    missing = False
    try:
        for key, offset, fields in it:
            res.samples += 1
            tick(1)
            starts.append(offset)
            last_key = key
            if isinstance(fields, SampleError):
                problems.append(Problem(url, key, fields.reason, _strip_url(str(fields), url)))
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
        problems.append(Problem(url, None, e.reason, _strip_url(str(e), url) + after))
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
        problems.extend(_check_offsets(task, offsets, starts, raw, readable))
    return res


def _check_offsets(task: _VerifyTask, offsets: Any, starts: list[int], raw: _HashingChunks, readable: bool) -> list[Problem]:
    url = task.url
    if raw.compressed:
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
        if end > raw.size:
            out.append(Problem(url, None, "offset_index", f"the last offset index entry {end} is past the end of the shard ({raw.size} bytes)"))
        elif end < raw.size:
            after = storage.read_range(url, end, min(end + BLOCK, raw.size), task.io)
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
    from .codecs.image import IMAGE_EXTENSIONS

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
        source: anything :class:`~shardflow.ShardDataset` accepts.
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
    tasks = [_VerifyTask(u, info, idx, io, decode) for u, info, idx in zip(src.urls, infos, src.index_urls)]
    workers = _default_workers(src) if workers is None else workers
    _preload(src, workers)
    results: list[_VerifyResult] = _map_shards(_verify_shard, tasks, workers, progress)
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


def human_bytes(n: int | None) -> str:
    """``1536`` -> ``"1.5 KiB"``."""
    if n is None:
        return "?"
    if n < 1024:
        return f"{n} B"
    exp = min(int(math.log(n, 1024)), 4)
    return f"{n / 1024 ** exp:.1f} {['B', 'KiB', 'MiB', 'GiB', 'TiB'][exp]}"
