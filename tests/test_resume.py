"""Mid-epoch resumption (C11) through the one helper, for every stateful piece.

``assert_resumes`` (tests/helpers.py) runs an epoch uninterrupted, then again
to step k, saves, rebuilds, loads and finishes, and compares item for item,
including the epoch after. It is applied to the dataset iterated directly (in
the main process) and to the loader with 0, 1, 2 and 3 workers, persistent or
not, sized or not.
"""

from __future__ import annotations

import json
import pickle
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from shardflow import ShardDataset
from shardflow.errors import ShardflowError, StateError
# `shardflow.loader` (the function) is shadowed by the submodule once another test imports it:
# take the function from its module.
from shardflow.loading.shardloader import ShardLoader
from shardflow.loading.shardloader import loader as make_loader
from shardflow.planning.plan import ShuffleConfig
from tests.helpers import assert_resumes, canonical, make_shards, sample_key

TIMEOUT = 60

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")

C11_SHUFFLE = ShuffleConfig(shards=True, buffer=16)
C11_INTERLEAVED = ShuffleConfig(shards=True, buffer=16, window=0)


@pytest.fixture(scope="module")
def c11(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_shards(tmp_path_factory.mktemp("c11"), [10] * 10)


@pytest.fixture(scope="module")
def c11_bare(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_shards(tmp_path_factory.mktemp("c11bare"), [10] * 10, manifest=False)


def loader_maker(folder: Path, shuffle: Any = C11_SHUFFLE, workers: int = 2, epoch: int | None = None, **kw: Any) -> Callable[[], Any]:
    ds_kw = {k: kw.pop(k) for k in ("rank", "world_size", "seed", "partial") if k in kw}
    ds_kw.setdefault("seed", 0)

    def make() -> ShardLoader:
        ds = ShardDataset(folder, shuffle=shuffle, decode=None, **ds_kw)
        if epoch is not None:
            ds.set_epoch(epoch)
        timeout = TIMEOUT if workers else 0
        return make_loader(ds, batch_size=kw.get("batch_size", 4), num_workers=workers, timeout=timeout,
                                **{k: v for k, v in kw.items() if k != "batch_size"})

    return make


def flat_keys(batches: list[Any]) -> list[str]:
    return [k for b in batches for k in b["__key__"]]


def batch_set(batches: list[Any]) -> list[tuple[str, ...]]:
    return sorted(tuple(b["__key__"]) for b in batches)


# ---------------------------------------------------------------- C11 exact


C11_FIRST = {  # the first batch, exact: the same on every machine
    C11_SHUFFLE: ["000031", "000053", "000026", "000021"],  # the window shuffle (shardflow.window)
    C11_INTERLEAVED: ["000083", "000042", "000040", "000043"],  # 4 shards at a time, a 16-sample buffer
}


@pytest.mark.parametrize("shuffle", [C11_SHUFFLE, C11_INTERLEAVED, False], ids=["shuffle", "interleaved", "stored"])
def test_c11_resume_after_five_batches(c11: Path, shuffle: Any) -> None:
    record, record_next = assert_resumes(loader_maker(c11, shuffle), k=5)
    assert len(record) == len(record_next) == 25
    assert [len(b["__key__"]) for b in record] == [4] * 25
    assert sorted(flat_keys(record)) == sorted(flat_keys(record_next)) == [sample_key(i) for i in range(100)]
    if shuffle:
        assert flat_keys(record) != flat_keys(record_next)  # epoch 1 is another order
        assert record[0]["__key__"] == C11_FIRST[shuffle]
    else:
        assert record == record_next
        # stored order through 2 workers: batches go round robin, the DataLoader alternates
        assert flat_keys(record) == [sample_key(i) for i in range(100)]


@pytest.mark.parametrize("k", [0, 1, 12, 23, 24, 25])
def test_c11_resume_at_any_step(c11: Path, k: int) -> None:
    assert_resumes(loader_maker(c11), k=k)


@pytest.mark.parametrize("workers", [0, 1, 3])
def test_c11_resume_other_worker_counts(c11: Path, workers: int) -> None:
    assert_resumes(loader_maker(c11, workers=workers), k=7)


def test_c11_resume_persistent_workers(c11: Path) -> None:
    assert_resumes(loader_maker(c11, persistent_workers=True), k=5)


def test_c11_resume_in_a_later_epoch(c11: Path) -> None:
    record, record_next = assert_resumes(loader_maker(c11, epoch=3), k=9)
    epoch4 = loader_maker(c11, epoch=4)()
    assert [canonical(b) for b in epoch4] == record_next


def test_c11_resume_with_ranks(c11: Path) -> None:
    for rank in range(2):
        record, _ = assert_resumes(loader_maker(c11, rank=rank, world_size=2, partial="drop", batch_size=3), k=4)
        assert len(record) == 17  # 50 samples per rank, batches of 3


def test_resume_every_step_with_uneven_worker_runs(tmp_path: Path) -> None:
    """3 workers over 10 batches (3, 3, 4): the DataLoader's round robin skips a worker
    that is done; the saved position must follow it at every step."""
    folder = make_shards(tmp_path, [7, 3, 10])
    make = loader_maker(folder, ShuffleConfig(shards=True, buffer=5, interleave=2), workers=3, batch_size=2)
    record = [canonical(b) for b in make()]
    assert len(record) == 10
    for k in range(len(record) + 1):
        ld = make()
        it = iter(ld)
        head = [canonical(next(it)) for _ in range(k)]
        state = ld.state_dict()
        del it, ld
        fresh = make()
        fresh.load_state_dict(state)
        assert head + [canonical(b) for b in fresh] == record, f"resumed at {k}"


# ---------------------------------------------------------------- changed configuration


def test_c11_changed_worker_count_resumes_the_remaining_batches(c11: Path) -> None:
    record = [canonical(b) for b in loader_maker(c11)()]
    for workers in (0, 1, 3, 4):
        ld = loader_maker(c11)()
        it = iter(ld)
        head = [canonical(next(it)) for _ in range(5)]
        state = ld.state_dict()
        del it, ld
        other = loader_maker(c11, workers=workers)()
        other.load_state_dict(state)
        rest = [canonical(b) for b in other]
        # the same remaining batches, each once (order may differ: documented in ShardLoader.state_dict)
        assert batch_set(rest) == batch_set(record[5:]), workers
        assert Counter(flat_keys(head + rest)) == Counter(flat_keys(record))
        # and the next epoch is the recorded epoch 1, batch for batch
        epoch1 = [canonical(b) for b in other]
        assert batch_set(epoch1) == batch_set([canonical(b) for b in _epoch(loader_maker(c11), 1)])


def _epoch(make: Callable[[], Any], epoch: int) -> list[Any]:
    ld = make()
    ld.dataset.set_epoch(epoch)
    return list(ld)


def test_c11_changed_world_size_resumes_exactly(c11: Path) -> None:
    """C11: "a changed world size either resumes exactly or raises". It resumes (elastic, see
    tests/test_elastic.py): the batches one rank had not taken, shared over two, each sample once."""
    record = [canonical(b) for b in loader_maker(c11)()]
    ld = loader_maker(c11)()
    it = iter(ld)
    head = [canonical(next(it)) for _ in range(5)]
    state = ld.state_dict()
    del it
    rest = []
    for rank in range(2):
        other = loader_maker(c11, rank=rank, world_size=2)()
        other.load_state_dict(state)
        assert len(other) == 10  # 80 samples left: 40 per rank, 10 batches of 4
        rest += [canonical(b) for b in other]
    assert Counter(flat_keys(head + rest)) == Counter(flat_keys(record))
    direct = ShardDataset(c11, shuffle=C11_SHUFFLE, decode=None)
    it2 = iter(direct)
    taken = [next(it2)["__key__"] for _ in range(7)]
    left = []
    for rank in range(2):
        ds = ShardDataset(c11, shuffle=C11_SHUFFLE, rank=rank, world_size=2, decode=None)
        ds.load_state_dict(direct.state_dict())
        left += [s["__key__"] for s in ds]
    assert len(left) == 94 and sorted(set(taken + left)) == [sample_key(i) for i in range(100)]  # 93 left: 1 padded
    assert Counter(taken + left).most_common(2)[1][1] == 1 and left[-1] == left[0]  # the padding: the first one again


@pytest.mark.parametrize(
    "change, name",
    [({"seed": 1}, "seed"), ({"shuffle": False}, "shuffle"), ({"batch_size": 5}, "batch_size"), ({"drop_last": True}, "drop_last")],
)
def test_changed_configuration_raises_naming_it(c11: Path, change: dict[str, Any], name: str) -> None:
    ld = loader_maker(c11, workers=0)()
    it = iter(ld)
    next(it)
    state = ld.state_dict()
    other = loader_maker(c11, workers=0, **change)()
    with pytest.raises(StateError, match=name):
        other.load_state_dict(state)


def test_state_is_versioned_and_plain(c11: Path) -> None:
    ld = loader_maker(c11, workers=0)()
    it = iter(ld)
    next(it)
    state = ld.state_dict()
    assert json.loads(json.dumps(state)) == state  # a checkpoint can store it as JSON
    assert {"kind", "version", "epoch", "remaining", "next_worker", "config"} <= set(state)
    assert state["kind"] == "ShardLoader" and state["epoch"] == 0
    with pytest.raises(StateError, match="version"):
        loader_maker(c11, workers=0)().load_state_dict({**state, "version": 99})
    with pytest.raises(StateError, match="ShardLoader"):
        loader_maker(c11, workers=0)().load_state_dict({**state, "kind": "ShardDataset"})


# ---------------------------------------------------------------- epochs around resumption


@pytest.mark.parametrize("workers, persistent", [(0, False), (2, False), (2, True)])
def test_c11_break_without_saving_starts_a_new_epoch(c11: Path, workers: int, persistent: bool) -> None:
    make = loader_maker(c11, workers=workers, **({"persistent_workers": True} if persistent else {}))
    first = make()
    epoch0, epoch1 = [canonical(b) for b in first], [canonical(b) for b in first]
    ld = make()
    for i, _ in enumerate(ld):
        if i == 4:
            break
    assert [canonical(b) for b in ld] == epoch1  # not the rest of epoch 0, not epoch 0 again
    assert epoch0 != epoch1


@pytest.mark.parametrize("workers, persistent", [(0, False), (2, False), (2, True)])
def test_a_second_iter_before_the_first_ends(c11: Path, workers: int, persistent: bool) -> None:
    """Two iter() of one loader, the first not finished: the first reads epoch 0, the second
    epoch 1 whole, and the state follows the second (both iter() before a next() made the first
    read epoch 1, mixed with 2 workers). With persistent workers (one DataLoader iterator)
    advancing the first after the second started took batches 3-4 of epoch 1 from under the
    second (it then yielded 20 of 22, the two counted in epoch 0's run): it raises instead."""
    make = loader_maker(c11, workers=workers, **({"persistent_workers": True} if persistent else {}))
    first = make()
    epoch0, epoch1 = [canonical(b) for b in first], [canonical(b) for b in first]
    ld = make()
    one = iter(ld)
    if persistent:  # one DataLoader iterator: the first must have started
        got_one = [canonical(next(one)) for _ in range(3)]
    two = iter(ld)  # without persistent workers, before the first next() of the first
    if not persistent:
        got_one = [canonical(next(one)) for _ in range(3)]
    got_two = [canonical(next(two)) for _ in range(3)]
    assert got_one == epoch0[:3] and got_two == epoch1[:3]
    assert ld.state_dict()["epoch"] == 1 and ld.state_dict()["remaining"] == [[1, 3]]
    if persistent:
        with pytest.raises(ShardflowError, match="superseded by a later iter"):
            next(one)
    else:
        assert [canonical(next(one)) for _ in range(2)] == epoch0[3:5]
    assert [canonical(b) for b in two] == epoch1[3:]
    assert ld.state_dict()["epoch"] == 2 and ld.state_dict()["remaining"] == []


@pytest.mark.parametrize("workers, persistent", [(0, False), (2, False), (2, True)])
def test_set_epoch_between_iter_and_first_batch_names_the_state(c11: Path, workers: int, persistent: bool) -> None:
    """Lightning calls iter() and then (ShardEpochs) set_epoch(0) before the first batch. The
    data follow set_epoch (here 2), but the run's state said epoch 0 (after a check iter(), 1):
    a checkpoint in that epoch resumed another epoch's batches."""
    make = loader_maker(c11, workers=workers, **({"persistent_workers": True} if persistent else {}))
    first = make()
    epochs = [[canonical(b) for b in first] for _ in range(4)]
    ld = make()
    it = iter(ld)
    ld.dataset.set_epoch(2)
    head = [canonical(next(it)) for _ in range(4)]
    assert head == epochs[2][:4]
    state = ld.state_dict()
    assert state["epoch"] == 2 and state["remaining"] == [[1, 4]]
    assert [canonical(b) for b in it] == epochs[2][4:]
    resumed = make()
    resumed.load_state_dict(state)
    assert [canonical(b) for b in resumed] == epochs[2][4:]
    assert [canonical(b) for b in ld] == epochs[3]


def test_state_right_after_loading_keeps_the_position(c11: Path) -> None:
    """A checkpoint taken after resuming but before the next batch must not lose the position."""
    make = loader_maker(c11)
    record = [canonical(b) for b in make()]
    ld = make()
    it = iter(ld)
    for _ in range(6):
        next(it)
    state = ld.state_dict()
    del it
    again = make()
    again.load_state_dict(state)
    state2 = again.state_dict()  # saved again before iterating
    final = make()
    final.load_state_dict(state2)
    assert [canonical(b) for b in final] == record[6:]


def test_state_before_and_after_an_epoch(c11: Path) -> None:
    make = loader_maker(c11)
    first = make()
    epoch0 = [canonical(b) for b in first]
    epoch1 = [canonical(b) for b in first]
    fresh = make()
    untouched = fresh.state_dict()  # nothing read yet: the next epoch is 0
    assert untouched["epoch"] == 0 and untouched["remaining"] == []
    done = make()
    list(done)
    after = done.state_dict()  # a whole epoch read: the next one is 1
    assert after["epoch"] == 1
    for state, want in ((untouched, epoch0), (after, epoch1)):
        ld = make()
        ld.load_state_dict(state)
        assert [canonical(b) for b in ld] == want


# ---------------------------------------------------------------- the dataset iterated directly


@pytest.mark.parametrize("shuffle", [C11_SHUFFLE, False], ids=["shuffle", "stored"])
@pytest.mark.parametrize("k", [0, 1, 37, 99, 100])
def test_dataset_direct_resumes(c11: Path, shuffle: Any, k: int) -> None:
    record, record_next = assert_resumes(lambda: ShardDataset(c11, shuffle=shuffle, seed=0, decode=None), k=k)
    assert len(record) == 100 and sorted(s["__key__"] for s in record) == [sample_key(i) for i in range(100)]
    assert (record == record_next) == (not shuffle)


def test_dataset_direct_resumes_with_ranks(c11: Path) -> None:
    for rank in range(3):
        record, _ = assert_resumes(lambda: ShardDataset(c11, shuffle=True, seed=3, rank=rank, world_size=3, decode=None), k=11)
        assert len(record) == 34  # ceil(100 / 3), padded


def test_dataset_direct_state_right_after_loading(c11: Path) -> None:
    make = lambda: ShardDataset(c11, shuffle=C11_SHUFFLE, seed=0, decode=None)  # noqa: E731
    record = [canonical(s) for s in make()]
    ds = make()
    it = iter(ds)
    for _ in range(30):
        next(it)
    state = ds.state_dict()
    again = make()
    again.load_state_dict(state)
    final = make()
    final.load_state_dict(again.state_dict())
    assert [canonical(s) for s in final] == record[30:]


# ---------------------------------------------------------------- without a manifest


@pytest.mark.parametrize("shuffle", [C11_SHUFFLE, False], ids=["shuffle", "stored"])
def test_unsized_loader_resumes_with_the_same_workers(c11_bare: Path, shuffle: Any) -> None:
    record, _ = assert_resumes(loader_maker(c11_bare, shuffle), k=5)
    assert sorted(flat_keys(record)) == [sample_key(i) for i in range(100)]


def test_unsized_dataset_direct_resumes(c11_bare: Path) -> None:
    record, _ = assert_resumes(lambda: ShardDataset(c11_bare, shuffle=C11_SHUFFLE, seed=0, decode=None), k=42)
    assert len(record) == 100


def test_unsized_changed_worker_count_raises(c11_bare: Path) -> None:
    ld = loader_maker(c11_bare)()
    it = iter(ld)
    next(it)
    state = ld.state_dict()
    del it
    with pytest.raises(StateError, match="num_workers"):
        loader_maker(c11_bare, workers=3)().load_state_dict(state)


def test_state_pickles(c11: Path) -> None:
    ds = ShardDataset(c11, shuffle=C11_SHUFFLE)
    it = iter(ds)
    next(it)
    state = ds.state_dict()
    assert pickle.loads(pickle.dumps(state)) == state


@pytest.mark.parametrize("sized", [True, False], ids=["sized", "unsized"])
@pytest.mark.parametrize("steps", [(3, 4), (2, 7)])
def test_resume_twice_in_one_epoch(c11: Path, c11_bare: Path, sized: bool, steps: tuple[int, int]) -> None:
    """Save, resume, take more, save again, resume again: still the uninterrupted epoch."""
    make = loader_maker(c11 if sized else c11_bare, workers=3)
    record = [canonical(b) for b in make()]
    got: list[Any] = []
    state = None
    for k in steps:
        ld = make()
        if state is not None:
            ld.load_state_dict(state)
        it = iter(ld)
        got += [canonical(next(it)) for _ in range(k)]
        state = ld.state_dict()
        del it, ld
    last = make()
    last.load_state_dict(state)
    got += [canonical(b) for b in last]
    assert got == record


@pytest.mark.parametrize("bare", [False, True], ids=["manifest", "no_manifest"])
def test_a_direct_pass_over_a_dataset_a_loader_took_has_one_state_path(c11, c11_bare, bare):
    """Iterated directly after a loader set its batching, the dataset yields samples under its own
    split, and its state_dict names that pass's position (the pass is an epoch run like the
    loader's; it used to run on a copy whose position the dataset did not see)."""
    folder = c11_bare if bare else c11

    def taken() -> ShardDataset:
        ds = ShardDataset(folder, shuffle=C11_SHUFFLE, seed=4, decode=None)
        make_loader(ds, batch_size=8)
        return ds

    ds = taken()
    it = iter(ds)
    head = [next(it)["__key__"] for _ in range(23)]
    state = ds.state_dict()
    rest = [s["__key__"] for s in it]
    assert state["kind"] == "ShardDataset" and state["epoch"] == 0 and state["remaining"]
    assert sorted(head + rest) == [f"{i:06d}" for i in range(100)]
    fresh = taken()
    fresh.load_state_dict(state)
    assert [s["__key__"] for s in fresh] == rest
    assert ds.stats["samples"] == 100 and fresh.stats["samples"] == len(rest)
