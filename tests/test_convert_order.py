"""The order ``convert imagefolder`` writes in (issue 30): a seeded shuffle by default, mixing the
classes across and within shards, byte-identical on a re-run, resumable; ``order="walk"`` keeps
the walk order."""

from __future__ import annotations

import filecmp
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

import shardflow
from shardflow.convert.engine.engine import ConvertOptions
from shardflow.convert.images.imagefolder import convert_imagefolder
from shardflow.convert.engine.mixorder import PackedInputs, in_order, input_order
from shardflow.errors import ConversionError
from tests.helpers import tiny_image

CLASSES, PER, MAX_COUNT = 12, 25, 50  # 300 images, 6 shards


def walk_names() -> list[str]:
    return [f"c{c:02d}/{i:03d}.png" for c in range(CLASSES) for i in range(PER)]


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("order") / "src"
    for j, name in enumerate(walk_names()):
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(tiny_image("png", j))
    return root


def convert(tree: Path, dst: Path, **kw) -> shardflow.Manifest:  # type: ignore[name-defined]
    return convert_imagefolder(tree, str(dst), options=ConvertOptions(max_count=MAX_COUNT, workers=1), **kw)


def stored(dst: Path) -> tuple[list[str], list[int], list[str]]:
    """Keys, labels and shard URLs of every sample, in stored order."""
    samples = list(shardflow.ShardDataset(dst, shuffle=False, decode=None))
    return [s["__key__"] for s in samples], [int(s["cls"]) for s in samples], [s["__url__"] for s in samples]


def tars(folder: Path) -> list[str]:
    return sorted(p for p in os.listdir(folder) if p.endswith(".tar"))


def mean_distinct(labels: list[int], batch: int) -> float:
    return float(np.mean([len(set(labels[i : i + batch])) for i in range(0, len(labels) - batch + 1, batch)]))


def test_input_order_is_a_seeded_permutation() -> None:
    p = input_order(1000, 0)
    assert sorted(p.tolist()) == list(range(1000))
    assert np.array_equal(p, input_order(1000, 0)) and not np.array_equal(p, input_order(1000, 1))
    items = [(f"k{i}", "png", f"a/{i}.png", i % 7, 100 + i, None if i % 2 else 10**18 + i) for i in range(50)]
    assert list(in_order(iter(items), "walk", 0)) == items
    shuffled = list(in_order(iter(items), "shuffled", 0))
    assert shuffled == [items[i] for i in input_order(50, 0)]  # the values come back exactly (ints, None)
    packed = PackedInputs()
    packed.add(items[3])
    assert packed[0] == items[3] and len(packed) == 1
    with pytest.raises(ValueError, match="order must be one of"):
        list(in_order(iter(items), "sorted", 0))


def test_default_order_is_a_seeded_permutation_of_the_walk(tree: Path, tmp_path: Path) -> None:
    walk = convert(tree, tmp_path / "walk", order="walk")
    keys_walk, labels_walk, _ = stored(tmp_path / "walk")
    assert keys_walk == [n[:-4] for n in walk_names()]  # the walk order: classes one after the other
    assert walk.meta["order"] == "walk"
    manifest = convert(tree, tmp_path / "a")
    keys, labels, _ = stored(tmp_path / "a")
    assert manifest.meta["order"] == "shuffled" and manifest.meta["order_seed"] == 0
    # the walk's samples, each once, in the permutation of the seed, each with its own label
    assert keys == [keys_walk[i] for i in input_order(CLASSES * PER, 0)]
    assert labels == [int(k[1:3]) for k in keys]
    # a re-run writes the same bytes; another seed another order
    convert(tree, tmp_path / "b")
    assert tars(tmp_path / "a") == tars(tmp_path / "b")
    assert all(filecmp.cmp(tmp_path / "a" / n, tmp_path / "b" / n, shallow=False) for n in tars(tmp_path / "a"))
    other = convert(tree, tmp_path / "c", seed=1)
    assert other.meta["order_seed"] == 1 and sorted(stored(tmp_path / "c")[0]) == sorted(keys) != stored(tmp_path / "c")[0]


