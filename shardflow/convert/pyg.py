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
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import json
import logging
import multiprocessing
import os
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import ConversionError, SampleError
from ..format.manifest import Manifest
from .engine import ConvertOptions, run_conversion

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

_KEY_WIDTH = 9
_SCHEMA_GRAPHS = 32  # graphs of an indexable dataset inspected for the schema and the fingerprint

# Datasets of this process (and, after fork, of its worker processes), by token.
_DATASETS: dict[str, Any] = {}


# ------------------------------------------------------------------ dataset specs


@dataclass(frozen=True)
class DatasetSpec:
    """An importable dataset: ``target(**kwargs, root=root)`` (picklable; sent to workers).

    Attributes:
        target: ``"module:attr"`` (``attr`` may be dotted: ``module:Class.factory``)
            or ``"module.attr"``.
        kwargs: keyword arguments of the call (JSON values on the command line).
        root: passed as ``root=`` when not None (the folder of a PyG dataset).
    """

    target: str
    kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    root: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.target, str) or not self.target.strip():
            raise ValueError(f"a dataset spec is 'module:callable', got {self.target!r}")
        if not isinstance(self.kwargs, Mapping):
            raise TypeError(f"dataset kwargs must be a mapping, got {type(self.kwargs).__name__}")
        if "root" in self.kwargs and self.root is not None:
            raise ValueError("give the dataset root once: as root= or inside kwargs, not both")

    def describe(self) -> str:
        """``target`` plus its arguments, as one line."""
        args = dict(self.kwargs)
        if self.root is not None:
            args["root"] = self.root
        return self.target if not args else f"{self.target} {json.dumps(args, sort_keys=True, default=str)}"

    def token(self) -> str:
        """A stable text identifying this spec (cache key and fingerprint part)."""
        return json.dumps([self.target, dict(self.kwargs), self.root], sort_keys=True, default=repr)

    def resolve(self) -> Any:
        """Import the target object (not called yet).

        Raises:
            ConversionError: the module or attribute cannot be imported.
        """
        module_name, sep, attr = self.target.partition(":")
        if not sep:
            module_name, _, attr = self.target.rpartition(".")
        if not module_name or not attr:
            raise ConversionError(
                f"dataset spec {self.target!r}: expected 'module:callable' "
                "(for example 'torch_geometric.datasets:TUDataset')"
            )
        try:
            obj: Any = importlib.import_module(module_name)
        except ImportError as e:
            raise ConversionError(f"dataset spec {self.target!r}: cannot import module {module_name!r}: {e}") from e
        for part in attr.split("."):
            try:
                obj = getattr(obj, part)
            except AttributeError:
                raise ConversionError(
                    f"dataset spec {self.target!r}: {module_name!r} has no attribute {attr!r}"
                ) from None
        return obj

    def open(self) -> Any:
        """Build the dataset (or iterable of graphs) the spec names.

        Raises:
            ConversionError: import failure, arguments given for a non-callable
                target, or the call raised (the cause is chained).
        """
        target = self.resolve()
        if not callable(target) or _is_graph(target):  # a Data is callable, yet a value
            if self.kwargs or self.root is not None:
                raise ConversionError(
                    f"dataset spec {self.target!r} is a {type(target).__name__}, not a callable: "
                    "it takes no kwargs or root"
                )
            return target
        kwargs = dict(self.kwargs)
        if self.root is not None:
            kwargs["root"] = self.root
        try:
            return target(**kwargs)
        except Exception as e:
            raise ConversionError(f"building the dataset {self.describe()} failed: {type(e).__name__}: {e}") from e


# ------------------------------------------------------------------ schema


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


# ------------------------------------------------------------------ encoding


def _is_graph(obj: Any) -> bool:
    from ..graph import is_graph

    return is_graph(obj)


def _encode(index: int, graph: Any) -> tuple[bytes, tuple[int, int]]:
    """Encode graph ``index``; returns its bytes and (num_nodes, num_edges)."""
    from ..graph import encode_graph

    if not _is_graph(graph):
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


