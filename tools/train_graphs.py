"""Train a small GNN from shards, with checkpoint and resume, beside the same model trained from
the plain source (the ``InMemoryDataset`` + PyG ``DataLoader`` + ``DistributedSampler``).

The data is networkx's graph atlas (every graph of 3 to 7 nodes, 1,249 graphs), labelled 1
when the graph holds a triangle; node features are the node's degree, one-hot, plus noise
drawn from torch's global generator in a per-sample transform (so sample seeding decides it).
It is held in an ``InMemoryDataset`` (one graph in five held out for validation) and converted
with ``shardflow.convert.pyg.to_shards``. Both runs use the same GIN model, initial weights,
optimizer, epochs, batch size and seed; each prints its validation accuracy.

Usage (copy it; every part is public API)::

    python tools/train_graphs.py [--work DIR] [--epochs 20] [--workers 2]
    torchrun --nproc_per_node=2 tools/train_graphs.py            # DDP over gloo on CPU
    python tools/train_graphs.py --stop-after 100                 # stop mid-epoch, then
    python tools/train_graphs.py                                  # resume from the checkpoint
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DistributedSampler

import shardflow

MAX_DEGREE = 6


def atlas_graphs() -> list[Any]:
    """networkx's atlas as PyG graphs: x one-hot degree (float32 (N, 7)), y = has a triangle."""
    import networkx as nx
    from torch_geometric.data import Data

    graphs = []
    for g in nx.graph_atlas_g():
        if g.number_of_nodes() < 3 or g.number_of_edges() == 0:
            continue
        edges = [(u, v) for u, v in g.edges()] + [(v, u) for u, v in g.edges()]
        edge_index = torch.tensor(edges, dtype=torch.long).t().contiguous()
        degree = torch.tensor([d for _, d in sorted(g.degree())])
        x = F.one_hot(degree, MAX_DEGREE + 1).float()
        y = torch.tensor([int(sum(nx.triangles(g).values()) > 0)])
        graphs.append(Data(x=x, edge_index=edge_index, y=y, num_nodes=g.number_of_nodes()))
    return graphs


def make_inmemory(root: Path) -> tuple[Any, Any]:
    """The plain source: train and val ``InMemoryDataset`` of the atlas graphs."""
    from torch_geometric.data import InMemoryDataset

    class Atlas(InMemoryDataset):
        def __init__(self, root: str, split: str) -> None:
            self.split = split
            super().__init__(root)
            self.load(self.processed_paths[0])

        @property
        def processed_file_names(self) -> list[str]:
            return [f"{self.split}.pt"]

        def process(self) -> None:
            graphs = [g for i, g in enumerate(atlas_graphs()) if (i % 5 == 0) == (self.split == "val")]
            self.save(graphs, self.processed_paths[0])

    return Atlas(str(root), "train"), Atlas(str(root), "val")


def noisy(graph: Any) -> Any:
    """Node-feature noise from torch's global generator (the augmentation)."""
    graph = graph.clone()
    graph.x = graph.x + 0.1 * torch.randn_like(graph.x)
    return graph


def make_model() -> torch.nn.Module:
    from torch_geometric.nn import GIN

    torch.manual_seed(0)  # the same initial weights for both runs
    return GraphClassifier(GIN(MAX_DEGREE + 1, 32, num_layers=3))


class GraphClassifier(torch.nn.Module):
    def __init__(self, gnn: torch.nn.Module) -> None:
        super().__init__()
        self.gnn = gnn
        self.head = torch.nn.Linear(32, 2)

    def forward(self, batch: Any) -> torch.Tensor:
        from torch_geometric.nn import global_add_pool

        return self.head(global_add_pool(self.gnn(batch.x, batch.edge_index), batch.batch))


def wrap(model: torch.nn.Module) -> torch.nn.Module:
    return torch.nn.parallel.DistributedDataParallel(model) if dist.is_initialized() else model


