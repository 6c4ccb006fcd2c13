"""What DataLoader workers do for the loader: the first batch computed at ``iter()``
(shardflow.batching.Primed), and batches stacked straight into shared memory
(shardflow.collation), checked inside real worker processes."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from shardflow import ShardDataset
from shardflow.batching import Primed
from shardflow.collation import collate
from shardflow.errors import ShardflowError
from shardflow.loading import loader as make_loader
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
    """Yields, from a worker, whether collate's tensors lie in shared memory there."""

    def __iter__(self) -> Iterator[Any]:
        samples = [{"img": torch.full((3, 4, 5), i, dtype=torch.uint8), "arr": np.full((2, 3), i, np.float32),
                    "cls": i} for i in range(4)]
        batch = collate(samples)
        yield {
            "in_worker": get_worker_info() is not None,
            "img_shared": batch["img"].is_shared(),
            "arr_shared": batch["arr"].is_shared(),
            "img": batch["img"],
            "arr": batch["arr"],
        }


@pytest.mark.parametrize("workers", [0, 1])
def test_collate_stacks_into_shared_memory_in_workers(workers: int) -> None:
    (got,) = list(DataLoader(_WhereStacked(), batch_size=None, num_workers=workers, timeout=60 if workers else 0))
    assert got["in_worker"] == bool(workers)
    assert got["img_shared"] == bool(workers) and got["arr_shared"] == bool(workers)
    assert got["img"].shape == (4, 3, 4, 5) and got["img"].dtype == torch.uint8
    assert got["img"][:, 0, 0, 0].tolist() == [0, 1, 2, 3]
    assert got["arr"].shape == (4, 2, 3) and got["arr"].dtype == torch.float32
    assert got["arr"][:, 1, 2].tolist() == [0.0, 1.0, 2.0, 3.0]
