#!/usr/bin/env python3
"""shardflow side by side with its peers, on data this script makes, in one run.

Peers: webdataset, LitData (``litdata.optimize`` + ``StreamingDataset`` /
``StreamingDataLoader``), MosaicML Streaming (``MDSWriter`` + ``StreamingDataset`` /
``StreamingDataLoader``) and a plain one-file-per-sample ``Dataset`` (ImageFolder
style, Pillow decode). Install them with ``pip install -e ".[peers]"``; a peer that
is not installed is skipped with a message.

Two data sets: JPEGs of 64x64 (synthetic: smooth colour fields plus noise) and
photo-sized JPEGs of about 400x350 (random crops, flips and scales of the
photographs scikit-learn ships, or synthetic ones without scikit-learn).

Measured, per data set:

* conversion of the image tree, files/s (``tar cf`` of the tree as the floor);
* raw iteration, one process, samples as bytes;
* read + decode to uint8 RGB arrays, one process (beside the Pillow and
  simplejpeg decode limits: the same bytes in RAM decoded in a loop);
* one epoch of a 2-worker DataLoader, shuffle, batch 64, CHW uint8 tensors;
* time to the first batch of that loader, fresh and after a mid-epoch resume.

Each library runs in a process of its own per repetition, and repetitions
alternate the libraries (A B C A B C ...), so that machine noise hits all alike.
shardflow's sources are byte-compiled first, as an installed package's are (see
:func:`byte_compile_shardflow`).
``shardflow-noseed`` (a reader only: shardflow's data, ``sample_seeding=False``) is
the baseline of what per-sample seeding costs, read alternated beside ``shardflow``.
The table gives medians and [min-max] ranges; the ratios are what to compare
across machines.

usage: python tools/bench_peers.py [--quick] [--repeat 3] [--work DIR] [--small N] [--photos N]
                                   [--only shardflow,litdata,...] [--sets small,photo]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import warnings
from typing import Any, Callable

import numpy as np

# the peers' decode wraps Pillow's read-only array without a copy, as a user's would
warnings.filterwarnings("ignore", message="The given NumPy array is not writable")

LIBS = ("shardflow", "litdata", "mosaic", "webdataset", "files", "shardflow-noseed")
# readers only: they read another library's converted data instead of converting their own
READS_OF = {"shardflow-noseed": "shardflow"}
BATCH = 64
WORKERS = 2


# --------------------------------------------------------------------------- data


def _save_jpeg(arr: np.ndarray, path: str) -> None:
    from PIL import Image

    Image.fromarray(arr).save(path, quality=90)


def make_small(root: str, n: int, classes: int = 20, size: int = 64) -> None:
    """n synthetic JPEGs of size x size in ``classes`` class folders."""
    rng = np.random.default_rng(0)
    yy, xx = np.mgrid[0:size, 0:size]
    for i in range(n):
        c = i % classes
        d = os.path.join(root, f"class_{c:03d}")
        os.makedirs(d, exist_ok=True)
        a = rng.uniform(0, 6, 3)
        img = np.stack([127 + 120 * np.sin(xx / size * a[k] + yy / size * a[(k + 1) % 3]) for k in range(3)], -1)
        img += rng.normal(0, 8, img.shape)
        _save_jpeg(np.clip(img, 0, 255).astype(np.uint8), os.path.join(d, f"{i:07d}.jpg"))


def _photos() -> list[np.ndarray]:
    try:
        from sklearn.datasets import load_sample_images

        return [np.asarray(im) for im in load_sample_images().images]
    except ImportError:
        print("scikit-learn absent: photo-sized images are synthetic", file=sys.stderr)
        rng = np.random.default_rng(1)
        yy, xx = np.mgrid[0:480, 0:640]
        base = np.stack([127 + 120 * np.sin(xx / 37.0 + k) * np.cos(yy / 23.0 - k) for k in range(3)], -1)
        return [np.clip(base + rng.normal(0, 20, base.shape), 0, 255).astype(np.uint8)]


def make_photos(root: str, n: int, classes: int = 10, w: int = 400, h: int = 350) -> None:
    """n JPEGs of about w x h cut from photographs (random crops, scales, flips)."""
    from PIL import Image

    rng = np.random.default_rng(2)
    sources = _photos()
    for i in range(n):
        src = sources[i % len(sources)]
        scale = rng.uniform(0.75, 1.0)
        cw, ch = int(w * scale), int(h * scale)
        y = int(rng.integers(0, src.shape[0] - ch))
        x = int(rng.integers(0, src.shape[1] - cw))
        crop = Image.fromarray(src[y : y + ch, x : x + cw]).resize((w, h))
        arr = np.asarray(crop)
        if rng.random() < 0.5:
            arr = arr[:, ::-1]
        d = os.path.join(root, f"class_{i % classes:03d}")
        os.makedirs(d, exist_ok=True)
        _save_jpeg(np.ascontiguousarray(arr), os.path.join(d, f"{i:07d}.jpg"))


def list_tree(root: str) -> list[tuple[str, int]]:
    """(path, class index) of every image, classes and files sorted."""
    classes = sorted(e.name for e in os.scandir(root) if e.is_dir())
    out = []
    for c, name in enumerate(classes):
        d = os.path.join(root, name)
        out += [(os.path.join(d, f), c) for f in sorted(os.listdir(d))]
    return out


def ensure_tree(root: str, kind: str, n: int) -> None:
    stamp = os.path.join(root, ".complete")
    if os.path.exists(stamp) and open(stamp).read() == str(n):
        return
    shutil.rmtree(root, ignore_errors=True)
    (make_small if kind == "small" else make_photos)(root, n)
    with open(stamp, "w") as f:
        f.write(str(n))


# ------------------------------------------------------------------ peer imports


def import_mosaic() -> Any:
    """``streaming.base`` without ``streaming/__init__`` (which imports torchvision through
    ``streaming.vision``; torchvision may not load with this torch)."""
    import importlib.util
    import types

    if "streaming" not in sys.modules:
        spec = importlib.util.find_spec("streaming")
        if spec is None or spec.submodule_search_locations is None:
            raise ImportError("mosaicml-streaming is not installed")
        pkg = types.ModuleType("streaming")
        pkg.__path__ = list(spec.submodule_search_locations)
        sys.modules["streaming"] = pkg
    import streaming.base as base

    return base


def available(lib: str) -> str | None:
    """None when the peer can run, else why not."""
    try:
        if lib == "litdata":
            import litdata  # noqa: F401
        elif lib == "mosaic":
            import_mosaic()
        elif lib == "webdataset":
            import webdataset  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any failure to import skips the peer
        return f"{type(e).__name__}: {e}"
    return None


# ------------------------------------------------------------------ conversion


def _lit_item(item: tuple[str, int]) -> dict[str, Any]:
    path, c = item
    with open(path, "rb") as f:
        return {"jpg": f.read(), "cls": c}


def convert(lib: str, tree: str, out: str, per_shard: int) -> float:
    """Convert ``tree`` into ``out`` with ``lib``; returns the seconds taken."""
    shutil.rmtree(out, ignore_errors=True)
    t0 = time.perf_counter()
    if lib == "shardflow":
        from shardflow.convert.engine.engine import ConvertOptions
        from shardflow.convert.images.imagefolder import convert_imagefolder

        convert_imagefolder(tree, out, options=ConvertOptions(max_count=per_shard, workers=WORKERS))
    elif lib == "tar":
        os.makedirs(out)
        subprocess.run(["tar", "cf", os.path.join(out, "tree.tar"), "-C", tree, "."], check=True)
    elif lib == "mosaic":
        base = import_mosaic()
        items = list_tree(tree)
        mean = os.path.getsize(items[0][0]) + 1024
        with base.MDSWriter(out=out, columns={"jpg": "bytes", "cls": "int"}, size_limit=mean * per_shard) as w:
            for path, c in items:
                with open(path, "rb") as f:
                    w.write({"jpg": f.read(), "cls": c})
    elif lib == "litdata":
        import contextlib

        import litdata

        items = list_tree(tree)
        with open(os.devnull, "w") as null, contextlib.redirect_stdout(null), contextlib.redirect_stderr(null):
            litdata.optimize(fn=_lit_item, inputs=items, output_dir=out, chunk_size=per_shard,
                             num_workers=WORKERS, reorder_files=False, verbose=False, start_method="fork")
    elif lib == "webdataset":
        import webdataset as wds

        os.makedirs(out)
        with wds.ShardWriter(os.path.join(out, "train-%06d.tar"), maxcount=per_shard, verbose=0) as w:
            for path, c in list_tree(tree):
                with open(path, "rb") as f:
                    key = os.path.relpath(path, tree).rsplit(".", 1)[0]
                    w.write({"__key__": key, "jpg": f.read(), "cls": c})
    else:
        raise ValueError(lib)
    return time.perf_counter() - t0


# ------------------------------------------------------------------ reading


def pil_rgb(b: bytes) -> np.ndarray:
    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(b)).convert("RGB"))


def to_chw(b: bytes) -> Any:
    import torch

    return torch.from_numpy(pil_rgb(b)).permute(2, 0, 1)


class Pipelines:
    """What one library does on one data set: raw, decode and loader builders."""

    def __init__(self, lib: str, data: str, tree: str, n: int) -> None:
        self.lib, self.data, self.tree, self.n = READS_OF.get(lib, lib), data, tree, n
        # shardflow-noseed: shardflow with per-sample seeding off, the baseline of its cost
        self.options = {"sample_seeding": False} if lib == "shardflow-noseed" else {}

    # raw iteration: an iterator of (bytes, cls) or dict samples
    def raw(self) -> Any:
        lib, data = self.lib, self.data
        if lib == "shardflow":
            import shardflow

            return shardflow.ShardDataset(data, decode=None, **self.options)
        if lib == "litdata":
            import litdata

            return litdata.StreamingDataset(data)
        if lib == "mosaic":
            return import_mosaic().StreamingDataset(local=data, shuffle=False, batch_size=1)
        if lib == "webdataset":
            import webdataset as wds

            return wds.WebDataset(self._urls(), shardshuffle=False)
        return (open(p, "rb").read() for p, _ in list_tree(self.tree))

    def decoded(self, fast: bool = False) -> Any:
        lib = self.lib
        if lib == "shardflow":
            import shardflow

            options = {"jpeg_decoder": "simplejpeg"} if fast else {}
            return shardflow.ShardDataset(self.data, decode=shardflow.DecodeOptions(image="numpy", **options),
                                          fields=("jpg", "cls"), **self.options)
        if lib == "webdataset":
            import webdataset as wds

            return wds.WebDataset(self._urls(), shardshuffle=False).decode("rgb8").to_tuple("jpg", "cls")
        if lib == "files":
            return ((pil_rgb(open(p, "rb").read()), c) for p, c in list_tree(self.tree))
        return ((pil_rgb(s["jpg"]), s["cls"]) for s in self.raw())

    def loader(self, state: Any = None, fast: bool = False) -> Any:
        lib, data = self.lib, self.data
        if lib == "shardflow":
            import shardflow

            options = shardflow.DecodeOptions(image="torch", jpeg_decoder="simplejpeg" if fast else "pillow")
            ds = shardflow.ShardDataset(data, shuffle=True, decode=options, fields=("jpg", "cls"), **self.options)
            ld = shardflow.loader(ds, batch_size=BATCH, num_workers=WORKERS)
        elif lib == "litdata":
            import litdata

            ds = litdata.StreamingDataset(data, shuffle=True, transform=_lit_decode)
            ld = litdata.StreamingDataLoader(ds, batch_size=BATCH, num_workers=WORKERS)
        elif lib == "mosaic":
            ds = _mosaic_decoding()(local=data, shuffle=True, batch_size=BATCH)
            ld = import_mosaic().StreamingDataLoader(ds, batch_size=BATCH, num_workers=WORKERS)
        elif lib == "webdataset":
            import torch
            import webdataset as wds

            ds = (
                wds.WebDataset(self._urls(), shardshuffle=100, nodesplitter=None, workersplitter=wds.split_by_worker)
                .shuffle(1000)
                .decode("rgb8")
                .to_tuple("jpg", "cls")
                .map_tuple(lambda a: torch.from_numpy(a).permute(2, 0, 1), lambda c: c)
                .batched(BATCH)
            )
            ld = wds.WebLoader(ds, batch_size=None, num_workers=WORKERS)
        else:
            import torch.utils.data as tud

            ld = tud.DataLoader(_Files(list_tree(self.tree)), batch_size=BATCH, shuffle=True, num_workers=WORKERS)
        if state is not None:
            ld.load_state_dict(state)
        return ld

    def resumable(self) -> bool:
        return self.lib in ("shardflow", "litdata", "mosaic")

    def _urls(self) -> list[str]:
        return sorted(os.path.join(self.data, f) for f in os.listdir(self.data) if f.endswith(".tar"))


def _lit_decode(item: dict[str, Any]) -> tuple[Any, int]:
    return to_chw(item["jpg"]), item["cls"]


def _mosaic_decoding() -> type:
    base = import_mosaic()

    class Decoding(base.StreamingDataset):
        def __getitem__(self, i: int) -> tuple[Any, int]:
            s = super().__getitem__(i)
            return to_chw(s["jpg"]), s["cls"]

    return Decoding


class _Files:
    """ImageFolder-style map-style dataset: one file per sample, Pillow decode."""

    def __init__(self, items: list[tuple[str, int]]) -> None:
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> tuple[Any, int]:
        path, c = self.items[i]
        with open(path, "rb") as f:
            return to_chw(f.read()), c


def _batch_len(b: Any) -> int:
    if isinstance(b, dict):
        return len(b["cls"])
    return len(b[1])


def timed_count(make: Callable[[], Any], min_time: float = 0.5, passes: int = 8) -> float:
    """Samples/s over whole passes (repeated up to ``passes`` until ``min_time`` has passed).

    An untimed start first (imports, first open), as a training job has it done once.
    """
    warm = iter(make())
    next(warm, None)
    del warm
    total, t0 = 0, time.perf_counter()
    for _ in range(passes):
        total += sum(1 for _ in make())
        if time.perf_counter() - t0 >= min_time:
            break
    return total / (time.perf_counter() - t0)


def measure(lib: str, data: str, tree: str, n: int, quick: bool) -> dict[str, float]:
    """Every read measurement of one library on one data set, in this process."""
    p = Pipelines(lib, data, tree, n)
    out: dict[str, float] = {}
    out["raw"] = timed_count(p.raw, 0.3 if quick else 1.0)
    out["decode"] = timed_count(p.decoded, 0.3 if quick else 1.0, passes=1 if not quick else 2)
    if p.lib == "shardflow":
        try:
            import simplejpeg  # noqa: F401

            out["decode_fast"] = timed_count(lambda: p.decoded(fast=True), 0.3, passes=1)
        except ImportError:
            pass
        except TypeError:  # no fast decoder option in this version
            pass
        else:
            ld = p.loader(fast=True)
            t0 = time.perf_counter()
            seen = sum(_batch_len(b) for b in ld)
            out["epoch_fast"] = seen / (time.perf_counter() - t0)
            del ld
    # time to first batch, fresh
    t0 = time.perf_counter()
    ld = p.loader()
    it = iter(ld)
    next(it)
    out["first_batch"] = time.perf_counter() - t0
    del it, ld
    # one epoch; the state is taken half way
    ld = p.loader()
    state = None
    seen, t0 = 0, time.perf_counter()
    half = n // BATCH // 2
    for j, b in enumerate(ld):
        seen += _batch_len(b)
        if j + 1 == half and p.resumable():
            state = ld.state_dict()
    out["epoch"] = seen / (time.perf_counter() - t0)
    if seen != n:
        raise SystemExit(f"{lib}: the loader epoch saw {seen} samples, expected {n}")
    del ld
    if state is not None:
        t0 = time.perf_counter()
        ld = p.loader(state)
        it = iter(ld)
        next(it)
        out["resume_first_batch"] = time.perf_counter() - t0
        del it, ld
    return out


def limits(tree: str) -> dict[str, float]:
    """Pillow and simplejpeg decode limits: the same bytes in RAM, decoded in a loop.

    Run in a process that has imported torch, as every reader measured beside it has. That
    matters through glibc's malloc: until a process frees one large mmap'd block (importing
    torch does), malloc serves every block over 128 KiB, such as a photo's ~0.5 MB decode
    buffers, with a fresh mmap, so each 400x350 decode paid ~340 first-touch page faults and
    twice the CPU time (1,321/s here against 1,905/s for LitData's identical Pillow decode).
    """
    import torch  # noqa: F401 - the readers' allocator state (see above)

    blobs = [open(p, "rb").read() for p, _ in list_tree(tree)]
    out = {"pillow": timed_count(lambda: (pil_rgb(b) for b in blobs), 1.0, passes=1)}
    try:
        import simplejpeg

        out["simplejpeg"] = timed_count(lambda: (simplejpeg.decode_jpeg(b) for b in blobs), 1.0, passes=1)
    except ImportError:
        pass
    return out


# ------------------------------------------------------------------ driver


def child(args: argparse.Namespace) -> int:
    """One measurement in this process; prints one JSON line."""
    if args.child == "convert":
        dt = convert(args.lib, args.tree, args.data, args.per_shard)
        res: dict[str, float] = {"convert": args.n / dt}
    elif args.child == "limits":
        res = limits(args.tree)
    else:
        res = measure(args.lib, args.data, args.tree, args.n, args.quick)
    print("RESULT " + json.dumps(res))
    return 0


def run_child(kind: str, lib: str, tree: str, data: str, n: int, per_shard: int, quick: bool) -> dict[str, float]:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", kind, "--lib", lib, "--tree", tree,
           "--data", data, "--n", str(n), "--per-shard", str(per_shard)] + (["--quick"] if quick else [])
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        print(f"  {kind} {lib}: failed (exit {proc.returncode})\n{proc.stderr[-2000:]}", file=sys.stderr)
        return {}
    return json.loads(lines[-1][len("RESULT "):])


def fmt_rate(v: list[float], unit: str = "") -> str:
    if not v:
        return "-"
    med = statistics.median(v)
    if unit == "s":
        return f"{med:.3f} s [{min(v):.3f}-{max(v):.3f}]"
    return f"{med:,.0f} [{min(v):,.0f}-{max(v):,.0f}]"


def report(name: str, n: int, results: dict[str, dict[str, list[float]]], repeat: int) -> None:
    def med(lib: str, key: str) -> float | None:
        v = results.get(lib, {}).get(key)
        return statistics.median(v) if v else None

    print(f"\n### {name}: {n:,} JPEGs; median [min-max] of {repeat} alternating runs\n")
    rows = [
        ("conversion, files/s", "convert", ""),
        ("raw iteration, 1 process, samples/s", "raw", ""),
        ("read + decode to uint8 RGB, 1 process, samples/s", "decode", ""),
        ("DataLoader epoch, 2 workers, shuffle, batch 64, samples/s", "epoch", ""),
        ("time to first batch (2 workers)", "first_batch", "s"),
        ("first batch after a mid-epoch resume", "resume_first_batch", "s"),
    ]
    libs = [lib for lib in ("shardflow", "shardflow-noseed", "litdata", "mosaic", "webdataset", "files", "tar")
            if lib in results]
    print("| | " + " | ".join(libs) + " |")
    print("|---|" + "---:|" * len(libs))
    for label, key, unit in rows:
        cells = [fmt_rate(results[lib].get(key, []), unit) for lib in libs]
        print(f"| {label} | " + " | ".join(cells) + " |")
    lim = results.get("limits", {})
    sf = results.get("shardflow", {})
    print()
    if lim.get("pillow"):
        print(f"Decode limits (bytes in RAM, 1 process): Pillow {fmt_rate(lim['pillow'])}/s"
              + (f", simplejpeg {fmt_rate(lim['simplejpeg'])}/s" if lim.get("simplejpeg") else ""))
        if sf.get("decode_fast"):
            print(f"shardflow with jpeg_decoder='simplejpeg': read + decode {fmt_rate(sf['decode_fast'])}/s, "
                  f"DataLoader epoch {fmt_rate(sf.get('epoch_fast', []))}/s")
    print("\n| shardflow / peer (medians) | ratio |\n|---|---:|")

    def ratio(label: str, a: float | None, b: float | None, inverse: bool = False) -> None:
        if a and b:
            print(f"| {label} | {(b / a if inverse else a / b):.2f}x |")

    for peer in ("litdata", "mosaic", "webdataset", "files"):
        for key, what in (("raw", "raw iteration"), ("decode", "read + decode"), ("epoch", "loader epoch")):
            ratio(f"{what} / {peer}", med("shardflow", key), med(peer, key))
        ratio(f"first batch, {peer} time / shardflow time", med("shardflow", "first_batch"), med(peer, "first_batch"), True)
        ratio(f"first batch after resume, {peer} time / shardflow time", med("shardflow", "resume_first_batch"),
              med(peer, "resume_first_batch"), True)
        ratio(f"conversion / {peer}", med("shardflow", "convert"), med(peer, "convert"))
    ratio("conversion / tar cf", med("shardflow", "convert"), med("tar", "convert"))
    ratio("loader epoch / shardflow-noseed (per-sample seeding on / off)", med("shardflow", "epoch"),
          med("shardflow-noseed", "epoch"))
    a, b = results.get("shardflow", {}).get("epoch", []), results.get("shardflow-noseed", {}).get("epoch", [])
    if a and len(a) == len(b):
        paired = ", ".join(f"{x / y:.3f}" for x, y in zip(a, b))
        print(f"\nloader epoch, shardflow / shardflow-noseed, run by run: {paired}")
    if lim.get("pillow"):
        ratio("read + decode / Pillow limit", med("shardflow", "decode"), statistics.median(lim["pillow"]))
        if sf.get("decode_fast"):
            ratio("read + decode (simplejpeg) / Pillow limit", med("shardflow", "decode_fast"),
                  statistics.median(lim["pillow"]))
            for peer in ("files", "litdata"):
                ratio(f"loader epoch (simplejpeg) / {peer}", med("shardflow", "epoch_fast"), med(peer, "epoch"))


def byte_compile_shardflow() -> None:
    """Byte-compile shardflow's sources, as pip does when it installs a package.

    Where ``PYTHONDONTWRITEBYTECODE`` is set (it is on the development machine), a
    checkout's modules are otherwise compiled again in every child process: about 40 ms
    of every shardflow conversion's import, which the peers, installed in site-packages
    with their ``.pyc`` files, never pay. The ``__pycache__`` folders are git-ignored.
    """
    import compileall
    import importlib.util

    spec = importlib.util.find_spec("shardflow")
    if spec is not None and spec.submodule_search_locations:
        compileall.compile_dir(list(spec.submodule_search_locations)[0], quiet=1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small data sets, one run: a smoke test")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--work", default="/tmp/shardflow-bench-peers")
    ap.add_argument("--small", type=int, default=20000, help="64x64 JPEGs")
    ap.add_argument("--photos", type=int, default=5000, help="~400x350 JPEGs")
    ap.add_argument("--only", default=",".join(LIBS), help="comma-separated libraries")
    ap.add_argument("--sets", default="small,photo")
    ap.add_argument("--no-convert", action="store_true", help="reuse converted data from an earlier run")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--lib", help=argparse.SUPPRESS)
    ap.add_argument("--tree", help=argparse.SUPPRESS)
    ap.add_argument("--data", help=argparse.SUPPRESS)
    ap.add_argument("--n", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--per-shard", type=int, default=1000, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)
    if args.quick:
        args.small, args.photos, args.repeat = min(args.small, 2000), min(args.photos, 400), 1
    byte_compile_shardflow()
    libs = []
    for lib in args.only.split(","):
        if lib not in LIBS:  # `tar cf` is every run's conversion floor, not a reader
            raise SystemExit(f"--only: unknown library {lib!r}; choose from {', '.join(LIBS)}")
        why = available(lib)
        if why is None:
            libs.append(lib)
        else:
            print(f"skipping {lib}: not importable ({why}); pip install -e '.[peers]'", file=sys.stderr)
    for name in args.sets.split(","):
        n = args.small if name == "small" else args.photos
        per_shard = 1000 if name == "small" else 100
        tree = os.path.join(args.work, f"tree-{name}-{n}")
        print(f"[{name}] making {n} images in {tree}", file=sys.stderr)
        ensure_tree(tree, name, n)
        n = len(list_tree(tree))
        data = {lib: os.path.join(args.work, f"{READS_OF.get(lib, lib)}-{name}-{n}") for lib in libs + ["tar"]}
        data["files"] = tree
        results: dict[str, dict[str, list[float]]] = {}
        converters = [lib for lib in libs + ["tar"] if lib != "files" and lib not in READS_OF]
        for r in range(0 if args.no_convert else args.repeat):
            for lib in converters:
                print(f"[{name}] run {r + 1}: convert {lib}", file=sys.stderr)
                res = run_child("convert", lib, tree, data[lib], n, per_shard, args.quick)
                for k, v in res.items():
                    results.setdefault(lib, {}).setdefault(k, []).append(v)
        for r in range(args.repeat):
            print(f"[{name}] run {r + 1}: decode limits", file=sys.stderr)
            for k, v in run_child("limits", "-", tree, "-", n, per_shard, args.quick).items():
                results.setdefault("limits", {}).setdefault(k, []).append(v)
            for lib in (libs if r % 2 == 0 else libs[::-1]):  # A B C, then C B A
                print(f"[{name}] run {r + 1}: read {lib}", file=sys.stderr)
                for k, v in run_child("read", lib, tree, data[lib], n, per_shard, args.quick).items():
                    results.setdefault(lib, {}).setdefault(k, []).append(v)
        report("64x64" if name == "small" else "~400x350 photos", n, results, args.repeat)
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
