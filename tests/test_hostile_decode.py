"""Hostile field bytes (issue 25, cases b and e): compressed fields bounded by ``Limits`` like tar
members, damaged ones a skippable ``DecodeError``, and integer fields with a bounded number of digits.

Memory cases run in a fresh interpreter (``peak_rss`` of tests/test_hostile.py) and state their bound.
"""

from __future__ import annotations

import gzip
import json
import lzma
import zlib
from pathlib import Path

import numpy as np
import pytest

from shardflow import DecodeOptions, IndexedShardDataset, IOOptions, ShardDataset
from shardflow.codecs import decode_field, encode_field
from shardflow.errors import DecodeError
from shardflow.format.limits import Limits
from shardflow.format.tar import END_OF_ARCHIVE, encode_sample
from shardflow.writing.indexing import index_shards

from .test_hostile import MiB, peak_rss

pytestmark = pytest.mark.timeout(120)


def _gzip_zeros(n: int) -> bytes:
    c = zlib.compressobj(9, zlib.DEFLATED, zlib.MAX_WBITS | 16)
    zeros = b"\0" * (4 * MiB)
    return b"".join(c.compress(zeros[: min(len(zeros), n - i)]) for i in range(0, n, len(zeros))) + c.flush()


@pytest.fixture(scope="module")
def field_bombs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One-sample-bomb shards: the bomb in sample 1, plain samples 0 and 2 around it."""
    import zstandard

    root = tmp_path_factory.mktemp("field-bombs")
    fields = {
        "txt.gz.gz": gzip.compress(_gzip_zeros(256 * MiB), 9, mtime=0),  # 2 KB holding 256 MiB
        "txt.zst": zstandard.ZstdCompressor(level=3).compress(b"\0" * (256 * MiB)),
        "txt.xz": lzma.compress(b"\0" * (64 * MiB)),
    }
    out = {}
    for name, data in fields.items():
        path = root / f"{name.replace('.', '-')}.tar"
        path.write_bytes(
            encode_sample("000000", {"txt": b"before"})
            + encode_sample("000001", {name: data})
            + encode_sample("000002", {"txt": b"after"})
            + END_OF_ARCHIVE
        )
        out[name] = path
    return out


@pytest.mark.parametrize("name", ["txt.gz.gz", "txt.zst", "txt.xz"])
def test_a_compressed_field_bomb_is_refused_within_the_limits(field_bombs: dict[str, Path], name: str) -> None:
    path = field_bombs[name]
    assert path.stat().st_size < 20_000  # 2-10 KB of field
    got = peak_rss(f"""
        ds = shardflow.ShardDataset({str(path)!r}, fields=None)
        result["keys"] = [s["__key__"] for s in ds]
    """)
    assert "DecodeError" in got["error"] and f"sample '000001': cannot decode field {name!r}" in got["error"], got
    assert "Limits.max_compression_ratio=1000" in got["error"]
    assert got["peak"] < 64 * MiB, got["peak"] / MiB  # bound: the cap (1 KiB..stored x 1000 = ~10 MB) + 4 MiB pieces
    got = peak_rss(f"""
        ds = shardflow.ShardDataset({str(path)!r}, on_error="skip")
        result["samples"] = [(s["__key__"], s["txt"]) for s in ds]
        result["stats"] = dict(ds.stats)
    """)
    assert got["samples"] == [["000000", "before"], ["000002", "after"]], got
    assert got["stats"]["field_too_large"] == 1 and got["stats"]["skipped"] == 1
    assert got["peak"] < 64 * MiB, got["peak"] / MiB


def test_the_field_cap_is_the_io_limits(tmp_path: Path) -> None:
    big = b"x" * (3 * MiB)
    data = gzip.compress(big, 9, mtime=0)  # ~3 KB: ratio ~1000
    path = tmp_path / "a.tar"
    path.write_bytes(encode_sample("000000", {"bin.gz": data}) + END_OF_ARCHIVE)
    ratio = len(big) // len(data)
    assert ratio > 1000
    with pytest.raises(DecodeError, match="decompress to more than"):
        list(ShardDataset(path))
    io = IOOptions(limits=Limits(max_compression_ratio=ratio + 1))
    assert [s["bin.gz"] for s in ShardDataset(path, io=io)] == [big]
    index_shards([str(path)])
    assert IndexedShardDataset(str(path.parent), io=io)[0]["bin.gz"] == big
    with pytest.raises(DecodeError, match="decompress to more than"):
        IndexedShardDataset(str(path.parent))[0]
    low = IOOptions(limits=Limits(max_member_bytes=MiB))  # the size limit applies as well
    with pytest.raises(DecodeError, match=r"over min\(Limits.max_member_bytes=1048576"):
        list(ShardDataset(path, io=low))


@pytest.mark.parametrize("ext", ["gz", "zst", "xz"])
def test_compressed_fields_round_trip_like_the_stdlib(tmp_path: Path, ext: str) -> None:
    import zstandard

    arr = np.arange(1000, dtype=np.int32).reshape(10, 100)
    sample = {"npy": arr, "json": {"a": [1, 2]}, "txt": "héllo " * 50}
    fields = {f"{k}.{ext}": encode_field("k", f"{k}.{ext}", v) for k, v in sample.items()}
    inflate = {"gz": gzip.decompress, "xz": lzma.decompress,
               "zst": lambda b: zstandard.ZstdDecompressor().decompress(b)}[ext]
    assert json.loads(inflate(fields[f"json.{ext}"])) == {"a": [1, 2]}
    path = tmp_path / "a.tar"
    path.write_bytes(encode_sample("000000", fields) + END_OF_ARCHIVE)
    (got,) = list(ShardDataset(path))
    np.testing.assert_array_equal(got[f"npy.{ext}"], arr)
    assert got[f"json.{ext}"] == {"a": [1, 2]} and got[f"txt.{ext}"] == sample["txt"]
    assert [s[f"txt.{ext}"] for s in ShardDataset(path, decode=None)] == [fields[f"txt.{ext}"]]  # bytes kept


@pytest.mark.parametrize(
    "name, data",
    [
        ("txt.gz", gzip.compress(b"hello world" * 100, mtime=0)[:-30]),  # cut
        ("txt.gz", gzip.compress(b"hello world" * 100, mtime=0)[:12] + b"\xff" * 40),  # damaged
        ("txt.gz", b"not gzip at all"),
        ("txt.xz", lzma.compress(b"hello world" * 100)[:-20]),
        ("txt.xz", b"\xfd7zXZ\x00" + b"\x01" * 40),
        ("txt.zst", b"\x28\xb5\x2f\xfd" + b"\x01" * 40),
    ],
    ids=["gz-cut", "gz-damaged", "gz-not-gzip", "xz-cut", "xz-damaged", "zst-damaged"],
)
def test_a_damaged_compressed_field_is_a_skippable_decode_error(tmp_path: Path, name: str, data: bytes) -> None:
    with pytest.raises(DecodeError, match=f"field {name!r}: bad {name.rsplit('.', 1)[1]} data"):
        decode_field(name, data, DecodeOptions())
    path = tmp_path / "a.tar"
    path.write_bytes(encode_sample("000000", {"txt": b"a"}) + encode_sample("000001", {name: data})
                     + encode_sample("000002", {"txt": b"c"}) + END_OF_ARCHIVE)
    ds = ShardDataset(path, on_error="skip")
    assert [s["__key__"] for s in ds] == ["000000", "000002"]
    assert ds.stats["decode"] == 1


# ------------------------------------------------------------------ integer fields (case e)


def test_a_cls_of_4000_digits_is_a_decode_error_at_decode(tmp_path: Path) -> None:
    path = tmp_path / "a.tar"
    path.write_bytes(encode_sample("000000", {"cls": b"7"}) + encode_sample("000001", {"cls": b"9" * 4000})
                     + encode_sample("000002", {"cls": b"-12"}) + END_OF_ARCHIVE)
    with pytest.raises(DecodeError, match=r"sample '000001': cannot decode field 'cls': 4000 digits, more than 19"):
        list(ShardDataset(path))
    ds = ShardDataset(path, on_error="skip")
    assert [(s["__key__"], s["cls"]) for s in ds] == [("000000", 7), ("000002", -12)]
    assert ds.stats["decode"] == 1
    # what fits an int64 (the collate's tensor) decodes; one past it does not
    assert decode_field("cls", str(2**63 - 1).encode(), DecodeOptions()) == 2**63 - 1
    assert decode_field("cls", str(-(2**63)).encode(), DecodeOptions()) == -(2**63)
    for bad in (str(2**63).encode(), b"1_000", b"", b"0x10", b"\xff"):
        with pytest.raises(DecodeError, match="field 'cls'"):
            decode_field("cls", bad, DecodeOptions())
