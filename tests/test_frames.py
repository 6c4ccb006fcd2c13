"""Framed ``.tar.zst`` shards (``compression="zstd"``), checked against the plain shards of the same samples.

The reference: the plain ``.tar`` shards of the same samples, read by CPython
``tarfile``; the ``.tar.zst`` ones decompressed by ``zstandard``'s streaming
reader (and the ``zstd`` command where there is one) must be the same bytes,
and every read path of shardflow (shuffled epochs, random access, resumption,
rank splits inside a shard) must give the same samples from both.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import struct
import subprocess
import tarfile
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

import shardflow
from shardflow import IndexedShardDataset, ShardDataset, ShardWriter, ShuffleConfig
from shardflow.format.frames import FRAME_BYTES, FRAME_CAP, FrameTable, FrameTableError
from shardflow.format.limits import Limits
from shardflow.loading.shardloader import loader as make_loader
from shardflow.storage import IOOptions
from tests.helpers import assert_resumes, canonical

TIMEOUT = 60
IMAGES = 600
PER_SHARD = 250

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")


def _jpeg(i: int) -> bytes:
    """A 64x64 JPEG like tools' image folders: smooth colour waves plus noise, quality 90."""
    rng = np.random.default_rng(i)
    yy, xx = np.mgrid[0:64, 0:64]
    a = rng.uniform(0, 6, 3)
    img = np.stack([127 + 120 * np.sin(xx / 64 * a[k] + yy / 64 * a[(k + 1) % 3]) for k in range(3)], -1)
    img += rng.normal(0, 8, img.shape)
    buf = io.BytesIO()
    Image.fromarray(np.clip(img, 0, 255).astype(np.uint8)).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def _sample(i: int) -> dict[str, Any]:
    return {"__key__": f"c{i % 4}/{i:06d}", "jpg": JPEGS[i], "cls": i % 4}


JPEGS = [_jpeg(i) for i in range(IMAGES)]


def _write(folder: Path, compression: str | None) -> Path:
    return Path(shardflow.write_shards(_sample, range(IMAGES), str(folder), max_count=PER_SHARD, workers=1,
                                       compression=compression).url).parent


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("frames")
    return _write(root / "plain", None), _write(root / "zstd", "zstd")


def _unzstd(path: Path) -> bytes:
    with open(path, "rb") as f:
        return zstandard.ZstdDecompressor().stream_reader(f, read_across_frames=True).read()


def _raw(ds: Any) -> list[tuple[str, bytes, bytes]]:
    return [(s["__key__"], s["jpg"], s["cls"]) for s in ds]


# ------------------------------------------------------------------ the format


def test_stored_bytes_within_1_1x_of_the_image_bytes(pair: tuple[Path, Path]) -> None:
    plain, packed = pair
    images = sum(len(j) for j in JPEGS)
    zstd = json.loads((packed / "shardflow.json").read_text())
    tar = json.loads((plain / "shardflow.json").read_text())
    stored = sum(s["bytes"] for s in zstd["shards"])
    assert stored == sum(p.stat().st_size for p in packed.glob("*.tar.zst"))
    # 64x64 JPEGs of ~2 KB: the tar headers and padding nearly double them; zstd takes those away
    assert sum(s["bytes"] for s in tar["shards"]) > 1.5 * images
    assert stored <= 1.1 * images, f"stored {stored} bytes for {images} bytes of images ({stored / images:.3f}x)"
    assert [s["compression"] for s in zstd["shards"]] == ["zstd"] * 3
    assert [s["url"] for s in zstd["shards"]] == [f"train-{g:06d}.tar.zst" for g in range(3)]
    assert all((packed / s["frames"]).exists() and (packed / s["index"]).exists() for s in zstd["shards"])
    assert all("compression" not in s and "frames" not in s for s in tar["shards"])


def test_decompressed_shards_are_the_plain_tars(pair: tuple[Path, Path]) -> None:
    plain, packed = pair
    for g in range(3):
        data = _unzstd(packed / f"train-{g:06d}.tar.zst")
        assert data == (plain / f"train-{g:06d}.tar").read_bytes()  # byte for byte: the same deterministic tar
        with tarfile.open(fileobj=io.BytesIO(data)) as tf:
            names = tf.getnames()
            first = tf.extractfile(names[1]).read()  # type: ignore[union-attr]
        i = g * PER_SHARD
        assert names[:4] == [f"c{i % 4}/{i:06d}.cls", f"c{i % 4}/{i:06d}.jpg", f"c{(i + 1) % 4}/{i + 1:06d}.cls",
                             f"c{(i + 1) % 4}/{i + 1:06d}.jpg"]
        assert first == JPEGS[i]


