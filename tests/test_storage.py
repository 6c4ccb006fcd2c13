"""Tests of shardflow.storage against real local servers (HTTP, moto S3) and files."""

from __future__ import annotations

import gc
import gzip
import hashlib
import multiprocessing
import os
import re
import threading
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import fsspec
import pytest

from shardflow.errors import RemoteReadError, ShardFormatError, TruncatedShardError
from shardflow.storage import (
    IOOptions,
    RemoteWriteError,
    ShardChangedError,
    ShardNotFoundError,
    decompressing_chunks,
    exists,
    is_compressed,
    iter_chunks,
    join_url,
    list_glob,
    object_size,
    open_chunks,
    open_output,
    read_range,
    readahead,
)
from shardflow.storage.backends.filesystems import filesystem as storage_filesystem
from tests.helpers import handles_under
from tests.servers import FileHTTPServer, wait_until

DATA = hashlib.sha256(b"seed").digest() * 313 + b"tail!"  # 10021 bytes, no repeats at 1000
SIZE = len(DATA)


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def readahead_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "shardflow-readahead"]


# --------------------------------------------------------------------------- stores


@dataclass
class Store:
    """Somewhere to put objects: ``put(rel, data) -> url``."""

    name: str
    put: Callable[[str, bytes], str]
    storage_options: dict[str, Any]

    def options(self, **kwargs: Any) -> IOOptions:
        kwargs.setdefault("backoff", 0.01)
        return IOOptions(storage_options=self.storage_options, **kwargs)


@pytest.fixture
def memory_root():
    root = f"sftest-{uuid.uuid4().hex[:8]}"
    yield root
    fs = fsspec.filesystem("memory")
    if fs.exists(f"/{root}"):
        fs.rm(f"/{root}", recursive=True)


def _local_store(tmp_path, prefix: str = "") -> Store:
    def put(rel: str, data: bytes) -> str:
        path = tmp_path / "store" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        return prefix + str(path)

    return Store("file" if prefix else "local", put, {})


def _memory_store(root: str) -> Store:
    fs = fsspec.filesystem("memory")

    def put(rel: str, data: bytes) -> str:
        fs.pipe(f"/{root}/{rel}", data)
        return f"memory://{root}/{rel}"

    return Store("memory", put, {})


def _s3_store(moto, prefix: str) -> Store:
    fs = moto.fs()

    def put(rel: str, data: bytes) -> str:
        url = prefix + rel
        fs.pipe(url, data)
        fs.invalidate_cache()
        return url

    return Store("s3", put, moto.storage_options)


@pytest.fixture(params=["local", "file", "memory", "http", "s3"])
def store(request, tmp_path, memory_root) -> Store:
    if request.param == "local":
        return _local_store(tmp_path)
    if request.param == "file":
        return _local_store(tmp_path, "file://")
    if request.param == "memory":
        return _memory_store(memory_root)
    if request.param == "http":
        srv = request.getfixturevalue("http_server")
        return Store("http", srv.put, {})
    moto = request.getfixturevalue("moto_server")
    return _s3_store(moto, request.getfixturevalue("s3_prefix"))


# --------------------------------------------------------------------------- options


@pytest.mark.parametrize(
    "kwargs, error",
    [
        ({"retries": -1}, ValueError),
        ({"retries": 1.5}, TypeError),
        ({"retries": True}, TypeError),
        ({"backoff": -0.1}, ValueError),
        ({"backoff": float("nan")}, ValueError),
        ({"block_size": 0}, ValueError),
        ({"readahead": -1}, ValueError),
        ({"cache_limit": 0}, ValueError),
        ({"cache_dir": ""}, ValueError),
        ({"storage_options": [("a", 1)]}, TypeError),
    ],
)
def test_options_rejects_bad_values(kwargs, error):
    with pytest.raises(error):
        IOOptions(**kwargs)


def test_options_copy_storage_options_and_accept_pathlike(tmp_path):
    so = {"anon": True}
    opts = IOOptions(storage_options=so, cache_dir=tmp_path)
    so["anon"] = False
    assert opts.storage_options == {"anon": True}
    assert opts.cache_dir == str(tmp_path)


# --------------------------------------------------------------------------- reading, every store

RANGES = [(0, None), (0, SIZE), (7, None), (5, 1000), (999, 3001), (SIZE - 3, None),
          (0, SIZE + 100), (SIZE, None), (SIZE + 5, SIZE + 9), (42, 42)]


def test_iter_chunks_exact_bytes(store):
    url = store.put("dir/obj.tar", DATA)
    opts = store.options(block_size=1000)
    for start, end in RANGES:
        chunks = list(iter_chunks(url, start, end, opts))
        assert b"".join(chunks) == DATA[start:end], (store.name, start, end)
        assert all(0 < len(c) <= 1000 for c in chunks)
        if start == 0 and end is None:
            assert [len(c) for c in chunks] == [1000] * 10 + [21]


def test_local_reads_at_most_local_read(tmp_path):
    """A local file is read at most LOCAL_READ (2 MiB) at a time, whatever block_size says."""
    from shardflow.storage.reading import LOCAL_READ
    data = os.urandom(LOCAL_READ * 2 + 12345)
    path = tmp_path / "big.tar"
    path.write_bytes(data)
    chunks = list(iter_chunks(str(path), options=IOOptions(block_size=4 << 20)))
    assert LOCAL_READ == 2 << 20
    assert [len(c) for c in chunks] == [LOCAL_READ, LOCAL_READ, 12345]
    assert b"".join(chunks) == data
    assert [len(c) for c in iter_chunks(str(path), 5, None, IOOptions(block_size=1 << 20))] == [1 << 20] * 4 + [12340]


def test_read_range_exact_bytes(store):
    url = store.put("obj.bin", DATA)
    opts = store.options()
    for start, end in [(0, 4), (0, SIZE), (123, 4567), (SIZE - 1, SIZE), (SIZE - 2, SIZE + 50),
                       (SIZE + 3, SIZE + 10), (8, 8)]:
        assert read_range(url, start, end, opts) == DATA[start:end], (store.name, start, end)
    assert object_size(url, opts) == SIZE
    assert exists(url, opts)
    assert not is_compressed(url, opts)


