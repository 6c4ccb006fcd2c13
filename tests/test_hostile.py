"""Hostile and broken shards: never a hang, memory bounded by what is real, every loss named or counted.

Each case is a shard built byte by byte the way an attacker (or an unlucky disk) would, read by every
reader. A case asserts the error named, or the exact samples and counts under ``on_error="skip"``;
memory cases measure the peak RSS of a fresh subprocess (``ru_maxrss`` after imports subtracted) and
state their bound next to the assertion.
"""

from __future__ import annotations

import contextlib
import json
import re
import os
import subprocess
import sys
import textwrap
import zlib
from pathlib import Path

import pytest

from shardflow import DecodeOptions, IndexedShardDataset, IOOptions, ShardDataset
from shardflow.errors import DecodeError, ManifestError, RemoteReadError, SampleError, ShardflowError, ShardFormatError
from shardflow.format.limits import Limits
from shardflow.planning.plan import ShuffleConfig
from shardflow.format.tar import END_OF_ARCHIVE, encode_member, encode_sample, iter_samples
from shardflow.writing.indexing import index_shards
from shardflow.inspect import verify

from .helpers import make_shards, sample_key

MiB = 1 << 20
GiB = 1 << 30
pytestmark = pytest.mark.timeout(60)


# ------------------------------------------------------------------ building hostile bytes


def header(name: bytes, size_field: bytes, typeflag: bytes = b"0") -> bytes:
    """A ustar header with any size field and type flag, and a correct checksum."""
    h = bytearray(512)
    h[: len(name)] = name
    h[100:108] = b"0000644\0"
    h[108:116] = b"0000000\0"
    h[116:124] = b"0000000\0"
    h[124:136] = size_field
    h[136:148] = b"00000000000\0"
    h[148:156] = b"        "
    h[156:157] = typeflag
    h[257:263] = b"ustar\0"
    h[263:265] = b"00"
    h[148:156] = b"%06o\0 " % sum(h)
    return bytes(h)


def base256(value: int) -> bytes:
    """A 12-byte GNU base-256 size field (two's complement for negative values)."""
    return bytes([0xFF if value < 0 else 0x80]) + (value % (1 << 88)).to_bytes(11, "big")


def samples(keys: range) -> bytes:
    return b"".join(encode_sample(sample_key(i), {"txt": f"sample {i}".encode(), "cls": str(i).encode()}) for i in keys)


def six_with(bad: bytes) -> bytes:
    """Samples 0-2, then ``bad`` (header and data of sample 3), then samples 4-5."""
    return samples(range(3)) + bad + samples(range(4, 6)) + END_OF_ARCHIVE


NEGATIVE = header(b"000003.txt", base256(-512)) + b"x" * 512  # the 3.5 KB shard that used to hang every reader


def write(tmp_path: Path, name: str, data: bytes) -> str:
    path = tmp_path / name
    path.write_bytes(data)
    return str(path)


def keys(ds) -> list[str]:
    return [s["__key__"] for s in ds]


# ------------------------------------------------------------------ size fields


@pytest.mark.parametrize(
    "field, said",
    [
        (base256(-512), "negative base-256 size field (-512)"),
        (base256(-1), "negative base-256 size field (-1)"),
        (b"-0000001000\0", "non-octal size field"),
        (b"0000008000\0\0", "non-octal size field"),
        (b"00_00001000\0", "non-octal size field"),
        (b"+0000001000\0", "non-octal size field"),
    ],
)
def test_bad_size_field_is_named(tmp_path: Path, field: bytes, said: str) -> None:
    url = write(tmp_path, "bad.tar", six_with(header(b"000003.txt", field) + b"x" * 512))
    with pytest.raises(ShardFormatError, match=r"bad\.tar: header at byte 6144 has a " + re.escape(said)):
        list(iter_samples([Path(url).read_bytes()], url))


@pytest.mark.parametrize(
    "field, declared",
    [(b"77777777777\0", 8 * GiB - 1), (base256(1 << 80), 1 << 80), (base256(GiB + 1), GiB + 1)],
)
def test_huge_size_names_the_limit_and_skip_keeps_the_samples_before(tmp_path: Path, field: bytes, declared: int) -> None:
    # a small file whose member header declares more than the limit: raise names the limit at once
    url = write(tmp_path, "huge.tar", samples(range(3)) + header(b"000003.txt", field) + b"x" * 512)
    with pytest.raises(SampleError, match=rf"member '000003.txt' at byte 6144 declares {declared} bytes, over the "
                       rf"limit of {GiB} bytes \(Limits.max_member_bytes"):
        keys(ShardDataset(url, decode=None))
    # skip: the member's bytes are skipped unread, the file then ends inside them: that is counted too
    ds = ShardDataset(url, decode=None, on_error="skip")
    assert keys(ds) == ["000000", "000001", "000002"]
    assert ds.stats["samples"] == 3
    assert ds.stats["truncated_shard"] == 1


def test_member_over_a_lowered_limit_is_skipped_exactly(tmp_path: Path) -> None:
    big = encode_sample("000003", {"bin": b"\1" * 5000})
    data = six_with(big)
    url = write(tmp_path, "six.tar", data)
    got = list(iter_samples([data], url, limits=Limits(max_member_bytes=4096), sample_errors="yield"))
    assert [(k, type(f).__name__) for k, _, f in got] == [
        ("000000", "dict"), ("000001", "dict"), ("000002", "dict"), ("000003", "SampleError"),
        ("000004", "dict"), ("000005", "dict")]
    assert got[3][2].reason == "member_too_large"
    assert "5000 bytes, over the limit of 4096 bytes (Limits.max_member_bytes" in str(got[3][2])
    assert got[4][2] == {"cls": b"4", "txt": b"sample 4"}


def test_limits_are_validated() -> None:
    with pytest.raises(ValueError, match="max_member_bytes must be >= 1"):
        Limits(max_member_bytes=0)
    with pytest.raises(TypeError, match="min_sample_bytes must be an int"):
        Limits(min_sample_bytes=1.5)
    with pytest.raises(ValueError, match="max_graph_nodes must be a positive int"):
        DecodeOptions(max_graph_nodes=0)