@pytest.mark.skipif(shutil.which("zstd") is None or shutil.which("tar") is None, reason="no zstd or tar command")
def test_zstd_dc_pipe_tar_lists_the_members(pair: tuple[Path, Path]) -> None:
    plain, packed = pair
    out = subprocess.run(f"zstd -dc '{packed}/train-000002.tar.zst' | tar t", shell=True, check=True,
                         capture_output=True, text=True, timeout=TIMEOUT).stdout.split()
    with tarfile.open(plain / "train-000002.tar") as tf:
        assert out == tf.getnames()
    assert len(out) == 2 * (IMAGES - 2 * PER_SHARD)


def test_frames_and_seek_table(pair: tuple[Path, Path]) -> None:
    _, packed = pair
    path = packed / "train-000000.tar.zst"
    data = path.read_bytes()
    table = np.load(packed / "train-000000.tar.zst.frames.npy", allow_pickle=False)
    plain, stored = table[:, 0], table[:, 1]
    offsets = np.load(packed / "train-000000.tar.zst.idx.npy", allow_pickle=False)
    assert table.dtype == np.int64 and table.shape[1] == 2 and (table[0] == 0).all()
    assert plain[-1] == len(_unzstd(path))
    assert np.all(np.diff(plain)[:-1] >= FRAME_BYTES) and np.all(np.diff(plain) <= FRAME_CAP)
    assert set(plain[1:-1].tolist()) <= set(offsets.tolist())  # frames break only between samples
    for i in range(len(table) - 1):  # each frame alone decompresses to its tar bytes
        frame = data[stored[i] : stored[i + 1]]
        assert zstandard.frame_content_size(frame) == plain[i + 1] - plain[i]
    # the zstd seekable format's seek table closes the file (read here by its spec, not by shardflow)
    frames, descriptor, magic = struct.unpack("<IBI", data[-9:])
    assert magic == 0x8F92EAB1 and descriptor == 0 and frames == len(table) - 1
    start = len(data) - 9 - 8 * frames
    entries = [struct.unpack("<II", data[start + 8 * k : start + 8 * k + 8]) for k in range(frames)]
    assert entries == list(zip(np.diff(stored).tolist(), np.diff(plain).tolist()))
    assert struct.unpack("<II", data[start - 8 : start]) == (0x184D2A5E, 8 * frames + 9)
    assert start - 8 == stored[-1]


