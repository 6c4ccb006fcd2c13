"""shardflow.collate: graph shards into PyG ``Batch`` objects through the loader, golden against
``Batch.from_data_list`` (with PyG's follow_batch / exclude_keys options)."""

import pickle
import random

import pytest
import torch

import shardflow
from shardflow import ShardDataset
from shardflow.errors import SampleError

pyg = pytest.importorskip("torch_geometric")
from torch_geometric.data import Batch, Data  # noqa: E402
from torch_geometric.datasets import FakeDataset, FakeHeteroDataset  # noqa: E402

from shardflow.loading.collation import Collate  # noqa: E402
from shardflow.convert.pyg import to_shards  # noqa: E402
from tests.order_reference import reference_permutation  # noqa: E402

FIELD = "graph.pyg"


def seed_all(seed):
    random.seed(seed)  # FakeDataset draws graph labels from `random`
    torch.manual_seed(seed)


def assert_same_value(a, b, where):
    if isinstance(b, torch.Tensor):
        assert isinstance(a, torch.Tensor), where
        assert a.dtype == b.dtype and a.shape == b.shape, (where, a.dtype, b.dtype, a.shape, b.shape)
        assert torch.equal(a, b), where
    elif isinstance(b, dict):
        assert a.keys() == b.keys(), where
        for k in b:
            assert_same_value(a[k], b[k], f"{where}[{k!r}]")
    else:
        assert a == b, where


def assert_batch_equal(got, want):
    """Everything Batch.from_data_list sets: class, stores, tensors, slices, increments."""
    assert type(got).__name__ == type(want).__name__
    assert got.num_graphs == want.num_graphs
    got_stores = {getattr(s, "_key", None): s for s in got.stores}
    want_stores = {getattr(s, "_key", None): s for s in want.stores}
    assert got_stores.keys() == want_stores.keys()
    for key, ws in want_stores.items():
        gs = got_stores[key]
        assert list(gs.keys()) == list(ws.keys()), key
        for name in ws.keys():
            assert_same_value(gs[name], ws[name], f"{key}.{name}")
    assert_same_value(got._slice_dict, want._slice_dict, "_slice_dict")
    assert_same_value(got._inc_dict, want._inc_dict, "_inc_dict")
    assert [g.num_nodes for g in got.to_data_list()] == [g.num_nodes for g in want.to_data_list()]


@pytest.fixture(scope="module")
def fake(tmp_path_factory):
    seed_all(0)
    graphs = [g for g in FakeDataset(num_graphs=100, avg_num_nodes=30, avg_degree=4, num_channels=8, edge_dim=4, task="graph")]
    folder = str(tmp_path_factory.mktemp("fake"))
    to_shards(graphs, folder, max_count=32, workers=1)
    return folder, graphs


@pytest.fixture(scope="module")
def fake_hetero(tmp_path_factory):
    seed_all(1)
    ds = FakeHeteroDataset(num_graphs=40, avg_num_nodes=12, avg_degree=3, avg_num_channels=6, edge_dim=2, task="graph")
    folder = str(tmp_path_factory.mktemp("hetero"))
    to_shards(ds, folder, max_count=16, workers=2)
    return folder, [ds[i] for i in range(len(ds))]


def _index(key):
    return int(key)


def test_golden_fake_dataset_follow_batch(fake):
    folder, graphs = fake
    loader = shardflow.loader(ShardDataset(folder), batch_size=16, collate_fn=Collate(follow_batch=["x"]))
    batches = list(loader)
    assert len(batches) == len(loader) == 7
    for batch in batches:
        keys = batch["__key__"]
        got = batch[FIELD]
        assert isinstance(got, Batch)
        assert "x_batch" in got and "x_ptr" in got
        assert_batch_equal(got, Batch.from_data_list([graphs[_index(k)] for k in keys], follow_batch=["x"]))
    # stored in the converters' default order, the graphs' seeded permutation
    assert [k for b in batches for k in b["__key__"]] == [f"{i:09d}" for i in reference_permutation(100)]


