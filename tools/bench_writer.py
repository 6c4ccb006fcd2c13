#!/usr/bin/env python3
"""Writer costs: time per shard at 500 and at 2,000 shards, a bytes-only writer's memory,
and the CLI's start-up time.

Each measurement runs in a fresh process; the shard counts alternate (500, 2000, 500, ...)
and the table gives medians. ``per shard, 2000 / 500`` near 1.0 means the cost of a shard
does not grow with the number of shards already written (the manifest is written once, at
close; a journal line per shard meanwhile).

usage: python tools/bench_writer.py [--repeat 3] [--per-shard 4] [--work DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

CHILD = r"""
import json, resource, sys, time
import shardflow
out, shards, per = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
payload = b"\xff\xd8" + bytes(range(256)) * 8
t0 = time.perf_counter()
with shardflow.ShardWriter(out + "/train-%06d.tar", max_count=per, meta={"source": "bench"}) as w:
    for i in range(shards * per):
        w.write({"__key__": f"s{i:08d}", "jpg": payload, "cls": i % 10})
dt = time.perf_counter() - t0
print(json.dumps({"seconds": dt, "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "torch": "torch" in sys.modules}))
"""


def write_run(work: str, shards: int, per: int) -> dict:
    out = os.path.join(work, f"w{shards}")
    shutil.rmtree(out, ignore_errors=True)
    proc = subprocess.run([sys.executable, "-c", CHILD, out, str(shards), str(per)],
                          capture_output=True, text=True, check=True, timeout=1800)
    shutil.rmtree(out, ignore_errors=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def cli_time(*args: str) -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "shardflow.cli", *args], capture_output=True, check=True, timeout=120)
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--per-shard", type=int, default=4, help="samples per shard (small shards: the manifest dominates)")
    ap.add_argument("--work", default="/tmp/shardflow-bench-writer")
    args = ap.parse_args()
    per_shard: dict[int, list[float]] = {500: [], 2000: []}
    rss: list[float] = []
    torch_seen = False
    helps: list[float] = []
    for _ in range(args.repeat):
        for n in (500, 2000):
            r = write_run(args.work, n, args.per_shard)
            per_shard[n].append(r["seconds"] / n)
            rss.append(r["rss_mb"])
            torch_seen |= r["torch"]
        helps.append(cli_time("--help"))
    m500, m2000 = statistics.median(per_shard[500]), statistics.median(per_shard[2000])
    print(f"\nShardWriter, {args.per_shard} samples of 2 KiB per shard; median of {args.repeat} alternating runs\n")
    print("| measurement | value |\n|---|---:|")
    print(f"| 500 shards, ms per shard | {m500 * 1e3:.2f} [{min(per_shard[500]) * 1e3:.2f}-{max(per_shard[500]) * 1e3:.2f}] |")
    print(f"| 2,000 shards, ms per shard | {m2000 * 1e3:.2f} [{min(per_shard[2000]) * 1e3:.2f}-{max(per_shard[2000]) * 1e3:.2f}] |")
    print(f"| per shard, 2,000 / 500 | {m2000 / m500:.2f}x |")
    print(f"| peak RSS of the writing process (bytes-only samples) | {max(rss):.0f} MB |")
    print(f"| torch imported by the writing process | {'yes' if torch_seen else 'no'} |")
    print(f"| `shardflow --help` | {statistics.median(helps):.2f} s [{min(helps):.2f}-{max(helps):.2f}] |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
