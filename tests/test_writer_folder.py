"""Several writers in one folder: nothing a writer finished is dropped by the next one.

``ShardWriter`` keeps the shards the folder's manifest lists (``train-*`` then ``val-*``,
webdataset's usual one-folder layout), except the earlier shards of its own series; a
crashed writer's journal is replayed into the manifest before anything else; a
conversion refuses, naming the shards, rather than mixing or dropping. Read back
against the stdlib ``tarfile`` reader."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

import shardflow
from shardflow.errors import DestinationExistsError, ManifestError
from shardflow.format.manifest import JOURNAL_SUFFIX, MANIFEST_NAME, Manifest

pytestmark = pytest.mark.timeout(120)


def sample(prefix: str, i: int) -> dict:
    return {"__key__": f"{prefix}{i:04d}", "bin": f"{prefix}{i}".encode() * 10, "cls": i % 3}


def write(folder: Path, prefix: str, n: int, max_count: int = 10, **kw) -> shardflow.Manifest:
    with shardflow.ShardWriter(str(folder / f"{prefix}-%06d.tar"), max_count=max_count, **kw) as sink:
        for i in range(n):
            sink.write(sample(prefix, i))
    return sink.manifest


def tar_keys(*paths: Path) -> list[str]:
    """Sample keys of tar files as the stdlib reads them (members of a key adjacent)."""
    out: list[str] = []
    for p in paths:
        with tarfile.open(p) as tf:
            for m in tf.getmembers():
                key = m.name.split(".", 1)[0]
                if not out or out[-1] != key:
                    out.append(key)
    return out


def read_keys(source) -> list[str]:
    return [s["__key__"] for s in shardflow.ShardDataset(str(source), decode=None)]


def test_train_then_val_in_one_folder_both_kept(tmp_path: Path) -> None:
    write(tmp_path, "train", 30)
    manifest = write(tmp_path, "val", 5)
    on_disk = Manifest.loads((tmp_path / MANIFEST_NAME).read_bytes())
    assert [s.url for s in on_disk.shards] == [
        "train-000000.tar", "train-000001.tar", "train-000002.tar", "val-000000.tar"] == [s.url for s in manifest.shards]
    expected = [f"train{i:04d}" for i in range(30)] + [f"val{i:04d}" for i in range(5)]
    assert tar_keys(*sorted(tmp_path.glob("*.tar"))) == expected
    assert read_keys(tmp_path) == expected  # the folder: every shard, train then val, once
    ds = shardflow.ShardDataset(str(tmp_path), decode=None)
    assert len(ds) == 35
    train = shardflow.ShardDataset(str(tmp_path / "train-{000000..000002}.tar"), decode=None)
    val = shardflow.ShardDataset(str(tmp_path / "val-000000.tar"), decode=None)
    assert len(train) == 30 and len(val) == 5  # each brace pattern still sized by the manifest
    assert [s["__key__"] for s in train] == expected[:30] and [s["__key__"] for s in val] == expected[30:]


def test_rerun_of_a_series_replaces_it_and_keeps_the_others(tmp_path: Path, caplog) -> None:
    write(tmp_path, "train", 30)
    write(tmp_path, "val", 5)
    with caplog.at_level(logging.INFO, logger="shardflow.writing.writer"):
        write(tmp_path, "train", 12)  # the train series again, shorter: replaced as a whole
    assert [s.url for s in Manifest.loads((tmp_path / MANIFEST_NAME).read_bytes()).shards] == [
        "val-000000.tar", "train-000000.tar", "train-000001.tar"]
    assert not (tmp_path / "train-000002.tar").exists()  # the earlier run's last shard: removed, named
    assert "removing 1 shard(s) of an earlier run of this series" in caplog.text and "train-000002.tar" in caplog.text
    assert sorted(read_keys(tmp_path)) == sorted([f"train{i:04d}" for i in range(12)] + [f"val{i:04d}" for i in range(5)])


def test_start_shard_appends_to_a_series(tmp_path: Path) -> None:
    write(tmp_path, "train", 20)
    with shardflow.ShardWriter(str(tmp_path / "train-%06d.tar"), max_count=10, start_shard=2) as sink:
        for i in range(20, 25):
            sink.write(sample("train", i))
    assert [s.url for s in sink.manifest.shards] == ["train-000000.tar", "train-000001.tar", "train-000002.tar"]
    assert read_keys(tmp_path) == [f"train{i:04d}" for i in range(25)]


def test_overwrite_starts_a_new_manifest(tmp_path: Path) -> None:
    write(tmp_path, "train", 30)
    write(tmp_path, "val", 5, overwrite=True)
    assert [s.url for s in Manifest.loads((tmp_path / MANIFEST_NAME).read_bytes()).shards] == ["val-000000.tar"]


def test_an_unreadable_manifest_is_refused_not_dropped(tmp_path: Path) -> None:
    write(tmp_path, "train", 30)
    (tmp_path / MANIFEST_NAME).write_text("{not json")
    with pytest.raises(ManifestError, match=r"overwrite=True"):
        write(tmp_path, "val", 5)
    assert (tmp_path / MANIFEST_NAME).read_text() == "{not json"


CHILD = """
import os, signal, sys
import shardflow
folder, prefix, n, max_count = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
sink = shardflow.ShardWriter(os.path.join(folder, prefix + "-%06d.tar"), max_count=max_count)
for i in range(n):
    sink.write({"__key__": f"{prefix}{i:04d}", "bin": f"{prefix}{i}".encode() * 10, "cls": i % 3})