# ------------------------------------------------------------------ every reader on the negative size


@pytest.fixture
def negative_dataset(tmp_path: Path) -> Path:
    """A 6-sample shard with manifest and index, whose sample 3 header has a negative base-256 size."""
    folder = make_shards(tmp_path, [6])
    shard = folder / "train-000000.tar"
    data = bytearray(shard.read_bytes())
    offsets = [off for _, off, _ in _members(bytes(data))]
    at = offsets[3]  # sample 3's only member
    name = bytes(data[at : at + 100]).split(b"\0")[0]
    data[at : at + 512] = header(name, base256(-512))
    shard.write_bytes(bytes(data))
    return folder


def _members(data: bytes):
    from shardflow.format.tar import iter_members

    return list(iter_members([data], "x.tar"))


@pytest.mark.timeout(20)
def test_negative_size_raises_in_every_reader(negative_dataset: Path) -> None:
    url = str(negative_dataset / "train-000000.tar")
    with pytest.raises(ShardFormatError, match="negative base-256 size field"):
        keys(ShardDataset(negative_dataset, decode=None))
    with pytest.raises(ShardFormatError, match="negative base-256 size field"):
        keys(ShardDataset(url, decode=None))
    with pytest.raises(ShardflowError, match="negative base-256 size field"):
        IndexedShardDataset(negative_dataset, decode=None)[3]
    assert IndexedShardDataset(negative_dataset, decode=None)[4]["__key__"] == "000004"
    with pytest.raises(ShardFormatError, match="negative base-256 size field"):
        index_shards([url], out=str(negative_dataset.parent / "reindexed"))
    report = verify(negative_dataset, workers=1)
    assert any(p.reason == "bad_shard" and "negative base-256 size field" in p.message for p in report), report


@pytest.mark.timeout(20)
def test_negative_size_under_skip_terminates_and_counts(tmp_path: Path) -> None:
    url = write(tmp_path, "neg.tar", six_with(NEGATIVE))
    ds = ShardDataset(url, decode=None, on_error="skip")
    assert keys(ds) == ["000000", "000001", "000002"]  # the damaged header is sound enough to name 000003
    assert dict(ds.stats) == {"samples": 3, "bad_shard": 1, "lost_samples": 1, "skipped": 1}


# ------------------------------------------------------------------ member types


def sparse_gnu() -> bytes:
    """A GNU old-style sparse member ('S'): real data 512 bytes, declared as a map."""
    return header(b"000001.bin", b"%011o\0" % 512, b"S") + b"s" * 512


def pax_record(key: str, value: str) -> bytes:
    body = f" {key}={value}\n".encode()
    n = len(body) + 1
    while len(str(n)) + len(body) != n:
        n = len(str(n)) + len(body)
    return str(n).encode() + body


def sparse_pax() -> bytes:
    """A PAX 1.0 sparse member (as GNU tar --sparse --format=pax writes): the records, then the member."""
    records = b"".join(pax_record(k, v) for k, v in [("GNU.sparse.major", "1"), ("GNU.sparse.minor", "0"),
                                                       ("GNU.sparse.name", "000001.bin"), ("GNU.sparse.realsize", "1048576")])
    return (header(b"././@PaxHeader", b"%011o\0" % len(records), b"x") + records.ljust(512, b"\0")
            + header(b"GNUSparseFile.0/000001.bin", b"%011o\0" % 3) + b"abc".ljust(512, b"\0"))


@pytest.mark.parametrize(
    "member, said",
    [
        (sparse_gnu(), r"member '000001.bin' at byte 2048 has tar type b'S' \(GNU sparse\)"),
        (sparse_pax(), r"member 'GNUSparseFile.0/000001.bin' at byte 3072 is a PAX sparse file \(GNU.sparse.major\)"),
        (header(b"000001.vol", b"%011o\0" % 0, b"V"), r"member '000001.vol' at byte 2048 has tar type b'V'"),
        (header(b"000001.bin", b"%011o\0" % 10, b"Q") + b"q" * 512, r"has tar type b'Q' \(unknown\)"),
    ],
)
def test_member_types_not_understood_are_named_and_skipped_exactly(tmp_path: Path, member: bytes, said: str) -> None:
    data = samples(range(1)) + member + samples(range(2, 4)) + END_OF_ARCHIVE
    url = write(tmp_path, "types.tar", data)
    with pytest.raises(SampleError, match=said):
        keys(ShardDataset(url, decode=None))
    ds = ShardDataset(url, decode=None, on_error="skip")
    assert keys(ds) == ["000000", "000002", "000003"]
    assert ds.stats["unsupported_member"] == 1
    assert ds.stats["skipped"] == 1


def test_pax_record_lengths_are_validated(tmp_path: Path) -> None:
    for record in (b"-5 path=x\n", b"99 path=x\n", b"5_0 path=x\n", b"3 path=x\n"):
        bad = header(b"././@PaxHeader", b"%011o\0" % len(record), b"x") + record.ljust(512, b"\0")
        data = bad + header(b"000001.txt", b"%011o\0" % 1) + b"a".ljust(512, b"\0") + END_OF_ARCHIVE
        with pytest.raises(ShardFormatError, match="malformed PAX"):
            list(iter_samples([data], "pax.tar"))


def test_extended_header_over_its_limit(tmp_path: Path) -> None:
    data = header(b"././@LongLink", b"%011o\0" % (2 * MiB), b"L") + b"n" * 512
    with pytest.raises(ShardFormatError, match=r"declares 2097152 bytes, over the limit of 1048576 \(Limits.max_header_bytes\)"):
        list(iter_samples([data], "long.tar"))


# ------------------------------------------------------------------ memory (subprocess, peak RSS)