def _key(index: int, width: int = _KEY_WIDTH) -> str:
    return f"{index:0{width}d}"


def _forget(dataset: Any, index: int) -> None:
    """Drop ``InMemoryDataset``'s cached copy of graph ``index`` (it keeps every
    graph it handed out, for later epochs; a conversion reads each graph once)."""
    cache = getattr(dataset, "_data_list", None)
    if type(cache) is list:
        try:
            cache[dataset.indices()[index]] = None
        except (AttributeError, IndexError, TypeError):
            pass


def is_indexable(obj: Any) -> bool:
    """Whether ``obj`` is a dataset with ``len()`` and ``[i]`` (converted by worker
    processes, each taking its own graphs), not a plain iterable of graphs."""
    if isinstance(obj, (str, bytes, Mapping, Iterator)) or _is_graph(obj):
        return False
    try:
        from torch.utils.data import IterableDataset

        if isinstance(obj, IterableDataset):
            return False
    except ImportError:  # pragma: no cover - torch is a dependency
        pass
    return hasattr(type(obj), "__len__") and hasattr(type(obj), "__getitem__")


def _probe_indices(n: int) -> list[int]:
    """Up to :data:`_SCHEMA_GRAPHS` graph numbers spread over ``range(n)``, first and last included."""
    if n <= _SCHEMA_GRAPHS:
        return list(range(n))
    step = (n - 1) / (_SCHEMA_GRAPHS - 1)
    return sorted({round(j * step) for j in range(_SCHEMA_GRAPHS)})


def _probe(dataset: Any, indices: list[int]) -> tuple[str, dict[str, Any] | None]:
    """Hash of the encoded probe graphs, and their merged schema."""
    h = hashlib.sha256()
    schema = None
    for i in indices:
        graph = dataset[i]
        data, _ = _encode(i, graph)
        h.update(hashlib.sha256(data).digest())
        schema = merge_schemas(schema, graph_schema(graph))
        _forget(dataset, i)
    return h.hexdigest()[:32], schema


@dataclass(frozen=True)
class _Context:
    """What every worker needs: where the dataset is, and what this process saw of it."""

    token: str
    spec: DatasetSpec | None
    field: str
    num_graphs: int
    width: int
    probe: str


def _worker_dataset(ctx: _Context) -> Any:
    """The dataset in a worker: inherited through fork, or built again from the spec and checked."""
    dataset = _DATASETS.get(ctx.token)
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
    probe, _ = _probe(dataset, _probe_indices(ctx.num_graphs))
    if probe != ctx.probe:
        raise ConversionError(
            f"the dataset {ctx.spec.describe()} built again in a worker process holds other graphs than "
            "in the main process (is it random without a seed?); convert with workers=1"
        )
    _DATASETS[ctx.token] = dataset
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


def _build_indexed(descriptors: list[tuple[str, int]], ctx: _Context) -> Iterator[tuple[Any, ...]]:
    """Worker: take, encode and yield this shard's graphs one at a time."""
    _single_threaded_worker()
    dataset = _worker_dataset(ctx)
    for _, i in descriptors:
        data, sizes = _encode(i, dataset[i])
        _forget(dataset, i)
        yield _key(i, ctx.width), {ctx.field: data}, sizes


class _Encoded:
    """A graph encoded in this process (plain-iterable sources): the descriptor is the sample.

    Its ``repr`` (what the engine hashes to decide whether a finished shard can be
    kept on a re-run) is the key and a hash of the bytes, not the bytes.
    """

    __slots__ = ("key", "data", "sizes", "_digest")

    def __init__(self, key: str, data: bytes, sizes: tuple[int, int]) -> None:
        self.key = key
        self.data = data
        self.sizes = sizes
        self._digest = hashlib.blake2b(data, digest_size=16).hexdigest()

    def __repr__(self) -> str:
        return f"{self.key}:{len(self.data)}:{self._digest}"


def _build_encoded(descriptors: list[_Encoded], field_name: str) -> Iterator[tuple[Any, ...]]:
    for d in descriptors:
        yield d.key, {field_name: d.data}, d.sizes


