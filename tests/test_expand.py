"""One-to-many samples: crops and tiles before the shuffle buffer, counted by len() and resumption."""

import numpy as np
import pytest

import shardflow
from shardflow.errors import SampleError
from shardflow.expand import Expand, random_crops, tiles


@pytest.fixture
def matrices(tmp_path):
    with shardflow.ShardWriter(str(tmp_path / "m-%06d.tar"), max_count=3) as w:
        for i in range(8):
            w.write({"__key__": f"m{i:03d}", "x.npy": (np.arange(64 * 48).reshape(64, 48) + i * 100000).astype(np.int32)})
    return str(tmp_path)


def source_value(key):
    return (np.arange(64 * 48).reshape(64, 48) + int(key[1:4]) * 100000).astype(np.int32)


def test_crops_are_exact_counted_and_reproducible(matrices):
    ds = shardflow.ShardDataset(matrices, expand=random_crops("x.npy", (20, 16), 5), shuffle=True, seed=3)
    assert len(ds) == 40
    epoch0 = list(ds)
    assert len(epoch0) == 40
    assert sorted(s["__key__"] for s in epoch0) == sorted(f"m{i:03d}#{j}" for i in range(8) for j in range(5))
    for s in epoch0:
        y, x = s["crop_yx"]
        np.testing.assert_array_equal(s["x.npy"], source_value(s["__key__"])[y : y + 20, x : x + 16])
    ds.set_epoch(0)
    again = list(ds)
    assert [(s["__key__"], s["crop_yx"]) for s in again] == [(s["__key__"], s["crop_yx"]) for s in epoch0]
    ds.set_epoch(1)
    epoch1 = list(ds)
    assert [s["crop_yx"] for s in epoch1] != [s["crop_yx"] for s in epoch0]
    # crops of one source spread over the epoch instead of arriving together
    positions = [i for i, s in enumerate(epoch0) if s["__key__"].startswith("m000#")]
    assert positions != list(range(positions[0], positions[0] + 5))


def test_tiles_and_split_over_ranks(matrices):
    per_rank = [list(shardflow.ShardDataset(matrices, expand=tiles("x.npy", 16, (2, 3)), rank=r, world_size=2)) for r in (0, 1)]
    assert [len(p) for p in per_rank] == [24, 24]
    keys = [s["__key__"] for p in per_rank for s in p]
    assert sorted(keys) == sorted(f"m{i:03d}#{j}" for i in range(8) for j in range(6))
    first = per_rank[0][0]
    assert first["__key__"] == "m000#0" and first["x.npy"].shape == (16, 16)


def test_loader_resumes_mid_epoch_with_crops(matrices):
    def make():
        ds = shardflow.ShardDataset(matrices, expand=random_crops("x.npy", 8, 3), shuffle=True, seed=1)
        return shardflow.loader(ds, batch_size=4, num_workers=2)

    full = [b["__key__"] for b in make()]
    assert len(full) == 6 and sum(map(len, full)) == 24
    first = make()
    it = iter(first)
    got = [next(it)["__key__"] for _ in range(2)]
    state = first.state_dict()
    del it
    second = make()
    second.load_state_dict(state)
    rest = [b["__key__"] for b in second]
    assert got + rest == full


def test_expand_errors_follow_on_error(matrices):
    bad = random_crops("x.npy", 100, 2)  # larger than the 64x48 matrices
    with pytest.raises(SampleError, match=r"sample 'm000': expand raised ValueError: crop 100x100 is larger"):
        list(shardflow.ShardDataset(matrices, expand=bad))
    ds = shardflow.ShardDataset(matrices, expand=Expand(lambda s, rng: [s], 1), on_error="skip")
    assert len(list(ds)) == 8
    wrong = Expand(lambda s, rng: [s], 2)
    ds = shardflow.ShardDataset(matrices, expand=wrong, on_error="skip")
    with pytest.raises(shardflow.ShardflowError, match="yielded no sample"):
        list(ds)


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("workers", [0, 2])
def test_one_crop_per_sample_is_still_applied(matrices, shuffle, workers):
    """``count=1`` is a one-to-one expand (a random crop per sample): every sample goes through
    it and is decoded, as with larger counts (it was skipped: raw bytes came out whole)."""
    ds = shardflow.ShardDataset(matrices, expand=random_crops("x.npy", (20, 16), 1), shuffle=shuffle, seed=3)
    assert len(ds) == 8
    keys, crops = [], []
    for batch in shardflow.loader(ds, batch_size=4, num_workers=workers):
        assert tuple(batch["x.npy"].shape) == (4, 20, 16)
        keys += batch["__key__"]
        crops += batch["crop_yx"]
    assert sorted(keys) == [f"m{i:03d}#0" for i in range(8)]


def test_one_crop_per_sample_matches_the_source(matrices):
    for s in shardflow.ShardDataset(matrices, expand=random_crops("x.npy", (20, 16), 1), shuffle=True, seed=3):
        y, x = s["crop_yx"]
        np.testing.assert_array_equal(s["x.npy"], source_value(s["__key__"])[y : y + 20, x : x + 16])