def test_golden_shuffled_with_workers_and_exclude_keys(fake):
    folder, graphs = fake
    ds = ShardDataset(folder, shuffle=True, seed=3)
    loader = shardflow.loader(ds, batch_size=16, num_workers=2, collate_fn=Collate(exclude_keys=["edge_attr"]))
    seen = []
    for batch in loader:
        keys = batch["__key__"]
        seen += keys
        assert "edge_attr" not in batch[FIELD]
        want = Batch.from_data_list([graphs[_index(k)] for k in keys], exclude_keys=["edge_attr"])
        assert_batch_equal(batch[FIELD], want)
    assert sorted(seen) == [f"{i:09d}" for i in range(100)] and seen != sorted(seen)


def test_golden_fake_hetero_dataset(fake_hetero):
    folder, graphs = fake_hetero
    loader = shardflow.loader(ShardDataset(folder), batch_size=16, collate_fn=Collate(follow_batch=["x"]))
    batches = list(loader)
    assert [len(b["__key__"]) for b in batches] == [16, 16, 8]
    for batch in batches:
        want = Batch.from_data_list([graphs[_index(k)] for k in batch["__key__"]], follow_batch=["x"])
        assert_batch_equal(batch[FIELD], want)
        for node_type in want.node_types:
            assert torch.equal(batch[FIELD][node_type].x_batch, want[node_type].x_batch)


def test_default_collate_equals_collate_without_options(fake):
    folder, graphs = fake
    plain = list(shardflow.loader(ShardDataset(folder), batch_size=16))
    ours = list(shardflow.loader(ShardDataset(folder), batch_size=16, collate_fn=Collate()))
    for a, b in zip(plain, ours):
        assert a["__key__"] == b["__key__"]
        assert_batch_equal(b[FIELD], a[FIELD])


def test_node_budget_batching_on_converted_shards(fake):
    folder, graphs = fake
    budget = 200
    ds = ShardDataset(folder, shuffle=True, seed=0)
    assert ds.manifest.meta["size_columns"] == ["num_nodes", "num_edges"]
    loader = shardflow.loader(ds, batch_size=64, max_cost=budget, cost="num_nodes", collate_fn=Collate(follow_batch=["x"]))
    batches = list(loader)
    assert len(batches) == len(loader)
    keys = [k for b in batches for k in b["__key__"]]
    assert sorted(keys) == [f"{i:09d}" for i in range(100)]
    for b in batches:
        batch = b[FIELD]
        assert batch.num_nodes == sum(graphs[_index(k)].num_nodes for k in b["__key__"])
        assert batch.num_nodes <= budget or batch.num_graphs == 1
        want = Batch.from_data_list([graphs[_index(k)] for k in b["__key__"]], follow_batch=["x"])
        assert_batch_equal(batch, want)
    # fewer, fuller batches than a count of 16 would give for this budget
    assert max(b[FIELD].num_nodes for b in batches) > budget // 2


def test_edge_budget_two_ranks_equal_batch_counts(fake):
    folder, _ = fake
    counts = []
    for rank in (0, 1):
        ds = ShardDataset(folder, shuffle=True, seed=0, rank=rank, world_size=2)
        counts.append(len(list(shardflow.loader(ds, batch_size=64, max_cost=1500, cost="num_edges", collate_fn=Collate()))))
    assert counts[0] == counts[1]


def _mixed_graphs():
    graphs = []
    for i in range(8):
        g = Data(x=torch.full((3, 2), float(i)), edge_index=torch.tensor([[0, 1], [1, 2]]), edge_attr=torch.ones(2, 4))
        graphs.append(g)
    del graphs[5].edge_attr  # an optional attribute missing from one graph
    return graphs


