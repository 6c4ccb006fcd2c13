#!/usr/bin/env python3
"""PyTorch Lightning over shards: a ``LightningDataModule`` whose loaders are ``shardflow.loader``.

    python tools/lightning_example.py [--work DIR] [--epochs 2] [--workers 2]

Writes 600 small samples (once) into ``DIR/train`` and 120 into ``DIR/val``, then fits a linear
model. What the data module relies on (docs/frameworks.md):

- ``shardflow.loader`` returns a ``ShardLoader``: Lightning takes any iterable with ``len()`` as a
  dataloader, so no ``DistributedSampler`` is injected (``use_distributed_sampler`` does not
  apply); under DDP each rank's ``ShardDataset`` reads ``torch.distributed`` itself and every rank
  gets the same number of batches.
- Epochs: Lightning calls ``iter()`` once on a loader that is not a torch ``DataLoader`` to check
  that it is iterable, and a ``ShardLoader`` counts every ``iter()`` as the start of the next
  epoch, so without help training would begin at epoch 1. :class:`ShardEpochs` (a callback)
  gives the dataset Lightning's epoch number at the start of every epoch, so epoch ``e`` of
  training is shardflow's epoch ``e`` (its shuffle a function of ``(seed, e)``).
- ``ShardLoader`` has ``state_dict()`` / ``load_state_dict()``, so Lightning stores the loader's
  position in every checkpoint and ``trainer.fit(..., ckpt_path=...)`` continues a mid-epoch
  checkpoint with exactly the batches not yet seen.
"""

from __future__ import annotations

import argparse
import os

import lightning as L
import numpy as np
import torch

import shardflow


def write_shards(folder: str, n: int, seed: int) -> None:
    """``n`` samples ``{x.npy: float32 (8,), y.npy: float32 ()}`` of a fixed linear model, in shards of 100."""
    if os.path.exists(os.path.join(folder, "shardflow.json")):
        return
    rng = np.random.default_rng(seed)
    w = np.arange(8, dtype=np.float32) / 8
    with shardflow.ShardWriter(os.path.join(folder, "part-%06d.tar"), max_count=100) as sink:
        for i in range(n):
            x = rng.normal(size=8).astype(np.float32)
            sink.write({"__key__": f"{i:06d}", "x.npy": x, "y.npy": np.float32(x @ w)})


class ShardEpochs(L.Callback):
    """Tell the training dataset Lightning's epoch at the start of every epoch."""

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        dataset = getattr(trainer.datamodule, "train_dataset", None)
        if dataset is not None:
            dataset.set_epoch(trainer.current_epoch)


class ShardDataModule(L.LightningDataModule):
    """Train and validation loaders over shard folders (local or any fsspec URL); train with
    ``Trainer(callbacks=[ShardEpochs()])``."""

    def __init__(self, train: str, val: str | None = None, *, batch_size: int = 32, num_workers: int = 2,
                 seed: int = 0) -> None:  # fmt: skip
        super().__init__()
        self.train, self.val = train, val
        self.train_dataset: shardflow.ShardDataset | None = None
        self.batch_size, self.num_workers, self.seed = batch_size, num_workers, seed

    def train_dataloader(self) -> shardflow.ShardLoader:
        # built when Lightning asks, after DDP started: the dataset finds its rank then
        ds = self.train_dataset = shardflow.ShardDataset(self.train, shuffle=True, seed=self.seed, decode="numpy")
        return shardflow.loader(ds, batch_size=self.batch_size, num_workers=self.num_workers,
                                persistent_workers=self.num_workers > 0)  # fmt: skip

    def val_dataloader(self) -> shardflow.ShardLoader | list:
        if self.val is None:
            return []
        ds = shardflow.ShardDataset(self.val, shuffle=False, decode="numpy")
        return shardflow.loader(ds, batch_size=self.batch_size, num_workers=self.num_workers)


class Regression(L.LightningModule):
    """A linear model; ``seen`` records the sample keys of every training batch (for the tests)."""

    def __init__(self) -> None:
        super().__init__()
        self.model = torch.nn.Linear(8, 1)
        self.seen: list[list[str]] = []

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        self.seen.append(list(batch["__key__"]))
        loss = torch.nn.functional.mse_loss(self.model(batch["x.npy"]).squeeze(-1), batch["y.npy"])
        self.log("train_loss", loss, batch_size=len(batch["__key__"]))
        return loss

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        loss = torch.nn.functional.mse_loss(self.model(batch["x.npy"]).squeeze(-1), batch["y.npy"])
        self.log("val_loss", loss, batch_size=len(batch["__key__"]))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--work", default="/tmp/shardflow-lightning")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args()
    write_shards(os.path.join(args.work, "train"), 600, seed=0)
    write_shards(os.path.join(args.work, "val"), 120, seed=1)
    data = ShardDataModule(os.path.join(args.work, "train"), os.path.join(args.work, "val"), num_workers=args.workers)
    trainer = L.Trainer(max_epochs=args.epochs, accelerator="cpu", devices=1, default_root_dir=args.work,
                        enable_progress_bar=False, callbacks=[ShardEpochs()])  # fmt: skip
    trainer.fit(Regression(), datamodule=data)
    print({k: round(float(v), 4) for k, v in trainer.callback_metrics.items()})


if __name__ == "__main__":
    main()
