"""Tests for shardflow.graph.records: graph fields decoded for batching give exactly the
batch of Batch.from_data_list, and exactly decode_graph's errors."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

pytest.importorskip("torch_geometric.data")
pytest.importorskip("networkx")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from torch_geometric.data import Batch, Data  # noqa: E402
from torch_geometric.datasets import FakeDataset  # noqa: E402

import shardflow  # noqa: E402
from shardflow.loading.collation import Collate, takes_graph_records  # noqa: E402
from shardflow.errors import DecodeError, SampleError  # noqa: E402
from shardflow.graph import decode_graph, encode_graph, headers  # noqa: E402
from shardflow.graph.records import GraphRecord, collate_records, decode_graph_record  # noqa: E402
from shardflow.writing.writer import ShardWriter  # noqa: E402
from tests.test_graph_codec import assert_same_graph  # noqa: E402
from tests.test_graph_collate import (  # noqa: E402
    assert_batch_equal,
    atlas_graphs,
    golden,
    graph_collections,
    heuristic_graphs,
)


def fake_graphs(count: int, seed: int = 0) -> list:
    torch.manual_seed(seed)
    ds = FakeDataset(num_graphs=count, avg_num_nodes=12, avg_degree=3, num_channels=5, edge_dim=4, task="graph")
    return [ds[i] for i in range(count)]


def records_of(graphs: list, **limits) -> list:
    return [decode_graph_record(encode_graph(g), **limits) for g in graphs]


def batch_of_records(records: list, follow_batch=(), exclude_keys=()) -> Batch:
    """What the default collate makes of the records of one batch."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return Collate(tuple(follow_batch), tuple(exclude_keys))._graphs("graphs", records, records)


def assert_contiguous(batch: Batch) -> None:
    for key, value in batch.items():
        if isinstance(value, torch.Tensor):
            assert value.is_contiguous() and value.storage_offset() == 0, key


def assert_like_decode_graph(buf, **limits):
    """decode_graph_record raises decode_graph's error, or its record is the same graph."""
    try:
        want = decode_graph(buf, **limits)
    except DecodeError as exc:
        with pytest.raises(DecodeError) as got:
            decode_graph_record(buf, **limits)
        assert str(got.value) == str(exc)
        return None
    record = decode_graph_record(buf, **limits)
    if type(record) is GraphRecord:
        assert_same_graph(want, record.build())
        batch = collate_records([record])
        if batch is not None:
            assert_batch_equal(golden([want]), batch)
    else:
        assert_same_graph(want, record)
    return record


# --------------------------------------------------------------------------------------
# Batches equal PyG's.


def test_fake_dataset_graphs_become_records_and_batch_like_pyg():
    graphs = fake_graphs(40)
    records = records_of(graphs)
    assert all(type(r) is GraphRecord for r in records)
    assert records[0].names == tuple(graphs[0]._store._mapping)
    assert [r.num_nodes for r in records] == [g.num_nodes for g in graphs]
    for follow, exclude in [((), ()), (("x", "edge_index", "y"), ()), (("x",), ("edge_attr",))]:
        batch = collate_records(records, follow_batch=set(follow), exclude_keys=set(exclude))
        assert batch is not None
        assert_batch_equal(golden(graphs, follow_batch=list(follow), exclude_keys=list(exclude)), batch)
        assert_contiguous(batch)
    assert not records[3].arrays[2].flags.writeable  # views into the field's bytes
    batch = collate_records(records)
    batch.x.add_(1)  # the batch owns its memory: the records' bytes are untouched
    assert_same_graph(graphs[0], records[0].build())


def test_atlas_graphs_and_one_graph_batches():
    graphs = atlas_graphs(40, 104)  # from_networkx: edge_index, num_nodes (an int), x, y
    assert_batch_equal(golden(graphs), batch_of_records(records_of(graphs)))
    for g in fake_graphs(3):
        assert_batch_equal(golden([g]), collate_records(records_of([g])))


