#!/usr/bin/env python3
"""A runnable DDP training loop over shards, with mid-epoch checkpoints.

    torchrun --nproc_per_node=2 tools/ddp_example.py [--work DIR] [--stop-after STEPS]

Rank 0 writes 1,000 small samples into uneven shards (once); both ranks then train a linear model
with DistributedDataParallel (gloo, CPU) for 2 epochs. Every rank takes the same number of steps.
Rank 0 alone saves `loader.state_dict()` with the model every 10 steps (ranks step in lock-step, so
its state is every rank's); run it again after stopping it (`--stop-after 25` stops mid-epoch on
purpose) and it continues exactly where the checkpoint was, also with another `--nproc_per_node`
(elastic: the samples left in the epoch are shared out over the new ranks).
"""

from __future__ import annotations

import argparse
import os

import numpy as np
import torch
import torch.distributed as dist

import shardflow


def make_shards(folder: str) -> None:
    rng = np.random.default_rng(0)
    w = rng.normal(size=8).astype(np.float32)
    sizes = [300, 250, 200, 150, 100]  # uneven on purpose
    i = 0
    for shard, n in enumerate(sizes):
        with shardflow.ShardWriter(os.path.join(folder, f"part{shard}-%06d.tar"), max_count=n, manifest=False) as sink:
            for _ in range(n):
                x = rng.normal(size=8).astype(np.float32)
                sink.write({"__key__": f"{i:06d}", "x.npy": x, "y.npy": np.float32(x @ w)})
                i += 1
    from shardflow.writing.indexing import index_shards

    index_shards(sorted(os.path.join(folder, f) for f in os.listdir(folder) if f.endswith(".tar")), out=folder)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", default="/tmp/shardflow-ddp")
    ap.add_argument("--stop-after", type=int, default=None, help="stop after this many steps (to try resuming)")
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    data = os.path.join(args.work, "shards")
    if rank == 0 and not os.path.exists(os.path.join(data, "shardflow.json")):
        os.makedirs(data, exist_ok=True)
        make_shards(data)
    dist.barrier()

    ds = shardflow.ShardDataset(data, shuffle=True, seed=0, decode="numpy")  # ranks from torch.distributed
    loader = shardflow.loader(ds, batch_size=32, num_workers=2)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)

    ckpt = os.path.join(args.work, "ckpt.pt")  # one checkpoint, written by rank 0
    state = torch.load(ckpt) if os.path.exists(ckpt) else None  # plain data: loads with weights_only
    first_epoch = 0
    if state is not None:
        model.load_state_dict(state["model"])
        loader.load_state_dict(state["data"])  # the next iteration continues that epoch
        first_epoch = state["epoch"]
        layout = state["data"]["remaining"]  # the epoch's [world size, steps] stages
        where = f"after {layout[-1][1]} steps on {layout[-1][0]} ranks" if layout else "at its start"
        print(f"rank {rank}: resuming epoch {first_epoch} {where}; {len(loader)} batches in the epoch")
    steps = 0
    for epoch in range(first_epoch, 2):
        if state is None:
            ds.set_epoch(epoch)  # a loaded state already names the epoch it resumes
        state = None
        loss = torch.zeros(())
        for batch in loader:
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(batch["x.npy"]).squeeze(1), batch["y.npy"])
            loss.backward()
            opt.step()
            steps += 1
            if steps % 10 == 0 and rank == 0:
                torch.save({"model": model.state_dict(), "data": loader.state_dict(), "epoch": epoch}, ckpt)
            if args.stop_after is not None and steps >= args.stop_after:
                print(f"rank {rank}: stopping after {steps} steps (epoch {epoch}); run again to resume")
                dist.destroy_process_group()
                return
        print(f"rank {rank}: epoch {epoch} done, {len(loader)} steps per epoch, loss {loss.item():.4f}")
    dist.barrier()
    if rank == 0 and os.path.exists(ckpt):
        os.remove(ckpt)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