class _StreamState:
    """What a plain-iterable conversion learns while it streams: count and schema.

    The schema merges the first :data:`_SCHEMA_GRAPHS` graphs and every later graph
    whose structure (:func:`shardflow.graph.graph_structure`) was not seen before.
    """

    def __init__(self) -> None:
        self.count = 0
        self.schema: dict[str, Any] | None = None
        self.observed = 0
        self._seen: set[tuple[Any, ...]] = set()

    def encode(self, graphs: Iterable[Any]) -> Iterator[_Encoded]:
        from ..graph.structure import graph_structure

        for i, graph in enumerate(graphs):
            data, sizes = _encode(i, graph)
            self._observe(i, graph, graph_structure(graph))
            self.count = i + 1
            yield _Encoded(_key(i), data, sizes)

    def _observe(self, index: int, graph: Any, structure: tuple[Any, ...]) -> None:
        if index < _SCHEMA_GRAPHS or structure not in self._seen:
            self._seen.add(structure)
            self.schema = merge_schemas(self.schema, graph_schema(graph))
            self.observed += 1


# ------------------------------------------------------------------ metadata


def _qualname(obj: Any) -> str:
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


def _dataset_info(dataset: Any) -> dict[str, Any]:
    """``num_classes``, ``num_node_features``, ``num_edge_features`` where cheap to know."""
    out: dict[str, Any] = {}
    try:
        from torch_geometric.data import Dataset, InMemoryDataset
    except ImportError:  # pragma: no cover - encoding needs it anyway
        return out
    if not isinstance(dataset, Dataset):
        return out
    # Dataset.num_classes iterates over the whole dataset; InMemoryDataset's reads the
    # collated labels (unless a transform is set).
    cheap = isinstance(dataset, InMemoryDataset) and dataset.transform is None
    names = ("num_classes", "num_node_features", "num_edge_features") if cheap else ("num_node_features", "num_edge_features")
    for name in names:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                value = getattr(dataset, name)
        except Exception as e:  # noqa: BLE001 - informational metadata only
            log.debug("no %s for %s: %s", name, _qualname(dataset), e)
            continue
        if type(value) is int:
            out[name] = value
    _forget(dataset, 0)  # the feature counts look at graph 0
    return out


def _file_states(dataset: Any) -> list[Any]:
    """Size and mtime of a PyG dataset's processed files (part of the resume fingerprint)."""
    try:
        paths = list(dataset.processed_paths)
    except Exception:  # noqa: BLE001 - no root, or not a PyG dataset
        return []
    states = []
    for p in paths:
        try:
            st = os.stat(p)
        except OSError:
            continue
        states.append([os.path.abspath(p), st.st_size, st.st_mtime_ns])
    return states


def _fingerprint(*parts: Any) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(json.dumps(p, sort_keys=True, default=repr).encode())
        h.update(b"\0")
    return h.hexdigest()[:16]


def _close_database(dataset: Any) -> None:
    """Close an ``OnDiskDataset``'s database connection before worker processes fork
    (a SQLite connection must not cross a fork); it reopens on next use."""
    try:
        from torch_geometric.data import OnDiskDataset
    except ImportError:  # pragma: no cover
        return
    if isinstance(dataset, OnDiskDataset) and getattr(dataset, "_db", None) is not None:
        dataset.close()
        dataset._db = None  # close() keeps the closed handle; None makes `db` connect again