def _compress(path: Path, kind: str, member: int, tail: bytes) -> None:
    """Write a one-member tar of ``member`` zero bytes (+ ``tail`` tar bytes), compressed, streaming."""
    hdr = header(b"000000.bin", b"%011o\0" % member if member < 8**11 else base256(member))
    zeros = b"\0" * (4 * MiB)
    with open(path, "wb") as f:
        if kind == "zst":
            import zstandard

            w = zstandard.ZstdCompressor(level=1).stream_writer(f, closefd=False)
            write_, finish = w.write, w.close
        else:
            c = zlib.compressobj(9 if member > GiB else 1, zlib.DEFLATED, zlib.MAX_WBITS | 16)
            write_, finish = (lambda b: f.write(c.compress(b))), (lambda: f.write(c.flush()))
        write_(hdr)
        left = member + (-member % 512)
        while left:
            n = min(left, len(zeros))
            write_(zeros[:n])
            left -= n
        write_(tail)
        finish()


@pytest.fixture(scope="module")
def bombs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bombs")
    tail = encode_sample("000001", {"txt": b"after the bomb"}) + END_OF_ARCHIVE
    out = {}
    for kind in ("zst", "gz"):
        out[kind] = root / f"bomb.tar.{kind}"
        _compress(out[kind], kind, GiB + 1, tail)  # declares (and holds) one byte over the default limit
    for kind in ("zst", "gz"):
        out["big-" + kind] = root / f"big.tar.{kind}"
        _compress(out["big-" + kind], kind, 256 * MiB, tail)  # under the limit: read, once
    return out


def peak_rss(code: str) -> dict:
    """Run ``code`` in a fresh interpreter; return its JSON result plus the peak RSS growth in bytes."""
    script = textwrap.dedent(
        """
        import json, resource, sys
        import shardflow, shardflow.dataset, shardflow.format.tar, numpy, torch
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        result = {}
        try:
        %s
        except Exception as e:
            result["error"] = f"{type(e).__name__}: {e}"
        result["peak"] = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) * 1024
        print(json.dumps(result))
        """
    ) % textwrap.indent(textwrap.dedent(code), "    ")
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("kind", ["zst", "gz"])
def test_decompression_bomb_raise_is_fast_and_small(bombs: dict[str, Path], kind: str) -> None:
    assert bombs[kind].stat().st_size < (64 << 10 if kind == "zst" else 2 * MiB)  # a 32 KB .tar.zst, a ~1 MB .tar.gz
    got = peak_rss(f"""
        ds = shardflow.ShardDataset({str(bombs[kind])!r}, decode=None)
        result["keys"] = [s["__key__"] for s in ds]
    """)
    assert "over the limit of 1073741824 bytes (Limits.max_member_bytes" in got["error"]
    assert got["peak"] < 64 * MiB  # bound: 64 MiB (it was 2.6 GB)


@pytest.mark.parametrize("kind", ["zst", "gz"])
def test_decompression_bomb_skip_streams_past_it(bombs: dict[str, Path], kind: str) -> None:
    got = peak_rss(f"""
        ds = shardflow.ShardDataset({str(bombs[kind])!r}, decode=None, on_error="skip")
        result["samples"] = [(s["__key__"], bytes(s["txt"]).decode()) for s in ds]
        result["stats"] = dict(ds.stats)
    """)
    assert got["samples"] == [["000001", "after the bomb"]], got
    assert got["stats"]["member_too_large"] == 1 and got["stats"]["skipped"] == 1
    assert got["peak"] < 64 * MiB  # bound: 64 MiB for a 1 GiB member skipped


@pytest.mark.parametrize("kind", ["zst", "gz"])
def test_big_member_is_held_once(bombs: dict[str, Path], kind: str) -> None:
    got = peak_rss(f"""
        ds = shardflow.ShardDataset({str(bombs["big-" + kind])!r}, decode=None)
        it = iter(ds)
        s = next(it)
        result["len"] = len(s["bin"])
        result["zero"] = not any(s["bin"][:: 1 << 16])
        del s
        result["rest"] = [x["__key__"] for x in it]
    """)
    assert got.get("error") is None, got
    assert got["len"] == 256 * MiB and got["zero"] and got["rest"] == ["000001"]
    # bound: 1.25x the member (held twice, as before, would be >= 2x = 512 MiB)
    assert got["peak"] < 320 * MiB, got["peak"] / MiB


def test_the_member_limit_is_an_io_option(bombs: dict[str, Path]) -> None:
    io = IOOptions(limits=Limits(max_member_bytes=64 * MiB))
    ds = ShardDataset(bombs["big-zst"], decode=None, io=io, on_error="skip")
    assert [(s["__key__"], bytes(s["txt"])) for s in ds] == [("000001", b"after the bomb")]
    assert ds.stats["member_too_large"] == 1
    with pytest.raises(SampleError, match=r"declares 268435456 bytes, over the limit of 67108864 bytes"):
        keys(ShardDataset(bombs["big-zst"], decode=None, io=io))
    with pytest.raises(TypeError, match="limits must be"):
        IOOptions(limits={"max_member_bytes": 1})


# ------------------------------------------------------------------ offset indexes


def _rewrite_index(folder: Path, offsets) -> None:
    from shardflow.format.manifest import encode_offsets

    (folder / "train-000000.tar.idx.npy").write_bytes(encode_offsets(offsets))


N_INDEXED = 40  # samples in the indexed shard: rank 1 of 2 starts 20 samples in, past the read-through gap


