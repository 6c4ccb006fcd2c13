#!/usr/bin/env python3
"""Read benchmark: shardflow vs webdataset on the same shards, in one run.

Reports raw iteration, iteration with RGB decode, and a 2-worker DataLoader
with shuffle and batch 64, plus the Pillow decode limit (the same JPEG bytes
decoded from RAM in one process). Each figure is the median of --repeat runs,
alternating pipelines so that machine noise hits both alike; the ratios are
what to compare across machines.

usage: python tools/bench_read.py [--tree IMAGEFOLDER] [--images 20000] [--size 64] [--work DIR]
                             [--repeat 3] [--raw-passes 5]

Without --tree, a synthetic ImageFolder is generated (smooth images plus noise,
as in the project's baseline scripts) and converted with `shardflow convert
imagefolder`.
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import subprocess
import sys
import time

import numpy as np


def make_tree(root: str, images: int, size: int, classes: int = 20) -> None:
    from PIL import Image

    if os.path.isdir(root) and sum(len(f) for _, _, f in os.walk(root)) >= images:
        return
    rng = np.random.default_rng(0)
    yy, xx = np.mgrid[0:size, 0:size]
    per = images // classes
    for c in range(classes):
        d = os.path.join(root, f"class_{c:03d}")
        os.makedirs(d, exist_ok=True)
        for i in range(per):
            a = rng.uniform(0, 6, 3)
            img = np.stack([127 + 120 * np.sin(xx / size * a[k] + yy / size * a[(k + 1) % 3]) for k in range(3)], -1)
            img += rng.normal(0, 8, img.shape)
            Image.fromarray(np.clip(img, 0, 255).astype(np.uint8)).save(os.path.join(d, f"{i:07d}.jpg"), quality=90)


def timed(fn) -> tuple[float, int]:
    t0 = time.perf_counter()
    n = fn()
    return time.perf_counter() - t0, n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tree", help="an ImageFolder to convert (default: generate one)")
    ap.add_argument("--images", type=int, default=20000)
    ap.add_argument("--size", type=int, default=64)
    ap.add_argument("--work", default="/tmp/shardflow-bench-read")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--raw-passes", type=int, default=5,
                    help="passes over the shards per raw-iteration timing (the first one runs slower)")
    args = ap.parse_args()

    import torch
    import webdataset as wds
    from PIL import Image

    import shardflow

    tree = args.tree or os.path.join(args.work, f"tree-{args.images}-{args.size}")
    if not args.tree:
        make_tree(tree, args.images, args.size)
    shards = os.path.join(args.work, f"shards-{os.path.basename(tree.rstrip('/'))}")
    subprocess.run(
        [sys.executable, "-m", "shardflow.cli", "convert", "imagefolder", tree, shards, "--max-count", "1000"],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    ds0 = shardflow.ShardDataset(shards, decode=None)
    urls = ds0.urls
    n_total = len(ds0)
    blobs = [s["jpg"] for s in ds0]

    # Raw iteration of 20k samples takes well under a second; the first pass after another
    # pipeline runs up to 2x slower on the development VM (memory and caches settle), so
    # each raw timing covers --raw-passes passes over the shards (both libraries alike).
    def sf_raw():
        return sum(1 for _ in range(args.raw_passes) for _ in shardflow.ShardDataset(shards, decode=None))

    def wds_raw():
        return sum(1 for _ in range(args.raw_passes) for _ in wds.WebDataset(urls, shardshuffle=False))

    def pil_limit():
        for b in blobs:
            np.asarray(Image.open(io.BytesIO(b)).convert("RGB"))
        return len(blobs)

    def sf_decode():
        return sum(1 for _ in shardflow.ShardDataset(shards, decode="numpy", fields=("jpg", "cls")))

    def wds_decode():
        return sum(1 for _ in wds.WebDataset(urls, shardshuffle=False).decode("rgb8").to_tuple("jpg", "cls"))

    def sf_loader():
        ds = shardflow.ShardDataset(shards, shuffle=True, decode="torch", fields=("jpg", "cls"))
        return sum(len(b["cls"]) for b in shardflow.loader(ds, batch_size=64, num_workers=2))

    def wds_loader():
        ds = (
            wds.WebDataset(urls, shardshuffle=False, nodesplitter=None, workersplitter=wds.split_by_worker)
            .shuffle(1000)
            .decode("rgb8")
            .to_tuple("jpg", "cls")
            .map_tuple(torch.from_numpy, lambda c: c)
            .batched(64)
        )
        return sum(len(y) for _, y in wds.WebLoader(ds, batch_size=None, num_workers=2))

    pipelines = {
        "webdataset raw iteration": wds_raw,
        "shardflow raw iteration": sf_raw,
        "Pillow decode limit (bytes in RAM, 1 process)": pil_limit,
        "webdataset read + decode rgb8": wds_decode,
        "shardflow read + decode numpy": sf_decode,
        "webdataset shuffle(1000) + WebLoader 2 workers, batch 64": wds_loader,
        "shardflow shuffle + loader 2 workers, batch 64": sf_loader,
    }
    rates: dict[str, list[float]] = {k: [] for k in pipelines}
    for _ in range(args.repeat):
        for name, fn in pipelines.items():
            dt, n = timed(fn)
            if name.endswith("raw iteration"):
                n //= args.raw_passes
                dt /= args.raw_passes
            if n != n_total:
                raise SystemExit(f"{name}: saw {n} samples, expected {n_total}")
            rates[name].append(n / dt)
    med = {k: statistics.median(v) for k, v in rates.items()}
    print(f"\n{n_total} JPEGs of {args.size}x{args.size}, {len(urls)} shards; median of {args.repeat} runs\n")
    print("| pipeline | samples/s |")
    print("|---|---:|")
    for k, v in med.items():
        print(f"| {k} | {v:,.0f} |")
    print("\n| ratio | value | target |")
    print("|---|---:|---:|")
    print(f"| shardflow raw / webdataset raw | {med['shardflow raw iteration'] / med['webdataset raw iteration']:.2f}x | >= 5x |")
    print(f"| shardflow read+decode / Pillow limit | {med['shardflow read + decode numpy'] / med['Pillow decode limit (bytes in RAM, 1 process)']:.2f}x | >= 0.8x |")
    print(f"| shardflow read+decode / webdataset read+decode | {med['shardflow read + decode numpy'] / med['webdataset read + decode rgb8']:.2f}x | |")
    sl = med["shardflow shuffle + loader 2 workers, batch 64"]
    wl = med["webdataset shuffle(1000) + WebLoader 2 workers, batch 64"]
    print(f"| shardflow loader / webdataset loader (2 workers) | {sl / wl:.2f}x | |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
