"""Crash consistency: a writer (``ShardWriter``, ``write_shards``) SIGKILLed at random
points, then a second writer into the same folder. The folder always yields every sample
that was complete before the kill (for a ``ShardWriter``: every shard at its name; for a
conversion: every group its record lists), each once, in order, or a clear refusal.
Checked against the stdlib ``tarfile`` reader. Each run is a subprocess writing a few
hundred tiny samples, killed after a random count or a random delay; the runs are seeded
(``CRASH_SEED``, ``CRASH_RUNS`` to try more) and a failure names its seed."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

import shardflow
from shardflow.errors import DestinationExistsError
from shardflow.format.manifest import MANIFEST_NAME, Manifest
from shardflow.sources.listed import IncompleteDatasetError

pytestmark = pytest.mark.timeout(600)

SEED = int(os.environ.get("CRASH_SEED", "2126"))
RUNS = int(os.environ.get("CRASH_RUNS", "20"))

WRITER = """
import os, signal, sys
import shardflow
folder, n, max_count, kill_at = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
sink = shardflow.ShardWriter(os.path.join(folder, "train-%06d.tar"), max_count=max_count)
print("ready", flush=True)
for i in range(n):
    if i == kill_at:
        os.kill(os.getpid(), signal.SIGKILL)
    sink.write({"__key__": f"train{i:04d}", "bin": os.urandom(i % 300), "cls": i % 3})
sink.close()
print("closed", flush=True)
signal.pause()
"""

CONVERTER = """
import os, signal, sys
import shardflow
from tests.test_crash_consistency import build  # the same fn (the conversion's identity) as the test's

if __name__ == "__main__":
    folder, n, max_count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    print("ready", flush=True)
    shardflow.write_shards(build, range(n), folder, max_count=max_count, workers=1)
    print("closed", flush=True)
    signal.pause()
"""


def run_killed(code: str, args: list[str], delay: float | None, kill_at: int = -1) -> None:
    """Run ``code`` in a subprocess (its own session); SIGKILL its group ``delay`` seconds
    after it says ready, or let it kill itself (``delay`` None; a conversion's ``build``
    does at input ``kill_at``)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "CRASH_KILL_AT": str(kill_at)}
    proc = subprocess.Popen([sys.executable, "-c", code, *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line == b"ready\n", proc.stderr.read().decode() if proc.stderr else line
        if delay is not None:
            time.sleep(delay)
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    assert proc.returncode == -signal.SIGKILL


def tar_keys(paths: list[Path]) -> list[str]:
    out: list[str] = []
    for p in paths:
        with tarfile.open(p) as tf:
            for m in tf.getmembers():
                key = m.name.split(".", 1)[0]
                if not out or out[-1] != key:
                    out.append(key)
    return out


def read_keys(folder: Path, *, allow_incomplete: bool = False) -> list[str]:
    io = shardflow.IOOptions(allow_incomplete=allow_incomplete)
    return [s["__key__"] for s in shardflow.ShardDataset(str(folder), decode=None, io=io)]


def second_writer(folder: Path) -> list[str]:
    with shardflow.ShardWriter(str(folder / "val-%06d.tar"), max_count=2) as sink:
        for i in range(5):
            sink.write({"__key__": f"val{i:04d}", "bin": b"v" * i, "cls": 0})
    return [f"val{i:04d}" for i in range(5)]


def test_killed_shard_writer_then_a_second_writer(tmp_path: Path) -> None:
    rng = random.Random(SEED)
    for run in range(RUNS):
        folder = tmp_path / f"w{run}"
        folder.mkdir()
        n, max_count = rng.randint(50, 300), rng.choice([1, 3, 7, 20, 64])
        by_count = run % 2 == 0
        kill_at = rng.randint(0, n - 1) if by_count else n + 1
        where = f"seed {SEED} run {run}: n={n} max_count={max_count} " + (
            f"kill_at={kill_at}" if by_count else "kill after a delay")
        run_killed(WRITER, [str(folder), str(n), str(max_count), str(kill_at)],
                   None if by_count else rng.uniform(0.0, 1.0))
        on_disk = sorted(folder.glob("train-*.tar"))  # every shard at its name is complete
        complete = tar_keys(on_disk)
        assert complete == [f"train{i:04d}" for i in range(len(complete))], where
        if by_count:  # the shards finished before sample kill_at: all but the one in progress
            assert len(complete) == (kill_at - 1) // max_count * max_count if kill_at else len(complete) == 0, where
        val = second_writer(folder)
        assert read_keys(folder) == complete + val, where
        manifest = Manifest.loads((folder / MANIFEST_NAME).read_bytes())
        assert [s.url for s in manifest.shards] == [p.name for p in on_disk] + ["val-000000.tar", "val-000001.tar",
                                                                               "val-000002.tar"], where


def test_killed_conversion_then_a_second_writer(tmp_path: Path) -> None:
    rng = random.Random(SEED + 1)
    for run in range(max(1, RUNS // 2)):
        folder = tmp_path / f"c{run}"
        n, max_count = rng.randint(50, 300), rng.choice([3, 10, 40])
        kill_at = rng.randint(0, n - 1)
        where = f"seed {SEED + 1} run {run}: n={n} max_count={max_count} kill_at={kill_at}"
        run_killed(CONVERTER, [str(folder), str(n), str(max_count)], None, kill_at)
        listed: list[str] = []
        if (folder / MANIFEST_NAME).exists():
            manifest = Manifest.loads((folder / MANIFEST_NAME).read_bytes())
            listed = tar_keys([folder / s.url for s in manifest.shards])
            # whole groups (one shard of max_count inputs each), in order; they finish out of
            # order, so not always a prefix; none past the input that was being built
            groups = sorted({int(k[1:]) // max_count for k in listed})
            assert listed == [f"c{i:04d}" for g in groups for i in range(g * max_count, min(n, (g + 1) * max_count))], where
            assert int(listed[-1][1:]) < kill_at if listed else True, where
        if run % 2 == 0:  # the conversion again: resumes, and the folder holds all of it
            shardflow.write_shards(build, range(n), str(folder), max_count=max_count, workers=1)
            assert read_keys(folder) == [f"c{i:04d}" for i in range(n)], where
            continue
        folder.mkdir(exist_ok=True)
        val = second_writer(folder)  # another writer: keeps what the conversion listed
        if listed:  # the conversion did not finish: its folder is read on purpose only (issue 32)
            with pytest.raises(IncompleteDatasetError, match="did not finish"):
                read_keys(folder)
        assert read_keys(folder, allow_incomplete=True) == listed + val, where
        if listed:  # and the conversion now refuses to resume over the writer's shards, naming them
            with pytest.raises(DestinationExistsError, match=r"another writer \(val-000000.tar"):
                shardflow.write_shards(build, range(n), str(folder), max_count=max_count, workers=1)


def build(i: int) -> dict:
    """A conversion's sample ``i``; kills the whole conversion at input ``CRASH_KILL_AT``
    (set in the subprocess only), wherever ``build`` runs."""
    if i == int(os.environ.get("CRASH_KILL_AT", "-1")):
        os.killpg(os.getpgid(0), signal.SIGKILL)
    return {"__key__": f"c{i:04d}", "bin": bytes([i % 256]) * (i % 200 + 1)}
