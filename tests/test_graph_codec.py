"""Tests for shardflow.graph.codec: PyG graphs <-> bytes of a ``pyg`` field, no pickle."""

from __future__ import annotations

import copy
import json
import math
import pickle
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch

pyg_data = pytest.importorskip("torch_geometric.data")
safetensors_torch = pytest.importorskip("safetensors.torch")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from torch_geometric import EdgeIndex, Index  # noqa: E402
from torch_geometric.data import Batch, Data, HeteroData, InMemoryDataset  # noqa: E402

from shardflow.errors import DecodeError, SampleError, ShardflowError  # noqa: E402
from shardflow.graph import decode_graph, encode_graph, is_graph  # noqa: E402
from shardflow.graph.codec import SCHEMA_KEY, stored_rules  # noqa: E402
from shardflow.graph.decode import _tensor_from_bytes  # noqa: E402

DTYPES = [
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.bool,
    torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8,
    torch.uint16, torch.uint32, torch.uint64, torch.complex64,
]  # fmt: skip


# --------------------------------------------------------------------------------------
# Helpers.


def assert_same_tensor(a: torch.Tensor, b: torch.Tensor, where: str = "") -> None:
    """Same class, dtype, shape and bytes (bitwise: NaN payloads and -0.0 included)."""
    assert type(a) is type(b), f"{where}: {type(a)} != {type(b)}"
    assert a.dtype == b.dtype, f"{where}: {a.dtype} != {b.dtype}"
    assert a.shape == b.shape, f"{where}: {a.shape} != {b.shape}"
    a_bytes = a.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    b_bytes = b.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    assert torch.equal(a_bytes, b_bytes), f"{where}: values differ"


def assert_same_value(a, b, where: str = "") -> None:
    assert type(a) is type(b), f"{where}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert_same_tensor(a, b, where)
        if isinstance(a, EdgeIndex):
            assert a.sparse_size() == b.sparse_size(), where
            assert a.sort_order == b.sort_order, where
            assert a.is_undirected == b.is_undirected, where
        if isinstance(a, Index):
            assert (a.dim_size, a.is_sorted) == (b.dim_size, b.is_sorted), where
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape, where
        assert a.tobytes() == b.tobytes(), where
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for key in a:
            assert_same_value(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_value(x, y, f"{where}[{i}]")
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b), where
    elif isinstance(a, float):
        assert a == b and math.copysign(1, a) == math.copysign(1, b), where
    else:
        assert a == b, where


