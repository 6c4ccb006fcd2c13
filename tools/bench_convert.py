#!/usr/bin/env python3
"""Conversion A/B: ``shardflow convert imagefolder`` against ``tar cf`` (and peers) of one tree.

Each conversion runs in a fresh process, exactly as ``tools/bench_peers.py`` times it
(:func:`bench_peers.convert`: the import of the converter, the walk, the writing and the
manifest, inside the timer), and the libraries alternate round by round (A B A B ...), so
that the noise of a shared machine hits them alike. Besides files/s it reports the CPU
seconds of all the processes of a conversion (the converting process and every child it
waited for: worker processes, ``tar``), which is what to compare on a busy machine.

usage: python tools/bench_convert.py TREE [--per-shard 1000] [--rounds 5] [--libs shardflow,tar]
                                          [--work /tmp/conv-bench]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys

CHILD = r"""
import json, os, resource, sys, time
sys.path.insert(0, {tools!r})
import bench_peers
lib, tree, out, per, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
def cpu():
    s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime
c0 = cpu()
dt = bench_peers.convert(lib, tree, out, per)
print("RESULT " + json.dumps({{"seconds": dt, "cpu": cpu() - c0, "rate": n / dt}}))
"""


def count_files(tree: str) -> int:
    return sum(len(files) for _, _, files in os.walk(tree))


def run(lib: str, tree: str, work: str, per_shard: int, n: int) -> dict[str, float]:
    out = os.path.join(work, lib)
    code = CHILD.format(tools=os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", code, lib, tree, out, str(per_shard), str(n)],
                          capture_output=True, text=True, timeout=600)
    shutil.rmtree(out, ignore_errors=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"{lib} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("tree")
    ap.add_argument("--per-shard", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--libs", default="shardflow,tar", help="comma-separated: shardflow, tar, mosaic, litdata, ...")
    ap.add_argument("--work", default="/tmp/conv-bench")
    args = ap.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import bench_peers

    bench_peers.byte_compile_shardflow()  # as an installed package is (see there)
    libs = args.libs.split(",")
    n = count_files(args.tree)
    os.makedirs(args.work, exist_ok=True)
    results: dict[str, list[dict[str, float]]] = {lib: [] for lib in libs}
    for r in range(args.rounds):
        order = libs if r % 2 == 0 else libs[::-1]
        for lib in order:
            results[lib].append(run(lib, args.tree, args.work, args.per_shard, n))
        print(f"round {r + 1}: " + ", ".join(
            f"{lib} {results[lib][-1]['rate']:,.0f}/s cpu {results[lib][-1]['cpu']:.3f}s" for lib in libs), flush=True)
    print(f"\n{args.tree}: {n:,} files, {args.per_shard} per shard, {args.rounds} rounds (median [min-max])")
    print("| | files/s | wall s | CPU s, all processes |\n|---|---:|---:|---:|")
    for lib in libs:
        rates = [x["rate"] for x in results[lib]]
        secs = [x["seconds"] for x in results[lib]]
        cpus = [x["cpu"] for x in results[lib]]
        print(f"| {lib} | {statistics.median(rates):,.0f} [{min(rates):,.0f}-{max(rates):,.0f}] | "
              f"{statistics.median(secs):.3f} | {statistics.median(cpus):.3f} [{min(cpus):.3f}-{max(cpus):.3f}] |")
    base = libs[0]
    for lib in libs[1:]:
        ratios = [a["rate"] / b["rate"] for a, b in zip(results[base], results[lib])]
        print(f"{base} / {lib}, per round: " + " ".join(f"{x:.2f}x" for x in ratios)
              + f"; median {statistics.median(ratios):.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
