#!/usr/bin/env python3
"""What the loader's accounting costs: per sample, and on a 2-worker local epoch (on against off, A B A B).

    python tools/bench_accounting.py [--samples 20000] [--repeat 3] [--images]

1. The per-item cost of one stage timer (:func:`shardflow.accounting.timed`) over a plain
   iterator, in nanoseconds, best of 3 passes (a worker runs 3-4 of them per sample: read,
   decode, the transform when there is one, and one per batch for collate).
2. One epoch of a 2-worker ``shardflow.loader`` (batch 64) over small local samples (a class and
   100 bytes of text: the worst case, where a sample costs least; ``--images``: 64x64 JPEGs
   decoded), ``accounting=True`` against ``False``, alternated, each run in a fresh process;
   the ratio of the medians.
"""

from __future__ import annotations

import argparse
import io
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def timer_ns(n: int = 1_000_000) -> float:
    """Nanoseconds per item that :func:`shardflow.accounting.timed` adds, best of 3."""
    from shardflow.accounting import timed

    items = list(range(n))
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter_ns()
        for _x in items:
            pass
        plain = time.perf_counter_ns() - t0
        t0 = time.perf_counter_ns()
        for _x in timed(items, "read"):
            pass
        best = min(best, (time.perf_counter_ns() - t0 - plain) / n)
    return best


EPOCH = r"""
import sys, time
import shardflow
ds = shardflow.ShardDataset(sys.argv[1], shuffle=True, seed=0)
t0 = time.perf_counter()
n = sum(len(b["cls"]) for b in shardflow.loader(ds, batch_size=64, num_workers=2, accounting=sys.argv[2] == "on"))
print(n / (time.perf_counter() - t0))
"""


def write(folder: str, samples: int, images: bool) -> None:
    import shardflow

    jpg = None
    if images:
        from PIL import Image

        buf = io.BytesIO()
        Image.fromarray(np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(buf, "JPEG")
        jpg = buf.getvalue()
    with shardflow.ShardWriter(str(Path(folder) / "train-%06d.tar"), max_count=1000) as w:
        for i in range(samples):
            w.write({"__key__": f"k{i:08d}", "cls": i % 10, **({"jpg": jpg} if jpg else {"txt": "x" * 100})})


def epoch_rates(samples: int, repeat: int, images: bool) -> tuple[list[float], list[float]]:
    with tempfile.TemporaryDirectory() as tmp:
        write(tmp, samples, images)
        rates: dict[str, list[float]] = {"on": [], "off": []}
        for _ in range(repeat):
            for mode in ("on", "off"):
                out = subprocess.run([sys.executable, "-c", EPOCH, tmp, mode], capture_output=True, text=True, check=True)
                rates[mode].append(float(out.stdout.strip().splitlines()[-1]))
    return rates["on"], rates["off"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--samples", type=int, default=20_000)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--images", action="store_true", help="64x64 JPEGs, decoded, instead of tiny text samples")
    a = p.parse_args()
    print(f"one stage timer: {timer_ns():.0f} ns per item")
    on, off = epoch_rates(a.samples, a.repeat, a.images)
    print(f"2-worker epoch, accounting on : {statistics.median(on):>10,.0f} samples/s  {[round(r) for r in on]}")
    print(f"2-worker epoch, accounting off: {statistics.median(off):>10,.0f} samples/s  {[round(r) for r in off]}")
    print(f"on / off: {statistics.median(on) / statistics.median(off):.3f}")


if __name__ == "__main__":
    main()
