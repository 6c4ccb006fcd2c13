"""Batching graphs by a node budget instead of a count, with equal batch counts on every rank."""

import numpy as np
import pytest
import torch

import shardflow
from shardflow.errors import ManifestError
from shardflow.planning.plan import ShuffleConfig, SplitConfig, cost_batches, plan_epoch

pyg = pytest.importorskip("torch_geometric")
from torch_geometric.data import Data  # noqa: E402


def graph(n, i):
    idx = torch.arange(n)
    return Data(x=torch.full((n, 2), float(i)), edge_index=torch.stack([idx, (idx + 1) % n]), y=torch.tensor([i]))


@pytest.fixture
def skewed(tmp_path):
    rng = np.random.default_rng(0)
    sizes = [int(s) for s in rng.choice([3, 10, 40, 400], size=90, p=[0.4, 0.3, 0.2, 0.1])]
    with shardflow.ShardWriter(str(tmp_path / "g-%06d.tar"), max_count=20) as w:
        for i, n in enumerate(sizes):
            w.write({"__key__": f"g{i:03d}", "graph.pyg": graph(n, i)})
    return str(tmp_path), sizes


def test_cost_batches_greedy():
    assert cost_batches(np.array([5, 5, 5, 20, 1, 1]), 10, 100) == [2, 3, 4, 6]
    assert cost_batches(np.array([1, 1, 1, 1, 1]), 100, 2) == [2, 4, 5]