def test_missing_object_raises_not_found(store):
    url = store.put("present.tar", b"x")
    missing = url.replace("present.tar", "absent.tar")
    opts = store.options()
    assert not exists(missing, opts)
    for call in (lambda: list(iter_chunks(missing, options=opts)),
                 lambda: read_range(missing, 0, 10, opts),
                 lambda: object_size(missing, opts)):
        with pytest.raises(ShardNotFoundError) as info:
            call()
        assert isinstance(info.value, FileNotFoundError)
        assert isinstance(info.value, RemoteReadError)
        assert missing in str(info.value)


def test_open_chunks_without_cache_exact(store):
    url = store.put("a/b.tar", DATA)
    for depth in (0, 3):
        got = list(open_chunks(url, 10, 9000, store.options(block_size=512, readahead=depth)))
        assert b"".join(got) == DATA[10:9000]
    assert not readahead_threads() or wait_until(lambda: not readahead_threads())


def test_bad_ranges_are_refused(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"abc")
    for start, end in [(-1, None), (3, 2), ("0", None)]:
        with pytest.raises(ValueError):
            iter_chunks(str(path), start, end)
        with pytest.raises(ValueError):
            open_chunks(str(path), start, end)


def test_empty_object(store):
    url = store.put("empty.tar", b"")
    opts = store.options()
    assert list(iter_chunks(url, options=opts)) == []
    assert read_range(url, 0, 10, opts) == b""
    assert object_size(url, opts) == 0
    assert not is_compressed(url, opts)


# --------------------------------------------------------------------------- retries over HTTP


BIG = os.urandom(1_000_000)


def test_dropped_connections_are_resumed_at_the_offset(flaky_http_server):
    srv = flaky_http_server
    url = srv.put("shard.tar", BIG)
    srv.faults.drop_after = 150_000
    chunks = list(iter_chunks(url, options=IOOptions(block_size=64 << 10, backoff=0.001)))
    assert sha(b"".join(chunks)) == sha(BIG)
    # each response is cut after 150000 bytes (aiohttp may also discard bytes it had
    # buffered when it sees the cut), so at least 6 drops before the last response
    assert srv.stats.drops >= 6
    assert srv.stats.gets == srv.stats.drops + 1
    assert srv.stats.ranged_gets == srv.stats.gets  # each GET asks for the rest only


def test_connection_resets_are_resumed(flaky_http_server):
    srv = flaky_http_server
    url = srv.put("shard.tar", BIG)
    srv.faults.drop_after = 150_000
    srv.faults.reset = True  # data in flight is lost with the connection
    srv.faults.max_drops = 4
    chunks = list(iter_chunks(url, options=IOOptions(block_size=64 << 10, backoff=0.001)))
    assert sha(b"".join(chunks)) == sha(BIG)
    assert srv.stats.drops == 4


def test_dropped_connections_with_start_and_end(flaky_http_server):
    srv = flaky_http_server
    url = srv.put("shard.tar", BIG)
    srv.faults.drop_after = 100_000
    srv.faults.max_drops = 3
    got = b"".join(iter_chunks(url, 12_345, 876_543, IOOptions(block_size=1 << 20, backoff=0.001)))
    assert got == BIG[12_345:876_543]
    assert srv.stats.drops == 3


def test_server_without_range_support(flaky_http_server):
    srv = flaky_http_server
    url = srv.put("shard.tar", BIG)
    srv.faults.ignore_range = True
    srv.faults.drop_after = 400_000
    srv.faults.max_drops = 2
    opts = IOOptions(block_size=1 << 16, backoff=0.001)
    assert b"".join(iter_chunks(url, 1000, None, opts)) == BIG[1000:]
    assert srv.stats.drops == 2 and srv.stats.ranged_gets == 0
    assert read_range(url, 500_000, 500_010, opts) == BIG[500_000:500_010]


def test_http_5xx_is_retried(flaky_http_server):
    srv = flaky_http_server
    url = srv.put("shard.tar", BIG)
    srv.faults.fail_next = 3
    got = b"".join(iter_chunks(url, options=IOOptions(backoff=0.001)))
    assert got == BIG
    assert srv.stats.failures == 3
    srv.faults.fail_next = 2
    assert read_range(url, 10, 20, IOOptions(backoff=0.001)) == BIG[10:20]


def test_retries_exhausted_names_url_and_offset(flaky_http_server):
    srv = flaky_http_server
    url = srv.put("shard.tar", BIG)
    srv.faults.drop_at = 600_000  # every response reaching byte 600000 is cut there
    opts = IOOptions(retries=3, backoff=0.001, block_size=1 << 16)
    with pytest.raises(RemoteReadError) as info:
        list(iter_chunks(url, 600_000, None, opts))
    message = str(info.value)
    assert url in message
    assert "at byte 600000" in message
    assert "after 3 retries" in message
    assert not isinstance(info.value, ShardChangedError)
    assert info.value.__cause__ is not None
    assert srv.stats.gets == 1 + 3

    # from the start: progress up to the cut, then the same failure there
    got = bytearray()
    with pytest.raises(RemoteReadError, match=re.escape(url)) as info:
        for chunk in iter_chunks(url, 0, None, opts):
            got += chunk
    offset = int(re.search(r"at byte (\d+)", str(info.value)).group(1))
    assert offset == len(got)
    assert 600_000 - (1 << 16) < offset <= 600_000
    assert bytes(got) == BIG[:offset]


def test_no_retries_fails_at_first_drop(flaky_http_server):
    srv = flaky_http_server
    url = srv.put("shard.tar", BIG)
    srv.faults.drop_after = 200_000
    with pytest.raises(RemoteReadError, match="at byte"):
        list(iter_chunks(url, options=IOOptions(retries=0, block_size=1 << 16)))
    assert srv.stats.gets == 1


