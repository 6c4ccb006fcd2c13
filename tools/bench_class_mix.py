#!/usr/bin/env python3
"""How mixed are the batches? Distinct classes per batch, shardflow's defaults against a permutation.

Builds an ImageFolder of CLASSES x PER tiny JPEGs (issue 30: 200 x 130, about 7.7 classes per
shard of 1,000), then streams, with the defaults (``ShardDataset(shuffle=True, seed=0)``,
``shardflow.loader``, 2 workers, batch 256), two datasets of the same images:

- ``converted``: ``shardflow convert imagefolder SRC DST --max-count 1000`` (the converter's
  default order);
- ``class-ordered``: webdataset-style shards written by ``tarfile``, the classes one after the
  other, 1,000 samples per shard, then ``shardflow index``.

For each it reports the mean number of distinct classes in a batch, the largest class's mean
share of a batch, and the same for a uniform permutation of the labels (what ``RandomSampler``
or ``DistributedSampler`` give), checks that the epoch holds every sample exactly once, and
shows what ``shardflow inspect DST --batches N --json`` predicted (``batches.mean_distinct``).

Usage::

    PYTHONPATH=$PWD python tools/bench_class_mix.py [--classes 200] [--per 130] [--json]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from collections import Counter

import numpy as np
from PIL import Image


def make_tree(root: str, classes: int, per: int, size: int) -> None:
    """ROOT/class_XXX/NNNNNNN.jpg; a few distinct tiny JPEGs, reused (only the labels matter here)."""
    rng = np.random.default_rng(0)
    blobs = []
    for _ in range(8):
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 255, (size, size, 3), dtype=np.uint8)).save(buf, format="JPEG", quality=90)
        blobs.append(buf.getvalue())
    for c in range(classes):
        d = os.path.join(root, f"class_{c:03d}")
        os.makedirs(d, exist_ok=True)
        for i in range(per):
            with open(os.path.join(d, f"{i:07d}.jpg"), "wb") as f:
                f.write(blobs[(c + i) % len(blobs)])


def write_class_ordered(root: str, dst: str, classes: int, per: int, max_count: int) -> None:
    """Webdataset-style shards, classes one after the other (what users bring), max_count samples each."""
    os.makedirs(dst, exist_ok=True)
    n = 0
    tar = None
    for c in range(classes):
        d = os.path.join(root, f"class_{c:03d}")
        for name in sorted(os.listdir(d)):
            if n % max_count == 0:
                if tar is not None:
                    tar.close()
                tar = tarfile.open(os.path.join(dst, f"train-{n // max_count:06d}.tar"), "w", format=tarfile.USTAR_FORMAT)
            key = f"c{c:03d}_{name.split('.')[0]}"
            with open(os.path.join(d, name), "rb") as f:
                data = f.read()
            for field, payload in (("cls", str(c).encode()), ("jpg", data)):
                info = tarfile.TarInfo(f"{key}.{field}")
                info.size, info.mtime = len(payload), 0
                tar.addfile(info, io.BytesIO(payload))
            n += 1
    if tar is not None:
        tar.close()


def cli(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "shardflow.cli", *args], check=True, stdout=subprocess.DEVNULL)


def mix(batches: list[np.ndarray]) -> dict[str, float]:
    """Mean distinct classes per batch and mean share of the largest class (full batches only)."""
    full = [b for b in batches if len(b) == len(batches[0])]
    distinct = [len(np.unique(b)) for b in full]
    largest = [Counter(b.tolist()).most_common(1)[0][1] / len(b) for b in full]
    return {"mean_distinct": float(np.mean(distinct)), "largest_share": float(np.mean(largest)),
            "worst_distinct": int(np.min(distinct))}


def permutation(labels: np.ndarray, batch: int, seeds: int = 4) -> dict[str, float]:
    """The same figures for uniform permutations of the labels (mean over ``seeds``)."""
    runs = []
    for s in range(seeds):
        p = labels[np.random.default_rng(s).permutation(len(labels))]
        runs.append(mix([p[i : i + batch] for i in range(0, len(p), batch)]))
    return {k: float(np.mean([r[k] for r in runs])) for k in runs[0]}


def inspect_mean(dst: str, batches: int, batch: int) -> float:
    """``shardflow inspect DST --batches N --json``'s ``batches.mean_distinct`` (labels read before training)."""
    out = subprocess.run([sys.executable, "-m", "shardflow.cli", "inspect", dst, "--no-scan", "--json", "--batches",
                          str(batches), "--batch-size", str(batch)], check=True, capture_output=True, text=True)
    return float(json.loads(out.stdout)["batches"]["mean_distinct"])


def stream(dst: str, batch: int, workers: int) -> tuple[list[np.ndarray], int, int]:
    """Batches of labels from the defaults; also (samples yielded, distinct keys)."""
    import shardflow

    ds = shardflow.ShardDataset(dst, shuffle=True, seed=0, decode=None)
    dl = shardflow.loader(ds, batch_size=batch, num_workers=workers)
    out, keys = [], set()
    n = 0
    for b in dl:
        out.append(np.asarray([int(x) for x in b["cls"]]))
        keys.update(b["__key__"])
        n += len(b["__key__"])
    return out, n, len(keys)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--classes", type=int, default=200)
    ap.add_argument("--per", type=int, default=130)
    ap.add_argument("--size", type=int, default=8, help="image side in pixels")
    ap.add_argument("--max-count", type=int, default=1000)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--work", help="folder to build in (default: a temporary one)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = args.work or tmp
        src, conv, wds = (os.path.join(work, x) for x in ("src", "converted", "class-ordered"))
        if not os.path.isdir(src):
            make_tree(src, args.classes, args.per, args.size)
        if not os.path.exists(os.path.join(conv, "shardflow.json")):
            cli("convert", "imagefolder", src, conv, "--max-count", str(args.max_count))
        if not os.path.exists(os.path.join(wds, "shardflow.json")):
            write_class_ordered(src, wds, args.classes, args.per, args.max_count)
            cli("index", wds)
        total = args.classes * args.per
        labels = np.repeat(np.arange(args.classes), args.per)
        perm = permutation(labels, args.batch)
        report = {"samples": total, "batch": args.batch, "workers": args.workers, "permutation": perm}
        for name, dst in (("converted", conv), ("class-ordered", wds)):
            batches, n, unique = stream(dst, args.batch, args.workers)
            got = mix(batches)
            got["ratio"] = got["mean_distinct"] / perm["mean_distinct"]
            got["exact_epoch"] = n == total and unique == total
            got["inspect_mean_distinct"] = inspect_mean(dst, len(batches), args.batch)
            report[name] = got
    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    print(f"{total} samples, {args.classes} classes, batch {args.batch}, {args.workers} workers")
    print(f"{'':16s}{'distinct/batch':>16s}{'ratio':>8s}{'largest share':>15s}{'worst':>7s}{'exact':>7s}{'inspect':>9s}")
    print(f"{'permutation':16s}{perm['mean_distinct']:16.1f}{1.0:8.2f}{perm['largest_share']:15.1%}{perm['worst_distinct']:7.0f}")
    for name in ("converted", "class-ordered"):
        r = report[name]
        print(f"{name:16s}{r['mean_distinct']:16.1f}{r['ratio']:8.2f}{r['largest_share']:15.1%}"
              f"{r['worst_distinct']:7d}{str(r['exact_epoch']):>7s}{r['inspect_mean_distinct']:9.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
