"""Raw iteration only: ``ShardDataset(decode=None)`` against ``litdata.StreamingDataset``.

Both iterate the same data set in this one process, alternating (A B, then B A, ...),
one whole pass per timing, a fresh dataset each pass (as ``tools/bench_peers.py``
times them); the medians of wall time and of CPU time (``time.process_time``: other
jobs on the machine count less) are reported, with the ratio. The data are the
converted sets that ``tools/bench_peers.py`` leaves in its ``--work`` folder
(``shardflow-small-20000``, ``litdata-small-20000``, ``shardflow-photo-5000``,
``litdata-photo-5000``); run that first.

    python tools/bench_raw.py --work /tmp/shardflow-bench-peers --rounds 9
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

SETS = {"small": "small-20000", "photo": "photo-5000"}


def one_pass(make: Callable[[], Any]) -> tuple[int, float, float]:
    """``(samples, wall seconds, CPU seconds)`` of one pass over a fresh dataset."""
    t0, c0 = time.perf_counter(), time.process_time()
    n = sum(1 for _ in make())
    return n, time.perf_counter() - t0, time.process_time() - c0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    ap.add_argument("--work", default="/tmp/shardflow-bench-peers", help="tools/bench_peers.py's --work folder")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--sets", default="small,photo")
    args = ap.parse_args()
    import litdata

    import shardflow

    for name in args.sets.split(","):
        ours = os.path.join(args.work, f"shardflow-{SETS[name]}")
        theirs = os.path.join(args.work, f"litdata-{SETS[name]}")
        libs: dict[str, Callable[[], Any]] = {
            "shardflow": lambda: shardflow.ShardDataset(ours, decode=None),
            "litdata": lambda: litdata.StreamingDataset(theirs),
        }
        for make in libs.values():  # untimed: imports, first opens
            one_pass(make)
        runs: dict[str, list[tuple[int, float, float]]] = {lib: [] for lib in libs}
        for r in range(args.rounds):
            for lib in (list(libs) if r % 2 == 0 else list(libs)[::-1]):
                runs[lib].append(one_pass(libs[lib]))
        rates = {}
        for lib, got in runs.items():
            n = got[0][0]
            wall = n / statistics.median(g[1] for g in got)
            cpu = n / statistics.median(g[2] for g in got)
            rates[lib] = (wall, cpu)
            print(f"{name}: {lib:9s} {n} samples, {wall:,.0f}/s wall, {cpu:,.0f}/s CPU")
        (sw, sc), (lw, lc) = rates["shardflow"], rates["litdata"]
        print(f"{name}: shardflow / litdata  wall {sw / lw:.2f}x  CPU {sc / lc:.2f}x")


if __name__ == "__main__":
    main()
