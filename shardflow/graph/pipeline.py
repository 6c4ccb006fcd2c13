"""Graph datasets end to end: shards from a PyG dataset, ``Batch`` objects out of the loader.

Migrating from an ``InMemoryDataset`` takes two lines::

    from shardflow.graph.pipeline import collate_fn, to_shards

    to_shards(MyInMemoryDataset(root), "shards/")            # once
    ds = shardflow.ShardDataset("shards/", shuffle=True)
    for batch in shardflow.loader(ds, batch_size=64, collate_fn=collate_fn(follow_batch=["x"])):
        batch["graph.pyg"]                                   # a torch_geometric Batch

The batches equal ``Batch.from_data_list`` on the original graphs (same
tensors, dtypes, ``batch``, ``ptr`` and increments). Without ``follow_batch`` or
``exclude_keys`` the loader's default collate already builds the ``Batch``;
:func:`collate_fn` adds those two options and error messages that name the
samples whose graphs cannot be batched together.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..collation import collate
from ..errors import SampleError
from ..format.manifest import Manifest
from . import collate_graphs, is_graph

__all__ = ["GraphCollate", "collate_fn", "graph_structure", "to_shards"]


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


def _describe(samples: Sequence[Any], index: int, position: str) -> str:
    """``sample 'key' (<position>, shard <url>)``."""
    sample = samples[index]
    if not isinstance(sample, Mapping):
        return f"sample #{index} ({position})"
    url = sample.get("__url__")
    where = f"{position}, shard {url}" if url else position
    return f"sample {sample.get('__key__', f'#{index}')!r} ({where})"


def _where(samples: Sequence[Any], graphs: list[Any], exclude: frozenset[str]) -> str:
    """Name the samples at fault: the first whose graph differs from the first one's,
    or else every sample of the batch (the first eight)."""
    try:
        ref = graph_structure(graphs[0], exclude)
        for i in range(1, len(graphs)):
            if not is_graph(graphs[i]) or graph_structure(graphs[i], exclude) != ref:
                return (
                    f"{_describe(samples, i, f'graph {i} of the batch')} against "
                    f"{_describe(samples, 0, 'graph 0')}"
                )
    except Exception:  # noqa: BLE001 - only describing an error already raised
        pass
    names = [
        str(s.get("__key__", f"#{i}")) if isinstance(s, Mapping) else f"#{i}" for i, s in enumerate(samples[:8])
    ]
    more = f" and {len(samples) - 8} more" if len(samples) > 8 else ""
    return f"the batch of samples {names}{more}"


@dataclass(frozen=True)
class GraphCollate:
    """A picklable ``collate_fn`` for :func:`shardflow.loader` over graph samples.

    Dict samples: every field whose values are graphs becomes one PyG ``Batch``
    (:func:`shardflow.graph.collate_graphs`, equal to ``Batch.from_data_list``
    with the same ``follow_batch`` / ``exclude_keys``); every other field is
    collated by :func:`shardflow.collation.collate` (numbers and equal-shape
    arrays stacked, strings such as ``__key__`` into lists). A list of graphs
    (samples that a ``transform`` turned into graphs) becomes one ``Batch``.

    Attributes:
        follow_batch: graph attributes that also get ``<attr>_batch`` (int64, the
            graph index of every element along the concatenation dimension) and
            ``<attr>_ptr`` (int64, ``num_graphs + 1`` offsets).
        exclude_keys: graph attributes left out of the batch.

    Raises (when called):
        SampleError: graphs of one batch differ in attributes, node or edge
            types, or cannot be concatenated; the message names the field, the
            sample keys (and shards) at fault and the attribute or type.
        ValueError: an empty list of samples.
    """

    follow_batch: tuple[str, ...] = ()
    exclude_keys: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name in ("follow_batch", "exclude_keys"):
            value = getattr(self, name)
            if isinstance(value, str):
                raise TypeError(f"{name} must be a sequence of attribute names, e.g. ['x'], not a str")
            object.__setattr__(self, name, tuple(value or ()))

    def __call__(self, samples: Sequence[Any]) -> Any:
        if not samples:
            raise ValueError("cannot collate an empty list of samples")
        samples = samples if isinstance(samples, list) else list(samples)
        first = samples[0]
        if is_graph(first):
            return self._graphs("graphs", samples, samples)
        if not isinstance(first, Mapping):
            return collate(samples)
        keys = first.keys()
        graph_fields = [k for k, v in first.items() if is_graph(v)]
        if not graph_fields or any(s.keys() != keys for s in samples):
            return collate(samples)  # no graphs, or samples that disagree: its error names them
        others = collate([{k: v for k, v in s.items() if k not in graph_fields} for s in samples])
        out = {}
        for k in first:
            out[k] = self._graphs(f"field {k!r}", samples, [s[k] for s in samples]) if k in graph_fields else others[k]
        return out

    def _graphs(self, what: str, samples: list[Any], graphs: list[Any]) -> Any:
        try:
            return collate_graphs(graphs, follow_batch=self.follow_batch, exclude_keys=self.exclude_keys)
        except SampleError as e:
            where = _where(samples, graphs, frozenset(self.exclude_keys))
            raise SampleError(f"cannot batch the graphs of {what}: {where}: {e}", reason=e.reason) from e


def collate_fn(
    follow_batch: Iterable[str] | None = None, exclude_keys: Iterable[str] | None = None
) -> GraphCollate:
    """A ``collate_fn`` for :func:`shardflow.loader` that builds PyG ``Batch`` objects.

    Example::

        loader = shardflow.loader(ShardDataset("shards/", shuffle=True), batch_size=64,
                                  collate_fn=collate_fn(follow_batch=["x"]))

    Args:
        follow_batch: graph attributes that also get ``<attr>_batch`` and
            ``<attr>_ptr`` vectors (as ``Batch.from_data_list``).
        exclude_keys: graph attributes left out of the batch.

    Returns:
        A picklable :class:`GraphCollate` (it reaches DataLoader workers under any
        start method).
    """
    return GraphCollate(tuple(follow_batch or ()), tuple(exclude_keys or ()))


def to_shards(
    dataset: Any,
    dst: str | os.PathLike[str],
    *,
    max_count: int = 10_000,
    field: str = "graph.pyg",
    workers: int | None = None,
    prefix: str = "train",
    resume: bool = True,
    storage_options: Mapping[str, Any] | None = None,
    progress: Callable[[int], None] | None = None,
) -> Manifest:
    """Write an existing PyG dataset object into shards, one sample per graph.

    The graphs are encoded one at a time (never collated), each stored by its own
    elements (a graph of an ``InMemoryDataset`` is a view into the whole collated
    storage; only its part is written). Sample ``i`` has key ``%09d % i``, the
    graph in ``field`` and its ``(num_nodes, num_edges)`` in the sizes index (for
    ``shardflow.loader(..., max_cost=...)``). Read the shards back with
    ``shardflow.ShardDataset(dst)``.

    Args:
        dataset: an ``InMemoryDataset``, ``OnDiskDataset`` or any indexable
            dataset or list of ``Data`` / ``HeteroData`` (converted by ``workers``
            processes, which share it through ``fork``), or an iterable of graphs
            such as a generator (encoded and written by this process).
        dst: destination folder (local or fsspec URL).
        max_count: graphs per shard.
        field: the graph's field name, ending in ``.pyg``.
        workers: conversion processes; None = one per CPU.
        prefix: shard names are ``<prefix>-%06d.tar``.
        resume: keep finished shards of an earlier run whose source is unchanged.
        storage_options: fsspec options for a remote ``dst``.
        progress: ``progress(n)`` after every finished shard of ``n`` graphs.

    Returns:
        The :class:`~shardflow.format.manifest.Manifest`; ``meta`` holds the
        graph schema, ``num_graphs`` and the dataset's class (see
        :func:`shardflow.convert.pyg.convert_pyg`).

    Raises:
        ConversionError: the dataset gives something that is not a graph, or a
            worker failed.
        SampleError: a graph attribute cannot be stored without pickle (names
            the graph and the attribute).
    """
    from ..convert.engine import ConvertOptions
    from ..convert.pyg import convert_graphs

    options = ConvertOptions(
        max_count=max_count,
        prefix=prefix,
        workers=workers,
        resume=resume,
        storage_options=dict(storage_options or {}),
    )
    return convert_graphs(dataset, os.fspath(dst), options=options, progress=progress, field=field)
