"""Train a small CNN from shards, with checkpoint and resume, beside the same model trained
from the plain image folder (a file-per-sample Dataset + ``DistributedSampler``).

The data is scikit-learn's handwritten digits (1,797 grey 8x8 images, 10 classes), upscaled
to 32x32 PNG files in an ImageFolder tree (``train/`` and ``val/``, one file in five held
out), converted with ``shardflow convert imagefolder``. Both runs use the same model,
initial weights, optimizer, epochs, batch size, augmentation (a random shift of up to 3
pixels, drawn from torch's global generator in a per-sample transform) and seed; each prints
its validation accuracy.

Usage (copy it; every part is public API)::

    python tools/train_images.py [--work DIR] [--epochs 4] [--workers 2]
    torchrun --nproc_per_node=2 tools/train_images.py            # DDP over gloo on CPU
    python tools/train_images.py --stop-after 40                  # stop mid-epoch, then
    python tools/train_images.py                                  # resume from the checkpoint

The shard run checkpoints (model, optimizer, ``loader.state_dict()``, epoch) every
``--ckpt-every`` steps on rank 0 and resumes from it; with sample seeding (on by default)
a resumed run ends with the same weights as an uninterrupted one on the same world size.
``torchvision`` is not needed: the plain baseline reads the folder with Pillow the way
``torchvision.datasets.ImageFolder`` does (classes sorted, files sorted in each class).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from PIL import Image
from torch.utils.data import DataLoader, Dataset, DistributedSampler

import shardflow

SIZE = 32


def build_tree(root: Path) -> None:
    """digits -> root/{train,val}/digit_K/NNNN.png (32x32 grey)."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    for i, (image, label) in enumerate(zip(digits.images, digits.target)):
        split = "val" if i % 5 == 0 else "train"
        folder = root / split / f"digit_{label}"
        folder.mkdir(parents=True, exist_ok=True)
        pixels = (image * (255.0 / 16.0)).astype(np.uint8)
        Image.fromarray(pixels, mode="L").resize((SIZE, SIZE), Image.NEAREST).save(folder / f"{i:04d}.png")


def shift(image: torch.Tensor) -> torch.Tensor:
    """A random shift of up to 3 pixels (uint8 (3, H, W) -> same), from torch's global generator."""
    dx, dy = (int(v) for v in torch.randint(-3, 4, (2,)))
    return torch.roll(image, shifts=(dy, dx), dims=(1, 2))


def to_input(images: torch.Tensor) -> torch.Tensor:
    return images.float().div_(255.0)


class PlainFolder(Dataset):
    """What ``torchvision.datasets.ImageFolder`` does: (image uint8 (3, H, W), class index)."""

    def __init__(self, root: Path, augment: bool) -> None:
        classes = sorted(p.name for p in root.iterdir() if p.is_dir())
        self.samples = [(f, c) for c, name in enumerate(classes) for f in sorted((root / name).iterdir())]
        self.augment = augment

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        path, label = self.samples[i]
        rgb = np.asarray(Image.open(path).convert("RGB"))
        image = torch.from_numpy(rgb.copy()).permute(2, 0, 1).contiguous()
        return (shift(image) if self.augment else image), label


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)  # the same initial weights for both runs
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(16, 32, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Flatten(), torch.nn.Linear(32 * 8 * 8, 10),
    )


def wrap(model: torch.nn.Module) -> torch.nn.Module:
    return torch.nn.parallel.DistributedDataParallel(model) if dist.is_initialized() else model


def accuracy(model: torch.nn.Module, val: Path) -> float:
    data = PlainFolder(val, augment=False)
    model.eval()
    right = 0
    with torch.no_grad():
        for images, labels in DataLoader(data, batch_size=256):
            right += int((model(to_input(images)).argmax(1) == labels).sum())
    model.train()
    return right / len(data)


