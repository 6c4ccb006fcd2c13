"""Faults and hangs (issue 32): a full staging disk, a stalled staging claim, slow resume plans,
a killed conversion's lock, an epoch past the bound and metadata nested too deeply each end in
bounded time with a named error.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from shardflow import ShardDataset
from shardflow.convert.engine import ConvertOptions
from shardflow.errors import ConversionError, ShardflowError, StateError
from shardflow.storage.locks import DestinationLock, writer_holding

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
    from shardflow.convert.parquet import convert_parquet

    src = tmp_path / "deep.parquet"
    deep = '{"info": {"features": {"label": ' + "[" * 100_000 + "]" * 100_000 + "}}}"
    table = pa.table({"label": [1, 2, 3]}).replace_schema_metadata({b"huggingface": deep.encode()})
    pq.write_table(table, src)
    with pytest.raises(ConversionError, match=r"deep\.parquet: the schema metadata 'huggingface'.*nested too deeply"):
        convert_parquet(str(src), str(tmp_path / "out"), options=ConvertOptions(workers=1))


LOCK_AND_FORK = """
import os, sys, time
from shardflow.storage.locks import DestinationLock
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
