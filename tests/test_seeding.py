"""Randomness keyed by the sample (DESIGN.md §10): a per-sample transform's draws from
torch's, numpy's and Python's global generators depend on (seed, epoch, key) alone,
not on the worker count, a rerun or a resume; a collate_fn's on (seed, epoch, rank, batch).

The reference for every draw is the generator seeded by hand with the documented seed
(``shardflow.seeding.sample_seed``), not another run of the loader.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from shardflow import ShardDataset
from shardflow.loading.collation import collate
from shardflow.loading.shardloader import loader as make_loader
from shardflow.seeding import batch_seed, sample_generator, sample_rng, sample_seed
from tests.helpers import make_shards

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")

SEED = 7
N = 240
BATCH = 8


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_shards(tmp_path_factory.mktemp("seeding"), [40] * 6)


def draw(sample: dict[str, Any]) -> dict[str, Any]:
    """The issue's transform: one draw from each global generator, kept in the sample."""
    sample["t"] = float(torch.rand(()))
    sample["n"] = float(np.random.rand())
    sample["p"] = random.random()
    return sample


def expected(key: str, epoch: int) -> tuple[float, float, float]:
    """The draws of ``draw`` for ``key``, from generators seeded by hand as documented."""
    s = sample_seed(SEED, epoch, key)
    g = torch.Generator()
    g.manual_seed(s)
    return (float(torch.rand((), generator=g)), float(np.random.RandomState(s >> 32).random_sample()),
            random.Random(s).random())


def draws_by_key(batches: list[dict[str, Any]]) -> dict[str, tuple[float, float, float]]:
    out: dict[str, tuple[float, float, float]] = {}
    for b in batches:
        for k, t, n, p in zip(b["__key__"], b["t"].tolist(), b["n"].tolist(), b["p"].tolist()):
            assert k not in out, f"key {k} twice in one epoch"
            out[k] = (t, n, p)
    return out


def epoch_batches(data: Path, workers: int, epoch: int = 0, **kw: Any) -> list[dict[str, Any]]:
    ds = ShardDataset(data, shuffle=True, seed=SEED, transform=draw, **kw)
    ds.set_epoch(epoch)
    return list(make_loader(ds, batch_size=BATCH, num_workers=workers))


@pytest.mark.parametrize("workers", [0, 2])
def test_every_sample_draws_what_its_seed_gives(data: Path, workers: int) -> None:
    got = draws_by_key(epoch_batches(data, workers))
    assert len(got) == N
    same = sum(got[k] == pytest.approx(expected(k, 0), abs=0, rel=0) for k in got)
    assert same == N


def test_zero_and_two_workers_and_a_rerun_draw_the_same(data: Path) -> None:
    zero = draws_by_key(epoch_batches(data, 0))
    two = draws_by_key(epoch_batches(data, 2))
    again = draws_by_key(epoch_batches(data, 2))
    assert sum(zero[k] == two[k] for k in zero) == N
    assert sum(two[k] == again[k] for k in two) == N


def test_draws_differ_between_epochs(data: Path) -> None:
    e0 = draws_by_key(epoch_batches(data, 0, epoch=0))
    e1 = draws_by_key(epoch_batches(data, 0, epoch=1))
    assert sum(e0[k][0] == e1[k][0] for k in e0) == 0
    assert all(e1[k] == expected(k, 1) for k in e1)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_resumed_epoch_draws_what_the_uninterrupted_one_did(data: Path, workers: int) -> None:
    whole = draws_by_key(epoch_batches(data, workers))
    ds = ShardDataset(data, shuffle=True, seed=SEED, transform=draw)
    ld = make_loader(ds, batch_size=BATCH, num_workers=workers)
    it = iter(ld)
    for _ in range(11):  # 88 samples taken, 152 left
        next(it)
    state = ld.state_dict()
    del it
    ds2 = ShardDataset(data, shuffle=True, seed=SEED, transform=draw)
    ld2 = make_loader(ds2, batch_size=BATCH, num_workers=workers)
    ld2.load_state_dict(state)
    rest = draws_by_key(list(ld2))
    assert len(rest) == N - 11 * BATCH == 152
    assert sum(rest[k] == whole[k] for k in rest) == 152


def test_sample_rng_and_generator_follow_the_sample(data: Path) -> None:
    def explicit(sample: dict[str, Any]) -> dict[str, Any]:
        sample["n"] = float(sample_rng().random())
        sample["t"] = float(torch.rand((), generator=sample_generator()))
        return sample

    for workers in (0, 2):
        ds = ShardDataset(data, shuffle=True, seed=SEED, transform=explicit)
        for b in make_loader(ds, batch_size=BATCH, num_workers=workers):
            for k, n, t in zip(b["__key__"], b["n"].tolist(), b["t"].tolist()):
                s = sample_seed(SEED, 0, k)
                g = torch.Generator()
                g.manual_seed(s)
                assert n == np.random.Generator(np.random.PCG64(s)).random()
                assert t == float(torch.rand((), generator=g))


