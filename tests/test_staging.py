"""A rank's DataLoader workers share remote fetches through its staging area
(shardflow.storage.sharing.staging / staged): bytes and requests counted by the loopback
HTTP server, samples compared with the 0-worker read and with the bytes written,
a crashed fetcher taken over at the byte offset it reached, areas removed."""

from __future__ import annotations

import multiprocessing
import os
import signal
from pathlib import Path

import numpy as np
import pytest

import shardflow
from shardflow.planning.plan import ShuffleConfig
from shardflow.storage import IOOptions
from shardflow.storage.sharing import staged
from shardflow.storage.sharing import staged_blocks
from shardflow.storage.sharing import staging
from shardflow.storage.sharing.staging import StagedOptions, StagingScope

FAST = IOOptions(backoff=0.0)
REMOTE = ["http://127.0.0.1:1/train-000000.tar"]


def payload(i: int, size: int) -> bytes:
    return np.random.default_rng(i).integers(0, 256, size + (i * 37) % 500, dtype=np.uint8).tobytes()


def write(folder, n: int, per: int, size: int = 1500) -> dict[str, bytes]:
    want = {}
    with shardflow.ShardWriter(str(folder / "train-%06d.tar"), max_count=per) as sink:
        for i in range(n):
            key = f"{i:06d}"
            want[key] = payload(i, size)
            sink.write({"__key__": key, "bin": want[key], "cls": i})
    return want


def serve(srv, folder) -> int:
    """Serve ``folder``'s files; returns the bytes of its shards."""
    stored = 0
    for name in sorted(os.listdir(folder)):
        data = (folder / name).read_bytes()
        srv.put(name, data)
        stored += len(data) if name.endswith(".tar") else 0
    return stored


def tar_gets(srv) -> int:
    return sum(v for k, v in srv.stats.gets_by_path.items() if k.endswith(".tar"))


def epoch(url: str, workers: int, io: IOOptions, **kwargs) -> list[tuple[str, bytes]]:
    # window 0: a bucket's shards are read without the window shuffle (random access by sample is for
    # local shards), so the local reference is read the same way
    ds = shardflow.ShardDataset(url, decode=None, shuffle=ShuffleConfig(window=0), seed=5, io=io, **kwargs)
    loader = shardflow.loader(ds, batch_size=8, num_workers=workers, collate_fn=list)
    return [(s["__key__"], s["bin"]) for batch in loader for s in batch]


@pytest.fixture
def small_blocks(monkeypatch):
    """Blocks of 64 KiB, so that the test's small shards span several (workers fork)."""
    monkeypatch.setattr(staged_blocks, "BLOCK", 64 << 10)


@pytest.mark.parametrize("workers", [0, 1, 2, 4, 8])
def test_each_byte_once_per_rank_whatever_the_workers(http_server, tmp_path, small_blocks, workers):
    """Every worker reads nearly every byte of the rank's shards (batches round
    robin); staged, the server sends each shard once, in about one GET."""
    srv = http_server
    want = write(tmp_path / "d", 600, 200)  # 3 shards of ~400 KB: 6-7 blocks each
    stored = serve(srv, tmp_path / "d")
    io = IOOptions(backoff=0.0, staging_dir=str(tmp_path / "staging"))
    reference = epoch(str(tmp_path / "d"), 0, io)  # the local read
    assert sorted(reference) == sorted(want.items())
    srv.reset_stats()
    assert epoch(srv.url, workers, io) == reference  # the same batches, in the same order
    tar_bytes = srv.stats.body_bytes - sum(os.path.getsize(tmp_path / "d" / n) for n in os.listdir(tmp_path / "d")
                                           if not n.endswith(".tar") and srv.stats.gets_by_path.get(n))
    assert tar_bytes <= 1.1 * stored, (tar_bytes, stored)
    # one GET per shard: every worker starts at block 0, and a fetch claims each next
    # block before its current one is complete, so no reader gets ahead of it
    assert tar_gets(srv) == 3, srv.stats.gets_by_path
    assert os.listdir(tmp_path / "staging") == []  # removed by the last worker out


