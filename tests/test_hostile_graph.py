"""Graph attributes that size an allocation (issue 25, case d): an ``EdgeIndex``'s ``sparse_size``
and an ``Index``'s ``dim_size`` are checked against the graph limits at decode, so a 390-byte
graph cannot become gigabytes at collate.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from shardflow import DecodeOptions, ShardDataset
from shardflow.errors import DecodeError
from shardflow.format.tar import END_OF_ARCHIVE, encode_sample

from .test_hostile import MiB, peak_rss

torch = pytest.importorskip("torch")
pyg = pytest.importorskip("torch_geometric")
pytestmark = pytest.mark.timeout(120)


def _edge_index(n: int | None, nodes: int = 2):
    return pyg.EdgeIndex(torch.tensor([[0, 1], [1, 0]]), sparse_size=(n, n) if n is not None else None)


def _shard(tmp_path: Path, bad) -> Path:
    """Four graphs, the second one ``bad``."""
    from shardflow.graph import encode_graph

    parts = []
    for i in range(4):
        graph = bad if i == 1 else pyg.data.Data(edge_index=_edge_index(2), x=torch.zeros(2, 1))
        parts.append(encode_sample(f"{i:06d}", {"pyg": encode_graph(graph)}))
    path = tmp_path / "graphs.tar"
    path.write_bytes(b"".join(parts) + END_OF_ARCHIVE)
    return path


def _keys(ds) -> list[str]:
    return [s["__key__"] for s in ds]


def test_a_huge_sparse_size_is_a_decode_error(tmp_path: Path) -> None:
    path = _shard(tmp_path, pyg.data.Data(edge_index=_edge_index(1 << 25)))
    raw = list(ShardDataset(path, decode=None))[1]["pyg"]
    assert len(raw) < 600
    said = r"edge_index: sparse_size 33554432 is over the limit of 16777216 \(DecodeOptions.max_graph_nodes\)"
    with pytest.raises(DecodeError, match=said):
        _keys(ShardDataset(path))
    ds = ShardDataset(path, on_error="skip")
    assert _keys(ds) == ["000000", "000002", "000003"] and ds.stats["decode"] == 1
    got = peak_rss(f"""
        ds = shardflow.ShardDataset({str(path)!r}, on_error="skip")
        result["nodes"] = [int(b["pyg"].num_nodes) for b in shardflow.loader(ds, batch_size=4)]
        result["stats"] = dict(ds.stats)
    """)
    assert got["nodes"] == [6] and got["stats"]["decode"] == 1, got
    assert got["peak"] < 64 * MiB, got["peak"] / MiB  # bound: 64 MiB (it was 2.4 GB at collate)


def test_a_sparse_size_past_the_declared_nodes_is_named(tmp_path: Path) -> None:
    bad = pyg.data.Data(edge_index=_edge_index(1000), x=torch.zeros(2, 1))
    with pytest.raises(DecodeError, match=r"edge_index: sparse_size 1000 is more than the graph's 2 nodes"):
        _keys(ShardDataset(_shard(tmp_path, bad)))


def test_a_huge_index_dim_size_is_a_decode_error(tmp_path: Path) -> None:
    bad = pyg.data.Data(edge_index=_edge_index(2), x=torch.zeros(2, 1),
                        idx=pyg.Index(torch.tensor([0, 1]), dim_size=1 << 40))
    with pytest.raises(DecodeError, match=r"idx: dim_size 1099511627776 is over the limit of 16777216"):
        _keys(ShardDataset(_shard(tmp_path, bad)))
    low = DecodeOptions(max_graph_nodes=1)
    with pytest.raises(DecodeError, match=r"over the limit of 1 \(DecodeOptions.max_graph_nodes\)"):
        _keys(ShardDataset(_shard(tmp_path, pyg.data.Data(edge_index=_edge_index(None))), decode=low))


def test_sound_sizes_decode_like_the_original(tmp_path: Path) -> None:
    good = pyg.data.Data(edge_index=_edge_index(2), x=torch.zeros(2, 1), idx=pyg.Index(torch.tensor([0, 1]), dim_size=5))
    got = [s["pyg"] for s in ShardDataset(_shard(tmp_path, good))]
    assert got[1].edge_index.sparse_size() == (2, 2) and got[1].idx.dim_size == 5
    batch = pyg.data.Batch.from_data_list(got)
    assert batch.num_nodes == 8
