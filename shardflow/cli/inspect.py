"""``shardflow inspect URL``: a readable summary of a dataset (``--json`` for machines)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from ..inspect import summarize
from .options import add_io_arguments, source_and_io
from .progress import progress_bar, total_samples
from .units import counted, human_bytes

_META_WIDTH = 100  # characters of each meta value shown (``--json`` has them whole)


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "inspect",
        help="summarize a dataset: shards, samples, fields, classes, graphs, first keys",
        description="Summarize a dataset, local or remote, with or without a manifest (without one the "
        "shards are scanned). Class counts come from meta['class_counts'] when the manifest has them, "
        "else from the samples' label field; graph statistics from decoding the 'pyg' fields.",
    )
    parser.add_argument("url", help="dataset folder, manifest URL, shard pattern or URL, or a pipeline config "
                        "(.yaml) whose list of sources and weights is shown as a mixture")
    parser.add_argument("--json", action="store_true", help="print machine-readable JSON with exact counts")
    parser.add_argument("--keys", type=int, default=10, metavar="N", help="first keys to list (default 10)")
    parser.add_argument("--label", default="cls", help="field holding class labels (default cls)")
    scan = parser.add_mutually_exclusive_group()
    scan.add_argument("--scan", dest="scan", action="store_const", const=True, default=None,
                      help="always read every shard (exact counts even with a manifest)")
    scan.add_argument("--no-scan", dest="scan", action="store_const", const=False,
                      help="read only the manifest and the first samples (fast)")
    parser.add_argument("--max-graphs", type=int, default=None, metavar="N",
                        help="decode at most N graphs per shard for graph statistics (default all)")
    parser.add_argument("--workers", type=int, default=None, metavar="N", help="scanning processes (default: CPUs)")
    parser.add_argument("--batches", type=int, default=None, metavar="N",
                        help="report the class mix of the first N planned batches of epoch 0, rank 0 (labels read "
                        "without image bytes) beside a uniform permutation's")
    parser.add_argument("--batch-size", type=int, default=256, metavar="B", help="batch size for --batches (default 256)")
    add_io_arguments(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    # a pipeline config gives its sources (a union or a mixture), each with its own storage options
    source, io, per_epoch = source_and_io(args)
    with progress_bar("scanning", total=total_samples(source, io), unit="sample") as update:
        info = summarize(
            source, keys=args.keys, scan=args.scan, label=args.label, max_graphs=args.max_graphs,
            workers=args.workers, io=io, progress=update, samples_per_epoch=per_epoch,
        )
    if args.batches:
        info["batches"] = planned_batches(args, source, io)
    if args.json:
        print(json.dumps(info, indent=1, ensure_ascii=False))
    else:
        print(format_summary(info))
    # nothing could be read (a mistyped path, a shard that is gone): not an empty dataset
    return 1 if info["errors"] and not info["samples"] else 0


def planned_batches(args: argparse.Namespace, source: Any, io: Any) -> dict[str, Any]:
    """The class mix of the planned batches (:func:`shardflow.inspect.batchmix.planned_mix`): the
    dataset as its config builds it (a ``.yaml``), else ``ShardDataset(URL, shuffle=True, seed=0)``."""
    from .. import loader
    from ..config import dataset_from_config, load_config
    from ..dataset import ShardDataset
    from ..inspect.batchmix import planned_mix

    if str(args.url).endswith((".yaml", ".yml")):
        ds = dataset_from_config(load_config(args.url), decode=None)
    else:
        ds = ShardDataset(source, shuffle=True, seed=0, decode=None, io=io)
    loader(ds, batch_size=args.batch_size)  # sets the dataset's batch size, as training will
    return planned_mix(ds, args.batches, label=args.label)


def format_batches(b: dict[str, Any]) -> list[str]:
    """The summary's lines for a :func:`planned_batches` result."""
    p, run = b["permutation"], b["worst_run"] or {"first": 0, "batches": 0, "mean_distinct": 0.0}
    ratio = f" ({b['ratio']:.2f}x)" if b["ratio"] is not None else ""
    return [
        f"batches   {b['batches']:,} of {b['batch_size']:,} planned (epoch 0, rank 0; labels from the {b['labels_from']})",
        f"  distinct classes per batch  {b['mean_distinct']:.1f}{ratio}; a uniform permutation {p['mean_distinct']:.1f}",
        f"  largest class's share       {b['largest_share']:.1%}; a uniform permutation {p['largest_share']:.1%}",
        f"  worst batch {b['worst_distinct']} distinct; worst run of {run['batches']} batches from batch "
        f"{run['first']}: {run['mean_distinct']:.1f}",
    ]


def _n(x: int | None) -> str:
    return "?" if x is None else f"{x:,}"


def _stats_line(s: dict[str, Any]) -> str:
    return f"min {s['min']:,} · mean {s['mean']:,.1f} · max {s['max']:,}"


