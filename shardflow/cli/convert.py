"""``shardflow convert KIND SRC DST``: one sub-command per converter.

All argument parsing of the converters lives here; the converters in
:mod:`shardflow.convert` take plain arguments and a ``progress`` callback.
The sub-commands share :mod:`shardflow.cli.convert_common` (the shard options,
the progress bar, the one-line summary); Parquet and LMDB are in
:mod:`shardflow.cli.convert_stores`.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from ..policy import CONVERT_ON_ERROR
from .convert_common import add_order_options, add_shard_options, options_from_args, run_converter
from .convert_common import rate as _rate
from .convert_stores import add_lmdb, add_parquet
from .shown import shown
from .units import counted

KINDS = ("imagefolder", "pyg", "arrays", "lines", "parquet", "lmdb")


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "convert", help="convert an image folder, a PyG dataset, arrays, text lines, Parquet or LMDB into shards"
    )
    kinds = parser.add_subparsers(dest="kind", metavar="KIND")
    kinds.required = True
    for add in (_add_imagefolder, _add_pyg, _add_arrays, _add_lines, add_parquet, add_lmdb):
        add(kinds)


# ------------------------------------------------------------------ imagefolder


def _add_imagefolder(kinds: argparse._SubParsersAction) -> None:
    # the converter is imported with its parser, as pyg's and arrays' are (its default order
    # comes from it), not in the handler: a program that builds the parser first (a benchmark, a
    # long-lived tool calling main() repeatedly) has it imported before it converts
    from ..convert.images import imagefolder

    parser = kinds.add_parser(
        "imagefolder",
        help="convert an ImageFolder tree (SRC/<class>/<image>) into shards",
        description=(
            "Pack SRC/<class>/.../<image> files into tar shards in DST (fields <ext> with the original "
            "bytes and cls), with class_to_idx in DST/shardflow.json. Each image's header is checked as it "
            "is read: corrupt images are skipped and named (--on-error raise stops instead). Hidden entries, "
            "other files and symlinked folders that lead back into the tree or out of it are skipped and "
            "named in the manifest (meta.ignored). A class with no image is an error unless --allow-empty. "
            "Re-running resumes."
        ),
    )
    parser.add_argument("src", metavar="SRC", help="root of the image folder (one sub-folder per class)")
    parser.add_argument("dst", metavar="DST", help="destination folder or fsspec URL for shards and manifest")
    parser.add_argument("--allow-empty", action="store_true", help="keep classes with no images (with their index)")
    parser.add_argument(
        "--classes-from", metavar="DATASET_OR_FILE",
        help="class indices of another dataset (its folder or manifest: meta.class_to_idx) or of a JSON / text "
        "list of class names, e.g. the training set's for a val split; a class folder not in it is an error",
    )  # fmt: skip
    parser.add_argument("--on-error", choices=CONVERT_ON_ERROR, default="skip",
                        help="a corrupt image: skip it and name it (default), or stop with an error")
    parser.add_argument("--follow-links", action="store_true",
                        help="follow symlinked folders that lead out of SRC (links back into SRC never are)")
    parser.add_argument("--max-side", type=int, metavar="N",
                        help="shrink images whose long side exceeds N pixels once, as they are packed (same format; "
                        "smaller images are kept byte for byte); recorded in the manifest (meta.resize)")
    parser.add_argument("--quality", type=int, default=90, metavar="Q",
                        help="JPEG/WebP quality of the images --max-side re-encodes (1-100, default 90)")
    add_order_options(parser, "images in a seeded random order, every shard mixing the classes",
                      "classes one after the other, as listed (for data that must stay ordered)",
                      default=imagefolder.DEFAULT_ORDER)
    add_shard_options(parser)
    parser.set_defaults(func=_imagefolder)


def _imagefolder(args: argparse.Namespace) -> int:
    from ..convert.images.imagefolder import convert_imagefolder, count_images

    options = options_from_args(args)
    # A total for the ETA costs one scandir pass that keeps counts only; it is
    # done only when a bar is drawn (a terminal), never in logs or pipes.
    total = None
    if sys.stderr.isatty():
        total = sum(count_images(args.src, storage_options=dict(options.storage_options),
                                 follow_links=args.follow_links).values())  # fmt: skip

    def summary(manifest: Any, seconds: float) -> str:
        n = manifest.num_samples
        line = (
            f"{counted(n, 'sample')}, {counted(len(manifest.meta['class_to_idx']), 'class', 'classes')}, "
            f"{counted(len(manifest.shards), 'shard')} "
            f"{_rate(n, seconds, 'files')} -> {shown(args.dst)}"
        )
        return line + left_out(manifest.meta)

    return run_converter(
        lambda update, client: convert_imagefolder(
            args.src, args.dst, allow_empty=args.allow_empty, options=options, progress=update, client=client,
            classes_from=args.classes_from, on_error=args.on_error, follow_links=args.follow_links,
            max_side=args.max_side, quality=args.quality, order=args.order, seed=args.seed,
        ),
        summary,
        args=args,
        desc="imagefolder",
        unit="files",
        total=total,
    )


SHOWN = 10
"""Skipped and ignored entries a conversion's summary names (the manifest names up to 1,000)."""


