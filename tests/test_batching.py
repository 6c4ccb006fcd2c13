"""What DataLoader workers do for the loader: the first batch computed at ``iter()``
(shardflow.loading.batching.Primed), large batches stacked straight into shared memory
(shardflow.loading.collation) and small tensors sent by value (WorkerItem), checked inside real
worker processes."""

from __future__ import annotations

import pickle
from collections.abc import Iterator
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.multiprocessing  # noqa: F401 - registers torch's reductions with ForkingPickler
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from shardflow import ShardDataset
from shardflow.loading.batching import Primed, WorkerItem, skip_items, take
from shardflow.loading.collation import collate
from shardflow.errors import ShardflowError
from shardflow.loading.shardloader import loader as make_loader
from shardflow.loading.transfer import BY_VALUE_MAX_BYTES
from tests.helpers import make_shards

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")


class _Counting:
    def __init__(self, n: int, fail_at: int | None = None) -> None:
        self.n, self.fail_at, self.calls, self.closed = n, fail_at, 0, False

    def __iter__(self) -> Iterator[int]:
        return self

    def __next__(self) -> int:
        i = self.calls
        self.calls += 1
        if i == self.fail_at:
            raise ShardflowError(f"item {i} is bad")
        if i >= self.n:
            raise StopIteration
        return i

    def close(self) -> None:
        self.closed = True


def test_primed_computes_the_first_item_at_once_and_then_streams() -> None:
    items = _Counting(3)
    primed = Primed(items)
    assert items.calls == 1  # the first item, before any next()
    assert list(primed) == [0, 1, 2]
    assert list(Primed(_Counting(0))) == []


def test_primed_raises_an_error_of_the_first_item_at_the_first_next() -> None:
    primed = Primed(_Counting(3, fail_at=0))  # does not raise here
    with pytest.raises(ShardflowError, match="item 0 is bad"):
        next(primed)
    later = Primed(_Counting(3, fail_at=1))
    assert next(later) == 0
    with pytest.raises(ShardflowError, match="item 1 is bad"):
        next(later)


def test_primed_close_closes_the_items() -> None:
    items = _Counting(3)
    primed = Primed(items)
    primed.close()
    assert items.closed


def test_loader_workers_prime_their_first_batch(tmp_path: Path) -> None:
    """Batches from primed workers are those of the main process, in the same order."""
    data = make_shards(tmp_path, [10] * 6)
    runs = []
    for workers in (0, 2):
        ds = ShardDataset(data, shuffle=8, decode=None, seed=3)
        runs.append([list(b["__key__"]) for b in make_loader(ds, batch_size=4, num_workers=workers, timeout=60 if workers else 0)])
    assert runs[0] == runs[1] and len(runs[0]) == 15


def test_loader_worker_error_in_the_first_batch_reaches_the_main_process(tmp_path: Path) -> None:
    data = make_shards(tmp_path, [5, 5])
    (data / "train-000000.tar").write_bytes(b"this is no tar" * 100)
    ds = ShardDataset(data, decode=None)
    with pytest.raises(Exception, match="train-000000.tar"):
        list(make_loader(ds, batch_size=2, num_workers=2, timeout=60))


class _WhereStacked(IterableDataset):
    """Yields, from a worker, whether collate's tensors lie in shared memory there (two batches:
    a worker's first one, when small, is stacked into private memory to travel by value)."""

    def __iter__(self) -> Iterator[Any]:
        # img and arr over BY_VALUE_MAX_BYTES per batch (110 and 131 kB), cls under it
        samples = [{"img": torch.full((3, 96, 96), i, dtype=torch.uint8), "arr": np.full((2, 4096), i, np.float32),
                    "cls": i} for i in range(4)]
        for _ in range(2):
            batch = collate(samples)
            yield {
                "in_worker": get_worker_info() is not None,
                "img_shared": batch["img"].is_shared(),
                "arr_shared": batch["arr"].is_shared(),
                "cls_shared": batch["cls"].is_shared(),
                "img": batch["img"],
                "arr": batch["arr"],
            }


@pytest.mark.parametrize("workers", [0, 1])
def test_collate_stacks_into_shared_memory_in_workers(workers: int) -> None:
    first, got = list(DataLoader(_WhereStacked(), batch_size=None, num_workers=workers, timeout=60 if workers else 0))
    assert got["in_worker"] == first["in_worker"] == bool(workers)
    assert got["img_shared"] == bool(workers) and got["arr_shared"] == bool(workers)
    # the worker's first batch: its first tensor over 64 KiB (img) by value; arr takes a slot
    assert not first["img_shared"] and first["arr_shared"] == bool(workers)
    assert not got["cls_shared"]  # small: it travels by value
    assert got["img"].shape == (4, 3, 96, 96) and got["img"].dtype == torch.uint8
    assert got["img"][:, 0, 0, 0].tolist() == [0, 1, 2, 3]
    assert got["arr"].shape == (4, 2, 4096) and got["arr"].dtype == torch.float32
    assert got["arr"][:, 1, 2].tolist() == [0.0, 1.0, 2.0, 3.0]


