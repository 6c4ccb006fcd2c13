"""The shared conversion engine: leftovers of a crashed run, progress manifest."""

import os

from shardflow.convert.engine import ConvertOptions, run_conversion
from shardflow.format.manifest import Manifest


def build(descriptors, context):
    for i in descriptors:
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
    # tasks fsync each shard file before renaming it, and leave the folder's fsync to the
    # engine, which does it before each record (state, then manifest) it writes: once per
    # record, not once per shard
    import stat

    events = []
    fsync, replace = os.fsync, os.replace

    def record_fsync(fd):
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            events.append("fsync dir")
        fsync(fd)

    def record_replace(src, dst):
        name = os.path.basename(dst)
        events.append("record" if name == ".shardflow-convert.json" else "shard" if name.endswith(".tar") else "other")
        replace(src, dst)

    monkeypatch.setattr(os, "fsync", record_fsync)
    monkeypatch.setattr(os, "replace", record_replace)
    m = run_conversion(str(tmp_path / "d"), range(25), build, options=ConvertOptions(max_count=2, workers=1))
    assert len(m.shards) == 13 and events.count("shard") == 13
    records = [i for i, e in enumerate(events) if e == "record"]
    assert records
    for r in records:
        last_shard = max(i for i, e in enumerate(events[:r]) if e == "shard")
        assert "fsync dir" in events[last_shard:r]
    assert events.count("fsync dir") <= 3 * len(records)
