#!/usr/bin/env python3
"""How mixed are the batches? Distinct classes per batch, shardflow's defaults against a permutation.

Builds an ImageFolder of CLASSES x PER tiny JPEGs (issue 30: 200 x 130, about 7.7 classes per
shard of 1,000), then streams, with the defaults (``ShardDataset(shuffle=True, seed=0)``,
``shardflow.loader``, 2 workers, batch 256), two datasets of the same images:

- ``converted``: ``shardflow convert imagefolder SRC DST --max-count 1000`` (the converter's
  default order);
- ``class-ordered``: webdataset-style shards written by ``tarfile``, the classes one after the
  other, 1,000 samples per shard, then ``shardflow index``.

For each it reports the mean number of distinct classes in a batch, the largest class's mean
share of a batch, and the same for a uniform permutation of the labels (what ``RandomSampler``
or ``DistributedSampler`` give), checks that the epoch holds every sample exactly once, and
shows what ``shardflow inspect DST --batches N --json`` predicted (``batches.mean_distinct``).

With ``--peers litdata,mosaic`` it measures the same for the peers on the same images, each with its
defaults, the files given in the walk order (classes one after the other, as users do):

- ``litdata``: ``litdata.optimize(fn, inputs, num_workers=2, chunk_size=MAX_COUNT)``, then
  ``StreamingDataset(dir, shuffle=True, seed=0)`` in ``StreamingDataLoader`` (its default shuffle);
- ``mosaic``: an ``MDSWriter`` loop (``size_limit`` giving about MAX_COUNT samples a shard), then
  ``StreamingDataset(local=dir, shuffle=True, batch_size=B)`` in ``StreamingDataLoader`` (default
  ``py1e``, default ``shuffle_block_size``), in a child process whose PYTHONPATH is the torchvision
  stub of /work/shared/bench/peers (``streaming.vision`` imports torchvision at module level).

Only the labels are counted (nothing decoded).

Usage::

    PYTHONPATH=$PWD python tools/bench_class_mix.py [--classes 200] [--per 130] [--json] [--peers litdata,mosaic]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from collections import Counter

import numpy as np
from PIL import Image


def make_tree(root: str, classes: int, per: int, size: int) -> None:
    """ROOT/class_XXX/NNNNNNN.jpg; a few distinct tiny JPEGs, reused (only the labels matter here)."""
    rng = np.random.default_rng(0)
    blobs = []
    for _ in range(8):
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 255, (size, size, 3), dtype=np.uint8)).save(buf, format="JPEG", quality=90)
        blobs.append(buf.getvalue())
    for c in range(classes):
        d = os.path.join(root, f"class_{c:03d}")
        os.makedirs(d, exist_ok=True)
        for i in range(per):
            with open(os.path.join(d, f"{i:07d}.jpg"), "wb") as f:
                f.write(blobs[(c + i) % len(blobs)])


def write_class_ordered(root: str, dst: str, classes: int, per: int, max_count: int) -> None:
    """Webdataset-style shards, classes one after the other (what users bring), max_count samples each."""
    os.makedirs(dst, exist_ok=True)
    n = 0
    tar = None
    for c in range(classes):
        d = os.path.join(root, f"class_{c:03d}")
        for name in sorted(os.listdir(d)):
            if n % max_count == 0:
                if tar is not None:
                    tar.close()
                tar = tarfile.open(os.path.join(dst, f"train-{n // max_count:06d}.tar"), "w", format=tarfile.USTAR_FORMAT)
            key = f"c{c:03d}_{name.split('.')[0]}"
            with open(os.path.join(d, name), "rb") as f:
                data = f.read()
            for field, payload in (("cls", str(c).encode()), ("jpg", data)):
                info = tarfile.TarInfo(f"{key}.{field}")
                info.size, info.mtime = len(payload), 0
                tar.addfile(info, io.BytesIO(payload))
            n += 1
    if tar is not None:
        tar.close()


def cli(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "shardflow.cli", *args], check=True, stdout=subprocess.DEVNULL)


def mix(batches: list[np.ndarray]) -> dict[str, float]:
    """Mean distinct classes per batch and mean share of the largest class (full batches only)."""
    full = [b for b in batches if len(b) == len(batches[0])]
    distinct = [len(np.unique(b)) for b in full]
    largest = [Counter(b.tolist()).most_common(1)[0][1] / len(b) for b in full]
    return {"mean_distinct": float(np.mean(distinct)), "largest_share": float(np.mean(largest)),
            "worst_distinct": int(np.min(distinct))}


def permutation(labels: np.ndarray, batch: int, seeds: int = 4) -> dict[str, float]:
    """The same figures for uniform permutations of the labels (mean over ``seeds``)."""
    runs = []
    for s in range(seeds):
        p = labels[np.random.default_rng(s).permutation(len(labels))]
        runs.append(mix([p[i : i + batch] for i in range(0, len(p), batch)]))
    return {k: float(np.mean([r[k] for r in runs])) for k in runs[0]}


def inspect_mean(dst: str, batches: int, batch: int) -> float:
    """``shardflow inspect DST --batches N --json``'s ``batches.mean_distinct`` (labels read before training)."""
    out = subprocess.run([sys.executable, "-m", "shardflow.cli", "inspect", dst, "--no-scan", "--json", "--batches",
                          str(batches), "--batch-size", str(batch)], check=True, capture_output=True, text=True)
    return float(json.loads(out.stdout)["batches"]["mean_distinct"])


