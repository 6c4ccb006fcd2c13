"""A second local user against the staging areas and the shard cache (issue 32, shared temporary folders).

The staging areas lived in the shared temporary folder under names anyone could compute (the
shards' URLs, the DataLoader process's pid, rank, world size and epoch), and a cache folder named
by the user was used whoever had made it. Another local account that made them first could plant
symbolic links that the job wrote through, block files and cache entries that the job trained on,
and a job restarted under the same pid read the area its killed predecessor left.

Each case plants what the attacker would, in a shared folder with the sticky bit (as ``/tmp``),
and asserts what the job read (the real dataset's keys and bytes), that the attacker's files were
not written, or the error that names the refused folder. The tests run as root: the attacker's
folders are handed to uid 65534 with ``os.chown``; cases that need root skip where it is not.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import shardflow
from shardflow import IOOptions
from shardflow.storage import UnsafeFolderError
from shardflow.storage.sharing import staging
from shardflow.storage.sharing.cache import ShardCache

pytestmark = pytest.mark.timeout(120)

ATTACKER = 65534  # nobody
PASSWD = b"root:x:0:0:root:/root:/bin/bash\ndaemon:x:1:1:daemon:/usr/sbin:/usr/sbin/nologin\n"
ROOT = pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0,
                          reason="making a folder that belongs to another user needs root (os.chown)")


def payload(i: int, seed: int) -> bytes:
    return np.random.default_rng([seed, i]).integers(0, 256, 700 + (i * 37) % 300, dtype=np.uint8).tobytes()


def write(folder: Path, n: int, per: int, seed: int) -> dict[str, bytes]:
    """Shards of ``n`` samples (``per`` a shard) in ``folder``; the bytes of a sample depend on
    ``seed``, its key and size do not (two seeds: two versions of the same layout)."""
    want = {}
    with shardflow.ShardWriter(str(folder / "train-%06d.tar"), max_count=per) as sink:
        for i in range(n):
            key = f"{i:06d}"
            want[key] = payload(i, seed)
            sink.write({"__key__": key, "bin": want[key]})
    return want


def serve(srv, folder: Path, prefix: str) -> str:
    for p in sorted(folder.iterdir()):
        srv.put(f"{prefix}/{p.name}", p.read_bytes())
    return f"{srv.url}/{prefix}/"


def shared_folder(tmp_path: Path) -> Path:
    """A folder every user can write, with the sticky bit: the machine's temporary folder."""
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    return shared


def attackers(path: Path, mode: int = 0o777) -> Path:
    """Hand ``path`` (and what is in it) to the other user, as if that user had made it."""
    for p in [path, *path.rglob("*")]:
        os.chown(p, ATTACKER, ATTACKER, follow_symlinks=False)
    if not path.is_symlink():
        os.chmod(path, mode)
    return path


def samples(ds) -> list[tuple[str, bytes]]:
    return [(s["__key__"], s["bin"]) for s in ds]


def old_area_names(urls: list[str]) -> list[str]:
    """The names the staging area of this process's epochs 0 .. 3 had: computable by anyone
    who can see the job's pid (``ps``) and the dataset's URLs."""
    job = os.getpid()
    return [staging.PREFIX + hashlib.sha256(repr((tuple(urls), 1, job, 0, 1, epoch)).encode()).hexdigest()[:24]
            for epoch in range(4)]


def block_base(url: str) -> str:
    """The name of an object's files in an area (a digest of its URL, see staged_blocks)."""
    return hashlib.sha256(url.encode()).hexdigest()[:32]


@pytest.fixture
def served(http_server, tmp_path):
    """A 2-shard dataset (40 samples) on the loopback server: ``(url, the real samples)``."""
    (tmp_path / "real").mkdir()
    want = write(tmp_path / "real", 40, 20, seed=1)
    return serve(http_server, tmp_path / "real", "real"), sorted(want.items())


