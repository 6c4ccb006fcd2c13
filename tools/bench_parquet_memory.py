#!/usr/bin/env python3
"""Peak RSS growth of ``convert parquet`` against the files' row-group size (docs/getting-data-in.md).

    python tools/bench_parquet_memory.py [--rows 3000] [--value-kb 100] [--row-groups 100 3000]
        [--orders walk shuffled]

Writes one uncompressed Parquet file per row-group size (the same rows: an image struct of
``--value-kb`` KB and a label), converts each with one worker in a fresh process, in each of
``--orders`` (shards of 1,000 rows), and prints the peak RSS growth of that process over its RSS
before the conversion (sampled every 10 ms).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np
import psutil
import pyarrow as pa
import pyarrow.parquet as pq

from shardflow.convert.engine.engine import ConvertOptions
from shardflow.convert.records.parquet import convert_parquet


def peak_growth(fn) -> tuple[float, float]:
    """``(peak RSS growth in MiB, seconds)`` of ``fn()``."""
    proc = psutil.Process()
    base = peak = proc.memory_info().rss
    done = threading.Event()

    def watch() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, proc.memory_info().rss)
            time.sleep(0.01)

    t = threading.Thread(target=watch)
    t.start()
    start = time.perf_counter()
    try:
        fn()
    finally:
        done.set()
        t.join()
    return (peak - base) / 2**20, time.perf_counter() - start


def convert_one(src: str, dst: str, order: str) -> None:
    growth, seconds = peak_growth(
        lambda: convert_parquet(src, dst, options=ConvertOptions(max_count=1000, workers=1), order=order))
    print(f"RSS growth {growth:.0f} MiB, {seconds:.1f} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--rows", type=int, default=3000)
    ap.add_argument("--value-kb", type=int, default=100)
    ap.add_argument("--row-groups", type=int, nargs="+", default=[100, 3000])
    ap.add_argument("--orders", nargs="+", default=["walk", "shuffled"], choices=["walk", "shuffled"])
    ap.add_argument("--convert", nargs=3, metavar=("SRC", "DST", "ORDER"), help=argparse.SUPPRESS)  # the child's job
    args = ap.parse_args()
    if args.convert:
        convert_one(*args.convert)
        return
    work = tempfile.mkdtemp(prefix="shardflow-pq-")
    try:
        rng = np.random.default_rng(0)
        images = pa.array([{"bytes": b"\xff\xd8\xff\xe0" + rng.bytes(args.value_kb * 1000), "path": str(i)}
                           for i in range(args.rows)],
                          pa.struct([("bytes", pa.binary()), ("path", pa.string())]))  # fmt: skip
        table = pa.table({"image": images, "label": pa.array(np.arange(args.rows) % 10)})
        for size in args.row_groups:
            pq.write_table(table, os.path.join(work, f"rg{size}.parquet"), row_group_size=size, compression="none")
        del images, table
        for size in args.row_groups:
            src = os.path.join(work, f"rg{size}.parquet")
            for order in args.orders:
                out = subprocess.run([sys.executable, __file__, "--convert", src, os.path.join(work, f"out{size}{order}"),
                                      order], capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
                print(f"row groups of {size:>6} rows, {order:>8}: file {os.path.getsize(src) / 2**20:.0f} MiB, {out}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