@pytest.mark.parametrize(
    "forge, said",
    [
        (lambda o: o - o[-1], "starts at the negative offset -"),  # strictly increasing, all <= 0
        (lambda o: [*o[:2], o[1], *o[3:]], r"not strictly increasing \(entry 2 is 1024, after 1024\)"),
        (lambda o: [*o[:2], o[2] + 8, *o[3:]], r"entry 2 \(2056\) is not on a 512-byte tar block"),
        (lambda o: [*o[:-1], 1 << 40], r"ends at byte 1099511627776, past the end of the shard's \d+ bytes"),
        (lambda o: o[:3], r"has shape \(3,\) and dtype int64, expected int64 \(41,\)"),
    ],
)
@pytest.mark.timeout(20)
def test_bad_offset_index_is_a_shardflow_error_everywhere(tmp_path: Path, forge, said: str) -> None:
    import numpy as np

    folder = make_shards(tmp_path, [N_INDEXED])
    real = np.load(folder / "train-000000.tar.idx.npy")
    _rewrite_index(folder, np.asarray(forge(real), dtype=np.int64))
    with pytest.raises(ManifestError, match=said) as info:
        keys(ShardDataset(folder, decode=None, rank=1, world_size=2))  # a later part: read through the index
    assert info.value.reason == "bad_index"
    with pytest.raises(ManifestError, match=said):
        IndexedShardDataset(folder, decode=None)[4]
    ds = ShardDataset(folder, decode=None, rank=1, world_size=2, on_error="skip")
    with pytest.raises(ShardflowError, match="yielded no sample"):
        keys(ds)
    assert ds.stats["bad_index"] == 1 and ds.stats["lost_samples"] == N_INDEXED // 2
    report = verify(folder, workers=1)
    assert [bool(re.search(said, p.message)) for p in report if p.reason == "offset_index"] == [True], report


def test_an_index_header_declaring_a_huge_array_is_refused_before_allocating() -> None:
    import io

    import numpy as np

    from shardflow.format.manifest import decode_offsets

    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {"descr": "<i8", "fortran_order": False, "shape": (10**11,)})
    data = buf.getvalue() + bytes(56)
    with pytest.raises(ManifestError, match=r"offset index has shape \(100000000000,\) and dtype int64, expected int64 \(7,\)"):
        decode_offsets(data, "x.idx.npy", 6)
    with pytest.raises(ManifestError, match=r"holds 56 bytes of data, but its header declares 800000000000"):
        decode_offsets(data, "x.idx.npy", 10**11 - 1)


# ------------------------------------------------------------------ manifests


def test_manifest_declaring_more_samples_than_the_shard_holds_fails_fast(tmp_path: Path) -> None:
    folder = make_shards(tmp_path, [100], index=False)
    manifest = json.loads((folder / "shardflow.json").read_text())
    manifest["shards"][0]["samples"] = 50_000_000
    (folder / "shardflow.json").write_text(json.dumps(manifest))
    size = (folder / "train-000000.tar").stat().st_size
    got = peak_rss(f"""
        ds = shardflow.ShardDataset({str(folder)!r}, decode=None)
        result["keys"] = len([s for s in ds])
    """)
    assert got["error"] == (
        f"ManifestError: {folder}/shardflow.json: shard 'train-000000.tar' declares 50000000 samples in {size} bytes, "
        f"more than it can hold ({size // 512}: a sample takes at least Limits.min_sample_bytes=512 bytes)"
    )
    assert got["peak"] < 64 * MiB  # bound: 64 MiB (it was 9.3 GB and 134 s)


# ------------------------------------------------------------------ graphs


def _graph_shard(tmp_path: Path, bad_ids: list[int]) -> Path:
    torch = pytest.importorskip("torch")
    pyg = pytest.importorskip("torch_geometric.data")
    from shardflow.graph import encode_graph

    parts = []
    for i in range(4):
        ids = [[0, 1], [1, bad_ids[i]]] if i < len(bad_ids) else [[0, 1], [1, 0]]
        raw = encode_graph(pyg.Data(edge_index=torch.tensor(ids)))
        parts.append(encode_sample(sample_key(i), {"pyg": raw}))
    path = tmp_path / "graphs.tar"
    path.write_bytes(b"".join(parts) + END_OF_ARCHIVE)
    return path


@pytest.mark.parametrize("bad", [100_000_000, 1 << 62, -5])
def test_graph_bomb_is_a_decode_error_named_and_counted(tmp_path: Path, bad: int) -> None:
    path = _graph_shard(tmp_path, [bad])
    raw = next(iter(ShardDataset(path, decode=None)))["pyg"]
    assert len(raw) < 400  # the graph was 278 bytes
    said = "holds the negative node id" if bad < 0 else (
        rf"holds the node id {bad}: it implies {bad + 1} nodes, over the limit of 16777216 \(DecodeOptions.max_graph_nodes\)")
    with pytest.raises(DecodeError, match=said):
        keys(ShardDataset(path))
    ds = ShardDataset(path, on_error="skip")
    assert keys(ds) == ["000001", "000002", "000003"]
    assert ds.stats["decode"] == 1


def test_graph_limits_are_options_and_bound_collate_memory(tmp_path: Path) -> None:
    pytest.importorskip("torch_geometric")
    path = _graph_shard(tmp_path, [100_000_000] * 4)
    ok = ShardDataset(path, decode=DecodeOptions(max_graph_nodes=200_000_000))
    assert [int(s["pyg"].edge_index.max()) for s in ok] == [100_000_000] * 4
    with pytest.raises(DecodeError, match=r"over the limit of 1000 \(DecodeOptions.max_graph_nodes\)"):
        (tmp_path / "b").mkdir()
        keys(ShardDataset(_graph_shard(tmp_path / "b", [2000]), decode=DecodeOptions(max_graph_nodes=1000)))
    with pytest.raises(DecodeError, match=r"holds 2 edges, over the limit of 1 \(DecodeOptions.max_graph_edges\)"):
        keys(ShardDataset(path, decode=DecodeOptions(max_graph_edges=1)))
    got = peak_rss(f"""
        ds = shardflow.ShardDataset({str(path)!r}, on_error="skip")
        result["batches"] = sum(1 for _ in shardflow.loader(ds, batch_size=4))
        result["stats"] = dict(ds.stats)
    """)
    assert got.get("error") is not None and "yielded no sample" in got["error"], got
    assert got["peak"] < 64 * MiB  # bound: 64 MiB (the 4-graph collate peaked at 9.8 GB)


# ------------------------------------------------------------------ exact skip


def _corrupt(folder: Path, sample: int, at: int = 5) -> None:
    """Flip a byte of the first header of ``sample`` (its checksum then fails)."""
    import numpy as np

    shard = folder / "train-000000.tar"
    offsets = np.load(folder / "train-000000.tar.idx.npy")
    data = bytearray(shard.read_bytes())
    data[int(offsets[sample]) + at] ^= 0xFF
    shard.write_bytes(bytes(data))