os.kill(os.getpid(), signal.SIGKILL)
"""


def killed_writer(folder: Path, prefix: str, n: int, max_count: int) -> None:
    """A ShardWriter in a subprocess that writes ``n`` samples and is SIGKILLed (never closes)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run([sys.executable, "-c", CHILD, str(folder), prefix, str(n), str(max_count)],
                          env=env, capture_output=True, timeout=60)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()


@pytest.mark.parametrize("second", ["val", "train2"])
def test_writer_after_a_killed_writer_keeps_its_shards(tmp_path: Path, second: str) -> None:
    # 36 samples, 5 per shard: the 36th write finished shard 6 (samples 30-34), 35 then were
    # complete; the shard holding sample 35 was in progress and is lost with the process
    killed_writer(tmp_path, "train", 36, 5)
    assert (tmp_path / (MANIFEST_NAME + JOURNAL_SUFFIX)).exists() and not (tmp_path / MANIFEST_NAME).exists()
    assert len(shardflow.ShardDataset(str(tmp_path), decode=None)) == 35  # a reader replays the journal
    write(tmp_path, second, 1)
    assert not (tmp_path / (MANIFEST_NAME + JOURNAL_SUFFIX)).exists()
    expected = [f"train{i:04d}" for i in range(35)] + [f"{second}0000"]
    assert read_keys(tmp_path) == expected
    assert len(shardflow.ShardDataset(str(tmp_path), decode=None)) == 36
    assert tar_keys(*sorted(tmp_path.glob("train-*.tar")), tmp_path / f"{second}-000000.tar") == expected


def test_same_series_after_a_killed_writer_is_a_rerun(tmp_path: Path, caplog) -> None:
    killed_writer(tmp_path, "train", 36, 5)
    with caplog.at_level(logging.WARNING):
        write(tmp_path, "train", 1)  # the job restarted: its series replaced, the replay and removal named
    assert "replayed the journal of an interrupted writer into the manifest (7 shards, 35 samples)" in caplog.text
    assert "removing 6 shard(s) of an earlier run of this series" in caplog.text
    assert read_keys(tmp_path) == ["train0000"]
    assert sorted(p.name for p in tmp_path.glob("*.tar")) == ["train-000000.tar"]


def build(i: int) -> dict:
    return {"__key__": f"c{i:04d}", "bin": b"x" * (i % 7 + 1)}


def test_conversion_refuses_a_writer_folder_naming_its_shards(tmp_path: Path) -> None:
    write(tmp_path, "train", 30)
    with pytest.raises(DestinationExistsError, match=r"train-000000.tar, train-000001.tar, train-000002.tar.*overwrite=True"):
        shardflow.write_shards(build, range(10), str(tmp_path), max_count=5, prefix="conv", workers=1)
    assert read_keys(tmp_path) == [f"train{i:04d}" for i in range(30)]


def test_conversion_replays_a_crashed_writer_journal_first(tmp_path: Path) -> None:
    killed_writer(tmp_path, "train", 36, 5)
    with pytest.raises(DestinationExistsError, match=r"train-000000.tar.*and 3 more"):
        shardflow.write_shards(build, range(10), str(tmp_path), max_count=5, prefix="conv", workers=1)
    assert not (tmp_path / (MANIFEST_NAME + JOURNAL_SUFFIX)).exists()
    assert len(Manifest.loads((tmp_path / MANIFEST_NAME).read_bytes()).shards) == 7


def test_writer_into_a_conversion_keeps_it_and_the_conversion_then_refuses(tmp_path: Path) -> None:
    shardflow.write_shards(build, range(12), str(tmp_path), max_count=5, workers=1)
    write(tmp_path, "val", 5)
    assert read_keys(tmp_path) == [f"c{i:04d}" for i in range(12)] + [f"val{i:04d}" for i in range(5)]
    with pytest.raises(DestinationExistsError, match=r"1 shard\(s\) of another writer \(val-000000.tar\)"):
        shardflow.write_shards(build, range(12), str(tmp_path), max_count=5, workers=1)  # resume would drop val
    shardflow.write_shards(build, range(12), str(tmp_path), max_count=5, workers=1, overwrite=True)
    assert read_keys(tmp_path) == [f"c{i:04d}" for i in range(12)]