def test_a_sample_larger_than_a_frame_is_cut_inside_and_reads_back(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    big = [rng.integers(0, 255, n, dtype=np.uint8).tobytes() for n in (10, FRAME_CAP + 1000, 3000, 2 * FRAME_CAP)]
    with ShardWriter(str(tmp_path / "s-%06d.tar"), compression="zstd") as w:
        for i, b in enumerate(big):
            w.write({"__key__": f"{i:03d}", "bin": b})
    table = np.load(tmp_path / "s-000000.tar.zst.frames.npy")
    assert np.diff(table[:, 0]).max() == FRAME_CAP
    ds = IndexedShardDataset(tmp_path, decode=None)
    assert [ds[i]["bin"] for i in (3, 1, 0, 2)] == [big[3], big[1], big[0], big[2]]
    assert [s["bin"] for s in ShardDataset(tmp_path, decode=None)] == big


# ------------------------------------------------------------------ reading: the same samples as plain shards


@pytest.mark.parametrize("workers", [0, 2])
def test_same_shuffled_epoch_as_the_plain_shards(pair: tuple[Path, Path], workers: int) -> None:
    plain, packed = pair

    def epoch(folder: Path, e: int) -> list[Any]:
        # the interleaved shuffle (window 0): the window shuffle reads plain local .tar shards
        # one sample at a time, and .tar.zst ones keep the interleave (docs/distributed.md)
        ds = ShardDataset(folder, shuffle=ShuffleConfig(window=0), seed=7, decode=None)
        ds.set_epoch(e)
        ld = make_loader(ds, batch_size=16, num_workers=workers, timeout=TIMEOUT if workers else 0)
        return [(b["__key__"], b["jpg"]) for b in ld]

    for e in (0, 1):
        want = epoch(plain, e)
        assert epoch(packed, e) == want
        assert sorted(k for keys, _ in want for k in keys) == sorted(_sample(i)["__key__"] for i in range(IMAGES))


def test_stored_order_and_decoded_images(pair: tuple[Path, Path]) -> None:
    plain, packed = pair
    assert _raw(ShardDataset(packed, decode=None)) == _raw(ShardDataset(plain, decode=None))
    first = next(iter(ShardDataset(packed, decode="numpy")))
    assert np.array_equal(first["jpg"], np.asarray(Image.open(io.BytesIO(JPEGS[0])).convert("RGB")))


def test_random_access_equals_the_plain_shards(pair: tuple[Path, Path]) -> None:
    plain, packed = pair
    a, b = IndexedShardDataset(plain, decode=None), IndexedShardDataset(packed, decode=None)
    assert len(a) == len(b) == IMAGES
    order = np.random.default_rng(3).permutation(IMAGES).tolist()
    for i in order:
        got, want = b[i], a[i]
        assert got["__key__"] == want["__key__"] == _sample(i)["__key__"]
        assert got["jpg"] == want["jpg"] == JPEGS[i] and got["cls"] == want["cls"]
        assert got["__url__"].endswith(".tar.zst")


def test_random_access_reads_one_frame(pair: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    _, packed = pair
    ds = IndexedShardDataset(packed, decode=None)
    table = np.load(packed / "train-000001.tar.zst.frames.npy")
    reads: list[tuple[int, int]] = []
    real = os.pread

    def pread(fd: int, n: int, at: int) -> bytes:
        reads.append((at, at + n))
        return real(fd, n, at)

    monkeypatch.setattr(os, "pread", pread)
    assert ds[PER_SHARD + 200]["jpg"] == JPEGS[PER_SHARD + 200]
    assert len(reads) == 1 and tuple(reads[0]) in set(zip(table[:-1, 1].tolist(), table[1:, 1].tolist()))
    # samples in order: one read (and one decompression) per frame, not per sample
    offsets = np.load(packed / "train-000001.tar.zst.idx.npy")
    frame_of = np.searchsorted(table[:, 0], offsets[:-1], side="right") - 1
    reads.clear()
    assert [ds[PER_SHARD + j]["jpg"] for j in range(PER_SHARD)] == JPEGS[PER_SHARD : 2 * PER_SHARD]
    spans = {(int(table[f, 1]), int(table[f + 1, 1])) for f in frame_of}
    assert sorted(reads) == sorted(spans) and len(spans) > 1  # each frame once


def test_resume_exact_and_equal_to_the_plain_epoch(pair: tuple[Path, Path]) -> None:
    plain, packed = pair

    def maker(folder: Path) -> Any:
        def make() -> Any:
            ds = ShardDataset(folder, shuffle=ShuffleConfig(window=0), seed=1, decode=None)  # as above: the interleave on both
            return make_loader(ds, batch_size=8, num_workers=2, timeout=TIMEOUT)
        return make

    def no_url(batches: list[Any]) -> list[Any]:
        return [{k: v for k, v in b.items() if k != "__url__"} for b in batches]

    record, _ = assert_resumes(maker(packed), k=23)
    assert len(record) == IMAGES // 8
    assert no_url(record) == no_url([canonical(b) for b in maker(plain)()])


def test_two_ranks_split_inside_one_shard(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    n = 400
    for sub, comp in (("plain", None), ("zstd", "zstd")):
        with ShardWriter(str(tmp_path / sub / "one-%06d.tar"), max_count=n, compression=comp) as w:
            for i in range(n):
                w.write(_sample(i))
    table = np.load(tmp_path / "zstd" / "one-000000.tar.zst.frames.npy")
    offsets = np.load(tmp_path / "zstd" / "one-000000.tar.zst.idx.npy")
    ranges: list[tuple[int, int]] = []
    import shardflow.storage.framed as framed

    real = framed.open_chunks

    def spy(url: str, start: int = 0, end: int | None = None, *args: Any, **kw: Any) -> Any:
        ranges.append((start, end))
        return real(url, start, end, *args, **kw)

    monkeypatch.setattr(framed, "open_chunks", spy)
    got, read = {}, {}
    for rank in (0, 1):
        for sub in ("plain", "zstd"):
            ranges.clear()
            got[rank, sub] = _raw(ShardDataset(tmp_path / sub, rank=rank, world_size=2, decode=None))
        read[rank] = sorted(ranges)
        assert got[rank, "zstd"] == got[rank, "plain"]
        assert [k for k, _, _ in got[rank, "zstd"]] == [_sample(i)["__key__"] for i in range(rank * n // 2, (rank + 1) * n // 2)]
    # each rank read the frames that hold its half, and no others: rank 1 from the frame that
    # holds its first sample on, not from byte 0
    plain, stored = table[:, 0], table[:, 1]
    mid = int(np.searchsorted(plain, offsets[n // 2], side="right")) - 1
    end0 = int(np.searchsorted(plain, offsets[n // 2], side="left"))
    assert 0 < stored[mid] and len(table) > 3
    assert read[0][0][0] == 0 and max(e for _, e in read[0]) == stored[end0]
    assert read[1][0][0] == stored[mid] and max(e for _, e in read[1]) == stored[-1]


def test_gzip_shards_still_stream(tmp_path: Path, pair: tuple[Path, Path]) -> None:
    import gzip

    plain, _ = pair
    (tmp_path / "gz").mkdir()
    for p in sorted(plain.glob("*.tar")):
        (tmp_path / "gz" / (p.name + ".gz")).write_bytes(gzip.compress(p.read_bytes()))
    assert _raw(ShardDataset(sorted(str(p) for p in (tmp_path / "gz").glob("*.gz")), decode=None)) == \
        _raw(ShardDataset(plain, decode=None))


# ------------------------------------------------------------------ hostile frame tables and frames


def _copy(pair: tuple[Path, Path], tmp_path: Path) -> Path:
    out = tmp_path / "copy"
    shutil.copytree(pair[1], out)
    return out


def _set_table(folder: Path, table: np.ndarray, shard: int = 0) -> None:
    np.save(folder / f"train-{shard:06d}.tar.zst.frames.npy", np.asarray(table, dtype=np.int64), allow_pickle=False)


@pytest.mark.parametrize("case, match", [
    ("decreasing", "do not increase"),
    ("not_zero", "not \\(0, 0\\)"),
    ("past_end", "past the end of the shard"),
    ("one_row", "at least 2"),
    ("three_columns", "frame table has shape"),
    ("float", "frame table has shape .* dtype float64"),
])
def test_a_bad_frame_table_is_a_named_error(pair: tuple[Path, Path], tmp_path: Path, case: str, match: str) -> None:
    folder = _copy(pair, tmp_path)
    table = np.load(folder / "train-000000.tar.zst.frames.npy")
    if case == "decreasing":
        table[[1, 2]] = table[[2, 1]]
    elif case == "not_zero":
        table[0] = (512, 0)
    elif case == "past_end":
        table[-1, 1] += 10_000_000
    elif case == "one_row":
        table = table[:1]
    elif case == "three_columns":
        table = np.concatenate([table, table[:, :1]], axis=1)
    if case == "float":
        np.save(folder / "train-000000.tar.zst.frames.npy", table.astype(np.float64))
    else:
        _set_table(folder, table)
    with pytest.raises(FrameTableError, match=match) as err:
        IndexedShardDataset(folder, decode=None)[0]
    assert "train-000000.tar.zst.frames.npy" in str(err.value) and err.value.reason == "bad_frames"
    with pytest.raises(FrameTableError, match=match):
        list(ShardDataset(folder, shuffle=True, seed=0, decode=None))


def test_frame_table_limits(pair: tuple[Path, Path]) -> None:
    _, packed = pair
    small = IOOptions(limits=Limits(max_frame_bytes=FRAME_BYTES // 2))
    with pytest.raises(FrameTableError, match="Limits.max_frame_bytes=131072"):
        IndexedShardDataset(packed, decode=None, io=small)[0]
    tight = IOOptions(limits=Limits(max_compression_ratio=1))
    with pytest.raises(FrameTableError, match="Limits.max_compression_ratio=1"):
        IndexedShardDataset(packed, decode=None, io=tight)[0]


def test_a_table_that_misplaces_frames_is_a_named_error(pair: tuple[Path, Path], tmp_path: Path) -> None:
    folder = _copy(pair, tmp_path)
    table = np.load(folder / "train-000000.tar.zst.frames.npy")
    table[1, 1] += 1  # frame 1 said to start a byte later
    _set_table(folder, table)
    ds = IndexedShardDataset(folder, decode=None)
    with pytest.raises(FrameTableError, match="frame 0 does not end where its frame table entry does"):
        ds[0]
    with pytest.raises(FrameTableError, match="frame 1 is not a zstd frame"):
        ds[int(np.searchsorted(np.load(folder / "train-000000.tar.zst.idx.npy"), table[1, 0]))]


@pytest.mark.parametrize("header", ["lies", "no_size"])
def test_a_frame_bomb_is_refused_before_it_is_decompressed(pair: tuple[Path, Path], tmp_path: Path, header: str) -> None:
    folder = _copy(pair, tmp_path)
    shard = folder / "train-000000.tar.zst"
    table = np.load(folder / "train-000000.tar.zst.frames.npy")
    data = shard.read_bytes()
    zeros = b"\0" * (64 << 20)
    if header == "lies":  # 64 MiB of zeros in ~2 KB, its table entry kept at frame 0's real size
        bomb = zstandard.ZstdCompressor().compress(zeros)
    else:  # streamed: no content size in the header
        bomb = zstandard.ZstdCompressor(write_content_size=False).compress(zeros)
    del zeros
    assert len(bomb) < 10_000
    shard.write_bytes(data[: table[0, 1]] + bomb + data[table[1, 1] :])
    table[1:, 1] += len(bomb) - (table[1, 1] - table[0, 1])
    _set_table(folder, table)
    manifest = json.loads((folder / "shardflow.json").read_text())
    manifest["shards"][0]["bytes"] = shard.stat().st_size
    (folder / "shardflow.json").write_text(json.dumps(manifest))
    ds = IndexedShardDataset(folder, decode=None)
    tracemalloc.start()
    try:
        with pytest.raises(FrameTableError, match="frame 0 declares .* its frame table entry") as err:
            ds[0]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20, f"{peak} bytes allocated on the way to the error"
    assert "train-000000.tar.zst" in str(err.value)
    with pytest.raises(FrameTableError):
        list(ShardDataset(folder, shuffle=True, seed=0, decode=None))


def test_frame_table_unit() -> None:
    t = FrameTable(np.array([0, 100, 250, 300]), np.array([0, 40, 90, 120]))
    assert t.size == 300
    assert t.frames_for(0, 100) == (0, 1)
    assert t.frames_for(100, 101) == (1, 2)
    assert t.frames_for(99, 101) == (0, 2)
    assert t.frames_for(250, 300) == (2, 3)
    assert t.frames_for(300, 300) == (2, 3)  # (an empty range at the end: the last frame, never past it)


# ------------------------------------------------------------------ tools


def test_verify_and_inspect(pair: tuple[Path, Path], tmp_path: Path) -> None:
    from shardflow.inspect import summarize, verify

    _, packed = pair
    report = verify(packed, workers=1)
    assert list(report) == [] and report.ok and report.samples == IMAGES
    info = summarize(packed, workers=1)
    assert info["compression"] == {"zstd": 3, "framed": 3}
    folder = _copy(pair, tmp_path)
    table = np.load(folder / "train-000001.tar.zst.frames.npy")
    table[1, 0] -= 512
    _set_table(folder, table, shard=1)
    problems = list(verify(folder, workers=1))
    # read through its table, the shard stops at frame 0: the table is named, and the samples it hid
    assert [p.reason for p in problems] == ["bad_frames", "sample_count"]
    assert problems[0].shard.endswith("train-000001.tar.zst") and "frame 0 declares" in problems[0].message


def test_head_spread_reads_the_same_samples(pair: tuple[Path, Path]) -> None:
    from shardflow.inspect import head

    plain, packed = pair
    got = [(s["__key__"], s["jpg"]) for s in head(str(packed), 9, spread=True)]
    assert got == [(s["__key__"], s["jpg"]) for s in head(str(plain), 9, spread=True)]
    assert [k for k, _ in got] == [_sample(i * IMAGES // 9)["__key__"] for i in range(9)]


def test_cli_convert_compression_zstd(tmp_path: Path) -> None:
    from shardflow.cli import main

    src = tmp_path / "src"
    for i in range(40):
        (src / f"c{i % 2}").mkdir(parents=True, exist_ok=True)
        (src / f"c{i % 2}" / f"{i:04d}.jpg").write_bytes(JPEGS[i])
    assert main(["convert", "imagefolder", str(src), str(tmp_path / "out"), "--compression", "zstd",
                 "--max-count", "25", "--workers", "1"]) == 0
    m = json.loads((tmp_path / "out" / "shardflow.json").read_text())
    assert [(s["url"], s["samples"], s["compression"]) for s in m["shards"]] == [
        ("train-000000.tar.zst", 25, "zstd"), ("train-000001.tar.zst", 15, "zstd")]
    got = {s["__key__"]: s["jpg"] for s in ShardDataset(tmp_path / "out", decode=None)}
    assert got == {f"c{i % 2}/{i:04d}": JPEGS[i] for i in range(40)}


# ------------------------------------------------------------------ remote: only the frames needed cross the link


def test_remote_rank_and_random_access_fetch_only_their_frames(http_server: Any, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    from shardflow.reader import runs

    # remote gaps under REMOTE_SEEK_BYTES (4 MiB of stored bytes) are read through, not seeked over:
    # this shard is smaller, so let rank 1 seek as it would past a larger gap
    monkeypatch.setattr(runs, "REMOTE_SEEK_BYTES", 1)
    srv = http_server
    n = 400
    folder = tmp_path / "one"
    with ShardWriter(str(folder / "one-%06d.tar"), max_count=n, compression="zstd") as w:
        for i in range(n):
            w.write(_sample(i))
    for p in sorted(folder.iterdir()):
        srv.put(p.name, p.read_bytes())
    table = np.load(folder / "one-000000.tar.zst.frames.npy")
    offsets = np.load(folder / "one-000000.tar.zst.idx.npy")
    sidecars = sum((folder / f).stat().st_size for f in ("shardflow.json", "one-000000.tar.zst.idx.npy",
                                                          "one-000000.tar.zst.frames.npy"))
    plain, stored = table[:, 0], table[:, 1]
    mid = int(np.searchsorted(plain, offsets[n // 2], side="right")) - 1

    srv.reset_stats()
    got = _raw(ShardDataset(srv.url, rank=1, world_size=2, decode=None))
    assert got == _raw(ShardDataset(folder, rank=1, world_size=2, decode=None))
    assert [k for k, _, _ in got] == [_sample(i)["__key__"] for i in range(n // 2, n)]
    assert srv.stats.gets_by_path["one-000000.tar.zst"] == 1  # one streaming GET of its frames
    # over the link: the sidecars, plus the frames from the one holding rank 1's first sample on
    assert srv.stats.body_bytes == sidecars + int(stored[-1] - stored[mid])

    ds = IndexedShardDataset(srv.url, decode=None)
    ds[0]  # the sidecars, once
    srv.reset_stats()
    i = n - 3
    f = int(np.searchsorted(plain, offsets[i], side="right")) - 1
    assert ds[i]["jpg"] == JPEGS[i]
    assert srv.stats.gets_by_path == {"one-000000.tar.zst": 1} and srv.stats.body_bytes == stored[f + 1] - stored[f]


# ------------------------------------------------------------------ property: any range, any chunking


@settings(max_examples=40, deadline=None)
@given(sizes=st.lists(st.integers(0, 3 * FRAME_BYTES // 2), min_size=1, max_size=12), data=st.data())
def test_any_tar_range_reads_back_through_the_frames(sizes: list[int], data: Any) -> None:
    from shardflow.format.frames import FrameWriter, framed_chunks, read_framed

    rng = np.random.default_rng(len(sizes))
    w = FrameWriter("mem")
    tar, stored = [], []
    for n in sizes:  # a "sample": random bytes, half of them compressible
        piece = rng.integers(0, 4, n, dtype=np.uint8).tobytes()
        tar.append(piece)
        stored.append(w.add(piece))
        stored.append(w.sample_end())
    stored.append(w.finish())
    plain, blob, table = b"".join(tar), b"".join(stored), w.table
    assert table.size == len(plain) and _unzstd_bytes(blob) == plain
    lo = data.draw(st.integers(0, len(plain)))
    hi = data.draw(st.integers(lo, len(plain)))
    limits = Limits()
    assert read_framed(lambda a, b: blob[a:b], "mem", lo, hi, table, limits) == plain[lo:hi]
    first, stop = table.frames_for(lo, hi)
    part = blob[table.stored[first] : table.stored[stop]]
    cut = sorted(data.draw(st.lists(st.integers(0, len(part)), max_size=6)))
    chunks = [part[a:b] for a, b in zip([0, *cut], [*cut, len(part)]) if b > a]
    assert b"".join(framed_chunks(iter(chunks), "mem", lo, hi, table, limits)) == plain[lo:hi]


def _unzstd_bytes(blob: bytes) -> bytes:
    return zstandard.ZstdDecompressor().stream_reader(io.BytesIO(blob), read_across_frames=True).read()


def test_the_same_samples_give_byte_identical_shards(tmp_path: Path) -> None:
    for run in ("a", "b"):
        with ShardWriter(str(tmp_path / run / "s-%06d.tar"), max_count=200, compression="zstd") as w:
            for i in range(300):
                w.write(_sample(i))
    for name in sorted(p.name for p in (tmp_path / "a").iterdir()):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
