"""Resource hygiene: file descriptors, threads and worker processes come back to what
they were after a full epoch, an early ``break`` and ``del`` + ``gc.collect()``,
reading local shards and shards over HTTP, in this process and through DataLoader
workers; datasets pickle cleanly, spawn workers work, and a transform that cannot be
pickled is refused with an error that says so.

The HTTP server runs in a child process, so that its threads and sockets are not
counted with the reader's.
"""

from __future__ import annotations

import gc
import os
import pickle
import subprocess
import sys
import threading
from dataclasses import replace
from typing import NamedTuple

import numpy as np
import pytest

import shardflow
from shardflow.storage import IOOptions
from tests.servers import wait_until

psutil = pytest.importorskip("psutil")

N, PER = 60, 20
IO = IOOptions(block_size=16 << 10)  # several chunks per shard: read-ahead has work in flight

_SERVER = """
import sys
sys.path.insert(0, sys.argv[2])
from tests.servers import FileHTTPServer
srv = FileHTTPServer(sys.argv[1]).start()
print(srv.url, flush=True)
sys.stdin.read()
srv.stop()
"""


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hygiene") / "d"
    with shardflow.ShardWriter(str(folder / "train-%06d.tar"), max_count=PER) as sink:
        for i in range(N):
            sink.write({"__key__": f"{i:06d}", "bin": np.random.default_rng(i).bytes(20_000), "cls": i})
    return folder


