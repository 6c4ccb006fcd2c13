"""``shardflow index URLS``: write a manifest for existing shards."""

from __future__ import annotations

import argparse
import os
import sys
import time

from ..writing.indexing import index_shards
from ..storage import IOOptions, expand_urls, is_dir, list_glob
from ..storage.urls import SHARD_SUFFIXES, join_url
from .options import add_io_arguments, io_options
from .progress import progress_bar
from .units import counted, human_bytes


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "index",
        help="write shardflow.json (counts, bytes, sha256, offsets) for existing shards",
        description="Scan tar shards (webdataset's or anyone's) and write a manifest with sample counts, "
        "sizes, SHA-256 and offset indexes, so they get exact rank splits, seeking and random access.",
    )
    p.add_argument("urls", nargs="+", help="shard URLs, brace patterns or globs (local or fsspec)")
    p.add_argument("--out", help="folder for shardflow.json and the offset indexes (default: the shards' folder)")
    p.add_argument("--workers", type=int, default=4, help="shards scanned at once (default 4)")
    p.add_argument("--force", action="store_true",
                   help="replace an existing shardflow.json that lists shards this run does not index")
    add_io_arguments(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    io = io_options(args)
    urls = []
    for pattern in args.urls:
        if os.path.isdir(pattern):  # a local folder: its shards, sorted
            found = sorted(e.path for e in os.scandir(pattern) if e.is_file() and e.name.endswith(SHARD_SUFFIXES))
        elif "://" in pattern and not pattern.endswith(SHARD_SUFFIXES) and is_dir(pattern, io):  # a bucket folder
            found = [u for u in list_glob(join_url(pattern, "*"), io) if u.endswith(SHARD_SUFFIXES)]
        elif pattern.rstrip("/").endswith(".json"):
            raise ValueError(
                f"{pattern}: this is a manifest, not a shard; `shardflow index` reads shards and writes the "
                "manifest: give the shards' folder, a pattern or the shard URLs"
            )
        else:
            urls.extend(expand_urls(pattern, io.storage_options))
            continue
        if not found:
            raise FileNotFoundError(f"{pattern}: no .tar shards in this folder")
        urls.extend(found)
    _check_existing(urls, args.out, args.force, io)
    t0 = time.perf_counter()
    with progress_bar("index", total=len(urls), unit="shard") as update:
        m = index_shards(urls, out=args.out, workers=args.workers, progress=update, io=io)
    dt = time.perf_counter() - t0
    print(
        f"indexed {counted(len(m.shards), 'shard')}, {counted(m.num_samples, 'sample')}, "
        f"{human_bytes(sum(s.bytes for s in m.shards))} in {dt:.1f} s -> {m.url}",
        file=sys.stdout,
    )
    return 0


def _check_existing(urls: list[str], out: str | None, force: bool, io: IOOptions) -> None:
    """Refuse to replace a manifest that lists shards this run leaves out: their counts,
    and the converter's metadata (``class_to_idx``...), would be lost without a word."""
    from ..format.manifest import MANIFEST_NAME
    from ..sources.source import load_manifest
    from ..storage import exists
    from ..storage.urls import parent_url

    folders = {parent_url(u) for u in urls}
    if force or (out is None and len(folders) != 1):
        return  # (several folders without --out: index_shards says so)
    murl = join_url(out if out is not None else folders.pop(), MANIFEST_NAME)
    if not exists(murl, io):
        return
    old = load_manifest(murl, io)
    names = {u.rstrip("/").rsplit("/", 1)[-1] for u in urls}
    left_out = [s.url for s in old.shards if s.url.rstrip("/").rsplit("/", 1)[-1] not in names]
    if left_out:
        raise FileExistsError(
            f"{murl} lists {counted(len(old.shards), 'shard')}, {len(left_out)} of which this run does not index "
            f"(e.g. {left_out[0]}): replacing it would drop them and its metadata "
            f"({', '.join(sorted(old.meta)) or 'none'}). Index all the shards, write elsewhere with --out, "
            "or pass --force to replace it"
        )