@pytest.mark.parametrize("source", ["folder", "shard"])
def test_corrupt_header_loses_only_its_sample_with_an_index(tmp_path: Path, source: str) -> None:
    folder = make_shards(tmp_path, [6])
    _corrupt(folder, 3)
    src = folder if source == "folder" else folder / "train-000000.tar"  # a shard finds its manifest beside it
    with pytest.raises(ShardFormatError, match="bad tar header checksum at byte 3072"):
        keys(ShardDataset(src, decode=None))
    ds = ShardDataset(src, decode=None, on_error="skip")
    assert keys(ds) == ["000000", "000001", "000002", "000004", "000005"]
    assert dict(ds.stats) == {"samples": 5, "bad_shard": 1, "lost_samples": 1, "skipped": 1}


def test_two_corrupt_samples_and_a_later_part(tmp_path: Path) -> None:
    folder = make_shards(tmp_path, [N_INDEXED])
    _corrupt(folder, 22)
    _corrupt(folder, 30, at=130)  # inside the size field: non-octal
    ds = ShardDataset(folder, decode=None, on_error="skip", rank=1, world_size=2)  # samples 20-39, via the index
    assert keys(ds) == [sample_key(i) for i in range(20, 40) if i not in (22, 30)]
    assert dict(ds.stats) == {"samples": 18, "bad_shard": 1, "lost_samples": 2, "skipped": 2}


def test_corrupt_header_without_an_index_keeps_what_it_can_tell_complete(tmp_path: Path) -> None:
    folder = make_shards(tmp_path, [6], manifest=False, index=False)
    shard = folder / "train-000000.tar"
    data = bytearray(shard.read_bytes())
    data[3 * 1024 + 5] ^= 0xFF  # samples are 1024 bytes: sample 3's header, checksum now wrong
    shard.write_bytes(bytes(data))
    ds = ShardDataset(shard, decode=None, on_error="skip")
    # without an index, whether the damaged header began sample 3 or was another member of
    # sample 2 cannot be told: sample 2 is not yielded as complete
    assert keys(ds) == ["000000", "000001"]
    assert dict(ds.stats) == {"samples": 2, "bad_shard": 1, "lost_samples": 1, "skipped": 1}


@pytest.mark.parametrize("manifest", [True, False])
def test_cut_inside_member_data_keeps_every_complete_sample(tmp_path: Path, manifest: bool) -> None:
    folder = make_shards(tmp_path, [51], manifest=manifest, index=manifest)
    shard = folder / "train-000000.tar"
    data = shard.read_bytes()
    shard.write_bytes(data[: 50 * 1024 + 512 + 1])  # 50 whole samples, then sample 50's header and 1 data byte
    ds = ShardDataset(folder if manifest else shard, decode=None, on_error="skip")
    assert keys(ds) == [sample_key(i) for i in range(50)]
    assert ds.stats["samples"] == 50 and ds.stats["lost_samples"] == 1 and ds.stats["truncated_shard"] == 1


# ------------------------------------------------------------------ manifest URLs


def _point_manifest(folder: Path, url: str, index: str | None = None) -> None:
    manifest = json.loads((folder / "shardflow.json").read_text())
    manifest["shards"][0]["url"] = url
    if index is not None:
        manifest["shards"][0]["index"] = index
    (folder / "shardflow.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize(
    "url, why",
    [
        ("../outside/x.tar", "leaves the manifest's folder"),
        ("sub/../../outside/x.tar", "leaves the manifest's folder"),
        ("%2e%2e/outside/x.tar", "leaves the manifest's folder"),
        ("/etc/passwd", "is an absolute path"),
        ("~/x.tar", "is an absolute path"),
        ("file:///etc/passwd", "is an absolute URL"),
        ("http://127.0.0.1:9/x.tar", "is an absolute URL"),
        ("s3://bucket/x.tar", "is an absolute URL"),
        ("simplecache::file:///etc/passwd", "is an fsspec '::' chain"),
        ("C:/Windows/x.tar", "is an absolute URL"),
        ("..\\x.tar", "holds a backslash"),
    ],
)
def test_manifest_urls_stay_inside_the_dataset(tmp_path: Path, url: str, why: str) -> None:
    folder = make_shards(tmp_path, [3])
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "x.tar").write_bytes((folder / "train-000000.tar").read_bytes())
    _point_manifest(folder, url)
    with pytest.raises(ManifestError, match=re.escape(f"the shard URL {url!r} {why}")) as info:
        ShardDataset(folder, decode=None)
    assert info.value.reason == "manifest_url" and "trust_manifest_urls=True" in str(info.value)
    with pytest.raises(ManifestError, match="manifest_url|must be relative"):
        IndexedShardDataset(folder, decode=None)


def test_index_urls_are_contained_too_and_trust_is_an_option(tmp_path: Path) -> None:
    folder = make_shards(tmp_path, [3])
    _point_manifest(folder, "train-000000.tar", index="/etc/passwd")
    with pytest.raises(ManifestError, match=r"the offset index URL '/etc/passwd' is an absolute path"):
        ShardDataset(folder, decode=None)
    # trusted: an absolute URL to the real shard opens (as `shardflow index --out` elsewhere writes)
    _point_manifest(folder, str(folder / "train-000000.tar"), index="train-000000.tar.idx.npy")
    ds = ShardDataset(folder, decode=None, io=IOOptions(trust_manifest_urls=True))
    assert keys(ds) == ["000000", "000001", "000002"]
    # contained relative URLs with '..' that stay inside are fine
    (folder / "sub").mkdir()
    _point_manifest(folder, "sub/../train-000000.tar")
    assert keys(ShardDataset(folder, decode=None)) == ["000000", "000001", "000002"]