def test_without_staging_each_worker_streams_every_shard(http_server, tmp_path):
    """The cost staging removes (and the switch that turns it off)."""
    srv = http_server
    write(tmp_path / "d", 600, 200)
    stored = serve(srv, tmp_path / "d")
    srv.reset_stats()
    epoch(srv.url, 4, IOOptions(backoff=0.0, staging=False))
    assert srv.stats.body_bytes > 3 * stored and tar_gets(srv) >= 4 * 3


def test_staged_epoch_survives_dropped_connections(flaky_http_server, tmp_path, small_blocks):
    srv = flaky_http_server
    want = write(tmp_path / "d", 600, 200)
    stored = serve(srv, tmp_path / "d")
    srv.faults.drop_after = 150_000
    srv.faults.max_drops = 4
    # aiohttp discards what it buffered but was not read yet once it sees a cut: the bytes a
    # loaded machine's fetch thread had not taken within 20 ms would be sent again (4 drops lost
    # 450 kB, past the bound below); half a second lets the fetch take them, as it would any
    # network's bytes that arrived before the cut
    srv.faults.linger = 0.5
    io = IOOptions(backoff=0.0, staging_dir=str(tmp_path / "staging"))
    seen = epoch(srv.url, 4, io)
    assert sorted(seen) == sorted(want.items())
    assert srv.stats.drops == 4
    assert srv.stats.body_bytes <= 1.1 * stored + 200_000  # resumed at the offset reached


def _claim_and_die(root: str, url: str, have: bytes, ready) -> None:
    """A fetcher that claimed block 0, wrote its first bytes, and is killed."""
    obj = staged_blocks.StagedObject(StagingScope(root, 1, 2), url, FAST)
    fd = obj.claim(0)
    with open(obj.block_path(0), "wb") as f:
        f.write(have)
    ready.set()
    signal.pause()
    os.close(fd)


def test_a_dead_fetchers_claim_is_taken_over_at_its_offset(http_server, tmp_path):
    srv = http_server
    data = np.random.default_rng(0).integers(0, 256, 300_000, dtype=np.uint8).tobytes()
    url = srv.put("obj.bin", data)
    root = str(tmp_path / "area")
    os.makedirs(root)
    ctx = multiprocessing.get_context("fork")
    ready = ctx.Event()
    dead = ctx.Process(target=_claim_and_die, args=(root, url, data[:100_000], ready))
    dead.start()
    assert ready.wait(30)
    os.kill(dead.pid, signal.SIGKILL)
    dead.join(30)
    io = StagedOptions(backoff=0.0, staging_scope=StagingScope(root, 0, 2))
    srv.reset_stats()
    assert b"".join(staged.staged_chunks(url, 0, None, io)) == data
    assert srv.stats.gets == 1 and srv.stats.body_bytes == len(data) - 100_000  # continued where it was cut