def left_out(meta: dict[str, Any]) -> str:
    """The summary's lines for what a conversion skipped (corrupt inputs) and ignored (other
    files, folders), each entry with its reason; '' when nothing was left out."""
    lines = []
    for what, count, entries in (
        ("skipped (corrupt)", meta.get("skipped_count", 0), meta.get("skipped") or []),
        ("ignored", meta.get("ignored_files", 0) + meta.get("skipped_dirs", 0), meta.get("ignored") or []),
    ):
        if not count:
            continue
        lines.append(f"{what}: {count}")
        lines += [f"  {shown(e['path'])}: {shown(e['reason'])}" for e in entries[:SHOWN]]
        if count > min(len(entries), SHOWN):
            lines.append(f"  ... and {count - min(len(entries), SHOWN)} more (meta.{what.split()[0]} in the manifest)")
    return "".join("\n" + line for line in lines)


# ------------------------------------------------------------------ pyg


def _add_pyg(kinds: argparse._SubParsersAction) -> None:
    from ..convert.pyg import DEFAULT_FIELD

    p = kinds.add_parser(
        "pyg",
        help="one sample per graph of a PyTorch Geometric dataset",
        description=(
            "Write one sample per graph: key = graph number (000000042), field graph.pyg (the graph's tensors "
            "with exact dtypes and its attributes, safetensors + JSON, no pickle), plus a sizes index "
            "(num_nodes, num_edges) for batching by a node budget. DATASET is 'module:callable', called with "
            "--kwargs and --root: a PyG dataset class (torch_geometric.datasets:TUDataset --root data/TU "
            "--kwargs '{\"name\": \"MUTAG\"}'), or a function returning a dataset, a list or a generator of "
            "graphs. An indexable dataset is converted by --workers processes, each taking its own graphs; a "
            "generator is encoded and written by this process alone."
        ),
    )
    p.add_argument("dataset", metavar="DATASET", help="importable 'module:callable' (or 'module:object')")
    p.add_argument("dst", metavar="DST", help="destination folder (local or fsspec URL)")
    p.add_argument("--root", metavar="DIR", help="passed as root= (the dataset's folder)")
    p.add_argument(
        "--kwargs", metavar="JSON", default="{}", help='keyword arguments as a JSON object, e.g. \'{"name": "MUTAG"}\''
    )
    p.add_argument("--field", default=DEFAULT_FIELD, help=f"the graph's field name, ending in .pyg (default {DEFAULT_FIELD})")
    add_order_options(p, "graphs in a seeded random order (a generator's through a window of one shard's graphs)",
                      "graph 0, 1, 2, ... as the dataset holds them")
    add_shard_options(p)
    p.set_defaults(func=_pyg)


