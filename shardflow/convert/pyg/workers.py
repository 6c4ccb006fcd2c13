"""The workers of an indexable PyG conversion: each takes, encodes and writes its own graphs.

The descriptors are graph numbers, never graphs. A worker finds the dataset in
:data:`DATASETS` (inherited through ``fork`` from the converting process) or
builds it again from the spec and checks that it holds the same graphs
(:func:`worker_dataset`).
"""

from __future__ import annotations

import hashlib
import multiprocessing
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ...errors import ConversionError, SampleError
from .schema import graph_schema, merge_schemas
from .spec import DatasetSpec, is_graph, is_indexable

__all__ = [
    "DATASETS",
    "KEY_WIDTH",
    "SCHEMA_GRAPHS",
    "WorkerContext",
    "build_indexed",
    "encode_one",
    "forget",
    "graph_key",
    "probe_graphs",
    "probe_indices",
    "worker_dataset",
]

KEY_WIDTH = 9
"""Digits of a graph's key (``000000042``); wider past 999,999,999 graphs."""

SCHEMA_GRAPHS = 32
"""Graphs of a dataset inspected for the schema and the fingerprint."""

DATASETS: dict[str, Any] = {}
"""Datasets of this process (and, after fork, of its worker processes), by token."""


def encode_one(index: int, graph: Any) -> tuple[bytes, tuple[int, int]]:
    """Encode graph ``index``; returns its bytes and (num_nodes, num_edges)."""
    from ...graph import encode_graph

    if not is_graph(graph):
        raise ConversionError(
            f"graph {index}: the dataset gave a {type(graph).__module__}.{type(graph).__qualname__}, "
            "not a torch_geometric Data or HeteroData"
        )
    try:
        data = encode_graph(graph)
    except SampleError as e:
        raise SampleError(f"graph {index}: {e}") from e
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Unable to accurately infer 'num_nodes'"
        sizes = (int(graph.num_nodes or 0), int(graph.num_edges or 0))
    return data, sizes


def graph_key(index: int, width: int = KEY_WIDTH) -> str:
    """The key of graph ``index``: its number, zero-padded to ``width`` digits."""
    return f"{index:0{width}d}"


def forget(dataset: Any, index: int) -> None:
    """Drop ``InMemoryDataset``'s cached copy of graph ``index`` (it keeps every
    graph it handed out, for later epochs; a conversion reads each graph once)."""
    cache = getattr(dataset, "_data_list", None)
    if type(cache) is list:
        try:
            cache[dataset.indices()[index]] = None
        except (AttributeError, IndexError, TypeError):
            pass


def probe_indices(n: int) -> list[int]:
    """Up to :data:`SCHEMA_GRAPHS` graph numbers spread over ``range(n)``, first and last included."""
    if n <= SCHEMA_GRAPHS:
        return list(range(n))
    step = (n - 1) / (SCHEMA_GRAPHS - 1)
    return sorted({round(j * step) for j in range(SCHEMA_GRAPHS)})


def probe_graphs(dataset: Any, indices: list[int]) -> tuple[str, dict[str, Any] | None]:
    """Hash of the encoded probe graphs, and their merged schema."""
    h = hashlib.sha256()
    schema = None
    for i in indices:
        graph = dataset[i]
        data, _ = encode_one(i, graph)
        h.update(hashlib.sha256(data).digest())
        schema = merge_schemas(schema, graph_schema(graph))
        forget(dataset, i)
    return h.hexdigest()[:32], schema


@dataclass(frozen=True)
class WorkerContext:
    """What every worker needs: where the dataset is, and what this process saw of it."""

    token: str
    spec: DatasetSpec | None
    field: str
    num_graphs: int
    width: int
    probe: str


def worker_dataset(ctx: WorkerContext) -> Any:
    """The dataset in a worker: inherited through fork, or built again from the spec and checked."""
    dataset = DATASETS.get(ctx.token)
    if dataset is not None:
        return dataset
    if ctx.spec is None:
        raise ConversionError(
            f"the dataset object is not available in this worker process (start method "
            f"{multiprocessing.get_start_method()!r}); convert with workers=1 or give a dataset spec"
        )
    dataset = ctx.spec.open()
    if not is_indexable(dataset) or len(dataset) != ctx.num_graphs:
        raise ConversionError(
            f"the dataset {ctx.spec.describe()} built again in a worker process is not the same: "
            f"{len(dataset) if is_indexable(dataset) else 'not indexable'} graphs instead of {ctx.num_graphs}"
        )
    probe, _ = probe_graphs(dataset, probe_indices(ctx.num_graphs))
    if probe != ctx.probe:
        raise ConversionError(
            f"the dataset {ctx.spec.describe()} built again in a worker process holds other graphs than "
            "in the main process (is it random without a seed?); convert with workers=1"
        )
    DATASETS[ctx.token] = dataset
    return dataset


def _single_threaded_worker() -> None:
    """Use one torch thread in a worker process, as DataLoader workers do.

    A worker forked from a process whose torch already ran OpenMP threads inherits
    a thread pool that does not exist in it: its first parallel operation (a copy of
    a tensor of more than 32,768 elements) then waits forever at GNU libgomp's
    barrier. One thread per worker also avoids oversubscribing the CPUs that the
    workers share.
    """
    if multiprocessing.parent_process() is None:
        return  # converting in the main process: leave the user's setting alone
    import torch

    if torch.get_num_threads() != 1:
        torch.set_num_threads(1)


def build_indexed(descriptors: list[tuple[str, int]], ctx: WorkerContext) -> Iterator[tuple[Any, ...]]:
    """Worker: take, encode and yield this shard's graphs one at a time."""
    _single_threaded_worker()
    dataset = worker_dataset(ctx)
    for _, i in descriptors:
        data, sizes = encode_one(i, dataset[i])
        forget(dataset, i)
        yield graph_key(i, ctx.width), {ctx.field: data}, sizes

