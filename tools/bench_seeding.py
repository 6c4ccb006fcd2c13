"""What sample seeding costs: per sample, and on a 2-worker epoch (on against off, A B A B).

    python tools/bench_seeding.py [--keys 200000] [--samples 20000] [--repeat 3]

1. The per-sample cost: ``Seeder.sample(key)`` over real-looking keys, in microseconds per
   sample, for all three generators and for the subsets ``sample_seeding`` can name, beside
   its parts alone (the BLAKE2b of the key, each generator's seeding as shardflow does it,
   ``random.seed`` through its Python wrapper, and ``torch.manual_seed``). Best of 3 passes.
2. One epoch of a 2-worker ``shardflow.loader`` (batch 64) over small samples with a
   per-sample transform, ``sample_seeding=True`` against ``False``, alternated, each run in a
   fresh process; the ratio of the medians.
"""

from __future__ import annotations

import _random
import argparse
import hashlib
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch


def best_us(fn: Callable[[list], None], items: list, passes: int = 3) -> float:
    """Microseconds per item of ``fn(items)``, the best of ``passes``."""
    best = float("inf")
    for _ in range(passes):
        t0 = time.perf_counter()
        fn(items)
        best = min(best, (time.perf_counter() - t0) / len(items) * 1e6)
    return best


def per_call(n: int) -> dict[str, float]:
    from shardflow.seeding import Seeder

    keys = [f"class_{i % 1000:04d}/img_{i:08d}" for i in range(n)]
    prefix = b"shardflow/sample/0/3/"
    values = [int.from_bytes(hashlib.blake2b(prefix + k.encode(), digest_size=8).digest(), "little") for k in keys]
    out = {}
    for names in (("torch", "numpy", "python"), ("torch", "numpy"), ("torch",), ("numpy",), ("python",)):
        seeder = Seeder(seed=0, epoch=3, rank=0, enabled=names)

        def run(ks: list, sample: Callable[[str], None] = seeder.sample) -> None:
            for k in ks:
                sample(k)

        out[f"Seeder.sample(key), {'+'.join(names)}"] = best_us(run, keys)

    def hashing(ks: list, base: object = hashlib.blake2b(prefix, digest_size=8)) -> None:
        for k in ks:
            h = base.copy()
            h.update(k.encode("utf-8", "surrogatepass"))
            int.from_bytes(h.digest(), "little")

    def torch_seed(vs: list, seed: Callable[[int], object] = torch.default_generator.manual_seed) -> None:
        for v in vs:
            seed(v)

    def numpy_seed(vs: list, seed: Callable[[int], None] = np.random.seed) -> None:
        for v in vs:
            seed(v >> 32)

    def python_c_seed(vs: list, inst: random.Random = random.seed.__self__) -> None:
        for v in vs:
            _random.Random.seed(inst, v)
            inst.gauss_next = None

    def python_seed(vs: list, seed: Callable[[int], None] = random.seed) -> None:
        for v in vs:
            seed(v)

    def torch_manual_seed(vs: list) -> None:
        for v in vs:
            torch.manual_seed(v)

    out["  part: BLAKE2b of the key"] = best_us(hashing, keys)
    out["  part: torch.default_generator.manual_seed"] = best_us(torch_seed, values)
    out["  part: np.random.seed"] = best_us(numpy_seed, values)
    out["  part: Python random, C seed + gauss_next"] = best_us(python_c_seed, values)
    out["  (random.seed, the Python wrapper)"] = best_us(python_seed, values)
    out["  (torch.manual_seed, for comparison)"] = best_us(torch_manual_seed, values[:20000], passes=1)
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
        print(f"{name:48s} {us:6.2f} us per sample")
    on, off = epoch_rates(a.samples, a.repeat)
    print(f"2-worker epoch, seeding on : {statistics.median(on):>10,.0f} samples/s  {[round(r) for r in on]}")
    print(f"2-worker epoch, seeding off: {statistics.median(off):>10,.0f} samples/s  {[round(r) for r in off]}")
    print(f"on / off: {statistics.median(on) / statistics.median(off):.3f}")


if __name__ == "__main__":
    main()
