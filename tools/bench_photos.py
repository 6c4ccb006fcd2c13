#!/usr/bin/env python3
"""Camera-sized JPEGs: full decode against reduced decode, and shards packed with --max-side.

Makes (once) an ImageFolder of JPEGs the size cameras give (default 2,000 of 3000x2000, quality 90,
crops of the photographs scikit-image and scikit-learn ship, upscaled: ``../shared/bench/peers/
gen_photos.py``), converts it twice (as stored, and with ``--max-side 512``), then streams each
epoch through ``shardflow.loader`` (2 workers, batch 32, shuffled) into 256x256 uint8 tensors
(``shardflow.transforms.Resize``), in a fresh process per timed run, the variants alternated:

- ``full``: ``decode="torch"``, every JPEG decoded whole, then resized;
- ``reduced``: ``DecodeOptions(image="torch", min_side=256)``: libjpeg's 1/2, 1/4 or 1/8 decode
  that keeps the short side >= 256, then resized;
- ``max-side``: the ``--max-side 512`` shards, decoded whole, then resized.

Prints samples/s per variant (median of --repeat), the ratios to ``full``, and the stored bytes.

usage: python tools/bench_photos.py [--work DIR] [--images 2000] [--size 3000x2000] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def gen_photos() -> str:
    """``shared/bench/peers/gen_photos.py`` beside the checkout (or beside a folder above it)."""
    d = HERE
    while d != os.path.dirname(d):
        d = os.path.dirname(d)
        path = os.path.join(d, "shared", "bench", "peers", "gen_photos.py")
        if os.path.exists(path):
            return path
    sys.exit("bench_photos: cannot find shared/bench/peers/gen_photos.py beside the checkout")

CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
import shardflow
from shardflow.codecs import DecodeOptions
from shardflow.transforms import Resize
src, variant = sys.argv[1], sys.argv[2]
decode = DecodeOptions(image="torch", min_side=256) if variant == "reduced" else "torch"
ds = shardflow.ShardDataset(src, shuffle=True, seed=0, decode=decode, fields=("image", "cls"),
                            transform={"image": Resize(256)})
n = 0
for batch in shardflow.loader(ds, batch_size=32, num_workers=2):
    assert tuple(batch["image"].shape[1:]) == (3, 256, 256)
    n += len(batch["cls"])
print(json.dumps({"samples": n, "seconds": time.perf_counter() - t0}))
"""


def convert(tree: str, dst: str, *extra: str) -> float:
    if os.path.exists(os.path.join(dst, "shardflow.json")):
        return float("nan")
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "shardflow.cli", "convert", "imagefolder", tree, dst, "--workers", "2",
                    "--max-count", "256", *extra], check=True)  # fmt: skip
    return time.perf_counter() - t0


def stored_bytes(folder: str) -> int:
    return sum(s["bytes"] for s in json.load(open(os.path.join(folder, "shardflow.json")))["shards"])


def run(src: str, variant: str) -> float:
    out = subprocess.run([sys.executable, "-c", CHILD, src, variant], check=True, capture_output=True, text=True)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    return r["samples"] / r["seconds"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", default="bench-photos")
    ap.add_argument("--images", type=int, default=2000)
    ap.add_argument("--size", default="3000x2000")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    w, h = args.size.split("x")
    tree = os.path.join(args.work, f"tree-{args.size}-{args.images}")
    if not os.path.isdir(tree):
        subprocess.run([sys.executable, gen_photos(), tree, str(args.images // 10), w, h], check=True)
    full, small = os.path.join(args.work, "shards-full"), os.path.join(args.work, "shards-512")
    t_full, t_small = convert(tree, full), convert(tree, small, "--max-side", "512")
    print(f"convert: as stored {t_full:.1f} s, --max-side 512 {t_small:.1f} s (nan: already converted)")
    b_full, b_small = stored_bytes(full), stored_bytes(small)
    print(f"stored bytes: {b_full / 2**20:,.1f} MiB as stored, {b_small / 2**20:,.1f} MiB with --max-side 512 "
          f"({b_small / b_full:.3f}x)")  # fmt: skip
    variants = {"full": full, "reduced": full, "max-side": small}
    rates: dict[str, list[float]] = {v: [] for v in variants}
    for r in range(args.repeat):
        for v, src in variants.items():
            rates[v].append(run(src, v))
            print(f"  run {r + 1} {v:9s} {rates[v][-1]:8,.1f} samples/s", flush=True)
    base = statistics.median(rates["full"])
    print(f"\n{'variant':10s} {'samples/s (median)':>20s} {'runs':>28s} {'vs full':>8s}")
    for v, xs in rates.items():
        med = statistics.median(xs)
        print(f"{v:10s} {med:20,.1f} {' '.join(f'{x:,.0f}' for x in xs):>28s} {med / base:7.2f}x")


if __name__ == "__main__":
    main()
