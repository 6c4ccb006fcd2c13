"""Random reads and epoch time on the same data, four ways.

Data: ``--rows`` samples of 64 x 64 x 3 uint8 plus an int label (20,000 rows =
234 MiB by default), stored three ways in one folder on the same disk:

- ``x.npy`` / ``y.npy``: the whole arrays (what users start from);
- ``files/000000042.npy``: one ``.npy`` file per sample;
- ``shards/``: ``convert_arrays`` output (field ``npy`` + ``cls``, offset indexes).

Random reads (one process, the same ``--reads`` random indices for both):
``IndexedShardDataset[i]["npy"]`` against ``np.load(files/<i>.npy)`` (decoded
arrays), and ``IndexedShardDataset.read_raw(i)`` against reading the file's
bytes (I/O and tar parsing without the ``.npy`` decoding both share), with the
files in the page cache ("warm") and after evicting them from it with
``posix_fadvise(POSIX_FADV_DONTNEED)`` ("cold"; a request the kernel may honour
partly, so cold figures are indicative). Each figure is the best of 3 rounds,
the two methods alternating, so load from other processes affects both alike.

Epoch (each in a fresh subprocess, warm page cache, batch 256, shuffled,
``--workers`` DataLoader workers): the ``ShardDataset`` stream through
``shardflow.loader``; the map-style ``IndexedShardDataset`` with a
``RandomSampler``; and ``np.load`` of the whole array followed by a
``TensorDataset`` + ``DataLoader`` (load time counted separately). Peak RSS
(``VmHWM``) is reported for each.

Usage::

    python tools/bench_indexed.py [--rows 20000] [--reads 5000] [--workers 0 2] [--dir /tmp/x]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

ROW_SHAPE = (64, 64, 3)
BATCH = 256


def _hwm_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _evict(paths: list[str]) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def setup(work: str, rows: int) -> None:
    from shardflow.convert.records.arrays import convert_arrays
    from shardflow.convert.engine.engine import ConvertOptions

    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, size=(rows, *ROW_SHAPE), dtype=np.uint8)
    y = rng.integers(0, 1000, size=rows, dtype=np.int64)
    np.save(os.path.join(work, "x.npy"), x)
    np.save(os.path.join(work, "y.npy"), y)
    files = os.path.join(work, "files")
    os.makedirs(files, exist_ok=True)
    for i in range(rows):
        np.save(os.path.join(files, f"{i:09d}.npy"), x[i])
    convert_arrays(os.path.join(work, "x.npy"), os.path.join(work, "shards"), labels=os.path.join(work, "y.npy"),
                   options=ConvertOptions(max_count=2000, workers=2))


def random_reads(work: str, rows: int, reads: int, rounds: int = 3) -> dict[str, float]:
    import shardflow

    idx = np.random.default_rng(1).integers(0, rows, size=reads).tolist()
    files = [os.path.join(work, "files", f"{i:09d}.npy") for i in range(rows)]
    shard_dir = os.path.join(work, "shards")
    shard_files = [os.path.join(shard_dir, n) for n in os.listdir(shard_dir)]
    x = np.load(os.path.join(work, "x.npy"), mmap_mode="r")
    out: dict[str, float] = {}
    ds = shardflow.IndexedShardDataset(shard_dir, decode="numpy")

    def read_file(path: str) -> bytes:
        with open(path, "rb") as f:
            return f.read()

    ways = {
        # (what, IndexedShardDataset, one file per sample)
        "bytes": (lambda i: ds.read_raw(i)["npy"], lambda i: read_file(files[i])),
        "array": (lambda i: ds[i]["npy"], lambda i: np.load(files[i])),
    }
    for cache in ("warm", "cold"):
        for what, (indexed, per_file) in ways.items():
            for rnd in range(rounds):  # alternate the order; keep each method's best round
                pair = (("indexed", indexed), ("files", per_file))
                for name, fn in pair if rnd % 2 == 0 else pair[::-1]:
                    if cache == "cold":
                        _evict(files + shard_files)
                    ds.close()
                    t = time.perf_counter()
                    for i in idx:
                        fn(i)
                    rate = reads / (time.perf_counter() - t)
                    key = f"{name}_{what}_{cache}"
                    out[key] = max(out.get(key, 0.0), rate)
    for i in idx[:200]:  # the two give the same rows
        if not (np.array_equal(ds[i]["npy"], x[i]) and np.array_equal(np.load(files[i]), x[i])):
            raise SystemExit(f"row {i} differs")
    return out


def epoch(work: str, kind: str, workers: int) -> dict[str, float]:
    """One shuffled epoch of batches of 256; runs in its own process."""
    import torch
    from torch.utils.data import DataLoader, RandomSampler, TensorDataset

    import shardflow

    shard_dir = os.path.join(work, "shards")
    load = 0.0
    if kind == "stream":
        ds = shardflow.ShardDataset(shard_dir, shuffle=True, seed=0, decode="numpy")
        dl = shardflow.loader(ds, batch_size=BATCH, num_workers=workers)
        get = lambda b: (b["npy"], b["cls"])  # noqa: E731
    elif kind == "indexed":
        ids = shardflow.IndexedShardDataset(shard_dir, decode="numpy", transform=_xy)
        dl = DataLoader(ids, batch_size=BATCH, sampler=RandomSampler(ids, generator=torch.Generator().manual_seed(0)),
                        num_workers=workers)
        get = lambda b: b  # noqa: E731
    else:
        t = time.perf_counter()
        x = torch.from_numpy(np.load(os.path.join(work, "x.npy")))
        y = torch.from_numpy(np.load(os.path.join(work, "y.npy")))
        load = time.perf_counter() - t
        dl = DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=True, num_workers=workers,
                        generator=torch.Generator().manual_seed(0))
        get = lambda b: b  # noqa: E731
    t = time.perf_counter()
    n = 0
    total = 0
    for batch in dl:
        xb, yb = get(batch)
        n += len(yb)
        total += int(yb.sum())
    return {"load": load, "epoch": time.perf_counter() - t, "samples": n, "label_sum": total, "peak_mib": _hwm_mib()}


def _xy(sample):
    """IndexedShardDataset transform: (image array, label) (module level: picklable)."""
    return sample["npy"], sample["cls"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=20_000)
    p.add_argument("--reads", type=int, default=5000)
    p.add_argument("--workers", type=int, nargs="+", default=[0, 2], help="DataLoader workers for the epochs")
    p.add_argument("--dir", default=None, help="work folder (default: a temporary one)")
    p.add_argument("--epoch", nargs=3, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.epoch:
        print(json.dumps(epoch(args.epoch[0], args.epoch[1], int(args.epoch[2]))))
        return
    work = args.dir or tempfile.mkdtemp(prefix="bench-indexed-")
    os.makedirs(work, exist_ok=True)
    t = time.perf_counter()
    setup(work, args.rows)
    mib = args.rows * int(np.prod(ROW_SHAPE)) / 2**20
    print(f"{args.rows} samples of {ROW_SHAPE} uint8 ({mib:.0f} MiB) in {work}; setup {time.perf_counter() - t:.1f} s\n")

    r = random_reads(work, args.rows, args.reads)
    print(f"### Random reads ({args.reads} random indices, one process, best of 3 alternating rounds)\n")
    print("| page cache | result | IndexedShardDataset (reads/s) | one .npy per sample (reads/s) | ratio |")
    print("|---|---|---|---|---|")
    for cache in ("warm", "cold"):
        for what, label in (("bytes", "raw bytes"), ("array", "decoded array")):
            a, b = r[f"indexed_{what}_{cache}"], r[f"files_{what}_{cache}"]
            print(f"| {cache} | {label} | {a:,.0f} | {b:,.0f} | {a / b:.2f}x |")

    print(f"\n### One shuffled epoch, batch {BATCH} (fresh process each, warm page cache, best of 2)\n")
    print("| workers | method | load (s) | epoch (s) | load + epoch vs TensorDataset | peak RSS (MiB) |")
    print("|---|---|---|---|---|---|")
    labels = int(np.load(os.path.join(work, "y.npy")).sum())
    for workers in args.workers:
        res: dict[str, dict[str, float]] = {}
        for _ in range(2):  # two rounds, the best (shortest load + epoch) kept per method
            for kind in ("tensor", "stream", "indexed"):
                out = subprocess.run([sys.executable, __file__, "--epoch", work, kind, str(workers)],
                                     check=True, capture_output=True, text=True)
                r = json.loads(out.stdout.strip().splitlines()[-1])
                if r["samples"] != args.rows or r["label_sum"] != labels:
                    raise SystemExit(f"{kind}: epoch saw {r['samples']} samples, label sum {r['label_sum']}")
                if kind not in res or r["load"] + r["epoch"] < res[kind]["load"] + res[kind]["epoch"]:
                    res[kind] = r
        base = res["tensor"]["load"] + res["tensor"]["epoch"]
        names = {"tensor": "np.load + TensorDataset", "stream": "ShardDataset stream", "indexed": "IndexedShardDataset + RandomSampler"}
        for kind in ("tensor", "stream", "indexed"):
            x = res[kind]
            total = x["load"] + x["epoch"]
            print(f"| {workers} | {names[kind]} | {x['load']:.2f} | {x['epoch']:.2f} | {total / base:.2f}x | {x['peak_mib']:.0f} |")


if __name__ == "__main__":
    main()