def test_two_readers_share_one_fetch(http_server, tmp_path, small_blocks):
    """Two readers of the same range in one area: one GET, each byte sent once,
    both get the object's bytes; blocks read by both are removed."""
    srv = http_server
    data = np.random.default_rng(1).integers(0, 256, 500_000, dtype=np.uint8).tobytes()
    url = srv.put("obj.bin", data)
    root = str(tmp_path / "area")
    os.makedirs(root)
    a = staged.staged_chunks(url, 0, None, StagedOptions(backoff=0.0, staging_scope=StagingScope(root, 0, 2)))
    b = staged.staged_chunks(url, 1000, 400_000, StagedOptions(backoff=0.0, staging_scope=StagingScope(root, 1, 2)))
    got_a, got_b = [next(a)], [next(b)]
    got_a += list(a)
    got_b += list(b)
    assert b"".join(got_a) == data and b"".join(got_b) == data[1000:400_000]
    assert srv.stats.gets == 1 and srv.stats.body_bytes == len(data)
    block = staged_blocks.BLOCK
    left = sorted(n for n in os.listdir(root) if n.split(".")[-1].isdigit())
    # read past by both: blocks 1 .. 5 (block 0: b started inside it, still counts); the tail is a's only
    assert [int(n.split(".")[-1]) for n in left] == [j for j in range(-(-len(data) // block)) if (j + 1) * block > 400_000]


def test_changed_object_between_fetches_is_an_error(http_server, tmp_path):
    srv = http_server
    url = srv.put("obj.bin", b"x" * 1000)
    root = str(tmp_path / "area")
    os.makedirs(root)
    obj = staged_blocks.StagedObject(StagingScope(root, 0, 2), url, FAST)
    obj.record_meta(1000, {"size": "1000", "ETag": '"a"'})
    other = staged_blocks.StagedObject(StagingScope(root, 1, 2), url, FAST)
    with pytest.raises(shardflow.storage.ShardChangedError, match="changed during the epoch"):
        other.record_meta(1000, {"size": "1000", "ETag": '"b"'})


def test_areas_left_by_dead_jobs_are_removed(tmp_path):
    left = tmp_path / (staging.PREFIX + "dead")
    left.mkdir()
    (left / ".users").write_bytes(b"")
    (left / "x.0").write_bytes(b"1" * 10)
    io = staging.staging_for(IOOptions(staging_dir=str(tmp_path)), REMOTE, ("k",), 0, 2)
    items = staging.staged_epoch(iter([1, 2]), io)
    assert next(items) == 1
    assert sorted(os.listdir(tmp_path)) == [os.path.basename(io.staging_scope.root)]
    assert list(items) == [2]
    assert os.path.isdir(io.staging_scope.root)  # worker 1 has not finished: the area stays
    other = staging.staged_epoch(iter([3]), staging.staging_for(IOOptions(staging_dir=str(tmp_path)), REMOTE, ("k",), 1, 2))
    assert list(other) == [3]
    assert os.listdir(tmp_path) == []


def test_staging_is_off_where_nothing_is_shared():
    io = IOOptions()
    assert staging.staging_for(io, ["/data/a.tar", "file:///data/b.tar"], ("k",), 0, 4) is io
    assert staging.scope_of(staging.staging_for(io, REMOTE, ("k",), 0, 1)) is not None  # a re-read is local
    assert staging.scope_of(staging.staging_for(IOOptions(staging=False), REMOTE, ("k",), 0, 4)) is None
    assert staging.scope_of(staging.staging_for(IOOptions(cache_dir="/tmp/c"), REMOTE, ("k",), 0, 4)) is None
    with pytest.raises(TypeError):
        IOOptions(staging="yes")


def test_no_staging_where_the_folder_cannot_be_made(tmp_path, caplog):
    blocked = tmp_path / "file"
    blocked.write_bytes(b"")  # a file: no folder can be made under it
    io = IOOptions(staging_dir=str(blocked))
    assert staging.staging_for(io, REMOTE, ("k",), 0, 2) is io
    assert "no staging area" in caplog.text


def test_over_the_limit_the_most_read_unheld_blocks_go_first(tmp_path, small_blocks):
    root = str(tmp_path / "area")
    os.makedirs(root)
    block = staged_blocks.BLOCK
    io = StagedOptions(staging_limit=4 * block, staging_scope=StagingScope(root, 0, 2))
    obj = staged_blocks.StagedObject(io.staging_scope, "http://h/x.tar", io)
    obj.record_meta(5 * block, {"size": str(5 * block), "ETag": '"e"'})
    for j in range(4):
        with open(obj.block_path(j), "wb") as f:
            f.write(b"\0" * block)
    with open(obj.block_path(4), "wb") as f:
        f.write(b"\0" * (block // 2))  # being written: never removed
    obj.passed(1)  # read by one of the 2 workers: the first to go
    held = os.open(obj.block_path(2), os.O_RDONLY)  # a reader's shared lock: kept
    import fcntl

    fcntl.flock(held, fcntl.LOCK_SH)
    try:
        obj.make_room()  # 4.5 blocks + the next one > 4 blocks: 2 must go
    finally:
        os.close(held)
    present = sorted(int(n.split(".")[-1]) for n in os.listdir(root) if n.split(".")[-1].isdigit())
    assert present == [2, 3, 4] or present == [0, 2, 4]
    assert 1 not in present and 2 in present and 4 in present


def _later_part_staged(srv, tmp_path, seed):
    """A 500,000-byte object on ``srv`` whose bytes 200,000-450,000 worker 1 of 2 has read
    through a new staging area: returns ``(url, data, area root)``."""
    data = np.random.default_rng(seed).integers(0, 256, 500_000, dtype=np.uint8).tobytes()
    url = srv.put("obj.bin", data)
    root = str(tmp_path / "area")
    os.makedirs(root)
    later = staged.staged_chunks(url, 200_000, 450_000, StagedOptions(backoff=0.0, staging_scope=StagingScope(root, 1, 2)))
    assert b"".join(later) == data[200_000:450_000]
    return url, data, root


def test_a_part_starting_inside_a_block_is_fetched_from_its_first_byte(http_server, tmp_path, small_blocks):
    """A rank's part of a shard starts where it starts, not at a block bound; a reader
    that needs the bytes before it in that block fetches those alone."""
    srv = http_server
    url, data, root = _later_part_staged(srv, tmp_path, seed=2)
    assert srv.stats.body_bytes == 250_000  # its part only
    whole = staged.staged_chunks(url, 0, None, StagedOptions(backoff=0.0, staging_scope=StagingScope(root, 0, 2)))
    assert b"".join(whole) == data
    assert srv.stats.body_bytes == len(data)  # each byte once: before, inside and after the staged part
    # the part; the blocks before it; the bytes of its first block before it; the bytes after it
    assert srv.stats.gets == 4


def test_a_fetch_that_starts_before_its_reader_read_the_meta_file_stops_at_the_next_staged_block(
        http_server, tmp_path, small_blocks):
    """A fetch's thread may run before its reader has read the object's meta file (which another
    fetch wrote): its request still ends where the next staged block begins. It asked for the
    rest of the object before, and the store sent bytes no block of this fetch takes."""
    srv = http_server
    url, data, root = _later_part_staged(srv, tmp_path, seed=3)  # blocks 3 .. 6 staged, the meta file written
    srv.reset_stats()
    obj = staged_blocks.StagedObject(StagingScope(root, 0, 2), url, FAST)  # its meta not read yet
    fetch = staged.Fetch(obj, 0, obj.claim(0), None)
    fetch.start()
    fetch.join(60)
    assert not fetch.is_alive() and fetch.error is None
    block = staged_blocks.BLOCK
    assert srv.stats.gets == 1 and srv.stats.body_bytes == 3 * block  # blocks 0 .. 2, up to block 3's
    assert b"".join(Path(obj.block_path(j)).read_bytes() for j in range(3)) == data[:3 * block]


def test_epoch_two_through_the_cache_asks_the_store_nothing(http_server, tmp_path):
    """Workers that each read part of every shard fill the cache once per shard, checked
    against the manifest's digests, and find the copies by them in the next epoch."""
    srv = http_server
    want = write(tmp_path / "d", 600, 200)
    serve(srv, tmp_path / "d")
    io = IOOptions(backoff=0.0, cache_dir=str(tmp_path / "cache"))
    ds = shardflow.ShardDataset(srv.url, decode=None, shuffle=True, seed=5, io=io)
    loader = shardflow.loader(ds, batch_size=8, num_workers=2, collate_fn=list)
    srv.reset_stats()
    first = [(s["__key__"], s["bin"]) for batch in loader for s in batch]
    assert sorted(first) == sorted(want.items())
    assert tar_gets(srv) == 3, srv.stats.gets_by_path
    srv.reset_stats()
    second = [(s["__key__"], s["bin"]) for batch in loader for s in batch]
    assert sorted(second) == sorted(want.items())
    assert srv.stats.requests == 0, srv.stats
