#!/usr/bin/env python3
"""Samples each DataLoader worker reads (parsed, not decoded) per sample the rank yields, from the plan.

    python tools/plan_reads.py [--samples 10000] [--shard 100]

Workers take a rank's batches round robin (so the batch order does not depend on ``num_workers``);
with a shuffle buffer a batch's samples are spread over a stretch of the read order, and a worker
reads through the gaps of up to ``SEEK_GAP`` samples between its own (it seeks over longer ones).
This counts the samples read that way, against the contiguous split (each worker its own stretch of
batches) that shardflow used before, computed from the plans alone (no I/O, no timing).
"""

from __future__ import annotations

import argparse

import numpy as np

from shardflow.planning.plan import ShuffleConfig, SplitConfig, plan_epoch, worker_batches
from shardflow.reader import SEEK_GAP


def samples_read(plan, workers: int, interleaved: bool) -> int:
    total = 0
    for w in range(workers):
        _, pos = plan.batch_positions(list(worker_batches(plan.num_batches, w, workers, interleaved)))
        pos = np.sort(pos)
        seg, smp = plan.read_segment[pos], plan.read_sample[pos]
        for s in np.unique(seg):
            x = np.sort(smp[seg == s])
            runs = np.split(x, np.flatnonzero(np.diff(x) > SEEK_GAP) + 1)
            total += sum(int(r[-1] - r[0] + 1) for r in runs)
    return total


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=10_000)
    ap.add_argument("--shard", type=int, default=100, help="samples per shard")
    args = ap.parse_args()
    counts = np.full(args.samples // args.shard, args.shard)
    n = int(counts.sum())
    print("buffer  batch  workers  round robin  contiguous  (samples read per sample yielded)")
    for buffer, batch, workers in [(1000, 64, 4), (1000, 256, 4), (100, 64, 4), (1000, 64, 8)]:
        plan = plan_epoch(counts, 0, 1, 0, 0, ShuffleConfig(buffer=buffer), SplitConfig(batch_size=batch))
        rr, cont = samples_read(plan, workers, True) / n, samples_read(plan, workers, False) / n
        print(f"{buffer:6d}  {batch:5d}  {workers:7d}  {rr:10.2f}x  {cont:9.2f}x")


if __name__ == "__main__":
    main()