def accuracy(model: torch.nn.Module, val: Any) -> float:
    from torch_geometric.loader import DataLoader

    model.eval()
    right = 0
    with torch.no_grad():
        for batch in DataLoader(val, batch_size=256):
            right += int((model(batch).argmax(1) == batch.y).sum())
    model.train()
    return right / len(val)


def train_from_shards(a: argparse.Namespace, shards: Path, rank: int) -> tuple[torch.nn.Module, float]:
    model = wrap(make_model())
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    # The atlas is ordered by size, and so by label: the default shuffle's window spreads those
    # local, indexed shards (docs/distributed.md), with no epoch-sized buffer.
    ds = shardflow.ShardDataset(shards, shuffle=True, seed=a.seed, transform={"graph.pyg": noisy})
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
            graphs = batch["graph.pyg"]
            opt.zero_grad()
            F.cross_entropy(model(graphs), graphs.y).backward()
            opt.step()
            step += 1
            seen += graphs.num_graphs
            if rank == 0 and step % a.ckpt_every == 0:
                torch.save({"model": model.state_dict(), "optim": opt.state_dict(), "data": loader.state_dict(),
                            "epoch": epoch, "step": step}, str(ckpt) + ".tmp")
                os.replace(str(ckpt) + ".tmp", ckpt)
            if a.stop_after is not None and step >= a.stop_after:
                raise SystemExit(f"rank {rank}: stopped after step {step}; run again to resume")
    if rank == 0:
        ckpt.unlink(missing_ok=True)  # finished: a new run starts afresh
    return model, seen / max(time.perf_counter() - t0, 1e-9)


class Noisy(torch.utils.data.Dataset):
    """The plain source with the same augmentation, graph by graph."""

    def __init__(self, base: Any) -> None:
        self.base = base

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, i: int) -> Any:
        return noisy(self.base[i])


def train_from_inmemory(a: argparse.Namespace, train: Any) -> tuple[torch.nn.Module, float]:
    from torch_geometric.loader import DataLoader

    model = wrap(make_model())
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    data = Noisy(train)
    sampler = DistributedSampler(data, shuffle=True, seed=a.seed, drop_last=True) if dist.is_initialized() else None
    loader = DataLoader(data, batch_size=a.batch_size, sampler=sampler, shuffle=sampler is None,
                        num_workers=a.workers, drop_last=True, generator=torch.Generator().manual_seed(a.seed))
    t0, seen = time.perf_counter(), 0
    for epoch in range(a.epochs):
        if sampler is not None:
            sampler.set_epoch(epoch)
        for batch in loader:
            opt.zero_grad()
            F.cross_entropy(model(batch), batch.y).backward()
            opt.step()
            seen += batch.num_graphs
    return model, seen / max(time.perf_counter() - t0, 1e-9)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", default="/tmp/shardflow-train-graphs")
    p.add_argument("--epochs", type=int, default=20)
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
    shards = work / "shards"
    if rank == 0:
        train, val = make_inmemory(work / "inmemory")
        if not (shards / "shardflow.json").exists():
            from shardflow.convert.pyg import to_shards

            to_shards(train, str(shards), max_count=64, workers=1)
    if dist.is_initialized():
        dist.barrier()
    train, val = make_inmemory(work / "inmemory")

    model, rate = train_from_shards(a, shards, rank)
    lines = [f"shards    (ShardDataset + shardflow.loader)                 accuracy {accuracy(model, val):.4f}  "
             f"({rate:,.0f} graphs/s on rank {rank})"]
    if not a.skip_plain:
        model, rate = train_from_inmemory(a, train)
        lines.append(f"plain     (InMemoryDataset + PyG DataLoader + DistributedSampler) accuracy {accuracy(model, val):.4f}  "
                     f"({rate:,.0f} graphs/s on rank {rank})")
    if rank == 0:
        print(f"{a.epochs} epochs, batch {a.batch_size}, {a.workers} workers, "
              f"{dist.get_world_size() if dist.is_initialized() else 1} rank(s), seed {a.seed}, "
              f"{len(train)} training graphs, {len(val)} validation graphs")
        print("\n".join(lines))
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
