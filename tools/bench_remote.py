#!/usr/bin/env python3
"""Remote read benchmark: one epoch from a loopback S3 server vs the same shards on local disk.

The same pipeline everywhere (shard shuffle + buffer, JPEG decode to CHW uint8 tensors,
``shardflow.loader`` with 2 workers, batch 64), reading:

- the local folder the shards were written to;
- ``s3://`` on a moto S3 server that this script starts on 127.0.0.1 in a child
  process (no network leaves the machine), with read-ahead on (the default
  ``IOOptions``: the next shards stream while this one is decoded) and off
  (``readahead=0``) for reference;
- ``http://`` on the test suite's HTTP file server, in a child process, which waits
  ``--http-latency`` seconds before answering each request (a distant bucket's time
  to first byte): what read-ahead hides when reads wait on the network.

Each figure is the median of ``--repeat`` epochs, alternating the sources so that
machine noise hits all alike; the ratios are what to compare across machines. The
servers run on the same cores as the workers, so on a small machine their CPU time
is part of the remote cost (on a real bucket it is not): the table also gives the
CPU seconds per epoch of this process with its workers and of the server.

usage: python tools/bench_remote.py [--images 10000] [--size 64] [--per-shard 1000]
                                    [--repeat 3] [--persistent-workers]
                                    [--http-latency 0.05] [--work DIR]

Without --persistent-workers each epoch starts new workers, and each of them creates
its S3 client (about 0.2 s of CPU); with it they are created once.
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import numpy as np

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
sys.stdin.read()  # runs until the parent closes our stdin
server.stop()
"""


def make_shards(folder: str, images: int, size: int, per_shard: int) -> None:
    """Synthetic JPEGs (smooth images plus noise, as in tools/bench_read.py) in shards."""
    from PIL import Image

    import shardflow

    if os.path.exists(os.path.join(folder, "shardflow.json")):
        return
    rng = np.random.default_rng(0)
    yy, xx = np.mgrid[0:size, 0:size]
    with shardflow.ShardWriter(os.path.join(folder, "train-%06d.tar"), max_count=per_shard) as sink:
        for i in range(images):
            a = rng.uniform(0, 6, 3)
            img = np.stack([127 + 120 * np.sin(xx / size * a[k] + yy / size * a[(k + 1) % 3]) for k in range(3)], -1)
            img += rng.normal(0, 8, img.shape)
            buf = io.BytesIO()
            Image.fromarray(np.clip(img, 0, 255).astype(np.uint8)).save(buf, format="JPEG", quality=90)
            sink.write({"__key__": f"{i:07d}", "jpg": buf.getvalue(), "cls": i % 20})


_HTTP_SERVER = """
import sys
sys.path.insert(0, sys.argv[2])
from tests.servers import Faults, FileHTTPServer
srv = FileHTTPServer(sys.argv[1], Faults(latency=float(sys.argv[3]))).start()
print(srv.url, flush=True)
sys.stdin.read()
srv.stop()
"""


