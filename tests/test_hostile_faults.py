"""Faults and hangs (issue 32): a full staging disk, a stalled staging claim, slow resume plans,
a killed conversion's lock, an epoch past the bound and metadata nested too deeply each end in
bounded time with a named error.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from shardflow import ShardDataset
from shardflow.convert.engine.engine import ConvertOptions
from shardflow.errors import ConversionError, ShardflowError, StateError
from shardflow.storage import IOOptions
from shardflow.storage.sharing import staged, staged_blocks
from shardflow.storage.sharing.staging import StagedOptions, StagingScope
from shardflow.storage.sharing.staging_faults import StagingFullError
from shardflow.storage.writing.locks import DestinationLock, writer_holding

from .helpers import make_shards

pytestmark = pytest.mark.timeout(120)


def test_set_epoch_past_the_bound_is_a_named_state_error(tmp_path: Path) -> None:
    ds = ShardDataset(str(make_shards(tmp_path, [4])))
    with pytest.raises(StateError, match=r"2\*\*62") as info:
        ds.set_epoch(2**63)
    assert isinstance(info.value, ValueError) and isinstance(info.value, ShardflowError)
    with pytest.raises(StateError):
        ds.set_epoch(-1)
    ds.set_epoch(2**62 - 1)
    assert ds.epoch == 2**62 - 1


def test_parquet_metadata_nested_too_deep_is_a_named_conversion_error(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    from shardflow.convert.records.parquet import convert_parquet

    src = tmp_path / "deep.parquet"
    deep = '{"info": {"features": {"label": ' + "[" * 100_000 + "]" * 100_000 + "}}}"
    table = pa.table({"label": [1, 2, 3]}).replace_schema_metadata({b"huggingface": deep.encode()})
    pq.write_table(table, src)
    with pytest.raises(ConversionError, match=r"deep\.parquet: the schema metadata 'huggingface'.*nested too deeply"):
        convert_parquet(str(src), str(tmp_path / "out"), options=ConvertOptions(workers=1))


LOCK_AND_FORK = """
import os, sys, time
from shardflow.storage.writing.locks import DestinationLock
DestinationLock(sys.argv[1]).acquire()
child = os.fork()
if child == 0:  # a writer worker that outlives the run (it would notice the orphaning later)
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 1), os.dup2(null, 2)  # the test's pipes are not held open
    time.sleep(120)
    os._exit(0)
