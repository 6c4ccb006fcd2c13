"""Graph statistics of a summary: nodes, edges and types per decoded graph, merged
over shards and reduced to ``min``/``mean``/``max``/``total``."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

__all__ = ["add_graph", "graph_record", "graph_summary", "merge_graphs", "missing_extra", "value_stats"]



def graph_record(graph: Any) -> dict[str, Any]:
    """Nodes, edges and types of one decoded graph."""
    rec: dict[str, Any] = {"nodes": int(graph.num_nodes or 0), "edges": int(graph.num_edges)}
    if hasattr(graph, "node_types") and hasattr(graph, "edge_types") and type(graph).__name__ == "HeteroData":
        rec["kind"] = "HeteroData"
        rec["node_types"] = {t: int(graph[t].num_nodes or 0) for t in graph.node_types}
        rec["edge_types"] = {"|".join(t): int(graph[t].num_edges) for t in graph.edge_types}
    else:
        rec["kind"] = type(graph).__name__
        attrs = {}
        for key in sorted(graph.keys()):
            value = graph[key]
            if hasattr(value, "dtype") and hasattr(value, "shape"):
                attrs[key] = f"{str(value.dtype).replace('torch.', '')} {list(value.shape)}"
            else:
                attrs[key] = type(value).__name__
        rec["attributes"] = attrs
    return rec


def add_graph(acc: dict[str, Any], rec: dict[str, Any]) -> None:
    acc.setdefault("nodes", []).append(rec["nodes"])
    acc.setdefault("edges", []).append(rec["edges"])
    acc.setdefault("kinds", Counter())[rec["kind"]] += 1
    for t, c in rec.get("node_types", {}).items():
        acc.setdefault("node_types", {}).setdefault(t, []).append(c)
    for t, c in rec.get("edge_types", {}).items():
        acc.setdefault("edge_types", {}).setdefault(t, []).append(c)
    if "attributes" in rec and "attributes" not in acc:
        acc["attributes"] = rec["attributes"]


def merge_graphs(into: dict[str, Any], acc: dict[str, Any]) -> None:
    into.setdefault("nodes", []).extend(acc.get("nodes", []))
    into.setdefault("edges", []).extend(acc.get("edges", []))
    into.setdefault("kinds", Counter()).update(acc.get("kinds", Counter()))
    into["errors"] = into.get("errors", 0) + acc.get("errors", 0)
    for part in ("node_types", "edge_types"):
        for t, values in acc.get(part, {}).items():
            into.setdefault(part, {}).setdefault(t, []).extend(values)
    if "attributes" in acc and "attributes" not in into:
        into["attributes"] = acc["attributes"]
    if acc.get("missing"):
        into["missing"] = acc["missing"]


def missing_extra(error: BaseException) -> str | None:
    """The message of the ImportError behind a decoding error (an optional package that is not
    installed: it names the extra), or None when none is behind it."""
    seen = set()
    e: BaseException | None = error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, ImportError):
            return str(e)
        e = e.__cause__ or e.__context__
    return None


def value_stats(values: Sequence[int]) -> dict[str, Any]:
    if not values:
        return {"min": 0, "mean": 0.0, "max": 0, "total": 0}
    total = int(sum(values))
    return {"min": int(min(values)), "mean": round(total / len(values), 3), "max": int(max(values)), "total": total}


def graph_summary(acc: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {
        "graphs": len(acc.get("nodes", [])),
        "kinds": dict(sorted(acc.get("kinds", Counter()).items())),
        "nodes": value_stats(acc.get("nodes", [])),
        "edges": value_stats(acc.get("edges", [])),
    }
    if acc.get("node_types"):
        out["node_types"] = {t: value_stats(v) for t, v in sorted(acc["node_types"].items())}
    if acc.get("edge_types"):
        out["edge_types"] = {t: value_stats(v) for t, v in sorted(acc["edge_types"].items())}
    if acc.get("attributes"):
        out["attributes"] = acc["attributes"]
    if acc.get("errors"):
        out["undecodable"] = acc["errors"]
    if acc.get("missing"):
        out["missing"] = acc["missing"]
    return out
