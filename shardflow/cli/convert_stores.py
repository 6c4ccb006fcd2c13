"""``shardflow convert parquet`` and ``shardflow convert lmdb``: the stores datasets come in.

Argument parsing only; the converters are :mod:`shardflow.convert.records.parquet` and
:mod:`shardflow.convert.records.lmdb`.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from .convert_common import add_order_options, add_shard_options, options_from_args, rate, run_converter
from .options import storage_options
from .shown import shown
from .units import counted

__all__ = ["add_parquet", "add_lmdb"]


def add_parquet(kinds: argparse._SubParsersAction) -> None:
    """Register ``convert parquet``."""
    p = kinds.add_parser(
        "parquet",
        help="one sample per row of Parquet files (a Hugging Face dataset: data/train-*.parquet)",
        description=(
            "Write one sample per row, in a seeded random order by default (--order): key = row number over the "
            "files in order (000000042). Image columns "
            "(Hugging Face Image structs) keep their bytes under their real format (jpg, png, webp, ...), "
            "integers become cls, strings txt, other columns <column>.json; --columns picks and renames. "
            "ClassLabel names from the files' Hugging Face metadata go into the manifest (class_to_idx). "
            "Workers read row group by row group in small batches; hf:// URLs need shardflow[hf]."
        ),
    )
    p.add_argument("src", metavar="SRC", help="a .parquet file, a folder of them, or a glob ('data/train-*.parquet'); "
                   "local or fsspec URL")  # fmt: skip
    p.add_argument("dst", metavar="DST", help="destination folder (local or fsspec URL)")
    p.add_argument(
        "--columns", metavar="COL[:FIELD],...",
        help="columns to convert, in order, optionally renamed: image:jpg,label:cls (default: all)",
    )  # fmt: skip
    p.add_argument(
        "--merge-configs", action="store_true",
        help="convert the files of several Hugging Face configs (data/, extra/, ...) into one dataset "
        "(default: refused; give one config's folder)",
    )  # fmt: skip
    p.add_argument(
        "--images-root", metavar="DIR",
        help="read images that the files reference by path (datasets' to_parquet() of local images) from "
        "this folder; a relative path is relative to its Parquet file, and a path out of DIR is an error",
    )  # fmt: skip
    add_order_options(p, "row groups in a seeded random order, then each shard's rows (a worker holds one shard's "
                      "rows)", "the rows of the files in order")
    add_shard_options(p)
    p.set_defaults(func=_parquet)


def _parquet(args: argparse.Namespace) -> int:
    from ..convert.records.parquet import convert_parquet, count_rows

    options = options_from_args(args)
    total = (count_rows(args.src, storage_options(args.storage_option), merge_configs=args.merge_configs)
             if sys.stderr.isatty() else None)  # fmt: skip

    def summary(m: Any, seconds: float) -> str:
        classes = m.meta.get("class_to_idx")
        named = f", {counted(len(classes), 'class', 'classes')}" if classes else ""
        files = len(m.meta.get("files", []))
        return (f"{counted(m.num_samples, 'row')} of {counted(files, 'file')}{named} -> "
                f"{counted(len(m.shards), 'shard')} {rate(m.num_samples, seconds, 'rows')} in {shown(args.dst)}")  # fmt: skip

    return run_converter(
        lambda update, client: convert_parquet(
            args.src, args.dst, columns=args.columns, options=options, progress=update, client=client,
            merge_configs=args.merge_configs, images_root=args.images_root, order=args.order, seed=args.seed,
        ),
        summary,
        args=args,
        desc="rows",
        unit="row",
        total=total,
    )


def add_lmdb(kinds: argparse._SubParsersAction) -> None:
    """Register ``convert lmdb``."""
    p = kinds.add_parser(
        "lmdb",
        help="one sample per key of an LMDB database, the value's bytes unchanged",
        description=(
            "Write one sample per key, in a seeded random order of the keys (or key order: --order walk): the key made tar-safe by %%XX escapes (reversible; "
            "the count is in the manifest), the value's bytes unchanged in one field named from its magic "
            "bytes (jpg, png, webp, gif, tif, bmp, npy) or --field. The database is opened read-only "
            "without its lock file. Pickled values are refused unless --allow-pickle (then stored "
            "unchanged, never unpickled, under --field or 'pickle')."
        ),
    )
    p.add_argument("src", metavar="SRC", help="the LMDB environment: a folder holding data.mdb, or the data file")
    p.add_argument("dst", metavar="DST", help="destination folder (local or fsspec URL)")
    p.add_argument("--field", help="the field of every value, e.g. bin (default: from each value's magic bytes)")
    p.add_argument("--allow-pickle", action="store_true",
                   help="store pickled values (unchanged, never unpickled) instead of refusing them")  # fmt: skip
    add_order_options(p, "keys in a seeded random order (all keys listed first, each value looked up)",
                      "key order, one cursor per shard")
    add_shard_options(p)
    p.set_defaults(func=_lmdb)


def _lmdb(args: argparse.Namespace) -> int:
    from ..convert.records.lmdb import convert_lmdb, count_entries

    options = options_from_args(args)
    total = count_entries(args.src) if sys.stderr.isatty() else None

    def summary(m: Any, seconds: float) -> str:
        changed = m.meta.get("keys", {}).get("changed", 0)
        note = f" ({counted(changed, 'key')} escaped, see meta.keys)" if changed else ""
        return (f"{counted(m.num_samples, 'key')} of {shown(args.src)} -> {counted(len(m.shards), 'shard')} "
                f"{rate(m.num_samples, seconds, 'keys')} in {shown(args.dst)}{note}")  # fmt: skip

    return run_converter(
        lambda update, client: convert_lmdb(
            args.src, args.dst, field=args.field, allow_pickle=args.allow_pickle, options=options,
            progress=update, client=client, order=args.order, seed=args.seed,
        ),
        summary,
        args=args,
        desc="keys",
        unit="key",
        total=total,
    )
