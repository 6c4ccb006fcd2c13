"""Memory that ``shardflow convert arrays SRC DST`` adds, as the CLI runs it (default workers and chunk).

Writes a ``.npy`` of ``--rows`` rows of 64 x 64 x 3 uint8 (20,000 rows = 246 MB) in a
subprocess, then runs the CLI on it and samples, every 10 ms, the converting process and its
worker processes (psutil). Reported, above the converting process's own figures just before
its first worker starts (imports done):

- ``added``: the parent's RSS growth plus every worker's private memory (USS): the memory the
  conversion really takes;
- ``rss sum`` and ``pss sum`` of the process tree (``rss sum`` counts the pages a forked worker
  shares with its parent once per process, so it overstates).

Usage::

    python tools/bench_arrays_tree_memory.py [--rows 20000] [--dir /tmp/x] [-- CLI ARGS...]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time


def make(path: str, rows: int) -> None:
    code = (
        "import numpy as np, sys\n"
        "out = np.lib.format.open_memmap(sys.argv[1], mode='w+', dtype=np.uint8, shape=(int(sys.argv[2]), 64, 64, 3))\n"
        "rng = np.random.default_rng(0)\n"
        "for a in range(0, len(out), 1000):\n"
        "    out[a : a + 1000] = rng.integers(0, 256, size=out[a : a + 1000].shape, dtype=np.uint8)\n"
        "out.flush()\n"
    )
    subprocess.run([sys.executable, "-c", code, path, str(rows)], check=True)


def measure(src: str, dst: str, extra: list[str]) -> dict[str, float]:
    import psutil

    shutil.rmtree(dst, ignore_errors=True)
    p = subprocess.Popen([sys.executable, "-m", "shardflow.cli", "convert", "arrays", src, dst, *extra],
                         stdout=subprocess.PIPE)
    proc = psutil.Process(p.pid)
    before = base = None
    peak = {"added": 0, "rss sum": 0, "pss sum": 0}
    while p.poll() is None:
        try:
            kids = proc.children(recursive=True)
            me = proc.memory_full_info()
            if not kids:
                before = me
            else:
                base = base or before or me
                infos = [me] + [k.memory_full_info() for k in kids]
                peak["added"] = max(peak["added"], me.rss - base.rss + sum(i.uss for i in infos[1:]))
                peak["rss sum"] = max(peak["rss sum"], sum(i.rss for i in infos) - base.rss)
                peak["pss sum"] = max(peak["pss sum"], sum(i.pss for i in infos) - base.pss)
        except psutil.Error:
            pass
        time.sleep(0.01)
    if p.returncode:
        raise SystemExit(f"convert arrays failed ({p.returncode})")
    if base is None:
        raise SystemExit("no worker process was seen (--workers 1 runs in the CLI: use tools/bench_arrays_memory.py)")
    print(p.stdout.read().decode().strip())
    return peak


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=20_000)
    ap.add_argument("--dir", default=None)
    ap.add_argument("extra", nargs="*", help="further CLI arguments (after --)")
    args = ap.parse_args()
    work = args.dir or tempfile.mkdtemp(prefix="bench-arrays-tree-")
    os.makedirs(work, exist_ok=True)
    src = os.path.join(work, "x.npy")
    if not os.path.exists(src):
        make(src, args.rows)
    peak = measure(src, os.path.join(work, "out"), args.extra)
    print(f"source {os.path.getsize(src) / 1e6:.0f} MB; growth above the CLI before its workers: "
          + ", ".join(f"{k} {v / 1e6:.1f} MB" for k, v in peak.items()))


if __name__ == "__main__":
    main()
