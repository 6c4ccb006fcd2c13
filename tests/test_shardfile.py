"""One shard being written: its bytes through the write buffer, its sha256 and index, and
when its files are fsynced and renamed (the crash-safety order)."""

from __future__ import annotations

import hashlib
import os
import stat
import tarfile

import numpy as np
import pytest

from shardflow import storage
from shardflow.writing import shardfile
from shardflow.errors import SampleError
from shardflow.format.tar import END_OF_ARCHIVE, encode_sample, iter_samples
from shardflow.writing.shardfile import ShardFile

SAMPLES = [(f"s{i:03d}", {"cls": b"%d" % i, "jpg": bytes([i]) * (i * 37 % 1500)}) for i in range(40)]
SAMPLES[17] = ("big", {"a": b"x" * 5, "bin": b"\x07" * 5000, "cls": b"17"})  # a payload over the chunk


@pytest.mark.parametrize("chunk", [700, 1 << 20])
def test_bytes_sha_and_offsets_through_the_write_buffer(tmp_path, monkeypatch, chunk):
    monkeypatch.setattr(shardfile, "WRITE_CHUNK", chunk)
    hints: list[tuple[int, int]] = []
    real = storage.start_writeback
    monkeypatch.setattr(storage, "start_writeback", lambda f, off, n: (hints.append((off, n)), real(f, off, n)))
    url = str(tmp_path / "train-000000.tar")
    with ShardFile(url, url + ".idx.npy") as shard:
        sizes = [shard.write(k, f) for k, f in SAMPLES]
    encoded = [encode_sample(k, dict(f)) for k, f in SAMPLES]
    data = open(url, "rb").read()
    assert data == b"".join(encoded) + END_OF_ARCHIVE
    assert sizes == [len(e) for e in encoded]
    assert shard.info.bytes == len(data) and shard.info.sha256 == hashlib.sha256(data).hexdigest()
    starts = np.cumsum([0] + sizes).tolist()
    assert np.load(url + ".idx.npy").tolist() == starts
    read = [(k, off, f) for k, off, f in iter_samples([data], url)]
    assert read == [(k, start, dict(f)) for (k, f), start in zip(SAMPLES, starts)]
    # every byte went through one writeback hint, in order (the last one's fsync waits for little)
    assert [off for off, _ in hints] == np.cumsum([0] + [n for _, n in hints])[:-1].tolist()
    assert sum(n for _, n in hints) == len(data)
    assert len(hints) > (2 if chunk == 700 else 0)


def test_an_error_mid_shard_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(shardfile, "WRITE_CHUNK", 700)
    url = str(tmp_path / "train-000000.tar")
    with pytest.raises(SampleError, match="written twice"):
        with ShardFile(url, url + ".idx.npy") as shard:
            for k, f in SAMPLES:
                shard.write(k, f)
            shard.write(*SAMPLES[0])
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("sync_dir", [True, False])
def test_files_are_fsynced_before_their_rename_and_the_folder_once(tmp_path, monkeypatch, sync_dir):
    events: list[tuple[str, str]] = []
    fsync, replace = os.fsync, os.replace

    def record_fsync(fd):
        st = os.fstat(fd)
        events.append(("fsync dir", "") if stat.S_ISDIR(st.st_mode) else ("fsync", str(st.st_ino)))
        fsync(fd)

    def record_replace(src, dst):
        events.append(("rename", str(os.stat(src).st_ino)))
        replace(src, dst)

    monkeypatch.setattr(os, "fsync", record_fsync)
    monkeypatch.setattr(os, "replace", record_replace)
    url = str(tmp_path / "train-000000.tar")
    with ShardFile(url, url + ".idx.npy", sync_dir=sync_dir) as shard:
        shard.write(*SAMPLES[0])
        shard.write("g", {"pyg": b"graph"}, sizes=(3, 4))
    files = [e for e in events if e[0] != "fsync dir"]
    assert [e[0] for e in files] == ["fsync", "rename"] * 3  # shard, offsets, sizes: each durable, then named
    assert all(files[i][1] == files[i + 1][1] for i in range(0, 6, 2))
    assert events.count(("fsync dir", "")) == (1 if sync_dir else 0)
    if sync_dir:
        assert events[-1] == ("fsync dir", "")
    assert sorted(os.listdir(tmp_path)) == ["train-000000.tar", "train-000000.tar.idx.npy", "train-000000.tar.sizes.npy"]


def test_writeback_hint_on_a_real_file_is_harmless(tmp_path):
    path = tmp_path / "f"
    with open(path, "wb") as f:
        f.write(b"a" * 10000)
        storage.start_writeback(f, 0, 10000)
        storage.start_writeback(f, 10000, 0)
        f.write(b"b")
    assert path.read_bytes() == b"a" * 10000 + b"b"


def test_a_sample_that_cannot_be_encoded_changes_nothing(tmp_path):
    """A failed write leaves the shard, its offset and sizes indexes and its keys as they were:
    the key can be written again and every index row belongs to a sample of the shard."""
    url = str(tmp_path / "s.tar")
    with ShardFile(url, url + ".idx.npy") as f:
        f.write("a", {"x": b"1"}, sizes=(1, 2))
        with pytest.raises(TypeError):
            f.write("b", {"x": 123}, sizes=(3, 4))  # not bytes
        f.write("b", {"x": b"2"}, sizes=(5, 6))
    assert f.info.samples == 2
    assert np.load(url + ".sizes.npy").tolist() == [[1, 2], [5, 6]]
    with tarfile.open(url) as tar:
        assert [(m.name, tar.extractfile(m).read()) for m in tar] == [("a.x", b"1"), ("b.x", b"2")]


def test_a_staged_shard_appears_only_when_committed_each_file_fsynced_first(tmp_path, monkeypatch):
    url = str(tmp_path / "train-000000.tar")
    with ShardFile(url, url + ".idx.npy", staged=True) as shard:
        shard.write(*SAMPLES[0])
        shard.write("g", {"pyg": b"graph"}, sizes=(3, 4))
    finals = [final for _, final in shard.staged]
    assert finals == [url, url + ".idx.npy", url + ".sizes.npy"]
    assert not any(os.path.exists(f) for f in finals) and all(os.path.exists(t) for t, _ in shard.staged)
    synced: list[int] = []
    fsync, replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.fstat(fd).st_ino), fsync(fd)))
    monkeypatch.setattr(os, "replace", lambda a, b: (assert_synced(a), replace(a, b)))

    def assert_synced(path):
        assert os.stat(path).st_ino in synced  # durable before it has its name

    for tmp, final in shard.staged:
        storage.commit_staged(tmp, final)
    data = open(url, "rb").read()
    assert data == encode_sample(*SAMPLES[0]) + encode_sample("g", {"pyg": b"graph"}) + END_OF_ARCHIVE
    assert shard.info.sha256 == hashlib.sha256(data).hexdigest()
    assert sorted(os.listdir(tmp_path)) == ["train-000000.tar", "train-000000.tar.idx.npy", "train-000000.tar.sizes.npy"]


def test_a_failed_staged_shard_leaves_nothing(tmp_path):
    url = str(tmp_path / "train-000000.tar")
    with pytest.raises(SampleError):
        with ShardFile(url, url + ".idx.npy", staged=True) as shard:
            shard.write(*SAMPLES[0])
            shard.write(*SAMPLES[0])
    assert os.listdir(tmp_path) == [] and shard.staged == []