@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
def test_name_heuristics_dtypes_and_scalars(index_dtype):
    graphs = heuristic_graphs(9, index_dtype=index_dtype)
    assert_batch_equal(
        golden(graphs, follow_batch=["face", "count", "root_index"], exclude_keys=["tags"]),
        batch_of_records(records_of(graphs), follow_batch=["face", "count", "root_index"], exclude_keys=["tags"]),
    )
    # Tensors only: a record, incremented names and 0-dim ones included.
    tensors_only = [Data(**{k: v for k, v in g.items() if isinstance(v, torch.Tensor)}) for g in graphs]
    records = records_of(tensors_only)
    # (an edge_index of another dtype than int64 is checked by decode_graph itself)
    assert all(type(r) is GraphRecord for r in records) == (index_dtype == torch.int64)
    batch = batch_of_records(records, follow_batch=["face", "root_index"])
    assert_batch_equal(golden(tensors_only, follow_batch=["face", "root_index"]), batch)


def test_zero_edges_zero_nodes_and_mixed_batches():
    empty = [Data(x=torch.zeros(0, 2), edge_index=torch.zeros(2, 0, dtype=torch.long)) for _ in range(3)]
    assert_batch_equal(golden(empty), batch_of_records(records_of(empty)))
    graphs = fake_graphs(6)
    mixed = records_of(graphs[:3]) + [decode_graph(encode_graph(g)) for g in graphs[3:]]
    assert_batch_equal(golden(graphs), batch_of_records(mixed))


def test_records_that_do_not_line_up_fail_as_the_graphs_do():
    graphs = fake_graphs(4)
    del graphs[2].edge_attr
    with pytest.raises(SampleError, match="no attribute 'edge_attr'"):
        batch_of_records(records_of(graphs))
    wide = fake_graphs(2)
    wide[1].x = torch.ones(wide[1].num_nodes, 7)
    with pytest.raises(SampleError, match="graphs"):
        batch_of_records(records_of(wide))
    assert collate_records(records_of(wide)) is None
    cast = fake_graphs(3)
    cast[1].x = cast[1].x.double()  # torch.cat promotes: PyG's answer
    assert_batch_equal(golden(cast), batch_of_records(records_of(cast)))


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(graph_collections())
def test_random_collections_equal_pyg(collection):
    graphs, follow = collection
    assert_batch_equal(golden(graphs, follow_batch=follow), batch_of_records(records_of(graphs), follow_batch=follow))


# --------------------------------------------------------------------------------------
# Which fields are records, and the checks: exactly decode_graph's.


class Custom(Data):
    def __inc__(self, key, value, *args, **kwargs):
        return 2 if key == "ring_index" else super().__inc__(key, value, *args, **kwargs)


def test_other_layouts_are_decoded_graphs():
    g = fake_graphs(1)[0]
    cases = {
        "an int attribute": Data(x=g.x, edge_index=g.edge_index, label=3),
        "num_nodes": Data(edge_index=g.edge_index, num_nodes=g.num_nodes, x=g.x),
        "no node-level tensor": Data(edge_index=g.edge_index),
        "a batch-named tensor": Data(x=g.x, sub_batch=torch.zeros(2, dtype=torch.long)),
        "bfloat16": Data(x=g.x.bfloat16(), edge_index=g.edge_index),
        "custom rules": Custom(x=g.x, ring_index=torch.tensor([0, 1])),
    }
    for what, graph in cases.items():
        decoded = assert_like_decode_graph(encode_graph(graph))
        assert type(decoded) is not GraphRecord, what


@pytest.mark.parametrize(
    ("ids", "limits", "message"),
    [
        ([[0, 1], [1, -3]], {}, "negative node id -3"),
        ([[0, 1], [1, 9]], {}, "holds the node id 9, but the graph has 4 nodes"),
        ([[0, 1], [1, 3]], {"max_nodes": 3}, "over the limit of 3"),
        ([[0, 1, 2], [1, 2, 3]], {"max_edges": 2}, "holds 3 edges, over the limit of 2"),
    ],
)
def test_bounds_are_decode_graphs(ids, limits, message):
    graph = Data(x=torch.ones(4, 2), edge_index=torch.tensor(ids))
    with pytest.raises(DecodeError, match=message):
        decode_graph_record(encode_graph(graph), **limits)
    assert_like_decode_graph(encode_graph(graph), **limits)


