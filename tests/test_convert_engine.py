"""The shared conversion engine: leftovers of a crashed run, progress manifest."""

import os

from shardflow.convert.engine.engine import ConvertOptions, run_conversion
from shardflow.format.manifest import Manifest


def build(descriptors, context):
    for i in descriptors:
        yield f"{i:06d}", {"txt": str(i).encode()}


def failing(descriptors, context):
    for i in descriptors:
        if i == 17:
            raise ValueError("input 17 is bad")
        yield f"{i:06d}", {"txt": str(i).encode()}


def test_temporaries_of_a_crashed_run_are_removed(tmp_path):
    stale = tmp_path / ".train-000003.tar.1a2b3c.tmp"
    stale.write_bytes(b"half a shard")
    other = tmp_path / ".notes.tmp"
    other.write_bytes(b"not ours")
    m = run_conversion(str(tmp_path), range(25), build, options=ConvertOptions(max_count=10, workers=1))
    assert [s.samples for s in m.shards] == [10, 10, 5]
    assert not stale.exists() and other.exists()
    assert sorted(p for p in os.listdir(tmp_path) if p.endswith(".tar")) == [f"train-00000{i}.tar" for i in range(3)]
    again = Manifest.loads((tmp_path / "shardflow.json").read_bytes())
    assert again.meta["conversion"]["complete"] is True


def test_shard_renames_are_durable_before_a_record_lists_them(tmp_path, monkeypatch):
    # tasks stage their shards; this process fsyncs each file, renames it, and fsyncs the
    # folder before each record (state, then manifest) it writes: once per record, not per
    # shard. Every shard a record lists was renamed before a folder fsync that precedes it.
    import json
    import stat

    events = []
    fsync, replace = os.fsync, os.replace

    def record_fsync(fd):
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            events.append(("fsync dir", None))
        fsync(fd)

    def record_replace(src, dst):
        name = os.path.basename(dst)
        if name == ".shardflow-convert.json":
            listed = [n for g in json.loads(open(src).read())["groups"].values() for n in g["shards"]]
            events.append(("record", listed))
        else:
            events.append(("rename", name))
        replace(src, dst)

    monkeypatch.setattr(os, "fsync", record_fsync)
    monkeypatch.setattr(os, "replace", record_replace)
    m = run_conversion(str(tmp_path / "d"), range(25), build, options=ConvertOptions(max_count=2, workers=1))
    assert len(m.shards) == 13
    records = [i for i, (kind, _) in enumerate(events) if kind == "record"]
    assert records
    for r in records:
        for name in events[r][1]:
            renamed = events.index(("rename", name))
            assert ("fsync dir", None) in events[renamed:r], name
    assert sum(kind == "fsync dir" for kind, _ in events) <= 3 * len(records)
    assert not [n for n in os.listdir(tmp_path / "d") if n.endswith(".tmp")]


def test_a_failed_conversion_leaves_no_staged_shard(tmp_path):
    import pytest

    from shardflow.errors import ConversionError
    from shardflow.format.manifest import Manifest as M

    with pytest.raises(ConversionError, match="input 17 is bad"):
        run_conversion(str(tmp_path), range(25), failing, options=ConvertOptions(max_count=2, workers=2))
    names = os.listdir(tmp_path)
    assert not [n for n in names if n.endswith(".tmp")]
    finished = M.loads((tmp_path / "shardflow.json").read_bytes())
    assert all((tmp_path / s.url).stat().st_size == s.bytes for s in finished.shards)
    assert "train-000008.tar" not in names
