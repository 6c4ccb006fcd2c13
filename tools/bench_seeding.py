"""What sample seeding costs: per sample, and on a 2-worker epoch (on against off, A B A B).

    python tools/bench_seeding.py [--keys 200000] [--samples 20000] [--repeat 3]

1. The per-sample cost: ``Seeder.sample(key)`` (a BLAKE2b of the key, then torch's default
   generator, numpy's global and Python's ``random`` seeded directly) over real-looking keys,
   in microseconds per sample, beside the three seeding calls alone and ``torch.manual_seed``.
2. One epoch of a 2-worker ``shardflow.loader`` (batch 64) over small samples with a
   per-sample transform, ``sample_seeding=True`` against ``False``, alternated, each run in a
   fresh process; the ratio of the medians.
"""

from __future__ import annotations

import argparse
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch


def per_call(n: int) -> dict[str, float]:
    from shardflow.seeding import Seeder

    keys = [f"class_{i % 1000:04d}/img_{i:08d}" for i in range(n)]
    seeder = Seeder(seed=0, epoch=3, rank=0)
    out = {}
    t0 = time.perf_counter()
    for k in keys:
        seeder.sample(k)
    out["Seeder.sample(key)"] = (time.perf_counter() - t0) / n * 1e6
    gen = torch.default_generator
    t0 = time.perf_counter()
    for i in range(n):
        gen.manual_seed(i)
        np.random.seed(i)
        random.seed(i)
    out["the three seed calls alone"] = (time.perf_counter() - t0) / n * 1e6
    m = min(n, 20000)
    t0 = time.perf_counter()
    for i in range(m):
        torch.manual_seed(i)
    out["torch.manual_seed (for comparison)"] = (time.perf_counter() - t0) / m * 1e6
    return out


EPOCH = r"""
import sys, time
import shardflow
def touch(s):
    s["cls"] = s["cls"] + 0
    return s
ds = shardflow.ShardDataset(sys.argv[1], shuffle=True, seed=0, transform=touch, sample_seeding=sys.argv[2] == "on")
t0 = time.perf_counter()
n = sum(len(b["cls"]) for b in shardflow.loader(ds, batch_size=64, num_workers=2))
print(n / (time.perf_counter() - t0))
"""


def epoch_rates(samples: int, repeat: int) -> tuple[list[float], list[float]]:
    import shardflow

    with tempfile.TemporaryDirectory() as tmp:
        with shardflow.ShardWriter(str(Path(tmp) / "train-%06d.tar"), max_count=1000) as w:
            for i in range(samples):
                w.write({"__key__": f"k{i:08d}", "cls": i % 10, "txt": "x" * 100})
        rates: dict[str, list[float]] = {"on": [], "off": []}
        for _ in range(repeat):
            for mode in ("on", "off"):
                out = subprocess.run([sys.executable, "-c", EPOCH, tmp, mode], capture_output=True, text=True, check=True)
                rates[mode].append(float(out.stdout.strip().splitlines()[-1]))
    return rates["on"], rates["off"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--keys", type=int, default=200_000)
    p.add_argument("--samples", type=int, default=20_000)
    p.add_argument("--repeat", type=int, default=3)
    a = p.parse_args()
    for name, us in per_call(a.keys).items():
        print(f"{name:40s} {us:6.2f} us per sample")
    on, off = epoch_rates(a.samples, a.repeat)
    print(f"2-worker epoch, seeding on : {statistics.median(on):>10,.0f} samples/s  {[round(r) for r in on]}")
    print(f"2-worker epoch, seeding off: {statistics.median(off):>10,.0f} samples/s  {[round(r) for r in off]}")
    print(f"on / off: {statistics.median(on) / statistics.median(off):.3f}")


if __name__ == "__main__":
    main()
