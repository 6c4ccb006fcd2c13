"""Peak memory and speed of ``shardflow convert imagefolder`` as the file count grows (case C15).

For each size CLASSESxPER_CLASS it builds (or reuses) an ImageFolder tree whose files are HARD
LINKS to a handful of real small JPEGs (crops of scikit-image photos): fast to make, and fine for
measuring the walk and the memory, though every file shares its bytes with many others (so the
source is read from the page cache). It then runs the real command line in a subprocess::

    python -m shardflow.cli convert imagefolder TREE OUT --workers W --max-count M --no-resume

and reports, in a Markdown table:

- peak RSS of the converting process (psutil polling, every 50 ms);
- ``ru_maxrss`` of the largest process of the run (converter or writer worker), from
  ``getrusage(RUSAGE_CHILDREN)`` in a wrapper process that runs only that command;
- peak of the summed RSS and of the summed USS (memory private to each process, not
  double-counting pages shared by the forked workers) over the process tree, by polling;
- wall time, files/s, shard count; and the time of the CLI's counting pass (progress total).

Usage::

    python tools/bench_convert_memory.py 100x1000 1000x1000 [--root /tmp/shardflow-bench] [--workers 2]

Trees are kept under ROOT for the next run (``--clean`` removes them afterwards); shard outputs
are deleted after each measurement.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

MB = 1024 * 1024

_WRAPPER = (
    "import json, resource, subprocess, sys\n"
    "rc = subprocess.run(sys.argv[1:], stdout=subprocess.PIPE, text=True)\n"
    "print(json.dumps({'rc': rc.returncode, 'stdout': rc.stdout,"
    " 'maxrss_kb': resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss}))\n"
)


def originals(folder: Path, count: int = 4) -> list[Path]:
    """``count`` distinct real JPEGs (crops of scikit-image photos, about 1-2 KB each)."""
    import skimage.data
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    photos = [skimage.data.astronaut(), skimage.data.coffee(), skimage.data.chelsea(), skimage.data.rocket()]
    paths = []
    for i in range(count):
        photo = photos[i % len(photos)]
        top, left = 40 + 7 * (i // len(photos)), 60 + 5 * (i // len(photos))
        crop = Image.fromarray(photo[top : top + 128, left : left + 128]).resize((32, 32), Image.Resampling.BILINEAR)
        out = io.BytesIO()
        crop.save(out, "JPEG", quality=90)
        path = folder / f"{i}.jpg"
        path.write_bytes(out.getvalue())
        paths.append(path)
    return paths


def build_tree(root: Path, classes: int, per_class: int) -> Path:
    """ROOT/tree-CxP: classes x per_class hard links (reused when complete)."""
    tree = root / f"tree-{classes}x{per_class}"
    done = root / f"tree-{classes}x{per_class}.complete"
    if done.exists():
        print(f"reusing {tree}", flush=True)
        return tree
    shutil.rmtree(tree, ignore_errors=True)
    # ext4 allows 65,000 links per inode: at most 50,000 files per original
    count = max(4, -(-classes * per_class // 50_000))
    sources = [str(p) for p in originals(root / f"originals-{count}", count)]
    start = time.perf_counter()
    for c in range(classes):
        folder = tree / f"n{c:08d}"
        folder.mkdir(parents=True)
        base = str(folder)
        for j in range(per_class):
            os.link(sources[(c + j) % len(sources)], f"{base}/{j + 1:04d}.jpg")
        if (c + 1) % max(1, classes // 10) == 0:
            print(f"  linked {(c + 1) * per_class:,} files ({time.perf_counter() - start:.0f} s)", flush=True)
    done.touch()
    return tree


class TreePoller:
    """Polls RSS/USS of a process and its descendants until stopped; keeps the peaks."""

    def __init__(self, pid: int, interval: float = 0.05) -> None:
        self.pid = pid
        self.interval = interval
        self.main_rss = self.sum_rss = self.sum_uss = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> TreePoller:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        try:
            top = psutil.Process(self.pid)
        except psutil.NoSuchProcess:
            return
        while not self._stop.is_set():
            try:
                # the wrapper's child is the converter; its children are the writer workers
                converters = top.children()
                procs = converters + [p for c in converters for p in c.children(recursive=True)]
                rss = uss = 0
                for p in procs:
                    info = p.memory_full_info()
                    rss += info.rss
                    uss += info.uss
                if converters:
                    self.main_rss = max(self.main_rss, converters[0].memory_info().rss)
                self.sum_rss = max(self.sum_rss, rss)
                self.sum_uss = max(self.sum_uss, uss)
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                pass
            self._stop.wait(self.interval)


def count_pass_seconds(tree: Path) -> float:
    """Time of the counting pass the CLI runs for a progress total (fresh process)."""
    code = (
        "import sys, time\n"
        "from shardflow.convert.images.imagefolder import count_images\n"
        "t = time.perf_counter(); n = sum(count_images(sys.argv[1]).values())\n"
        "print(time.perf_counter() - t, n)\n"
    )
    out = subprocess.run([sys.executable, "-c", code, str(tree)], capture_output=True, text=True, check=True)
    return float(out.stdout.split()[0])


def measure(tree: Path, out: Path, workers: int, max_count: int) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    cmd = [
        sys.executable, "-m", "shardflow.cli", "convert", "imagefolder", str(tree), str(out),
        "--workers", str(workers), "--max-count", str(max_count), "--no-resume",
    ]  # fmt: skip
    start = time.perf_counter()
    wrapper = subprocess.Popen([sys.executable, "-c", _WRAPPER, *cmd], stdout=subprocess.PIPE, text=True)
    with TreePoller(wrapper.pid) as poller:
        stdout, _ = wrapper.communicate()
    wall = time.perf_counter() - start
    result = json.loads(stdout)
    if result["rc"] != 0:
        raise SystemExit(f"conversion failed (exit {result['rc']}): {' '.join(cmd)}")
    manifest = json.loads((out / "shardflow.json").read_text())
    files = sum(s["samples"] for s in manifest["shards"])
    shutil.rmtree(out)
    return {
        "files": files,
        "shards": len(manifest["shards"]),
        "wall": wall,
        "cli": result["stdout"].strip(),
        "main_rss": poller.main_rss / MB,
        "maxrss": result["maxrss_kb"] / 1024,
        "sum_rss": poller.sum_rss / MB,
        "sum_uss": poller.sum_uss / MB,
        "command": " ".join(["shardflow", *cmd[3:]]),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("sizes", nargs="*", default=["100x1000", "1000x1000"], help="CLASSESxPER_CLASS (default 100x1000 1000x1000)")
    parser.add_argument("--root", type=Path, default=Path("/tmp/shardflow-bench"), help="where trees and outputs live")
    parser.add_argument("--workers", type=int, default=2, help="converter writer processes (default 2)")
    parser.add_argument("--max-count", type=int, default=10_000, help="samples per shard (default 10000)")
    parser.add_argument("--clean", action="store_true", help="remove the trees afterwards")
    args = parser.parse_args(argv)

    rows = []
    for size in args.sizes:
        classes, per_class = (int(x) for x in size.lower().split("x"))
        print(f"== {classes} classes x {per_class} files", flush=True)
        tree = build_tree(args.root, classes, per_class)
        counting = count_pass_seconds(tree)
        row = measure(tree, args.root / f"out-{classes}x{per_class}", args.workers, args.max_count)
        row.update(size=f"{classes} x {per_class}", counting=counting)
        print(f"  {row['command']}\n  -> {row['cli']}", flush=True)
        rows.append(row)
        if args.clean:
            shutil.rmtree(tree)
            (args.root / f"tree-{classes}x{per_class}.complete").unlink()

    print()
    print(f"`shardflow convert imagefolder` on hard-linked JPEG trees, --workers {args.workers}, --max-count {args.max_count}, {os.cpu_count()} CPUs")
    print()
    print("| tree | files | shards | wall s | files/s | converter peak RSS MB | largest process ru_maxrss MB | tree peak RSS sum MB | tree peak USS sum MB | count pass s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['size']} | {r['files']:,} | {r['shards']} | {r['wall']:.1f} | {r['files'] / r['wall']:,.0f} | "
            f"{r['main_rss']:.0f} | {r['maxrss']:.0f} | {r['sum_rss']:.0f} | {r['sum_uss']:.0f} | {r['counting']:.1f} |"
        )
    if len(rows) > 1:
        growth = rows[-1]["sum_rss"] - rows[0]["sum_rss"]
        print(f"\npeak RSS sum grows by {growth:+.0f} MB from {rows[0]['files']:,} to {rows[-1]['files']:,} files")
    return 0


if __name__ == "__main__":
    sys.exit(main())
