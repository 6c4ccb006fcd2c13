"""A small training run that checkpoints every step: run by tests/test_reproducible_training.py.

``python tests/resume_training.py DATA CKPT OUT [--epochs 2] [--slow-from STEP]``

Trains ``Linear(16, 2)`` with SGD and momentum on shards of ``x`` (npy float32 (16,)) and
``cls``, with a noise augmentation drawn from torch's global generator in a per-sample
transform, ``shardflow.loader(num_workers=2)``. After every step it saves model, optimizer
and ``loader.state_dict()`` to CKPT (atomically) and the step count to CKPT + ".step"; a
run that finds CKPT resumes from it. At the end it saves the weights to OUT. Under
``torchrun`` (RANK / WORLD_SIZE set) it joins a gloo group and wraps the model in DDP;
rank 0 alone checkpoints, every rank resumes from that one file.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import torch
import torch.distributed as dist

import shardflow


def noise(sample: dict[str, Any]) -> dict[str, Any]:
    x = torch.as_tensor(sample["npy"])
    sample["npy"] = x + 0.1 * torch.randn_like(x)
    return sample


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("data")
    p.add_argument("ckpt")
    p.add_argument("out")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--slow-from", type=int, default=-1, help="sleep 250 ms per step from this step on")
    a = p.parse_args()

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    distributed = "WORLD_SIZE" in os.environ
    if distributed:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if distributed else 0

    torch.manual_seed(0)
    model: torch.nn.Module = torch.nn.Linear(16, 2)
    if distributed:
        model = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ds = shardflow.ShardDataset(a.data, shuffle=True, seed=3, decode="numpy", transform=noise)
    loader = shardflow.loader(ds, batch_size=8, num_workers=a.workers)

    state = torch.load(a.ckpt) if os.path.exists(a.ckpt) else None
    step = 0
    if state is not None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
        loader.load_state_dict(state["data"])
        step = state["step"]
    for epoch in range(state["epoch"] if state else 0, a.epochs):
        if state is None:
            ds.set_epoch(epoch)
        state = None
        for batch in loader:
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(batch["npy"].float()), batch["cls"])
            loss.backward()
            opt.step()
            step += 1
            if rank == 0:
                tmp = a.ckpt + ".tmp"
                torch.save({"model": model.state_dict(), "optim": opt.state_dict(),
                            "data": loader.state_dict(), "epoch": epoch, "step": step}, tmp)
                os.replace(tmp, a.ckpt)
                with open(a.ckpt + ".step.tmp", "w") as f:
                    f.write(str(step))
                os.replace(a.ckpt + ".step.tmp", a.ckpt + ".step")
            if 0 <= a.slow_from <= step:
                # the test's kill must land before epoch 2 ends: with 2 ranks that is 10 steps
                # after the kill point, 2.5 s at this pace (0.5 s at 50 ms: short on a loaded machine)
                time.sleep(0.25)
    if rank == 0:
        torch.save(model.state_dict(), a.out)
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
