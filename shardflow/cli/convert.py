"""``shardflow convert KIND SRC DST``: one sub-command per converter.

Each converter module ``shardflow.convert.<kind>`` exposes
``register_cli(subparsers)``, which adds its sub-command and handler.
"""

from __future__ import annotations

import argparse
import importlib
from typing import Any

KINDS = ("imagefolder", "pyg", "arrays", "lines")


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("convert", help="convert an image folder, a PyG dataset, arrays or text lines into shards")
    kinds = parser.add_subparsers(dest="kind", metavar="KIND")
    kinds.required = True
    for kind in KINDS:
        try:
            module = importlib.import_module(f"shardflow.convert.{kind}")
        except ModuleNotFoundError as e:
            if e.name != f"shardflow.convert.{kind}":
                raise
            continue
        module.register_cli(kinds)


def add_shard_options(parser: argparse.ArgumentParser, *, max_count: int | None = 10_000) -> None:
    """Options every converter shares: shard size, workers, resume, storage.

    ``max_count=None`` lets the converter choose the shard size (its help says how).
    """
    default = f"default {max_count}" if max_count is not None else "default: chosen by the converter"
    parser.add_argument("--max-count", type=int, default=max_count, help=f"samples per shard ({default})")
    parser.add_argument("--prefix", default="train", help="shard name prefix: PREFIX-000000.tar (default train)")
    parser.add_argument("--workers", type=int, default=None, help="writer processes (default: number of CPUs)")
    parser.add_argument("--no-resume", action="store_true", help="rewrite every shard instead of keeping finished ones")
    parser.add_argument(
        "--storage-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="fsspec storage option for a remote DST (repeatable)",
    )


def report(line: str) -> int:
    """Print a converter's one-line summary (the CLI's output) and return exit status 0."""
    print(line)
    return 0


def storage_options(pairs: list[str]) -> dict[str, str]:
    """Parse repeated ``KEY=VALUE`` options."""
    out = {}
    for p in pairs:
        k, sep, v = p.partition("=")
        if not sep:
            raise ValueError(f"--storage-option needs KEY=VALUE, got {p!r}")
        out[k] = v
    return out


def options_from_args(args: argparse.Namespace, *, max_count: int | None = None) -> Any:
    """The :class:`~shardflow.convert.engine.ConvertOptions` of the shared shard options.

    ``max_count`` overrides ``--max-count`` (a converter that picks the shard size itself).
    """
    from ..convert.engine import ConvertOptions

    return ConvertOptions(
        max_count=max_count if max_count is not None else args.max_count,
        prefix=args.prefix,
        workers=args.workers,
        resume=not args.no_resume,
        storage_options=storage_options(args.storage_option),
    )
