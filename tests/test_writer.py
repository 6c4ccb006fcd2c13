"""Tests for shardflow.writing.writer: the manifest written once at close, the journal of
finished shards (replayed when a writer never closed), no torch for bytes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import shardflow
from shardflow.errors import ManifestError
from shardflow.format.journal import manifest_from_journal
from shardflow.format.manifest import JOURNAL_SUFFIX, MANIFEST_NAME, Manifest
from shardflow.sources.listed import IncompleteDatasetError

pytestmark = pytest.mark.timeout(120)


def sample(i: int) -> dict:
    return {"__key__": f"k{i:04d}", "bin": bytes([i % 256]) * 100, "cls": i % 3}


def journal_lines(folder: Path) -> list[dict]:
    """The header and the shard entries (each entry's commit line checked and left out)."""
    lines = [json.loads(line) for line in (folder / (MANIFEST_NAME + JOURNAL_SUFFIX)).read_bytes().splitlines()]
    out = lines[:1]
    for line in lines[1:]:
        if "shard" in line:
            out.append(line)
        else:
            assert line == {"committed": out[-1]["shard"]["url"]}
    return out


def test_manifest_written_once_at_close_journal_meanwhile(tmp_path: Path) -> None:
    sink = shardflow.ShardWriter(str(tmp_path / "t-%06d.tar"), max_count=10, meta={"source": "x"})
    for i in range(35):
        sink.write(sample(i))
    assert not (tmp_path / MANIFEST_NAME).exists()
    lines = journal_lines(tmp_path)
    assert lines[0] == {"format": "shardflow-journal", "version": 1, "meta": {"source": "x"}, "commits": True}
    assert [(e["shard"]["url"], e["shard"]["samples"]) for e in lines[1:]] == [
        ("t-000000.tar", 10), ("t-000001.tar", 10), ("t-000002.tar", 10)]
    assert all(e["fields"] == {"bin": "bin", "cls": "cls"} and "meta" not in e for e in lines[1:])
    # a reader meanwhile is refused (the writer holds the folder: issue 32); asked for the finished
    # part on purpose, it replays the journal: the three complete shards
    with pytest.raises(IncompleteDatasetError, match="a writer"):
        shardflow.ShardDataset(str(tmp_path), decode=None)
    ds = shardflow.ShardDataset(str(tmp_path), decode=None, io=shardflow.IOOptions(allow_incomplete=True))
    assert len(ds) == 30 and [s["__key__"] for s in ds] == [f"k{i:04d}" for i in range(30)]
    manifest = sink.close()
    assert not (tmp_path / (MANIFEST_NAME + JOURNAL_SUFFIX)).exists()
    on_disk = Manifest.loads((tmp_path / MANIFEST_NAME).read_bytes())
    assert [s.samples for s in on_disk.shards] == [10, 10, 10, 5] == [s.samples for s in manifest.shards]
    assert on_disk.meta == {"source": "x"} and on_disk.fields == {"bin": "bin", "cls": "cls"}
    assert len(shardflow.ShardDataset(str(tmp_path))) == 35


def test_journal_equals_manifest_and_records_meta_changes(tmp_path: Path) -> None:
    sink = shardflow.ShardWriter(str(tmp_path / "t-%06d.tar"), max_count=2, meta={"n": 0})
    for i in range(5):
        sink.write(sample(i))
        sink.manifest.meta["n"] = i // 2  # changes after shards 0 (n=0: unchanged) and 1 (n=1)
    replayed = manifest_from_journal((tmp_path / (MANIFEST_NAME + JOURNAL_SUFFIX)).read_bytes(), "m")
    lines = journal_lines(tmp_path)
    assert ["meta" in e for e in lines[1:]] == [False, True]
    assert replayed.meta == {"n": 1}
    final = sink.close()
    assert [s.to_json() for s in replayed.shards] == [s.to_json() for s in final.shards[:2]]


def test_torn_last_journal_line_is_ignored_bad_header_raises(tmp_path: Path) -> None:
    sink = shardflow.ShardWriter(str(tmp_path / "t-%06d.tar"), max_count=2)
    for i in range(5):
        sink.write(sample(i))
    data = (tmp_path / (MANIFEST_NAME + JOURNAL_SUFFIX)).read_bytes()
    assert [s.url for s in manifest_from_journal(data, "m").shards] == ["t-000000.tar", "t-000001.tar"]
    assert [s.url for s in manifest_from_journal(data[:-7], "m").shards] == ["t-000000.tar"]
    with pytest.raises(ManifestError, match="line 2 is not a journal entry"):
        manifest_from_journal(data.replace(b'{"shard"', b'{"shar"', 1), "m")
    with pytest.raises(ManifestError, match="not a shardflow writer journal"):
        manifest_from_journal(b'{"format": "shardflow"}\n', "m")
    sink.abort()


def test_stale_manifest_dropped_when_the_first_shard_starts(tmp_path: Path) -> None:
    with shardflow.ShardWriter(str(tmp_path / "t-%06d.tar"), max_count=2) as sink:
        for i in range(6):
            sink.write(sample(i))
    sink = shardflow.ShardWriter(str(tmp_path / "t-%06d.tar"), max_count=2)
    assert (tmp_path / MANIFEST_NAME).exists()  # nothing written yet: the old manifest stays
    sink.write(sample(100))
    assert not (tmp_path / MANIFEST_NAME).exists()  # its shards are being replaced
    sink.close()
    assert [s.samples for s in Manifest.loads((tmp_path / MANIFEST_NAME).read_bytes()).shards] == [1]


def test_abort_writes_the_manifest_of_finished_shards(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError):
        with shardflow.ShardWriter(str(tmp_path / "t-%06d.tar"), max_count=4) as sink:
            for i in range(10):
                sink.write(sample(i))
            raise RuntimeError("boom")
    manifest = Manifest.loads((tmp_path / MANIFEST_NAME).read_bytes())
    assert [s.samples for s in manifest.shards] == [4, 4]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        MANIFEST_NAME, "t-000000.tar", "t-000000.tar.idx.npy", "t-000001.tar", "t-000001.tar.idx.npy"]