def test_errors_quote_names_never_file_contents(tmp_path: Path) -> None:
    secret = b"root:x:0:0:SECRET-TOKEN-1234:/root:/bin/bash\n" * 20
    url = write(tmp_path, "passwd.tar", secret)
    with pytest.raises(ShardFormatError) as info:
        keys(ShardDataset(url, decode=None))
    assert "SECRET" not in str(info.value) and "root:" not in str(info.value)
    bad = header(b"000000.txt", b"root:x:0:0:\0") + b"x" * 512
    with pytest.raises(ShardFormatError, match=r"non-octal size field \(not digits 0-7\)") as info:
        list(iter_samples([bad], "x.tar"))
    assert "root" not in str(info.value).replace("000000", "")


# ------------------------------------------------------------------ network deadlines and splicing


FAST = dict(request_timeout=0.5, retries=1, backoff=0.05, part_deadline=3.0)


def _served(tmp_path: Path, srv, n: int = 40) -> str:
    folder = make_shards(tmp_path, [n])
    for p in folder.iterdir():
        srv.put(p.name, p.read_bytes())
    return srv.url_for("shardflow.json")


@pytest.mark.timeout(60)
def test_a_stall_after_some_bytes_on_every_get_fails_in_bounded_time(tmp_path: Path, flaky_http_server) -> None:
    import time

    murl = _served(tmp_path, flaky_http_server)
    # every GET sends 5000 bytes, then stalls: each reopen makes progress, so retries never run out
    flaky_http_server.faults.stall_after = 5000
    began = time.monotonic()
    with pytest.raises(RemoteReadError, match=r"reached byte \d+ only, after \d+\.\d s of waiting on the store, past the "
                       r"deadline of 3 s \(IOOptions.part_deadline\)") as info:
        keys(ShardDataset(murl, decode=None, io=IOOptions(**FAST)))
    # past the deadline by about one timed-out request (0.5 s), or more where a loaded machine
    # wakes the request's timer late: the bound is the deadline, not how far past it
    assert float(re.search(r"after (\d+\.\d) s", str(info.value)).group(1)) >= 3.0, str(info.value)
    assert time.monotonic() - began < 20  # about part_deadline (it was never: no error in 900 s)
    assert flaky_http_server.stats.gets >= 3  # it did make progress before giving up
    skip = ShardDataset(murl, decode=None, io=IOOptions(**FAST), on_error="skip")
    got = keys(skip)  # the samples read whole before the deadline, then the rest counted lost
    assert got == [sample_key(i) for i in range(len(got))] and 0 < len(got) < 40
    assert skip.stats["remote_read"] == 1 and skip.stats["lost_samples"] == 40 - len(got)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("where", ["headers", "head"])
def test_stalled_headers_and_head_requests_time_out_and_retries_apply(tmp_path: Path, flaky_http_server, where) -> None:
    import time

    murl = _served(tmp_path, flaky_http_server)
    if where == "head":
        flaky_http_server.faults.stall_head = 60.0
    else:
        flaky_http_server.faults.stall_headers = True
    flaky_http_server.reset_stats()
    began = time.monotonic()
    with pytest.raises((RemoteReadError, ManifestError)):
        keys(ShardDataset(murl, decode=None, io=IOOptions(request_timeout=0.5, retries=0, backoff=0.01)))
    assert time.monotonic() - began < 20  # retries=0: one timed-out request of 0.5 s (it was 300 s); slack for load


def test_a_changed_object_without_validators_is_caught_by_the_manifest_digest(tmp_path: Path, flaky_http_server) -> None:
    folder = make_shards(tmp_path, [40])
    shard = (folder / "train-000000.tar").read_bytes()
    for p in folder.iterdir():
        flaky_http_server.put(p.name, p.read_bytes())
    # another version of the same size: the first GET is dropped half way, the file replaced
    changed = bytearray(shard)
    changed[20 * 1024 + 512] ^= 1  # sample 20's cls "20" becomes "30": a different object, same size
    faults = flaky_http_server.faults
    faults.no_validators, faults.drop_after, faults.max_drops = True, 20 * 1024 + 512, 1
    faults.change_on_drop = bytes(changed)
    io = IOOptions(retries=3, backoff=0.01, request_timeout=2.0, readahead=0)
    with pytest.raises(RemoteReadError, match=r"read whole, its sha256 is [0-9a-f]+ but the manifest lists"):
        keys(ShardDataset(flaky_http_server.url_for("shardflow.json"), decode=None, io=io))
    assert flaky_http_server.stats.drops == 1 and flaky_http_server.stats.changes == 1


# ------------------------------------------------------------------ workers and their parent


