"""Raw iteration only: ``ShardDataset(decode=None)`` against ``litdata.StreamingDataset``.

Both iterate the same data set in this one process, alternating (A B, then B A, ...),
one whole pass per timing, a fresh dataset each pass (as ``tools/bench_peers.py``
times them); the medians of wall time and of CPU time (``time.process_time``: other
jobs on the machine count less) are reported, with the ratio. The data are the
converted sets that ``tools/bench_peers.py`` leaves in its ``--work`` folder
(``shardflow-small-20000``, ``litdata-small-20000``, ``shardflow-photo-5000``,
``litdata-photo-5000``); run that first.

    python tools/bench_raw.py --work /tmp/shardflow-bench-peers --rounds 9
    python tools/bench_raw.py --work /tmp/shardflow-bench-peers --rounds 6 --sets small --fresh
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

SETS = {"small": "small-20000", "photo": "photo-5000"}


def one_pass(make: Callable[[], Any]) -> tuple[int, float, float]:
    """``(samples, wall seconds, CPU seconds)`` of one pass over a fresh dataset."""
    t0, c0 = time.perf_counter(), time.process_time()
    n = sum(1 for _ in make())
    return n, time.perf_counter() - t0, time.process_time() - c0


def _dataset(lib: str, path: str) -> Callable[[], Any]:
    if lib == "litdata":
        import litdata

        return lambda: litdata.StreamingDataset(path)
    import shardflow

    return lambda: shardflow.ShardDataset(path, decode=None)


def _child(lib: str, path: str) -> None:
    """One timed pass in this fresh process: the imports first, as a training script has them."""
    import litdata  # noqa: F401
    import numpy  # noqa: F401
    import PIL.Image  # noqa: F401
    import torch  # noqa: F401

    import shardflow
    from shardflow import ShardDataset  # noqa: F401 - the lazy import of the dataset module

    make = _dataset(lib, path)
    n, wall, cpu = one_pass(make)
    print(f"{n} {wall} {cpu}")


def _fresh(lib: str, path: str) -> tuple[int, float, float]:
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", lib, "--data", path],
                         capture_output=True, text=True, check=True).stdout.split()
    return int(out[0]), float(out[1]), float(out[2])


def _report(name: str, runs: dict[str, list[tuple[int, float, float]]]) -> None:
    rates = {}
    for lib, got in runs.items():
        n = got[0][0]
        wall = n / statistics.median(g[1] for g in got)
        cpu = n / statistics.median(g[2] for g in got)
        rates[lib] = (wall, cpu)
        us = sorted(round(g[2] / n * 1e6, 1) for g in got)
        print(f"{name}: {lib:9s} {n} samples, {wall:,.0f}/s wall, {cpu:,.0f}/s CPU (CPU us per sample, sorted: {us})")
    (sw, sc), (lw, lc) = rates["shardflow"], rates["litdata"]
    print(f"{name}: shardflow / litdata  wall {sw / lw:.2f}x  CPU {sc / lc:.2f}x  (load average {os.getloadavg()})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    ap.add_argument("--work", default="/tmp/shardflow-bench-peers", help="tools/bench_peers.py's --work folder")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--sets", default="small,photo")
    ap.add_argument("--fresh", action="store_true", help="each timed pass alone in a new process")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--data", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        _child(args.child, args.data)
        return
    for name in args.sets.split(","):
        paths = {lib: os.path.join(args.work, f"{lib}-{SETS[name]}") for lib in ("shardflow", "litdata")}
        runs: dict[str, list[tuple[int, float, float]]] = {lib: [] for lib in paths}
        if args.fresh:
            for r in range(args.rounds):  # A B B A ...
                for lib in (list(paths) if r % 2 == 0 else list(paths)[::-1]):
                    runs[lib].append(_fresh(lib, paths[lib]))
            _report(name, runs)
            continue
        libs = {lib: _dataset(lib, path) for lib, path in paths.items()}
        for make in libs.values():  # untimed: imports, first opens
            one_pass(make)
        for r in range(args.rounds):
            for lib in (list(libs) if r % 2 == 0 else list(libs)[::-1]):
                runs[lib].append(one_pass(libs[lib]))
        _report(name, runs)


if __name__ == "__main__":
    main()
