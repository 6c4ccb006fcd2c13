"""Several sources in one dataset (DESIGN §7): unions, repeated shards, weighted mixtures.

Exact values: union sizes and splits, the quota rule (largest remainder, then
slots dealt to ranks), equal batch counts over 2 and 3 ranks with sources of
sizes 1:100, draws without repetition, and resumption mid-epoch in a mixture.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest

import shardflow
from shardflow import ShardDataset, Source
from shardflow.errors import SourceError
from shardflow.loading.shardloader import loader as make_loader
from shardflow.planning.mixing import epoch_quotas, rank_quotas
from shardflow.planning.plan import ShuffleConfig
from tests.helpers import assert_resumes, make_shards, shard_urls

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")

SHUFFLE = ShuffleConfig(shards=True, buffer=8)


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A: 3 shards (10 each), B: 1 shard of 5; each folder has its own manifest."""
    d = tmp_path_factory.mktemp("two")
    return make_shards(d, [10, 10, 10], name="A"), make_shards(d, [5], name="B")


@pytest.fixture(scope="module")
def lopsided(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Sources 1:100 in size: big 1,000 samples in 10 shards, small 10 samples in 1."""
    d = tmp_path_factory.mktemp("lopsided")
    return make_shards(d, [100] * 10, name="big"), make_shards(d, [10], name="small")


def ids(samples: list[Any]) -> list[tuple[int, str]]:
    """(source, key) of each sample: keys repeat across sources, the pair does not."""
    return [(int(s["__source__"]), s["__key__"]) for s in samples]


# ---------------------------------------------------------------- unions


def test_union_is_sized_and_split_like_one_dataset(two: tuple[Path, Path]) -> None:
    a, b = two
    ds = ShardDataset([a, b], decode=None)
    assert ds.sized and len(ds) == 35
    got = ids(list(ds))
    assert Counter(s for s, _ in got) == {0: 30, 1: 5}
    assert len(set(got)) == 35
    assert [p.label for p in ds.sources] == [str(a), str(b)]
    for world in (2, 3):
        per_rank = [ids(list(ShardDataset([a, b], decode=None, shuffle=SHUFFLE, rank=r, world_size=world))) for r in range(world)]
        assert [len(x) for x in per_rank] == [-(-35 // world)] * world  # 18, 18 / 12, 12, 12: padded as one dataset
        assert set().union(*map(set, per_rank)) == set(got)


def test_shard_list_across_two_manifests_is_sized_equal_ranks(tmp_path: Path) -> None:
    """The issue's case: a list of the shards of two folders, each with its manifest, once
    gave 73 and 60 samples to 2 ranks (unsized round robin of whole shards)."""
    a = make_shards(tmp_path, [40, 33], name="a")
    b = make_shards(tmp_path, [30, 30], name="b")
    urls = shard_urls(a) + shard_urls(b)
    counts = []
    seen: set[tuple[str, str]] = set()
    for rank in range(2):
        ds = ShardDataset(urls, decode=None, rank=rank, world_size=2)
        assert ds.sized and len(ds) == 67
        samples = list(ds)
        counts.append(len(samples))
        seen |= {(s["__url__"], s["__key__"]) for s in samples}
    assert counts == [67, 67] and len(seen) == 133


def test_unsized_source_error_names_it(two: tuple[Path, Path], tmp_path: Path) -> None:
    a, _ = two
    bare = make_shards(tmp_path, [4, 4], name="bare", manifest=False)
    ds = ShardDataset([a, bare], decode=None)
    assert not ds.sized
    with pytest.raises(TypeError, match=r"source 1 \(.*bare\) has no manifest") as e:
        len(ds)
    assert "source 0" not in str(e.value)
    assert Counter(int(s["__source__"]) for s in ds) == {0: 30, 1: 8}  # still streams, tagged


def test_a_shard_reached_twice_is_refused(two: tuple[Path, Path]) -> None:
    a, b = two
    with pytest.raises(SourceError, match=r"train-000000\.tar: the same shard is reached by source 0 and by source 2"):
        ShardDataset([a, b, a])
    first = shard_urls(a)[0]
    with pytest.raises(SourceError, match=r"train-000000\.tar: the same shard is reached twice by source 0"):
        ShardDataset(Source([first, shard_urls(a)[1], first]))
    overlap = f"{a}/train-{{000000..000001}}.tar::{a}/train-{{000001..000002}}.tar"
    with pytest.raises(SourceError, match=r"train-000001\.tar: the same shard is reached twice"):
        ShardDataset(overlap)
    with pytest.raises(SourceError, match="train-000000.tar"):  # the same file named two ways
        ShardDataset([first, str(Path(first).parent / ".." / Path(first).parent.name / Path(first).name)])


def test_list_entries_are_sources(two: tuple[Path, Path]) -> None:
    a, b = two
    urls = shard_urls(a)
    ds = ShardDataset([urls[2], b, Source(str(a / "train-00000[01].tar"), name="a-head")], decode=None)
    assert [p.label for p in ds.sources] == [urls[2], str(b), "a-head"]
    assert [(p.start, p.stop, p.sized) for p in ds.sources] == [(0, 1, True), (1, 2, True), (2, 4, True)]
    assert len(ds) == 35
    with pytest.raises(ValueError, match=r"wrap the pattern as shardflow.Source"):
        ShardDataset([str(a / "train-*.tar")])


# ---------------------------------------------------------------- the quota rule


def test_quota_rule_exact() -> None:
    assert epoch_quotas([3, 1], 80) == [60, 20]
    assert epoch_quotas([1, 1, 1], 100) == [34, 33, 33]  # the one left over: the lowest index of a tie
    assert epoch_quotas([0.5, 0.3, 0.2], 15) == [8, 4, 3]  # 7.5, 4.5, 3: floors 7, 4, 3, one left to source 0
    assert epoch_quotas([0.2, 0.7, 0.1], 7) == [1, 5, 1]  # 1.4, 4.9, 0.7: floors 1, 4, 0; two left to 4.9 and 0.7
    # 15 slots laid out source after source (8, 4, 3), slot j to rank j mod 3
    assert rank_quotas([8, 4, 3], 3) == [[3, 3, 2], [1, 1, 2], [1, 1, 1]]
    assert rank_quotas([60, 20], 2) == [[30, 30], [10, 10]]
    assert rank_quotas([1, 5, 1], 1) == [[1], [5], [1]]


def test_quotas_per_source_per_epoch_and_per_rank(two: tuple[Path, Path]) -> None:
    a, b = two
    sources = [Source(a, weight=0.5), Source(b, weight=0.3), Source(a.parent / "A" / "train-000000.tar", weight=0.2)]
    # source 2 is a shard of A: refused, it is reached twice
    with pytest.raises(SourceError):
        ShardDataset(sources, samples_per_epoch=5)
    c = make_shards(a.parent, [7], name="C")
    sources[2] = Source(c, weight=0.2)
    for epoch in range(3):
        per_rank = []
        for rank in range(3):
            ds = ShardDataset(sources, samples_per_epoch=5, shuffle=SHUFFLE, rank=rank, world_size=3, decode=None)
            ds.set_epoch(epoch)
            got = Counter(int(s["__source__"]) for s in ds)
            assert ds.plan(epoch).quotas == (got[0], got[1], got[2])
            per_rank.append([got[0], got[1], got[2]])
        assert per_rank == [[3, 1, 1], [3, 1, 1], [2, 2, 1]], epoch
    ds = ShardDataset(sources, samples_per_epoch=5, decode=None)  # one rank, 5 samples: 2.5, 1.5, 1 -> 3, 1, 1
    assert Counter(int(s["__source__"]) for s in ds) == {0: 3, 1: 1, 2: 1}


@pytest.mark.parametrize("world", [2, 3])
def test_equal_batch_counts_with_sources_1_to_100(lopsided: tuple[Path, Path], world: int) -> None:
    big, small = lopsided
    sources = [Source(big, weight=1), Source(small, weight=1)]
    per_rank_batches, epoch_sources, small_keys, big_keys = [], Counter(), Counter(), []
    for rank in range(world):
        ds = ShardDataset(sources, samples_per_epoch=50, shuffle=True, seed=5, rank=rank, world_size=world, decode=None)
        ld = make_loader(ds, batch_size=8, num_workers=0)
        batches = list(ld)
        assert len(ld) == 7
        per_rank_batches.append(len(batches))
        for bt in batches:
            for src, key in zip(bt["__source__"].tolist(), bt["__key__"]):
                epoch_sources[src] += 1
                (small_keys.update([key]) if src == 1 else big_keys.append(key))
    assert per_rank_batches == [7] * world
    assert epoch_sources == {0: 25 * world, 1: 25 * world}  # quotas 50/50 of W * 50
    # the small source is read pass after pass: each of its 10 samples 2.5 * W times (+-1)
    assert sum(small_keys.values()) == 25 * world and len(small_keys) == 10
    assert max(small_keys.values()) - min(small_keys.values()) <= 1
    assert len(big_keys) == len(set(big_keys)) == 25 * world  # no repetition within a pass


def test_draws_without_repetition_then_the_next_pass(lopsided: tuple[Path, Path]) -> None:
    big, small = lopsided
    sources = [Source(big, weight=4), Source(small, weight=1)]
    seen: list[str] = []
    ds = ShardDataset(sources, samples_per_epoch=250, shuffle=True, seed=1, decode=None)
    for epoch in range(5):
        ds.set_epoch(epoch)
        seen += [s["__key__"] for s in ds if s["__source__"] == 0]
    assert len(seen) == 1000 and len(set(seen)) == 1000  # 5 epochs of 200: exactly one pass of the big source
    ds.set_epoch(5)
    nxt = [s["__key__"] for s in ds if s["__source__"] == 0]
    assert len(nxt) == 200 and len(set(nxt)) == 200  # the next pass starts


def test_mixture_is_deterministic_and_interleaved(lopsided: tuple[Path, Path]) -> None:
    big, small = lopsided
    make = lambda: ShardDataset([Source(big, weight=3), Source(small, weight=1)], samples_per_epoch=40, shuffle=SHUFFLE, seed=2, decode=None)  # noqa: E731
    one = [(s["__source__"], s["__key__"]) for s in make()]
    assert one == [(s["__source__"], s["__key__"]) for s in make()]
    ds = make()
    ds.set_epoch(1)
    assert [(s["__source__"], s["__key__"]) for s in ds] != one
    sources = [s for s, _ in one]
    assert sources.count(1) == 10
    halves = Counter(sources[:20]), Counter(sources[20:])
    assert halves[0][1] >= 3 and halves[1][1] >= 3  # spread through the epoch, not at one end


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_mid_epoch_in_a_mixture(lopsided: tuple[Path, Path], workers: int) -> None:
    big, small = lopsided

    def make() -> Any:
        ds = ShardDataset([Source(big, weight=2), Source(small, weight=1)], samples_per_epoch=60, shuffle=SHUFFLE, seed=4, decode=None)
        return make_loader(ds, batch_size=6, num_workers=workers, timeout=60 if workers else 0)

    record, _ = assert_resumes(make, k=4)
    assert len(record) == 10
    assert Counter(s for b in record for s in b["__source__"][3]) == {0: 40, 1: 20}  # canonical tensor: values at [3]


def test_weights_need_samples_per_epoch_and_every_source(two: tuple[Path, Path]) -> None:
    a, b = two
    with pytest.raises(SourceError, match="samples_per_epoch"):
        ShardDataset([Source(a, weight=1), Source(b, weight=1)])
    with pytest.raises(SourceError, match=r"source 1 \(.*B\) has none"):
        ShardDataset([Source(a, weight=1), b], samples_per_epoch=10)
    with pytest.raises(ValueError, match="weight must be a positive finite number"):
        Source(a, weight=0)


def test_config_takes_a_list_of_sources_with_weights(two: tuple[Path, Path], tmp_path: Path) -> None:
    a, b = two
    path = tmp_path / "mix.yaml"
    path.write_text(f"source:\n  - {{url: {a}, weight: 3}}\n  - {{url: {b}, weight: 1, name: small}}\nsamples_per_epoch: 8\ndecode: none\n")
    from shardflow.config import dataset_from_config

    ds = dataset_from_config(path)
    assert [p.label for p in ds.sources] == [str(a), "small"] and [p.weight for p in ds.sources] == [3.0, 1.0]
    assert Counter(int(s["__source__"]) for s in ds) == {0: 6, 1: 2}
    from shardflow.config import ConfigError, load_config

    assert load_config(path).to_dict()["source"][1] == {"url": str(b), "weight": 1, "name": "small"}
    with pytest.raises(ConfigError, match=r"source\[0\]"):
        load_config({"source": [{"path": str(a)}]})


def test_inspect_shows_a_mixture(two: tuple[Path, Path], tmp_path: Path) -> None:
    from shardflow.cli.inspect import format_summary
    from shardflow.inspect import summarize

    a, b = two
    info = summarize([Source(a, weight=3), Source(b, weight=1)], scan=False, samples_per_epoch=80)
    assert [(p["shards"], p["samples"], p["weight"], p["quota"]) for p in info["sources"]] == [(3, 30, 3.0, 60), (1, 5, 1.0, 20)]
    text = format_summary(info)
    assert f"dataset   2 sources  (manifests {a}/shardflow.json, {b}/shardflow.json)" in text
    assert "sources   2 (a weighted mixture" in text and "quota 60 per epoch" in text and "quota 20 per epoch" in text


# ---------------------------------------------------------------- opening a folder


def test_a_folder_url_reads_its_manifest_first(http_server: Any) -> None:
    """A folder with a manifest costs one read of it (a GET, and the HEAD every HTTP open
    sends): no listing of the folder, no existence checks (before: 4 requests, one a
    listing); without a manifest, the folder is listed."""
    root = Path(http_server.root)
    make_shards(root, [5, 5], name="d")
    make_shards(root, [3], name="bare", manifest=False)
    http_server.reset_stats()
    ds = ShardDataset(http_server.url_for("d"), decode=None)
    assert ds.sized and len(ds) == 10
    stats = http_server.stats
    assert (stats.requests, stats.gets, stats.heads, stats.gets_by_path) == (2, 1, 1, {"d/shardflow.json": 1})
    http_server.reset_stats()
    bare = ShardDataset(http_server.url_for("bare") + "/", decode=None)
    assert not bare.sized and [s["__key__"] for s in bare] == ["000000", "000001", "000002"]
    assert http_server.stats.gets_by_path["bare/shardflow.json"] == 1  # tried first,
    assert http_server.stats.gets_by_path["bare/"] >= 1  # then listed


def test_a_source_reads_with_its_own_storage_options(two: tuple[Path, Path]) -> None:
    a, b = two
    ds = ShardDataset([Source(a, storage_options={"anon": True}), b], storage_options={"anon": False, "x": 1}, decode=None)
    first, last = ds.shards.options_for(0, ds.io), ds.shards.options_for(3, ds.io)
    assert first.storage_options == {"anon": True, "x": 1}  # the source's own win, the rest are kept
    assert last is ds.io and ds.shards.options_for(2, ds.io) is first  # merged once per source
    assert len(list(ds)) == 35


def test_the_shard_set_is_ds_shards_and_source_stays_its_old_name(tmp_path) -> None:
    """"Source" names one input of several (``Source``, and ``__source__`` in a sample);
    the resolved shards are ``ds.shards``; ``ds.source`` is the same object, kept for a release."""
    with shardflow.ShardWriter(str(tmp_path / "a" / "s-%03d.tar"), max_count=3) as w:
        for i in range(6):
            w.write({"__key__": f"k{i:02d}", "cls": i})
    ds = shardflow.ShardDataset(str(tmp_path / "a"), decode=None)
    assert ds.shards is ds.source
    assert len(ds.shards.urls) == 2 and list(ds.shards.counts) == [3, 3]
    assert {s["__source__"] for s in ds} == {0}
