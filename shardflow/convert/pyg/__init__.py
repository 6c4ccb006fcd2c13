"""``convert pyg``: one sample per graph of a PyTorch Geometric dataset.

Graph ``i`` of the dataset becomes the sample with key ``%09d % i``
(``000000042``; wider past 999,999,999 graphs) and one field, ``graph.pyg`` by
default: the graph encoded by :func:`shardflow.graph.encode_graph` (safetensors
plus a JSON schema, no pickle). Each sample also gets its row of the sizes
index, ``(num_nodes, num_edges)`` (summed over node and edge types for
``HeteroData``), so a loader can batch by a node budget
(``shardflow.loader(..., max_cost=...)``).

Where the graphs come from. A *dataset spec* names an importable object,
``module:attr`` (``torch_geometric.datasets:TUDataset``; ``module.attr`` works
too). A callable is called with the spec's ``kwargs`` plus ``root=`` when a root
is given (a PyG dataset class and its root folder, or any factory function);
anything else is used as it is. The result is either

- *indexable*: it has ``len()`` and ``[i]`` (an ``InMemoryDataset``, an
  ``OnDiskDataset``, any PyG ``Dataset``, a list of graphs). The descriptors
  streamed to the conversion engine are graph numbers, never graphs: each
  worker process takes its own graphs ``dataset[i]`` and encodes them. The
  dataset is created once in this process; worker processes started by
  ``fork`` (the default on Linux) share it, others build it again from the
  spec (so the spec must build the same dataset every time; a worker checks a
  few graphs against this process's and raises if they differ). Or
- *a plain iterable* (a generator, an ``IterableDataset``): it cannot be split
  between processes, so this process iterates it once, encodes each graph and
  writes the shards itself (``options.workers`` is not used). Memory holds the
  encoded bytes of one shard; for parallel conversion give an indexable
  dataset instead.

Memory never holds a collated dataset: graphs are encoded one at a time, and a
graph taken from an ``InMemoryDataset`` (whose tensors are views into the
collated storage) is stored by its own elements only, so shard bytes are
proportional to the graphs (the codec guarantees it; see
:mod:`shardflow.graph.codec`). ``InMemoryDataset`` keeps a Python copy of
every graph it hands out (its cache for later epochs); conversion drops each
one after encoding it.

What is stored is what ``dataset[i]`` returns, so a dataset's ``transform`` is
applied (and a random transform is frozen into the shards): build the dataset
with ``transform=None`` to store the raw graphs.

The manifest's ``meta`` holds the source, the dataset class, ``num_graphs``,
``num_classes`` / ``num_node_features`` / ``num_edge_features`` where the
dataset gives them cheaply, the ``graph`` schema (see :func:`graph_schema`) and
``size_columns``. Re-running a conversion keeps the finished shards when the
source (spec, processed files, length, a sample of graph contents; for a plain
iterable every graph's bytes) is unchanged.

Order: by default the graphs are written in a seeded shuffle (``order="shuffled"``,
:mod:`~shardflow.convert.engine.mixorder`), so that a dataset stored class after class (many
``TUDataset`` s are) gives shards that mix the classes: an indexable dataset's graph numbers in
:func:`~shardflow.convert.engine.mixorder.input_order`'s permutation (8 bytes per graph held), a
plain iterable's graphs through the window shuffle (at most ``window`` encoded graphs held; by
default one shard's, ``max_count``: the stream holds the graphs of the shard in flight anyway).
``order="walk"`` writes graph 0, 1, 2, ... Keys stay the graph numbers either way; ``meta``
records ``order`` and ``order_seed`` (and ``order_window`` for a plain iterable).

Modules: :mod:`~shardflow.convert.pyg.spec` (dataset specs),
:mod:`~shardflow.convert.pyg.schema` (the graph schema),
:mod:`~shardflow.convert.pyg.workers` (indexable datasets, one graph number per
descriptor), :mod:`~shardflow.convert.pyg.stream` (plain iterables),
:mod:`~shardflow.convert.pyg.meta` (manifest metadata and the resume fingerprint).
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from ...errors import ConversionError
from ...format.manifest import Manifest
from ..engine.engine import ConvertOptions, run_conversion
from ..engine.mixorder import DEFAULT_ORDER, check_order, in_window_order, input_order, order_meta
from .meta import close_database, dataset_info, file_states, fingerprint, qualname
from .schema import graph_schema, merge_schemas
from .spec import DatasetSpec, is_graph, is_indexable
from .stream import StreamState, build_encoded
from .workers import DATASETS, KEY_WIDTH, WorkerContext, build_indexed, probe_graphs, probe_indices

__all__ = [
    "DEFAULT_FIELD",
    "DatasetSpec",
    "convert_pyg",
    "convert_graphs",
    "check_graph_field",
    "is_indexable",
    "graph_schema",
    "merge_schemas",
    "to_shards",
]

log = logging.getLogger(__name__)

DEFAULT_FIELD = "graph.pyg"
"""Field name of the graph in every sample."""

SIZE_COLUMNS = ["num_nodes", "num_edges"]


def check_graph_field(name: str) -> str:
    """Return ``name`` if it can hold a graph (ends in ``.pyg``, not metadata).

    Raises:
        ValueError: it cannot.
    """
    if not name.endswith(".pyg") and name != "pyg":
        raise ValueError(f"the graph field must end in '.pyg' (its codec), got {name!r}")
    if name.startswith("__"):
        raise ValueError(f"field names starting with '__' are metadata, got {name!r}")
    return name


def _convert(
    dataset: Any,
    dst: str,
    *,
    spec: DatasetSpec | None,
    field_name: str,
    options: ConvertOptions,
    progress: Callable[[int], None] | None,
    client: Any = None,
    order: str = DEFAULT_ORDER,
    seed: int = 0,
    window: int | None = None,
) -> Manifest:
    check_graph_field(field_name)
    check_order(order)
    source = spec.describe() if spec is not None else f"{qualname(dataset)} object"
    meta: dict[str, Any] = {"converter": "pyg", "source": source, "dataset_class": qualname(dataset), "field": field_name}
    if not is_indexable(dataset):
        if not isinstance(dataset, Iterable) or isinstance(dataset, (str, bytes, Mapping)) or is_graph(dataset):
            raise ConversionError(
                f"{source}: expected a dataset (len() and [i]) or an iterable of graphs, got a {qualname(dataset)}"
            )
        if (options.workers or 1) > 1:
            log.info("%s is a plain iterable: encoding and writing in this process (workers=1)", source)
        state = StreamState()
        return run_conversion(
            dst,
            in_window_order(state.encode(dataset), order, int(seed), window or options.max_count),
            build_encoded,
            context=field_name,
            meta={**meta, "size_columns": SIZE_COLUMNS, **order_meta(order, seed, window or options.max_count)},
            meta_at_end=lambda: {"num_graphs": state.count, "graph": state.schema, "graph_schema_from": state.observed},
            options=dataclasses.replace(options, workers=1),
            progress=progress,
            client=client,
        )

    n = len(dataset)
    probe_at = probe_indices(n)
    probe, schema = probe_graphs(dataset, probe_at)
    meta.update(num_graphs=n, **dataset_info(dataset))
    meta.update(graph=schema, graph_schema_from=len(probe_at), size_columns=SIZE_COLUMNS, **order_meta(order, seed))
    token = spec.token() if spec is not None else f"object:{id(dataset)}:{os.getpid()}"
    if client is not None and spec is None:
        raise ConversionError(
            f"{source}: a dataset object cannot be sent to Dask workers; give a dataset spec "
            "(convert_pyg('module:callable', ...)) so that each worker builds it"
        )
    workers = options.workers or os.cpu_count() or 1
    if workers > 1 and spec is None and multiprocessing.get_start_method() != "fork":
        log.warning(
            "converting a dataset object with start method %r: worker processes cannot share it, "
            "so this process converts alone (workers=1)", multiprocessing.get_start_method()
        )
        options = dataclasses.replace(options, workers=1)
        workers = 1
    if workers > 1:
        close_database(dataset)
    width = max(KEY_WIDTH, len(str(max(n - 1, 0))))
    ctx = WorkerContext(token, spec, field_name, n, width, probe)
    tag = fingerprint(spec.token() if spec is not None else qualname(dataset), n, file_states(dataset), probe, field_name)
    # one descriptor per graph: a tag of the source (so a resumed run never keeps shards of
    # another dataset) and the graph number; graphs are taken and encoded in the workers
    numbers = range(n) if order == "walk" else input_order(n, int(seed))
    descriptors = ((tag, int(i)) for i in numbers)
    previous = DATASETS.get(token)
    DATASETS[token] = dataset  # worker processes forked from here inherit it
    try:
        return run_conversion(
            dst, descriptors, build_indexed, context=ctx, meta=meta, options=options, progress=progress, client=client
        )
    finally:
        if previous is None:
            DATASETS.pop(token, None)
        else:
            DATASETS[token] = previous


def convert_pyg(
    dataset_spec: str | DatasetSpec,
    dst: str,
    *,
    options: ConvertOptions = ConvertOptions(),
    progress: Callable[[int], None] | None = None,
    root: str | os.PathLike[str] | None = None,
    kwargs: Mapping[str, Any] | None = None,
    field: str = DEFAULT_FIELD,
    client: Any = None,
    order: str = DEFAULT_ORDER,
    seed: int = 0,
    window: int | None = None,
) -> Manifest:
    """Convert the graphs of an importable PyG dataset into shards, one sample per graph.

    Graph ``i`` is the sample with key ``%09d % i`` in the field ``field``
    (a ``.pyg`` field: exact tensors and dtypes, no pickle) plus its sizes-index
    row ``(num_nodes, num_edges)``. See the module docstring for how indexable
    datasets and plain iterables are read, and what ``meta`` holds.

    Args:
        dataset_spec: ``"module:callable"`` (for example
            ``"torch_geometric.datasets:TUDataset"`` with ``root=`` and
            ``kwargs={"name": "MUTAG"}``, or ``"torch_geometric.datasets:FakeDataset"``
            with ``kwargs={"num_graphs": 100}``, or a function of yours returning
            a dataset, a list or a generator of graphs), or a :class:`DatasetSpec`.
        dst: destination folder (local or fsspec URL).
        options: shard size (graphs per shard), prefix, workers, resume, storage
            options.
        progress: ``progress(n)`` after every finished shard of ``n`` graphs.
        root: passed as ``root=`` to the callable (a PyG dataset's folder).
        kwargs: more keyword arguments for the callable.
        field: the graph's field name; must end in ``.pyg``.
        client: a ``dask.distributed.Client``: write the shards as tasks on its
            cluster (its workers must reach the source and ``dst``); None: local
            processes.
        order, seed: ``"shuffled"`` (default: the graphs in a seeded permutation, see the
            module docstring) or ``"walk"`` (graph 0, 1, 2, ...).
        window: a plain iterable's window shuffle, in graphs (the encoded graphs held at most;
            None: ``options.max_count``).

    Returns:
        The manifest; ``meta`` holds ``converter``, ``source``, ``dataset_class``,
        ``num_graphs``, ``field``, ``graph`` (the schema of :func:`graph_schema`,
        merged over the graphs inspected: ``graph_schema_from`` of them),
        ``size_columns`` and, where the dataset gives them cheaply,
        ``num_classes``, ``num_node_features``, ``num_edge_features``; ``order``,
        ``order_seed`` (and ``order_window`` for a plain iterable).

    Raises:
        ConversionError: the spec cannot be imported or called, it gives
            something that is not graphs, or a worker failed (names the shard).
        SampleError: a graph holds an attribute a ``pyg`` field cannot store
            (names the graph and the attribute).
        ValueError: a bad ``field``, spec or ``order``.
    """
    if isinstance(dataset_spec, DatasetSpec):
        if root is not None or kwargs:
            raise ValueError("give root and kwargs inside the DatasetSpec, not beside it")
        spec = dataset_spec
    else:
        spec = DatasetSpec(dataset_spec, dict(kwargs or {}), os.fspath(root) if root is not None else None)
    check_graph_field(field)
    dataset = spec.open()
    return _convert(dataset, dst, spec=spec, field_name=field, options=options, progress=progress, client=client,
                    order=order, seed=seed, window=window)


def convert_graphs(
    dataset: Any,
    dst: str,
    *,
    options: ConvertOptions = ConvertOptions(),
    progress: Callable[[int], None] | None = None,
    field: str = DEFAULT_FIELD,
    spec: DatasetSpec | None = None,
    client: Any = None,
    order: str = DEFAULT_ORDER,
    seed: int = 0,
    window: int | None = None,
) -> Manifest:
    """Convert a dataset object already in hand (``InMemoryDataset``, ``OnDiskDataset``,
    a list of ``Data``, a generator of graphs) into shards, as :func:`convert_pyg`.

    Worker processes share the object when they are started by ``fork`` (the
    default on Linux); with another start method an indexable dataset is
    converted by this process alone. See :func:`to_shards`
    for the short form.

    ``spec``, when the dataset was built by :meth:`DatasetSpec.open`, names the
    source in the manifest and lets workers not started by ``fork`` (and Dask
    workers, with ``client``) build it again. ``order``, ``seed``, ``window``: as :func:`convert_pyg`.
    """
    return _convert(dataset, dst, spec=spec, field_name=field, options=options, progress=progress, client=client,
                    order=order, seed=seed, window=window)


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
    order: str = DEFAULT_ORDER,
    seed: int = 0,
) -> Manifest:
    """Write an existing PyG dataset object into shards, one sample per graph.

    The graphs are encoded one at a time (never collated), each stored by its own
    elements (a graph of an ``InMemoryDataset`` is a view into the whole collated
    storage; only its part is written). Graph ``i`` has key ``%09d % i``, the
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
        order, seed: ``"shuffled"`` (default, seeded) or ``"walk"``: see :func:`convert_pyg`.

    Returns:
        The :class:`~shardflow.format.manifest.Manifest`; ``meta`` holds the
        graph schema, ``num_graphs`` and the dataset's class (see
        :func:`convert_pyg`).

    Raises:
        ConversionError: the dataset gives something that is not a graph, or a
            worker failed.
        SampleError: a graph attribute cannot be stored without pickle (names
            the graph and the attribute).
    """
    options = ConvertOptions(
        max_count=max_count,
        prefix=prefix,
        workers=workers,
        resume=resume,
        storage_options=dict(storage_options or {}),
    )
    return convert_graphs(dataset, os.fspath(dst), options=options, progress=progress, field=field, order=order,
                          seed=seed)