def format_summary(info: dict[str, Any]) -> str:
    """The human-readable form of a :func:`shardflow.inspect.summarize` result."""
    lines = []
    many = len(info.get("sources") or []) > 1
    src = info["source"] if isinstance(info["source"], str) else f"{len(info['source'])} {'sources' if many else 'URLs'}"
    where = f"manifest{'s' if many else ''} {info['manifest']}" if info["manifest"] else "no manifest: counts from a scan of the shards"
    lines.append(f"dataset   {src}  ({where})")
    if len(info.get("sources") or []) > 1 or any(p["weight"] for p in info.get("sources") or []):
        weighted = any(p["weight"] for p in info["sources"])
        lines.append(f"sources   {len(info['sources'])} ({'a weighted mixture' if weighted else 'a union'}; "
                     "samples carry __source__)")
        for i, p in enumerate(info["sources"]):
            mix = f"  weight {p['weight']:g}" if p["weight"] else ""
            quota = f"  quota {p['quota']:,} per epoch" if p["quota"] is not None else ""
            lines.append(f"  {i}  {p['label']}  {p['shards']:,} shards, {_n(p['samples'])} samples{mix}{quota}")
    samples = _n(info["samples"])
    per = ""
    if info["samples"] and info["shards"]:
        per = f" (~{info['samples'] / info['shards']:,.0f} per shard)"
    lines.append(f"shards    {info['shards']:,}")
    lines.append(f"samples   {samples}{per}")
    if info["bytes"] is not None:
        avg = f", ~{human_bytes(info['bytes'] // info['samples'])} per sample" if info["samples"] else ""
        lines.append(f"bytes     {human_bytes(info['bytes'])} ({info['bytes']:,}{avg})")
    comp = info.get("compression")
    if comp:
        kinds = ", ".join(f"{k} ({counted(v, 'shard')})" for k, v in comp.items() if k != "framed")
        lines.append(f"compression {kinds}; {counted(comp['framed'], 'shard')} framed (seekable: offset index, "
                     "random access)")
    if info["fields"]:
        lines.append("fields")
        width = max(len(f) for f in info["fields"])
        for name, f in info["fields"].items():
            count = f"  in {counted(f['samples'], 'sample')}" if f["samples"] is not None else ""
            lines.append(f"  {name:<{width}}  codec {f['codec']}{count}")
    if info["classes"]:
        classes = info["classes"]
        total = sum(c["samples"] for c in classes)
        lines.append(f"classes   {len(classes):,} (counts from {'the manifest meta' if info['classes_from'] == 'meta' else 'the samples'})")
        shown = classes if len(classes) <= 30 else classes[:15] + [None] + classes[-5:]
        width = max(len(str(c["label"])) for c in classes)
        for c in shown:
            if c is None:
                lines.append(f"  ... {len(classes) - 20:,} more")
                continue
            name = f"  {c['name']}" if c["name"] is not None else ""
            share = f"{100 * c['samples'] / total:5.1f}%" if total else ""
            lines.append(f"  {str(c['label']):>{width}}{name:<16}  {c['samples']:>8,}  {share}")
    for name, g in (info["graphs"] or {}).items():
        kinds = ", ".join(f"{k} x{v:,}" for k, v in g["kinds"].items())
        lines.append(f"graphs    field {name!r}: {g['graphs']:,} decoded ({kinds})")
        if g["graphs"]:
            lines.append(f"  nodes per graph  {_stats_line(g['nodes'])}")
            lines.append(f"  edges per graph  {_stats_line(g['edges'])}")
        for t, s in g.get("node_types", {}).items():
            lines.append(f"  node type {t}: {_stats_line(s)}")
        for t, s in g.get("edge_types", {}).items():
            lines.append(f"  edge type ({', '.join(t.split('|'))}): {_stats_line(s)}")
        if g.get("attributes"):
            lines.append("  attributes       " + ", ".join(f"{k} {v}" for k, v in g["attributes"].items()))
        if g.get("missing"):  # not the data's fault: a package to install
            lines.append(f"  {g['undecodable']:,} graphs not decoded: {g['missing']}")
        elif g.get("undecodable"):
            lines.append(f"  {g['undecodable']:,} graphs could not be decoded (run `shardflow verify`)")
    if info["first_keys"]:
        lines.append(f"first keys {', '.join(info['first_keys'])}")
    if info["meta"]:
        lines.append("meta")
        for k, v in info["meta"].items():
            text = json.dumps(v, ensure_ascii=False)
            if len(text) > _META_WIDTH:
                text = text[: _META_WIDTH - 3] + "..."
            lines.append(f"  {k}: {text}")
    if info.get("batches"):
        lines += format_batches(info["batches"])
    for err in info["errors"]:
        lines.append(f"warning   {err} (run `shardflow verify`)")
    return "\n".join(lines)