@pytest.mark.timeout(60)
def test_workers_exit_when_the_main_process_is_killed(tmp_path: Path) -> None:
    import signal as signals
    import time

    psutil = pytest.importorskip("psutil")
    folder = make_shards(tmp_path, [40, 40])
    script = textwrap.dedent(f"""
        import os, sys, time
        import shardflow
        def stuck(sample):  # workers then block in user code, where torch's own watchdog cannot act
            if int(sample["__key__"]) % 40 >= 4:
                time.sleep(120)
            return sample
        ds = shardflow.ShardDataset({str(folder)!r}, decode=None, transform=stuck)
        loader = shardflow.loader(ds, batch_size=2, num_workers=4, collate_fn=list)
        it = iter(loader)
        next(it)
        import psutil
        print(" ".join(str(c.pid) for c in psutil.Process().children()), flush=True)
        time.sleep(120)  # killed here, workers mid-epoch
    """)
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=env)
    try:
        workers = [int(p) for p in proc.stdout.readline().split()]
        assert len(workers) >= 4
        proc.send_signal(signals.SIGKILL)
        proc.wait(10)
        waited = 0.0
        while any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in workers):
            time.sleep(0.1)
            waited += 0.1
            if waited > 20:
                break
        alive = [p for p in workers if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        assert alive == []  # without the parent-death signal they sleep on for 120 s
    finally:
        proc.kill()
        for p in workers if "workers" in dir() else []:
            with contextlib.suppress(Exception):
                os.kill(p, signals.SIGKILL)


# ------------------------------------------------------------------ writers: one per destination, no leftovers


def test_one_writer_per_destination_and_a_crashed_one_holds_nothing(tmp_path: Path) -> None:
    from shardflow import ShardWriter
    from shardflow.storage import DestinationLockedError

    pattern = str(tmp_path / "out" / "train-%06d.tar")
    first = ShardWriter(pattern, max_count=2)
    first.write({"__key__": "a", "txt": "x"})
    with pytest.raises(DestinationLockedError, match=rf"another writer \(pid {os.getpid()} on .+\) is writing"):
        ShardWriter(pattern, max_count=2).write({"__key__": "b", "txt": "y"})
    first.close()
    assert not (tmp_path / "out" / ".shardflow.lock").exists()
    # a writer killed mid-shard: its lock dies with it, its temporaries are removed by the next run
    script = textwrap.dedent(f"""
        import os
        from shardflow import ShardWriter
        w = ShardWriter({pattern!r}, max_count=100)
        for i in range(10):
            w.write({{"__key__": f"{{i:06d}}", "txt": "x" * 1000}})
        os._exit(9)
    """)
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    assert subprocess.run([sys.executable, "-c", script], env=env, timeout=60).returncode == 9
    left = sorted(p.name for p in (tmp_path / "out").iterdir() if p.name.endswith(".tmp"))
    assert left and all(name.startswith(".train-000000.tar.") for name in left), left
    with ShardWriter(pattern, max_count=100) as again:
        again.write({"__key__": "000000", "txt": "y"})
        assert not any(p.name.endswith(".tmp") and p.name in left for p in (tmp_path / "out").iterdir())
    names = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert names == ["shardflow.json", "train-000000.tar", "train-000000.tar.idx.npy"], names
    assert [s["__key__"] for s in ShardDataset(tmp_path / "out", decode=None)] == ["000000"]


# ------------------------------------------------------------------ graphs pointing past their nodes, the CLI


def _three_graphs(tmp_path: Path, bad) -> Path:
    """Samples 000000-000002 with a ``pyg`` field each; 000001 is the graph ``bad``."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("torch_geometric")
    from shardflow.graph import encode_graph
    from torch_geometric.data import Data

    good = Data(x=torch.zeros(3, 2), edge_index=torch.tensor([[0, 1], [1, 2]]))
    folder = tmp_path / "graphs"
    folder.mkdir()
    raw = [encode_sample(sample_key(i), {"pyg": encode_graph(bad if i == 1 else good)}) for i in range(3)]
    (folder / "g-000000.tar").write_bytes(b"".join(raw) + END_OF_ARCHIVE)
    index_shards([str(folder / "g-000000.tar")])
    return folder


def _hetero_past_its_nodes():
    import torch
    from torch_geometric.data import HeteroData

    g = HeteroData()
    g["author"].x = torch.zeros(1, 3)
    g["venue"].x = torch.zeros(4, 3)
    g["author", "writes", "venue"].edge_index = torch.tensor([[0], [9]])
    return g


def _data_past_its_nodes():
    import torch
    from torch_geometric.data import Data

    return Data(x=torch.zeros(3, 2), edge_index=torch.tensor([[0, 1], [1, 7]]))


@pytest.mark.parametrize(
    "make, said",
    [
        (_data_past_its_nodes, "edge_index[1] holds the node id 7, but the graph has 3 nodes"),
        (_hetero_past_its_nodes, "('author', 'writes', 'venue').edge_index[1] holds the node id 9, but the graph has 4 nodes"),
    ],
)
def test_edge_index_past_the_declared_nodes_is_named_by_every_reader(tmp_path: Path, make, said: str) -> None:
    folder = _three_graphs(tmp_path, make())
    with pytest.raises(DecodeError, match=r"g-000000\.tar.*'000001'.*" + re.escape(said)):
        keys(ShardDataset(folder))
    ds = ShardDataset(folder, on_error="skip")
    got = list(ds)
    assert [s["__key__"] for s in got] == ["000000", "000002"]
    assert [s["pyg"].edge_index.tolist() for s in got] == [[[0, 1], [1, 2]]] * 2
    assert ds.stats["decode"] == 1 and ds.stats["skipped"] == 1
    ix = IndexedShardDataset(folder)
    with pytest.raises(DecodeError, match=re.escape(said)):
        ix[1]
    assert ix[2]["__key__"] == "000002" and ix[2]["pyg"].num_nodes == 3
    report = verify(folder, workers=1)
    assert [(p.key, p.reason) for p in report] == [("000001", "decode")]
    assert said in report[0].message


def _cli(args: list[str], capsys) -> tuple[int, str, str]:
    from shardflow.cli import main

    try:
        rc = main(args)
    except SystemExit as e:
        rc = e.code
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.mark.timeout(30)
def test_cli_names_a_negative_size_header_in_every_command(tmp_path: Path, capsys) -> None:
    url = write(tmp_path, "neg-000000.tar", six_with(NEGATIVE))
    said = "neg-000000.tar: header at byte 6144 has a negative base-256 size field (-512)"
    rc, out, _ = _cli(["inspect", url], capsys)
    assert rc == 0 and "samples   3 " in out
    assert f"warning   {url[:-len('neg-000000.tar')]}{said}" in out
    rc, out, _ = _cli(["verify", url, "--workers", "1"], capsys)
    assert rc == 1
    assert f"FAIL {url}: bad_shard: header at byte 6144 has a negative base-256 size field (-512) (after sample '000002')" in out
    rc, out, err = _cli(["index", url, "--out", str(tmp_path / "ix")], capsys)
    assert rc == 1 and said in err
    assert not (tmp_path / "ix" / "shardflow.json").exists()


def test_inspect_warns_of_samples_it_could_not_read(tmp_path: Path) -> None:
    from shardflow.inspect import summarize

    url = write(tmp_path, "six.tar", six_with(encode_sample("000003", {"bin": b"\1" * 5000})))
    info = summarize(url, workers=1, io=IOOptions(limits=Limits(max_member_bytes=4096)))
    assert info["samples"] == 6
    assert info["fields"] == {"cls": {"codec": "cls", "samples": 5}, "txt": {"codec": "txt", "samples": 5}}
    assert info["errors"] == [
        f"1 sample could not be read, the first: {url} key '000003': member '000003.bin' at byte 6144 declares "
        "5000 bytes, over the limit of 4096 bytes (Limits.max_member_bytes; raise it to read larger members)"]
    assert summarize(url, workers=1)["errors"] == []


# ------------------------------------------------------------------ manifest fields of the wrong type


@pytest.mark.parametrize(
    "change, said",
    [
        (lambda m: m.pop("shards"), '"shards" is missing, not a list of shard entries'),
        (lambda m: m.update(shards={"a": 1}), '"shards" is a dict, not a list of shard entries'),
        (lambda m: m["shards"].__setitem__(0, "train-000000.tar"), "shard entry 0 is a str, not an object"),
        (lambda m: m["shards"][0].update(url=None), "shard entry 0 has no url (url is None)"),
        (lambda m: m["shards"][0].update(url=""), "shard entry 0 has no url (url is '')"),
        (lambda m: m["shards"][0].update(samples="6"), "shard entry 0 ('train-000000.tar'): samples is '6', not an integer"),
        (lambda m: m["shards"][0].update(samples=True), "shard entry 0 ('train-000000.tar'): samples is True, not an integer"),
        (lambda m: m["shards"][0].update(bytes=1.5), "shard entry 0 ('train-000000.tar'): bytes is 1.5, not an integer"),
        (lambda m: m["shards"][0].update(index=7), "shard entry 0 ('train-000000.tar'): index is 7, not a string"),
        (lambda m: m.update(fields=["txt"]), '"fields" is a list, not an object'),
        (lambda m: m.update(meta=3), '"meta" is an int, not an object'),
    ],
)
def test_manifest_entries_of_the_wrong_type_are_named_by_every_reader(tmp_path: Path, capsys, change, said: str) -> None:
    # a string count was rounded through int(), a float size truncated (1.5 -> "1 bytes"), a null url
    # opened the file "None", a manifest without "shards" read as an empty dataset that verify called OK
    folder = make_shards(tmp_path, [6])
    manifest = json.loads((folder / "shardflow.json").read_text())
    change(manifest)
    (folder / "shardflow.json").write_text(json.dumps(manifest))
    want = re.escape(f"{folder / 'shardflow.json'}: {said}")
    for on_error in ("raise", "skip"):
        with pytest.raises(ManifestError, match=want):
            keys(ShardDataset(folder, decode=None, on_error=on_error))
    with pytest.raises(ManifestError, match=want):
        IndexedShardDataset(folder, decode=None)
    for command in ("inspect", "verify"):
        rc, _, err = _cli([command, str(folder)], capsys)
        assert rc == 1 and said in err


def test_a_missing_shard_is_a_shardflow_error_for_random_access(tmp_path: Path) -> None:
    folder = make_shards(tmp_path, [3, 3])
    (folder / "train-000001.tar").unlink()
    ix = IndexedShardDataset(folder, decode=None)
    assert ix[2]["__key__"] == "000002"
    with pytest.raises(ShardflowError, match=re.escape(f"shard not found: {folder / 'train-000001.tar'}")) as e:
        ix[3]
    assert isinstance(e.value, FileNotFoundError) and isinstance(e.value.__cause__, FileNotFoundError)


def _rename_first_member(folder: Path, sample: int, key: str) -> None:
    """Give the first member of ``sample`` (at the offset its index entry gives) the key ``key``,
    its header checksum fixed: a damaged or hostile shard that still parses as tar."""
    import numpy as np

    shard = folder / "train-000000.tar"
    at = int(np.load(folder / "train-000000.tar.idx.npy")[sample])
    data = bytearray(shard.read_bytes())
    name = bytes(data[at : at + 100]).split(b"\0", 1)[0]
    data[at : at + 100] = (key.encode() + name[name.index(b".") :]).ljust(100, b"\0")
    data[at + 148 : at + 156] = b"        "
    data[at + 148 : at + 156] = b"%06o\0 " % sum(data[at : at + 512])
    shard.write_bytes(bytes(data))


@pytest.mark.parametrize("n, victim", [(12, 5), (40, 5), (40, 21), (100, 50)])  # 12: read whole; else by seeks
@pytest.mark.parametrize("two_fields", [False, True])
def test_a_sample_start_named_with_the_previous_key_loses_that_sample_only(tmp_path: Path, n, victim, two_fields):
    folder = make_shards(tmp_path, [n], (lambda i: {"txt": f"text {i}"}) if two_fields else None)
    _rename_first_member(folder, victim, sample_key(victim - 1))
    expected = {sample_key(i): {"cls": str(i).encode(), **({"txt": f"text {i}".encode()} if two_fields else {})}
                for i in range(n) if i != victim}
    split = [dict(rank=r, world_size=2) for r in range(2)]
    ways = [[{}], [dict(shuffle=ShuffleConfig(window=0), seed=3)], split]
    if two_fields:  # the window shuffle reads each sample on its own, a seek: see the note below
        ways.append([dict(shuffle=True, seed=3)])
    if victim == n // 2 and not two_fields:
        # rank 1 seeks to the damaged sample itself: its one member's key is told from the one
        # before only by reading that one too, which a seek does not (left out, not asserted)
        ways.remove(split)
    for runs in ways:
        got, stats = [], {}
        for kw in runs:
            ds = ShardDataset(folder, decode=None, on_error="skip", **kw)
            got += [(s["__key__"], {k: v for k, v in s.items() if not k.startswith("__")}) for s in ds]
            for k, v in ds.stats.items():
                stats[k] = stats.get(k, 0) + v
        assert sorted(k for k, _ in got) == sorted(expected), runs  # each once: no duplicate, none lost
        assert dict(got) == expected  # byte-equal, whole samples only
        # the damaged one counted, named by shard and key
        assert stats == {"samples": n - 1, "non_adjacent": 1, "skipped": 1}, runs
    with pytest.raises(SampleError, match=rf"train-000000\.tar: .*key '{sample_key(victim - 1)}'") as err:
        keys(ShardDataset(folder, decode=None))
    assert err.value.reason == "non_adjacent"
