"""A real 2-process DDP job (torch.distributed, gloo, CPU) over uneven shards.

Shards of 5, 3, 2 and 1 samples: splitting whole shards over 2 ranks would give
one rank 7 samples and the other 4, and the job would hang in the gradient
all-reduce of the extra steps. With the manifest both ranks take the same
number of steps, the job ends, and together the ranks read every sample.

The ranks are spawned with ``torch.multiprocessing`` and joined with a
deadline, so a hang fails the test instead of hanging CI. The ranks find their
rank through ``torch.distributed`` (nothing is passed to the dataset). One job
runs two epochs, to pay the start-up (torch, DDP) once:

- ``fork``: 2 forked DataLoader workers per rank, ``partial="pad"``;
- ``spawn``: 1 DataLoader worker per rank started the rank's default way
  (``spawn``, under ``torch.multiprocessing.spawn``): such a worker sees no
  process group and no ``RANK`` variable, and must still read only its rank's
  share; with ``drop_last=True``.
"""

from __future__ import annotations

import json
import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.helpers import make_shards, sample_key

WORLD = 2
SIZES = [5, 3, 2, 1]
DEADLINE_S = 300  # the whole job, start-up included (torch imports are slow on a busy CI machine)
COLLECTIVE_TIMEOUT = timedelta(seconds=240)  # a rank may wait long for the other to start up; the deadline catches hangs
PHASES = {"fork": {"context": "fork", "workers": 2, "drop_last": False}, "spawn": {"context": None, "workers": 1, "drop_last": True}}


def _train_epoch(rank: int, folder: str, context: str | None, workers: int, drop_last: bool) -> dict[str, Any]:
    """One epoch of a tiny DDP model, one optimizer step per batch, on a fresh dataset and loader."""
    import shardflow
    from shardflow.loading.shardloader import loader as make_loader  # the function, whatever the import order
    from shardflow.world import World

    torch.manual_seed(0)
    ds = shardflow.ShardDataset(folder, decode="numpy")  # rank and world size from torch.distributed
    if ds.world() != World(rank=rank, world_size=WORLD):
        raise AssertionError(f"rank {rank} detected {ds.world()}")
    ld = make_loader(
        ds, batch_size=2, num_workers=workers, drop_last=drop_last, timeout=240, multiprocessing_context=context
    )
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(1, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    planned = len(ld)
    steps, keys = 0, []
    for batch in ld:
        x = batch["cls"].to(torch.float32).unsqueeze(1)
        loss = (model(x) - x).pow(2).mean()
        opt.zero_grad()
        loss.backward()  # all-reduce: a rank with an extra step would wait here forever
        opt.step()
        steps += 1
        keys.extend(batch["__key__"])
    plan = ds.plan()
    return {
        "rank": rank,
        "planned": planned,
        "steps": steps,
        "keys": keys,
        "weights": [p.detach().flatten().tolist() for p in model.parameters()],
        "padding": plan.padding,
        "dropped": plan.dropped,
    }


def _rank_main(rank: int, folder: str, init_file: str, out_dir: str) -> None:
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD, timeout=COLLECTIVE_TIMEOUT
    )
    results = {}
    for name, phase in PHASES.items():
        report = _train_epoch(rank, folder, **phase)
        gathered: list[Any] = [None] * WORLD
        dist.all_gather_object(gathered, report)
        results[name] = gathered
    if rank == 0:
        Path(out_dir, "result.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()
    # Done and reported: skip the interpreter's teardown of torch (tens of seconds on a busy machine).
    os._exit(0)


@pytest.fixture(scope="module")
def ddp_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    tmp = tmp_path_factory.mktemp("ddp")
    folder = make_shards(tmp, SIZES)
    out = tmp / "out"
    out.mkdir()
    ctx = mp.spawn(_rank_main, args=(str(folder), str(tmp / "store"), str(out)), nprocs=WORLD, join=False)
    deadline = time.monotonic() + DEADLINE_S
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            for p in ctx.processes:
                p.join(5)
            pytest.fail(f"the DDP job did not end within {DEADLINE_S} s (a rank is waiting for the other)")
    return json.loads((out / "result.json").read_text())


@pytest.mark.slow
def test_ddp_uneven_shards_equal_steps_and_every_sample(ddp_results: dict[str, list[dict[str, Any]]]) -> None:
    results = ddp_results["fork"]
    assert [r["rank"] for r in results] == [0, 1]
    # 11 samples, partial="pad": 6 per rank (one padded), 3 steps of 2 on each rank, as len() said
    assert [(r["planned"], r["steps"]) for r in results] == [(3, 3), (3, 3)]
    assert [(r["padding"], r["dropped"]) for r in results] == [(1, 0), (1, 0)]
    union = [k for r in results for k in r["keys"]]
    assert sorted(set(union)) == [sample_key(i) for i in range(11)]
    assert len(union) == 12  # the 11 samples plus the declared padding
    assert results[0]["keys"] == [sample_key(i) for i in range(6)]
    assert results[1]["keys"] == [sample_key(i) for i in (6, 7, 8, 9, 10, 0)]
    assert results[0]["weights"] == results[1]["weights"]  # DDP kept the replicas in step


@pytest.mark.slow
def test_ddp_spawned_workers_keep_the_rank(ddp_results: dict[str, list[dict[str, Any]]]) -> None:
    results = ddp_results["spawn"]
    # drop_last on 6 per rank, batch 2: still 3 full steps on each rank
    assert [(r["planned"], r["steps"]) for r in results] == [(3, 3), (3, 3)]
    assert [r["keys"] for r in results] == [
        [sample_key(i) for i in range(6)],
        [sample_key(i) for i in (6, 7, 8, 9, 10, 0)],
    ]
    assert results[0]["weights"] == results[1]["weights"]