def _hand_made(header: dict, data: bytes) -> bytes:
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text + data


def test_bad_headers_raise_decode_graphs_errors():
    good = encode_graph(Data(x=torch.ones(3, 2), edge_index=torch.tensor([[0, 1], [1, 2]])))
    n = int.from_bytes(good[:8], "little")
    header, data = json.loads(good[8 : 8 + n]), good[8 + n :]
    entry = next(k for k in header if k != "__metadata__")
    for field, bad in [("dtype", "F128"), ("shape", [-1, 3]), ("data_offsets", [0, 10**9]), ("shape", [10**6]),
                       ("shape", "5"), ("data_offsets", [-8, 8])]:  # fmt: skip
        broken = json.loads(json.dumps(header))
        broken[entry][field] = bad
        assert_like_decode_graph(_hand_made(broken, data))
    for buf in (b"", b"garbage", good + b"\x00" * 8, good[:-3], (10**9).to_bytes(8, "little") + b"{}"):
        assert_like_decode_graph(buf)


def _header_text(buf: bytes) -> bytes:
    return bytes(buf[8 : 8 + int.from_bytes(buf[:8], "little")])


def test_a_layout_seen_before_is_read_from_its_template():
    first, second = fake_graphs(2, seed=4)
    assert headers.match(_header_text(encode_graph(Data(x=first.x, lone_index=first.edge_index)))) is None
    assert type(assert_like_decode_graph(encode_graph(Data(x=first.x, lone_index=first.edge_index)))) is GraphRecord
    buf = encode_graph(Data(x=second.x, lone_index=second.edge_index))
    found = headers.match(_header_text(buf))
    assert found is not None and found[0].names == ("x", "lone_index")
    assert_like_decode_graph(buf)
    # Digits inside strings are literal: other names, entries and dtypes are other layouts.
    for graph in (Data(x=second.x, lone2_index=second.edge_index), Data(x=second.x.double(), lone_index=second.edge_index)):
        other = encode_graph(graph)
        assert headers.match(_header_text(other)) is None
        record = assert_like_decode_graph(other)
        assert type(record) is GraphRecord and record.names == tuple(graph._store._mapping)
    # A number that json refuses (a leading zero) is decode_graph's error.
    text = _header_text(buf)
    shape = text.index(b'"shape":[') + len(b'"shape":[')
    padded = text[:shape] + b"0" + text[shape:-1]  # the same length: one padding space less
    assert padded != text and len(padded) == len(text)
    assert headers.match(padded) is None
    with pytest.raises(DecodeError):
        decode_graph_record(buf[:8] + padded + buf[8 + len(text) :])


def test_a_template_reads_tensors_stored_in_another_order():
    graph = Data(x=torch.arange(6.0).reshape(3, 2), edge_index=torch.tensor([[0, 1], [1, 2]]), w=torch.arange(4) + 7)
    good = encode_graph(graph)
    n = int.from_bytes(good[:8], "little")
    header, data = json.loads(good[8 : 8 + n]), good[8 + n :]
    entries = sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])
    in_order = _hand_made(header, data)
    assert type(assert_like_decode_graph(in_order)) is GraphRecord  # (its layout learned)
    # the same layout, the edge ids and w (both 32 bytes) swapped in the data section
    a, b = (k for k in entries if header[k]["dtype"] == "I64")
    (a0, a1), (b0, b1) = header[a]["data_offsets"], header[b]["data_offsets"]
    assert a1 - a0 == b1 - b0 == 32 and a1 == b0
    swapped = json.loads(json.dumps(header))
    swapped[a]["data_offsets"], swapped[b]["data_offsets"] = [b0, b1], [a0, a1]
    buf = _hand_made(swapped, data[:a0] + data[b0:b1] + data[a0:a1] + data[b1:])
    assert headers.match(_header_text(buf)) is not None
    assert type(assert_like_decode_graph(buf)) is GraphRecord
    # overlapping tensors in the learned layout: decode_graph's error
    overlap = json.loads(json.dumps(header))
    overlap[b]["data_offsets"] = [a0, a1]
    assert headers.match(_header_text(_hand_made(overlap, data))) is not None
    assert assert_like_decode_graph(_hand_made(overlap, data)) is None


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_damaged_bytes_give_decode_graphs_outcome(data):
    buf = bytearray(encode_graph(fake_graphs(1, seed=3)[0]))
    assert type(decode_graph_record(bytes(buf))) is GraphRecord  # (its layout's template is learned)
    cut = data.draw(st.integers(0, len(buf)))
    position = data.draw(st.integers(0, len(buf) - 1))
    damaged = bytearray(buf)
    damaged[position] ^= data.draw(st.integers(1, 255))
    for candidate in (bytes(buf[:cut]), bytes(damaged)):
        assert_like_decode_graph(candidate)


