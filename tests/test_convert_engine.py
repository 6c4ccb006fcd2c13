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
