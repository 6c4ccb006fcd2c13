"""``shardflow verify``: sound shards pass; each kind of damage is named by shard, key and reason."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from shardflow import ShardWriter
from shardflow.cli import main
from shardflow.format.manifest import MANIFEST_NAME, encode_offsets
from shardflow.format.tar import END_OF_ARCHIVE, encode_member, iter_members
from shardflow.inspect import verify

N = 10  # samples, in shards of 4: train-000000 (s0000-s0003), -000001 (s0004-s0007), -000002 (s0008, s0009)


def jpeg(i: int) -> bytes:
    rng = np.random.default_rng(i)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(buf, "JPEG")
    return buf.getvalue()


@pytest.fixture
def data(tmp_path: Path) -> Path:
    folder = tmp_path / "data"
    with ShardWriter(str(folder / "train-%06d.tar"), max_count=4) as w:
        for i in range(N):
            w.write({"__key__": f"s{i:04d}", "jpg": jpeg(i), "cls": i % 2})
    return folder


def shard(folder: Path, n: int) -> Path:
    return folder / f"train-{n:06d}.tar"


def members(path: Path) -> list[tuple[str, int, bytes]]:
    return list(iter_members([path.read_bytes()], str(path)))


def rewrite(path: Path, keep: list[tuple[str, int, bytes]]) -> None:
    path.write_bytes(b"".join(encode_member(name, data) for name, _, data in keep) + END_OF_ARCHIVE)


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    rc = main(["verify", *argv])
    return rc, capsys.readouterr().out


def test_sound_dataset_exits_0_with_one_line(data: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out = run(capsys, str(data), "--workers", "1")
    assert rc == 0
    lines = out.strip().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("OK: 3 shards, 10 samples")
    assert "sha256, sizes, sample counts, offset indexes; every field decoded" in lines[0]


def test_flipped_bytes_in_one_sample(data: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = shard(data, 1)
    raw = bytearray(path.read_bytes())
    name, offset, payload = next(m for m in members(path) if m[0] == "s0005.jpg")
    start = offset + 512 + 2  # past the header and the JPEG SOI marker
    raw[start : start + 64] = bytes(b ^ 0xFF for b in raw[start : start + 64])
    path.write_bytes(bytes(raw))
    rc, out = run(capsys, str(data), "--workers", "1")
    assert rc == 1
    assert f"FAIL {path} key 's0005': decode: field 'jpg'" in out
    assert f"FAIL {path}: sha256: sha256 is " in out
    assert "the manifest lists" in out
    assert out.strip().splitlines()[-1].startswith("verify: 2 problems in 1 of 3 shards")
    # structure-only checks still catch the checksum, not the image
    rc, out = run(capsys, str(data), "--no-decode", "--workers", "1")
    assert rc == 1 and "sha256" in out and "decode" not in out.replace("fields not decoded", "")


def test_truncated_shard(data: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = shard(data, 0)
    full = path.read_bytes()
    cut = next(off for name, off, _ in members(path) if name == "s0002.jpg") + 512 + 100
    path.write_bytes(full[:cut])
    rc, out = run(capsys, str(data), "--workers", "1")
    assert rc == 1
    assert f"FAIL {path}: truncated_shard: truncated inside member 's0002.jpg'" in out
    assert "(after sample 's0001')" in out  # members sorted by field: s0002.cls came before
    assert f"FAIL {path}: size: the manifest lists {len(full)} bytes, the shard has {cut}" in out
    assert f"FAIL {path}: sample_count: the manifest lists 4 samples, the shard holds 2" in out
    assert f"{path}: sha256" in out


def test_deleted_field_is_named_by_key(data: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = shard(data, 1)
    rewrite(path, [m for m in members(path) if m[0] != "s0006.cls"])
    rc, out = run(capsys, str(data), "--workers", "1")
    assert rc == 1
    assert f"FAIL {path} key 's0006': missing_field: lacks the field(s) ['cls'] that most samples have" in out
    assert f"FAIL {path}: offset_index: 1 of 4 offset index entries differ" in out  # s0007 moved
    # a dataset whose samples legitimately differ can opt out of the field check
    rc, out = run(capsys, str(data), "--workers", "1", "--mixed-fields")
    assert "missing_field" not in out and "offset_index" in out


def test_deleted_sample_is_a_count_mismatch(data: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = shard(data, 2)
    rewrite(path, [m for m in members(path) if not m[0].startswith("s0009.")])
    rc, out = run(capsys, str(data), "--workers", "1")
    assert rc == 1
    assert f"FAIL {path}: sample_count: the manifest lists 2 samples, the shard holds 1" in out
    assert f"FAIL {path}: size:" in out


def test_wrong_offset_index_and_missing_shard(data: Path, capsys: pytest.CaptureFixture[str]) -> None:
    index = Path(str(shard(data, 0)) + ".idx.npy")
    offsets = np.load(index)
    offsets[2] += 512
    index.write_bytes(encode_offsets(offsets))
    os.remove(shard(data, 2))
    rc, out = run(capsys, str(data), "--workers", "1")
    assert rc == 1
    assert f"FAIL {shard(data, 0)}: offset_index: 1 of 4 offset index entries differ from the sample offsets; " \
           f"the first is entry 2: index says byte {offsets[2]}, sample 2 starts at byte {offsets[2] - 512}" in out
    assert f"FAIL {shard(data, 2)}: missing_shard: the shard does not exist" in out


def test_json_report_and_workers_agree(data: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = shard(data, 2)
    raw = bytearray(path.read_bytes())
    raw[700] ^= 0xFF
    path.write_bytes(bytes(raw))
    rc, out = run(capsys, str(data), "--json", "--workers", "2")
    assert rc == 1
    report = json.loads(out)
    assert report["ok"] is False and report["shards"] == 3 and report["samples"] == N
    assert {p["reason"] for p in report["problems"]} >= {"sha256"}
    assert all(p["shard"] == str(path) for p in report["problems"])
    serial = verify(data, workers=1)
    assert [p.to_json() for p in serial] == report["problems"]


def test_no_manifest_checks_structure_and_decoding(data: Path, capsys: pytest.CaptureFixture[str]) -> None:
    os.remove(data / MANIFEST_NAME)
    rc, out = run(capsys, str(data), "--workers", "1")
    assert rc == 0
    assert "10 samples" in out and "no manifest: structure only" in out


def test_progress_reaches_the_callback(data: Path) -> None:
    seen: list[int] = []
    report = verify(data, workers=2, progress=seen.append)
    assert report.ok and report.samples == N
    assert sum(seen) == N


def test_remote_dataset(capsys: pytest.CaptureFixture[str], request: pytest.FixtureRequest) -> None:
    import fsspec

    root = f"memory://verify-{request.node.name}"
    with ShardWriter(f"{root}/train-%06d.tar", max_count=3) as w:
        for i in range(5):
            w.write({"__key__": f"r{i}", "jpg": jpeg(i), "cls": i})
    fs = fsspec.filesystem("memory")
    try:
        rc, out = run(capsys, root, "--workers", "1")
        assert rc == 0 and out.startswith("OK: 2 shards, 5 samples")
        path = f"{root}/train-000001.tar"
        data = bytearray(fs.cat(path))
        data[512 + 512 + 400] ^= 0xFF  # inside r3.jpg (members: r3.cls, r3.jpg, ...)
        fs.pipe(path, bytes(data))
        rc, out = run(capsys, root, "--workers", "1")
        assert rc == 1
        assert f"FAIL {path}: sha256" in out
    finally:
        fs.rm(root.split("://", 1)[1], recursive=True)


def test_verify_a_mixture_config_with_per_source_options(moto_server, s3_prefix, s3_options, tmp_path,
                                                          monkeypatch, capsys):
    from tests.test_cli_inspect import mixture_config

    cfg = mixture_config(tmp_path, s3_prefix, s3_options, monkeypatch)
    assert main(["verify", str(cfg), "--workers", "1"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("OK: 5 shards, 17 samples")
