"""The main process requests a rank's first batches' bytes at iter(), before its
DataLoader workers fork (shardflow.dataset.warmstart), into the staging area the
workers then read: GETs and bytes counted by the loopback HTTP server, samples
compared with what was written; descriptors that lock the area are closed in
forked children."""

from __future__ import annotations

import multiprocessing
import os
import threading

import pytest

import shardflow
from shardflow import storage
from shardflow.dataset.warmstart import prefetch_first
from shardflow.storage import IOOptions
from shardflow.storage.sharing import staged_blocks
from shardflow.storage.sharing import staging
from shardflow.storage.sharing.staging import StagingScope

from tests.servers import wait_until
from tests.test_staging import serve, tar_gets, write

FAST = IOOptions(backoff=0.0)


def first_shard_names(ds, workers: int) -> set[str]:
    """The shards that the first batch of each worker reads (reference: the plan itself)."""
    plan = ds.plan(0, 0)
    _, order = plan.batch_positions(list(range(workers)))
    return {os.path.basename(ds.urls[plan.segments[s].shard]) for s in set(plan.read_segment[order].tolist())}


def test_the_first_batches_bytes_are_requested_before_the_workers_and_fetched_once(http_server, tmp_path):
    srv = http_server
    want = write(tmp_path / "d", 600, 100)  # 6 shards, 4 read at once
    stored = serve(srv, tmp_path / "d")
    io = IOOptions(backoff=0.0, staging_dir=str(tmp_path / "staging"))
    ds = shardflow.ShardDataset(srv.url, decode=None, shuffle=True, seed=5, io=io)
    loader = shardflow.loader(ds, batch_size=8, num_workers=2, collate_fn=list)
    first = first_shard_names(ds, 2)
    assert 0 < len(first) < 6
    srv.reset_stats()
    # what iter() does before forking the workers: in this process, no worker yet
    prefetch_first(ds, 0, 2)
    assert wait_until(lambda: set(srv.stats.gets_by_path) == first)
    assert all(n == 1 for n in srv.stats.gets_by_path.values())
    # the workers (forked now, same job, rank and epoch) read those bytes from the area
    seen = [(s["__key__"], s["bin"]) for batch in loader for s in batch]
    assert sorted(seen) == sorted(want.items())
    assert tar_gets(srv) == 6, srv.stats.gets_by_path  # one GET per shard, the first ones this process's
    assert srv.stats.body_bytes == stored  # each byte once
    # Removed by the last one out; on a loaded machine it can stay (the last worker and the main
    # process's prefetch hold leave at once and each finds the other there), but nobody holds it:
    # the next job's sweep removes it.
    left = tmp_path / "staging"
    if not wait_until(lambda: os.listdir(left) == [], 10):
        import fcntl

        for area in os.listdir(left):
            fd = os.open(left / area / ".users", os.O_RDONLY)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # raises while a holder is left
            finally:
                os.close(fd)


def test_iter_requests_the_first_shards_once_for_any_number_of_workers(http_server, tmp_path):
    srv = http_server
    want = write(tmp_path / "d", 600, 100)
    stored = serve(srv, tmp_path / "d")
    io = IOOptions(backoff=0.0, staging_dir=str(tmp_path / "staging"))
    for workers in (1, 3):
        ds = shardflow.ShardDataset(srv.url, decode=None, shuffle=True, seed=5, io=io)
        srv.reset_stats()
        seen = [(s["__key__"], s["bin"]) for b in shardflow.loader(ds, batch_size=8, num_workers=workers,
                                                                  collate_fn=list) for s in b]
        assert sorted(seen) == sorted(want.items())
        assert tar_gets(srv) == 6 and srv.stats.body_bytes == stored, (workers, srv.stats)


def test_nothing_is_requested_ahead_for_spawned_workers_or_without_staging(http_server, tmp_path):
    srv = http_server
    write(tmp_path / "d", 200, 100)
    serve(srv, tmp_path / "d")
    for io, context in ((IOOptions(backoff=0.0, staging=False), None), (FAST, "spawn")):
        ds = shardflow.ShardDataset(srv.url, decode=None, io=io)
        shardflow.loader(ds, batch_size=8, num_workers=2, multiprocessing_context=context)
        assert ds._forked_workers == (2 if context is None else 0)
        srv.reset_stats()
        with ds.epoch_run(2).start():  # what iter() runs before starting the workers
            pass
        assert srv.stats.gets == 0