def test_shuffled_shards_mix_the_classes(tree: Path, tmp_path: Path) -> None:
    convert(tree, tmp_path / "mixed")
    _, labels, urls = stored(tmp_path / "mixed")
    # a uniform permutation of 12 classes x 25 gives about 9.2 distinct classes per 16 samples
    assert mean_distinct(labels, 16) >= 8.3
    for url in sorted(set(urls)):  # every shard of 50 holds most classes (walk order: 2 or 3)
        assert len({c for c, u in zip(labels, urls) if u == url}) >= 10
    convert(tree, tmp_path / "walk", order="walk")
    assert mean_distinct(stored(tmp_path / "walk")[1], 16) <= 2.0


def test_a_failed_shuffled_conversion_resumes_byte_identical(tree: Path, tmp_path: Path) -> None:
    clean = tmp_path / "clean"
    convert(tree, clean)
    # the image written last in the shuffled order is corrupt: the run stops after earlier shards
    last = walk_names()[int(input_order(CLASSES * PER, 0)[-1])]
    src = tmp_path / "src"
    shutil.copytree(tree, src)
    good = (src / last).read_bytes()
    (src / last).write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 20)
    dst = tmp_path / "out"
    with pytest.raises(ConversionError):
        convert(src, dst, on_error="raise")
    done = tars(dst)
    assert done and len(done) < CLASSES * PER // MAX_COUNT
    before = {n: os.stat(dst / n).st_mtime_ns for n in done}
    (src / last).write_bytes(good)
    convert(src, dst, on_error="raise")
    assert {n: os.stat(dst / n).st_mtime_ns for n in done} == before  # finished shards kept
    assert tars(dst) == tars(clean)
    assert all(filecmp.cmp(dst / n, clean / n, shallow=False) for n in tars(clean))


def test_shuffled_listing_stats_no_file_and_a_rerun_rewrites_only_changed_shards(tree: Path, tmp_path: Path,
                                                                                   monkeypatch) -> None:  # fmt: skip
    from shardflow.convert.images.walk import LocalTree

    stats: list[str] = []
    real = LocalTree.stat
    monkeypatch.setattr(LocalTree, "stat", lambda self, rel: (stats.append(rel), real(self, rel))[1])
    src = tmp_path / "src"
    shutil.copytree(tree, src)
    dst = tmp_path / "out"
    first = convert(src, dst)
    # the listing keeps names alone: sizes and versions come from the files the workers opened
    assert stats == []
    assert first.meta["class_counts"] == {f"c{c:02d}": PER for c in range(CLASSES)}
    names = tars(dst)
    before = {n: os.stat(dst / n).st_mtime_ns for n in names}
    order = input_order(CLASSES * PER, 0)
    shard_of = {walk_names()[int(i)]: p // MAX_COUNT for p, i in enumerate(order)}
    grown = walk_names()[7]  # new bytes of another size
    (src / grown).write_bytes(tiny_image("png", 10_000, size=(6, 5)))
    touched = next(n for n in walk_names() if shard_of[n] not in (shard_of[grown],))  # same bytes, newer mtime
    os.utime(src / touched, ns=(1, os.stat(src / touched).st_mtime_ns + 10**9))
    second = convert(src, dst)
    # a re-run takes every file's size and version with a stat before it keeps a finished shard
    assert sorted(stats) == sorted(walk_names())
    rewritten = sorted(n for n in names if os.stat(dst / n).st_mtime_ns != before[n])
    assert rewritten == sorted({f"train-{shard_of[grown]:06d}.tar", f"train-{shard_of[touched]:06d}.tar"})
    assert second.meta["class_counts"] == first.meta["class_counts"]
    clean = tmp_path / "clean"
    convert(src, clean)
    assert tars(dst) == tars(clean)
    assert all(filecmp.cmp(dst / n, clean / n, shallow=False) for n in tars(clean))
    keys, _, _ = stored(dst)
    assert keys[list(order).index(7)] == walk_names()[7][:-4]