def train_from_shards(a: argparse.Namespace, shards: Path, rank: int) -> tuple[torch.nn.Module, float]:
    model = wrap(make_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    # The defaults: the converter writes the classes mixed (a seeded order) and the default shuffle
    # mixes shards and samples; no epoch-sized buffer (docs/distributed.md has the class mix).
    ds = shardflow.ShardDataset(shards, shuffle=True, seed=a.seed, decode="torch", fields=("image", "cls"),
                                transform={"image": shift})
    loader = shardflow.loader(ds, batch_size=a.batch_size, num_workers=a.workers, drop_last=True)
    ckpt = Path(a.work) / "ckpt.pt"
    state = torch.load(ckpt) if ckpt.exists() else None
    step = 0
    if state is not None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
        loader.load_state_dict(state["data"])
        step = state["step"]
        print(f"rank {rank}: resuming epoch {state['epoch']} at step {step}")
    t0, seen = time.perf_counter(), 0
    for epoch in range(state["epoch"] if state else 0, a.epochs):
        if state is None:
            ds.set_epoch(epoch)
        state = None
        for batch in loader:
            opt.zero_grad()
            F.cross_entropy(model(to_input(batch["image"])), batch["cls"]).backward()
            opt.step()
            step += 1
            seen += len(batch["cls"])
            if rank == 0 and step % a.ckpt_every == 0:
                torch.save({"model": model.state_dict(), "optim": opt.state_dict(), "data": loader.state_dict(),
                            "epoch": epoch, "step": step}, str(ckpt) + ".tmp")
                os.replace(str(ckpt) + ".tmp", ckpt)
            if a.stop_after is not None and step >= a.stop_after:
                raise SystemExit(f"rank {rank}: stopped after step {step}; run again to resume")
    if rank == 0:
        ckpt.unlink(missing_ok=True)  # finished: a new run starts afresh
    return model, seen / max(time.perf_counter() - t0, 1e-9)


def train_from_folder(a: argparse.Namespace, train: Path) -> tuple[torch.nn.Module, float]:
    model = wrap(make_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    data = PlainFolder(train, augment=True)
    sampler = DistributedSampler(data, shuffle=True, seed=a.seed, drop_last=True) if dist.is_initialized() else None
    loader = DataLoader(data, batch_size=a.batch_size, sampler=sampler, shuffle=sampler is None,
                        num_workers=a.workers, drop_last=True, generator=torch.Generator().manual_seed(a.seed))
    t0, seen = time.perf_counter(), 0
    for epoch in range(a.epochs):
        if sampler is not None:
            sampler.set_epoch(epoch)
        for images, labels in loader:
            opt.zero_grad()
            F.cross_entropy(model(to_input(images)), labels).backward()
            opt.step()
            seen += len(labels)
    return model, seen / max(time.perf_counter() - t0, 1e-9)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", default="/tmp/shardflow-train-images")
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ckpt-every", type=int, default=10)
    p.add_argument("--stop-after", type=int, default=None, help="stop after this many steps (then run again)")
    p.add_argument("--skip-plain", action="store_true", help="train from shards only")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    work = Path(a.work)
    tree, shards = work / "images", work / "shards"
    if rank == 0 and not (shards / "train" / "shardflow.json").exists():
        build_tree(tree)
        from shardflow.convert.engine.engine import ConvertOptions
        from shardflow.convert.images.imagefolder import convert_imagefolder

        for split in ("train", "val"):
            convert_imagefolder(tree / split, str(shards / split), options=ConvertOptions(max_count=64))
    if dist.is_initialized():
        dist.barrier()

    model, rate = train_from_shards(a, shards / "train", rank)
    lines = [f"shards  (ShardDataset + shardflow.loader)            accuracy {accuracy(model, tree / 'val'):.4f}  "
             f"({rate:,.0f} samples/s on rank {rank})"]
    if not a.skip_plain:
        model, rate = train_from_folder(a, tree / "train")
        lines.append(f"plain   (ImageFolder-style Dataset + DistributedSampler) accuracy {accuracy(model, tree / 'val'):.4f}  "
                     f"({rate:,.0f} samples/s on rank {rank})")
    if rank == 0:
        print(f"{a.epochs} epochs, batch {a.batch_size}, {a.workers} workers, "
              f"{dist.get_world_size() if dist.is_initialized() else 1} rank(s), seed {a.seed}")
        print("\n".join(lines))
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