@pytest.mark.parametrize("new", [b"x" * len(BIG), b"short"], ids=["same-size", "other-size"])
def test_object_changed_mid_read(flaky_http_server, new):
    srv = flaky_http_server
    url = srv.put("shard.tar", BIG)
    srv.faults.drop_after = 300_000
    srv.faults.change_on_drop = new
    with pytest.raises(ShardChangedError) as info:
        list(iter_chunks(url, options=IOOptions(block_size=1 << 16, backoff=0.001)))
    assert "changed" in str(info.value)
    assert url in str(info.value)
    assert isinstance(info.value, RemoteReadError)
    assert srv.stats.changes == 1


def test_s3_reads_one_version_per_get(moto_server, s3_prefix):
    """One streaming GET reads one version: a write after the read started does not
    reach it (S3 GETs are atomic), so the bytes are all of the version first seen."""
    fs = moto_server.fs()
    url = s3_prefix + "x.tar"
    fs.pipe(url, BIG)
    opts = IOOptions(storage_options=moto_server.storage_options, block_size=1 << 16, backoff=0.001)
    chunks = iter_chunks(url, options=opts)
    first = next(chunks)
    fs.pipe(url, os.urandom(len(BIG)))
    assert first + b"".join(chunks) == BIG


def test_s3_dropped_stream_reopens_at_the_offset(moto_server, s3_prefix, s3_proxy):
    moto_server.fs().pipe(s3_prefix + "x.tar", BIG)
    opts = IOOptions(storage_options=s3_proxy.storage_options, block_size=1 << 16, backoff=0.001)
    s3_proxy.drop_after(len(BIG) // 3)
    assert b"".join(iter_chunks(s3_prefix + "x.tar", options=opts)) == BIG
    assert s3_proxy.drops == 1


def test_s3_object_changed_before_a_reopen(moto_server, s3_prefix, s3_proxy):
    """The reopen after a drop sends If-Match with the first ETag: the store refuses
    the new version, so two versions are never spliced."""
    fs = moto_server.fs()
    url = s3_prefix + "x.tar"
    fs.pipe(url, BIG)
    opts = IOOptions(storage_options=s3_proxy.storage_options, block_size=1 << 16, backoff=0.001)
    s3_proxy.drop_after(len(BIG) // 2, hold=True)  # the first GET stalls half-way...
    chunks = iter_chunks(url, options=opts)
    got = [next(chunks)]
    fs.pipe(url, os.urandom(len(BIG)))  # ...the object is replaced...
    s3_proxy.release()  # ...and then the connection drops
    with pytest.raises(ShardChangedError, match=r"x\.tar changed while being read, at byte \d+ \(its ETag"):
        for chunk in chunks:
            got.append(chunk)
    data = b"".join(got)
    assert s3_proxy.drops == 1
    # (aiohttp discards what it buffered once the connection fails, so the cut is at a chunk)
    assert 1 << 16 <= len(data) < len(BIG) and data == BIG[: len(data)]  # old bytes only


def test_s3_range_past_the_end_and_empty_objects(moto_server, s3_prefix):
    fs = moto_server.fs()
    fs.pipe(s3_prefix + "e.tar", b"")
    fs.pipe(s3_prefix + "s.tar", b"0123456789")
    opts = IOOptions(storage_options=moto_server.storage_options)
    assert list(iter_chunks(s3_prefix + "e.tar", options=opts)) == []
    assert list(iter_chunks(s3_prefix + "s.tar", 10, options=opts)) == []
    assert list(iter_chunks(s3_prefix + "s.tar", 12, options=opts)) == []
    assert b"".join(iter_chunks(s3_prefix + "s.tar", 4, 7, options=opts)) == b"456"
    assert b"".join(iter_chunks(s3_prefix + "s.tar", 4, 70, options=opts)) == b"456789"
    with pytest.raises(ShardNotFoundError, match="shard not found"):
        list(iter_chunks(s3_prefix + "missing.tar", options=opts))


def test_object_changed_local(tmp_path):
    path = tmp_path / "shard.tar"
    path.write_bytes(BIG)
    chunks = iter_chunks(str(path), options=IOOptions(block_size=1 << 16))
    next(chunks)
    chunks.close()
    # a reopen after a change is refused: simulate via the cache-less internal path
    chunks = iter_chunks(str(path), options=IOOptions(block_size=1 << 16, backoff=0.001))
    assert next(chunks) == BIG[: 1 << 16]
    os.truncate(path, 100_000)  # the local reader sees a short read, retries, sees the change
    with pytest.raises(ShardChangedError, match="changed"):
        list(chunks)


def test_server_ignoring_content_encoding_yields_raw_object(http_server):
    payload = BIG[:200_000]
    blob = gzip.compress(payload)
    url = http_server.put("s.tar.gz", blob)
    http_server.faults.content_encoding["s.tar.gz"] = "gzip"
    opts = IOOptions(block_size=1 << 14)
    raw = b"".join(iter_chunks(url, options=opts))
    assert raw == blob  # the stored bytes: sizes and sha256 match the manifest
    assert b"".join(decompressing_chunks(open_chunks(url, options=opts), url)) == payload
    assert is_compressed(url, opts)


# --------------------------------------------------------------------------- decompression


def _split(data: bytes, size: int) -> list[bytes]:
    return [data[i : i + size] for i in range(0, len(data), size)]


class Source:
    """A chunk generator that records whether it was closed."""

    def __init__(self, chunks, fail_at: int | None = None) -> None:
        self.chunks = list(chunks)
        self.fail_at = fail_at
        self.closed = False
        self.produced = 0

    def __iter__(self):
        try:
            for i, chunk in enumerate(self.chunks):
                if i == self.fail_at:
                    raise ValueError(f"bad chunk {i}")
                self.produced += 1
                yield chunk
        finally:
            self.closed = True


def _zstd(data: bytes, checksum: bool = False) -> bytes:
    zstandard = pytest.importorskip("zstandard")
    return zstandard.ZstdCompressor(write_checksum=checksum).compress(data)


def _zstd_checked(data: bytes) -> bytes:
    return _zstd(data, checksum=True)


@pytest.mark.parametrize("size", [1, 3, 1000, 1 << 20])
@pytest.mark.parametrize("kind", ["gzip", "gzip-members", "zstd", "zstd-frames", "plain"])
def test_decompressing_chunks_round_trip(kind, size):
    payload = BIG[:300_000] + bytes(300_000)
    if kind == "gzip":
        blob = gzip.compress(payload)
    elif kind == "gzip-members":
        blob = gzip.compress(payload[:100_000]) + gzip.compress(payload[100_000:])
    elif kind == "zstd":
        blob = _zstd(payload)
    elif kind == "zstd-frames":
        blob = _zstd(payload[:100_000]) + _zstd(payload[100_000:])
    else:
        blob = payload
    out = list(decompressing_chunks(iter(_split(blob, size)), "mem://x"))
    assert b"".join(out) == payload
    assert all(out)


@pytest.mark.parametrize("compress", [gzip.compress, _zstd], ids=["gzip", "zstd"])
def test_decompressed_bytes_come_before_the_rest_of_the_input(compress):
    """A reader waiting for a shard's first samples gets them once their compressed bytes
    came, not once the rest of the shard (or 4 MiB of output) did."""
    payload = BIG[:1_000_000]
    blob = compress(payload)
    pieces = _split(blob, 16 << 10)
    taken = []

    def source():
        for piece in pieces:
            taken.append(len(piece))
            yield piece

    out = decompressing_chunks(source(), "mem://x")
    first = next(out)
    assert payload.startswith(first)
    assert sum(taken) <= len(blob) // 2, (sum(taken), len(blob))
    assert first + b"".join(out) == payload


@pytest.mark.parametrize("compress", [gzip.compress, _zstd], ids=["gzip", "zstd"])
def test_decompressing_chunks_truncated(compress):
    blob = compress(BIG[:200_000])
    for cut in (len(blob) - 1, len(blob) // 2, 10):
        with pytest.raises(TruncatedShardError) as info:
            list(decompressing_chunks(iter(_split(blob[:cut], 4096)), "s3://b/shard.tar.gz"))
        assert "s3://b/shard.tar.gz" in str(info.value)
        assert isinstance(info.value, ShardFormatError)


@pytest.mark.parametrize("compress", [gzip.compress, _zstd_checked], ids=["gzip", "zstd"])
def test_decompressing_chunks_corrupt(compress):
    blob = bytearray(compress(BIG[:200_000]))  # (zstd only notices with a checksum)
    blob[len(blob) // 2 : len(blob) // 2 + 64] = bytes(64)
    with pytest.raises(ShardFormatError, match=re.escape("shard-7.tar")):
        list(decompressing_chunks(iter([bytes(blob)]), "shard-7.tar"))


def test_decompressing_chunks_bounds_output_and_closes_source():
    blob = gzip.compress(bytes(64 << 20), compresslevel=1)
    src = Source(_split(blob, 1 << 16))
    out = decompressing_chunks(iter(src), "zeros.tar.gz")
    total = 0
    for chunk in out:
        assert len(chunk) <= 4 << 20
        total += len(chunk)
    assert total == 64 << 20
    src = Source(_split(blob, 1 << 16))
    out = decompressing_chunks(iter(src), "zeros.tar.gz")
    next(out)
    out.close()
    assert src.closed


def test_decompressing_chunks_passthrough_edge_cases():
    assert list(decompressing_chunks(iter([]), "x")) == []
    assert b"".join(decompressing_chunks(iter([b"\x1f"]), "x")) == b"\x1f"
    assert b"".join(decompressing_chunks(iter([b"ab", b"", b"c", b"defg"]), "x")) == b"abcdefg"


def test_is_compressed(tmp_path):
    (tmp_path / "a.gz").write_bytes(gzip.compress(b"abc"))
    (tmp_path / "a.zst").write_bytes(_zstd(b"abc"))
    (tmp_path / "a.tar").write_bytes(b"ustar" * 10)
    (tmp_path / "tiny").write_bytes(b"\x1f")
    assert is_compressed(str(tmp_path / "a.gz"))
    assert is_compressed(str(tmp_path / "a.zst"))
    assert not is_compressed(str(tmp_path / "a.tar"))
    assert not is_compressed(str(tmp_path / "tiny"))


# --------------------------------------------------------------------------- read-ahead


def test_readahead_preserves_order_and_ends():
    src = Source([bytes([i]) * 10 for i in range(50)])
    it = readahead(iter(src), 3)
    assert list(it) == src.chunks
    assert wait_until(lambda: not readahead_threads())
    assert src.closed


def test_readahead_zero_depth_is_identity():
    chunks = iter([b"a"])
    assert readahead(chunks, 0) is chunks
    with pytest.raises(ValueError):
        readahead(chunks, -1)


def test_readahead_propagates_exceptions():
    src = Source([b"a", b"b", b"c", b"d"], fail_at=2)
    it = readahead(iter(src), 2)
    assert next(it) == b"a"
    assert next(it) == b"b"
    with pytest.raises(ValueError, match="bad chunk 2"):
        next(it)
    with pytest.raises(StopIteration):
        next(it)
    assert wait_until(lambda: not readahead_threads())
    assert src.closed


def test_readahead_close_stops_thread_and_closes_source():
    before = set(threading.enumerate())  # the threads themselves, not a count others' threads ending can lower
    src = Source([b"x" * 100] * 1000)
    it = readahead(iter(src), 2)
    assert next(it) == b"x" * 100
    assert wait_until(lambda: src.produced >= 3)  # the thread fills the queue ...
    assert src.produced <= 1 + 2 + 1  # ... and no further: bounded by depth
    it.close()
    assert src.closed
    assert not readahead_threads()
    assert [t.name for t in threading.enumerate() if t not in before] == []
    with pytest.raises(StopIteration):
        next(it)


def test_readahead_garbage_collected_stops_thread():
    src = Source([b"x" * 100] * 1000)
    it = readahead(iter(src), 2)
    next(it)
    del it
    gc.collect()
    assert wait_until(lambda: src.closed and not readahead_threads())


def test_readahead_never_started_is_stopped_by_gc():
    src = Source([b"x"] * 100)
    readahead(iter(src), 1)  # dropped at once
    gc.collect()
    assert wait_until(lambda: src.closed and not readahead_threads())


# --------------------------------------------------------------------------- handle hygiene


def test_local_file_handles_are_released(tmp_path):
    path = tmp_path / "shard.tar"
    path.write_bytes(BIG)
    opts = IOOptions(block_size=1 << 16)
    assert handles_under(path) == 0

    assert b"".join(iter_chunks(str(path), options=opts)) == BIG
    assert handles_under(path) == 0

    it = iter_chunks(str(path), options=opts)
    next(it)
    assert handles_under(path) == 1
    it.close()
    assert handles_under(path) == 0

    it = iter_chunks(str(path), options=opts)
    next(it)
    del it
    gc.collect()
    assert handles_under(path) == 0

    it = open_chunks(str(path), options=IOOptions(block_size=1 << 16, readahead=2))
    next(it)
    it.close()
    assert handles_under(path) == 0

    it = decompressing_chunks(open_chunks(str(path), options=opts), str(path))
    next(it)
    it.close()
    assert wait_until(lambda: handles_under(path) == 0)
    assert read_range(str(path), 5, 10) == BIG[5:10]
    assert handles_under(path) == 0


def test_http_early_close_releases_connection(http_server):
    psutil = pytest.importorskip("psutil")
    proc = psutil.Process()
    url = http_server.put("shard.tar", BIG)
    opts = IOOptions(block_size=1 << 14)
    assert b"".join(iter_chunks(url, options=opts)) == BIG  # one pooled connection now
    baseline = proc.num_fds()
    for _ in range(5):
        it = iter_chunks(url, options=opts)
        next(it)
        it.close()  # the half-read response's connection is closed, not pooled
        it = open_chunks(url, options=IOOptions(block_size=1 << 14, readahead=2))
        next(it)
        del it
        gc.collect()
    assert wait_until(lambda: proc.num_fds() <= baseline)
    assert b"".join(iter_chunks(url, options=opts)) == BIG


# --------------------------------------------------------------------------- atomic output


def test_open_output_local(tmp_path):
    target = tmp_path / "out" / "sub" / "shard-000000.tar"
    with open_output(str(target)) as f:
        f.write(b"hello")
        assert not target.exists()
    assert target.read_bytes() == b"hello"
    assert sorted(p.name for p in target.parent.iterdir()) == ["shard-000000.tar"]

    with pytest.raises(KeyError), open_output(str(target)) as f:
        f.write(b"partial")
        raise KeyError("boom")
    assert target.read_bytes() == b"hello"  # the old object is untouched
    assert sorted(p.name for p in target.parent.iterdir()) == ["shard-000000.tar"]

    fresh = tmp_path / "out" / "never.tar"
    with pytest.raises(RuntimeError), open_output("file://" + str(fresh)) as f:
        f.write(b"x" * 100)
        raise RuntimeError
    assert sorted(p.name for p in fresh.parent.iterdir()) == ["sub"]


def test_open_output_memory(memory_root):
    url = f"memory://{memory_root}/w/shard.tar"
    with pytest.raises(RuntimeError), open_output(url) as f:
        f.write(b"partial")
        raise RuntimeError
    assert not exists(url)
    with open_output(url) as f:
        f.write(BIG)
    assert read_range(url, 0, SIZE) == BIG[:SIZE]
    assert object_size(url) == len(BIG)


def test_open_output_s3(moto_server, s3_prefix):
    opts = IOOptions(storage_options=moto_server.storage_options)
    url = s3_prefix + "shard-000001.tar"
    with pytest.raises(RuntimeError), open_output(url, opts) as f:
        f.write(BIG)
        raise RuntimeError
    assert not exists(url, opts)
    assert list_glob(s3_prefix + "*", opts) == []
    with open_output(url, opts) as f:
        f.write(BIG)
    assert b"".join(iter_chunks(url, options=opts)) == BIG
    assert list_glob(s3_prefix + "*.tar", opts) == [url]


def test_open_output_upload_failure_is_remote_write_error(tmp_path):
    # http(s) filesystems cannot be written: the failure surfaces as RemoteWriteError
    with FileHTTPServer(tmp_path) as srv, pytest.raises(RemoteWriteError) as info:
        with open_output(srv.url + "/x.tar") as f:
            f.write(b"x")
    assert srv.url + "/x.tar" in str(info.value)


# --------------------------------------------------------------------------- cache


def _cache_child(url: str, cache_dir: str, barrier, results) -> None:
    barrier.wait(120)  # spawned children import the test module: seconds each on a loaded machine
    opts = IOOptions(cache_dir=cache_dir, block_size=1 << 16)
    results.put(sha(b"".join(open_chunks(url, options=opts))))


def _data_files(cache_dir) -> list[str]:
    return sorted(n for n in os.listdir(cache_dir) if not n.startswith("."))


def test_cache_shared_by_processes_downloads_once(flaky_http_server, tmp_path):
    srv = flaky_http_server
    payload = os.urandom(2 << 20)
    url = srv.put("data/shard-000000.tar", payload)
    srv.faults.delay = 0.005  # a download takes ~0.2 s: the two readers overlap
    cache_dir = str(tmp_path / "cache")
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(3)
    results = ctx.Queue()
    procs = [ctx.Process(target=_cache_child, args=(url, cache_dir, barrier, results))
             for _ in range(2)]
    for p in procs:
        p.start()
    barrier.wait(120)
    digests = [results.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    assert digests == [sha(payload)] * 2
    assert srv.stats.gets_by_path["data/shard-000000.tar"] == 1
    files = _data_files(cache_dir)
    assert len(files) == 1 and files[0].endswith("-shard-000000.tar")
    assert (tmp_path / "cache" / files[0]).read_bytes() == payload
    assert not [n for n in os.listdir(cache_dir) if n.startswith(".tmp-")]

    # this process: served from the cache, a range of it, no new GET
    opts = IOOptions(cache_dir=cache_dir, block_size=1 << 16)
    assert b"".join(open_chunks(url, 1000, 5000, opts)) == payload[1000:5000]
    assert srv.stats.gets_by_path["data/shard-000000.tar"] == 1


def test_cache_threads_download_once(http_server, tmp_path):
    url = http_server.put("shard.tar", BIG)
    http_server.faults.delay = 0.002
    opts = IOOptions(cache_dir=str(tmp_path / "c"), block_size=1 << 16)
    results: list[bytes] = []

    def read() -> None:
        results.append(b"".join(open_chunks(url, options=opts)))

    threads = [threading.Thread(target=read) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert results == [BIG] * 4
    assert http_server.stats.gets_by_path["shard.tar"] == 1


def test_cache_lru_eviction_and_in_use(memory_root, tmp_path):
    store = _memory_store(memory_root)
    cache_dir = tmp_path / "cache"
    opts = IOOptions(cache_dir=str(cache_dir), cache_limit=2500, readahead=0, block_size=256)
    blobs = {name: os.urandom(1000) for name in "abcde"}
    urls = {name: store.put(f"{name}.tar", blob) for name, blob in blobs.items()}

    def read(name: str) -> None:
        assert b"".join(open_chunks(urls[name], options=opts)) == blobs[name]

    def cached() -> list[str]:
        return sorted(n.split("-", 1)[1] for n in _data_files(cache_dir))

    read("a")
    read("b")
    assert cached() == ["a.tar", "b.tar"]
    read("c")  # 3000 > 2500: the least recently used (a) goes
    assert cached() == ["b.tar", "c.tar"]
    read("b")  # b is now more recent than c
    read("d")
    assert cached() == ["b.tar", "d.tar"]

    held = open_chunks(urls["b"], options=opts)  # b is older than d but in use
    assert next(held) == blobs["b"][:256]
    read("e")
    assert cached() == ["b.tar", "e.tar"]
    assert b"".join(held) == blobs["b"][256:]  # its lock is released at the end
    held.close()
    read("a")
    assert cached() == ["a.tar", "e.tar"]
    assert sum(os.path.getsize(cache_dir / n) for n in _data_files(cache_dir)) <= 2500


def test_cache_leaves_no_lock_files(memory_root, tmp_path):
    """A lock file lives while its entry is in use; its last user (or eviction) removes it."""
    store = _memory_store(memory_root)
    cache_dir = tmp_path / "cache"
    opts = IOOptions(cache_dir=str(cache_dir), cache_limit=2500, readahead=0, block_size=256)
    blobs = {name: os.urandom(1000) for name in "abcd"}
    urls = {name: store.put(f"{name}.tar", blob) for name, blob in blobs.items()}

    def locks() -> list[str]:
        return sorted(os.listdir(cache_dir / ".locks"))

    held = [open_chunks(urls[n], options=opts) for n in "ab"]
    assert [next(h) for h in held] == [blobs["a"][:256], blobs["b"][:256]]
    assert len(locks()) == 2  # one per entry in use
    second = open_chunks(urls["a"], options=opts)  # a second user of the same entry
    assert b"".join(second) == blobs["a"]
    assert len(locks()) == 2  # the first user still holds it
    for h in held:
        h.close()
    assert locks() == []
    for n in "abcd":  # c and d evict a and b (limit 2,500 bytes)
        assert b"".join(open_chunks(urls[n], options=opts)) == blobs[n]
    assert locks() == []
    assert len(_data_files(cache_dir)) == 2
    assert b"".join(open_chunks(urls["c"], options=opts)) == blobs["c"]  # still served from the cache
    assert locks() == []


def test_cache_bypassed_when_object_exceeds_limit_or_no_room(memory_root, tmp_path):
    store = _memory_store(memory_root)
    cache_dir = tmp_path / "cache"
    opts = IOOptions(cache_dir=str(cache_dir), cache_limit=1500, readahead=0)
    big = store.put("big.tar", BIG[:2000])
    assert b"".join(open_chunks(big, options=opts)) == BIG[:2000]
    assert _data_files(cache_dir) == []

    small = [store.put(f"s{i}.tar", bytes([i]) * 1000) for i in range(2)]
    held = open_chunks(small[0], options=opts)
    next(held)  # cached and in use
    assert b"".join(open_chunks(small[1], options=opts)) == bytes([1]) * 1000  # no room
    assert [n.split("-", 1)[1] for n in _data_files(cache_dir)] == ["s0.tar"]
    held.close()


def test_cache_hit_by_the_manifest_digest_asks_the_store_nothing(http_server, tmp_path):
    """A copy checked against the manifest's sha256 is found by it again with no request
    (a later epoch reads from local disk alone); without the digest, one HEAD names it."""
    data = os.urandom(300_000)
    url = http_server.put("s.tar", data)
    opts = IOOptions(cache_dir=str(tmp_path / "c"), block_size=1 << 16)
    assert b"".join(open_chunks(url, options=opts, sha256=sha(data))) == data
    assert http_server.stats.gets_by_path["s.tar"] == 1
    http_server.reset_stats()
    assert b"".join(open_chunks(url, options=opts, sha256=sha(data))) == data
    assert b"".join(open_chunks(url, 10, 20, opts, sha256=sha(data))) == data[10:20]
    assert http_server.stats.requests == 0
    assert b"".join(open_chunks(url, 10, 20, opts)) == data[10:20]  # the same copy, by its identity
    assert (http_server.stats.gets, http_server.stats.heads) == (0, 1)
    new = os.urandom(200_000)  # rewritten, under a new manifest: a fresh entry, checked
    http_server.put("s.tar", new)
    assert b"".join(open_chunks(url, options=opts, sha256=sha(new))) == new
    assert len(_data_files(str(tmp_path / "c"))) == 2


def test_cache_refetches_a_changed_object(memory_root, tmp_path):
    store = _memory_store(memory_root)
    opts = IOOptions(cache_dir=str(tmp_path / "cache"), readahead=1)
    url = store.put("x.tar", b"first version")
    assert b"".join(open_chunks(url, options=opts)) == b"first version"
    store.put("x.tar", b"second, longer version")
    assert b"".join(open_chunks(url, options=opts)) == b"second, longer version"
    assert b"".join(open_chunks(url, 8, 14, opts)) == b"longer"


def test_cache_removes_dead_downloads(memory_root, tmp_path):
    store = _memory_store(memory_root)
    cache_dir = tmp_path / "cache"
    cache_dir.mkdir()
    # a download left behind by a dead process reserves nothing and is cleaned up
    (cache_dir / ".tmp-0123456789abcdef0123456789abcdef-900-aaaa").write_bytes(b"x" * 10)
    opts = IOOptions(cache_dir=str(cache_dir), cache_limit=1000, readahead=0)
    url = store.put("x.tar", b"y" * 600)
    assert b"".join(open_chunks(url, options=opts)) == b"y" * 600
    assert [n for n in os.listdir(cache_dir) if n.startswith(".tmp-")] == []
    assert len(_data_files(cache_dir)) == 1


def test_local_paths_are_not_cached(tmp_path):
    path = tmp_path / "shard.tar"
    path.write_bytes(b"abc")
    opts = IOOptions(cache_dir=str(tmp_path / "cache"))
    assert b"".join(open_chunks(str(path), options=opts)) == b"abc"
    assert not (tmp_path / "cache").exists()


# --------------------------------------------------------------------------- urls and listings


@pytest.mark.parametrize(
    "base, rel, expected",
    [
        ("s3://b/x", "s.tar", "s3://b/x/s.tar"),
        ("s3://b/x/", "sub/s.tar", "s3://b/x/sub/s.tar"),
        ("s3://b/x/y/", "../s.tar", "s3://b/x/s.tar"),
        ("s3://b/x", "/c/k.tar", "s3://c/k.tar"),
        ("gs://b/x/", "./s.tar", "gs://b/x/s.tar"),
        ("https://h/a", "s.tar", "https://h/a/s.tar"),
        ("https://h/a/b/", "../s.tar", "https://h/a/s.tar"),
        ("http://h:8000/a/", "/root.tar", "http://h:8000/root.tar"),
        ("/data/x", "s.tar", "/data/x/s.tar"),
        ("/data/x/", "../y/s.tar", "/data/y/s.tar"),
        ("data", "s.tar", os.path.join("data", "s.tar")),
        ("/data/x", "/abs/s.tar", "/abs/s.tar"),
        ("file:///data/x/", "s.tar", "file:///data/x/s.tar"),
        ("memory://x", "s.tar", "memory://x/s.tar"),
        ("s3://b/x", "https://h/s.tar", "https://h/s.tar"),
    ],
)
def test_join_url(base, rel, expected):
    assert join_url(base, rel) == expected


def test_join_url_rejects_empty():
    with pytest.raises(ValueError):
        join_url("s3://b/", "")


def test_list_glob(tmp_path, memory_root, http_server, monkeypatch):
    for name in ("b.tar", "a.tar", "c.txt"):
        (tmp_path / name).write_bytes(b"x")
        http_server.put(f"d/{name}", b"x")
        _memory_store(memory_root).put(name, b"x")
    monkeypatch.chdir(tmp_path)
    assert list_glob("*.tar") == ["a.tar", "b.tar"]
    assert list_glob(str(tmp_path / "*.tar")) == [str(tmp_path / "a.tar"), str(tmp_path / "b.tar")]
    assert list_glob(f"file://{tmp_path}/*.tar") == [f"file://{tmp_path}/a.tar",
                                                     f"file://{tmp_path}/b.tar"]
    assert list_glob(f"memory://{memory_root}/*.tar") == [f"memory://{memory_root}/a.tar",
                                                          f"memory://{memory_root}/b.tar"]
    assert list_glob(f"{http_server.url}/d/*.tar") == [f"{http_server.url}/d/a.tar",
                                                       f"{http_server.url}/d/b.tar"]
    assert list_glob(f"memory://{memory_root}/*.none") == []


def test_per_protocol_storage_options(http_server, moto_server, s3_prefix):
    # one options object for sources on two protocols: s3 keys must not reach aiohttp
    opts = IOOptions(storage_options={"s3": moto_server.storage_options, "http": {}})
    s3_url = s3_prefix + "o.tar"
    moto_server.fs().pipe(s3_url, b"from s3")
    http_url = http_server.put("o.tar", b"from http")
    assert b"".join(iter_chunks(s3_url, options=opts)) == b"from s3"
    assert b"".join(iter_chunks(http_url, options=opts)) == b"from http"


def test_s3_filesystems_share_one_session_unless_the_user_sets_one(moto_server):
    """Every s3:// filesystem of a process builds its client from one aiobotocore
    session (parsed models are kept: forked workers inherit them); a profile or a
    session of the user's own is left to s3fs."""
    from shardflow.storage.backends import filesystems

    opts = IOOptions(storage_options=moto_server.storage_options)
    fs_a, _ = filesystems.filesystem("s3://a/x.tar", opts)
    fs_b, _ = filesystems.filesystem("s3://b/y.tar", opts)
    assert fs_a.session is fs_b.session is filesystems.shared_s3_session()
    own = object()
    fs_c, _ = filesystems.filesystem("s3://a/x.tar", IOOptions(storage_options={**moto_server.storage_options, "session": own}))
    assert fs_c.session is own
    fs_d, _ = filesystems.filesystem("s3://a/x.tar", IOOptions(storage_options={**moto_server.storage_options, "profile": "p"}))
    assert fs_d.session is None  # s3fs creates it (for that profile) on first use


class _ContainerCredentials(BaseHTTPRequestHandler):
    """ECS/EKS-style container credentials that expire in 5 minutes (botocore then
    refreshes them on use, under an asyncio lock bound to the event loop)."""

    def log_message(self, *args):  # noqa: D401 - silence the stdlib server
        pass

    def do_GET(self):
        import datetime
        import json

        expires = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(minutes=5)
        body = json.dumps({"AccessKeyId": "testing", "SecretAccessKey": "testing", "Token": "testing",
                           "Expiration": expires.strftime("%Y-%m-%dT%H:%M:%SZ")}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def test_forked_workers_resolve_refreshable_credentials_again(moto_server, s3_prefix, monkeypatch):
    """The shared session's credentials are bound to the parent's event loop: a
    forked DataLoader worker must resolve its own, or its first refresh fails."""
    import torch

    import shardflow
    from shardflow.storage.backends import filesystems

    with shardflow.ShardWriter(s3_prefix + "t-%06d.tar", max_count=5, storage_options=moto_server.storage_options) as w:
        for i in range(20):
            w.write({"__key__": f"{i:06d}", "cls": i})
    server = ThreadingHTTPServer(("127.0.0.1", 0), _ContainerCredentials)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SECURITY_TOKEN", "AWS_SESSION_TOKEN"):
            monkeypatch.delenv(name, raising=False)
        monkeypatch.setenv("AWS_CONTAINER_CREDENTIALS_FULL_URI", f"http://127.0.0.1:{server.server_address[1]}/creds")
        monkeypatch.setattr(filesystems, "_S3_SESSION", None)
        options = {"client_kwargs": moto_server.storage_options["client_kwargs"]}  # credentials from the environment
        ds = shardflow.ShardDataset(s3_prefix, decode=None, shuffle=True, storage_options=options)
        assert sorted(int(s["cls"]) for s in ds) == list(range(20))  # the parent resolved refreshable credentials
        assert "Refreshable" in type(filesystems._S3_SESSION._credentials).__name__
        loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="fork", timeout=60)
        assert sorted(int(s["cls"]) for s in loader) == list(range(20))
    finally:
        server.shutdown()
        server.server_close()


def test_s3_store_that_ignores_range_is_refused(moto_server, s3_prefix, monkeypatch):
    data = bytes(range(256)) * 40
    moto_server.fs().pipe(s3_prefix + "x.tar", data)
    opts = IOOptions(storage_options=moto_server.storage_options, retries=0)
    fs, _ = storage_filesystem(s3_prefix + "x.tar", opts)
    real = type(fs)._call_s3

    async def without_range(self, method, *args, **kwargs):  # a gateway answering 200 + the whole object
        kwargs.pop("Range", None)
        return await real(self, method, *args, **kwargs)

    monkeypatch.setattr(type(fs), "_call_s3", without_range)
    assert b"".join(iter_chunks(s3_prefix + "x.tar", 0, 100, options=opts)) == data[:100]
    with pytest.raises(RemoteReadError, match=r"x\.tar: asked for bytes from 100, the store answered without a Content-Range"):
        b"".join(iter_chunks(s3_prefix + "x.tar", 100, 200, options=opts))


def test_errors_not_about_the_store_propagate_unchanged(tmp_path, monkeypatch):
    """Only I/O errors become RemoteReadError (with the URL and offset); anything else,
    a bug or torch's "DataLoader worker exited unexpectedly" RuntimeError raised by a
    signal handler in the middle of a read, keeps its type."""
    from shardflow.storage.readers.local import LocalReader

    path = tmp_path / "s.tar"
    path.write_bytes(b"x" * 1000)

    def broken(self, n):
        raise RuntimeError("DataLoader worker (pid 1) exited unexpectedly")

    monkeypatch.setattr(LocalReader, "read", broken)
    with pytest.raises(RuntimeError, match="exited unexpectedly"):
        list(iter_chunks(str(path)))
    monkeypatch.setattr(LocalReader, "read", lambda self, n: (_ for _ in ()).throw(PermissionError("denied")))
    with pytest.raises(RemoteReadError, match=r"s\.tar failed at byte 0: PermissionError: denied"):
        list(iter_chunks(str(path)))


@pytest.mark.parametrize("url", ["", "a/b.tar", "/abs/x", "file:///a/b", "file://rel", "s3://bucket/k", "C://x/y",
                                 "c:\\\\x", "memory://x", "data:text/plain,hi", "simplecache::s3://b/k",
                                 "https://h/p?q=a://b", "x://", "://x"])
def test_protocol_follows_fsspec_split_protocol_without_importing_it(url):
    from fsspec.core import split_protocol

    from shardflow.storage.urls import protocol

    assert protocol(url) == (split_protocol(url)[0] or "")


def test_local_conversion_imports_neither_fsspec_asyncio_nor_http(tmp_path):
    # a local conversion and read-back stay clear of the remote stack (~30 ms of imports)
    import subprocess
    import sys

    tree = tmp_path / "src" / "cat"
    tree.mkdir(parents=True)
    from tests.helpers import tiny_image

    (tree / "a.jpg").write_bytes(tiny_image("JPEG", 0))
    script = (
        "import sys\n"
        "from shardflow.convert.engine.engine import ConvertOptions\n"
        "from shardflow.convert.images.imagefolder import convert_imagefolder\n"
        f"m = convert_imagefolder({str(tmp_path / 'src')!r}, {str(tmp_path / 'out')!r}, "
        "options=ConvertOptions(workers=2))\n"
        "print(m.shards[0].samples, [n for n in ('fsspec', 'asyncio', 'http.client') if n in sys.modules])\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True)
    assert proc.stdout.strip() == "1 []"
