"""``shardflow index URLS``: write a manifest for existing shards."""

from __future__ import annotations

import argparse
import os
import sys
import time

from ..indexing import index_shards
from ..urls import SHARD_SUFFIXES, expand_urls
from .progress import progress_bar


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
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    urls = []
    for pattern in args.urls:
        if os.path.isdir(pattern):  # a local folder: its shards, sorted
            found = sorted(e.path for e in os.scandir(pattern) if e.is_file() and e.name.endswith(SHARD_SUFFIXES))
            if not found:
                raise FileNotFoundError(f"{pattern}: no .tar shards in this folder")
            urls.extend(found)
        else:
            urls.extend(expand_urls(pattern))
    t0 = time.perf_counter()
    with progress_bar("index", total=len(urls), unit="shard") as update:
        m = index_shards(urls, out=args.out, workers=args.workers, progress=update)
    dt = time.perf_counter() - t0
    print(
        f"indexed {len(m.shards)} shards, {m.num_samples} samples, "
        f"{sum(s.bytes for s in m.shards) / 1e6:.1f} MB in {dt:.1f} s -> {m.url}",
        file=sys.stdout,
    )
    return 0
