#!/usr/bin/env python3
"""A million-file ImageFolder tree: ``shardflow convert imagefolder`` (defaults) against ``tar cf``,
LitData's ``optimize`` and MosaicML Streaming's ``MDSWriter`` loop, then ``ShardDataset`` over the result.

Every timed run is a fresh child process (``bench_million.py --child JSON``); the libraries
alternate round by round (A B C D, then D C B A, ...). Each conversion is timed as the peer
harness (``shared/bench/peers/peer_bench.py``, ``c_convert``) times it: the library imported
first, the timer started before the listing of the tree, shardflow's CLI run in-process
(``shardflow.cli.main(["convert", "imagefolder", SRC, DST])``, defaults: 10,000 samples per shard,
one writer per CPU), LitData's ``optimize`` with the harness's function (the JPEG bytes and the
label, 2 workers), Mosaic's ``MDSWriter`` over the sorted tree in one process (``jpg`` bytes,
``cls`` int), ``tar cf`` of the tree. LitData and Mosaic get shards of the same sample count
(``chunk_size``; ``size_limit`` = count x mean file size x 1.01).

Memory: ``main`` is the peak RSS of the converting process (the kernel's ``ru_maxrss`` from
``wait4``, imports included), ``workers`` the largest peak RSS among the processes it waited for
(its ``RUSAGE_CHILDREN``: writer processes, ``tar``), ``tree`` the largest sum of the RSS of the
process and all its descendants, polled every 0.2 s with psutil (pages shared by forked workers
counted in each: an upper bound).

Then, in a fresh process for each, ``ShardDataset(DST)`` over shardflow's output: the seconds to
``len()`` and to the first sample (imports before the timer; their seconds printed beside).

usage: python tools/bench_million.py TREE [--repeat 1] [--libs shardflow,tar,litdata,mosaic[,shardflow-walk]]
                                      [--work DIR] [--json OUT.json] [--keep]

Mosaic's ``streaming.vision`` imports torchvision, whose PyPI build does not import beside the
CPU build of torch: its children run with ``PYTHONPATH`` set to the harness's ``tvstub``
(``shared/bench/peers/tvstub``, found beside the checkout or with ``--tvstub``).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
LIBS = ("shardflow", "tar", "litdata", "mosaic")  # and "shardflow-walk": the CLI with --order walk
WORKERS = 2  # LitData's optimize workers, as in the peer harness
MAX_COUNT = 10_000  # shardflow's default samples per shard; the others get the same


# ------------------------------------------------------------------ children


def list_tree(root: str) -> list[tuple[str, int]]:
    """The harness's ImageFolder walk: sorted class folders -> label, sorted files."""
    classes = sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d)))
    out = []
    for i, c in enumerate(classes):
        d = os.path.join(root, c)
        out += [(os.path.join(d, f), i) for f in sorted(os.listdir(d))]
    return out


@functools.lru_cache(maxsize=None)
def _class_index(root: str) -> dict[str, int]:
    return {c: i for i, c in enumerate(sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d))))}


def lit_fn(path: str) -> dict:
    """LitData's ``fn`` (the harness's): the JPEG bytes as stored and the label."""
    cdir = os.path.dirname(path)
    with open(path, "rb") as f:
        data = f.read()
    return {"jpg": data, "cls": _class_index(os.path.dirname(cdir))[os.path.basename(cdir)]}