# --------------------------------------------------------------------------------------
# In the loader.


@pytest.fixture
def graph_shards(tmp_path):
    graphs = fake_graphs(50, seed=1)
    with ShardWriter(str(tmp_path / "g-%06d.tar"), max_count=20) as writer:
        for i, g in enumerate(graphs):
            writer.write({"__key__": f"{i:06d}", "graph.pyg": g, "cls": i})
    return tmp_path, graphs


def test_the_loader_batches_records_like_pyg(graph_shards):
    path, graphs = graph_shards
    ds = shardflow.ShardDataset(path, shuffle=True, seed=5)
    seen = []
    for batch in shardflow.loader(ds, batch_size=16, collate_fn=Collate(follow_batch=["x"])):
        order = [int(k) for k in batch["__key__"]]
        assert batch["cls"].tolist() == order
        assert_batch_equal(golden([graphs[i] for i in order], follow_batch=["x"]), batch["graph.pyg"])
        seen += order
    assert sorted(seen) == list(range(50))
    assert all(isinstance(s["graph.pyg"], Data) for s in ds)  # iterated itself: graphs


def test_records_reach_only_the_default_collate(graph_shards):
    path, _ = graph_shards
    assert takes_graph_records(shardflow.collate) and takes_graph_records(Collate())
    assert not takes_graph_records(list)
    ds = shardflow.ShardDataset(path)
    for batch in shardflow.loader(ds, batch_size=8, collate_fn=list):
        assert all(type(s["graph.pyg"]) is Data for s in batch)
    seen = []
    ds = shardflow.ShardDataset(path, transform=lambda s: seen.append(type(s["graph.pyg"])) or s)
    assert sum(b["graph.pyg"].num_graphs for b in shardflow.loader(ds, batch_size=8)) == 50
    assert set(seen) == {Data}


def test_a_bad_graph_is_skipped_and_counted_before_batching(tmp_path):
    graphs = fake_graphs(6, seed=2)
    bad = Data(x=torch.ones(3, 5), edge_index=torch.tensor([[0], [7]]), y=graphs[0].y,
               edge_attr=torch.ones(1, 4))  # fmt: skip
    with ShardWriter(str(tmp_path / "g-%06d.tar"), max_count=10) as writer:
        for i, g in enumerate(graphs[:3] + [bad] + graphs[3:]):
            writer.write({"__key__": f"{i:06d}", "graph.pyg": g})
    with pytest.raises(DecodeError, match="holds the node id 7, but the graph has 3 nodes"):
        list(shardflow.loader(shardflow.ShardDataset(tmp_path), batch_size=7))
    ds = shardflow.ShardDataset(tmp_path, on_error="skip")
    (batch,) = list(shardflow.loader(ds, batch_size=7))
    assert batch["__key__"] == ["000000", "000001", "000002", "000004", "000005", "000006"]
    assert_batch_equal(golden(graphs), batch["graph.pyg"])
    assert ds.stats["decode"] == 1
