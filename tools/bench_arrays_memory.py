"""Peak memory of ``convert arrays`` on a source much larger than one chunk.

Writes an array of ``--chunks`` x ``--chunk-rows`` rows (64 x 64 x 3 uint8 by
default, so 20 chunks of 2,000 rows = 491 MB) as ``.npy``, uncompressed ``.npz``
and HDF5, converts each in a fresh subprocess, and reports the peak resident
set size above the process's size just before converting, in units of one chunk
(``chunk_rows x row bytes``). The claim checked: peak memory stays within 2x of
one chunk, whatever the source size.

- ``workers=1``: the conversion runs in the measuring process (its ``VmHWM``).
- ``workers=2``: shards are written by forked worker processes; reported is the
  largest worker's peak (``RUSAGE_CHILDREN``) above the smallest size a worker
  had right after fork (recorded by an ``os.register_at_fork`` hook), and the
  parent's own growth.

The source files are written by another subprocess, so that no measured
process inherits a high-water mark from the one that touched the whole array.

Usage::

    python tools/bench_arrays_memory.py [--chunks 20] [--chunk-rows 2000] [--dir /tmp/x] [--order walk|shuffled]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

import numpy as np


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _hwm_bytes() -> int:
    """This process's peak resident set size (``VmHWM``; unlike ``ru_maxrss`` it starts afresh at exec)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def child(src: str, dst: str, chunk_rows: int, max_count: int, workers: int, order: str) -> None:
    """Run one conversion and print its memory figures as JSON."""
    import h5py  # noqa: F401 - imported before the start figure: a fixed cost, not data

    from shardflow.convert.records.arrays import convert_arrays
    from shardflow.convert.engine.engine import ConvertOptions

    marks = dst + ".fork-rss"
    os.makedirs(marks, exist_ok=True)

    def mark_fork() -> None:  # runs in each worker right after fork: its starting size
        with open(os.path.join(marks, str(os.getpid())), "w") as f:
            f.write(str(_rss_bytes()))

    os.register_at_fork(after_in_child=mark_fork)
    base = _rss_bytes()
    t = time.perf_counter()
    m = convert_arrays(src, dst, chunk_rows=chunk_rows, options=ConvertOptions(max_count=max_count, workers=workers),
                       order=order)
    seconds = time.perf_counter() - t
    self_peak = _hwm_bytes()
    child_peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    starts = [int(open(os.path.join(marks, n)).read()) for n in os.listdir(marks)]
    child_base = min(starts) if starts else 0
    print(json.dumps({"base": base, "self_peak": self_peak, "child_peak": child_peak, "child_base": child_base,
                      "seconds": seconds,
                      "rows": m.num_samples, "shards": len(m.shards)}))


ROW_SHAPE = (64, 64, 3)


def make(work: str, rows: int, block: int) -> None:
    """Write x.npy, x.npz (stored member) and x.h5 holding the same random uint8 rows."""
    import h5py

    rng = np.random.default_rng(0)
    # written block by block, so no process ever holds the whole array
    npy = os.path.join(work, "x.npy")
    out = np.lib.format.open_memmap(npy, mode="w+", dtype=np.uint8, shape=(rows, *ROW_SHAPE))
    for a in range(0, rows, block):
        out[a : a + block] = rng.integers(0, 256, size=(min(block, rows - a), *ROW_SHAPE), dtype=np.uint8)
    out.flush()
    del out
    src = np.load(npy, mmap_mode="r")
    with h5py.File(os.path.join(work, "x.h5"), "w") as f:
        d = f.create_dataset("x", shape=src.shape, dtype=np.uint8, chunks=(64, *ROW_SHAPE))
        for a in range(0, rows, block):
            d[a : a + block] = src[a : a + block]
    np.savez(os.path.join(work, "x.npz"), x=src)  # a stored (uncompressed) member


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--chunks", type=int, default=20, help="source size in chunks (default 20)")
    p.add_argument("--chunk-rows", type=int, default=2000)
    p.add_argument("--max-count", type=int, default=10_000, help="rows per shard")
    p.add_argument("--dir", default=None, help="work folder (default: a temporary one)")
    p.add_argument("--order", choices=["shuffled", "walk"], default="shuffled", help="the rows' order (default shuffled)")
    p.add_argument("--child", nargs=6, help=argparse.SUPPRESS)
    p.add_argument("--make", nargs=3, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        src, dst, cr, mc, w, order = args.child
        child(src, dst, int(cr), int(mc), int(w), order)
        return
    if args.make:
        make(args.make[0], int(args.make[1]), int(args.make[2]))
        return

    work = args.dir or tempfile.mkdtemp(prefix="bench-arrays-")
    os.makedirs(work, exist_ok=True)
    rows = args.chunks * args.chunk_rows
    row_bytes = int(np.prod(ROW_SHAPE))
    chunk_bytes = args.chunk_rows * row_bytes
    subprocess.run([sys.executable, __file__, "--make", work, str(rows), str(args.chunk_rows)], check=True)
    npy, npz, h5 = (os.path.join(work, n) for n in ("x.npy", "x.npz", "x.h5"))
    print(f"source: {rows} rows x {ROW_SHAPE} uint8 = {rows * row_bytes / 2**20:.0f} MiB; "
          f"chunk: {args.chunk_rows} rows = {chunk_bytes / 2**20:.1f} MiB; shards of {args.max_count} rows; "
          f"order {args.order}\n")
    print("| source | workers | rows | seconds | peak above start (MiB) | peak / chunk |")
    print("|---|---|---|---|---|---|")
    for name, src in (("npy", npy), ("npz (stored)", npz + ":x"), ("hdf5", h5 + ":x")):
        for workers in (1, 2):
            dst = os.path.join(work, f"out-{name.split()[0]}-{workers}")
            res = subprocess.run(
                [sys.executable, __file__, "--child", src, dst, str(args.chunk_rows), str(args.max_count), str(workers),
                 args.order],
                check=True, capture_output=True, text=True,
            )
            r = json.loads(res.stdout.strip().splitlines()[-1])
            if r["rows"] != rows:
                raise SystemExit(f"{name}: wrote {r['rows']} rows, expected {rows}")
            if workers == 1:
                grow = r["self_peak"] - r["base"]
                cell = f"{grow / 2**20:.1f}"
            else:
                grow = r["child_peak"] - r["child_base"]
                parent = r["self_peak"] - r["base"]
                cell = f"{grow / 2**20:.1f} per worker (parent +{parent / 2**20:.1f})"
            print(f"| {name} | {workers} | {r['rows']} | {r['seconds']:.1f} | {cell} | {grow / chunk_bytes:.2f} |")
    print(f"\nfor comparison, np.load of the whole array holds {rows * row_bytes / 2**20:.0f} MiB "
          f"({rows * row_bytes / chunk_bytes:.0f} chunks); work folder: {work}")


if __name__ == "__main__":
    main()