@pytest.mark.parametrize("num_workers", [0, 1])
def test_graphs_that_differ_raise_naming_the_samples(tmp_path, num_workers):
    folder = str(tmp_path / "mixed")
    to_shards(_mixed_graphs(), folder, workers=1, order="walk")  # graphs 4 and 5 in one batch of 4, 5 after 4
    loader = shardflow.loader(ShardDataset(folder), batch_size=4, num_workers=num_workers, collate_fn=Collate())
    with pytest.raises(SampleError) as info:
        list(loader)
    msg = str(info.value)
    assert "sample '000000005'" in msg and "sample '000000004'" in msg  # the culprit and the reference
    assert "train-000000.tar" in msg
    assert "edge_attr" in msg and "field 'graph.pyg'" in msg
    # excluding the attribute that differs makes the same batches valid
    ok = shardflow.loader(ShardDataset(folder), batch_size=4, collate_fn=Collate(exclude_keys=["edge_attr"]))
    assert [b[FIELD].num_graphs for b in ok] == [4, 4]


def test_differing_node_types_and_feature_sizes_name_the_samples():
    from torch_geometric.data import HeteroData

    def hetero(types):
        h = HeteroData()
        for t in types:
            h[t].x = torch.zeros(2, 3)
        return h

    samples = [{"__key__": f"h{i}", "g.pyg": hetero(["a", "b"] if i != 2 else ["a", "c"])} for i in range(3)]
    with pytest.raises(SampleError, match=r"sample .h2. \(graph 2 of the batch\) against sample .h0. \(graph 0\).*node type"):
        shardflow.collate(samples)
    data = [{"__key__": f"d{i}", "g.pyg": Data(x=torch.zeros(2, 3 if i != 1 else 5))} for i in range(3)]
    with pytest.raises(SampleError, match=r"sample 'd1' \(graph 1 of the batch\) against sample 'd0'"):
        shardflow.collate(data)


def test_collate_other_fields_and_plain_graph_lists():
    graphs = _mixed_graphs()[:3]
    samples = [{"__key__": f"k{i}", "cls": i, "g.pyg": g} for i, g in enumerate(graphs)]
    out = shardflow.collate(samples, follow_batch=["x"])
    assert list(out) == ["__key__", "cls", "g.pyg"]
    assert out["__key__"] == ["k0", "k1", "k2"]
    assert torch.equal(out["cls"], torch.tensor([0, 1, 2]))
    assert_batch_equal(out["g.pyg"], Batch.from_data_list(graphs, follow_batch=["x"]))
    assert_batch_equal(shardflow.collate(graphs), Batch.from_data_list(graphs))  # samples a transform made graphs
    with pytest.raises(SampleError, match="fields missing"):
        shardflow.collate([{"__key__": "a", "g.pyg": graphs[0]}, {"__key__": "b"}])
    with pytest.raises(ValueError, match="empty"):
        shardflow.collate([])
    with pytest.raises(TypeError, match="not a str"):
        Collate(follow_batch="x")


def test_collate_options_are_picklable_and_comparable():
    fn = Collate(follow_batch=["x"], exclude_keys=("y",))
    assert pickle.loads(pickle.dumps(fn)) == fn
    assert fn.follow_batch == ("x",) and fn.exclude_keys == ("y",)


def test_migration_recipe_in_memory_dataset(tmp_path):
    """docs/graphs.md: an InMemoryDataset into shards once, then the same batches as PyG's DataLoader."""
    from torch_geometric.loader import DataLoader

    seed_all(2)
    ds = FakeDataset(num_graphs=48, avg_num_nodes=20, num_channels=4, edge_dim=2, task="graph")
    manifest = to_shards(ds, str(tmp_path / "shards"))
    assert manifest.meta["num_graphs"] == 48 and manifest.meta["num_classes"] == 10
    ours = list(shardflow.loader(ShardDataset(str(tmp_path / "shards")), batch_size=16))
    # the shards hold the graphs in a seeded permutation (the default order): PyG's loader over it
    theirs = list(DataLoader(ds[reference_permutation(48)], batch_size=16, shuffle=False))
    assert len(ours) == len(theirs) == 3
    for a, b in zip(ours, theirs):
        assert_batch_equal(a[FIELD], b)
