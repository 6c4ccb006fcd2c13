"""The graph schema a PyG conversion records in the manifest: attributes, dtypes, shapes, types."""

from __future__ import annotations

import json
import warnings
from typing import Any

__all__ = ["graph_schema", "merge_schemas"]


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def _variable_dims(graph: Any, store: Any, name: str, value: Any) -> set[int]:
    """Dimensions of a tensor that grow with the graph: its cat dim, when its size
    there is the store's node or edge count."""
    try:
        cat_dim = graph.__cat_dim__(name, value, store)
    except Exception:  # noqa: BLE001 - PyG would fail the same way when batching; no rule to report
        return set()
    if type(cat_dim) is not int or value.dim() == 0:
        return set()
    dim = cat_dim % value.dim()
    counts = set()
    for attr in ("num_nodes", "num_edges"):
        try:
            n = getattr(store, attr)
        except Exception:  # noqa: BLE001 - an edge store has no num_nodes, for example
            continue
        if type(n) is int:
            counts.add(n)
    return {dim} if value.shape[dim] in counts else set()


def _attr_schema(graph: Any, store: Any, name: str, value: Any) -> dict[str, Any]:
    import torch

    if isinstance(value, torch.Tensor):
        variable = _variable_dims(graph, store, name, value)
        shape = [None if d in variable else int(s) for d, s in enumerate(value.shape)]
        return {"dtype": _dtype_name(value.dtype), "shape": shape}
    if type(value).__name__ == "ndarray":
        return {"type": "ndarray", "dtype": str(value.dtype), "shape": list(value.shape)}
    return {"type": type(value).__name__}


def graph_schema(graph: Any) -> dict[str, Any]:
    """The schema of one graph: kind, attribute names, dtypes, shapes, node/edge types.

    Returns:
        ``{"kind": "Data" | "HeteroData", "class": "<module>.<qualname>",
        "stores": [{"key": null | "paper" | ["author", "writes", "paper"],
        "attrs": {name: {"dtype": "float32", "shape": [null, 32]} | {"type": "str"}}}]}``
        plus ``"node_types"`` and ``"edge_types"`` for ``HeteroData``. A shape
        entry is null where the size is the graph's node or edge count (the
        dimension along which graphs are concatenated).
    """
    from torch_geometric.data import HeteroData

    hetero = isinstance(graph, HeteroData)
    cls = type(graph)
    stores = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # num_nodes inference may warn
        for store in graph.stores:
            key = getattr(store, "_key", None)
            attrs = {str(n): _attr_schema(graph, store, n, v) for n, v in store.items()}
            stores.append({"key": list(key) if isinstance(key, tuple) else key, "attrs": attrs})
    out: dict[str, Any] = {
        "kind": "HeteroData" if hetero else "Data",
        "class": f"{cls.__module__}.{cls.__qualname__}",
        "stores": stores,
    }
    if hetero:
        out["node_types"] = list(graph.node_types)
        out["edge_types"] = [list(t) for t in graph.edge_types]
    return out


def _union(x: Any, y: Any) -> Any:
    """``x`` when equal, else the sorted distinct values of both (lists flattened)."""
    if x == y:
        return x
    values = sorted({str(v) for z in (x, y) if z is not None for v in (z if isinstance(z, list) else [z])})
    return values[0] if len(values) == 1 else values


def _merge_attr(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    out = dict(a)
    for k in ("dtype", "type"):
        if k in a or k in b:
            out[k] = _union(a.get(k), b.get(k))
    if "shape" in a or "shape" in b:
        sa, sb = a.get("shape"), b.get("shape")
        if sa is None or sb is None or len(sa) != len(sb):
            out["shape"] = None  # the number of dimensions varies
        else:
            out["shape"] = [x if x == y else None for x, y in zip(sa, sb)]
    if a.get("optional") or b.get("optional"):
        out["optional"] = True
    return out


def merge_schemas(a: dict[str, Any] | None, b: dict[str, Any]) -> dict[str, Any]:
    """Merge two graph schemas (of :func:`graph_schema`, or merged ones).

    Dimensions whose sizes differ become null; attributes and stores (node and
    edge types) present in only one get ``"optional": true``; differing kinds,
    classes, dtypes or types become sorted lists.
    """
    if a is None:
        return b
    out = {k: _union(a.get(k), b.get(k)) for k in ("kind", "class")}
    stores_a = {json.dumps(s["key"]): s for s in a["stores"]}
    stores_b = {json.dumps(s["key"]): s for s in b["stores"]}
    stores = []
    for k in dict.fromkeys([*stores_a, *stores_b]):
        sa, sb = stores_a.get(k), stores_b.get(k)
        if sa is None or sb is None:
            stores.append({**(sa or sb), "optional": True})  # type: ignore[dict-item]
            continue
        attrs = {}
        for name in dict.fromkeys([*sa["attrs"], *sb["attrs"]]):
            x, y = sa["attrs"].get(name), sb["attrs"].get(name)
            attrs[name] = {**(x or y), "optional": True} if x is None or y is None else _merge_attr(x, y)
        store: dict[str, Any] = {"key": sa["key"], "attrs": attrs}
        if sa.get("optional") or sb.get("optional"):
            store["optional"] = True
        stores.append(store)
    out["stores"] = stores
    if "node_types" in a or "node_types" in b:
        out["node_types"] = list(dict.fromkeys([*a.get("node_types", []), *b.get("node_types", [])]))
        edge_types = {json.dumps(t): t for t in [*a.get("edge_types", []), *b.get("edge_types", [])]}
        out["edge_types"] = list(edge_types.values())
    return out
