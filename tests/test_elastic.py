"""Elastic resumption (DESIGN §7, :mod:`shardflow.planning.elastic`) and one batch order for any worker count.

Two ranks stop mid-epoch; the state of rank 0 alone resumes on 1, 3, 4 or 7
ranks with 0 to 3 workers: the samples the two ranks had not taken come out
exactly once across the new ranks (plus the declared padding), every new rank
takes the same number of batches, and the next epoch is a plain epoch of the
new world. A real 2-process gloo job checkpoints on rank 0 only and resumes
from that one state on both ranks.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from shardflow import ShardDataset, Source
from shardflow.errors import StateError
from shardflow.loading.shardloader import ShardLoader
from shardflow.loading.shardloader import loader as make_loader
from shardflow.planning.plan import ShuffleConfig
from tests.helpers import make_shards, sample_key

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")

SHUFFLE = ShuffleConfig(shards=True, buffer=16)
ALL = [sample_key(i) for i in range(100)]


@pytest.fixture(scope="module")
def hundred(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_shards(tmp_path_factory.mktemp("elastic"), [10] * 10)


def maker(folder: Path, world: int, *, workers: int = 0, batch: int = 4, **ds_kw: Any) -> Callable[[int], ShardLoader]:
    kw = {"shuffle": SHUFFLE, "seed": 0, **ds_kw}

    def make(rank: int) -> ShardLoader:
        ds = ShardDataset(folder, decode=None, rank=rank, world_size=world, **kw)
        return make_loader(ds, batch_size=batch, num_workers=workers, timeout=60 if workers else 0)

    return make


def keys(batches: list[Any]) -> list[str]:
    return [k for b in batches for k in b["__key__"]]


def stop_two_ranks(folder: Path, k: int, workers: int = 2) -> tuple[dict[str, Any], list[str], list[list[str]]]:
    """Two ranks take k batches each; returns rank 0's state, the keys taken, and each rank's whole epoch."""
    make = maker(folder, 2, workers=workers)
    whole = [keys(list(make(r))) for r in range(2)]
    taken: list[str] = []
    state = None
    for r in range(2):
        ld = make(r)
        it = iter(ld)
        head = [next(it) for _ in range(k)]
        taken += keys(head)
        if r == 0:
            state = ld.state_dict()
        del it, ld
    assert state is not None
    return json.loads(json.dumps(state)), taken, whole


@pytest.mark.parametrize("world, workers", [(1, 0), (1, 3), (3, 0), (3, 2), (4, 1), (7, 0)])
def test_stop_two_ranks_resume_on_another_world(hundred: Path, world: int, workers: int) -> None:
    state, taken, whole = stop_two_ranks(hundred, k=5)
    assert state["remaining"] == [[2, 5]]  # the layout: 5 steps taken on a world of 2
    assert len(taken) == 40 and sorted(whole[0] + whole[1]) == ALL
    left = [key for w in whole for key in w if key not in set(taken)]  # 60, in the saved ranks' order
    make = maker(hundred, world, workers=workers)
    per_rank, lens, nexts = [], [], []
    for r in range(world):
        ld = make(r)
        ld.load_state_dict(state)  # rank 0's state, on every new rank
        lens.append(len(ld))
        per_rank.append(keys(list(ld)))
        nexts.append(keys(list(ld)))  # the epoch after: a plain epoch of the new world
    m = -(-60 // world)
    assert [len(x) for x in per_rank] == [m] * world  # equal shares: 60, 20, 15, 9 (7 ranks: 3 padded)
    assert lens == [-(-m // 4)] * world  # and equal batch counts, as len() said
    got = Counter(key for x in per_rank for key in x)
    assert set(got) == set(left) and sum(got.values()) == m * world
    assert sorted(k for k, c in got.items() if c == 2) == sorted(left[: m * world - 60])  # padding: the first ones again
    assert [x for x in per_rank for x in x][:60] == left  # in the saved order
    plain = maker(hundred, world, workers=workers)
    for r in range(world):
        fresh = plain(r)
        fresh.dataset.set_epoch(1)
        assert nexts[r] == keys(list(fresh)), r
    assert set().union(*map(set, nexts)) == set(ALL) and len(nexts[0]) == -(-100 // world)


def test_resume_on_the_same_world_from_the_other_ranks_state(hundred: Path) -> None:
    state, _, whole = stop_two_ranks(hundred, k=6)
    make = maker(hundred, 2, workers=3)
    for r in range(2):
        ld = make(r)
        ld.load_state_dict(state)  # saved on rank 0; ranks step together, so rank 1 continues at step 6
        assert keys(list(ld)) == whole[r][24:]


def test_elastic_twice_in_one_epoch(hundred: Path) -> None:
    """2 ranks take 5 steps, 3 ranks take 2 more, then 1 rank finishes: every sample once."""
    state, taken, _ = stop_two_ranks(hundred, k=5)
    make3 = maker(hundred, 3, workers=2)
    state3 = None
    for r in range(3):
        ld = make3(r)
        ld.load_state_dict(state)
        it = iter(ld)
        taken += keys([next(it), next(it)])
        if r == 2:
            state3 = ld.state_dict()
        del it, ld
    assert state3 is not None and state3["remaining"] == [[2, 5], [3, 2]]
    one = maker(hundred, 1, workers=1)(0)
    one.load_state_dict(state3)
    rest = keys(list(one))
    assert len(taken) == 64 and len(rest) == 36
    assert sorted(taken + rest) == ALL


def test_dataset_iterated_directly_resumes_elastically(hundred: Path) -> None:
    taken: list[str] = []
    state = None
    for r in range(2):
        ds = ShardDataset(hundred, shuffle=SHUFFLE, seed=0, decode=None, rank=r, world_size=2)
        it = iter(ds)
        taken += [next(it)["__key__"] for _ in range(17)]
        if r == 1:
            state = ds.state_dict()
    assert state is not None and state["remaining"] == [[2, 17]]
    rest = []
    for r in range(3):
        ds = ShardDataset(hundred, shuffle=SHUFFLE, seed=0, decode=None, rank=r, world_size=3)
        ds.load_state_dict(state)
        assert len(ds) == 34  # len() is the coming epoch's: the resumed one holds 22 per rank
        rest.append([s["__key__"] for s in ds])
    assert [len(x) for x in rest] == [22, 22, 22]  # 66 remaining over 3 ranks
    assert sorted(taken + [k for x in rest for k in x]) == ALL


def test_elastic_resume_in_a_mixture(tmp_path: Path) -> None:
    big = make_shards(tmp_path, [50, 50], name="big")
    small = make_shards(tmp_path, [8], name="small")
    sources = [Source(big, weight=3), Source(small, weight=1)]

    def ds(rank: int, world: int) -> ShardDataset:
        return ShardDataset(sources, samples_per_epoch=24, shuffle=SHUFFLE, seed=3, decode=None, rank=rank, world_size=world)

    whole = [[(s["__source__"], s["__key__"]) for s in ds(r, 2)] for r in range(2)]
    loaders = [make_loader(ds(r, 2), batch_size=4) for r in range(2)]
    its = [iter(ld) for ld in loaders]
    taken = [(s, k) for it in its for _ in range(2) for b in [next(it)] for s, k in zip(b["__source__"].tolist(), b["__key__"])]
    state = loaders[1].state_dict()
    rest = []
    for r in range(3):
        ld = make_loader(ds(r, 3), batch_size=4)
        ld.load_state_dict(state)
        batches = list(ld)
        assert len(batches) == 3  # 32 remaining: 11 per rank (one padded), 3 batches each
        rest += [(s, k) for b in batches for s, k in zip(b["__source__"].tolist(), b["__key__"])]
    want = Counter(whole[0] + whole[1])  # 48: quotas 36 and 12 (the small source: 8, then 4 of its next pass)
    got = Counter(taken + rest)
    assert len(taken) == 16 and len(rest) == 33  # 32 remaining: 11 per new rank, the last one padded
    assert got - want == Counter({rest[0]: 1}) and want - got == Counter()  # the padding repeats the first remaining
    assert Counter(s for s, _ in taken + rest[:32]) == {0: 36, 1: 12}  # the epoch's quotas, kept


def test_what_cannot_be_honoured_still_raises(hundred: Path) -> None:
    state, _, _ = stop_two_ranks(hundred, k=3, workers=0)
    for other, name in (
        (maker(hundred, 3, seed=1), "seed: saved 0, now 1"),
        (maker(hundred, 3, batch=5), "batch_size: saved 4, now 5"),
        (maker(hundred, 3, shuffle=False), "shuffle: saved"),
    ):
        with pytest.raises(StateError, match=name) as e:
            other(0).load_state_dict(state)
        assert "world_size" not in str(e.value)  # the world may change: not a difference
    with pytest.raises(StateError, match=r"seed: saved 0, now 1; batch_size: saved 4, now 5"):  # each one named
        maker(hundred, 2, seed=1, batch=5)(0).load_state_dict(state)
    fewer = make_shards(hundred.parent, [10] * 9, name="fewer")
    with pytest.raises(StateError, match="shards: saved"):
        maker(fewer, 2)(0).load_state_dict(state)
    with pytest.raises(StateError, match=r"\[world_size, steps\] pairs"):
        maker(hundred, 2)(0).load_state_dict({**state, "remaining": [[0, 1, 2]]})


@pytest.mark.parametrize("shuffle", [SHUFFLE, ShuffleConfig(shards=True, buffer=7, interleave=3)], ids=["buffer16", "interleave3"])
def test_shuffled_batch_sequence_is_the_same_for_any_worker_count(hundred: Path, shuffle: ShuffleConfig) -> None:
    runs = {}
    for workers in (0, 1, 2, 3):
        for r in range(2):
            ds = ShardDataset(hundred, shuffle=shuffle, seed=9, decode=None, rank=r, world_size=2)
            runs[(workers, r)] = [b["__key__"] for b in make_loader(ds, batch_size=3, num_workers=workers, timeout=60 if workers else 0)]
    for r in range(2):
        assert runs[(0, r)] == runs[(1, r)] == runs[(2, r)] == runs[(3, r)]
        assert len(runs[(0, r)]) == 17
    flat = [k for b in runs[(0, 0)] for k in b]
    assert flat != sorted(flat)  # really shuffled
    assert sorted(k for r in range(2) for b in runs[(0, r)] for k in b) == ALL


# ---------------------------------------------------------------- a real 2-process job

WORLD = 2
DEADLINE_S = 300
COLLECTIVE_TIMEOUT = timedelta(seconds=240)


def _job(rank: int, folder: str, init_file: str, out_dir: str) -> None:
    """Both ranks take 4 steps; rank 0 alone saves the loader state (as training scripts do);
    both ranks then build a fresh loader, load that one state and finish the epoch."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD, timeout=COLLECTIVE_TIMEOUT)
    from shardflow.loading.shardloader import loader as make

    def fresh() -> ShardLoader:
        ds = ShardDataset(folder, shuffle=SHUFFLE, seed=0, decode=None)  # ranks from torch.distributed
        return make(ds, batch_size=4, num_workers=2, timeout=120, multiprocessing_context="fork")

    ld = fresh()
    it = iter(ld)
    head = [next(it)["__key__"] for _ in range(4)]
    dist.barrier()
    ckpt = Path(out_dir, "ckpt.json")
    if rank == 0:
        ckpt.write_text(json.dumps(ld.state_dict()))
    del it, ld
    dist.barrier()
    resumed = fresh()
    resumed.load_state_dict(json.loads(ckpt.read_text()))  # every rank, rank 0's state
    planned = len(resumed)
    rest = [b["__key__"] for b in resumed]
    report = {"rank": rank, "head": head, "rest": rest, "planned": planned}
    gathered: list[Any] = [None] * WORLD
    dist.all_gather_object(gathered, report)
    if rank == 0:
        Path(out_dir, "result.json").write_text(json.dumps(gathered))
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


@pytest.mark.slow
def test_gloo_job_checkpoints_on_rank_0_and_resumes_on_both(hundred: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    ctx = mp.spawn(_job, args=(str(hundred), str(tmp_path / "store"), str(out)), nprocs=WORLD, join=False)
    deadline = time.monotonic() + DEADLINE_S
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            pytest.fail(f"the job did not end within {DEADLINE_S} s")
    results = json.loads((out / "result.json").read_text())
    whole = [[b for b in make_loader(ShardDataset(hundred, shuffle=SHUFFLE, seed=0, decode=None, rank=r, world_size=2), batch_size=4)] for r in range(2)]
    for r, res in enumerate(results):
        want = [b["__key__"] for b in whole[r]]
        assert res["planned"] == 13 and res["head"] + res["rest"] == want, r  # exactly the uninterrupted epoch
        assert len(res["rest"]) == 9
    assert sorted(k for res in results for b in res["head"] + res["rest"] for k in b) == ALL
