"""Selecting samples: ``ShardDataset(select=...)`` plans the selection exactly on every
rank (equal batch counts, each selected sample once, no repeats), against a selection
made by hand on the stdlib ``tarfile`` reading of the shards; a transform that returns
None keeps working, repeats batches, and warns once per epoch with the count."""

from __future__ import annotations

import hashlib
import logging
import tarfile
from collections import Counter

import numpy as np
import pytest

import shardflow
from shardflow.errors import ShardflowError
from tests.helpers import make_shards, shard_urls

pytestmark = pytest.mark.timeout(180)


def in_val(key: str) -> bool:
    """A validation split by key hash: about 1 key in 5 (a stable, salted hash, not hash()),
    40 of the 200 keys here."""
    return hashlib.sha256(f"2:{key}".encode()).digest()[0] % 5 == 0


def tar_keys(folder) -> list[str]:
    out: list[str] = []
    for url in shard_urls(folder):
        with tarfile.open(url) as tf:
            for m in tf.getmembers():
                k = m.name.split(".", 1)[0]
                if not out or out[-1] != k:
                    out.append(k)
    return out


@pytest.fixture
def data(tmp_path):
    folder = make_shards(tmp_path, [25, 40, 15, 60, 30, 30])  # 200 samples
    keys = tar_keys(folder)
    selected = [k for k in keys if in_val(k)]
    assert len(keys) == 200 and len(selected) == 40  # the split this test is about
    return folder, keys, selected


def batches(ds, rank: int, world: int, batch_size: int = 8, workers: int = 0, epoch: int = 0) -> list[list[str]]:
    loader = shardflow.loader(ds, batch_size=batch_size, num_workers=workers)
    ds.set_epoch(epoch)
    return [list(b["__key__"]) for b in loader]


@pytest.mark.parametrize("how", ["predicate", "keys"])
@pytest.mark.parametrize("shuffle", [False, True])
def test_select_is_exact_on_every_rank(data, how, shuffle):
    folder, keys, selected = data
    select = in_val if how == "predicate" else set(selected) | {"not-a-key"}
    per_rank = []
    for rank in range(2):
        ds = shardflow.ShardDataset(str(folder), decode=None, select=select, shuffle=shuffle, seed=3, rank=rank,
                                    world_size=2)
        assert len(ds) == 20
        per_rank.append(batches(ds, rank, 2))
    assert [len(b) for b in per_rank[0]] == [len(b) for b in per_rank[1]] == [8, 8, 4]  # equal batch counts
    seen = [k for rank in per_rank for b in rank for k in b]
    assert Counter(seen) == Counter(selected)  # all 40, none twice
    if not shuffle:
        assert seen == selected  # stored order: rank 0 the first half, rank 1 the second


def test_select_with_workers_equals_in_process_and_resumes(data):
    folder, keys, selected = data
    ds = shardflow.ShardDataset(str(folder), decode=None, select=in_val, shuffle=True, seed=1)
    ref = batches(ds, 0, 1, batch_size=6)
    ds2 = shardflow.ShardDataset(str(folder), decode=None, select=in_val, shuffle=True, seed=1)
    assert batches(ds2, 0, 1, batch_size=6, workers=2) == ref
    assert sorted(k for b in ref for k in b) == sorted(selected)
    # resumed after 3 batches: the rest, in the same order
    ds3 = shardflow.ShardDataset(str(folder), decode=None, select=in_val, shuffle=True, seed=1)
    loader = shardflow.loader(ds3, batch_size=6)
    ds3.set_epoch(0)
    it = iter(loader)
    head = [list(next(it)["__key__"]) for _ in range(3)]
    state = loader.state_dict()
    del it
    ds4 = shardflow.ShardDataset(str(folder), decode=None, select=in_val, shuffle=True, seed=1)
    loader4 = shardflow.loader(ds4, batch_size=6)
    loader4.load_state_dict(state)
    assert head + [list(b["__key__"]) for b in loader4] == ref


def test_select_decodes_the_selected_samples(data):
    folder, keys, selected = data
    ds = shardflow.ShardDataset(str(folder), select=set(selected[:7]))
    got = [(s["__key__"], s["cls"]) for s in ds]
    assert got == [(k, int(k)) for k in selected[:7]]  # make_shards: cls == the global index


def test_select_without_an_offset_index_or_a_manifest_is_refused(tmp_path):
    no_index = make_shards(tmp_path, [10, 10], index=False, name="noindex")
    with pytest.raises(ShardflowError, match=r"select= seeks .* needs an offset index per shard; 2 shard\(s\)"):
        shardflow.ShardDataset(str(no_index), select=in_val)
    bare = make_shards(tmp_path, [10, 10], manifest=False, name="bare")
    with pytest.raises(ShardflowError, match=r"select= plans the selected samples exactly, which needs sample counts"):
        shardflow.ShardDataset(str(bare), select=in_val)
    with pytest.raises(TypeError, match="select must be a key predicate or a collection of keys"):
        shardflow.ShardDataset(str(no_index), select="000001")


def test_a_filtering_transform_repeats_batches_and_warns_with_the_count(data, caplog):
    folder, keys, selected = data

    def only_val(sample):
        return sample if in_val(sample["__key__"]) else None

    seen: list[str] = []
    repeated_samples = 0
    for rank in range(2):
        ds = shardflow.ShardDataset(str(folder), decode=None, transform=only_val, rank=rank, world_size=2)
        assert len(ds) == 100  # planned samples: an upper bound of what the transform lets through
        loader = shardflow.loader(ds, batch_size=8)
        assert len(loader) == 13  # exact: batches are repeated to keep it
        for epoch in range(2):
            caplog.clear()
            with caplog.at_level(logging.WARNING, logger="shardflow.loading.shardloader"):
                got = batches(ds, rank, 2, epoch=epoch)
            assert len(got) == 13
            counts = Counter(k for b in got for k in b)
            twice = sum(c - 1 for c in counts.values())
            warnings = [r.getMessage() for r in caplog.records if "seen again" in r.getMessage()]
            if ds.stats["repeated_batches"]:
                assert len(warnings) == 1, warnings  # once per epoch, with the counts
                assert f"epoch {epoch}: {ds.stats['repeated_batches']} batch(es)" in warnings[0]
                assert f"{twice} sample(s) seen again" in warnings[0] and "select=" in warnings[0]
            else:
                assert warnings == [] and twice == 0
            if epoch == 0:
                repeated_samples += twice
                seen.extend(counts)
    assert sorted(seen) == sorted(selected)  # every selected sample arrives
    assert repeated_samples == 8  # and these twice: what select= avoids


def test_keys_in_no_shard_are_named(data, caplog):
    folder, keys, selected = data
    with caplog.at_level(logging.WARNING, logger="shardflow.planning.selection"):
        ds = shardflow.ShardDataset(str(folder), decode=None, select=[selected[0], "nope"])
    assert [s["__key__"] for s in ds] == [selected[0]]
    assert "1 of the 2 keys given are in no shard (e.g. ['nope'])" in caplog.text