def stream(dst: str, batch: int, workers: int) -> tuple[list[np.ndarray], int, int]:
    """Batches of labels from the defaults; also (samples yielded, distinct keys)."""
    import shardflow

    ds = shardflow.ShardDataset(dst, shuffle=True, seed=0, decode=None)
    dl = shardflow.loader(ds, batch_size=batch, num_workers=workers)
    out, keys = [], set()
    n = 0
    for b in dl:
        out.append(np.asarray([int(x) for x in b["cls"]]))
        keys.update(b["__key__"])
        n += len(b["__key__"])
    return out, n, len(keys)


TVSTUB = os.environ.get("TVSTUB", "/work/shared/bench/peers/tvstub")


def walk(root: str) -> list[tuple[str, int]]:
    """(path, label) in the ImageFolder walk order: sorted class folders, sorted files."""
    classes = sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d)))
    return [(os.path.join(root, c, f), i) for i, c in enumerate(classes) for f in sorted(os.listdir(os.path.join(root, c)))]


def lit_fn(path: str) -> dict:
    """LitData optimize fn: the raw JPEG bytes and the label (folder name class_XXX -> XXX)."""
    with open(path, "rb") as f:
        return {"jpg": f.read(), "cls": int(os.path.basename(os.path.dirname(path)).split("_")[1])}


def peer_child(lib: str, src: str, dst: str, batch: int, workers: int, max_count: int) -> dict:
    """Build LIB's dataset from SRC (once) and stream it with its defaults: label batches and sample ids."""
    items = walk(src)
    if lib == "litdata":
        import litdata

        if not os.path.isdir(dst):
            litdata.optimize(fn=lit_fn, inputs=[p for p, _ in items], output_dir=dst, num_workers=workers,
                             chunk_size=max_count)
            import multiprocessing  # optimize leaves the start method at spawn: the loader's workers fork

            multiprocessing.set_start_method("fork", force=True)

        class Labels(litdata.StreamingDataset):
            def __getitem__(self, index):
                s = super().__getitem__(index)
                return {"cls": s["cls"], "id": index.index if hasattr(index, "index") else int(index)}

        dl = litdata.StreamingDataLoader(Labels(dst, shuffle=True, seed=0), batch_size=batch, num_workers=workers)
    elif lib == "mosaic":
        from streaming import MDSWriter, StreamingDataLoader, StreamingDataset
        from streaming.base.util import clean_stale_shared_memory

        clean_stale_shared_memory()
        if not os.path.isdir(dst):
            mean = sum(os.path.getsize(p) for p, _ in items) / len(items)
            with MDSWriter(out=dst, columns={"jpg": "bytes", "cls": "int"}, size_limit=int(max_count * (mean + 16) * 1.01)) as w:
                for p, label in items:
                    with open(p, "rb") as f:
                        w.write({"jpg": f.read(), "cls": label})

        class Labels(StreamingDataset):
            def get_item(self, sample_id, retry=7):
                return {"cls": super().get_item(sample_id, retry)["cls"], "id": int(sample_id)}

        dl = StreamingDataLoader(Labels(local=dst, shuffle=True, batch_size=batch), batch_size=batch, num_workers=workers)
    else:
        raise ValueError(f"unknown peer {lib!r} (litdata, mosaic)")
    shards = len([f for f in os.listdir(dst) if f.endswith((".bin", ".mds"))])
    out, ids = [], []
    for b in dl:
        out.append([int(x) for x in b["cls"]])
        ids.extend(int(x) for x in b["id"])
    return {"batches": out, "ids": ids, "shards": shards}


