"""What graphs batched together must share, and naming the samples whose graphs differ."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from . import is_graph

__all__ = ["describe_mismatch", "describe_sample", "graph_structure"]


def graph_structure(graph: Any, exclude: Iterable[str] = ()) -> tuple[Any, ...]:
    """What graphs batched together must share, as a hashable value.

    The graph's class, its stores (node and edge types) and, per attribute not in
    ``exclude``, its kind, dtype and shape with the concatenation dimension (the
    one that grows with the node or edge count) replaced by -1. Two graphs that
    ``Batch.from_data_list`` can batch have equal structures, apart from
    attributes that PyG stacks or lists.
    """
    import torch

    skip = frozenset(exclude)
    stores = []
    for store in graph.stores:
        attrs = []
        for name, value in store.items():
            if name in skip:
                continue
            if isinstance(value, torch.Tensor):
                try:
                    cat_dim = graph.__cat_dim__(name, value, store)
                except Exception:  # noqa: BLE001 - PyG fails the same way when batching; the shape says enough
                    cat_dim = None
                shape = list(value.shape)
                if type(cat_dim) is int and shape:
                    shape[cat_dim % len(shape)] = -1
                attrs.append((name, "tensor", str(value.dtype), tuple(shape)))
            else:
                attrs.append((name, type(value).__name__))
        stores.append((repr(getattr(store, "_key", None)), tuple(sorted(attrs))))
    return type(graph), tuple(sorted(stores))


def describe_sample(samples: Sequence[Any], index: int, position: str) -> str:
    """``sample 'key' (<position>, shard <url>)``."""
    sample = samples[index]
    if not isinstance(sample, Mapping):
        return f"sample #{index} ({position})"
    url = sample.get("__url__")
    where = f"{position}, shard {url}" if url else position
    return f"sample {sample.get('__key__', f'#{index}')!r} ({where})"


def describe_mismatch(samples: Sequence[Any], graphs: list[Any], exclude: frozenset[str]) -> str:
    """Name the samples at fault: the first whose graph differs from the first one's,
    or else every sample of the batch (the first eight)."""
    try:
        ref = graph_structure(graphs[0], exclude)
        for i in range(1, len(graphs)):
            if not is_graph(graphs[i]) or graph_structure(graphs[i], exclude) != ref:
                return (
                    f"{describe_sample(samples, i, f'graph {i} of the batch')} against "
                    f"{describe_sample(samples, 0, 'graph 0')}"
                )
    except Exception:  # noqa: BLE001 - only describing an error already raised
        pass
    names = [
        str(s.get("__key__", f"#{i}")) if isinstance(s, Mapping) else f"#{i}" for i, s in enumerate(samples[:8])
    ]
    more = f" and {len(samples) - 8} more" if len(samples) > 8 else ""
    return f"the batch of samples {names}{more}"
