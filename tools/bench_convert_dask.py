"""Converting an ImageFolder tree on Dask vs local processes, from S3, and the client's memory.

Three measurements, each against its peer in the same run:

1. **Engines** (``--files``, default 100,000 = 100 classes x 1,000): files/s of
   ``convert_imagefolder`` with ``workers=W`` local processes vs a Dask ``LocalCluster``
   of W worker processes (one thread each) on 127.0.0.1, alternating A B A B
   (``--repeat``); the ratio is the median over rounds of Dask / local within a round (the
   best rates are shown too). The cluster is started once, before the timed runs; both write the
   same bytes (checked: same shard sha256 list).
2. **S3 source** (``--s3-files``, default 10,000): the tree uploaded to moto's S3 server
   on 127.0.0.1 (a child process), behind a WSGI middleware that counts requests by kind;
   files/s and requests per file (listings, object reads) of the S3 conversion, next to
   the same tree converted from local disk. moto is one Python process answering every
   request, so its files/s is a floor, not what a real bucket gives; the request counts
   are exact.
3. **Client memory** (``--rss-sizes``, default 100x1000 1000x1000): peak RSS (VmHWM) of
   the converting process, the CLI, for 100,000 vs 1,000,000 files, with local processes
   and as a Dask client (``--scheduler`` of a LocalCluster in this process).

Trees are hard links to a few small JPEGs (see tools/bench_convert_memory.py), kept under
``--root`` for the next run. Usage::

    python tools/bench_convert_dask.py [--workers 2] [--repeat 2] [--files 100000]
        [--s3-files 10000] [--rss-sizes 100x1000 1000x1000] [--skip engines,s3,rss]
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_convert_memory import build_tree  # noqa: E402

from shardflow.convert.engine.engine import ConvertOptions  # noqa: E402
from shardflow.convert.images.imagefolder import convert_imagefolder  # noqa: E402

MB = 1024 * 1024


def _tree_of(root: Path, files: int) -> Path:
    classes = max(1, files // 1000)
    return build_tree(root, classes, files // classes)


def _timed(tree: str, out: Path, **kw) -> tuple[float, list[str], int]:
    shutil.rmtree(out, ignore_errors=True)
    start = time.perf_counter()
    m = convert_imagefolder(tree, str(out), **kw)
    seconds = time.perf_counter() - start
    shutil.rmtree(out, ignore_errors=True)
    return seconds, [s.sha256 for s in m.shards], m.num_samples


def engines(args: argparse.Namespace) -> dict:
    from distributed import Client, LocalCluster

    tree = _tree_of(args.root, args.files)
    options = ConvertOptions(max_count=args.max_count, workers=args.workers, resume=False)
    rates: dict[str, list[float]] = {"local": [], "dask": []}
    with LocalCluster(n_workers=args.workers, threads_per_worker=1, processes=True, host="127.0.0.1",
                      dashboard_address=":0") as cluster, Client(cluster) as client:  # fmt: skip
        hashes = {}
        for r in range(args.repeat):
            for name in ("local", "dask") if r % 2 == 0 else ("dask", "local"):  # A B, then B A
                seconds, hashes[name], n = _timed(
                    str(tree), args.root / f"out-{name}", options=options, client=client if name == "dask" else None
                )
                rates[name].append(n / seconds)
                print(f"  round {r + 1} {name:5s}: {n:,} files in {seconds:.1f} s = {n / seconds:,.0f} files/s", flush=True)
        if hashes["local"] != hashes["dask"]:
            raise SystemExit("Dask and local processes wrote different shards")
    best = {k: max(v) for k, v in rates.items()}
    # each round runs local then Dask back to back: the ratio within a round is what load on a
    # shared machine disturbs least; report their median beside the best rates
    ratios = sorted(d / loc for loc, d in zip(rates["local"], rates["dask"]))
    return {"files": n, "workers": args.workers, "local": best["local"], "dask": best["dask"],
            "ratio": statistics.median(ratios), "ratio_of_best": best["dask"] / best["local"],
            "round_ratios": ratios, "rounds": rates}  # fmt: skip


class _Counting:
    """WSGI middleware: counts requests by method and kind (listing, object read, ...);
    ``GET /__counts__`` returns them as JSON and ``POST /__counts__`` resets them."""

    def __init__(self, app) -> None:
        self.app = app
        self.counts: collections.Counter = collections.Counter()
        self.lock = threading.Lock()

    def __call__(self, environ, start_response):
        method = environ["REQUEST_METHOD"]
        if environ.get("PATH_INFO") == "/__counts__":
            with self.lock:
                body = json.dumps(dict(self.counts)).encode()
                if method == "POST":
                    self.counts.clear()
            start_response("200 OK", [("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
            return [body]
        query = environ.get("QUERY_STRING", "")
        kind = "list" if ("list-type" in query or "delimiter" in query) else "other"
        if method in ("GET", "HEAD") and kind == "other":
            kind = "read" if method == "GET" else "head"
        with self.lock:
            self.counts[f"{method} {kind}"] += 1
        return self.app(environ, start_response)


def _serve_moto(port_queue) -> None:
    """Child process: moto's S3 server with the counting middleware (its own GIL, so the
    server does not slow the converting process down)."""
    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, create_backend_app
    from werkzeug.serving import make_server

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = make_server("127.0.0.1", 0, _Counting(DomainDispatcherApplication(create_backend_app)), threaded=True)
    port_queue.put(server.server_address[1])
    server.serve_forever()


def _moto() -> tuple[str, object]:
    import multiprocessing

    for k, v in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}.items():
        os.environ.setdefault(k, v)
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_serve_moto, args=(queue,), daemon=True)
    proc.start()
    return f"http://127.0.0.1:{queue.get(timeout=60)}", proc


def _counts(endpoint: str, reset: bool = False) -> dict[str, int]:
    import urllib.request

    req = urllib.request.Request(endpoint + "/__counts__", method="POST" if reset else "GET")
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def s3(args: argparse.Namespace) -> dict:
    import s3fs

    tree = _tree_of(args.root, args.s3_files)
    endpoint, server = _moto()
    opts = {"key": "testing", "secret": "testing", "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"}}
    fs = s3fs.S3FileSystem(**opts)
    fs.call_s3("create_bucket", Bucket="bench")
    start = time.perf_counter()
    batch: dict[str, bytes] = {}
    for cls in sorted(os.listdir(tree)):
        for name in sorted(os.listdir(tree / cls)):
            batch[f"bench/tree/{cls}/{name}"] = (tree / cls / name).read_bytes()
        if len(batch) >= 2000:
            fs.pipe(batch)
            batch = {}
    if batch:
        fs.pipe(batch)
    upload = args.s3_files / (time.perf_counter() - start)
    print(f"  uploaded {args.s3_files:,} files to moto: {upload:,.0f} files/s (s3fs pipe, concurrent)", flush=True)
    options = ConvertOptions(max_count=args.max_count, workers=args.workers, resume=False, storage_options=opts)
    rows = {"s3": [], "local": []}
    requests: dict[str, int] = {}
    for r in range(args.repeat):
        _counts(endpoint, reset=True)
        seconds, h_s3, n = _timed("s3://bench/tree", args.root / "out-s3", options=options)
        requests = _counts(endpoint)
        rows["s3"].append(n / seconds)
        seconds_l, h_local, _ = _timed(str(tree), args.root / "out-s3-local", options=options)
        rows["local"].append(n / seconds_l)
        print(f"  round {r + 1}: s3 {n / seconds:,.0f} files/s, local disk {n / seconds_l:,.0f} files/s; "
              f"requests {requests}", flush=True)  # fmt: skip
        if h_s3 != h_local:
            raise SystemExit("the S3 tree and its local copy gave different shards")
    server.terminate()
    total = sum(requests.values())
    return {"files": n, "s3": max(rows["s3"]), "local": max(rows["local"]), "requests": requests, "moto_put": upload,
            "requests_per_file": total / n, "lists": sum(v for k, v in requests.items() if "list" in k)}  # fmt: skip


def _cli_rss(tree: Path, out: Path, args: argparse.Namespace, scheduler: str | None) -> tuple[float, float, str]:
    shutil.rmtree(out, ignore_errors=True)
    code = (
        "import json, sys, time\n"
        "from shardflow.cli import main\n"
        "t = time.perf_counter(); rc = main(sys.argv[1:]); s = time.perf_counter() - t\n"
        "hwm = next(int(l.split()[1]) for l in open('/proc/self/status') if l.startswith('VmHWM:'))\n"
        "print(json.dumps({'rc': rc, 'hwm_kb': hwm, 'seconds': s}))\n"
    )
    cmd = ["convert", "imagefolder", str(tree), str(out), "--max-count", str(args.max_count), "--no-resume"]
    cmd += ["--scheduler", scheduler] if scheduler else ["--workers", str(args.workers)]
    done = subprocess.run([sys.executable, "-c", code, *cmd], capture_output=True, text=True)
    shutil.rmtree(out, ignore_errors=True)
    if done.returncode != 0:
        raise SystemExit(f"conversion failed: {done.stderr[-2000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return result["hwm_kb"] / 1024, result["seconds"], done.stdout.strip().splitlines()[0]


def rss(args: argparse.Namespace) -> list[dict]:
    from distributed import LocalCluster

    rows = []
    with LocalCluster(n_workers=args.workers, threads_per_worker=1, processes=True, host="127.0.0.1",
                      dashboard_address=":0") as cluster:  # fmt: skip
        for size in args.rss_sizes:
            classes, per_class = (int(x) for x in size.split("x"))
            tree = build_tree(args.root, classes, per_class)
            for engine in ("local", "dask"):
                peak, seconds, line = _cli_rss(tree, args.root / "out-rss", args, cluster.scheduler_address if engine == "dask" else None)
                print(f"  {classes * per_class:>9,} files {engine:5s}: client peak RSS {peak:.0f} MiB, {seconds:.0f} s ({line})", flush=True)
                rows.append({"files": classes * per_class, "engine": engine, "rss_mib": peak, "seconds": seconds})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=Path("/tmp/shardflow-bench"))
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--files", type=int, default=100_000)
    parser.add_argument("--s3-files", type=int, default=10_000)
    parser.add_argument("--max-count", type=int, default=10_000)
    parser.add_argument("--rss-sizes", nargs="*", default=["100x1000", "1000x1000"])
    parser.add_argument("--skip", default="", help="comma-separated parts to skip: engines, s3, rss")
    args = parser.parse_args(argv)
    skip = set(filter(None, args.skip.split(",")))
    report: dict = {}
    if "engines" not in skip:
        print(f"== engines: {args.workers} local processes vs a Dask LocalCluster of {args.workers}", flush=True)
        e = report["engines"] = engines(args)
        print(f"| files | local files/s (best) | Dask files/s (best) | Dask / local, median of rounds | of best |\n"
              f"|---|---|---|---|---|\n| {e['files']:,} | {e['local']:,.0f} | {e['dask']:,.0f} | {e['ratio']:.2f}x "
              f"| {e['ratio_of_best']:.2f}x |", flush=True)  # fmt: skip
    if "s3" not in skip:
        print("== S3 source (moto on 127.0.0.1)", flush=True)
        s = report["s3"] = s3(args)
        print(f"| files | S3 files/s | local disk files/s | moto's own PUT rate | requests/file | listings |\n"
              f"|---|---|---|---|---|---|\n| {s['files']:,} | {s['s3']:,.0f} | {s['local']:,.0f} | {s['moto_put']:,.0f} "
              f"| {s['requests_per_file']:.4f} | {s['lists']} |", flush=True)  # fmt: skip
    if "rss" not in skip:
        print("== client peak RSS", flush=True)
        rows = report["rss"] = rss(args)
        print("| files | engine | client peak RSS MiB | seconds |\n|---|---|---|---|")
        for r in rows:
            print(f"| {r['files']:,} | {r['engine']} | {r['rss_mib']:.0f} | {r['seconds']:.0f} |")
        for engine in ("local", "dask"):
            peaks = [r["rss_mib"] for r in rows if r["engine"] == engine]
            if len(peaks) >= 2:
                print(f"growth {engine}: {peaks[-1] - peaks[0]:+.0f} MiB from {rows[0]['files']:,} to {rows[-1]['files']:,} files")
    print(json.dumps(report, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
