"""Hostile inputs against the features that landed on 2026-12-01 (reviewer's reproducers).

Each test is a bug found by attacking the new code; the reference is the data
written (the keys and bytes given to the writer), never the code under test.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from shardflow import IndexedShardDataset, ShardDataset, ShardWriter
from shardflow.errors import ManifestError


def _write(folder: Path, n: int, per: int, seed: int = 0, **kw: object) -> list[bytes]:
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    blobs = [rng.bytes(20_000) for _ in range(n)]
    with ShardWriter(str(folder / "s-%06d.tar"), max_count=per, **kw) as sink:
        for i, blob in enumerate(blobs):
            sink.write({"__key__": f"{i:06d}", "bin": blob})
    return blobs


def test_random_access_refuses_a_shard_replaced_by_a_longer_one(tmp_path: Path) -> None:
    """Shard 1 (30 samples, keys 30-59) replaced behind the manifest by a 32-sample shard
    (keys 32-63): sample 45 must not silently come back as key 000047 (the streaming reader
    already refuses the longer shard with ManifestError reason changed_shard)."""
    _write(tmp_path / "a", 60, 30)
    _write(tmp_path / "b", 64, 32)
    listed = (tmp_path / "a" / "s-000001.tar").stat().st_size  # 30 x (512 + 20,480) + 1,024 = 630,784
    shutil.copy(tmp_path / "b" / "s-000001.tar", tmp_path / "a" / "s-000001.tar")
    assert listed == 630_784 and (tmp_path / "a" / "s-000001.tar").stat().st_size == 672_768
    with pytest.raises(ManifestError, match=r"s-000001\.tar: the shard has 672768 bytes but the manifest lists 630784"):
        list(ShardDataset(str(tmp_path / "a"), decode=None))
    ds = IndexedShardDataset(str(tmp_path / "a"), decode=None)
    assert ds[29]["__key__"] == "000029"  # shard 0 is intact
    with pytest.raises(ManifestError, match=r"s-000001\.tar: the shard has 672768 bytes") as info:
        ds[45]
    assert info.value.reason == "changed_shard"
