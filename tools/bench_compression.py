"""Plain ``.tar`` against framed ``.tar.zst`` shards of the same small JPEGs: size and raw read rate.

Writes N 64x64 JPEGs (smooth colour waves plus noise, quality 90: ~2 KB each,
like ``/work/shared/bench/gen_imagefolder.py``) with ``write_shards`` twice, plain
and ``compression="zstd"``, then times, alternating (A B, then B A, ...), one
whole pass each over a fresh dataset: ``ShardDataset(decode=None)`` in stored
order, the same shuffled (reads through the offset index, and the frame table),
and ``IndexedShardDataset`` random access to a fixed random subset. Medians of
wall and CPU seconds (``time.process_time``) per pass; the ratios are zstd / plain
from the same run. State the load average with any figure (it is printed).

    python tools/bench_compression.py --images 10000 --rounds 5
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np


def jpeg(i: int) -> bytes:
    from PIL import Image

    rng = np.random.default_rng(i)
    yy, xx = np.mgrid[0:64, 0:64]
    a = rng.uniform(0, 6, 3)
    img = np.stack([127 + 120 * np.sin(xx / 64 * a[k] + yy / 64 * a[(k + 1) % 3]) for k in range(3)], -1)
    img += rng.normal(0, 8, img.shape)
    buf = io.BytesIO()
    Image.fromarray(np.clip(img, 0, 255).astype(np.uint8)).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


IMAGES: list[bytes] = []


def sample(i: int) -> dict[str, Any]:
    return {"__key__": f"c{i % 10}/{i:07d}", "jpg": IMAGES[i], "cls": i % 10}


def timed(make: Callable[[], Any]) -> tuple[int, float, float]:
    t0, c0 = time.perf_counter(), time.process_time()
    n = sum(1 for _ in make())
    return n, time.perf_counter() - t0, time.process_time() - c0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    ap.add_argument("--images", type=int, default=10_000)
    ap.add_argument("--per-shard", type=int, default=2_000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--random", type=int, default=2_000, help="samples read by random access per pass")
    ap.add_argument("--work", default=None)
    args = ap.parse_args()
    import shardflow

    IMAGES.extend(jpeg(i) for i in range(args.images))
    work = args.work or tempfile.mkdtemp(prefix="shardflow-bench-zstd-")
    dirs = {}
    for comp in ("plain", "zstd"):
        dirs[comp] = os.path.join(work, comp)
        m = shardflow.write_shards(sample, range(args.images), dirs[comp], max_count=args.per_shard, workers=1,
                                   compression=None if comp == "plain" else "zstd", overwrite=True, resume=False)
        stored = sum(s.bytes for s in m.shards)
        image = sum(map(len, IMAGES))
        print(f"{comp:5s} stored {stored:,} bytes = {stored / image:.3f}x the {image:,} image bytes ({len(m.shards)} shards)")
    pick = np.random.default_rng(0).choice(args.images, size=min(args.random, args.images), replace=False).tolist()

    def stored_order(d: str) -> Any:
        return shardflow.ShardDataset(d, decode=None)

    def shuffled(d: str) -> Any:
        return shardflow.ShardDataset(d, decode=None, shuffle=True, seed=0)

    def random_access(d: str) -> Any:
        ds = shardflow.IndexedShardDataset(d, decode=None)
        return (ds[i] for i in pick)

    for name, how in (("stored order", stored_order), ("shuffled", shuffled), ("random access", random_access)):
        for comp in dirs:
            timed(lambda: how(dirs[comp]))  # untimed: imports, page cache
        runs: dict[str, list[tuple[int, float, float]]] = {c: [] for c in dirs}
        for r in range(args.rounds):
            for comp in (list(dirs) if r % 2 == 0 else list(dirs)[::-1]):
                runs[comp].append(timed(lambda: how(dirs[comp])))
        rate = {}
        for comp, got in runs.items():
            n = got[0][0]
            rate[comp] = (n / statistics.median(g[1] for g in got), n / statistics.median(g[2] for g in got))
        z, p = rate["zstd"], rate["plain"]
        print(f"{name:14s} plain {p[0]:9,.0f}/s wall {p[1]:9,.0f}/s CPU | zstd {z[0]:9,.0f}/s wall "
              f"{z[1]:9,.0f}/s CPU | zstd/plain {z[0] / p[0]:.2f} wall, {z[1] / p[1]:.2f} CPU")
    print(f"load average {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f} {os.getloadavg()[2]:.2f}")


if __name__ == "__main__":
    main()