def test_memory_destination_gets_manifest_at_close_and_no_journal() -> None:
    import fsspec

    fs = fsspec.filesystem("memory")
    with shardflow.ShardWriter("memory://wjournal/t-%06d.tar", max_count=3) as sink:
        for i in range(7):
            sink.write(sample(i))
        assert not fs.exists("/wjournal/" + MANIFEST_NAME)
        assert not fs.exists("/wjournal/" + MANIFEST_NAME + JOURNAL_SUFFIX)
    assert len(shardflow.ShardDataset("memory://wjournal")) == 7
    fs.rm("/wjournal", recursive=True)


def test_bytes_only_writer_does_not_import_torch(tmp_path: Path) -> None:
    script = (
        "import sys, numpy as np, shardflow\n"
        f"with shardflow.ShardWriter({str(tmp_path / 't-%06d.tar')!r}, max_count=5) as w:\n"
        "    for i in range(12):\n"
        "        w.write({'__key__': f'k{i}', 'jpg': b'x' * 10, 'cls': i, 'txt': 'a', 'json': {'i': i},\n"
        "                 'npy': np.zeros(3)})\n"
        "print('torch' in sys.modules, 'torch_geometric' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.split() == ["False", "False"]
    assert len(shardflow.ShardDataset(str(tmp_path))) == 12


def test_writer_and_indexer_take_io_like_the_datasets(tmp_path: Path) -> None:
    """One name for the IO options object: ``io=`` (an IOOptions) or the
    ``storage_options=`` shortcut, on the writer and the indexer as on the datasets."""
    from shardflow.writing.indexing import index_shards

    # trust_manifest_urls: the manifest in idx/ lists the shards of d/ by absolute path
    io = shardflow.IOOptions(cache_dir=str(tmp_path / "uploads"), trust_manifest_urls=True)
    with shardflow.ShardWriter(str(tmp_path / "d" / "s-%06d.tar"), max_count=3, io=io) as w:
        for i in range(5):
            w.write({"__key__": f"{i:03d}", "cls": i})
    assert w.io is io
    urls = [str(tmp_path / "d" / f"s-{i:06d}.tar") for i in range(2)]
    manifest = index_shards(urls, out=str(tmp_path / "idx"), io=io)
    assert [s.samples for s in manifest.shards] == [3, 2]
    assert [int(s["cls"]) for s in shardflow.ShardDataset(str(tmp_path / "idx"), decode=None, io=io)] == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match="not both"):
        shardflow.ShardWriter(str(tmp_path / "e-%06d.tar"), io=io, storage_options={"anon": True})
    with pytest.raises(ValueError, match="not both"):
        index_shards(urls, out=str(tmp_path / "idx2"), io=io, storage_options={"anon": True})