def assert_same_graph(original, decoded, *, ordered: bool = True) -> None:
    """Same kind, same stores in the same order, same attributes, same num_nodes.

    ``ordered=False`` accepts attributes in another order (``Batch.to_data_list`` puts
    ``num_nodes`` last).
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # num_nodes inference may warn, for both alike
        _assert_same_graph(original, decoded, ordered)


def _assert_same_graph(original, decoded, ordered: bool) -> None:
    assert isinstance(decoded, HeteroData) == isinstance(original, HeteroData)
    assert [s._key for s in decoded.stores] == [s._key for s in original.stores]
    for s_orig, s_dec in zip(original.stores, decoded.stores):
        if ordered:
            assert list(s_dec.keys()) == list(s_orig.keys()), s_orig._key
        else:
            assert sorted(s_dec.keys()) == sorted(s_orig.keys()), s_orig._key
        for key in s_orig.keys():
            assert_same_value(s_orig[key], s_dec[key], f"{s_orig._key}.{key}")
    if isinstance(original, HeteroData):
        assert decoded.node_types == original.node_types
        assert decoded.edge_types == original.edge_types
        for node_type in original.node_types:
            assert decoded[node_type].num_nodes == original[node_type].num_nodes
    else:
        assert decoded.num_nodes == original.num_nodes


def schema_of(buf: bytes) -> dict:
    """The JSON schema, read with the safetensors header layout (no shardflow code)."""
    header_len = int.from_bytes(buf[:8], "little")
    header = json.loads(buf[8 : 8 + header_len])
    return json.loads(header["__metadata__"][SCHEMA_KEY])


def c12_data() -> Data:
    torch.manual_seed(12)
    return Data(
        x=torch.randn(5, 3, dtype=torch.float32),
        edge_index=torch.tensor([[0, 1, 1, 2, 3, 4, 4, 0], [1, 0, 2, 1, 4, 3, 0, 4]]),
        edge_attr=torch.randn(8, 2).to(torch.float16),
        y=torch.tensor([1], dtype=torch.int64),
        pos=torch.randn(5, 3, dtype=torch.float64),
        name="mol-001",
        n_rings=2,
    )


def c12_hetero() -> HeteroData:
    torch.manual_seed(13)
    data = HeteroData()
    data["author"].x = torch.randn(1, 3)
    data["venue"].x = torch.randn(4, 3)
    data["author", "writes", "venue"].edge_index = torch.tensor([[0], [3]])
    return data


@pytest.fixture
def no_pickle(monkeypatch):
    """Make every unpickling entry point fail while the test runs."""

    def refuse(*args, **kwargs):
        raise AssertionError("pickle/torch.load was called")

    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "Unpickler", refuse)
    monkeypatch.setattr(torch, "load", refuse)


# --------------------------------------------------------------------------------------
# Case C12.


def test_c12_data_round_trip_through_a_file_without_pickle(tmp_path, no_pickle):
    original = c12_data()
    buf = encode_graph(original)
    path = tmp_path / "000000.pyg"
    path.write_bytes(buf)

    decoded = decode_graph(path.read_bytes())

    assert type(decoded) is Data
    assert_same_graph(original, decoded)
    assert decoded.x.dtype == torch.float32 and decoded.x.shape == (5, 3)
    assert decoded.edge_index.dtype == torch.int64 and decoded.edge_index.shape == (2, 8)
    assert decoded.edge_attr.dtype == torch.float16 and decoded.edge_attr.shape == (8, 2)
    assert decoded.y.dtype == torch.int64 and decoded.y.tolist() == [1]
    assert decoded.pos.dtype == torch.float64 and decoded.pos.shape == (5, 3)
    assert decoded.name == "mol-001" and type(decoded.name) is str
    assert decoded.n_rings == 2 and type(decoded.n_rings) is int
    assert decoded.num_nodes == 5


def test_c12_hetero_round_trip_without_pickle(no_pickle):
    original = c12_hetero()
    decoded = decode_graph(encode_graph(original))

    assert type(decoded) is HeteroData
    assert_same_graph(original, decoded)
    assert decoded.node_types == ["author", "venue"]
    assert decoded.edge_types == [("author", "writes", "venue")]
    assert decoded["author"].num_nodes == 1
    assert decoded["venue"].num_nodes == 4
    assert decoded["author", "writes", "venue"].edge_index.tolist() == [[0], [3]]
    assert decoded["venue"].x.shape == (4, 3) and decoded["venue"].x.dtype == torch.float32


@pytest.mark.parametrize("make", [c12_data, c12_hetero])
def test_c12_bytes_are_safetensors_not_pickle(make, tmp_path):
    original = make()
    buf = encode_graph(original)

    assert not buf.startswith(b"\x80")  # pickle protocol 2+ header
    assert b"PK\x03\x04" not in buf[:8]  # torch.save zip archive
    # The container is plain safetensors: the reference reader gets the same tensors.
    tensors = safetensors_torch.load(buf)
    path = tmp_path / "g.safetensors"
    path.write_bytes(buf)
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as handle:
        metadata = handle.metadata()
    schema = json.loads(metadata[SCHEMA_KEY])
    assert schema["kind"] == type(original).__name__
    for store in original.stores:
        for value in store.values():
            if isinstance(value, torch.Tensor):
                assert any(
                    t.dtype == value.dtype and t.shape == value.shape and torch.equal(t, value)
                    for t in tensors.values()
                )


def test_schema_records_types_num_nodes_and_rules():
    data_schema = schema_of(encode_graph(c12_data()))
    assert data_schema["kind"] == "Data" and data_schema["version"] == 1
    (store,) = data_schema["stores"]
    assert store["key"] is None and store["num_nodes"] == 5
    assert list(store["attrs"]) == ["x", "edge_index", "edge_attr", "y", "pos", "name", "n_rings"]
    assert store["attrs"]["name"] == "mol-001" and store["attrs"]["n_rings"] == 2
    assert store["rules"]["edge_index"] == [-1, 5]  # cat along -1, increment by num_nodes
    assert store["rules"]["x"] == [0, 0]
    assert store["rules"]["n_rings"] == [0]
    assert "custom" not in store
    assert "name" not in store["rules"]

    hetero_schema = schema_of(encode_graph(c12_hetero()))
    assert hetero_schema["kind"] == "HeteroData"
    keys = [s["key"] for s in hetero_schema["stores"]]
    assert keys == [None, "author", "venue", ["author", "writes", "venue"]]
    by_key = {json.dumps(s["key"]): s for s in hetero_schema["stores"]}
    assert by_key['"author"']["num_nodes"] == 1
    assert by_key['"venue"']["num_nodes"] == 4
    edge_rules = by_key['["author", "writes", "venue"]']["rules"]["edge_index"]
    assert edge_rules == [-1, {"tensor_value": ["int64", [2, 1], [1, 4]]}]


def test_decoding_never_unpickles_even_bad_bytes(no_pickle):
    buf = encode_graph(c12_data())
    decode_graph(buf)
    with pytest.raises(DecodeError):
        decode_graph(buf[:-5])


# --------------------------------------------------------------------------------------
# Tensors: dtypes, shapes, views.


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(), (0,), (1,), (7,), (3, 0, 2), (2, 3, 4)], ids=str)
def test_every_dtype_and_shape_round_trips_bitwise(dtype, shape):
    torch.manual_seed(0)
    raw = torch.randint(0, 256, (math.prod(shape) * dtype.itemsize,), dtype=torch.uint8)
    if dtype == torch.bool:
        value = (raw[: math.prod(shape)] % 2).to(torch.bool).reshape(shape)
    else:
        value = raw.view(dtype).reshape(shape)  # arbitrary bit patterns, NaNs included
    original = Data(value=value, num_nodes=3)

    decoded = decode_graph(encode_graph(original))

    assert_same_tensor(original.value, decoded.value)


def test_decoded_tensors_are_writable_and_independent_of_the_buffer():
    buf = bytearray(encode_graph(c12_data()))
    decoded = decode_graph(buf)
    before = decoded.x.clone()
    buf[-100:] = bytes(100)  # scribbling over the input leaves the graph alone
    assert torch.equal(decoded.x, before)
    decoded.x.add_(1)  # no read-only warning or error
    assert torch.equal(decoded.x, before + 1)


def test_non_contiguous_and_shared_tensors():
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    original = Data(
        x=base.t(),  # strided view
        x_again=base.t(),  # another view of the same storage
        cols=base[:, 1::2],  # non-contiguous slice
        same=base,
        same_object=base,  # one tensor under two names
        num_nodes=6,
    )
    decoded = decode_graph(encode_graph(original))
    assert_same_graph(original, decoded)
    assert decoded.same.data_ptr() != decoded.same_object.data_ptr()


class _ListDataset(InMemoryDataset):
    """A real InMemoryDataset over a list, collated in memory (no files)."""

    def __init__(self, data_list):
        super().__init__(root=None)
        self.data, self.slices = self.collate(data_list)


def test_views_from_an_in_memory_dataset_are_stored_by_their_own_elements():
    torch.manual_seed(1)
    data_list = [
        Data(
            x=torch.randn(50, 16),
            edge_index=torch.randint(0, 50, (2, 200)),
            edge_attr=torch.randn(200, 4),
            y=torch.tensor([i]),
        )
        for i in range(200)
    ]
    dataset = _ListDataset(data_list)
    item = dataset[57]
    assert item.x.untyped_storage().nbytes() > 100 * item.x.numel() * 4  # really a view

    buf = encode_graph(item)

    own_bytes = sum(t.numel() * t.element_size() for t in item.to_dict().values())
    assert own_bytes < len(buf) < own_bytes + 2048
    # Byte-identical to the encoding of a compact copy: only the graph's own elements.
    assert buf == encode_graph(data_list[57])
    assert_same_graph(data_list[57], decode_graph(buf))


# --------------------------------------------------------------------------------------
# Non-tensor attributes and special tensors.


def test_non_tensor_attributes_round_trip_exactly():
    original = Data(
        x=torch.ones(2, 1),
        name="graph-é✓",
        empty="",
        count=-(2**70),
        ratio=0.1,
        neg_zero=-0.0,
        inf=float("inf"),
        nan=float("nan"),
        flag=True,
        tags=["a", "b", None, 3, 2.5, False],
        pair=(1, "two"),
        meta={"source": "zinc", "ids": [1, 2], "nested": {"deep": None}},
        feats={"a": torch.arange(3), "b": [torch.ones(2, 2), torch.zeros(0)]},
        array=np.arange(6, dtype=np.int16).reshape(2, 3),
        float_array=np.linspace(0, 1, 5),
    )
    decoded = decode_graph(encode_graph(original))
    assert_same_graph(original, decoded)


def test_edge_index_and_index_keep_their_metadata():
    original = Data(
        edge_index=EdgeIndex(
            [[0, 1, 1, 2], [1, 0, 2, 1]], sparse_size=(3, 3), sort_order="row", is_undirected=True
        ),
        cluster=Index([0, 0, 1, 2], dim_size=3, is_sorted=True),
    )
    decoded = decode_graph(encode_graph(original))
    assert_same_graph(original, decoded)


def test_graph_without_x_keeps_num_nodes():
    explicit = Data(edge_index=torch.tensor([[0, 1], [1, 0]]), num_nodes=10)  # 8 isolated nodes
    decoded = decode_graph(encode_graph(explicit))
    assert decoded.num_nodes == 10 and "x" not in decoded
    assert list(decoded._store.keys()) == ["edge_index", "num_nodes"]

    inferred = Data(edge_index=torch.tensor([[0, 3], [3, 0]]))  # PyG infers 4 from edge_index
    buf = encode_graph(inferred)
    assert schema_of(buf)["stores"][0]["num_nodes"] == 4
    decoded = decode_graph(buf)
    assert list(decoded._store.keys()) == ["edge_index"]  # no key added: batches stay identical
    with pytest.warns(UserWarning):
        assert decoded.num_nodes == 4


def test_graph_with_zero_edges_and_zero_nodes():
    no_edges = Data(x=torch.randn(3, 2), edge_index=torch.empty(2, 0, dtype=torch.long))
    decoded = decode_graph(encode_graph(no_edges))
    assert_same_graph(no_edges, decoded)
    assert decoded.edge_index.shape == (2, 0) and decoded.num_nodes == 3

    empty = Data(x=torch.empty(0, 4), edge_index=torch.empty(2, 0, dtype=torch.long))
    assert_same_graph(empty, decode_graph(encode_graph(empty)))
    assert_same_graph(Data(), decode_graph(encode_graph(Data())))
    assert_same_graph(HeteroData(), decode_graph(encode_graph(HeteroData())))


def test_hetero_global_attributes_empty_types_and_num_nodes_per_type():
    original = HeteroData()
    original.name = "citations"
    original["paper"].x = torch.randn(3, 2)
    original["paper"].year = torch.tensor([2001, 2002, 2003])
    original["author"].num_nodes = 5  # a node type without features
    original["topic"]  # an empty node type
    original["author", "writes", "paper"].edge_index = torch.tensor([[0, 4], [2, 1]])
    original["author", "writes", "paper"].edge_attr = torch.randn(2, 1, dtype=torch.float64)
    original["paper", "cites", "paper"].edge_index = torch.empty(2, 0, dtype=torch.long)

    buf = encode_graph(original)
    decoded = decode_graph(buf)

    assert_same_graph(original, decoded)
    assert decoded.name == "citations"
    assert decoded["author"].num_nodes == 5
    nums = {json.dumps(s["key"]): s.get("num_nodes") for s in schema_of(buf)["stores"]}
    assert nums['"paper"'] == 3 and nums['"author"'] == 5 and nums['"topic"'] is None


def test_encoding_is_deterministic():
    assert encode_graph(c12_data()) == encode_graph(c12_data())
    assert encode_graph(c12_hetero()) == encode_graph(c12_hetero())


# --------------------------------------------------------------------------------------
# Subclasses and stored rules.


class FaceData(Data):
    """Custom batching: face and my_index move by twice the node count, gid is stacked."""

    def __inc__(self, key, value, *args, **kwargs):
        if key in ("face", "my_index"):
            return self.num_nodes * 2
        if key == "pair":
            return torch.tensor([[self.num_nodes], [1]])
        return super().__inc__(key, value, *args, **kwargs)

    def __cat_dim__(self, key, value, *args, **kwargs):
        if key == "gid":
            return None
        return super().__cat_dim__(key, value, *args, **kwargs)


def face_data(num_nodes: int = 4) -> FaceData:
    return FaceData(
        x=torch.randn(num_nodes, 2),
        edge_index=torch.tensor([[0, 1], [1, 0]]),
        face=torch.tensor([[0], [1], [2]]),
        my_index=torch.tensor([0, 1]),
        pair=torch.tensor([[0, 1], [1, 0]]),
        gid=torch.tensor([7, 8]),
    )


def test_subclass_rules_are_stored_and_answered_by_the_decoded_graph():
    original = face_data(4)
    buf = encode_graph(original)
    schema = schema_of(buf)
    assert schema["class"].endswith("FaceData")
    (store_schema,) = schema["stores"]
    rules, custom = store_schema["rules"], store_schema["custom"]
    assert rules["face"] == [-1, 8] and rules["edge_index"] == [-1, 4] and rules["gid"] == [None, 0]
    # Only the rules that differ from Data's defaults are custom.
    assert custom == {
        "face": [-1, 8],
        "my_index": [-1, 8],
        "pair": [0, {"tensor_value": ["int64", [2, 1], [4, 1]]}],
        "gid": [None, 0],
    }

    decoded = decode_graph(buf)

    assert isinstance(decoded, Data) and type(decoded).__name__ == "StoredRulesData"
    store = decoded._store
    for key in ("x", "edge_index", "face", "my_index", "pair", "gid"):
        value = decoded[key]
        assert decoded.__cat_dim__(key, value, store) == original.__cat_dim__(key, value, store)
        inc, want = decoded.__inc__(key, value, store), original.__inc__(key, value, store)
        if isinstance(want, torch.Tensor):
            assert_same_tensor(want, inc)
        else:
            assert type(inc) is type(want) and inc == want
    assert list(decoded._store.keys()) == list(original._store.keys())  # rules are not attributes
    assert set(stored_rules(decoded)) == {(None, k) for k in ("face", "my_index", "pair", "gid")}


def test_stored_rules_survive_copy_pickle_and_re_encoding():
    decoded = decode_graph(encode_graph(face_data(3)))
    for clone in (copy.copy(decoded), copy.deepcopy(decoded), decoded.clone(),
                  pickle.loads(pickle.dumps(decoded)), decoded.to("cpu")):  # fmt: skip
        assert type(clone) is type(decoded)
        assert clone.__inc__("face", clone.face) == 6
        assert clone.__cat_dim__("gid", clone.gid) is None
    again = stored_rules(decode_graph(encode_graph(decoded)))
    assert list(again) == list(stored_rules(decoded))
    for key, (cat_dim, inc) in stored_rules(decoded).items():
        assert again[key][0] == cat_dim
        assert_same_value(inc, again[key][1], str(key))


def test_subclass_with_default_rules_decodes_as_plain_data():
    class Tagged(Data):
        pass

    original = Tagged(x=torch.randn(3, 2), edge_index=torch.tensor([[0], [2]]))
    decoded = decode_graph(encode_graph(original))
    assert type(decoded) is Data
    assert_same_graph(original, decoded)


def test_lazy_imports_and_rule_classes_by_name_in_a_fresh_interpreter():
    code = (
        "import sys, shardflow.graph as g, shardflow.graph.codec as c\n"
        "assert 'torch_geometric' not in sys.modules and 'safetensors' not in sys.modules\n"
        "assert g.is_graph({'x': 1}) is False\n"
        "cls = c.StoredRulesData  # what pickle looks up in a DataLoader worker\n"
        "assert cls.__module__ == 'shardflow.graph.codec' and cls.__qualname__ == 'StoredRulesData'\n"
        "assert c.StoredRulesHeteroData.__name__ == 'StoredRulesHeteroData'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# --------------------------------------------------------------------------------------
# Errors.


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
def test_sparse_tensors_are_refused_naming_the_attribute():
    sparse = torch.eye(3).to_sparse()
    with pytest.raises(SampleError, match="adj.*sparse"):
        encode_graph(Data(x=torch.ones(3, 1), adj=sparse))
    hetero = HeteroData()
    hetero["paper"].adj = torch.eye(2).to_sparse_csr()
    with pytest.raises(ValueError, match=r"data\['paper'\]\.adj"):
        encode_graph(hetero)


@pytest.mark.parametrize(
    ("value", "match"),
    [
        (object(), "blob.*builtins.object"),
        ({1: "one"}, "blob.*str keys"),
        (torch.zeros(2, dtype=torch.complex128), "blob.*complex128"),
        (np.array(["a", "b"]), "blob.*numpy"),
        (np.float64(1.5), "blob.*numpy.float64"),
        ([1, {"k": object()}], r"blob\[1\]\['k'\]"),
    ],
    ids=["object", "int-keys", "complex128", "str-array", "numpy-scalar", "nested"],
)
def test_values_that_would_need_pickle_are_refused(value, match):
    with pytest.raises(SampleError, match=match) as info:
        encode_graph(Data(x=torch.ones(2, 1), blob=value))
    assert isinstance(info.value, ValueError) and isinstance(info.value, ShardflowError)


def test_non_graphs_are_refused():
    from torch_geometric.data import TemporalData

    with pytest.raises(SampleError, match="expected a torch_geometric"):
        encode_graph({"x": torch.ones(1)})
    with pytest.raises(SampleError, match="TemporalData"):
        encode_graph(TemporalData(src=torch.tensor([0]), dst=torch.tensor([1])))


def test_batching_rules_that_cannot_be_stored_are_refused():
    class TupleDim(Data):
        def __cat_dim__(self, key, value, *args, **kwargs):
            return (0, 1)

    class TextInc(Data):
        def __inc__(self, key, value, *args, **kwargs):
            return "one"

    class SizeInc(Data):
        def __inc__(self, key, value, *args, **kwargs):
            return value.numel() if key == "k" else super().__inc__(key, value, *args, **kwargs)

    with pytest.raises(SampleError, match="__cat_dim__ returned"):
        encode_graph(TupleDim(x=torch.ones(2, 1)))
    with pytest.raises(SampleError, match="__inc__ returned a builtins.str"):
        encode_graph(TextInc(x=torch.ones(2, 1)))
    with pytest.raises(SampleError, match="'k'.*two different"):
        encode_graph(SizeInc(x=torch.ones(2, 1), k=torch.ones(1), d={"k": torch.ones(2)}))


def test_a_rule_that_cannot_be_computed_is_left_to_batching_time():
    class FixedInc(Data):
        def __inc__(self, key, value, *args, **kwargs):
            return 5 if key == "fixed_index" else super().__inc__(key, value, *args, **kwargs)

    # No way to infer num_nodes: Data's own rule for 'my_index' fails, as PyG's batching would.
    original = FixedInc(my_index=torch.tensor([0, 1]), fixed_index=torch.tensor([1]))
    store = schema_of(encode_graph(original))["stores"][0]
    assert "my_index" not in store["rules"] and "my_index" not in store.get("custom", {})
    assert store["custom"] == {"fixed_index": [-1, 5]}  # the default fails: stored as custom
    decoded = decode_graph(encode_graph(original))
    assert decoded.__inc__("fixed_index", decoded.fixed_index) == 5


def _valid_safetensors_without_schema() -> bytes:
    return safetensors_torch.save({"x": torch.ones(2)})


def _one_store(kind: str = "Data", **store) -> dict:
    """A schema with one store (null key unless given), for hand-made bad inputs."""
    return {"version": 1, "kind": kind, "stores": [{"key": None, "attrs": {}, "rules": {}, **store}]}


def _with_schema(schema: dict) -> bytes:
    return safetensors_torch.save({"0": torch.ones(2)}, metadata={SCHEMA_KEY: json.dumps(schema)})


@pytest.mark.parametrize(
    "buf",
    [
        b"",
        b"\x80\x04K\x01.",  # a pickle
        b"garbage that is not a graph",
        (10**9).to_bytes(8, "little") + b"{}",
        (2).to_bytes(8, "little") + b"[]",
        _valid_safetensors_without_schema(),
        _with_schema({"version": 99, "kind": "Data", "stores": []}),
        _with_schema({"version": 1, "kind": "Tree", "stores": []}),
        _with_schema({"version": 1, "kind": "Data", "stores": []}),
        _with_schema(_one_store(attrs={"x": {"tensor": "9"}})),
        _with_schema(_one_store(attrs={"x": {"weird": 1}})),
        _with_schema(_one_store("HeteroData", key=[1, 2])),
        "not bytes",
    ],
    ids=lambda b: repr(b)[:40],
)  # fmt: skip
def test_bad_bytes_raise_decode_error(buf):
    with pytest.raises(DecodeError):
        decode_graph(buf)


def test_corrupt_tensor_table_raises_decode_error():
    buf = encode_graph(c12_data())
    header_len = int.from_bytes(buf[:8], "little")
    header = json.loads(buf[8 : 8 + header_len])
    first = next(k for k in header if k != "__metadata__")
    for field, bad in [("dtype", "F128"), ("shape", [-1, 3]), ("data_offsets", [0, 10**9]),
                       ("shape", [10**6]), ("shape", "5")]:  # fmt: skip
        broken = json.loads(json.dumps(header))
        broken[first][field] = bad
        text = json.dumps(broken).encode()
        text += b" " * (-len(text) % 8)
        with pytest.raises(DecodeError):
            decode_graph(len(text).to_bytes(8, "little") + text + buf[8 + header_len :])
    with pytest.raises(DecodeError, match="trailing"):
        decode_graph(buf + b"\x00" * 8)


def _hand_made(header: dict, data: bytes) -> bytes:
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)  # safetensors pads its header with spaces
    return len(text).to_bytes(8, "little") + text + data


def test_other_safetensors_writers_layouts_and_buffer_types():
    schema = _one_store(attrs={"flag": {"tensor": "a"}, "x": {"tensor": "b"}})
    values = torch.tensor([1.5, -2.0], dtype=torch.float32)
    buf = _hand_made(
        {
            "__metadata__": {SCHEMA_KEY: json.dumps(schema)},
            "a": {"dtype": "U8", "shape": [3], "data_offsets": [0, 3]},
            "b": {"dtype": "F32", "shape": [2], "data_offsets": [3, 11]},  # misaligned
        },
        bytes([1, 2, 3]) + values.numpy().tobytes(),
    )
    for form in (buf, bytearray(buf), memoryview(buf), np.frombuffer(buf, dtype=np.uint8)):
        decoded = decode_graph(form)
        assert decoded.flag.tolist() == [1, 2, 3]
        assert_same_tensor(decoded.x, values)
    assert len(buf) % 2 == 1
    wide = memoryview(np.frombuffer(buf + b"\x00", dtype=np.uint16))
    with pytest.raises(DecodeError, match="trailing"):
        decode_graph(wide)  # cast to bytes, then the padding byte is trailing data


@pytest.mark.parametrize(
    "schema",
    [
        [1, 2],
        _one_store(attrs={"x": [1, 2]}),
        _one_store(custom={"a": [1, 2, 3]}),
        _one_store(custom={"a": ["x", 1]}),
        _one_store(custom={"a": [0, "x"]}),
    ],
    ids=["not-an-object", "raw-list-value", "long-rule", "bad-cat-dim", "bad-inc"],
)  # fmt: skip
def test_bad_schemas_raise_decode_error(schema):
    with pytest.raises(DecodeError):
        decode_graph(safetensors_torch.save({}, metadata={SCHEMA_KEY: json.dumps(schema)}))
    with pytest.raises(DecodeError, match="no 'shardflow.graph'"):
        decode_graph(safetensors_torch.save({}, metadata={"other": "1"}))


def test_misaligned_and_big_endian_tensor_bytes():
    values = torch.tensor([1.5, -2.0, 3.25], dtype=torch.float32)
    raw = values.view(torch.uint8).numpy().tobytes()
    assert torch.equal(_tensor_from_bytes(raw, torch.float32, "little"), values)
    swapped = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(-1, 4).flip(1)
    # A big-endian host sees the little-endian bytes reversed per element.
    big_host = _tensor_from_bytes(raw, torch.float32, "big").view(torch.uint8).view(-1, 4)
    assert torch.equal(big_host, swapped)


def test_missing_torch_geometric_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_geometric.data", None)
    with pytest.raises(ImportError, match=r"shardflow\[graphs\]") as info:
        decode_graph(b"anything")
    assert "decoding 'pyg' fields" in str(info.value)
    with pytest.raises(ImportError, match="torch_geometric"):
        encode_graph(Data())


def test_is_graph():
    assert is_graph(Data())
    assert is_graph(HeteroData())
    assert is_graph(Batch.from_data_list([Data(x=torch.ones(1, 1))]))
    assert not is_graph({"x": torch.ones(1)})
    assert not is_graph(torch.ones(1))
    assert not is_graph(None)


# --------------------------------------------------------------------------------------
# Properties.

_dtypes = st.sampled_from(DTYPES)
_names = st.text(alphabet="abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=8).filter(
    lambda s: s not in {"num_nodes", "x", "edge_index"}
)
_json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**80), 2**80),
    st.floats(allow_nan=True),
    st.text(max_size=10),
)
_json_values = st.recursive(
    _json_scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=8,
)


@st.composite
def random_tensors(draw):
    dtype = draw(_dtypes)
    shape = tuple(draw(st.lists(st.integers(0, 4), max_size=3)))
    numel = math.prod(shape)
    raw = draw(st.binary(min_size=numel * dtype.itemsize, max_size=numel * dtype.itemsize))
    if dtype == torch.bool:
        return torch.tensor([b % 2 == 1 for b in raw[:numel]], dtype=torch.bool).reshape(shape)
    if not raw:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape)


@st.composite
def random_graphs(draw):
    num_nodes = draw(st.integers(0, 6))
    num_edges = draw(st.integers(0, 10)) if num_nodes else 0
    graph = Data()
    if draw(st.booleans()):
        graph.x = torch.randn(num_nodes, draw(st.integers(0, 3)))
    else:
        graph.num_nodes = num_nodes
    graph.edge_index = torch.randint(0, max(num_nodes, 1), (2, num_edges))
    for name in draw(st.lists(_names, max_size=4, unique=True)):
        graph[name] = draw(st.one_of(random_tensors(), _json_values.filter(lambda v: v is not None)))
    return graph


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_graphs())
def test_random_graphs_round_trip_exactly(graph):
    buf = encode_graph(graph)
    assert buf == encode_graph(graph)
    assert_same_graph(graph, decode_graph(buf))


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_damaged_bytes_decode_or_raise_decode_error(data):
    buf = bytearray(encode_graph(c12_data()))
    cut = data.draw(st.integers(0, len(buf)))
    position = data.draw(st.integers(0, len(buf) - 1))
    damaged = bytearray(buf)
    damaged[position] ^= data.draw(st.integers(1, 255))
    for candidate in (bytes(buf[:cut]), bytes(damaged)):
        try:
            graph = decode_graph(candidate)
        except DecodeError:
            continue
        assert isinstance(graph, Data)  # a flipped bit in tensor data still decodes
