"""Tests for shardflow.loading.transfer: the per-worker pool of shared-memory batch buffers, in one
process (pickled as the DataLoader pickles) and through real DataLoader workers."""

from __future__ import annotations

import pickle
from multiprocessing.reduction import ForkingPickler
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.multiprocessing  # noqa: F401 - registers torch's reductions with ForkingPickler
from torch.utils.data import DataLoader, IterableDataset

from shardflow import ShardDataset
from shardflow.loading import transfer
from shardflow.loading.batching import WorkerItem
from shardflow.codecs.image import decode_image, encode_image
from shardflow.loading.collation import collate
from shardflow.loading.shardloader import loader as make_loader
from tests.helpers import make_shards

pytestmark = [pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning"), pytest.mark.usefixtures("fast_paths")]


@pytest.fixture(autouse=True)
def fresh_pool(monkeypatch):
    """Each test sends from a pool of its own (this process plays worker and main process),
    past its first batch (which goes the way torch sends tensors: see the test of it)."""
    monkeypatch.setattr(transfer, "_pool", None)
    transfer._worker_pool().first = False
    yield
    transfer.forget({transfer._pool.token} if transfer._pool is not None else set())


def cross(item: WorkerItem) -> WorkerItem:
    return pickle.loads(bytes(ForkingPickler.dumps(item)))


@pytest.mark.parametrize("fast_paths", [True], indirect=True)  # the pool itself
def test_slots_are_reused_and_what_arrived_stays_intact():
    received = []
    for k in range(3 * transfer.POOL_SLOTS):
        out = transfer.shared_out(8, (3, 40, 40), torch.uint8)
        out.fill_(k)
        item = cross(WorkerItem(0, k, {"img": out}))
        received.append(item.data["img"])
        assert item.pools  # it came through a slot
        assert not item.data["img"].is_shared()  # copied out into the main process's memory
    # every slot was handed back, so the pool never ran dry, and each batch kept its values
    assert [int(t.min()) for t in received] == [int(t.max()) for t in received] == list(range(3 * transfer.POOL_SLOTS))


@pytest.mark.parametrize("fast_paths", [True], indirect=True)  # the pool itself
@pytest.mark.parametrize("side", [64, 80])  # 64 images of 3 x side x side: 768 KiB, 1.2 MiB
def test_a_workers_first_batch_is_not_copied_out_of_a_slot(monkeypatch, side):
    """Up to FIRST_BY_VALUE_MAX_BYTES the first batch travels by value (no descriptor for the
    main process to fetch from the worker), larger as torch sends tensors (mapped and kept)."""
    monkeypatch.setattr(transfer, "_pool", None)  # a worker that has sent nothing yet
    out = transfer.shared_out(64, (3, side, side), torch.uint8)
    out.fill_(7)
    small = out.numel() <= transfer.FIRST_BY_VALUE_MAX_BYTES
    assert out.is_shared() is not small
    item = cross(WorkerItem(0, 0, {"img": out}))
    assert not item.pools and item.data["img"].is_shared() is not small
    if small:  # a copy, sent by value (in one process torch maps the shared one to itself)
        assert item.data["img"].untyped_storage().data_ptr() != out.untyped_storage().data_ptr()
    assert int(item.data["img"].min()) == int(item.data["img"].max()) == 7
    later = cross(WorkerItem(0, 1, {"img": transfer.shared_out(64, (3, side, side), torch.uint8)}))
    assert later.pools and not later.data["img"].is_shared()  # then the slots, copied out


def test_a_slot_not_handed_back_is_never_reused():
    first = [transfer.shared_out(4, (1000,), torch.float32) for _ in range(transfer.POOL_SLOTS)]
    for k, t in enumerate(first):
        t.fill_(k)
    extra = transfer.shared_out(4, (1000,), torch.float32)  # every slot is taken: a fresh tensor
    assert all(extra.untyped_storage().data_ptr() != t.untyped_storage().data_ptr() for t in first)
    assert [float(t.mean()) for t in first] == [float(k) for k in range(transfer.POOL_SLOTS)]
    for t in first:  # hand them back as the main process would, then they serve again
        cross(WorkerItem(0, 0, {"x": t}))
    addresses = {t.untyped_storage().data_ptr() for t in first}
    held = first.pop()  # ... those this process no longer holds
    del t, first
    again = [transfer.shared_out(4, (1000,), torch.float32) for _ in range(transfer.POOL_SLOTS - 1)]
    assert {a.untyped_storage().data_ptr() for a in again} == addresses - {held.untyped_storage().data_ptr()}
    assert float(held.mean()) == transfer.POOL_SLOTS - 1  # the one still held is never written


@pytest.mark.parametrize("fast_paths", [True], indirect=True)  # the pool itself
def test_a_batch_the_worker_still_holds_is_never_written():
    """A collate_fn that keeps the last batch (to mix it into the next one): its slot is not
    reused while held, and a batch carrying it again sends a copy (the main process handed the
    slot back when the first batch arrived)."""
    kept = transfer.shared_out(4, (1000,), torch.float32).fill_(1.0)
    assert cross(WorkerItem(0, 0, {"x": kept})).pools  # arrived; the slot is handed back
    for k in range(2 * transfer.POOL_SLOTS):
        out = transfer.shared_out(4, (1000,), torch.float32).fill_(float(k + 2))
        assert out.untyped_storage().data_ptr() != kept.untyped_storage().data_ptr()
        got = cross(WorkerItem(0, k + 1, {"x": out, "previous": kept})).data
        assert float(got["x"].mean()) == k + 2 and float(got["previous"].mean()) == 1.0
        del out
    assert float(kept.mean()) == 1.0


def test_dtypes_shapes_and_a_slot_that_must_grow():
    for dtype, shape in [(torch.float64, (5, 7, 300)), (torch.int16, (2, 40000)), (torch.bool, (70000,))]:
        out = transfer.shared_out(3, shape, dtype)
        src = torch.arange(out.numel()).reshape(out.shape) % 7
        out.copy_(src.to(dtype))
        got = cross(WorkerItem(0, 0, {"nested": [(out,)]})).data["nested"][0][0]
        assert got.dtype == dtype and got.shape == (3, *shape)
        torch.testing.assert_close(got, src.to(dtype), rtol=0, atol=0)


@pytest.mark.parametrize("fast_paths", [True], indirect=True)  # the pool itself
def test_unknown_pool_is_an_error():
    out = transfer.shared_out(2, (200, 200), torch.uint8)
    item = cross(WorkerItem(0, 0, {"img": out}))
    transfer.forget(set(item.pools))
    out = transfer.shared_out(2, (200, 200), torch.uint8)
    with pytest.raises(Exception, match="forgotten"):
        cross(WorkerItem(0, 0, {"img": out}))


class _Many(IterableDataset):
    """A plain DataLoader over collate's batches (no WorkerItem: nobody hands slots back)."""

    def __iter__(self):
        for k in range(2 * transfer.POOL_SLOTS):
            yield collate([{"img": torch.full((3, 64, 64), k, dtype=torch.uint8)} for _ in range(8)])


@pytest.mark.timeout(60)
def test_a_plain_dataloader_gets_every_batch_intact():
    batches = list(DataLoader(_Many(), batch_size=None, num_workers=1, timeout=60))
    assert [int(b["img"].min()) for b in batches] == [int(b["img"].max()) for b in batches] == list(range(8))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("persistent", [False, True])
def test_loader_batches_through_the_pool_are_exact_and_unmapped_after(tmp_path: Path, persistent: bool):
    """Every batch of two epochs, all held at once: none was overwritten by a reused slot."""
    rng = np.random.default_rng(0)
    images = [encode_image(rng.integers(0, 256, (48, 64, 3), dtype=np.uint8), "png") for _ in range(96)]
    root = make_shards(tmp_path, [24] * 4, lambda i: {"png": images[i]})
    ds = ShardDataset(str(root), decode="torch", shuffle=True, seed=3)
    loader = make_loader(ds, batch_size=8, num_workers=2, persistent_workers=persistent, timeout=60)
    for epoch in range(2):
        ds.set_epoch(epoch)
        held = list(loader)
        assert sum(len(b["__key__"]) for b in held) == 96
        for batch in held:
            assert batch["png"].shape == (8, 3, 48, 64) and batch["png"].dtype == torch.uint8
            for key, img in zip(batch["__key__"], batch["png"]):
                expected = decode_image(images[int(key)], "torch")
                torch.testing.assert_close(img, expected, rtol=0, atol=0)
    if not persistent:
        assert not transfer._received  # the stopped workers' buffers are unmapped
    del loader


@pytest.mark.parametrize("fast_paths", [True], indirect=True)  # the pool itself
def test_views_of_a_slot_are_copied_out_too():
    """A batch holding a slot and views of it (``b[1:]``, a permute): each arrives as its own
    copy, and none changes when the slot is reused for later batches."""
    kept = []
    for k in range(3 * transfer.POOL_SLOTS):
        out = transfer.shared_out(8, (3, 40, 40), torch.uint8)
        out.copy_(torch.arange(out.numel()).reshape(out.shape) % 251 + k)
        ref = out.clone()
        item = cross(WorkerItem(0, k, {"img": out, "tail": out[1:], "hwc": out.permute(0, 2, 3, 1)}))
        assert item.pools
        kept.append((ref, item.data))
    for ref, data in kept:
        assert not data["tail"].is_shared() and not data["hwc"].is_shared()
        torch.testing.assert_close(data["img"], ref, rtol=0, atol=0)
        torch.testing.assert_close(data["tail"], ref[1:], rtol=0, atol=0)
        torch.testing.assert_close(data["hwc"], ref.permute(0, 2, 3, 1), rtol=0, atol=0)


def _collate_with_views(samples):
    batch = collate(samples)
    batch["chw_first"] = batch["png"][1:]  # a view at an offset of the slot
    batch["hwc"] = batch["png"].permute(0, 2, 3, 1)  # a strided view of the slot
    return batch


class _WithPrevious:
    """A collate_fn that also gives each batch the previous batch's images (mixing them)."""

    def __init__(self):
        self.previous = None

    def __call__(self, samples):
        batch = collate(samples)
        batch["previous"] = batch["png"] if self.previous is None else self.previous
        self.previous = batch["png"]
        return batch


@pytest.mark.timeout(120)
def test_a_collate_fn_keeping_the_last_batch_in_the_worker_sees_it_intact(tmp_path: Path):
    rng = np.random.default_rng(2)
    images = [encode_image(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8), "png") for _ in range(96)]
    root = make_shards(tmp_path, [24] * 4, lambda i: {"png": images[i]})
    ds = ShardDataset(str(root), decode="torch")
    held = list(make_loader(ds, batch_size=8, num_workers=1, collate_fn=_WithPrevious(), timeout=60))
    assert len(held) == 12
    for before, batch in zip(held, held[1:]):
        torch.testing.assert_close(batch["previous"], before["png"], rtol=0, atol=0)
        expected = torch.stack([decode_image(images[int(k)], "torch") for k in batch["__key__"]])
        torch.testing.assert_close(batch["png"], expected, rtol=0, atol=0)


@pytest.mark.timeout(120)
def test_a_collate_fn_returning_views_of_the_batch_keeps_every_batch_intact(tmp_path: Path):
    rng = np.random.default_rng(1)
    images = [encode_image(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8), "png") for _ in range(64)]
    root = make_shards(tmp_path, [16] * 4, lambda i: {"png": images[i]})
    ds = ShardDataset(str(root), decode="torch")
    held = list(make_loader(ds, batch_size=8, num_workers=1, collate_fn=_collate_with_views, timeout=60))
    assert len(held) == 8  # 8 x 3 x 64 x 64 bytes: each batch goes through a slot
    for batch in held:
        expected = torch.stack([decode_image(images[int(k)], "torch") for k in batch["__key__"]])
        torch.testing.assert_close(batch["png"], expected, rtol=0, atol=0)
        torch.testing.assert_close(batch["chw_first"], expected[1:], rtol=0, atol=0)
        torch.testing.assert_close(batch["hwc"], expected.permute(0, 2, 3, 1), rtol=0, atol=0)