print(child, flush=True)
os._exit(0)  # killed before it could release anything
"""


def test_a_killed_runs_lock_goes_with_it_though_a_forked_worker_lives_on(tmp_path: Path) -> None:
    folder = tmp_path / "dst"
    run = subprocess.run([sys.executable, "-c", LOCK_AND_FORK, str(folder)], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}, timeout=60)
    assert run.returncode == 0, run.stderr
    worker = int(run.stdout.split()[0])
    try:
        os.kill(worker, 0)  # the dead run's worker is still alive, holding a copy of its descriptors
        assert writer_holding(str(folder)) is None
        with DestinationLock(str(folder)):  # the re-run at once is not refused
            assert writer_holding(str(folder)) == f"pid {os.getpid()} on {socket.gethostname()}"
    finally:
        os.kill(worker, signal.SIGKILL)


@pytest.mark.timeout(60)  # the old planning took ~90 s for [[1000, 0], [1000, 0]] and >300 s for this one
def test_resume_states_of_many_ranks_plan_in_linear_time(tmp_path: Path) -> None:
    folder = make_shards(tmp_path, [1000] * 20)
    ds = ShardDataset(str(folder), decode=None, rank=0, world_size=1)
    state = ds.state_dict()
    state["remaining"] = [[2000, 0], [2000, 0]]  # inside the bounds (shardflow.state.MAX_STAGES, world sizes)
    ds.load_state_dict(state)
    plan = ds.plan()
    once = ShardDataset(str(folder), decode=None, rank=0, world_size=1)
    state["remaining"] = [[2000, 0]]
    once.load_state_dict(state)
    # nothing taken on 2,000 ranks twice: the rest is the whole epoch as those ranks had it, each sample once
    assert plan.samples == 20_000 and plan.padding == 0
    assert np.array_equal(plan.read_sample[plan.emit], once.plan().read_sample[once.plan().emit])
    keys = [s["__key__"] for s in ds]
    assert sorted(keys) == [f"{i:06d}" for i in range(20_000)]


# --------------------------------------------------------------------------------------------
# the staging area: a full disk, a stalled claim


@pytest.fixture
def full_disk(tmp_path: Path):
    """A 256 KiB tmpfs for a staging area (root can mount one); skipped where it cannot be made."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    if os.geteuid() != 0 or not shutil.which("mount"):
        pytest.skip("a small tmpfs (a full disk) needs root and mount(8)")
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)], capture_output=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {made.stderr.decode(errors='replace').strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


@pytest.mark.timeout(60)  # retried as a network error, it waited part_deadline (900 s)
def test_a_full_staging_disk_is_a_named_error_at_once(http_server, full_disk: Path, monkeypatch) -> None:
    monkeypatch.setattr(staged_blocks, "BLOCK", 64 << 10)
    data = np.random.default_rng(3).integers(0, 256, 1 << 20, dtype=np.uint8).tobytes()
    url = http_server.put("big.bin", data)
    root = full_disk / "area"
    root.mkdir()
    io = StagedOptions(backoff=0.0, staging_scope=StagingScope(str(root), 0, 2))
    with pytest.raises(StagingFullError, match=rf"staging {url}: the staging area {root} has no room left") as info:
        b"".join(staged.staged_chunks(url, 0, None, io))
    err = info.value
    assert isinstance(err, ShardflowError) and err.reason == "staging_full"  # what on_error="skip" counts
    assert "IOOptions.staging_dir" in str(err) and "staging=False" in str(err)
    assert http_server.stats.gets == 1  # not retried


@pytest.mark.timeout(60)  # a stalled holder made the others wait part_deadline (900 s)
def test_a_stalled_claim_holder_does_not_hold_up_the_others(http_server, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(staged_blocks, "BLOCK", 64 << 10)
    data = np.random.default_rng(4).integers(0, 256, 300_000, dtype=np.uint8).tobytes()
    url = http_server.put("obj.bin", data)
    root = tmp_path / "area"
    root.mkdir()
    holder = staged_blocks.StagedObject(StagingScope(str(root), 1, 2), url, IOOptions())
    claims = [holder.claim(j) for j in range(2)]  # a live worker that claimed blocks 0 and 1, then stalled
    with open(holder.block_path(0), "wb") as f:
        f.write(data[:1000])  # it had written a little
    try:
        io = StagedOptions(backoff=0.0, request_timeout=0.5, staging_scope=StagingScope(str(root), 0, 2))
        assert b"".join(staged.staged_chunks(url, 0, None, io)) == data
    finally:
        for fd in claims:
            os.close(fd)
    assert http_server.stats.body_bytes <= len(data)  # the bytes it had staged were not fetched again


def _staged_under_a_file_size_limit(url: str, root: str, out) -> None:
    """Child: read ``url`` through a staging area while no file may grow past 100 KB (``EFBIG``)."""
    import resource

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails instead of killing
    resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))
    io = StagedOptions(backoff=0.0, staging_scope=StagingScope(root, 0, 2))
    try:
        b"".join(staged.staged_chunks(url, 0, None, io))
        out.put(("read", ""))
    except BaseException as e:  # noqa: BLE001 - reported to the test
        out.put((type(e).__name__, f"{getattr(e, 'reason', '')}: {e}"))


@pytest.mark.timeout(60)
def test_a_file_size_limit_in_the_staging_area_is_a_named_error(http_server, tmp_path: Path, monkeypatch) -> None:
    """The same without root: RLIMIT_FSIZE in a child process makes block writes fail (EFBIG)."""
    import multiprocessing

    monkeypatch.setattr(staged_blocks, "BLOCK", 256 << 10)
    data = np.random.default_rng(5).integers(0, 256, 600_000, dtype=np.uint8).tobytes()
    url = http_server.put("limited.bin", data)
    root = tmp_path / "area"
    root.mkdir()
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    child = ctx.Process(target=_staged_under_a_file_size_limit, args=(url, str(root), out))
    child.start()
    kind, message = out.get(timeout=50)
    child.join(10)
    assert kind == "StagingFullError", message
    assert message.startswith(f"staging_full: staging {url}: the staging area {root} has no room left")