def _parse_kwargs(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--kwargs is not valid JSON: {e}") from e
    if not isinstance(value, dict):
        raise ValueError(f"--kwargs must be a JSON object, got {type(value).__name__}")
    return value


def _pyg(args: argparse.Namespace) -> int:
    from ..convert.pyg import DatasetSpec, check_graph_field, convert_graphs, is_indexable

    spec = DatasetSpec(args.dataset, _parse_kwargs(args.kwargs), args.root)
    field_name = check_graph_field(args.field)  # before building the dataset (which may download)
    options = options_from_args(args)
    dataset = spec.open()
    return run_converter(
        lambda update, client: convert_graphs(
            dataset, args.dst, spec=spec, field=field_name, options=options, progress=update, client=client,
            order=args.order, seed=args.seed,
        ),
        lambda m, s: f"{m.num_samples} graphs of {shown(spec.describe())} -> {counted(len(m.shards), 'shard')} in {shown(args.dst)}",
        args=args,
        desc="graphs",
        unit="graph",
        total=len(dataset) if is_indexable(dataset) else None,
    )


# ------------------------------------------------------------------ arrays


def _add_arrays(kinds: argparse._SubParsersAction) -> None:
    from ..convert.records.arrays import IMAGE_FORMATS

    p = kinds.add_parser(
        "arrays",
        help="one sample per row of a .npy, .npz or HDF5 array",
        description=(
            "Write one sample per row of an array: key = row number (000000042), field npy (exact dtype and "
            "shape) or png/jpg with --as, plus cls (integer labels) or label.npy from --labels. Rows are read "
            "chunk by chunk by each worker, so memory stays near one chunk whatever the array size. Without "
            "--max-count a shard holds 10,000 rows or about 1 GiB of row data, whichever is fewer rows."
        ),
    )
    p.add_argument("src", metavar="SRC", help="a .npy, .npz or HDF5 file; FILE:NAME picks an .npz member or HDF5 dataset")
    p.add_argument("dst", metavar="DST", help="destination folder (local or fsspec URL)")
    p.add_argument("--array", metavar="NAME", help="the .npz member or HDF5 dataset (when SRC holds several)")
    p.add_argument("--labels", metavar="PATH_OR_NAME", help="labels: a file (FILE or FILE:NAME) or an array name inside SRC")
    p.add_argument("--as", dest="as_image", choices=IMAGE_FORMATS, help="store uint8 (H, W[, 3]) rows as images")
    p.add_argument("--chunk-rows", type=int, metavar="N", help="rows a worker reads at once (default: 32 MiB of rows shared by the workers)")
    add_order_options(p, "rows in a seeded random order (read by random access)", "row 0, 1, 2, ...")
    add_shard_options(p, max_count=None)
    p.set_defaults(max_count=None, func=_arrays)


def _arrays(args: argparse.Namespace) -> int:
    from ..convert.records.arrays import convert_arrays, default_max_count, inspect_array

    spec = inspect_array(args.src, args.array)
    options = options_from_args(args, max_count=args.max_count or default_max_count(spec))
    return run_converter(
        lambda update, client: convert_arrays(
            args.src,
            args.dst,
            array=args.array,
            labels=args.labels,
            as_image=args.as_image,
            chunk_rows=args.chunk_rows,
            options=options,
            progress=update,
            client=client,
            order=args.order,
            seed=args.seed,
        ),
        lambda m, s: f"{m.num_samples} rows of {shown(spec.describe())} -> {counted(len(m.shards), 'shard')} in {shown(args.dst)}",
        args=args,
        desc="rows",
        unit="row",
        total=spec.rows,
    )


# ------------------------------------------------------------------ lines


def _add_lines(kinds: argparse._SubParsersAction) -> None:
    p = kinds.add_parser(
        "lines",
        help="one sample per line of a text or JSON-lines file (plain, gzip or zstd)",
        description=(
            "Write one sample per line: key line-000000042 (1-based line number), field txt (the line) or json "
            "(JSON lines, each line checked). Empty lines are kept as empty txt samples; in JSON lines they are "
            "skipped. The file is read as a stream; gzip and zstd are found by magic bytes."
        ),
    )
    p.add_argument("src", metavar="SRC", help="text or JSON-lines file, local or fsspec URL")
    p.add_argument("dst", metavar="DST", help="destination folder (local or fsspec URL)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--jsonl", dest="json_lines", action="store_true", default=None, help="JSON lines: field json")
    mode.add_argument("--text", dest="json_lines", action="store_false", help="plain text: field txt")
    add_order_options(p, "lines through a seeded window shuffle (a line moves less than --window positions); "
                      "the default for JSON lines", "the file's order; the default for text", default=None,
                      window="lines the window shuffle holds at most")
    add_shard_options(p)
    p.set_defaults(json_lines=None, func=_lines)


def _lines(args: argparse.Namespace) -> int:
    from ..convert.records.lines import convert_lines

    options = options_from_args(args)
    return run_converter(
        lambda update, client: convert_lines(
            args.src, args.dst, json_lines=args.json_lines, options=options, progress=update, client=client,
            order=args.order, seed=args.seed, window=args.window,
        ),
        lambda m, s: (
            f"{m.num_samples} samples from {m.meta.get('lines')} lines of {shown(args.src)} -> "
            f"{counted(len(m.shards), 'shard')} in {shown(args.dst)}"
        ),
        args=args,
        desc="lines",
        unit="line",
    )