# ---------------------------------------------------------------- by value


def test_small_tensors_travel_by_value_and_arrive_equal_and_writable():
    labels = torch.arange(64)
    flags = torch.tensor([True, False])
    halves = torch.linspace(0, 1, 10, dtype=torch.float16)
    strided = torch.arange(100, dtype=torch.int32).reshape(10, 10)[:, ::3]  # not contiguous
    data = {"cls": labels, "nested": {"flags": flags, "pair": (halves, [strided])}, "__key__": ["a", "b"]}
    item = WorkerItem(1, 7, data, {"samples": 2}, False)
    payload = bytes(ForkingPickler.dumps(item))
    assert b"torch.multiprocessing" not in payload and b"rebuild_storage" not in payload  # no shared memory
    out = pickle.loads(payload)
    assert (out.worker, out.index, out.stats, out.final) == (1, 7, {"samples": 2}, False)
    assert out.data["__key__"] == ["a", "b"]
    got = [out.data["cls"], out.data["nested"]["flags"], out.data["nested"]["pair"][0], out.data["nested"]["pair"][1][0]]
    for before, after in zip([labels, flags, halves, strided], got):
        assert type(after) is torch.Tensor and after.dtype == before.dtype
        torch.testing.assert_close(after, before, rtol=0, atol=0)
    assert isinstance(out.data["nested"]["pair"], tuple) and isinstance(out.data["nested"]["pair"][1], list)
    got[0][0] = 99  # writable, and not the sender's memory
    assert labels[0] == 0


def test_large_and_special_tensors_are_left_to_torch():
    big = torch.zeros(BY_VALUE_MAX_BYTES + 1, dtype=torch.uint8)
    brain = torch.ones(4, dtype=torch.bfloat16)  # no numpy dtype
    grad = torch.ones(3, requires_grad=True)
    param = torch.nn.Parameter(torch.ones(2))
    payload = bytes(ForkingPickler.dumps(WorkerItem(0, 0, {"big": big, "bf": brain, "grad": grad, "p": param})))
    assert payload.count(b"rebuild_storage") >= 1  # the large one through shared memory
    out = pickle.loads(payload)
    torch.testing.assert_close(out.data["big"], big)
    assert out.data["bf"].dtype == torch.bfloat16 and out.data["grad"].requires_grad
    assert isinstance(out.data["p"], torch.nn.Parameter)


def test_at_the_limit_still_by_value():
    edge = torch.ones(BY_VALUE_MAX_BYTES // 8, dtype=torch.int64)
    assert b"rebuild_storage" not in bytes(ForkingPickler.dumps(WorkerItem(0, 0, {"x": edge})))


def test_take_and_skip_items():
    it = iter(range(5))
    assert take(it, 3) == [0, 1, 2] and take(it, 3) == [3, 4] and take(it, 1) == []
    assert list(skip_items(iter(range(5)), 2)) == [2, 3, 4]


class _Pinnable:
    """A batch value of a user's type with its own ``pin_memory`` (as PyG's ``Batch`` has)."""

    def __init__(self, value: int, pinned: bool = False) -> None:
        self.value, self.pinned = value, pinned

    def pin_memory(self) -> "_Pinnable":
        return _Pinnable(self.value, pinned=True)


def test_pin_memory_reaches_the_batch_inside_a_worker_item():
    """The DataLoader's pin thread runs torch's pin_memory on what a worker yields: a
    WorkerItem; the batch inside it must be pinned, not passed on as it is."""
    from torch.utils.data._utils.pin_memory import pin_memory

    item = WorkerItem(0, 3, {"graph": _Pinnable(7), "nested": [(_Pinnable(8),)], "__key__": ["a"]}, {"samples": 1})
    out = pin_memory(item)
    assert isinstance(out, WorkerItem) and (out.worker, out.index, out.stats) == (0, 3, {"samples": 1})
    assert out.data["graph"].pinned and out.data["graph"].value == 7
    assert out.data["nested"][0][0].pinned and out.data["__key__"] == ["a"]
    assert pin_memory(WorkerItem(1, 0, None, final=True)).data is None  # a final item carries no batch
