"""Tampered resume states (issue 25, case g): every value a state declares is checked against the
dataset at ``load_state_dict`` (a ``StateError`` naming it), before anything is sized or looped by it.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

import shardflow
from shardflow import ShardDataset
from shardflow.errors import StateError

from .helpers import make_shards

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def sized(tmp_path: Path) -> tuple[ShardDataset, dict]:
    ds = ShardDataset(str(make_shards(tmp_path, [10, 10])), decode=None)
    it = iter(ds)
    for _ in range(3):
        next(it)
    return ds, ds.state_dict()


def _tampered(state: dict, **changes) -> dict:
    out = copy.deepcopy(state)
    out.update(changes)
    return out


@pytest.mark.parametrize(
    "change, said",
    [
        ({"remaining": [[10**9, 1]]}, r"world size 1000000000 .* more than"),
        ({"remaining": [[1, 1]] * 200_000}, r"200000 stages, more than 1024"),
        ({"remaining": [[1, 10**12]]}, r"10\^?12|1000000000000 steps"),
        ({"epoch": 2**70}, r"epoch 1180591620717411303424 is not an int in \[0, 2\*\*62\)"),
        ({"epoch": -1}, r"epoch -1 is not an int"),
        ({"epoch": "3"}, r"epoch '3' is not an int"),
        ({"epoch": True}, r"epoch True is not an int"),
        ({"next_worker": -1}, r"next_worker -1"),
        ({"next_worker": 2**40}, r"next_worker 1099511627776"),
    ],
)
def test_a_tampered_state_is_a_state_error_at_load(sized, change: dict, said: str) -> None:
    ds, state = sized
    bad = _tampered(state, **change)
    with pytest.raises(StateError, match=said):
        ds.load_state_dict(bad)
    loader = shardflow.loader(ds, batch_size=2, num_workers=0)
    lstate = loader.state_dict()
    with pytest.raises(StateError, match=said):
        loader.load_state_dict(_tampered(lstate, **change))


def test_states_within_bounds_still_resume(sized) -> None:
    ds, state = sized
    fresh = ShardDataset(ds.shards.urls[0].rsplit("/", 1)[0], decode=None)
    fresh.load_state_dict(state)
    assert len([s["__key__"] for s in fresh]) == 17  # 20 samples, 3 taken
    elastic = _tampered(state, remaining=[[4, 2], [1, 0]])  # 8 samples taken on 4 ranks, then this world
    fresh.load_state_dict(elastic)
    assert len(list(fresh)) == 12


def test_unsized_skips_are_bounded(tmp_path: Path) -> None:
    folder = make_shards(tmp_path, [5, 5], manifest=False)
    ds = ShardDataset(sorted(str(p) for p in folder.glob("*.tar")), decode=None)
    it = iter(ds)
    next(it)
    state = ds.state_dict()
    for remaining, said in (([-1], r"skip -1"), ([2**70], r"skip 1180591620717411303424"), (["x"], r"skip 'x'"),
                            ([0] * 100_000, r"100000 worker streams")):
        with pytest.raises(StateError, match=said):
            ds.load_state_dict(_tampered(state, remaining=remaining))
