"""Class mix of the default shuffle (issue 30): the window shuffle (shardflow.planning.window) spreads
class-sorted shards, exactly and resumably."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import shardflow
from shardflow.convert.engine.engine import ConvertOptions
from shardflow.convert.images.imagefolder import convert_imagefolder
from shardflow.inspect.batchmix import planned_mix
from shardflow.planning.plan import ShuffleConfig, SplitConfig, plan_epoch
from shardflow.planning.window import window_permutation
from tests.helpers import assert_resumes, make_shards, sample_key, tiny_image

CLASSES, PER, SHARD = 40, 250, 500  # 10,000 samples, classes one after the other, 2 classes a shard


def label(i: int) -> int:
    return i // PER


@pytest.fixture(scope="module")
def sorted_shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_shards(tmp_path_factory.mktemp("mix"), [SHARD] * (CLASSES * PER // SHARD), lambda i: {"cls": label(i)})


def mean_distinct(batches: list[list[int]]) -> float:
    full = [b for b in batches if len(b) == len(batches[0])]
    return float(np.mean([len(set(b)) for b in full]))


def permutation_distinct(batch: int, seeds: int = 8) -> float:
    labels = np.repeat(np.arange(CLASSES), PER)
    runs = []
    for s in range(seeds):
        p = labels[np.random.default_rng(s).permutation(len(labels))].tolist()
        runs.append(mean_distinct([p[i : i + batch] for i in range(0, len(p), batch)]))
    return float(np.mean(runs))


def stream(folder: Path, shuffle: Any = True, workers: int = 2, batch: int = 64, **kw: Any) -> list[dict[str, Any]]:
    ds = shardflow.ShardDataset(folder, shuffle=shuffle, seed=0, decode=None, **kw)
    return list(shardflow.loader(ds, batch_size=batch, num_workers=workers))


def test_window_permutation_is_a_seeded_permutation_that_moves_less_than_the_window() -> None:
    p = window_permutation(1000, 50, seed=7)
    assert sorted(p.tolist()) == list(range(1000))
    assert np.array_equal(p, window_permutation(1000, 50, seed=7))
    assert not np.array_equal(p, window_permutation(1000, 50, seed=8))
    # position j holds a stream position about `window * u` behind it (u uniform), circularly
    j = np.arange(1000)
    moved = (j - p + 500) % 1000 - 500
    assert -25 < int(moved.min()) and int(moved.max()) < 75 and 20 < float(moved.mean()) < 30
    assert np.array_equal(window_permutation(10, 1, seed=7), np.arange(10))
    assert np.array_equal(window_permutation(10, 0, seed=7), np.arange(10))


@pytest.mark.parametrize("world", [1, 3])
@pytest.mark.parametrize("partial", ["pad", "drop"])
def test_window_plan_is_exact_and_equal_per_rank(world: int, partial: str) -> None:
    counts = [7, 0, 12, 5, 9]  # 33 samples
    split = SplitConfig(batch_size=4, partial=partial)  # type: ignore[arg-type]
    plans = [plan_epoch(counts, r, world, 3, 1, ShuffleConfig(), split) for r in range(world)]
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    seen = Counter()
    for p in plans:
        assert p.scattered and p.samples == plans[0].samples and p.num_batches == plans[0].num_batches
        shard = np.asarray([s.shard for s in p.segments])[p.read_segment[p.emit]]
        seen.update((starts[shard] + p.read_sample[p.emit]).tolist())
    if partial == "pad":  # every sample once, plus W-1 padded repeats at most
        assert set(seen) == set(range(33)) and sum(seen.values()) == world * -(-33 // world)
    else:
        assert max(seen.values()) == 1 and len(seen) == world * (33 // world)
    # a function of (counts, world, seed, epoch): the same plan again, another one next epoch
    again = plan_epoch(counts, 0, world, 3, 1, ShuffleConfig(), split)
    assert np.array_equal(again.read_sample, plans[0].read_sample) and np.array_equal(again.emit, plans[0].emit)
    other = plan_epoch(counts, 0, world, 3, 2, ShuffleConfig(), split)
    assert not np.array_equal(other.read_sample, plans[0].read_sample)


def test_class_sorted_shards_give_batches_as_mixed_as_a_permutation(sorted_shards: Path) -> None:
    batches = stream(sorted_shards)
    keys = [k for b in batches for k in b["__key__"]]
    assert sorted(keys) == [sample_key(i) for i in range(CLASSES * PER)]  # the epoch is exact
    for b in batches:  # each sample keeps its own label
        assert [label(int(k)) for k in b["__key__"]] == [int(c) for c in b["cls"]]
    got = mean_distinct([[int(c) for c in b["cls"]] for b in batches])
    perm = permutation_distinct(64)  # about 31.9 of 40 classes
    assert got >= 0.9 * perm, (got, perm)
    # the shard interleave (4 shards) and a 1,000-sample buffer, the default before the window
    off = stream(sorted_shards, ShuffleConfig(window=0))
    assert mean_distinct([[int(c) for c in b["cls"]] for b in off]) < 0.5 * perm


def test_window_order_does_not_depend_on_the_worker_count(sorted_shards: Path) -> None:
    runs = [[k for b in stream(sorted_shards, workers=w) for k in b["__key__"]] for w in (0, 1, 3)]
    assert runs[0] == runs[1] == runs[2]


def test_window_shuffle_resumes_exactly(sorted_shards: Path) -> None:
    def make() -> Any:
        ds = shardflow.ShardDataset(sorted_shards, shuffle=True, seed=0, decode=None)
        return shardflow.loader(ds, batch_size=64, num_workers=2)

    record, record_next = assert_resumes(make, k=17)
    assert len(record) == len(record_next) == -(-CLASSES * PER // 64)


def test_window_is_off_where_random_access_is_not_cheap(sorted_shards: Path, tmp_path: Path) -> None:
    assert shardflow.ShardDataset(sorted_shards, shuffle=True).shuffle.window == 1 << 18
    bare = make_shards(tmp_path, [5, 5], index=False)  # no offset index: shards are read in order
    assert shardflow.ShardDataset(bare, shuffle=True).shuffle.window == 0
    assert shardflow.ShardDataset(sorted_shards, shuffle=False).shuffle.window == 0


# ---------------------------------------------------------------- the report before training


def inspect_json(folder: Path, batches: int, batch_size: int) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-m", "shardflow.cli", "inspect", str(folder), "--no-scan", "--json",
         "--batches", str(batches), "--batch-size", str(batch_size)],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return json.loads(out.stdout)["batches"]


@pytest.mark.parametrize("window", [None, 0])
def test_inspect_reports_the_mix_the_stream_delivers(sorted_shards: Path, window: int | None) -> None:
    """Labels read from the label members alone; the planned batches are the streamed ones."""
    report = inspect_json(sorted_shards, 20, 64) if window is None else None
    shuffle = True if window is None else ShuffleConfig(window=window)
    ds = shardflow.ShardDataset(sorted_shards, shuffle=shuffle, seed=0, decode=None)
    shardflow.loader(ds, batch_size=64)
    planned = planned_mix(ds, 20)
    streamed = [[int(c) for c in b["cls"]] for b in stream(sorted_shards, shuffle)][:20]
    assert planned["labels_from"] == "label members" and planned["batches"] == 20 and planned["batch_size"] == 64
    assert planned["mean_distinct"] == mean_distinct(streamed)
    assert planned["worst_distinct"] == min(len(set(b)) for b in streamed)
    assert 29 < planned["permutation"]["mean_distinct"] < 35  # 64 draws of 40 equal classes: about 31.9
    if report is not None:
        assert report["mean_distinct"] == planned["mean_distinct"] and report["ratio"] >= 0.9
    else:  # the interleave over class-sorted shards: far from a permutation, the worst run named
        assert planned["ratio"] < 0.5 and planned["worst_run"]["batches"] == 8


@pytest.fixture(scope="module")
def walk_converted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("walk")
    for c in range(12):
        for i in range(25):
            path = root / "src" / f"c{c:02d}" / f"{i:03d}.png"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(tiny_image("png", c * 25 + i))
    convert_imagefolder(root / "src", str(root / "walk"), options=ConvertOptions(max_count=50, workers=1), order="walk")
    convert_imagefolder(root / "src", str(root / "mixed"), options=ConvertOptions(max_count=50, workers=1))
    return root


def test_manifest_labels_and_one_warning_for_class_sorted_shards_read_unmixed(walk_converted: Path, caplog) -> None:
    walk = walk_converted / "walk"
    unmixed = ShuffleConfig(window=0, buffer=16, interleave=1)  # (a 1,000-sample buffer spans these 300 samples)
    ds = shardflow.ShardDataset(walk, shuffle=unmixed, seed=0, decode=None)
    with caplog.at_level(logging.WARNING, logger="shardflow"):
        shardflow.loader(ds, batch_size=16)
        shardflow.loader(ds, batch_size=16)
    warned = [r.getMessage() for r in caplog.records if "distinct classes" in r.getMessage()]
    assert len(warned) == 1 and "ShuffleConfig(window" in warned[0] and "--order shuffled" in warned[0]
    planned = planned_mix(ds, 10)
    assert planned["labels_from"] == "manifest" and planned["ratio"] < 0.5
    streamed = [[int(c) for c in b["cls"]] for b in stream(walk, unmixed, batch=16)][:10]
    assert planned["mean_distinct"] == mean_distinct(streamed)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="shardflow"):  # mixed by the window, or by the converter
        shardflow.loader(shardflow.ShardDataset(walk, shuffle=True, decode=None), batch_size=16)
        shardflow.loader(shardflow.ShardDataset(walk_converted / "mixed", shuffle=True, decode=None), batch_size=16)
    assert not [r for r in caplog.records if "distinct classes" in r.getMessage()]


def test_window_reads_the_stored_samples_and_drops_only_what_a_cut_shard_lost(tmp_path: Path) -> None:
    folder = make_shards(tmp_path, [50] * 4, lambda i: {"txt": f"text {i}" * (i % 7)})
    stored = {s["__key__"]: (s["cls"], s["txt"]) for s in shardflow.ShardDataset(folder, shuffle=False, decode=None)}
    mixed = list(shardflow.ShardDataset(folder, shuffle=True, seed=1, decode=None))
    assert {s["__key__"]: (s["cls"], s["txt"]) for s in mixed} == stored and len(mixed) == 200
    assert [s["__key__"] for s in mixed] != sorted(stored)
    # shard 2 cut 100 bytes into its sample 30: samples 130..149 are lost, each counted, the rest read
    ds = shardflow.ShardDataset(folder, shuffle=True, seed=1, decode=None, on_error="skip")
    cut = int(ds.shards.load_offsets(2, ds.io)[30]) + 100
    path = Path(ds.shards.urls[2])
    path.write_bytes(path.read_bytes()[:cut])
    got = [s["__key__"] for s in ds]
    assert sorted(got) == sorted(sample_key(i) for i in range(200) if not 130 <= i < 150)
    assert ds.stats["skipped"] == 20 and ds.stats["samples"] == 180
    with pytest.raises(shardflow.ShardflowError, match="train-000002.tar"):
        list(shardflow.ShardDataset(folder, shuffle=True, seed=1, decode=None))
