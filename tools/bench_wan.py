#!/usr/bin/env python3
"""shardflow, LitData and MosaicML Streaming reading one epoch from a bucket across a WAN.

What a team training from a bucket pays: bytes over the link and requests (the bill),
epoch rate and time to the first batch (the GPU's wait). The bucket is a moto S3 server
on 127.0.0.1 (a child process); in front of it this script runs a proxy (an asyncio
thread of its own) that delays every piece of data by ``--latency`` seconds each way and
caps all downloads together at ``--rate`` bytes/s (a share of a real NIC), counting the
bytes it passes down and the requests it passes up. Nothing leaves the machine.

Per library: the same JPEG tree (64x64 by default; tools/bench_peers.py makes it) converted by each,
uploaded to the bucket (not through the proxy), then read for one shuffled epoch by a
``--workers`` DataLoader, batch 64, decoded to CHW uint8 tensors, each run in a fresh
process with an empty local cache (LitData and Mosaic download whole chunks into one;
shardflow streams, sharing each fetch among a rank's workers through its staging area).
Repetitions alternate the libraries (A B C A B C) so that machine noise hits all alike.
shardflow also runs with each of ``--shardflow-workers`` (bytes and requests per epoch).

Peers run in ``--peers-python``: a venv with ``litdata`` and ``mosaicml-streaming``, which
left to themselves pull another torch than the dev venv's. One way that keeps the dev torch:
``python -m venv /work/venv-peers``, a ``.pth`` file in its site-packages naming the dev venv's
site-packages, then ``/work/venv-peers/bin/pip install -c <(echo torch==2.13.0) litdata
mosaicml-streaming``. LitData's obstore downloader is told to allow ``http://`` (the loopback
bucket has no TLS).

``--photos N`` reads N photo-sized JPEGs (~400x350, tools/bench_peers.py's photo set,
100 per shard) instead. ``--cache-epoch`` adds shardflow's second epoch through
``IOOptions(cache_dir=...)`` and its second epoch from the converted folder on local disk
(each the second ``iter()`` of one loader, so both fork their workers alike).

"First batch" counts from the moment torch, PIL and the library are imported (as #22
measures it: a training job imports them long before it asks for data); "first batch with
imports" and the epoch rate count from before those imports.

usage: python tools/bench_wan.py [--images 20000 | --photos 5000] [--per-shard N] [--latency 0.025]
                                 [--rate 20e6] [--workers 4] [--repeat 2] [--only shardflow,litdata,mosaic]
                                 [--shardflow-workers 1,8] [--unstaged] [--cache-epoch] [--compression zstd]
                                 [--peers-python PATH] [--work DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

BUCKET = "bench"
BATCH = 64
_AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
}
_SERVER = """
import logging, sys
from moto.moto_server.threaded_moto_server import ThreadedMotoServer
logging.getLogger("werkzeug").setLevel(logging.ERROR)
server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
server.start()
print(server.get_host_and_port()[1], flush=True)
sys.stdin.read()
server.stop()
"""
_REQUEST = re.compile(rb"(?:^|\r\n)(GET|HEAD|PUT|POST|DELETE) /")


# ------------------------------------------------------------------ the WAN proxy


class WanProxy:
    """A TCP proxy with latency each way and one bandwidth cap shared by all downloads.

    Attributes:
        down_bytes: bytes passed from the server to the clients.
        requests: HTTP requests passed up, by method.
    """

    def __init__(self, target: tuple[str, int], latency: float, rate: float, burst: int = 64 << 10) -> None:
        self.target, self.latency, self.rate, self.burst = target, latency, rate, burst
        self.down_bytes = 0
        self.requests: dict[str, int] = {}
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._tokens = float(burst)
        self._stamp = 0.0
        self.port = 0
        threading.Thread(target=self._run, daemon=True, name="wan-proxy").start()
        self._ready.wait(10)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def reset(self) -> None:
        with self._lock:
            self.down_bytes = 0
            self.requests = {}

    def counts(self) -> dict[str, Any]:
        with self._lock:
            return {"bytes": self.down_bytes, "requests": dict(self.requests)}

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)

        async def start() -> None:
            server = await asyncio.start_server(self._client, "127.0.0.1", 0)
            self.port = server.sockets[0].getsockname()[1]
            self._stamp = self._loop.time()
            self._ready.set()

        self._loop.run_until_complete(start())
        self._loop.run_forever()

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.close()
            return
        await asyncio.gather(self._pipe(reader, up_writer, down=False), self._pipe(up_reader, writer, down=True),
                             return_exceptions=True)

    async def _pipe(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, *, down: bool) -> None:
        """Copy ``src`` to ``dst``, each piece delivered ``latency`` seconds after it came."""
        loop = self._loop
        queue: asyncio.Queue = asyncio.Queue()

        async def deliver() -> None:
            while True:
                due, data = await queue.get()
                if data is None:
                    break
                wait = due - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                if down:
                    await self._take(len(data))
                    with self._lock:
                        self.down_bytes += len(data)
                dst.write(data)
                await dst.drain()
            dst.close()

        task = loop.create_task(deliver())
        try:
            while True:
                data = await src.read(64 << 10)
                if not data:
                    break
                if not down:
                    for m in _REQUEST.finditer(data):
                        method = m.group(1).decode()
                        with self._lock:
                            self.requests[method] = self.requests.get(method, 0) + 1
                queue.put_nowait((loop.time() + self.latency, data))
        except (ConnectionError, OSError):
            pass
        finally:
            queue.put_nowait((0.0, None))
            await asyncio.gather(task, return_exceptions=True)

    async def _take(self, n: int) -> None:
        """Wait until ``n`` bytes fit under the shared rate (a token bucket)."""
        while True:
            now = self._loop.time()
            self._tokens = min(float(self.burst), self._tokens + (now - self._stamp) * self.rate)
            self._stamp = now
            if self._tokens >= min(n, self.burst):
                self._tokens -= n
                return
            await asyncio.sleep((min(n, self.burst) - self._tokens) / self.rate)


# ------------------------------------------------------------------ child: one epoch


def storage_options(endpoint: str) -> dict[str, Any]:
    return {"key": "testing", "secret": "testing", "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"}}


def read_epoch(lib: str, name: str, n: int, workers: int, endpoint: str, data: str = "") -> dict[str, float]:
    """One shuffled epoch of ``s3://bench/<name>`` with ``lib``; returns rate and first batch.

    ``shardflow-cache`` reads two epochs through ``IOOptions(cache_dir=...)`` and
    ``shardflow-local`` two from the local folder ``data``: both report the second
    epoch (from the cache, from the page cache), ``epoch1`` the first.
    """
    import bench_peers as bp

    cache = tempfile.mkdtemp(prefix=f"wan-{lib}-")
    url = f"s3://{BUCKET}/{name}"
    epochs = 2 if lib in ("shardflow-cache", "shardflow-local") else 1
    try:
        t0 = time.perf_counter()
        # "first batch" as #22 measures it: torch, PIL and the library imported, nothing else
        # done yet (a training job imports them long before it asks for data); the epoch and
        # "first batch with imports" count from the first import, as before
        import PIL.Image  # noqa: F401
        import torch  # noqa: F401

        if lib.startswith("shardflow"):
            import shardflow  # noqa: F401
        elif lib == "litdata":
            import litdata  # noqa: F401
        else:
            bp.import_mosaic()
        ready = time.perf_counter()
        if lib.startswith("shardflow"):
            import shardflow
            from shardflow.storage import IOOptions

            io = IOOptions(storage_options=storage_options(endpoint), staging=lib != "shardflow-unstaged",
                           cache_dir=cache if lib == "shardflow-cache" else None)
            ds = shardflow.ShardDataset(data if lib == "shardflow-local" else url, shuffle=True,
                                        decode=shardflow.DecodeOptions(image="torch"), fields=("jpg", "cls"), io=io)
            ld = shardflow.loader(ds, batch_size=BATCH, num_workers=workers)
        elif lib == "litdata":
            import litdata
            from litdata.streaming import downloader

            # obstore (LitData's default download path) refuses http:// unless told: the
            # loopback bucket has no TLS, a real one does
            downloader._OBSTORE_CLIENT_OPTIONS["allow_http"] = "true"
            ds = litdata.StreamingDataset(url, shuffle=True, transform=bp._lit_decode, cache_dir=cache,
                                          storage_options={"endpoint_url": endpoint,
                                                           "aws_access_key_id": "testing",
                                                           "aws_secret_access_key": "testing"})
            ld = litdata.StreamingDataLoader(ds, batch_size=BATCH, num_workers=workers)
        else:
            os.environ["S3_ENDPOINT_URL"] = endpoint
            base = bp.import_mosaic()
            base.util.clean_stale_shared_memory()
            ds = bp._mosaic_decoding()(remote=url, local=cache, shuffle=True, batch_size=BATCH)
            ld = base.StreamingDataLoader(ds, batch_size=BATCH, num_workers=workers)
        out: dict[str, float] = {}
        for e in range(epochs):
            it = iter(ld)  # (shardflow.loader: each iter() is the next epoch)
            seen = bp._batch_len(next(it))
            now = time.perf_counter()
            first, cold = now - max(t0, ready), now - t0
            for b in it:
                seen += bp._batch_len(b)
            total = time.perf_counter() - t0
            if seen != n:
                raise SystemExit(f"{lib}: epoch {e + 1} saw {seen} samples, expected {n}")
            out = {"epoch": seen / total, "first_batch": first, "first_batch_cold": cold, "seconds": total,
                   **({"epoch1": out["epoch"]} if out else {})}
            t0 = time.perf_counter()
        return out
    finally:
        shutil.rmtree(cache, ignore_errors=True)


# ------------------------------------------------------------------ driver


def folder_bytes(folder: str) -> int:
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(folder) for f in fs)


def upload(folder: str, name: str, port: int) -> None:
    import boto3

    s3 = boto3.client("s3", endpoint_url=f"http://127.0.0.1:{port}", **{
        "aws_access_key_id": "testing", "aws_secret_access_key": "testing", "region_name": "us-east-1"})
    try:
        s3.create_bucket(Bucket=BUCKET)
    except s3.exceptions.BucketAlreadyOwnedByYou:
        pass
    for root, _, files in os.walk(folder):
        for f in sorted(files):
            path = os.path.join(root, f)
            s3.upload_file(path, BUCKET, f"{name}/{os.path.relpath(path, folder)}")


def python_for(lib: str, args: argparse.Namespace) -> str:
    return sys.executable if lib.startswith("shardflow") else args.peers_python


def convert(lib: str, tree: str, out: str, n: int, args: argparse.Namespace) -> None:
    if os.path.exists(out):
        return
    cmd = [python_for(lib, args), os.path.join(HERE, "bench_peers.py"), "--child", "convert", "--lib", lib,
           "--tree", tree, "--data", out, "--n", str(n), "--per-shard", str(args.per_shard)]
    if lib.startswith("shardflow") and args.compression != "none":  # the CLI, as a user would
        cmd = [sys.executable, "-m", "shardflow.cli", "convert", "imagefolder", tree, out, "--max-count", str(args.per_shard),
               "--workers", "2", "--compression", args.compression]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        shutil.rmtree(out, ignore_errors=True)
        raise SystemExit(f"converting with {lib} failed:\n{proc.stderr[-3000:]}")


def run_read(lib: str, name: str, n: int, workers: int, proxy: WanProxy, args: argparse.Namespace,
             data: str = "") -> dict[str, Any]:
    cmd = [python_for(lib, args), os.path.abspath(__file__), "--child", lib, "--name", name, "--n", str(n),
           "--workers", str(workers), "--endpoint", proxy.endpoint, "--data", data]
    proxy.reset()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, env={**os.environ, **_AWS_ENV})
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        print(f"  {lib} x{workers}: failed (exit {proc.returncode})\n{proc.stderr[-3000:]}", file=sys.stderr)
        return {}
    time.sleep(0.5)  # the last responses' bytes drain through the proxy
    return {**json.loads(lines[-1][len("RESULT "):]), **proxy.counts()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", type=int, default=20000, help="64x64 JPEGs")
    ap.add_argument("--photos", type=int, default=0,
                    help="read N photo-sized JPEGs (~400x350, bench_peers' photo set) instead of the 64x64 ones")
    ap.add_argument("--per-shard", type=int, default=0, help="samples per shard/chunk (default 1000, photos 100)")
    ap.add_argument("--cache-epoch", action="store_true",
                    help="also shardflow's epoch 2 through IOOptions(cache_dir=...) and its epoch 2 from local disk")
    ap.add_argument("--latency", type=float, default=0.025, help="seconds added each way")
    ap.add_argument("--rate", type=float, default=20e6, help="bytes/s for all downloads together")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--only", default="shardflow,litdata,mosaic")
    ap.add_argument("--shardflow-workers", default="1,8", help="extra worker counts for shardflow (bytes, requests)")
    ap.add_argument("--compression", default="none", choices=("none", "zstd"),
                    help="shardflow's shards: plain .tar or framed .tar.zst (shardflow convert --compression)")
    ap.add_argument("--unstaged", action="store_true", help="also shardflow with IOOptions(staging=False)")
    ap.add_argument("--peers-python", default="/work/venv-peers/bin/python")
    ap.add_argument("--work", default="/tmp/shardflow-bench-wan")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--name", help=argparse.SUPPRESS)
    ap.add_argument("--n", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--endpoint", help=argparse.SUPPRESS)
    ap.add_argument("--data", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print("RESULT " + json.dumps(read_epoch(args.child, args.name, args.n, args.workers, args.endpoint, args.data)))
        return 0
    import bench_peers as bp

    libs = args.only.split(",")
    kind = "photo" if args.photos else "small"
    args.per_shard = args.per_shard or (100 if args.photos else 1000)
    tree = os.path.join(args.work, f"tree-{kind}-{args.photos or args.images}")
    bp.ensure_tree(tree, kind, args.photos or args.images)  # bench_peers' generators, the same images
    n = len(bp.list_tree(tree))
    image_bytes = sum(os.path.getsize(p) for p, _ in bp.list_tree(tree))
    suffix = {lib: f"-{args.compression}" if lib.startswith("shardflow") and args.compression != "none" else "" for lib in libs}
    data = {lib: os.path.join(args.work, f"{lib}-{kind}-{n}-{args.per_shard}{suffix[lib]}") for lib in libs}
    for lib in libs:
        print(f"converting with {lib}", file=sys.stderr)
        convert(lib, tree, data[lib], n, args)
    server = subprocess.Popen([sys.executable, "-c", _SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, env={**os.environ, **_AWS_ENV})
    try:
        port = int(server.stdout.readline())
        for lib in libs:
            upload(data[lib], os.path.basename(data[lib]), port)
        proxy = WanProxy(("127.0.0.1", port), args.latency, args.rate)
        runs = [(lib, args.workers) for lib in libs]
        if "shardflow" in libs:
            counts = [int(w) for w in args.shardflow_workers.split(",") if w]
            runs += [("shardflow", w) for w in counts if w != args.workers]
            if args.unstaged:  # each worker streams what it reads itself (IOOptions(staging=False))
                runs += [("shardflow-unstaged", w) for w in sorted({args.workers, *counts})]
            if args.cache_epoch:  # epoch 2 from the cache against epoch 2 from the local folder
                runs += [("shardflow-cache", args.workers), ("shardflow-local", args.workers)]
        results: dict[tuple[str, int], list[dict[str, Any]]] = {}
        for r in range(args.repeat):
            for lib, workers in runs:
                print(f"run {r + 1}: {lib}, {workers} workers", file=sys.stderr)
                base = lib.split("-")[0]
                res = run_read(lib, os.path.basename(data[base]), n, workers, proxy, args, data[base])
                if res:
                    results.setdefault((lib, workers), []).append(res)
        report(results, {lib: folder_bytes(data[lib]) for lib in libs}, image_bytes, n, args)
    finally:
        server.stdin.close()
        server.wait(30)
    return 0


def report(results: dict[tuple[str, int], list[dict[str, Any]]], stored: dict[str, int], image_bytes: int, n: int,
           args: argparse.Namespace) -> None:
    def med(runs: list[dict[str, Any]], key: str) -> float:
        return statistics.median(run[key] for run in runs)

    what = "photo-sized JPEGs (~400x350)" if args.photos else "JPEGs of 64x64"
    print(f"\n### {n:,} {what} ({image_bytes / 1e6:.1f} MB of image bytes), {args.per_shard} per shard, "
          f"{args.latency * 1e3:g} ms each way, "
          f"{args.rate / 1e6:g} MB/s shared; median of {args.repeat} alternating runs; load average "
          f"{os.getloadavg()[0]:.2f} at the end\n")
    print("| library, workers | bytes over the link / stored | / image bytes | stored / image bytes | GETs | "
          "requests | epoch, samples/s | first batch, s | first batch with imports, s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for (lib, workers), runs in results.items():
        down = med(runs, "bytes")
        gets = statistics.median(run["requests"].get("GET", 0) for run in runs)
        reqs = statistics.median(sum(run["requests"].values()) for run in runs)
        kept = stored[lib.split("-")[0]]
        print(f"| {lib}, {workers} | {down / kept:.3f}x | {down / image_bytes:.3f}x | "
              f"{kept / image_bytes:.3f}x | {gets:.0f} | {reqs:.0f} | {med(runs, 'epoch'):,.0f} | "
              f"{med(runs, 'first_batch'):.2f} | {med(runs, 'first_batch_cold'):.2f} |")
    base = results.get(("shardflow", args.workers))
    if base:
        print()
        for peer in ("litdata", "mosaic"):
            other = results.get((peer, args.workers))
            if other:
                print(f"- epoch shardflow / {peer}: {med(base, 'epoch') / med(other, 'epoch'):.2f}x; first batch "
                      f"shardflow / {peer}: {med(base, 'first_batch') / med(other, 'first_batch'):.2f}x "
                      f"({med(base, 'first_batch_cold') / med(other, 'first_batch_cold'):.2f}x with imports)")
    cached, local = results.get(("shardflow-cache", args.workers)), results.get(("shardflow-local", args.workers))
    if cached and local:
        print(f"- epoch 2 through cache_dir / epoch 2 from local disk: {med(cached, 'epoch') / med(local, 'epoch'):.2f}x "
              f"({med(cached, 'epoch'):,.0f} / {med(local, 'epoch'):,.0f} samples/s; epoch 1 through the cache "
              f"{med(cached, 'epoch1'):,.0f})")


if __name__ == "__main__":
    sys.exit(main())
