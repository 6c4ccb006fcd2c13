"""World: who is reading (shardflow.world), and DataLoader workers that end with their parent
but never before it."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from shardflow import ShardDataset
from shardflow.loading.shardloader import loader as make_loader
from shardflow.world import World
from tests.helpers import batch_keys, make_shards, sample_key

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")


def test_the_main_process_is_no_worker() -> None:
    assert World.in_worker() is False
    assert World.detect().num_workers == 1


@pytest.mark.timeout(120)
def test_persistent_workers_started_from_a_thread_that_ends_keep_serving(tmp_path: Path) -> None:
    # Linux's parent-death signal fires when the *thread* that forked a worker exits: workers
    # watching their parent that way die with the thread ("DataLoader worker ... exited unexpectedly")
    folder = make_shards(tmp_path, [12, 12])
    loader = make_loader(ShardDataset(folder, decode=None), batch_size=4, num_workers=2, persistent_workers=True)
    epochs: list[list[list[str]]] = []
    errors: list[BaseException] = []

    def first_epoch() -> None:
        try:
            epochs.append(batch_keys(loader))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    starter = threading.Thread(target=first_epoch)
    starter.start()
    starter.join()
    assert not errors
    for _ in range(2):  # the same workers, after their starter thread ended
        epochs.append(batch_keys(loader))
    everything = [sample_key(i) for i in range(24)]
    assert [sorted(k for b in e for k in b) for e in epochs] == [everything] * 3