@ROOT
def test_symlinks_planted_in_a_predicted_area_are_not_written_through(served, tmp_path):
    url, want = served
    shared = shared_folder(tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    passwd = outside / "passwd"
    passwd.write_bytes(PASSWD)
    ds = shardflow.ShardDataset(url, decode=None, io=IOOptions(backoff=0.0, staging_dir=str(shared)))
    for name in old_area_names(ds.shards.urls):
        area = shared / name
        area.mkdir()
        (area / ".users").symlink_to(passwd)  # opened for its lock
        (area / ".done-0").symlink_to(outside / "made-by-the-job")  # created empty
        for shard_url in ds.shards.urls:
            h = block_base(shard_url)
            (area / f"{h}.0").symlink_to(outside / f"shard-{h}")  # the fetch writes the shard into it
            (area / f"{h}.0.done").symlink_to(passwd)  # a read mark: byte 1 at the worker's offset
        attackers(area)
    assert samples(ds) == want
    assert passwd.read_bytes() == PASSWD
    assert sorted(p.name for p in outside.iterdir()) == ["passwd"]  # nothing made out there
    for name in old_area_names(ds.shards.urls):  # the planted areas untouched
        assert (shared / name / ".users").is_symlink()
    # this user's areas: in a folder of its own, private, removed at the epoch's end
    mine = shared / f"shardflow-{os.geteuid()}"
    assert oct(os.lstat(mine).st_mode & 0o7777) == oct(0o700) and os.lstat(mine).st_uid == os.geteuid()
    assert os.listdir(mine) == []


@ROOT
def test_a_block_planted_in_a_predicted_area_is_not_trained_on(served, http_server, tmp_path):
    url, want = served
    shared = shared_folder(tmp_path)
    (tmp_path / "fake").mkdir()
    write(tmp_path / "fake", 40, 20, seed=666)  # the same keys and sizes, the attacker's bytes
    ds = shardflow.ShardDataset(url, decode=None, io=IOOptions(backoff=0.0, staging_dir=str(shared)))
    for name in old_area_names(ds.shards.urls):
        area = shared / name
        area.mkdir()
        (area / ".users").write_bytes(b"")
        for shard_url in ds.shards.urls:
            h = block_base(shard_url)
            fake = (tmp_path / "fake" / shard_url.rsplit("/", 1)[1]).read_bytes()
            (area / f"{h}.meta").write_text(json.dumps({"size": len(fake), "identity": {"ETag": '"planted"'}}))
            (area / f"{h}.0").write_bytes(fake)  # block 0, complete: no fetch, no identity check
        attackers(area)
    got = samples(ds)
    assert [k for k, _ in got] == [k for k, _ in want]
    assert got == want  # every byte the real dataset's (the attacker's: 40 of 40 before)


@ROOT
@pytest.mark.parametrize("how", ["another user's", "a symbolic link", "writable by others"])
def test_a_per_user_folder_that_is_not_this_users_alone_is_refused(served, tmp_path, how):
    url, _ = served
    shared = shared_folder(tmp_path)
    mine = shared / f"shardflow-{os.geteuid()}"
    if how == "another user's":
        mine.mkdir()
        attackers(mine, 0o700)
        expected = f"belongs to another user (uid {ATTACKER}, not {os.geteuid()})"
    elif how == "a symbolic link":
        theirs = shared / "theirs"
        theirs.mkdir()
        attackers(theirs)
        mine.symlink_to(theirs)
        attackers(mine)
        expected = "is a symbolic link (never followed)"
    else:
        mine.mkdir()
        os.chmod(mine, 0o777)  # ours, but anyone may have planted files in it
        expected = "can be used by other users"
    ds = shardflow.ShardDataset(url, decode=None, io=IOOptions(backoff=0.0, staging_dir=str(shared)))
    with pytest.raises(UnsafeFolderError) as info:
        samples(ds)
    assert isinstance(info.value, PermissionError) and info.value.reason == "unsafe_folder"
    message = str(info.value)
    assert message.startswith(f"staging folder {mine} (owner uid ") and expected in message
    assert "refusing it" in message
    if how == "a symbolic link":
        assert list((shared / "theirs").iterdir()) == []  # nothing made through the link


@ROOT
def test_a_staging_dir_of_another_user_is_refused_through_the_loader(served, tmp_path):
    """``staging_dir`` given, made by another user (its owner can rename anything in it):
    refused by a loader with 2 workers (the main process's first fetches, or the workers)."""
    url, _ = served
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    attackers(theirs, 0o755)
    ds = shardflow.ShardDataset(url, decode=None, io=IOOptions(backoff=0.0, staging_dir=str(theirs)))
    loader = shardflow.loader(ds, batch_size=4, num_workers=2, collate_fn=list)
    with pytest.raises(UnsafeFolderError, match=rf"staging folder {theirs} \(owner uid {ATTACKER}, mode 0755\) belongs to another"):
        list(loader)
    assert list(theirs.iterdir()) == []


def _planted_cache(tmp_path: Path, url: str, ds, secret: Path) -> Path:
    """A cache folder holding the attacker's copy of shard 0 and, for shard 1, a link to
    ``secret``, each pinned to the manifest's digest (served without a request)."""
    cache = tmp_path / "cache"
    cache.mkdir()
    (tmp_path / "fake").mkdir()
    write(tmp_path / "fake", 40, 20, seed=666)
    listed = json.loads((tmp_path / "real" / "shardflow.json").read_text())["shards"]
    for shard, shard_url in enumerate(ds.shards.urls):
        name = shard_url.rsplit("/", 1)[1]
        sha = listed[shard]["sha256"]
        entry = cache / f"{ShardCache.key(shard_url, {'ETag': 'x'})}-{name}"
        if shard == 0:
            shutil.copy(tmp_path / "fake" / name, entry)
        else:
            entry.symlink_to(secret)
        (cache / f".pin-{ShardCache.key(shard_url, {'sha256': sha})}").symlink_to(entry.name)
    return cache


@pytest.fixture
def secret(tmp_path):
    """A root-only file outside the cache: a shard of samples nobody else may read."""
    (tmp_path / "secret").mkdir()
    want = write(tmp_path / "secret", 20, 20, seed=7)
    path = tmp_path / "secret" / "train-000000.tar"
    os.chmod(path, 0o600)
    return path, sorted(want.items())


@ROOT
def test_a_cache_folder_made_by_another_user_is_refused(served, tmp_path, secret):
    url, _ = served
    ds = shardflow.ShardDataset(url, decode=None)
    cache = attackers(_planted_cache(tmp_path, url, ds, secret[0]))
    ds = shardflow.ShardDataset(url, decode=None, io=IOOptions(backoff=0.0, cache_dir=str(cache)))
    with pytest.raises(UnsafeFolderError) as info:
        samples(ds)
    assert str(info.value).startswith(
        f"shard cache {cache} (owner uid {ATTACKER}, mode 0777) belongs to another user (uid {ATTACKER}, not 0)")


def test_cache_entries_that_are_symbolic_links_are_not_served(served, tmp_path, secret, caplog):
    """In this user's own cache folder, an entry that is a link (to a file only root may read)
    is never followed: the shard is fetched and checked again; the linked file is untouched."""
    url, want = served
    ds = shardflow.ShardDataset(url, decode=None)
    cache = _planted_cache(tmp_path, url, ds, secret[0])
    os.remove(next(cache.glob("*-train-000000.tar")))  # this case: the link only
    before = secret[0].read_bytes()
    ds = shardflow.ShardDataset(url, decode=None, io=IOOptions(backoff=0.0, cache_dir=str(cache)))
    assert samples(ds) == want  # secret[1]'s samples (20 of 40) before
    assert secret[0].read_bytes() == before
    assert "not a regular file of this user's; not served" in caplog.text
    linked = [p for p in cache.iterdir() if p.name.endswith("-train-000001.tar")]
    assert [p.is_symlink() for p in linked] in ([False], [True, False], [False, True])


def test_a_new_cache_folder_is_private(served, tmp_path):
    url, want = served
    cache = tmp_path / "new" / "cache"
    ds = shardflow.ShardDataset(url, decode=None, io=IOOptions(backoff=0.0, cache_dir=str(cache)))
    assert samples(ds) == want
    assert os.lstat(cache).st_mode & 0o777 == 0o700


_JOB = """
import hashlib, json, os, signal, sys
import shardflow
from shardflow import IOOptions
url, shared, kill_after = sys.argv[1], sys.argv[2], int(sys.argv[3])
ds = shardflow.ShardDataset(url, decode=None, io=IOOptions(backoff=0.0, retries=0, staging_dir=shared))
out = []
for s in ds:
    out.append([s["__key__"], hashlib.sha256(s["bin"]).hexdigest()])
    if len(out) == kill_after:
        os.kill(os.getpid(), signal.SIGKILL)
print(json.dumps({"pid": os.getpid(), "samples": out}))
"""


def _in_new_pid_namespace(script: Path, *args: str) -> subprocess.CompletedProcess:
    """Run ``script`` as pid 2 of a new pid namespace (pid 1 is its shell): every run gets
    the same pid, as a job restarted in a fresh container does."""
    env = dict(os.environ, PYTHONPATH=str(Path(shardflow.__file__).resolve().parents[1]))
    command = f"{sys.executable} {script} {' '.join(args)}; true"
    return subprocess.run(["unshare", "--pid", "--fork", "sh", "-c", command], capture_output=True, text=True,
                          env=env, timeout=100)


@ROOT
def test_a_job_restarted_with_the_same_pid_never_reads_the_killed_jobs_area(http_server, tmp_path):
    if shutil.which("unshare") is None or subprocess.run(["unshare", "--pid", "--fork", "true"]).returncode != 0:
        pytest.skip("needs unshare --pid (a new pid namespace) to give two jobs the same pid")
    shared = shared_folder(tmp_path)
    script = tmp_path / "job.py"
    script.write_text(_JOB)
    (tmp_path / "v1").mkdir()
    write(tmp_path / "v1", 200, 200, seed=1)  # one shard of 200 samples
    url = serve(http_server, tmp_path / "v1", "data")
    killed = _in_new_pid_namespace(script, url, str(shared), "40")
    assert killed.stdout == "", killed.stderr  # killed after 40 samples: nothing printed
    # the dataset is rewritten in place (same keys, new bytes and sizes) before the restart
    (tmp_path / "v2").mkdir()
    want = write(tmp_path / "v2", 200, 200, seed=2)
    serve(http_server, tmp_path / "v2", "data")
    restarted = _in_new_pid_namespace(script, url, str(shared), "0")
    assert restarted.returncode == 0 and restarted.stdout, restarted.stderr  # no ShardChangedError
    result = json.loads(restarted.stdout)
    first = subprocess.run(["unshare", "--pid", "--fork", "sh", "-c", f"{sys.executable} -c 'import os; print(os.getpid())'; true"],
                           capture_output=True, text=True)
    assert result["pid"] == int(first.stdout)  # the same pid as the killed job's
    assert result["samples"] == [[k, hashlib.sha256(v).hexdigest()] for k, v in sorted(want.items())]