def convert(a: dict) -> dict:
    """One timed conversion (child); the library is imported before the timer."""
    lib, tree, dst = a["lib"], a["tree"], a["dst"]
    for p in (dst, dst + ".tar"):
        if os.path.isdir(p):
            shutil.rmtree(p)
        elif os.path.exists(p):
            os.remove(p)
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    cpu0 = cpu_seconds()  # (the imports below are not timed; their CPU is taken off at the end)
    if lib in ("shardflow", "shardflow-walk"):
        import contextlib
        import io

        from shardflow.cli import build_parser, main as sf_main

        build_parser()  # imports every converter module: import time, not timed (as the harness)
        order = ["--order", "walk"] if lib == "shardflow-walk" else []  # (the default: shuffled)
        cpu0, t0 = cpu_seconds(), time.perf_counter()
        with contextlib.redirect_stdout(io.StringIO()) as out:
            rc = sf_main(["convert", "imagefolder", tree, dst, *order])
        dt = time.perf_counter() - t0
        assert rc == 0, out.getvalue()
        shards = len([f for f in os.listdir(dst) if f.endswith(".tar")])
    elif lib == "litdata":
        import litdata

        cpu0, t0 = cpu_seconds(), time.perf_counter()
        paths = [p for p, _ in list_tree(tree)]
        litdata.optimize(fn=lit_fn, inputs=paths, output_dir=dst, num_workers=WORKERS, chunk_size=a["count"])
        dt = time.perf_counter() - t0
        shards = len([f for f in os.listdir(dst) if f.endswith(".bin")])
    elif lib == "mosaic":
        from streaming import MDSWriter

        cpu0, t0 = cpu_seconds(), time.perf_counter()
        with MDSWriter(out=dst, columns={"jpg": "bytes", "cls": "int"}, size_limit=a["mds_size"]) as w:
            for p, label in list_tree(tree):
                with open(p, "rb") as f:
                    w.write({"jpg": f.read(), "cls": label})
        dt = time.perf_counter() - t0
        shards = len([f for f in os.listdir(dst) if f.endswith(".mds")])
    elif lib == "tar":
        t0 = time.perf_counter()
        subprocess.run(["tar", "cf", dst + ".tar", "-C", os.path.dirname(tree), os.path.basename(tree)], check=True)
        dt = time.perf_counter() - t0
        shards = 1
    else:
        raise ValueError(lib)
    import resource

    workers = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024  # KiB on Linux
    return {"seconds": dt, "cpu": cpu_seconds() - cpu0, "shards": shards, "workers_mb": workers}


def cpu_seconds() -> float:
    """CPU seconds of this process and of the children it waited for (writer processes, tar)."""
    import resource

    s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime


def open_dataset(a: dict) -> dict:
    """``ShardDataset(dst)``: seconds to ``len()`` and to the first sample (child)."""
    t0 = time.perf_counter()
    import shardflow

    cls = shardflow.ShardDataset  # resolves the lazy import (torch): not timed
    t1 = time.perf_counter()
    ds = cls(a["dst"])
    n = len(ds)
    t2 = time.perf_counter()
    sample = next(iter(ds))
    t3 = time.perf_counter()
    return {"import": t1 - t0, "len": t2 - t1, "first": t3 - t1, "n": n, "fields": sorted(sample)}


# ------------------------------------------------------------------ driver


def tvstub(given: str | None) -> str | None:
    """The harness's torchvision stand-in (``shared/bench/peers/tvstub``) beside the checkout."""
    if given:
        return given
    d = HERE
    while d != os.path.dirname(d):
        d = os.path.dirname(d)
        path = os.path.join(d, "shared", "bench", "peers", "tvstub")
        if os.path.isdir(path):
            return path
    return None