@pytest.fixture(scope="module")
def http_url(shards):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.Popen([sys.executable, "-c", _SERVER, str(shards), root], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        yield proc.stdout.readline().strip()
    finally:
        proc.stdin.close()
        proc.wait(30)


def idle_http_sockets() -> set[int]:
    """File descriptors of the keep-alive connections idle in the pools of fsspec's HTTP
    sessions (shardflow's reads share them). They are reused by the next read, not leaked;
    a connection still held by a response is not idle and counts as in use. A pooled
    connection the server has closed meanwhile has no peer address any more but is still
    the pool's (aiohttp drops it on its next cleanup): it counts here too."""
    http = sys.modules.get("fsspec.implementations.http")
    if http is None:
        return set()
    fds = set()
    for fs in list(http.HTTPFileSystem._cache.values()):  # existing instances only: creating one starts a thread
        connector = getattr(getattr(fs, "_session", None), "connector", None)
        if connector is None:
            continue
        for conns in list(connector._conns.values()):  # aiohttp's pool: (protocol, last use) pairs
            for proto, _ in list(conns):
                sock = proto.transport.get_extra_info("socket") if proto.transport is not None else None
                if sock is not None and sock.fileno() >= 0:
                    fds.add(sock.fileno())
    return fds


class Resources(NamedTuple):
    """What the process holds. Descriptors are ``(number, what it is open on)`` pairs from
    /proc/self/fd, compared with everything open at the base: so neither a descriptor that other
    tests' garbage closes meanwhile, nor one of theirs that changes kind (a connection reset by
    its peer is no longer listed as connected), can hide or fake one of ours."""

    fds: frozenset  # descriptors other than TCP connections
    connections: frozenset  # TCP connections in use (not idle in a pool)
    threads: frozenset  # thread idents: servers of other tests may end theirs meanwhile
    children: frozenset  # child pids: none may start and stay
    every: frozenset  # every descriptor


def open_fds() -> dict[int, str]:
    fds = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            fds[int(name)] = os.readlink(f"/proc/self/fd/{name}")
        except OSError:  # the listing's own descriptor, closed by now
            continue
    return fds


def resources() -> Resources:
    me = psutil.Process()
    connected = {c.fd for c in me.net_connections(kind="inet") if c.raddr}
    idle = idle_http_sockets()
    fds = open_fds()
    return Resources(
        fds=frozenset((fd, what) for fd, what in fds.items() if fd not in connected | idle),
        connections=frozenset((fd, what) for fd, what in fds.items() if fd in connected - idle),
        threads=frozenset(t.ident for t in threading.enumerate()),
        children=frozenset(c.pid for c in me.children(recursive=True) if not _helper(c)),
        every=frozenset(fds.items()),
    )


def _helper(proc) -> bool:
    """multiprocessing's resource tracker: started once per process by the first spawn
    context, and kept for the life of the process by design."""
    try:
        return "resource_tracker" in " ".join(proc.cmdline())
    except psutil.Error:
        return False


def settle(base: Resources, fds: bool = True) -> Resources:
    """Wait until no thread, process, descriptor or connection is left beyond ``base``
    (threads and processes stop asynchronously); return what there is then."""
    gc.collect()

    def back() -> bool:
        now = resources()
        return (not fds or not (now.fds | now.connections) - base.every) and now.threads <= base.threads \
            and now.children <= base.children

    wait_until(back, timeout=60)  # returns once back: the deadline only matters on a loaded machine
    return resources()


def assert_back(base: Resources) -> None:
    now = settle(base)
    assert now.threads <= base.threads, [t.name for t in threading.enumerate() if t.ident not in base.threads]
    assert now.children <= base.children, now.children - base.children
    assert not now.fds - base.every, f"left open: {sorted(now.fds - base.every)}"
    assert not now.connections - base.every, f"connections left in use: {sorted(now.connections - base.every)}"


def source_of(kind, shards, http_url) -> str:
    return str(shards) if kind == "local" else http_url


def epoch(ds, workers: int, how: str) -> int:
    """Read ``ds``: a full pass, a ``break`` in the second shard, or an iterator left
    mid-shard (dropped by the caller). Returns the samples read."""
    it = shardflow.loader(ds, batch_size=4, num_workers=workers, collate_fn=list) if workers else ds
    n = 0
    if how == "full":
        for item in it:
            n += len(item) if workers else 1
        return n
    if how == "break":
        for item in it:
            n += len(item) if workers else 1
            if n >= PER + 5:
                break
        return n
    held = iter(it)
    next(held)
    next(held)
    epoch.held = held  # kept alive until the caller drops it (a function attribute: no global)
    return 2


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("kind", ["local", "http"])
def test_resources_come_back(shards, http_url, kind, workers):
    source = source_of(kind, shards, http_url)
    # warm up: imports, fsspec's I/O thread and connection pool (kept for the process)
    assert epoch(shardflow.ShardDataset(source, decode=None, io=IO), workers, "full") == N
    gc.collect()
    base = resources()
    for how in ("full", "break", "held"):
        ds = shardflow.ShardDataset(source, decode=None, io=IO, shuffle=True, seed=1)
        n = epoch(ds, workers, how)
        assert n == {"full": N, "break": PER + (8 if workers else 5), "held": 2}[how]
        if how == "break":  # the dataset is still alive; its readers are not
            now = settle(base, fds=False)
            assert now.threads <= base.threads and now.children <= base.children, how
        epoch.held = None
        del ds
        assert_back(base)


def abandon_three_iterators(source, io: IOOptions) -> None:
    ds = shardflow.ShardDataset(source, decode=None, io=io)
    iters = [iter(ds) for _ in range(3)]
    for it in iters:
        next(it)
    if "://" in source and not io.staging:  # remote streams run in read-ahead threads (local files need none)
        assert sum(t.name == "shardflow-readahead" for t in threading.enumerate()) >= 3


@pytest.mark.parametrize("kind", ["local", "http", "http-staged"])
def test_abandoned_iterators_are_released_by_gc(shards, http_url, kind, tmp_path):
    """Also through the staging area: its fetch threads end with their shard part, and
    the area's locks and block files are released with the iterators."""
    source = source_of(kind.split("-")[0], shards, http_url)
    io = replace(IO, staging_dir=str(tmp_path)) if kind == "http-staged" else replace(IO, staging=False)
    abandon_three_iterators(source, io)  # warm-up: the connection pool grows to what this needs
    settle(resources())
    base = resources()
    abandon_three_iterators(source, io)
    assert_back(base)
    assert os.listdir(tmp_path) == []  # each abandoned pass (its own epoch) removed its area


# --------------------------------------------------------------------------- pickling and spawn


def keep_even(sample):
    """A module-level transform: picklable, so spawn workers can run it."""
    return sample if int(sample["cls"]) % 2 == 0 else None


def test_datasets_pickle_and_iterate_the_same(shards, http_url, moto_server, s3_prefix, s3_options):
    base = s3_prefix + "p"
    fs = moto_server.fs()
    for name in os.listdir(shards):
        fs.put_file(str(shards / name), f"{base}/{name}")
    for source, options in ((str(shards), None), (http_url, None), (base, s3_options)):
        ds = shardflow.ShardDataset(source, decode=None, shuffle=True, seed=4, transform=keep_even, storage_options=options)
        first = [s["__key__"] for s in ds]
        copy = pickle.loads(pickle.dumps(ds))
        copy.set_epoch(0)
        assert [s["__key__"] for s in copy] == first and len(first) == N // 2
        assert copy.io.storage_options == (options or {})


def test_spawn_workers(shards):
    ds = shardflow.ShardDataset(str(shards), decode=None, transform=keep_even)
    loader = shardflow.loader(ds, batch_size=4, num_workers=2, multiprocessing_context="spawn", collate_fn=list)
    keys = sorted(s["__key__"] for batch in loader for s in batch)
    assert keys == [f"{i:06d}" for i in range(0, N, 2)]
    assert ds.stats["filtered"] == N // 2 and ds.stats["samples"] == N // 2 and ds.stats["skipped"] == 0


@pytest.mark.filterwarnings("ignore:Got pickle error when attempting to start a worker:UserWarning")
def test_unpicklable_transform_with_spawn_says_so(shards):
    base = resources()
    ds = shardflow.ShardDataset(str(shards), decode=None, transform=lambda s: s)
    loader = shardflow.loader(ds, batch_size=4, num_workers=2, multiprocessing_context="spawn")
    with pytest.raises(TypeError, match=r"the transform <function .*<lambda>.* cannot be pickled") as info:
        list(loader)
    assert "define it at module level" in str(info.value)
    with pytest.raises(TypeError, match="cannot be pickled"):
        pickle.dumps(ds)
    del loader, ds
    assert resources().children <= base.children  # no worker was left behind