def run_peer(lib: str, src: str, dst: str, args: argparse.Namespace) -> tuple[list[np.ndarray], int, int, int]:
    """peer_child in a child process (Mosaic's with the torchvision stub on PYTHONPATH)."""
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    if lib == "mosaic":
        env["PYTHONPATH"] = TVSTUB
    cmd = [sys.executable, os.path.abspath(__file__), "--peer-child", json.dumps(
        [lib, src, dst, args.batch, args.workers, args.max_count])]
    out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True, timeout=1800)
    res = json.loads(out.stdout.strip().splitlines()[-1])
    return [np.asarray(b) for b in res["batches"]], len(res["ids"]), len(set(res["ids"])), res["shards"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--classes", type=int, default=200)
    ap.add_argument("--per", type=int, default=130)
    ap.add_argument("--size", type=int, default=8, help="image side in pixels")
    ap.add_argument("--max-count", type=int, default=1000)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--work", help="folder to build in (default: a temporary one)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--peers", default="", help="also measure these, comma-separated: litdata,mosaic")
    ap.add_argument("--peer-child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.peer_child:
        print(json.dumps(peer_child(*json.loads(args.peer_child))))
        return 0
    peers = [p for p in args.peers.split(",") if p]
    with tempfile.TemporaryDirectory() as tmp:
        work = args.work or tmp
        src, conv, wds = (os.path.join(work, x) for x in ("src", "converted", "class-ordered"))
        if not os.path.isdir(src):
            make_tree(src, args.classes, args.per, args.size)
        if not os.path.exists(os.path.join(conv, "shardflow.json")):
            cli("convert", "imagefolder", src, conv, "--max-count", str(args.max_count))
        if not os.path.exists(os.path.join(wds, "shardflow.json")):
            write_class_ordered(src, wds, args.classes, args.per, args.max_count)
            cli("index", wds)
        total = args.classes * args.per
        labels = np.repeat(np.arange(args.classes), args.per)
        perm = permutation(labels, args.batch)
        report = {"samples": total, "batch": args.batch, "workers": args.workers, "permutation": perm}
        for name, dst in (("converted", conv), ("class-ordered", wds)):
            batches, n, unique = stream(dst, args.batch, args.workers)
            got = mix(batches)
            got["ratio"] = got["mean_distinct"] / perm["mean_distinct"]
            got["exact_epoch"] = n == total and unique == total
            got["inspect_mean_distinct"] = inspect_mean(dst, len(batches), args.batch)
            report[name] = got
        for lib in peers:
            batches, n, unique, shards = run_peer(lib, src, os.path.join(work, lib), args)
            got = mix(batches)
            got["ratio"] = got["mean_distinct"] / perm["mean_distinct"]
            got["exact_epoch"] = n == total and unique == total
            got["shards"] = shards
            report[lib] = got
    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    print(f"{total} samples, {args.classes} classes, batch {args.batch}, {args.workers} workers")
    print(f"{'':16s}{'distinct/batch':>16s}{'ratio':>8s}{'largest share':>15s}{'worst':>7s}{'exact':>7s}{'inspect':>9s}")
    print(f"{'permutation':16s}{perm['mean_distinct']:16.1f}{1.0:8.2f}{perm['largest_share']:15.1%}{perm['worst_distinct']:7.0f}")
    for name in ("converted", "class-ordered"):
        r = report[name]
        print(f"{name:16s}{r['mean_distinct']:16.1f}{r['ratio']:8.2f}{r['largest_share']:15.1%}"
              f"{r['worst_distinct']:7d}{str(r['exact_epoch']):>7s}{r['inspect_mean_distinct']:9.1f}")
    for name in peers:
        r = report[name]
        print(f"{name:16s}{r['mean_distinct']:16.1f}{r['ratio']:8.2f}{r['largest_share']:15.1%}"
              f"{r['worst_distinct']:7d}{str(r['exact_epoch']):>7s}{'-':>9s}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