class Poll(threading.Thread):
    """The largest sum of RSS over a process and its descendants, polled every 0.2 s (psutil)."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid = pid
        self.peak = 0
        self.stop = threading.Event()

    def run(self) -> None:
        import psutil

        try:
            root = psutil.Process(self.pid)
        except psutil.Error:
            return
        while not self.stop.is_set():
            total = 0
            try:
                procs = [root, *root.children(recursive=True)]
            except psutil.Error:
                return
            for p in procs:
                try:
                    total += p.memory_info().rss
                except psutil.Error:
                    pass
            self.peak = max(self.peak, total)
            self.stop.wait(0.2)


def run_child(args: dict, env: dict, timeout: float = 3600) -> dict | None:
    """Run one child; its result with ``main_mb`` (wait4's peak RSS) and ``tree_mb`` (polled);
    None when it ran past ``timeout`` seconds (its process group killed)."""
    p = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child", json.dumps(args)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                         start_new_session=True)  # fmt: skip
    poll = Poll(p.pid)
    poll.start()
    killer = threading.Timer(timeout, lambda: os.killpg(p.pid, 9))
    killer.start()
    out_box: list[str] = []
    reader = threading.Thread(target=lambda: out_box.append(p.stdout.read()), daemon=True)  # type: ignore[union-attr]
    reader.start()
    err = p.stderr.read()  # type: ignore[union-attr]
    _, status, usage = os.wait4(p.pid, 0)
    p.returncode = os.waitstatus_to_exitcode(status)
    timed_out = not killer.is_alive()
    killer.cancel()
    poll.stop.set()
    reader.join()
    if timed_out:
        print(f"{args['kind']} {args.get('lib', '')}: killed after {timeout:.0f} s", flush=True)
        return None
    lines = [ln for ln in "".join(out_box).splitlines() if ln.startswith("@@RESULT ")]
    if p.returncode != 0 or not lines:
        raise SystemExit(f"{args['kind']} {args.get('lib', '')} failed (exit {p.returncode}):\n{err[-3000:]}")
    res = json.loads(lines[-1][len("@@RESULT ") :])
    res.update(main_mb=usage.ru_maxrss / 1024, tree_mb=poll.peak / 2**20)
    return res


def child_env(lib: str, stub: str | None) -> dict:
    env = dict(os.environ)
    if lib == "mosaic":
        if stub is None:
            raise SystemExit("mosaic needs the harness's tvstub folder: pass --tvstub")
        env["PYTHONPATH"] = stub
    else:  # this checkout's shardflow, whatever is installed
        env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    return env


def count_tree(tree: str) -> tuple[int, int]:
    """Files and their bytes (one walk)."""
    n = size = 0
    for c in os.scandir(tree):
        if c.is_dir():
            for f in os.scandir(c.path):
                n += 1
                size += f.stat().st_size
    return n, size


def warm(tree: str) -> float:
    """Read every file once (seconds): the page cache holds the tree and its access times are
    set (``relatime`` writes an inode on a file's first read after a change), so the first
    library timed pays neither."""
    t0 = time.perf_counter()
    for c in os.scandir(tree):
        if c.is_dir():
            for f in os.scandir(c.path):
                with open(f.path, "rb") as fh:
                    fh.read()
    return time.perf_counter() - t0


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def report(results: dict, n: int, opened: list[dict], load: list[str]) -> str:
    lines = [f"\n{n:,} files; load (uptime) at the start of each round: {'; '.join(load)}",
             "| library | wall s (median) | files/s | runs, files/s | CPU us/file, all processes | "
             "peak RSS MB main / largest worker / tree sum |", "|---|---:|---:|---|---:|---|"]  # fmt: skip
    for lib, runs in results.items():
        if not runs:
            continue
        secs = [r["seconds"] for r in runs]
        mem = max(runs, key=lambda r: r["main_mb"])
        cpu = med([r["cpu"] for r in runs]) / n * 1e6
        lines.append(f"| {lib} | {med(secs):.2f} | {n / med(secs):,.0f} | {', '.join(f'{n / s:,.0f}' for s in secs)} | "
                     f"{cpu:.1f} | {mem['main_mb']:.0f} / {mem['workers_mb']:.0f} / {mem['tree_mb']:.0f} |")  # fmt: skip
    rate = {lib: n / med([r["seconds"] for r in runs]) for lib, runs in results.items() if runs}
    sf = rate.get("shardflow")
    if sf:
        lines.append("\nratios (shardflow files/s over theirs; bars in brackets):")
        if "tar" in rate:
            lines.append(f"  vs tar cf: {sf / rate['tar']:.2f}x  [>= 0.5x]")
        peers = {k: v for k, v in rate.items() if k in ("litdata", "mosaic")}
        if peers:
            best = max(peers, key=peers.get)  # type: ignore[arg-type]
            lines.append(f"  vs the faster of LitData and Mosaic ({best}): {sf / peers[best]:.2f}x  [>= 1.5x]")
        if "shardflow-walk" in rate:
            lines.append(f"  default (shuffled) vs --order walk: {sf / rate['shardflow-walk']:.2f}x  [>= 0.9x, issue 30]")
        peak = max(r["main_mb"] for r in results["shardflow"])
        wpeak = max(r["workers_mb"] for r in results["shardflow"])
        lines.append(f"  peak RSS: main {peak:.0f} MB, largest writer {wpeak:.0f} MB  [< 300 MB]")
    if opened:
        ln, first = med([o["len"] for o in opened]), med([o["first"] for o in opened])
        lines.append(f"  ShardDataset(dst): len() {ln:.3f} s, first sample {first:.3f} s after the constructor starts "
                     f"(imports {med([o['import'] for o in opened]):.2f} s, untimed; n={opened[0]['n']:,})  [< 2 s]")  # fmt: skip
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("tree", nargs="?")
    ap.add_argument("--child")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--libs", default=",".join(LIBS))
    ap.add_argument("--work", default="/tmp/bench-million")
    ap.add_argument("--json", default=None, help="write every run's figures here")
    ap.add_argument("--tvstub", default=None, help="the harness's torchvision stand-in folder (for mosaic)")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds a conversion may take (then killed, left out)")
    ap.add_argument("--keep", action="store_true", help="keep the outputs (default: removed, shardflow's last kept)")
    args = ap.parse_args()
    if args.child:
        a = json.loads(args.child)
        res = convert(a) if a["kind"] == "convert" else open_dataset(a)
        print("@@RESULT " + json.dumps(res), flush=True)
        os._exit(0)
    if not args.tree:
        ap.error("TREE is required")
    libs = args.libs.split(",")
    stub = tvstub(args.tvstub)
    n, size = count_tree(args.tree)
    mds_size = int(MAX_COUNT * (size / max(n, 1) + 16) * 1.01)
    print(f"{args.tree}: {n:,} files, {size / 1e6:,.1f} MB; {MAX_COUNT} per shard; libraries {libs}", flush=True)
    print(f"warm-up read of every file: {warm(args.tree):.1f} s", flush=True)
    results: dict[str, list[dict]] = {lib: [] for lib in libs}
    load: list[str] = []
    for r in range(args.repeat):
        load.append(os.popen("uptime").read().strip().split("load average:")[-1].strip())
        for lib in libs if r % 2 == 0 else libs[::-1]:
            dst = os.path.join(args.work, lib)
            res = run_child(dict(kind="convert", lib=lib, tree=os.path.abspath(args.tree), dst=dst, count=MAX_COUNT,
                                 mds_size=mds_size), child_env(lib, stub), args.timeout)  # fmt: skip
            if res is None:
                continue
            results[lib].append(res)
            print(f"round {r + 1} {lib}: {res['seconds']:.2f} s, {n / res['seconds']:,.0f} files/s, CPU {res['cpu']:.2f} s, "
                  f"{res['shards']} shards, "
                  f"peak RSS main {res['main_mb']:.0f} MB, workers {res['workers_mb']:.0f} MB, tree {res['tree_mb']:.0f} MB "
                  f"(load {os.getloadavg()[0]:.1f})", flush=True)  # fmt: skip
            if not args.keep and lib != "shardflow":
                for p in (dst, dst + ".tar"):
                    shutil.rmtree(p, ignore_errors=True) if os.path.isdir(p) else os.path.exists(p) and os.remove(p)
    opened = []
    if "shardflow" in libs:
        for _ in range(max(args.repeat, 2)):
            res = run_child(dict(kind="open", dst=os.path.join(args.work, "shardflow")), child_env("shardflow", stub))
            opened += [res] if res else []
    text = report(results, n, opened, load)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"files": n, "bytes": size, "runs": results, "open": opened, "load": load}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
