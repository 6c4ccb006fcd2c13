"""Bounds on the graphs a ``pyg`` field may declare or imply.

A graph's bytes are untrusted: a 278-byte field whose ``edge_index`` holds the
node id 1e8 makes PyG infer 1e8 nodes (gigabytes at collate time), and 2**62
overflows the batch increments. Every decoded graph is checked here before it
is returned: node counts (declared ``num_nodes``, or implied by the largest id
in an ``edge_index``) and edge counts within the limits, ids non-negative and
below the node count of their store, and every declared size that PyG allocates by
(an ``EdgeIndex``'s ``sparse_size``, an ``Index``'s ``dim_size``: a 390-byte graph
whose ``sparse_size`` says 2**25 was 2.4 GB at collate) within the node limit and,
where the store declares its nodes, within them.
"""

from __future__ import annotations

from typing import Any

import torch

from shardflow.compat.pyg import store_attributes
from shardflow.format.limits import MAX_GRAPH_EDGES, MAX_GRAPH_NODES

__all__ = ["check_graph"]

NODE_LEVEL = ("x", "pos", "batch", "node_attr")  # attributes whose first dimension counts nodes


def _declared_nodes(mapping: dict, where: str, max_nodes: int) -> int | None:
    """The node count a store declares (``num_nodes``, else rows of ``x``/``pos``), checked."""
    value = mapping.get("num_nodes")
    if value is not None:
        if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_floating_point():
            value = int(value)
        if type(value) is not int or value < 0:
            raise ValueError(f"{where}: num_nodes is {value!r}, not a count")
        if value > max_nodes:
            raise ValueError(
                f"{where}: num_nodes {value} is over the limit of {max_nodes} (DecodeOptions.max_graph_nodes)"
            )
        return value
    for name in NODE_LEVEL:
        tensor = mapping.get(name)
        if isinstance(tensor, torch.Tensor) and tensor.dim() >= 1:
            rows = int(tensor.shape[0])
            if rows > max_nodes:
                raise ValueError(
                    f"{where}: {name} has {rows} rows (nodes), over the limit of {max_nodes} "
                    "(DecodeOptions.max_graph_nodes)"
                )
            return rows
    return None


def _check_ids(ids: torch.Tensor, nodes: int | None, where: str, max_nodes: int) -> None:
    """Ids of one side of an ``edge_index`` row: >= 0 and below the node count (or the limit)."""
    if ids.numel() == 0:
        return
    low, high = int(ids.min()), int(ids.max())
    if low < 0:
        raise ValueError(f"{where} holds the negative node id {low}")
    if nodes is not None and high >= nodes:
        raise ValueError(f"{where} holds the node id {high}, but the graph has {nodes} nodes")
    if high >= max_nodes:
        raise ValueError(
            f"{where} holds the node id {high}: it implies {high + 1} nodes, over the limit of {max_nodes} "
            "(DecodeOptions.max_graph_nodes)"
        )


def _check_edges(value: Any, src: int | None, dst: int | None, where: str, max_nodes: int, max_edges: int) -> None:
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{where} is a {type(value).__name__}, not a tensor")
    if value.is_floating_point() or value.is_complex() or value.dtype == torch.bool:
        raise ValueError(f"{where} has dtype {value.dtype}, not an integer dtype")
    if value.dim() != 2 or value.shape[0] != 2:
        raise ValueError(f"{where} has shape {tuple(value.shape)}, expected (2, num_edges)")
    if value.shape[1] > max_edges:
        raise ValueError(
            f"{where} holds {value.shape[1]} edges, over the limit of {max_edges} (DecodeOptions.max_graph_edges)"
        )
    plain = value.as_subclass(torch.Tensor)
    _check_ids(plain[0], src, f"{where}[0]", max_nodes)
    _check_ids(plain[1], dst, f"{where}[1]", max_nodes)


def check_graph(graph: Any, *, max_nodes: int = MAX_GRAPH_NODES, max_edges: int = MAX_GRAPH_EDGES) -> None:
    """Check a decoded ``Data`` / ``HeteroData`` against the graph limits.

    Args:
        graph: a ``torch_geometric`` ``Data`` or ``HeteroData``.
        max_nodes: the most nodes a store (a ``Data``, a node type) may declare
            or imply through an ``edge_index`` id.
        max_edges: the most edges (columns) an ``edge_index`` may hold.

    Raises:
        ValueError: a count over a limit, a negative or out-of-range node id, an
            ``edge_index`` that is not an integer tensor of shape (2, E). The
            message names the attribute (``edge_index``, ``('a', 'to', 'b').edge_index``)
            and the option to raise.
    """
    stores = list(graph.stores)
    nodes: dict[Any, int | None] = {}
    for store in stores:
        key = getattr(store, "_key", None)
        if key is None or isinstance(key, str):
            where = "graph" if key is None else f"node type {key!r}"
            nodes[key] = _declared_nodes(store_attributes(store), where, max_nodes)
    for store in stores:
        key = getattr(store, "_key", None)
        value = store_attributes(store).get("edge_index")
        if value is None:
            continue
        if isinstance(key, tuple):
            src, dst = nodes.get(key[0]), nodes.get(key[2])
            where = f"{key!r}.edge_index"
        else:
            src = dst = nodes.get(None)
            where = "edge_index"
        _check_edges(value, src, dst, where, max_nodes, max_edges)
    for store in stores:
        key = getattr(store, "_key", None)
        if isinstance(key, tuple):
            sides = (nodes.get(key[0]), nodes.get(key[2]))
            prefix = f"{key!r}."
        else:
            sides = (nodes.get(key),) * 2
            prefix = "" if key is None else f"{key!r}."
        for name, value in store_attributes(store).items():
            _check_sizes(value, f"{prefix}{name}", sides, max_nodes)


def _check_sizes(value: Any, where: str, nodes: tuple[int | None, int | None], max_nodes: int, depth: int = 0) -> None:
    """The sizes an ``EdgeIndex`` or ``Index`` declares (in lists and dicts too): counts of
    at most ``max_nodes``, and at most the store's nodes where it declares them."""
    if depth > 8:  # the schema's own nesting is bounded by its JSON; values deeper hold no sizes PyG uses
        return
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _check_sizes(item, f"{where}[{i}]", nodes, max_nodes, depth + 1)
        return
    if isinstance(value, dict):
        for k, item in value.items():
            _check_sizes(item, f"{where}[{k!r}]", nodes, max_nodes, depth + 1)
        return
    if not isinstance(value, torch.Tensor):
        return
    sparse = getattr(value, "sparse_size", None)
    if callable(sparse) and hasattr(value, "sort_order"):  # torch_geometric.EdgeIndex
        for side, size in enumerate(sparse()):
            _check_size(size, f"{where}: sparse_size", nodes[side], max_nodes)
    elif hasattr(value, "dim_size") and hasattr(value, "is_sorted"):  # torch_geometric.Index
        _check_size(value.dim_size, f"{where}: dim_size", None, max_nodes)


def _check_size(size: Any, where: str, nodes: int | None, max_nodes: int) -> None:
    if size is None:
        return
    if type(size) is not int or size < 0:
        raise ValueError(f"{where} {size!r} is not a count")
    if size > max_nodes:
        raise ValueError(f"{where} {size} is over the limit of {max_nodes} (DecodeOptions.max_graph_nodes)")
    if nodes is not None and size > nodes:
        raise ValueError(f"{where} {size} is more than the graph's {nodes} nodes")
