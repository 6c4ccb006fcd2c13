"""Keys (issue 25, case l): per-shard memory bounded by the real data, whatever the keys' length,
and a key-length limit that the writer enforces (so it never writes what its reader refuses).
"""

from __future__ import annotations

import zlib
from pathlib import Path

import pytest

import shardflow
from shardflow import ShardWriter
from shardflow.errors import SampleError
from shardflow.format.keys import MAX_KEY_BYTES
from shardflow.format.tar import END_OF_ARCHIVE, encode_sample

from .test_hostile import MiB, peak_rss

pytestmark = pytest.mark.timeout(120)


def test_the_writer_refuses_a_key_over_the_limit(tmp_path: Path) -> None:
    assert MAX_KEY_BYTES == 65536
    with ShardWriter(str(tmp_path / "a" / "train-%06d.tar"), max_count=10) as w:
        with pytest.raises(SampleError, match=r"is 2097152 bytes long, over the limit of 65536"):
            w.write({"__key__": "k" * (2 << 20), "txt": "x"})
        w.write({"__key__": "é" * (MAX_KEY_BYTES // 2), "txt": "fits"})  # 65536 UTF-8 bytes
    (got,) = list(shardflow.ShardDataset(str(tmp_path / "a")))
    assert got["__key__"] == "é" * (MAX_KEY_BYTES // 2) and got["txt"] == "fits"
    with pytest.raises(SampleError, match="over the limit of 65536"):
        shardflow.write_shards(lambda i: {"__key__": "k" * (MAX_KEY_BYTES + 1), "txt": "x"}, range(1),
                               str(tmp_path / "b"), workers=1)


@pytest.fixture(scope="module")
def long_keys(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A .tar.gz of 3,000 samples whose keys are 60 KB each, all distinct: 180 MB of names."""
    path = tmp_path_factory.mktemp("keys") / "long.tar.gz"
    c = zlib.compressobj(9, zlib.DEFLATED, zlib.MAX_WBITS | 16)
    stem = "k" * 60_000
    with open(path, "wb") as f:
        for i in range(3000):
            f.write(c.compress(encode_sample(f"{stem}{i:06d}", {"txt": b"x"})))
        f.write(c.compress(END_OF_ARCHIVE) + c.flush())
    return path


def test_long_distinct_keys_do_not_accumulate(long_keys: Path) -> None:
    assert long_keys.stat().st_size < 4 * MiB
    got = peak_rss(f"""
        ds = shardflow.ShardDataset({str(long_keys)!r}, decode=None)
        n = 0
        for s in ds:
            n += 1
        result["n"] = n
    """)
    assert got == {"n": 3000, "peak": got["peak"]}, got
    assert got["peak"] < 64 * MiB, got["peak"] / MiB  # bound: 64 MiB (keys kept: 180 MB of names and more)


def test_a_key_reappearing_is_still_caught_with_long_keys(tmp_path: Path) -> None:
    long = "k" * 1000
    data = (encode_sample(long + "1", {"txt": b"a"}) + encode_sample(long + "2", {"txt": b"b"})
            + encode_sample(long + "1", {"cls": b"1"}) + END_OF_ARCHIVE)
    (tmp_path / "a.tar").write_bytes(data)
    with pytest.raises(SampleError, match="reappears"):
        list(shardflow.ShardDataset(str(tmp_path / "a.tar"), decode=None))


def test_a_key_set_answers_as_a_set_of_its_keys() -> None:
    """Short and long keys, added one by one and in bulk, asked one by one and in bulk."""
    from shardflow.format.keys import KeySet

    short, long = [f"s{i}" for i in range(5)], [f"{i}" + "k" * 100 for i in range(5)]
    for added in (short[:3], long[:3], short[:2] + long[:2]):
        ks, ref = KeySet(), set(added)
        ks.update(added[:1])
        for k in added[1:]:
            ks.add(k)
        assert len(ks) == len(ref)
        for probe in (short, long, short + long, short[3:], long[3:], [], [long[0][:64]]):
            assert ks.isdisjoint(probe) == ref.isdisjoint(probe), (added, probe)
            assert [k in ks for k in probe] == [k in ref for k in probe]
        bulk = KeySet()
        bulk.update(iter(added))
        assert all(k in bulk for k in added) and len(bulk) == len(ref)
