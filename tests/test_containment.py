"""What shardflow opens and what it creates (issue 25, cases f and i).

- Only regular files are read as shards, offset indexes and manifests: a FIFO, a device or a
  socket under such a name is refused by name (``NotRegularFileError``) at once, by every reader
  and by ``inspect`` and ``verify``, instead of hanging or reading forever.
- Files a writer creates in its destination (the lock, the journal, the conversion record,
  temporaries) are created with ``O_NOFOLLOW`` / ``O_EXCL``: a symlink planted there is an error
  naming it, and the link's target is never truncated or written.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import stat
from pathlib import Path

import pytest

import shardflow
from shardflow import IndexedShardDataset, ShardDataset, ShardWriter
from shardflow.inspect import verify
from shardflow.errors import ShardflowError
from shardflow.storage.errors import NotRegularFileError

from .helpers import make_shards

pytestmark = pytest.mark.timeout(30)  # a hang (the old behaviour on a FIFO) fails here


def _plant(path: Path, kind: str) -> contextlib.AbstractContextManager:
    """Replace ``path`` by a FIFO, a device (a symlink to /dev/zero) or a listening unix socket."""
    path.unlink(missing_ok=True)
    if kind == "fifo":
        os.mkfifo(path)
        return contextlib.nullcontext()
    if kind == "device":
        # a device node in the folder itself: a symlink to /dev/zero would be refused earlier, as a
        # link out of the dataset's folder (issue 32, tests/test_hostile_data.py)
        if os.geteuid() != 0:
            pytest.skip("creating a character device needs root (a symlink to one is refused as a link out)")
        os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(1, 5))  # /dev/zero's numbers
        return contextlib.nullcontext()
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(path))
    sock.listen(1)
    return contextlib.closing(sock)


KINDS = ["fifo", "device", "socket"]
SAID = {"fifo": "a FIFO", "device": "a character device", "socket": "a socket"}


@pytest.mark.parametrize("kind", KINDS)
def test_a_shard_that_is_not_a_regular_file_is_refused_by_name(tmp_path: Path, kind: str) -> None:
    folder = make_shards(tmp_path, [2, 2])
    shard = folder / "train-000001.tar"
    with _plant(shard, kind):
        said = f"{shard} is {SAID[kind]}, not a regular file"
        with pytest.raises(NotRegularFileError, match=said):
            list(ShardDataset(str(folder), decode=None))
        with pytest.raises(NotRegularFileError, match=said):
            list(ShardDataset(str(shard), decode=None))
        with pytest.raises(NotRegularFileError, match=said):
            IndexedShardDataset(str(folder))[3]
        ds = ShardDataset(str(folder), decode=None, on_error="skip")
        assert [s["__key__"] for s in ds] == ["000000", "000001"]  # the other shard is read
        report = verify(str(folder), workers=1)
        assert report[0].reason == "not_regular_file" and said in report[0].message
        assert {p.shard for p in report} == {str(shard)}  # (its size, digest and count then differ too)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", ["shardflow.json", "train-000000.tar.idx.npy"])
def test_a_manifest_or_index_that_is_not_a_regular_file_is_refused(tmp_path: Path, kind: str, name: str) -> None:
    folder = make_shards(tmp_path, [2, 2])
    target = folder / name
    with _plant(target, kind):
        with pytest.raises(NotRegularFileError, match=f"{target} is {SAID[kind]}, not a regular file"):
            if name == "shardflow.json":
                ShardDataset(str(target))
            else:
                IndexedShardDataset(str(folder))[0]


def test_inspect_and_verify_on_the_cli_name_a_fifo(tmp_path: Path, capsys) -> None:
    from shardflow.cli import main

    folder = make_shards(tmp_path, [2])
    shard = folder / "train-000000.tar"
    _plant(shard, "fifo")
    for args in (["inspect", str(shard)], ["verify", str(folder), "--workers", "1"]):
        with contextlib.suppress(SystemExit):
            main(args)
        out = capsys.readouterr()
        assert f"{shard} is a FIFO, not a regular file" in out.out + out.err, args


# ------------------------------------------------------------------ destinations (case i)


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    path = tmp_path / "victim.txt"
    path.write_text("precious")
    return path


@pytest.mark.parametrize("name", [".shardflow.lock", "shardflow.json.journal", "shardflow.json"])
def test_a_symlink_planted_in_a_writer_destination_is_refused(tmp_path: Path, victim: Path, name: str) -> None:
    dest = tmp_path / "out"
    dest.mkdir()
    (dest / name).symlink_to(victim)
    with pytest.raises(ShardflowError, match=f"{dest / name} is a symlink"):
        with ShardWriter(str(dest / "train-%06d.tar"), max_count=2) as w:
            for i in range(3):
                w.write({"__key__": f"{i:06d}", "txt": "x"})
    assert victim.read_text() == "precious"
    assert (dest / name).is_symlink()


@pytest.mark.parametrize("name", [".shardflow.lock", "shardflow.json", ".shardflow-convert.json", "train-000001.tar"])
def test_a_symlink_planted_in_a_conversion_destination_is_refused(tmp_path: Path, victim: Path, name: str) -> None:
    dest = tmp_path / "out"
    dest.mkdir()
    (dest / name).symlink_to(victim)
    said = "already holds 1 tar file" if name.endswith(".tar") else f"{dest / name} is a symlink"
    with pytest.raises(ShardflowError, match=said):
        shardflow.write_shards(_sample, range(5), str(dest), max_count=2, workers=1)
    assert victim.read_text() == "precious"


def test_a_symlinked_shard_name_is_not_written_through(tmp_path: Path, victim: Path) -> None:
    dest = tmp_path / "out"
    dest.mkdir()
    (dest / "train-000000.tar").symlink_to(victim)
    with pytest.raises(ShardflowError, match="train-000000.tar is a symlink"):
        with ShardWriter(str(dest / "train-%06d.tar"), max_count=2) as w:
            w.write({"__key__": "000000", "txt": "x"})
    assert victim.read_text() == "precious"


def _sample(i: int) -> dict:
    return {"__key__": f"{i:06d}", "txt": f"sample {i}"}


def test_nothing_is_written_outside_the_destination(tmp_path: Path) -> None:
    dest = tmp_path / "out"
    before = set(tmp_path.rglob("*"))
    shardflow.write_shards(_sample, range(5), str(dest), max_count=2, workers=1)
    after = set(tmp_path.rglob("*"))
    assert {p for p in after - before if dest not in p.parents and p != dest} == set()
    assert json.loads((dest / "shardflow.json").read_text())["shards"][0]["samples"] == 2
