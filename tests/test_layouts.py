"""Checked layouts kept between passes (format/layouts.py): a second pass over an unchanged shard
takes them; a shard changed in place, replaced or damaged is checked again."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import numpy as np
import pytest

import shardflow
from shardflow import fastpath
from shardflow.errors import ShardFormatError
from shardflow.format import layouts
from tests.helpers import make_shards, shard_urls


@pytest.fixture
def settled(monkeypatch: pytest.MonkeyPatch):
    """Shards count as settled as soon as they are written (by default a shard's ctime must be
    2 s old before its layout is kept, see layouts.SETTLED_NS); the bulk walk on (the layouts are
    its own: SHARDFLOW_FAST_PATHS=0 turns both off)."""
    monkeypatch.setattr(layouts, "SETTLED_NS", 0)
    before = fastpath.enabled()
    fastpath.set_enabled(True)
    layouts.clear()
    yield
    layouts.clear()
    fastpath.set_enabled(before)


def _fields(field: str, fill: int):
    """Sample ``i``'s payload field: the same length for any ``field`` name of 3 letters and ``fill``."""
    return lambda i: {field: bytes([(i * 7 + fill) % 256]) * (200 + i % 5)}


def _read(folder: Path) -> list[dict]:
    return list(shardflow.ShardDataset(str(folder), decode=None))


def _ctime_moved(path: str, before: os.stat_result) -> None:
    """Wait until ``path``'s ctime differs from ``before``'s: a filesystem clock coarser than two
    writes in a row gives both the same (that case is what layouts.SETTLED_NS is for)."""
    while os.stat(path).st_ctime_ns == before.st_ctime_ns:
        time.sleep(0.01)
        os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))  # mtime as it was, as `cp -p` leaves it


def test_second_pass_takes_the_kept_layouts(tmp_path, settled):
    folder = make_shards(tmp_path, [300, 200], _fields("bin", 0))
    first = _read(folder)
    assert layouts.held() == 500  # every sample's layout kept, both shards
    second = _read(folder)
    assert second == first
    assert [list(s) for s in second] == [list(s) for s in first]  # the keys' order too
    assert [s["__key__"] for s in second] == [f"{i:06d}" for i in range(500)]
    assert second[7]["bin"] == bytes([49]) * 202 and second[7]["__source__"] == 0
    assert list(second[7]) == ["__key__", "__url__", "bin", "cls", "__source__"]  # one dict, raw_sample's order
    assert second[7]["__url__"] == shard_urls(folder)[0] and second[7]["cls"] == b"7"
    assert layouts.held() == 500


@pytest.mark.parametrize("how", ["in place", "renamed over"])
def test_a_changed_shard_is_checked_again(tmp_path, settled, how):
    """Another shard's bytes, the same size (fields "dat" where they were "bin"): the second pass
    reads the new fields and bytes, not the layout kept from the first."""
    old = make_shards(tmp_path, [300], _fields("bin", 0), name="old")
    new = make_shards(tmp_path, [300], _fields("dat", 1), name="new")
    target, replacement = shard_urls(old)[0], shard_urls(new)[0]
    assert os.path.getsize(target) == os.path.getsize(replacement)
    assert "bin" in _read(old)[0] and layouts.held() == 300
    before = os.stat(target)
    if how == "in place":
        with open(target, "r+b") as f:
            f.write(Path(replacement).read_bytes())
        _ctime_moved(target, before)
        assert os.stat(target).st_ino == before.st_ino and os.stat(target).st_size == before.st_size
    else:
        shutil.copyfile(replacement, target + ".part")
        os.utime(target + ".part", ns=(before.st_atime_ns, before.st_mtime_ns))  # the same size and mtime
        os.replace(target + ".part", target)
    got = _read(old)
    want = _read(new)
    assert [s["__key__"] for s in got] == [f"{i:06d}" for i in range(300)]
    assert [list(s) for s in got] == [list(s) for s in want] and "bin" not in got[0]
    assert [s["dat"] for s in got] == [s["dat"] for s in want]
    assert got[5]["dat"] == bytes([36]) * 200


def test_a_shard_damaged_in_place_raises(tmp_path, settled):
    """One byte of a header's name changed after the first pass: its checksum no longer
    matches, and the second pass names the shard and where, as the first would have."""
    folder = make_shards(tmp_path, [300], _fields("bin", 0))
    target = shard_urls(folder)[0]
    assert len(_read(folder)) == 300 and layouts.held() == 300
    at = int(np.load(target + ".idx.npy")[150])  # sample 150's first header
    before = os.stat(target)
    with open(target, "r+b") as f:
        f.seek(at)
        name = f.read(1)
        f.seek(at)
        f.write(b"9" if name != b"9" else b"8")
    _ctime_moved(target, before)
    with pytest.raises(ShardFormatError, match=rf"{target}.*byte {at}"):
        _read(folder)


def test_a_recent_shard_is_not_kept(tmp_path):
    """A shard written less than layouts.SETTLED_NS ago may still change within its ctime's tick."""
    layouts.clear()
    folder = make_shards(tmp_path, [300], _fields("bin", 0))
    assert len(_read(folder)) == 300
    assert layouts.held() == 0


def test_the_files_used_longest_ago_go_first(tmp_path, settled, monkeypatch):
    monkeypatch.setattr(layouts, "MAX_SAMPLES", 400)
    folder = make_shards(tmp_path, [300, 200], _fields("bin", 0))
    assert len(_read(folder)) == 500
    assert layouts.held() == 200  # the first shard's 300 went when the second's came
    assert [s["__key__"] for s in _read(folder)] == [f"{i:06d}" for i in range(500)]