def test_another_ranks_sweep_keeps_the_bytes_fetched_before_the_workers_start(http_server, tmp_path):
    """Between the end of the main process's fetches and its workers' arrival nobody holds the
    area; another rank's worker entering its own area in the same folder sweeps the areas nobody
    holds, and used to remove this one: the workers fetched those shards again (a trial with 2
    ranks on S3 saw every shard of a rank fetched twice)."""
    srv = http_server
    want = write(tmp_path / "d", 600, 100)
    stored = serve(srv, tmp_path / "d")
    io = IOOptions(backoff=0.0, staging_dir=str(tmp_path / "staging"))
    ds = shardflow.ShardDataset(srv.url, decode=None, shuffle=True, seed=5, io=io)
    loader = shardflow.loader(ds, batch_size=8, num_workers=2, collate_fn=list)
    first = first_shard_names(ds, 2)
    srv.reset_stats()
    prefetch_first(ds, 0, 2)
    assert wait_until(lambda: set(srv.stats.gets_by_path) == first)
    assert wait_until(lambda: not any(t.name == "shardflow-prefetch" for t in threading.enumerate()))
    (area,) = os.listdir(tmp_path / "staging")  # fetched into, held by nobody now
    # rank 1's first worker (another process in a real run) enters its area in the same folder
    other = staging.staging_for(io, ds.urls, (storage.job_id(False), 1, 2, 0), 0, 2)
    assert list(staging.staged_epoch(iter(()), other)) == []
    assert area in os.listdir(tmp_path / "staging")  # not swept: its job is alive, its workers to come
    seen = [(s["__key__"], s["bin"]) for batch in loader for s in batch]
    assert sorted(seen) == sorted(want.items())
    assert tar_gets(srv) == 6, srv.stats.gets_by_path  # one GET per shard, the first ones before the sweep
    assert srv.stats.body_bytes == stored


def _exit() -> None:
    pass


def test_an_area_awaiting_the_workers_of_a_job_that_is_gone_is_swept(tmp_path):
    """The mark protects an area only while its job runs (a crashed job's area is removed)."""
    from shardflow.storage.sharing.areas import job_alive

    ctx = multiprocessing.get_context("fork")
    child = ctx.Process(target=_exit)
    child.start()
    child.join(10)
    io = IOOptions(staging_dir=str(tmp_path))
    urls = ["http://127.0.0.1:1/a.tar"]
    alive, gone = (staging.staging_for(io, urls, (job, 0, 1, 0), 0, 2).staging_scope for job in ("a", "b"))
    staging.let_go(staging.enter_area(alive, storage.job_id(False)))
    gone_job = f"{child.pid}@{storage.job_id(False).split('@')[1]}"  # the child's pid, gone now
    staging.let_go(staging.enter_area(gone, gone_job))
    assert job_alive(storage.job_id(False)) and not job_alive(gone_job)
    third = staging.staging_for(io, urls, ("c", 0, 1, 0), 0, 2)
    assert list(staging.staged_epoch(iter(()), third)) == []
    names = os.listdir(tmp_path)  # (a folder only this user can write holds the areas itself)
    assert os.path.basename(alive.root) in names and os.path.basename(gone.root) not in names


def _hold(ready, go) -> None:
    ready.set()  # (after the fork hooks ran in this child)
    go.wait(10)


@pytest.mark.parametrize("registered", [True, False])
def test_a_forked_child_does_not_keep_this_processes_claims(tmp_path, registered):
    """A flock belongs to the open file: a child's copy of a claim's descriptor would hold
    the claim after the parent let go of it. Registered descriptors are closed in the child."""
    obj = staged_blocks.StagedObject(StagingScope(str(tmp_path), 0, 2), "http://127.0.0.1:1/a.tar", FAST)
    fd = obj.claim(0)
    assert fd is not None
    if registered:
        staging.held_here(fd)
    ctx = multiprocessing.get_context("fork")
    ready, go = ctx.Event(), ctx.Event()
    child = ctx.Process(target=_hold, args=(ready, go))
    child.start()
    try:
        assert ready.wait(10)
        if registered:
            staging.let_go(fd)
        else:
            os.close(fd)
        again = obj.claim(0)  # another worker's look at the block, the child still alive
        assert (again is not None) == registered
        if again is not None:
            os.close(again)
    finally:
        go.set()
        child.join(10)
