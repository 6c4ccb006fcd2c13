"""Reading the first batch ahead (shardflow.phases): when it happens, and that it changes
nothing that is yielded (every needed position once; resumption exact)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from shardflow import ShardDataset, stages
from shardflow.loading import loader as make_loader
from shardflow.phases import PHASE_RATIO, first_phase, read_planned_in_phases
from shardflow.plan import RankPlan, ShuffleConfig, SplitConfig, plan_epoch, worker_batches
from tests.helpers import assert_resumes, make_shards

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")

SHUFFLE = ShuffleConfig(shards=True, buffer=40, initial=4)
COUNTS = [20] * 10
BATCH = 4


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_shards(tmp_path_factory.mktemp("phases"), COUNTS)


def _worker_positions(plan: RankPlan, step: int, worker: int, workers: int) -> tuple[np.ndarray, np.ndarray, int]:
    ids = [step + b for b in worker_batches(plan.num_batches - step, worker, workers, True)]
    sizes, order = plan.batch_positions(ids)
    needed = np.zeros(len(plan.read_sample), dtype=bool)
    needed[order] = True
    return needed, order, sizes[0]


def test_first_phase_only_when_the_first_batch_lies_far_back() -> None:
    plan = plan_epoch(COUNTS, 0, 1, 0, 0, SHUFFLE, SplitConfig(batch_size=BATCH))
    for workers in (1, 2):
        for worker in range(workers):  # a fresh epoch: the first batches are among the first reads
            assert first_phase(*_worker_positions(plan, 0, worker, workers)) is None
    needed, order, first = _worker_positions(plan, 25, 0, 2)  # mid-epoch: scattered over the buffer
    head = first_phase(needed, order, first)
    assert head is not None and head.tolist() == order[:first].tolist()
    assert np.count_nonzero(needed[: head.max() + 1]) > PHASE_RATIO * first
    assert first_phase(needed, order, 0) is None
    assert first_phase(needed, order[:first], first) is None  # one batch only: nothing to read later


def _read(data: Path, phased: bool, step: int) -> list[tuple[int, str]]:
    ds = ShardDataset(data, decode=None)
    plan = plan_epoch(COUNTS, 0, 1, 0, 0, SHUFFLE, SplitConfig(batch_size=BATCH))
    needed, order, first = _worker_positions(plan, step, 0, 2)
    policy = stages.ErrorPolicy("raise")
    if phased:
        items = read_planned_in_phases(plan, needed, order, first, ds.source, ds.io, policy, ds._offsets)  # noqa: SLF001
    else:
        items = stages.read_planned(plan, needed, ds.source, ds.io, policy, ds._offsets)  # noqa: SLF001
    return [(pos, s["__key__"]) for pos, s in items]


@pytest.mark.parametrize("step", [0, 13, 25, 40])
def test_phased_reading_reads_every_needed_position_once(data: Path, step: int) -> None:
    plain, phased = _read(data, False, step), _read(data, True, step)
    assert sorted(phased) == sorted(plain)
    assert len(set(p for p, _ in phased)) == len(phased)
    plan = plan_epoch(COUNTS, 0, 1, 0, 0, SHUFFLE, SplitConfig(batch_size=BATCH))
    head = first_phase(*_worker_positions(plan, step, 0, 2))
    if head is None:
        assert phased == plain
    else:  # the first batch's positions come first, in read order, then the rest in read order
        assert [p for p, _ in phased[: len(head)]] == sorted(head.tolist())
        rest = [p for p, _ in phased[len(head):]]
        assert rest == sorted(rest)


def _maker(data: Path, workers: int, on_error: str = "raise") -> Any:
    def make() -> Any:
        ds = ShardDataset(data, shuffle=SHUFFLE, decode=None, seed=0, on_error=on_error)
        return make_loader(ds, batch_size=BATCH, num_workers=workers, timeout=60 if workers else 0)

    return make


@pytest.mark.parametrize("workers,k", [(0, 20), (2, 25), (2, 27), (3, 12)])
def test_resume_through_the_first_phase_is_exact(data: Path, workers: int, k: int) -> None:
    plan = plan_epoch(COUNTS, 0, 1, 0, 0, SHUFFLE, SplitConfig(batch_size=BATCH))
    assert first_phase(*_worker_positions(plan, k, 0, max(workers, 1))) is not None  # the case under test
    assert_resumes(_maker(data, workers), k=k)


def test_resume_through_the_first_phase_with_a_truncated_shard(tmp_path: Path) -> None:
    folder = make_shards(tmp_path, COUNTS)
    shard = folder / "train-000004.tar"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])  # its last samples are gone
    make = _maker(folder, 2, on_error="skip")
    whole = [list(b["__key__"]) for b in make()]
    resumed = make()
    it = iter(resumed)
    head = [list(next(it)["__key__"]) for _ in range(25)]
    state = resumed.state_dict()
    del it, resumed
    third = make()
    third.load_state_dict(state)
    rest = [list(b["__key__"]) for b in third]
    assert head + rest == whole
    assert len({k for b in whole for k in b}) < sum(COUNTS)  # samples were lost, the same ones