def start_http(folder: str, latency: float) -> tuple[subprocess.Popen, str]:
    """The test suite's HTTP file server (Range, ETag) serving ``folder``, waiting
    ``latency`` seconds before answering each request (time to first byte)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.Popen([sys.executable, "-c", _HTTP_SERVER, folder, root, str(latency)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    return proc, proc.stdout.readline().strip()


def _stop(proc: subprocess.Popen) -> None:
    proc.stdin.close()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def start_s3() -> tuple[subprocess.Popen, dict]:
    env = {**os.environ, **_AWS_ENV}
    proc = subprocess.Popen([sys.executable, "-c", _SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True)
    port = int(proc.stdout.readline())
    options = {
        "key": "testing",
        "secret": "testing",
        "client_kwargs": {"endpoint_url": f"http://127.0.0.1:{port}", "region_name": "us-east-1"},
    }
    return proc, options


def _cpu(proc, children: bool = False, exclude: frozenset[int] | set[int] = frozenset()) -> float:
    """CPU seconds (user + system) of a process; with ``children``, plus those of its
    children, live (persistent DataLoader workers) or exited, other than ``exclude``."""
    import psutil

    t = proc.cpu_times()
    total = t.user + t.system
    if children:
        total += t.children_user + t.children_system
        for child in proc.children(recursive=True):
            if child.pid in exclude:
                continue
            try:
                c = child.cpu_times()
            except psutil.Error:  # exited meanwhile: counted with the reaped ones
                continue
            total += c.user + c.system
    return total


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", type=int, default=10000)
    ap.add_argument("--size", type=int, default=64)
    ap.add_argument("--per-shard", type=int, default=1000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--persistent-workers", action="store_true",
                    help="keep the DataLoader workers (and their S3 clients) from one epoch to the next")
    ap.add_argument("--http-latency", type=float, default=0.05,
                    help="seconds the HTTP server waits before answering each request (0: no HTTP rows)")
    ap.add_argument("--work", default="/tmp/shardflow-bench-remote")
    args = ap.parse_args()
    os.environ.update(_AWS_ENV)

    import psutil
    import s3fs

    import shardflow
    from shardflow.storage import IOOptions

    local = os.path.join(args.work, f"shards-{args.images}-{args.size}-{args.per_shard}")
    make_shards(local, args.images, args.size, args.per_shard)
    names = sorted(os.listdir(local))
    total_bytes = sum(os.path.getsize(os.path.join(local, n)) for n in names if n.endswith(".tar"))

    proc, options = start_s3()
    http = start_http(local, args.http_latency) if args.http_latency > 0 else None
    loaders: dict[str, Any] = {}
    try:
        fs = s3fs.S3FileSystem(**options)
        fs.call_s3("create_bucket", Bucket="bench")
        for n in names:
            fs.put_file(os.path.join(local, n), f"bench/data/{n}")
        remote = "s3://bench/data"

        def epoch(name: str, source: str, io: IOOptions) -> int:
            loader = loaders.get(name)
            if loader is None:
                ds = shardflow.ShardDataset(source, shuffle=True, decode="torch", fields=("jpg", "cls"), io=io)
                loader = shardflow.loader(
                    ds, batch_size=args.batch, num_workers=args.workers, persistent_workers=args.persistent_workers
                )
                if args.persistent_workers:  # one loader (and its workers) for every epoch
                    loaders[name] = loader
            return sum(len(b["cls"]) for b in loader)

        pipelines = {
            "local disk": lambda: epoch("local", local, IOOptions()),
            "s3 (moto, loopback), read-ahead on": lambda: epoch("on", remote, IOOptions(storage_options=options)),
            "s3 (moto, loopback), read-ahead off": lambda: epoch("off", remote, IOOptions(storage_options=options, readahead=0)),
        }
        servers = {name: proc for name in pipelines if name.startswith("s3")}
        if http is not None:
            label = f"http (loopback, {args.http_latency * 1000:.0f} ms to first byte)"
            pipelines[f"{label}, read-ahead on"] = lambda: epoch("http-on", http[1], IOOptions())
            pipelines[f"{label}, read-ahead off"] = lambda: epoch("http-off", http[1], IOOptions(readahead=0))
            servers.update({name: http[0] for name in pipelines if name.startswith("http")})
        rates: dict[str, list[float]] = {k: [] for k in pipelines}
        client_cpu: dict[str, list[float]] = {k: [] for k in pipelines}
        server_cpu: dict[str, list[float]] = {k: [] for k in pipelines}
        me = psutil.Process()
        exclude = {proc.pid} | ({http[0].pid} if http is not None else set())
        for name, fn in pipelines.items():  # warm-up: page cache, imports, first connections
            fn()
        for _ in range(args.repeat):
            for name, fn in pipelines.items():
                server = psutil.Process(servers[name].pid) if name in servers else None
                c0 = _cpu(me, children=True, exclude=exclude)
                s0 = _cpu(server) if server is not None else 0.0
                t0 = time.perf_counter()
                n = fn()
                dt = time.perf_counter() - t0
                client_cpu[name].append(_cpu(me, children=True, exclude=exclude) - c0)
                server_cpu[name].append(_cpu(server) - s0 if server is not None else 0.0)
                if n != args.images:
                    raise SystemExit(f"{name}: saw {n} samples, expected {args.images}")
                rates[name].append(n / dt)
    finally:
        loaders.clear()  # persistent workers hold connections to the servers: stop them first
        _stop(proc)
        if http is not None:
            _stop(http[0])

    med = {k: statistics.median(v) for k, v in rates.items()}
    base = med["local disk"]
    shards = sum(1 for n in names if n.endswith(".tar"))
    print(
        f"\n{args.images} JPEGs of {args.size}x{args.size} in {shards} shards ({total_bytes / 1e6:.1f} MB); "
        f"decode to tensors, {args.workers} {'persistent ' if args.persistent_workers else ''}workers, "
        f"batch {args.batch}; median of {args.repeat} epochs\n"
    )
    print("| source | samples/s | vs local | client CPU s/epoch | server CPU s/epoch |")
    print("|---|---:|---:|---:|---:|")
    for k, v in med.items():
        print(
            f"| {k} | {v:,.0f} | {v / base:.2f}x | {statistics.median(client_cpu[k]):.2f} "
            f"| {statistics.median(server_cpu[k]):.2f} |"
        )
    ratio = med["s3 (moto, loopback), read-ahead on"] / base
    cpu_local = statistics.median(client_cpu["local disk"])
    cpu_s3 = statistics.median(client_cpu["s3 (moto, loopback), read-ahead on"])
    print(f"\nclient CPU, local / s3 with read-ahead: {cpu_local / cpu_s3:.2f}x (the rate ratio on a machine where "
          "the pipeline is CPU-bound and the store does not share its cores)")
    print(f"\ntarget: s3 with read-ahead >= 0.80x local: {'met' if ratio >= 0.8 else 'NOT met'} ({ratio:.2f}x)")
    print(f"load average at the end: {', '.join(f'{x:.1f}' for x in os.getloadavg())} on {os.cpu_count()} CPUs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
