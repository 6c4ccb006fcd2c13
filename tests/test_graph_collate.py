"""Tests for shardflow.graph.collate: the batch equals Batch.from_data_list, bit for bit."""

from __future__ import annotations

import warnings

import pytest
import torch

pytest.importorskip("torch_geometric.data")
networkx = pytest.importorskip("networkx")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from torch_geometric.data import Batch, Data, HeteroData  # noqa: E402
from torch_geometric.datasets import FakeDataset, FakeHeteroDataset  # noqa: E402
from torch_geometric.utils import from_networkx  # noqa: E402

from shardflow.errors import SampleError  # noqa: E402
from shardflow.graph import decode_graph, encode_graph  # noqa: E402
from shardflow.graph.collate import collate_graphs  # noqa: E402
from tests.test_graph_codec import assert_same_graph, assert_same_value  # noqa: E402


def round_trip(graphs: list) -> list:
    return [decode_graph(encode_graph(g)) for g in graphs]


def golden(graphs: list, **kwargs) -> Batch:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # num_nodes inference warnings, same for both sides
        return Batch.from_data_list(graphs, **kwargs)


def ours(graphs: list, **kwargs) -> Batch:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return collate_graphs(graphs, **kwargs)


def _assert_same_nested(a, b, where: str) -> None:
    """Compare slice/inc dicts: nested dicts and lists of tensors or None."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), f"{where}: {list(a)} != {list(b)}"
        for key in a:
            _assert_same_nested(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same_nested(x, y, f"{where}[{i}]")
    else:
        assert_same_value(a, b, where)


def assert_batch_equal(a: Batch, b: Batch, *, same_class: bool = True) -> None:
    """Every store key in order, dtype, value, the slice/inc dicts, and to_data_list()."""
    if same_class:
        assert type(a).__name__ == type(b).__name__
    assert isinstance(a, HeteroData) == isinstance(b, HeteroData)
    assert a.num_graphs == b.num_graphs
    assert [s._key for s in a.stores] == [s._key for s in b.stores]
    for sa, sb in zip(a.stores, b.stores):
        assert list(sa.keys()) == list(sb.keys()), f"{sa._key}: {list(sa.keys())} != {list(sb.keys())}"
        for key in sa.keys():
            assert_same_value(sa[key], sb[key], f"{sa._key}.{key}")
        assert sa.__dict__.get("_num_nodes") == sb.__dict__.get("_num_nodes"), sa._key
    _assert_same_nested(a._slice_dict, b._slice_dict, "_slice_dict")
    _assert_same_nested(a._inc_dict, b._inc_dict, "_inc_dict")
    items_a, items_b = a.to_data_list(), b.to_data_list()
    assert len(items_a) == len(items_b) == a.num_graphs
    for x, y in zip(items_a, items_b):
        assert_same_graph(x, y)


def check_all_ways(originals: list, *, same_class: bool = True, **kwargs) -> Batch:
    """collate_graphs on decoded graphs and on originals, and PyG on decoded graphs,
    all equal PyG on the originals (to_data_list() included)."""
    want = golden(originals, **kwargs)
    decoded = round_trip(originals)
    batch = ours(decoded, **kwargs)
    assert_batch_equal(want, batch, same_class=same_class)
    assert_batch_equal(want, golden(decoded, **kwargs), same_class=same_class)
    assert_batch_equal(want, ours(originals, **kwargs))
    return batch


# --------------------------------------------------------------------------------------
# Golden comparisons on real graph collections.


def atlas_graphs(start: int, stop: int) -> list:
    generator = torch.Generator().manual_seed(start)
    graphs = []
    for graph in networkx.graph_atlas_g()[start:stop]:
        data = from_networkx(graph)
        data.x = torch.randn(data.num_nodes, 3, generator=generator)
        data.y = torch.tensor([graph.number_of_edges()])
        graphs.append(data)
    return graphs


@pytest.mark.parametrize(("start", "stop"), [(0, 40), (40, 104), (500, 501), (1200, 1253)])
def test_graph_atlas_batches_equal_pyg(start, stop):
    batch = check_all_ways(atlas_graphs(start, stop))
    assert batch.num_graphs == stop - start
    assert batch.name == [f"G{i}" for i in range(start, stop)]


def test_fake_dataset_with_edge_attributes_equals_pyg():
    torch.manual_seed(3)
    dataset = FakeDataset(num_graphs=90, avg_num_nodes=25, avg_degree=3, num_channels=8, edge_dim=4)
    graphs = [dataset[i] for i in range(len(dataset))]
    assert graphs[0].edge_attr.shape[1] == 4
    for size in (1, 2, 23, 64):
        check_all_ways(graphs[:size])
    check_all_ways(graphs, follow_batch=["x", "edge_attr"], exclude_keys=["y"])


def test_fake_node_task_dataset_equals_pyg():
    torch.manual_seed(4)
    dataset = FakeDataset(
        num_graphs=20, avg_num_nodes=10, num_channels=4, task="node", is_undirected=False
    )
    check_all_ways([dataset[i] for i in range(20)], follow_batch=["y"])


def test_fake_hetero_dataset_equals_pyg():
    torch.manual_seed(5)
    dataset = FakeHeteroDataset(num_graphs=5, avg_num_nodes=12, edge_dim=2)
    graphs = [dataset[i] for i in range(5)]
    batch = check_all_ways(graphs)
    assert set(batch.node_types) == set(graphs[0].node_types)
    check_all_ways(graphs[:3], follow_batch=["x"], exclude_keys=["edge_attr"])


# --------------------------------------------------------------------------------------
# Batching rules: subclasses and PyG's name heuristics.


class FaceData(Data):
    """face and my_index move by twice the node count; pair by a tensor; gid is stacked."""

    def __inc__(self, key, value, *args, **kwargs):
        if key in ("face", "my_index"):
            return self.num_nodes * 2
        if key == "pair":
            return torch.tensor([[self.num_nodes], [1]])
        if key == "count":
            return 10
        if key == "w":
            return 0.5  # a float increment: PyG adds it graph by graph
        return super().__inc__(key, value, *args, **kwargs)

    def __cat_dim__(self, key, value, *args, **kwargs):
        if key == "gid":
            return None
        if key == "my_index":
            return 0
        return super().__cat_dim__(key, value, *args, **kwargs)


def face_graphs(count: int) -> list:
    generator = torch.Generator().manual_seed(count)
    graphs = []
    for i in range(count):
        n = 2 + i % 4
        graphs.append(
            FaceData(
                x=torch.randn(n, 2, generator=generator),
                edge_index=torch.randint(0, n, (2, 3), generator=generator),
                face=torch.randint(0, n, (3, 2), generator=generator),
                my_index=torch.randint(0, n, (2, 2), generator=generator),
                pair=torch.randint(0, n, (2, 3), generator=generator),
                gid=torch.tensor([i, -i]),
                count=i,
                w=torch.rand(2, generator=generator),
                name=f"g{i}",
            )
        )
    return graphs


def test_subclass_with_custom_inc_batches_like_the_original():
    originals = face_graphs(7)
    batch = check_all_ways(originals, same_class=False, follow_batch=["face"])
    assert type(golden(originals)).__name__ == "FaceDataBatch"
    assert type(batch).__name__ == "StoredRulesDataBatch"
    # Spot-check the custom rules on the values themselves.
    assert batch.face[:, 2:4].tolist() == (originals[1].face + 2 * originals[0].num_nodes).tolist()
    assert batch.gid.shape == (7, 2)
    assert batch.count.tolist() == [i + 10 * i for i in range(7)]


def test_graphs_taken_out_of_a_batch_of_subclass_graphs_refuse_to_guess_increments():
    batch = ours(round_trip(face_graphs(3)))
    items = batch.to_data_list()
    assert items[1].__cat_dim__("gid", items[1].gid) is None  # cat dims carry over
    with pytest.raises(SampleError, match="increment of graph attribute 'face' is unknown"):
        collate_graphs(items)
    with pytest.raises(SampleError, match="unknown"):
        collate_graphs([batch, batch])  # a batch of batches: PyG asks the batch for __inc__


class CitedHetero(HeteroData):
    """A HeteroData subclass: paper.cluster moves by 3 per graph, paper.rank is stacked."""

    def __inc__(self, key, value, store=None, *args, **kwargs):
        if key == "cluster":
            return 3
        return super().__inc__(key, value, store, *args, **kwargs)

    def __cat_dim__(self, key, value, store=None, *args, **kwargs):
        if key == "rank":
            return None
        return super().__cat_dim__(key, value, store, *args, **kwargs)


def test_hetero_subclass_with_custom_rules_batches_like_the_original():
    graphs = []
    for i in range(4):
        data = CitedHetero()
        data["paper"].x = torch.randn(2 + i, 3)
        data["paper"].cluster = torch.arange(2 + i)
        data["paper"].rank = torch.tensor([i, i + 1])
        data["author"].x = torch.randn(1 + i, 3)
        data["author", "writes", "paper"].edge_index = torch.tensor([[0], [1 + i]])
        graphs.append(data)
    batch = check_all_ways(graphs, same_class=False, follow_batch=["cluster"])
    assert type(batch).__name__ == "StoredRulesHeteroDataBatch"
    assert batch["paper"].cluster[2:5].tolist() == [3, 4, 5]
    assert batch["paper"].rank.shape == (4, 2)


def test_batches_of_decoded_subclass_graphs_unpickle_in_a_fresh_interpreter(tmp_path):
    # DataLoader workers pickle batches (and graphs) to the main process.
    import pickle
    import subprocess
    import sys

    batch = ours(round_trip(face_graphs(3)))
    path = tmp_path / "batch.pkl"
    path.write_bytes(pickle.dumps((batch, round_trip(face_graphs(2))[0])))
    code = (
        "import pickle, sys\n"
        f"batch, graph = pickle.loads(open({str(path)!r}, 'rb').read())\n"
        "assert type(batch).__name__ == 'StoredRulesDataBatch', type(batch)\n"
        "assert batch.num_graphs == 3 and len(batch.to_data_list()) == 3\n"
        "assert graph.__inc__('face', graph.face) == 4\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_subclass_batches_after_a_transform_that_replaces_tensors():
    decoded = round_trip(face_graphs(4))
    moved = [g.to("cpu", non_blocking=True).clone() for g in decoded]
    assert_batch_equal(golden(face_graphs(4)), ours(moved), same_class=False)


def heuristic_graphs(count: int, *, index_dtype=torch.int64) -> list:
    generator = torch.Generator().manual_seed(100 + count)
    graphs = []
    for i in range(count):
        n = 1 + (i * 3) % 5
        graphs.append(
            Data(
                x=torch.randn(n, 3, generator=generator),
                edge_index=torch.randint(0, n, (2, i % 3), generator=generator).to(index_dtype),
                face=torch.randint(0, n, (3, 1), generator=generator),
                node_index=torch.arange(n),
                root_index=torch.tensor(i % n),  # 0-dim, incremented
                small_index=torch.tensor(i % n, dtype=torch.int32),  # 0-dim int32, incremented
                adj_t=torch.ones(n, 3),  # dense: concatenated along dim 0, not incremented
                weight_index=torch.rand(2, generator=generator),  # float, incremented
                mask_index=torch.tensor([True, False]),  # bool + int64 increment -> int64
                half_index=torch.tensor([0.5], dtype=torch.float16),
                count_index=i,  # Python int, incremented
                count=i,
                score=i / 3,
                flag=i % 2 == 0,
                label=f"l{i}",
                tags=["a", str(i)],
                scalar=torch.tensor(float(i)),  # 0-dim, stacked
            )
        )
    return graphs


@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
def test_pyg_name_heuristics_dtypes_and_scalars_equal_pyg(index_dtype):
    graphs = heuristic_graphs(9, index_dtype=index_dtype)
    batch = check_all_ways(
        graphs, follow_batch=["face", "count", "label", "root_index"], exclude_keys=["tags"]
    )
    assert batch.mask_index.dtype == torch.int64
    assert batch.edge_index.dtype == index_dtype
    assert batch.label == [f"l{i}" for i in range(9)]


def test_nested_dicts_and_lists_of_tensors_equal_pyg():
    graphs = [
        Data(
            x=torch.randn(i + 1, 2),
            feats={"node_index": torch.arange(i + 1), "w": torch.ones(i + 1)},
            parts=[torch.zeros(i + 1), torch.ones(2)],
        )
        for i in range(4)
    ]
    check_all_ways(graphs)


# --------------------------------------------------------------------------------------
# Edge cases.


def test_graphs_without_x():
    explicit = [Data(edge_index=torch.tensor([[0, 1], [1, 0]]), num_nodes=5 + i) for i in range(4)]
    batch = check_all_ways(explicit)
    assert batch.ptr.tolist() == [0, 5, 11, 18, 26]
    assert batch.edge_index[:, 2:4].tolist() == [[5, 6], [6, 5]]

    inferred = [Data(edge_index=torch.tensor([[0, i], [i, 0]])) for i in range(1, 4)]
    batch = check_all_ways(inferred)  # num_nodes inferred from edge_index, as PyG does
    assert batch.ptr.tolist() == [0, 2, 5, 9]


def test_graphs_with_zero_edges_and_zero_nodes():
    graphs = [
        Data(x=torch.randn(n, 2), edge_index=torch.empty(2, 0, dtype=torch.long), y=torch.tensor([n]))
        for n in (0, 3, 0, 1)
    ]
    batch = check_all_ways(graphs, follow_batch=["x", "edge_index"])
    assert batch.edge_index.shape == (2, 0)
    assert batch.batch.tolist() == [1, 1, 1, 3]
    assert batch.x_ptr.tolist() == [0, 0, 3, 3, 4]


def test_follow_batch_and_exclude_keys():
    graphs = heuristic_graphs(5)
    batch = check_all_ways(graphs, follow_batch=["x", "edge_index"], exclude_keys=["face", "label"])
    assert "face" not in batch and "label" not in batch
    assert batch.x_batch.tolist() == batch.batch.tolist()
    assert batch.edge_index_ptr.tolist() == [0, 0, 1, 3, 3, 4]


def test_single_graph_and_a_batch_of_batches():
    check_all_ways(heuristic_graphs(1))
    inner = [golden(heuristic_graphs(2)), golden(heuristic_graphs(3))]
    assert_batch_equal(golden(inner), ours(inner))


def test_the_fast_path_does_not_call_pyg(monkeypatch):
    graphs = round_trip(atlas_graphs(100, 140))
    want = golden(graphs, follow_batch=["x"])

    def refuse(*args, **kwargs):
        raise AssertionError("Batch.from_data_list was called")

    monkeypatch.setattr(Batch, "from_data_list", refuse)
    assert_batch_equal(want, ours(graphs, follow_batch=["x"]))


# --------------------------------------------------------------------------------------
# The policy for graphs that differ.


def test_a_missing_attribute_names_it_and_the_graph_index():
    graphs = atlas_graphs(10, 14)
    del graphs[2].y
    with pytest.raises(SampleError, match=r"graph 2\b.*no attribute 'y'"):
        collate_graphs(graphs)
    with pytest.raises(SampleError, match=r"graph 1\b.*has attribute 'y'"):
        collate_graphs(graphs[2:])
    batch = collate_graphs(graphs, exclude_keys=["y"])  # excluded: allowed to differ
    assert "y" not in batch and batch.num_graphs == 4


def test_hetero_graphs_that_differ_in_types_or_attributes():
    def make(with_venue: bool, with_year: bool) -> HeteroData:
        data = HeteroData()
        data["author"].x = torch.randn(2, 3)
        if with_year:
            data["author"].year = torch.tensor([1990, 2000])
        if with_venue:
            data["venue"].x = torch.randn(1, 3)
            data["author", "writes", "venue"].edge_index = torch.tensor([[0], [0]])
        return data

    with pytest.raises(SampleError, match=r"graph 1\b.*node type 'venue'"):
        collate_graphs([make(True, False), make(False, False)])
    with pytest.raises(SampleError, match=r"graph 2\b.*attribute 'year' of 'author'"):
        collate_graphs([make(True, True), make(True, True), make(True, False)])
    batch = collate_graphs([make(True, True), make(True, False)], exclude_keys=["year"])
    assert batch.num_graphs == 2


def test_mixing_kinds_empty_lists_and_non_graphs_are_refused():
    with pytest.raises(SampleError, match=r"graph 1\b.*HeteroData"):
        collate_graphs([Data(x=torch.ones(1, 1)), HeteroData()])
    with pytest.raises(SampleError, match="empty"):
        collate_graphs([])
    with pytest.raises(SampleError, match=r"graph 0\b.*dict"):
        collate_graphs([{"x": torch.ones(1)}])
    with pytest.raises(SampleError, match=r"graph 1\b.*str"):
        collate_graphs([Data(x=torch.ones(1, 1)), "x"])


def test_other_graph_kinds_go_to_pyg():
    from torch_geometric.data import TemporalData

    events = [
        TemporalData(
            src=torch.tensor([0, 1]), dst=torch.tensor([1, 2]), t=torch.tensor([1, 2]), msg=torch.ones(2, 1)
        )
        for _ in range(2)
    ]
    assert_batch_equal(golden(events), ours(events))


def test_attributes_that_cannot_be_concatenated():
    graphs = [Data(x=torch.ones(2, 3)), Data(x=torch.ones(2, 4))]
    with pytest.raises(SampleError, match="collate"):
        collate_graphs(graphs)


# --------------------------------------------------------------------------------------
# Property: random collections of same-structured graphs.

_DTYPES = [
    torch.float32, torch.float16, torch.float64, torch.int64, torch.int32, torch.bool, torch.uint8
]  # fmt: skip


@st.composite
def graph_collections(draw):
    names = draw(
        st.lists(
            st.sampled_from(
                ["x", "pos", "edge_attr", "y", "node_index", "face", "w", "extra_index", "s"]
            ),
            min_size=1,
            max_size=5,
            unique=True,
        )
    )
    per_node_or_edge = ("x", "pos", "edge_attr")
    layouts = {  # width -1: a 0-dim tensor per graph (stacked, or incremented if *_index)
        name: (draw(st.sampled_from(_DTYPES)), draw(st.integers(0 if name in per_node_or_edge else -1, 3)))
        for name in names
    }
    with_num_nodes = draw(st.booleans()) or "x" not in names and "pos" not in names
    count = draw(st.integers(1, 6))
    graphs = []
    for _ in range(count):
        n = draw(st.integers(0, 5))
        e = draw(st.integers(0, 6)) if n else 0
        graph = Data(edge_index=torch.randint(0, max(n, 1), (2, e)))
        if with_num_nodes:
            graph.num_nodes = n
        for name, (dtype, width) in layouts.items():
            rows = n if name in ("x", "pos") else e if name == "edge_attr" else draw(st.integers(0, 3))
            if name == "s":
                graph[name] = draw(st.one_of(st.integers(-5, 5), st.floats(-1, 1), st.text(max_size=3)))
                continue
            if width == -1:
                graph[name] = torch.tensor(draw(st.integers(0, 3))).to(dtype)
                continue
            last = "index" in name or name == "face"  # PyG concatenates these along -1
            shape = ((width, rows) if last else (rows, width)) if width else (rows,)
            value = torch.randint(0, 4, shape)
            graph[name] = value.to(dtype)
        graphs.append(graph)
    if "s" in names:  # PyG requires one kind of scalar per attribute across graphs
        kinds = {type(g.s) for g in graphs}
        if len(kinds) > 1:
            for g in graphs:
                g.s = str(g.s)
    return graphs, draw(st.lists(st.sampled_from(names), max_size=2, unique=True))


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(graph_collections())
def test_random_collections_equal_pyg(collection):
    graphs, follow = collection
    want = golden(graphs, follow_batch=follow)
    assert_batch_equal(want, ours(round_trip(graphs), follow_batch=follow))
    assert_batch_equal(want, ours(graphs, follow_batch=follow))
