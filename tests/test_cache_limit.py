"""The shard cache keeps to its limit when every read is a hit: it shrinks when a
process opens it with a lowered limit, and after a hit that finds it over the limit."""

from __future__ import annotations

import os
import uuid

import fsspec

from shardflow.storage import IOOptions, open_chunks
from shardflow.storage.sharing.cache import ShardCache

SHARD = 340_000  # ten of them: 3.4 MB


def _store(n: int) -> tuple[dict[str, str], dict[str, bytes]]:
    root = f"cachelimit-{uuid.uuid4().hex[:8]}"
    fs = fsspec.filesystem("memory")
    blobs = {f"s{i}": os.urandom(SHARD) for i in range(n)}
    for name, blob in blobs.items():
        fs.pipe(f"/{root}/{name}.tar", blob)
    return {name: f"memory://{root}/{name}.tar" for name in blobs}, blobs


def _data(cache_dir) -> list[str]:
    return sorted(n.split("-", 1)[1] for n in os.listdir(cache_dir) if not n.startswith("."))


def _size(cache_dir) -> int:
    return sum(os.path.getsize(os.path.join(cache_dir, n)) for n in os.listdir(cache_dir) if not n.startswith("."))


def _read(url: str, opts: IOOptions) -> bytes:
    return b"".join(open_chunks(url, options=opts))


def test_cache_filled_to_3_4_mb_shrinks_to_a_lowered_1_2_mb_limit_on_open(tmp_path):
    urls, blobs = _store(10)
    cache_dir = str(tmp_path / "cache")
    big = IOOptions(cache_dir=cache_dir, cache_limit=10_000_000, readahead=0)
    for name in sorted(urls):
        assert _read(urls[name], big) == blobs[name]
    assert _size(cache_dir) == 3_400_000
    small = IOOptions(cache_dir=cache_dir, cache_limit=1_200_000, readahead=0)
    assert _read(urls["s9"], small) == blobs["s9"]  # a hit: no download, yet the cache shrinks
    assert _size(cache_dir) == 1_020_000  # three shards fit in 1.2 MB
    assert _data(cache_dir) == ["s7.tar", "s8.tar", "s9.tar"]  # the most recently used kept
    for name in ("s7", "s8", "s9", "s9"):  # hits only from here on: nothing is downloaded
        assert _read(urls[name], small) == blobs[name]
    assert _size(cache_dir) <= 1_200_000


def test_a_hit_that_finds_the_cache_over_its_limit_shrinks_it(tmp_path):
    urls, blobs = _store(10)
    cache_dir = str(tmp_path / "cache")
    small = IOOptions(cache_dir=cache_dir, cache_limit=1_200_000, readahead=0)
    assert _read(urls["s0"], small) == blobs["s0"]
    # another process (here: another limit) fills the cache past this one's limit
    big = IOOptions(cache_dir=cache_dir, cache_limit=10_000_000, readahead=0)
    for name in sorted(urls)[1:]:
        assert _read(urls[name], big) == blobs[name]
    assert _size(cache_dir) == 3_400_000
    assert ShardCache(cache_dir, 1_200_000).usage() == 3_400_000  # opened before: no shrink on open
    assert _read(urls["s0"], small) == blobs["s0"]  # a hit, over the limit: shrinks
    assert _data(cache_dir) == ["s0.tar", "s8.tar", "s9.tar"]  # s0 was just used
    assert _size(cache_dir) == 1_020_000


def test_shards_in_use_are_kept_and_go_at_a_later_hit(tmp_path):
    urls, blobs = _store(4)
    cache_dir = str(tmp_path / "cache")
    big = IOOptions(cache_dir=cache_dir, cache_limit=10_000_000, readahead=0, block_size=1 << 16)
    for name in sorted(urls):
        assert _read(urls[name], big) == blobs[name]
    held = [open_chunks(urls[name], options=big) for name in ("s0", "s1")]  # the oldest two, in use
    assert [next(h) for h in held] == [blobs["s0"][: 1 << 16], blobs["s1"][: 1 << 16]]
    small = IOOptions(cache_dir=cache_dir, cache_limit=500_000, readahead=0)
    assert _read(urls["s3"], small) == blobs["s3"]  # the open shrinks: all but the two in use go
    assert _data(cache_dir) == ["s0.tar", "s1.tar"]  # and s3 streamed uncached (no room beside them)
    for h, name in zip(held, ("s0", "s1")):
        assert b"".join(h) == blobs[name][1 << 16 :]
        h.close()
    assert _read(urls["s1"], small) == blobs["s1"]  # a hit, 680 kB > 500 kB: the free s0 goes
    assert _data(cache_dir) == ["s1.tar"]
