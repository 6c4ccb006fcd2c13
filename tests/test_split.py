"""Splitting an epoch over ranks and DataLoader workers (cases C01-C05).

Ranks are simulated in one process by passing ``rank``/``world_size``; the
workers are real DataLoader worker processes (``fork``). Every loader gets a
``timeout`` so that a worker that hangs fails the test instead of CI.
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, get_worker_info

from shardflow import ShardDataset
from shardflow.errors import ShardflowError
# `shardflow.loader` (the function) is shadowed by the submodule once another test imports it:
# take the function from its module.
from shardflow.loading.shardloader import ShardLoader
from shardflow.loading.shardloader import loader as make_loader
from shardflow.planning.plan import ShuffleConfig
from tests.helpers import batch_keys, keys_of, make_shards, sample_key, shard_urls, worker_collate

TIMEOUT = 60  # seconds a loader waits for one batch before failing

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")


def keys(*ids: int) -> list[str]:
    return [sample_key(i) for i in ids]


def rank_loader(folder: Any, rank: int, world: int, batch: int, workers: int, **kw: Any) -> ShardLoader:
    ds_kw = {k: kw.pop(k) for k in ("shuffle", "seed", "partial") if k in kw}
    ds = ShardDataset(folder, rank=rank, world_size=world, decode="numpy", **ds_kw)
    return make_loader(ds, batch_size=batch, num_workers=workers, collate_fn=worker_collate, timeout=TIMEOUT, **kw)


def streams_of(batches: list[dict[str, Any]]) -> dict[int, list[str]]:
    """Keys per worker, in yield order."""
    out: dict[int, list[str]] = {}
    for b in batches:
        out.setdefault(b["__worker__"], []).extend(keys_of(b))
    return out


def tag_worker(sample: dict[str, Any]) -> dict[str, Any]:
    """A transform that records the worker id (module level: picklable)."""
    info = get_worker_info()
    sample["worker"] = -1 if info is None else info.id
    return sample


# ---------------------------------------------------------------- C01


@pytest.fixture(scope="module")
def one_shard(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_shards(tmp_path_factory.mktemp("c01"), [10])


def test_c01_one_shard_two_ranks(one_shard: Path) -> None:
    want = {0: [keys(0, 1), keys(2, 3), keys(4)], 1: [keys(5, 6), keys(7, 8), keys(9)]}
    seen: list[str] = []
    for rank in range(2):
        ld = rank_loader(one_shard, rank, 2, batch=2, workers=2)
        assert len(ld) == 3
        assert len(ld.dataset) == 5
        batches = list(ld)
        assert batch_keys(batches) == want[rank]
        # stored order: batches go round robin over the workers, so the DataLoader yields them in order
        assert [b["__worker__"] for b in batches] == [0, 1, 0]
        assert [b["cls"].tolist() for b in batches] == [[int(k) for k in ks] for ks in want[rank]]
        assert batches[0]["cls"].dtype == torch.int64
        seen += [k for b in batches for k in keys_of(b)]
    assert sorted(seen) == keys(*range(10)) and len(seen) == 10


def test_c01_worker_with_no_data_ends_cleanly(one_shard: Path) -> None:
    # 3 batches over 4 workers: worker 3 gets none and must just end
    for rank, first in ((0, 0), (1, 5)):
        ld = rank_loader(one_shard, rank, 2, batch=2, workers=4)
        batches = list(ld)
        assert batch_keys(batches) == [keys(first, first + 1), keys(first + 2, first + 3), keys(first + 4)]
        assert [b["__worker__"] for b in batches] == [0, 1, 2]
        assert ld.dataset.stats["samples"] == 5
        assert list(ld) != []  # and the next epoch runs too


def test_c01_dataset_without_loader(one_shard: Path) -> None:
    # main process and a plain DataLoader over the dataset: the same split
    for rank in range(2):
        ds = ShardDataset(one_shard, rank=rank, world_size=2)
        assert [s["__key__"] for s in ds] == keys(*range(5 * rank, 5 * rank + 5))
        ds = ShardDataset(one_shard, rank=rank, world_size=2, transform=tag_worker)
        dl = DataLoader(ds, batch_size=None, num_workers=2, timeout=TIMEOUT)
        got = [(s["__key__"], s["worker"]) for s in dl]
        assert got == list(zip(keys(*range(5 * rank, 5 * rank + 5)), [0, 1, 0, 1, 0]))  # stored order


@pytest.mark.parametrize("how", ["folder", "urls"])
def test_c01_without_manifest_a_rank_without_data_raises(tmp_path: Path, how: str) -> None:
    folder = make_shards(tmp_path, [10], manifest=False)
    source: Any = folder if how == "folder" else shard_urls(folder)
    assert not ShardDataset(source).sized
    # every rank fails, at construction (not later in a worker), so no rank waits for the other
    for rank in range(2):
        with pytest.raises(ShardflowError, match=r"1 shard\(s\) cannot be split over 2 ranks.*rank 1 would get no data.*shardflow index"):
            ShardDataset(source, rank=rank, world_size=2)
    with pytest.raises(ShardflowError, match=r"ranks 1 to 2 would get no data"):
        ShardDataset(source, rank=0, world_size=3)
    # one rank, two workers: worker 1 has no shard and ends cleanly
    ds = ShardDataset(source, rank=0, world_size=1)
    got = batch_keys(make_loader(ds, batch_size=2, num_workers=2, timeout=TIMEOUT))
    assert got == [keys(0, 1), keys(2, 3), keys(4, 5), keys(6, 7), keys(8, 9)]


# ---------------------------------------------------------------- C02


@pytest.mark.parametrize("partial", ["pad", "drop"])
def test_c02_uneven_shards_equal_batches(tmp_path: Path, partial: str) -> None:
    folder = make_shards(tmp_path, [4, 4, 2])
    want = {0: [keys(0, 1), keys(2, 3), keys(4)], 1: [keys(5, 6), keys(7, 8), keys(9)]}
    for rank in range(2):
        ld = rank_loader(folder, rank, 2, batch=2, workers=2, partial=partial)
        assert len(ld) == 3  # from the manifest, before iterating
        plan = ld.dataset.plan()
        assert (plan.samples, plan.num_batches, plan.padding, plan.dropped) == (5, 3, 0, 0)
        assert batch_keys(ld) == want[rank]
    for rank in range(2):
        ld = rank_loader(folder, rank, 2, batch=2, workers=2, partial=partial, drop_last=True)
        assert len(ld) == 2
        plan = ld.dataset.plan()
        assert (plan.samples, plan.num_batches, plan.padding, plan.dropped) == (5, 2, 0, 2)
        assert batch_keys(ld) == want[rank][:2]


def test_c02_remainder_policy_pad_and_drop(tmp_path: Path) -> None:
    folder = make_shards(tmp_path, [4, 4, 3])  # 11 samples over 2 ranks
    pad = [rank_loader(folder, r, 2, batch=2, workers=2, partial="pad") for r in range(2)]
    assert [len(ld) for ld in pad] == [3, 3]
    assert [len(ld.dataset) for ld in pad] == [6, 6]
    assert [ld.dataset.plan().padding for ld in pad] == [1, 1]  # reported, total over ranks
    assert [batch_keys(ld) for ld in pad] == [
        [keys(0, 1), keys(2, 3), keys(4, 5)],
        [keys(6, 7), keys(8, 9), keys(10, 0)],  # padding repeats the stream's start
    ]
    drop = [rank_loader(folder, r, 2, batch=2, workers=2, partial="drop") for r in range(2)]
    assert [len(ld) for ld in drop] == [3, 3]
    assert [len(ld.dataset) for ld in drop] == [5, 5]
    assert [(ld.dataset.plan().padding, ld.dataset.plan().dropped) for ld in drop] == [(0, 1), (0, 1)]
    assert [batch_keys(ld) for ld in drop] == [
        [keys(0, 1), keys(2, 3), keys(4)],
        [keys(5, 6), keys(7, 8), keys(9)],  # sample 10 is the declared drop
    ]
    with pytest.raises(ValueError, match="partial"):
        ShardDataset(folder, partial="wrap")


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("sizes", [[4, 4, 2], [7, 1, 1, 1, 3], [1, 9]])
def test_c02_equal_batch_counts_for_any_split(tmp_path: Path, sizes: list[int], shuffle: bool) -> None:
    folder = make_shards(tmp_path, sizes)
    total = sum(sizes)
    got = []
    for rank in range(3):
        ld = rank_loader(folder, rank, 3, batch=2, workers=2, shuffle=shuffle, seed=5)
        batches = batch_keys(ld)
        assert len(batches) == len(ld)
        got.append(batches)
    assert len({len(b) for b in got}) == 1, [len(b) for b in got]
    flat = Counter(k for r in got for b in r for k in b)
    padding = -(-total // 3) * 3 - total
    assert set(flat) == set(keys(*range(total))) and sum(flat.values()) == total + padding


# ---------------------------------------------------------------- C03


@pytest.fixture(scope="module")
def eight_shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_shards(tmp_path_factory.mktemp("c03"), [5] * 8)


@pytest.mark.parametrize("shuffle", [False, True])
def test_c03_every_key_once_over_all_streams(eight_shards: Path, shuffle: bool) -> None:
    per_rank: dict[int, list[str]] = {}
    streams: dict[tuple[int, int], list[str]] = {}
    for rank in range(2):
        ld = rank_loader(eight_shards, rank, 2, batch=1, workers=4, shuffle=shuffle, seed=0)
        for w, ks in streams_of(list(ld)).items():
            streams[(rank, w)] = ks
        per_rank[rank] = [k for (r, _), ks in streams.items() if r == rank for k in ks]
    assert sorted(streams) == [(r, w) for r in range(2) for w in range(4)]
    assert [len(v) for v in streams.values()] == [5] * 8
    everything = Counter(k for ks in streams.values() for k in ks)
    assert sorted(everything) == keys(*range(40)) and set(everything.values()) == {1}
    assert [len(per_rank[r]) for r in range(2)] == [20, 20]
    assert not set(per_rank[0]) & set(per_rank[1])


def test_c03_ten_items_four_workers_no_ranks(tmp_path: Path) -> None:
    folder = make_shards(tmp_path, [10])
    ld = make_loader(ShardDataset(folder), batch_size=1, num_workers=4, timeout=TIMEOUT)
    assert len(ld) == 10
    got = [k for b in ld for k in keys_of(b)]
    assert sorted(got) == keys(*range(10))
    # a plain DataLoader over the dataset splits over its workers too
    dl = DataLoader(ShardDataset(folder), batch_size=None, num_workers=4, timeout=TIMEOUT)
    assert sorted(s["__key__"] for s in dl) == keys(*range(10))
    dl = DataLoader(ShardDataset(folder), batch_size=3, num_workers=4, timeout=TIMEOUT)
    assert sorted(k for b in dl for k in b["__key__"]) == keys(*range(10))
    # and without a manifest (whole shards per worker) it is still 10, not 40
    os.remove(folder / "shardflow.json")
    ds = ShardDataset(folder)
    assert not ds.sized
    got = [k for b in make_loader(ds, batch_size=1, num_workers=4, timeout=TIMEOUT) for k in keys_of(b)]
    assert sorted(got) == keys(*range(10))


# ---------------------------------------------------------------- C04


@pytest.fixture(scope="module")
def six_by_four(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_shards(tmp_path_factory.mktemp("c04"), [4] * 6)


@pytest.mark.parametrize("num_workers", [0, 1, 2, 4, 8])
def test_c04_counts_do_not_depend_on_num_workers(six_by_four: Path, num_workers: int) -> None:
    ld = make_loader(ShardDataset(six_by_four), batch_size=8, num_workers=num_workers, timeout=TIMEOUT if num_workers else 0)
    got = batch_keys(ld)
    assert len(ld) == len(got) == 3
    assert sorted(k for b in got for k in b) == keys(*range(24))
    assert got == [keys(*range(0, 8)), keys(*range(8, 16)), keys(*range(16, 24))]  # and the same batches
    ld = make_loader(
        ShardDataset(six_by_four), batch_size=8, num_workers=num_workers, drop_last=True, timeout=TIMEOUT if num_workers else 0
    )
    got = batch_keys(ld)
    assert len(ld) == len(got) == 3 and [len(b) for b in got] == [8, 8, 8]


@pytest.mark.parametrize("num_workers", [0, 2, 4, 8])
def test_c04_len_matches_a_pass_with_a_remainder(tmp_path: Path, num_workers: int) -> None:
    folder = make_shards(tmp_path, [4, 4, 4, 4, 4, 3])  # 23 samples
    for drop_last, sizes in ((False, [8, 8, 7]), (True, [8, 8])):
        ld = make_loader(
            ShardDataset(folder), batch_size=8, num_workers=num_workers, drop_last=drop_last, timeout=TIMEOUT if num_workers else 0
        )
        got = batch_keys(ld)
        assert len(ld) == len(got) and [len(b) for b in got] == sizes
        assert ld.dataset.plan().dropped == (7 if drop_last else 0)


def test_c04_unsized_stream_has_no_len(six_by_four: Path, tmp_path: Path) -> None:
    urls = shard_urls(six_by_four)
    bare = tmp_path / "bare"
    bare.mkdir()
    for u in urls:
        os.link(u, bare / Path(u).name)
    ds = ShardDataset(bare)
    assert not ds.sized
    with pytest.raises(TypeError, match="no manifest"):
        len(ds)
    ld = make_loader(ds, batch_size=8, num_workers=4, timeout=TIMEOUT)
    with pytest.raises(TypeError, match="no manifest"):
        len(ld)
    got = batch_keys(ld)  # still every sample once
    assert sorted(k for b in got for k in b) == keys(*range(24))


# ---------------------------------------------------------------- C05


@pytest.fixture(scope="module")
def sixteen(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_shards(tmp_path_factory.mktemp("c05"), [1] * 16)


def c05_epochs(folder: Path, persistent: bool, epochs: list[int | None]) -> list[dict[tuple[int, int], list[str]]]:
    """Streams ``(rank, worker) -> keys`` of each epoch; None: no set_epoch."""
    loaders = [
        rank_loader(folder, rank, 2, batch=1, workers=2, shuffle=True, seed=0, persistent_workers=persistent)
        for rank in range(2)
    ]
    out = []
    for e in epochs:
        streams: dict[tuple[int, int], list[str]] = {}
        for rank, ld in enumerate(loaders):
            if e is not None:
                ld.dataset.set_epoch(e)
            for w, ks in streams_of(list(ld)).items():
                streams[(rank, w)] = ks
        out.append(streams)
    return out


def test_c05_epochs_are_partitions_and_reproducible(sixteen: Path) -> None:
    runs = {p: c05_epochs(sixteen, p, [0, 1, 2]) for p in (False, True)}
    for persistent, epochs in runs.items():
        for e, streams in enumerate(epochs):
            assert sorted(streams) == [(0, 0), (0, 1), (1, 0), (1, 1)], (persistent, e)
            assert [len(v) for v in streams.values()] == [4, 4, 4, 4]
            assert sorted(k for v in streams.values() for k in v) == keys(*range(16))
        for a, b in ((0, 1), (1, 2), (0, 2)):
            assignment = [{s: set(v) for s, v in epochs[i].items()} for i in (a, b)]
            assert assignment[0] != assignment[1], f"epochs {a} and {b} assign the same keys to every stream"
            assert all(epochs[a][s] != epochs[b][s] for s in epochs[a]), f"epochs {a} and {b} share a stream order"
    assert runs[False] == runs[True]  # persistent workers or not: the same epochs
    assert c05_epochs(sixteen, False, [2, 0]) == [runs[False][2], runs[False][0]]  # (seed, epoch) reproduces
    # exact first epoch, so that a change of order on another machine or version shows
    # (workers take the rank's batches round robin: rank 0 yields 0, 6, 15, 8, 5, 3, 9, 7 for any worker
    # count; the window shuffle, shardflow.window, strides the epoch's permutation over the ranks)
    assert runs[False][0][(0, 0)] == keys(0, 15, 5, 9)
    assert runs[False][0][(0, 1)] == keys(6, 8, 3, 7)


@pytest.mark.parametrize("persistent", [False, True])
def test_c05_new_iter_without_set_epoch_starts_the_next_epoch(sixteen: Path, persistent: bool) -> None:
    recorded = c05_epochs(sixteen, False, [0, 1, 2])
    assert c05_epochs(sixteen, persistent, [None, None, None]) == recorded
    assert c05_epochs(sixteen, persistent, [1, None]) == recorded[1:]


def test_c05_dataset_without_loader_advances_epochs(sixteen: Path) -> None:
    ds = ShardDataset(sixteen, shuffle=True, seed=0, rank=0, world_size=2)
    first, second = [s["__key__"] for s in ds], [s["__key__"] for s in ds]
    assert first != second and len(first) == len(second) == 8
    ds2 = ShardDataset(sixteen, shuffle=True, seed=0, rank=0, world_size=2)
    ds2.set_epoch(1)
    assert [s["__key__"] for s in ds2] == second
    ds2.set_epoch(0)
    assert [s["__key__"] for s in ds2] == first


# ---------------------------------------------------------------- mixing


def test_shuffled_batches_mix_shards(tmp_path: Path) -> None:
    folder = make_shards(tmp_path, [10] * 10)

    def shards_per_batch(shuffle: Any) -> list[int]:
        ld = make_loader(ShardDataset(folder, shuffle=shuffle, seed=0), batch_size=4, num_workers=2, timeout=TIMEOUT)
        return [len(set(b["__url__"])) for b in ld]

    assert min(shards_per_batch(True)) >= 2
    # a 16-sample buffer over 4 interleaved shards: a batch of 4 from a single shard happens by chance
    small = shards_per_batch(ShuffleConfig(shards=True, buffer=16))
    assert sum(n >= 2 for n in small) >= 0.9 * len(small)
    # stored order: only the batches that straddle a shard boundary mix (batches 2, 7, 12, ...), and
    # the loader yields the batches in plan order (round robin over the workers)
    assert shards_per_batch(False) == [2 if b % 5 == 2 else 1 for b in range(25)]


@pytest.mark.parametrize("persistent", [False, True])
def test_c05_plain_dataloader_epochs(sixteen: Path, persistent: bool) -> None:
    """A plain torch DataLoader over the dataset: epochs advance per iter() and follow set_epoch,
    also in persistent workers (the epoch lives in shared memory)."""

    def epoch_keys(e: int) -> list[str]:
        ds = ShardDataset(sixteen, shuffle=True, seed=0, rank=1, world_size=2)
        ds.set_epoch(e)
        return sorted(s["__key__"] for s in DataLoader(ds, batch_size=None, num_workers=2, timeout=TIMEOUT))

    want = [epoch_keys(e) for e in range(3)]
    assert want[0] != want[1] != want[2]
    ds = ShardDataset(sixteen, shuffle=True, seed=0, rank=1, world_size=2)
    dl = DataLoader(ds, batch_size=None, num_workers=2, persistent_workers=persistent, timeout=TIMEOUT)
    got = [sorted(s["__key__"] for s in dl) for _ in range(3)]
    assert got == want  # a new iter() is the next epoch
    ds.set_epoch(1)
    assert sorted(s["__key__"] for s in dl) == want[1]


@pytest.mark.parametrize("persistent", [False, True])
def test_c05_epochs_agree_after_iterating_in_this_process(sixteen: Path, persistent: bool) -> None:
    """An epoch iterated in the main process (a sanity pass before training, say),
    then a DataLoader: both workers must start the same next epoch, or they split
    different plans and yield some samples twice and others never."""
    ds = ShardDataset(sixteen, shuffle=True, seed=0, rank=1, world_size=2)
    assert len({s["__key__"] for s in ds}) == 8  # epoch 0, in this process
    dl = DataLoader(ds, batch_size=None, num_workers=2, persistent_workers=persistent, timeout=TIMEOUT)
    second = [s["__key__"] for s in dl]  # epoch 1, in 2 workers
    assert len(second) == len(set(second)) == 8  # this rank's 8 samples, each once
    ref = ShardDataset(sixteen, shuffle=True, seed=0, rank=1, world_size=2)
    ref.set_epoch(1)
    assert second == [s["__key__"] for s in DataLoader(ref, batch_size=None, num_workers=2, timeout=TIMEOUT)]
    assert [s["__key__"] for s in ds] != second  # and the main process goes on with epoch 2


def test_world_detection(monkeypatch: pytest.MonkeyPatch) -> None:
    from shardflow.world import World

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert World.detect() == World(0, 1)
    # a spawned DataLoader worker sees no process group: it takes the ranks the main process found
    assert World.detect(default=(1, 2)) == World(1, 2)
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert World.detect(default=(1, 2)) == World(3, 4)  # torchrun's variables first
    assert World.detect(0, 2) == World(0, 2)  # explicit wins
    with pytest.raises(ValueError, match="both"):
        World.detect(rank=1)


def test_a_dataset_given_to_a_loader_still_iterates_samples(sixteen: Path) -> None:
    """shardflow.loader(ds) configures ds for its batches; ds itself, and a plain
    DataLoader over it, still yield samples (not the loader's batch records)."""
    ds = ShardDataset(sixteen, shuffle=True, seed=0, rank=1, world_size=2)
    loader = make_loader(ds, batch_size=3, num_workers=2, timeout=TIMEOUT)
    assert len(loader) == 3 and [len(b["__key__"]) for b in loader] == [3, 3, 2]
    own = [s["__key__"] for s in ds]
    assert len(own) == len(set(own)) == 8 and all(isinstance(k, str) for k in own)
    plain = [s["__key__"] for s in DataLoader(ds, batch_size=None, num_workers=2, timeout=TIMEOUT)]
    assert len(plain) == len(set(plain)) == 8
    assert sum(len(b["__key__"]) for b in loader) == 8  # and the loader still batches