def test_sizes_index_written_for_graphs(skewed):
    folder, sizes = skewed
    m = shardflow.ShardDataset(folder).manifest
    assert m.meta["size_columns"] == ["num_nodes", "num_edges"]
    costs = shardflow.ShardDataset(folder).source.load_costs("num_nodes", shardflow.IOOptions())
    assert costs.tolist() == sizes


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_node_budget_equal_batches_every_sample_once(skewed, world_size):
    folder, sizes = skewed
    budget = 500
    per_rank = []
    for rank in range(world_size):
        ds = shardflow.ShardDataset(folder, shuffle=True, seed=1, rank=rank, world_size=world_size)
        loader = shardflow.loader(ds, batch_size=64, max_cost=budget, cost="num_nodes", num_workers=2 if rank == 0 else 0)
        planned = len(loader)  # the coming epoch's count (cost batches: it depends on the order)
        batches = []
        for b in loader:
            assert len(loader) == planned  # during the epoch: this epoch's
            batches.append(b)
        assert len(batches) == planned
        assert len(loader) == ds.num_batches(loader.workers, epoch=1)  # after it: the next epoch's
        for b in batches:
            nodes = b["graph.pyg"].num_nodes
            assert nodes <= budget or len(b["__key__"]) == 1
            assert nodes == sum(sizes[int(k[1:])] for k in b["__key__"])
        per_rank.append(batches)
    assert len({len(b) for b in per_rank}) == 1  # DDP-safe: the same number of steps on every rank
    keys = [k for batches in per_rank for b in batches for k in b["__key__"]]
    n = len(sizes)
    per = -(-n // world_size)
    assert len(keys) == per * world_size  # every sample once, plus the declared padding
    assert set(keys) == {f"g{i:03d}" for i in range(n)}


def test_ranks_with_fewer_batches_split_their_largest():
    counts = [4]
    costs = np.array([100, 100, 1, 1])  # rank 0: two heavy graphs, rank 1: two light ones
    plans = [plan_epoch(counts, r, 2, 0, 0, ShuffleConfig.off(), SplitConfig(batch_size=10, max_cost=150), costs) for r in (0, 1)]
    assert [p.num_batches for p in plans] == [2, 2]
    assert plans[0].batch_ends.tolist() == [1, 2] and plans[1].batch_ends.tolist() == [1, 2]


def test_cost_batching_needs_sizes(tmp_path):
    with shardflow.ShardWriter(str(tmp_path / "p-%06d.tar")) as w:
        for i in range(4):
            w.write({"__key__": f"{i}", "cls": i})
    ds = shardflow.ShardDataset(str(tmp_path))
    with pytest.raises(ManifestError, match="no per-sample size 'num_nodes'"):
        len(shardflow.loader(ds, batch_size=4, max_cost=10))


def test_sizes_index_with_subclasses_and_non_graph_samples(tmp_path):
    class PairData(Data):
        pass

    with shardflow.ShardWriter(str(tmp_path / "m-%06d.tar")) as w:
        w.write({"__key__": "a", "cls": 1})
        w.write({"__key__": "b", "graph.pyg": graph(3, 0)})
        w.write({"__key__": "c", "graph.pyg": PairData(x=torch.zeros(5, 2), edge_index=torch.zeros(2, 7, dtype=torch.long))})
    costs = shardflow.ShardDataset(str(tmp_path)).source
    assert costs.load_costs("num_nodes", shardflow.IOOptions()).tolist() == [0, 3, 5]
    assert costs.load_costs("num_edges", shardflow.IOOptions()).tolist() == [0, 3, 7]


def test_cost_batches_with_several_budgets():
    costs = np.array([[5, 1], [5, 1], [1, 9], [1, 1], [20, 0], [1, 30]])
    # nodes <= 10 and edges <= 10: [5,1]+[5,1] ok, +[1,9] breaks nodes; [1,9]+[1,1] hits 10 edges; ...
    assert cost_batches(costs, (10, 10), 100) == [2, 4, 5, 6]
    assert cost_batches(costs, (100, 100), 3) == [3, 6]
    assert cost_batches(costs[:, 0], 10, 100) == cost_batches(costs[:, :1], (10,), 100) == [2, 4, 5, 6]


@pytest.mark.parametrize("world_size", [2, 3])
def test_node_and_edge_budgets_at_once(skewed, world_size):
    folder, sizes = skewed
    budgets = {"num_nodes": 500, "num_edges": 450}
    counts, keys = [], []
    for rank in range(world_size):
        ds = shardflow.ShardDataset(folder, shuffle=True, seed=2, rank=rank, world_size=world_size)
        loader = shardflow.loader(ds, batch_size=64, max_cost=budgets, num_workers=2 if rank == 1 else 0)
        planned = len(loader)  # this epoch's (cost batches: the count depends on the order)
        batches = list(loader)
        assert len(batches) == planned
        counts.append(len(batches))
        for b in batches:
            g = b["graph.pyg"]
            assert (g.num_nodes <= 500 and g.num_edges <= 450) or len(b["__key__"]) == 1
            keys += b["__key__"]
    assert len(set(counts)) == 1  # ranks in step
    assert sorted(set(keys)) == sorted(f"g{i:03d}" for i in range(90))
    nodes_only = shardflow.loader(shardflow.ShardDataset(folder, shuffle=True, seed=2), batch_size=64, max_cost=500)
    both = shardflow.loader(shardflow.ShardDataset(folder, shuffle=True, seed=2), batch_size=64, max_cost=budgets)
    assert len(both) > len(nodes_only)  # the edge budget binds too


@pytest.mark.parametrize(
    "max_cost, cost, error, match",
    [
        ("500", "num_nodes", TypeError, r"max_cost must be None, an int >= 1 .* or a mapping of size columns"),
        (0, "num_nodes", ValueError, r"got 0 for 'num_nodes'"),
        ({}, "num_nodes", ValueError, "empty mapping"),
        ({"num_nodes": 2.5}, "num_nodes", ValueError, r"got 2.5 for 'num_nodes'"),
        (500, None, TypeError, r"cost must name a size column \(e.g. 'num_nodes' or 'num_edges'\)"),
    ],
)
def test_wrong_max_cost_says_what_is_allowed(skewed, max_cost, cost, error, match):
    folder, _ = skewed
    with pytest.raises(error, match=match):
        shardflow.loader(shardflow.ShardDataset(folder), batch_size=8, max_cost=max_cost, cost=cost)


def test_unknown_cost_column_lists_the_columns(skewed):
    folder, _ = skewed
    loader = shardflow.loader(shardflow.ShardDataset(folder), batch_size=8, max_cost={"num_nodes": 50, "atoms": 9})
    with pytest.raises(ManifestError, match=r"no per-sample size 'atoms' .*\['num_nodes', 'num_edges'\]"):
        len(loader)