# ------------------------------------------------------------------ conversion


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
) -> Manifest:
    check_graph_field(field_name)
    source = spec.describe() if spec is not None else f"{_qualname(dataset)} object"
    meta: dict[str, Any] = {"converter": "pyg", "source": source, "dataset_class": _qualname(dataset), "field": field_name}
    if not is_indexable(dataset):
        if not isinstance(dataset, Iterable) or isinstance(dataset, (str, bytes, Mapping)) or _is_graph(dataset):
            raise ConversionError(
                f"{source}: expected a dataset (len() and [i]) or an iterable of graphs, got a {_qualname(dataset)}"
            )
        if (options.workers or 1) > 1:
            log.info("%s is a plain iterable: encoding and writing in this process (workers=1)", source)
        state = _StreamState()
        return run_conversion(
            dst,
            state.encode(dataset),
            _build_encoded,
            context=field_name,
            meta={**meta, "size_columns": SIZE_COLUMNS},
            meta_at_end=lambda: {"num_graphs": state.count, "graph": state.schema, "graph_schema_from": state.observed},
            options=dataclasses.replace(options, workers=1),
            progress=progress,
            client=client,
        )

    n = len(dataset)
    probe_at = _probe_indices(n)
    probe, schema = _probe(dataset, probe_at)
    meta.update(num_graphs=n, **_dataset_info(dataset))
    meta.update(graph=schema, graph_schema_from=len(probe_at), size_columns=SIZE_COLUMNS)
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
        _close_database(dataset)
    width = max(_KEY_WIDTH, len(str(max(n - 1, 0))))
    ctx = _Context(token, spec, field_name, n, width, probe)
    tag = _fingerprint(spec.token() if spec is not None else _qualname(dataset), n, _file_states(dataset), probe, field_name)
    # one descriptor per graph: a tag of the source (so a resumed run never keeps shards of
    # another dataset) and the graph number; graphs are taken and encoded in the workers
    descriptors = ((tag, i) for i in range(n))
    previous = _DATASETS.get(token)
    _DATASETS[token] = dataset  # worker processes forked from here inherit it
    try:
        return run_conversion(
            dst, descriptors, _build_indexed, context=ctx, meta=meta, options=options, progress=progress, client=client
        )
    finally:
        if previous is None:
            _DATASETS.pop(token, None)
        else:
            _DATASETS[token] = previous


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
) -> Manifest:
    """Convert the graphs of an importable PyG dataset into shards, one sample per graph.

    Sample ``i`` holds graph ``i`` under key ``%09d % i`` in the field ``field``
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

    Returns:
        The manifest; ``meta`` holds ``converter``, ``source``, ``dataset_class``,
        ``num_graphs``, ``field``, ``graph`` (the schema of :func:`graph_schema`,
        merged over the graphs inspected: ``graph_schema_from`` of them),
        ``size_columns`` and, where the dataset gives them cheaply,
        ``num_classes``, ``num_node_features``, ``num_edge_features``.

    Raises:
        ConversionError: the spec cannot be imported or called, it gives
            something that is not graphs, or a worker failed (names the shard).
        SampleError: a graph holds an attribute a ``pyg`` field cannot store
            (names the graph and the attribute).
        ValueError: a bad ``field`` or spec.
    """
    if isinstance(dataset_spec, DatasetSpec):
        if root is not None or kwargs:
            raise ValueError("give root and kwargs inside the DatasetSpec, not beside it")
        spec = dataset_spec
    else:
        spec = DatasetSpec(dataset_spec, dict(kwargs or {}), os.fspath(root) if root is not None else None)
    check_graph_field(field)
    dataset = spec.open()
    return _convert(dataset, dst, spec=spec, field_name=field, options=options, progress=progress, client=client)


def convert_graphs(
    dataset: Any,
    dst: str,
    *,
    options: ConvertOptions = ConvertOptions(),
    progress: Callable[[int], None] | None = None,
    field: str = DEFAULT_FIELD,
    spec: DatasetSpec | None = None,
    client: Any = None,
) -> Manifest:
    """Convert a dataset object already in hand (``InMemoryDataset``, ``OnDiskDataset``,
    a list of ``Data``, a generator of graphs) into shards, as :func:`convert_pyg`.

    Worker processes share the object when they are started by ``fork`` (the
    default on Linux); with another start method an indexable dataset is
    converted by this process alone. See :func:`to_shards`
    for the short form.

    ``spec``, when the dataset was built by :meth:`DatasetSpec.open`, names the
    source in the manifest and lets workers not started by ``fork`` (and Dask
    workers, with ``client``) build it again.
    """
    return _convert(dataset, dst, spec=spec, field_name=field, options=options, progress=progress, client=client)


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
    return convert_graphs(dataset, os.fspath(dst), options=options, progress=progress, field=field)