def test_sample_rng_outside_a_transform_is_an_error() -> None:
    with pytest.raises(RuntimeError, match="inside a per-sample transform"):
        sample_rng()


def noisy_collate(samples: list[dict[str, Any]]) -> dict[str, Any]:
    batch = collate(samples)
    batch["mix"] = float(torch.rand(()))  # MixUp-style: one draw per batch
    return batch


@pytest.mark.parametrize("workers", [0, 2])
def test_collate_draws_follow_rank_and_batch_index(data: Path, workers: int) -> None:
    ds = ShardDataset(data, shuffle=True, seed=SEED)
    got = [b["mix"] for b in make_loader(ds, batch_size=BATCH, num_workers=workers, collate_fn=noisy_collate)]
    assert len(got) == N // BATCH
    want = []
    for i in range(N // BATCH):
        g = torch.Generator()
        g.manual_seed(batch_seed(SEED, 0, 0, i))
        want.append(float(torch.rand((), generator=g)))
    assert got == want


def identity(sample: dict[str, Any]) -> dict[str, Any]:
    return sample


def global_states_after(data: Path, transform: Any, sample_seeding: Any) -> tuple[float, float, float]:
    torch.manual_seed(5)
    np.random.seed(5)
    random.seed(5)
    ds = ShardDataset(data, shuffle=True, seed=SEED, transform=transform, sample_seeding=sample_seeding)
    assert len(list(make_loader(ds, batch_size=BATCH, num_workers=0))) == N // BATCH
    return (float(torch.rand(())), float(np.random.rand()), random.random())


def test_the_training_loops_generators_are_left_as_they_were(data: Path) -> None:
    """With num_workers=0 the samples are prepared in this process: seeding them (and
    their draws) must leave the generators the training loop draws from (dropout, init)
    where a loader that neither seeds nor draws leaves them."""
    assert global_states_after(data, draw, True) == global_states_after(data, identity, False)


def test_seeding_can_be_turned_off(data: Path) -> None:
    """sample_seeding=False: the transform draws from the generators as they are."""
    got = draws_by_key(epoch_batches(data, 0, sample_seeding=False))
    assert len(got) == N
    assert sum(got[k][0] == expected(k, 0)[0] for k in got) == 0


def gaussians(sample: dict[str, Any]) -> dict[str, Any]:
    """One draw from each generator's normal sampler: numpy and Python cache a second
    normal (``RandomState``'s gauss, ``random.gauss_next``); seeding must clear it."""
    sample["n"] = float(np.random.standard_normal())
    sample["p"] = random.gauss(0.0, 1.0)
    sample["t"] = float(torch.randn(()))
    return sample


def test_no_cached_normal_leaks_into_the_next_sample(data: Path) -> None:
    ds = ShardDataset(data, shuffle=True, seed=SEED, transform=gaussians)
    for b in make_loader(ds, batch_size=BATCH, num_workers=0):
        for k, n, p in zip(b["__key__"], b["n"].tolist(), b["p"].tolist()):
            s = sample_seed(SEED, 0, k)
            assert n == np.random.RandomState(s >> 32).standard_normal()
            assert p == random.Random(s).gauss(0.0, 1.0)


def coins(sample: dict[str, Any]) -> dict[str, Any]:
    sample["t"] = int(torch.randint(0, 2**16, ()))
    sample["n"] = int(np.random.randint(0, 2**16))
    return sample


def test_torch_and_numpy_draws_of_a_sample_are_unrelated(data: Path) -> None:
    """Both are Mersenne Twisters seeded from 32 bits: seeded from the same 32 bits they
    would draw the same words (torch.randint(0, 2) == np.random.randint(0, 2) for every sample)."""
    ds = ShardDataset(data, shuffle=True, seed=SEED, transform=coins)
    same = sum(int(t == n) for b in make_loader(ds, batch_size=BATCH, num_workers=0) for t, n in zip(b["t"], b["n"]))
    assert same <= 2  # 240 pairs of 16-bit draws: about 0.004 equal by chance


def test_seeding_only_the_named_generators(data: Path) -> None:
    got = draws_by_key(epoch_batches(data, 0, sample_seeding=("torch",)))
    assert all(got[k][0] == expected(k, 0)[0] for k in got)
    assert sum(got[k][1] == expected(k, 0)[1] for k in got) == 0
    assert sum(got[k][2] == expected(k, 0)[2] for k in got) == 0
    two = draws_by_key(epoch_batches(data, 2, sample_seeding=["numpy", "python"]))
    assert all(two[k][1:] == expected(k, 0)[1:] for k in two)
    assert sum(two[k][0] == expected(k, 0)[0] for k in two) == 0


def torch_only(sample: dict[str, Any]) -> dict[str, Any]:
    sample["t"] = float(torch.rand(()))
    return sample


def test_generators_not_named_are_not_touched(data: Path) -> None:
    """("torch",): numpy's and Python's generators go on from where the training loop left them."""
    assert global_states_after(data, torch_only, ("torch",)) == global_states_after(data, identity, False)


@pytest.mark.parametrize("option", [("torch", "cuda"), "np", ["Python"]])
def test_an_unknown_generator_is_named(data: Path, option: Any) -> None:
    with pytest.raises(ValueError, match="unknown generators.*known: \\['torch', 'numpy', 'python'\\]"):
        ShardDataset(data, sample_seeding=option)


def test_expand_draws_follow_the_sample_and_end_with_it(data: Path) -> None:
    """``expand`` runs seeded for its sample; once it returns, the sample's seed is gone
    (``sample_rng()`` outside a sample's preparation raises, as after a transform)."""
    from shardflow.expand import Expand

    seen: dict[str, float] = {}
    after: list[bool] = []

    def crops(sample: dict[str, Any], rng: np.random.Generator) -> list[dict[str, Any]]:
        seen[sample["__key__"]] = float(torch.rand(()))
        return [sample]

    def check(sample: dict[str, Any]) -> dict[str, Any]:
        return sample

    ds = ShardDataset(data, shuffle=True, seed=SEED, expand=Expand(crops, 1), transform=check)
    for s in ds:
        try:
            sample_rng()
            after.append(True)
        except RuntimeError:
            after.append(False)
    assert len(seen) == N and not any(after)
    for key, t in seen.items():
        g = torch.Generator()
        g.manual_seed(sample_seed(SEED, 0, key))
        assert t == float(torch.rand((), generator=g))


@pytest.fixture(scope="module")
def bare(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """6 shards of 40 without a manifest (an unsized stream): each worker batches its own shards."""
    return make_shards(tmp_path_factory.mktemp("seeding-bare"), [40] * 6, manifest=False)


@pytest.mark.parametrize("workers", [0, 2, 3])
def test_unsized_collate_draws_are_seeded_by_the_batchs_position(bare: Path, workers: int) -> None:
    """Without a manifest each worker numbers its own batches 0, 1, ...: batch 0 of worker 0 and
    batch 0 of worker 1 were seeded alike and drew the same MixUp weight (0.5553 twice). A batch
    is seeded as the rank's batch at the position the DataLoader yields it (n * workers + worker)."""
    ds = ShardDataset(bare, seed=SEED)
    got = [b["mix"] for b in make_loader(ds, batch_size=BATCH, num_workers=workers, collate_fn=noisy_collate,
                                         timeout=60 if workers else 0)]
    assert len(got) == N // BATCH  # 40 per shard, 2 or 3 whole shards per worker: no short batch
    want = []
    for i in range(N // BATCH):
        g = torch.Generator()
        g.manual_seed(batch_seed(SEED, 0, 0, i))
        want.append(float(torch.rand((), generator=g)))
    assert got == want
    assert len(set(got)) == N // BATCH


def bare_states_after(bare: Path, transform: Any, sample_seeding: Any) -> tuple[float, float, float]:
    torch.manual_seed(5)
    np.random.seed(5)
    random.seed(5)
    ds = ShardDataset(bare, seed=SEED, transform=transform, sample_seeding=sample_seeding)
    assert len(list(make_loader(ds, batch_size=BATCH, num_workers=0))) == N // BATCH
    return (float(torch.rand(())), float(np.random.rand()), random.random())


def test_unsized_batches_leave_the_training_loops_generators_as_they_were(bare: Path) -> None:
    """num_workers=0 without a manifest: the batch seeding (and the transform's) ran in the training
    process and was never undone, so all three of its generators were reset to the last batch's seed."""
    assert bare_states_after(bare, draw, True) == bare_states_after(bare, identity, False)
    assert bare_states_after(bare, None, True) == bare_states_after(bare, identity, False)


@pytest.mark.parametrize("option, names", [(np.bool_(True), ("torch", "numpy", "python")), (np.bool_(False), ())])
def test_a_numpy_bool_is_a_bool(data: Path, option: Any, names: tuple[str, ...]) -> None:
    """np.bool_ (a config read with numpy) failed with "'numpy.bool' object is not iterable"."""
    assert ShardDataset(data, sample_seeding=option).sample_seeding == names


@pytest.mark.parametrize("option", [1, 0, 2.5])
def test_a_number_is_refused_by_name(data: Path, option: Any) -> None:
    """sample_seeding=1 failed with "'int' object is not iterable", naming nothing."""
    with pytest.raises(TypeError, match="sample_seeding must be True, False or generator names"):
        ShardDataset(data, sample_seeding=option)
