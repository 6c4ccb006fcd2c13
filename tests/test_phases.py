"""Reading the first batch ahead (shardflow.phases): when it happens, and that it changes
nothing that is yielded (every needed position once; resumption exact)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from shardflow import ShardDataset, reader
from shardflow.loading.shardloader import loader as make_loader
from shardflow.reader.phases import PHASE_RATIO, first_phase, read_planned_in_phases
from shardflow.policy import ErrorPolicy
from shardflow.planning.plan import RankPlan, ShuffleConfig, SplitConfig, plan_epoch, worker_batches
from tests.helpers import assert_resumes, make_shards

pytestmark = [pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning"), pytest.mark.usefixtures("fast_paths")]

SHUFFLE = ShuffleConfig(shards=True, buffer=40, initial=4, window=0)  # the phases of the interleaved read (a window reads by seeks)
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


def test_first_phase_of_a_resume_is_the_first_batch_alone() -> None:
    plan = plan_epoch(COUNTS, 0, 1, 0, 0, SHUFFLE, SplitConfig(batch_size=BATCH))
    for workers in (1, 2):
        for worker in range(workers):  # a fresh epoch: the first batches are among the first reads
            needed, order, first = _worker_positions(plan, 0, worker, workers)
            assert first_phase(needed, order, first) is None
            # bounded (local, indexed shards): what is needed up to the first batch's last position
            head = first_phase(needed, order, first, bounded=True)
            last = int(order[:first].max())
            assert head is not None and head.tolist() == np.flatnonzero(needed[: last + 1]).tolist()
            assert set(order[:first].tolist()) <= set(head.tolist()) and len(head) < len(order)
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
    policy = ErrorPolicy("raise")
    if phased:
        items = read_planned_in_phases(plan, needed, order, first, ds.shards, ds.io, policy, ds.shard_offsets)
    else:
        items = reader.read_planned(plan, needed, ds.shards, ds.io, policy, ds.shard_offsets)
    return [(pos, s["__key__"]) for pos, s in items]


@pytest.mark.parametrize("step", [0, 13, 25, 40])
def test_phased_reading_reads_every_needed_position_once(data: Path, step: int) -> None:
    plain, phased = _read(data, False, step), _read(data, True, step)
    assert sorted(phased) == sorted(plain)
    assert len(set(p for p, _ in phased)) == len(phased)
    plan = plan_epoch(COUNTS, 0, 1, 0, 0, SHUFFLE, SplitConfig(batch_size=BATCH))
    head = first_phase(*_worker_positions(plan, step, 0, 2), bounded=True)  # local shards with an index
    assert head is not None
    # the first phase's positions come first, in read order, then the rest in read order
    assert [p for p, _ in phased[: len(head)]] == sorted(head.tolist())
    rest = [p for p, _ in phased[len(head):]]
    assert rest == sorted(rest)
    if first_phase(*_worker_positions(plan, step, 0, 2)) is None:  # a fresh start: read order itself
        assert phased == plain


def _maker(data: Path, workers: int, on_error: str = "raise") -> Any:
    def make() -> Any:
        ds = ShardDataset(data, shuffle=SHUFFLE, decode=None, seed=0, on_error=on_error)
        return make_loader(ds, batch_size=BATCH, num_workers=workers, timeout=60 if workers else 0)

    return make


@pytest.mark.parametrize("workers,k", [(0, 20), (2, 25), (2, 26), (3, 14)])
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


@pytest.mark.parametrize("k", [0, 25])
def test_shards_without_an_index_are_read_in_one_phase_and_resume(tmp_path: Path, k: int) -> None:
    folder = make_shards(tmp_path, COUNTS, index=False)
    ds = ShardDataset(folder, decode=None)
    assert all(u is None for u in ds.shards.index_urls)
    assert_resumes(_maker(folder, 2), k=k)


@pytest.mark.parametrize("index", [True, False])
def test_phases_are_two_reads_only_with_an_offset_index(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, index: bool) -> None:
    folder = make_shards(tmp_path, COUNTS, index=index)
    calls = []
    read = reader.phases.read_planned

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(int(np.count_nonzero(args[1])))
        return read(*args, **kwargs)

    monkeypatch.setattr(reader.phases, "read_planned", counted)
    batches = list(_maker(folder, 0)())
    assert sum(len(b["__key__"]) for b in batches) == sum(COUNTS)
    if index:  # what the first batch needs (fresh start), then the rest
        assert len(calls) == 2 and sum(calls) == sum(COUNTS) and calls[0] < 3 * BATCH
    else:
        assert calls == [sum(COUNTS)]


def test_a_fresh_start_on_compressed_shards_with_an_index_streams_them_whole(tmp_path: Path) -> None:
    """Shards gzipped after their offset indexes were written: read from the start they
    stream whole, decompressed; the first phase (through the index) must not touch them."""
    import gzip

    folder = make_shards(tmp_path, COUNTS)
    for path in folder.glob("*.tar"):
        path.write_bytes(gzip.compress(path.read_bytes()))
    for workers in (0, 2):
        batches = list(_maker(folder, workers)())
        assert sorted(k for b in batches for k in b["__key__"]) == sorted(f"{i:06d}" for i in range(sum(COUNTS)))


def test_a_fresh_remote_start_fetches_later_shards_only_after_the_first_batchs_reads(tmp_path: Path, http_server: Any) -> None:
    """On a link, the first batch's bytes do not share it with the shards read after it:
    those are opened ahead only once its last read position is read (then all are read)."""
    from shardflow.storage import IOOptions

    folder = make_shards(tmp_path, COUNTS)
    for f in sorted(folder.iterdir()):
        http_server.put(f.name, f.read_bytes())
    ds = ShardDataset(http_server.url, decode=None, io=IOOptions(backoff=0.0, staging=False))
    plan = plan_epoch(COUNTS, 0, 1, 0, 0, SHUFFLE, SplitConfig(batch_size=BATCH))
    needed, order, first = _worker_positions(plan, 0, 0, 1)
    hold = int(order[:first].max())
    names = [Path(u).name for u in ds.shards.urls]
    window = {names[plan.segments[int(plan.read_segment[p])].shard] for p in range(hold + 1) if needed[p]}
    assert len(window) < len(COUNTS)  # the case under test: shards read after the first batch
    http_server.reset_stats()
    items = read_planned_in_phases(plan, needed, order, first, ds.shards, ds.io, ErrorPolicy("raise"), ds.shard_offsets)
    seen = []
    for pos, sample in items:
        seen.append((pos, sample["__key__"]))
        if pos == hold:
            fetched = {k for k in http_server.stats.gets_by_path if k.endswith(".tar")}
            assert fetched <= window, (fetched, window)
    local = ShardDataset(folder, decode=None)
    want = reader.read_planned(plan, needed, local.shards, local.io, ErrorPolicy("raise"), local.shard_offsets)
    assert seen == [(pos, sample["__key__"]) for pos, sample in want]  # every needed position once, in read order
    assert {k for k in http_server.stats.gets_by_path if k.endswith(".tar")} == set(names)
