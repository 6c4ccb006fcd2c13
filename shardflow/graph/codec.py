"""Encode and decode one PyTorch Geometric graph as the bytes of a ``pyg`` field.

A ``pyg`` field is a `safetensors <https://github.com/huggingface/safetensors>`_
container: the graph's tensors are its entries (exact dtype and shape, each stored
by its own elements only), and everything else lives in one JSON document under the
metadata key ``"shardflow.graph"``. Nothing is pickled, on write or on read.

JSON schema (version 1)::

    {"version": 1,
     "kind": "Data" | "HeteroData",
     "class": "<module>.<qualname>",  # subclasses only (informational)
     "stores": [                      # Data: one store; HeteroData: global, node types, edge types
       {"key": null | "paper" | ["author", "writes", "paper"],
        "num_nodes": int | null,      # node-level stores only (Data, HeteroData node types)
        "attrs": {name: value, ...},  # in the store's order
        "rules": {name: rule, ...},   # attributes that Batch.from_data_list concatenates
        "custom": {name: leaf, ...}}]}  # only rules that differ from the class default

    value := null | true | false | int | float | str
           | {"tensor": entry}
           | {"edge_index": entry, "sparse_size": [int|null, int|null],
              "sort_order": "row" | "col" | null, "is_undirected": bool}
           | {"index": entry, "dim_size": int | null, "is_sorted": bool}
           | {"ndarray": entry}
           | {"list": [value, ...]} | {"tuple": [value, ...]} | {"dict": {str: value}}
    rule  := leaf | {"dict": {str: rule | null}} | {"list": [rule | null, ...]}
    leaf  := [cat_dim, inc]   # a tensor
           | [inc]            # an int, float or bool (PyG turns them into a tensor)
    inc   := int | float | bool | {"tensor_value": [dtype, shape, flat values]}

``cat_dim`` and ``inc`` are what ``data.__cat_dim__(key, value, store)`` and
``data.__inc__(key, value, store)`` returned at encode time on the original object,
so user subclasses of ``Data`` with their own rules, and PyG's name heuristics
(``*_index``, ``face``, ``*batch``), are honoured after decoding.

Decoding returns a plain ``Data`` / ``HeteroData`` when the stored rules are PyG's
defaults (always the case for those exact classes). When some rule differs (a user
subclass), the user's class cannot be imported without pickle, so decoding returns a
:class:`StoredRulesData` / :class:`StoredRulesHeteroData`: a ``Data`` / ``HeteroData``
whose ``__cat_dim__`` / ``__inc__`` answer the stored rules for those attributes (by
store and attribute name) and PyG's defaults for all others. The rules live in the
instance ``__dict__`` (never among ``keys()``), so they survive ``copy``,
``deepcopy``, ``to()``, ``clone()`` and pickling into DataLoader workers.
"""

from __future__ import annotations

import json
import logging
import math
import sys
import threading
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from shardflow.errors import DecodeError, SampleError, missing_dependency

logger = logging.getLogger(__name__)

SCHEMA_KEY = "shardflow.graph"
SCHEMA_VERSION = 1

# safetensors dtype names (the format's own spelling) <-> torch dtypes.
_ST_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "C64": torch.complex64,
    "U64": torch.uint64,
    "U32": torch.uint32,
    "U16": torch.uint16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
# Little-endian numpy dtypes for the torch dtypes numpy has (bfloat16 and float8 lack one).
_NP_DTYPES: dict[torch.dtype, np.dtype] = {
    dt: np.dtype(torch.empty(0, dtype=dt).numpy().dtype).newbyteorder("<")
    for dt in _ST_DTYPES.values()
    if dt not in (torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2)
}
# torch dtype name <-> dtype, for increments written inline in the JSON document.
_INLINE_DTYPES: dict[str, torch.dtype] = {
    str(dt).removeprefix("torch."): dt
    for dt in _ST_DTYPES.values()
    if not dt.is_complex
}
_SCALARS = (str, int, float, bool, type(None))
_RULES_ATTR = "_sf_rules"  # key in the instance __dict__ of the StoredRules* classes
# Markers in stored rules (strings: they survive pickling and never equal a real rule).
_DEFAULT = "default"  # no stored cat_dim (numbers) or no stored rule: use the class default
_UNKNOWN = "unknown"  # a custom increment that a batch or a separated graph cannot know


def _import_pyg(purpose: str) -> Any:
    """Import ``torch_geometric.data`` or raise the ImportError naming the extra."""
    try:
        import torch_geometric.data as pyg_data
    except ImportError as exc:
        raise missing_dependency("torch_geometric", "graphs", purpose) from exc
    return pyg_data


# --------------------------------------------------------------------------------------
# Classes that carry stored batching rules (built lazily: they subclass PyG classes).

_RULE_CLASSES: dict[str, type] = {}
_RULE_CLASSES_LOCK = threading.Lock()


def _store_key(store: Any) -> Any:
    return None if store is None else store._key


def _stored_cat_dim(obj: Any, key: str, store: Any) -> Any:
    """The stored cat_dim of ``key``, or _DEFAULT."""
    rules = obj.__dict__.get(_RULES_ATTR)
    rule = rules.get((_store_key(store), key)) if rules else None
    return _DEFAULT if rule is None else rule[0]


def _stored_inc(obj: Any, key: str, store: Any) -> Any:
    """The stored increment of ``key``, or _DEFAULT; raises if it is not known."""
    rules = obj.__dict__.get(_RULES_ATTR)
    rule = rules.get((_store_key(store), key)) if rules else None
    if rule is None:
        return _DEFAULT
    if isinstance(rule[1], str):  # _UNKNOWN
        raise SampleError(
            f"the custom increment of graph attribute {key!r} is unknown: this graph or "
            "batch was built from graphs decoded from a Data subclass with its own "
            "__inc__ (a graph taken out of a batch, or a batch of batches); collate "
            "the decoded graphs themselves instead"
        )
    return rule[1]


def _inherit_rules(target: Any, source: Any, batch_cls: type) -> None:
    """Pass stored rules on, as PyG passes on the first graph's ``__cat_dim__``.

    PyG calls ``batch.stores_as(first_graph)`` when collating and
    ``graph.stores_as(batch)`` when separating: the cat dims carry over, but a
    per-graph increment does not describe a batch, nor one graph of it.
    """
    rules = source.__dict__.get(_RULES_ATTR)
    if not rules or _RULES_ATTR in target.__dict__:
        return
    if isinstance(target, batch_cls) or isinstance(source, batch_cls):
        rules = {key: (cat_dim, _UNKNOWN) for key, (cat_dim, _) in rules.items()}
    target.__dict__[_RULES_ATTR] = rules


def _rule_classes() -> dict[str, type]:
    """The ``Data`` / ``HeteroData`` subclasses that answer stored rules (built once)."""
    if not _RULE_CLASSES:
        with _RULE_CLASSES_LOCK:
            if not _RULE_CLASSES:
                _RULE_CLASSES.update(_build_rule_classes())
    return _RULE_CLASSES


def _build_rule_classes() -> dict[str, type]:
    pyg = _import_pyg("decoding 'pyg' fields")

    class StoredRulesData(pyg.Data):
        """A ``Data`` decoded from a subclass whose batching rules differ from PyG's.

        ``__cat_dim__`` and ``__inc__`` return the values the original object's
        methods returned at encode time, for the attributes whose rules differed
        from ``Data``'s defaults; every other attribute follows ``Data``. The
        stored increments are constants: a transform that changes the node count
        of such a graph does not update them. A batch of such graphs keeps the
        first graph's cat dims (so ``to_data_list()`` works); a graph taken out of
        that batch knows its cat dims but not its custom increments, and raises
        :class:`~shardflow.errors.SampleError` if batched again.
        """

        def __cat_dim__(self, key: str, value: Any, *args: Any, **kwargs: Any) -> Any:
            cat_dim = _stored_cat_dim(self, key, None)
            if cat_dim != _DEFAULT:
                return cat_dim
            return super().__cat_dim__(key, value, *args, **kwargs)

        def __inc__(self, key: str, value: Any, *args: Any, **kwargs: Any) -> Any:
            inc = _stored_inc(self, key, None)
            if not isinstance(inc, str):
                return inc
            return super().__inc__(key, value, *args, **kwargs)

        def stores_as(self, data: Any) -> Any:
            _inherit_rules(self, data, pyg.Batch)
            return super().stores_as(data)

    class StoredRulesHeteroData(pyg.HeteroData):
        """A ``HeteroData`` decoded from a subclass whose batching rules differ.

        Rules are looked up by (node or edge type, attribute name); see
        :class:`StoredRulesData`.
        """

        def __cat_dim__(
            self, key: str, value: Any, store: Any = None, *args: Any, **kwargs: Any
        ) -> Any:
            cat_dim = _stored_cat_dim(self, key, store)
            if cat_dim != _DEFAULT:
                return cat_dim
            return super().__cat_dim__(key, value, store, *args, **kwargs)

        def __inc__(
            self, key: str, value: Any, store: Any = None, *args: Any, **kwargs: Any
        ) -> Any:
            inc = _stored_inc(self, key, store)
            if not isinstance(inc, str):
                return inc
            return super().__inc__(key, value, store, *args, **kwargs)

        def stores_as(self, data: Any) -> Any:
            _inherit_rules(self, data, pyg.Batch)
            return super().stores_as(data)

    for cls in (StoredRulesData, StoredRulesHeteroData):
        cls.__module__ = __name__
        cls.__qualname__ = cls.__name__
    return {cls.__name__: cls for cls in (StoredRulesData, StoredRulesHeteroData)}


def __getattr__(name: str) -> Any:
    # PEP 562: the StoredRules* classes exist once asked for, so that pickle (DataLoader
    # workers) finds them by name without this module importing PyG eagerly.
    if name in ("StoredRulesData", "StoredRulesHeteroData"):
        return _rule_classes()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def stored_rules(graph: Any) -> dict | None:
    """The stored batching rules of a decoded graph, or None for PyG's defaults.

    Returns:
        A dict ``{(store_key, attribute): (cat_dim, inc)}`` (``store_key`` is None
        for ``Data`` and for the global store of ``HeteroData``), or None.
    """
    return graph.__dict__.get(_RULES_ATTR)


# --------------------------------------------------------------------------------------
# Encoding.


def _type_name(value: Any) -> str:
    cls = type(value)
    return f"{cls.__module__}.{cls.__qualname__}"


class _Encoder:
    """Walks one graph, collecting tensors and the JSON document."""

    def __init__(self, data: Any, base: type, pyg: Any) -> None:
        self.data = data
        self.base = base  # Data or HeteroData: whose rules are the defaults
        self.exact = type(data) is base
        self.pyg = pyg
        self.tensors: dict[str, torch.Tensor] = {}
        self._storages: set[int] = set()
        self.custom: dict[str, list] = {}  # of the store being encoded

    # values --------------------------------------------------------------------------

    def value(self, value: Any, where: str) -> Any:
        cls = type(value)
        if cls in _SCALARS:
            return value
        if isinstance(value, torch.Tensor):
            return self.tensor(value, where)
        if cls is np.ndarray:
            if value.dtype.hasobject or value.dtype.kind not in "biufc":
                raise SampleError(
                    f"graph attribute {where!r} is a numpy array of dtype {value.dtype}, "
                    "which a 'pyg' field cannot store without pickle"
                )
            return {"ndarray": self.add(torch.from_numpy(np.ascontiguousarray(value)), where)}
        if cls is list or cls is tuple:
            items = [self.value(item, f"{where}[{i}]") for i, item in enumerate(value)]
            return {"list" if cls is list else "tuple": items}
        if cls is dict:
            out = {}
            for key, item in value.items():
                if type(key) is not str:
                    raise SampleError(
                        f"graph attribute {where!r} is a dict with key {key!r} of type "
                        f"{type(key).__name__}; a 'pyg' field stores dicts with str keys only"
                    )
                out[key] = self.value(item, f"{where}[{key!r}]")
            return {"dict": out}
        if cls.__name__ == "SparseTensor":
            raise SampleError(
                f"graph attribute {where!r} is a torch_sparse SparseTensor; a 'pyg' field "
                "stores dense tensors only: store its row, col and value tensors "
                "(for example as edge_index and edge_attr) instead"
            )
        raise SampleError(
            f"graph attribute {where!r} holds a {_type_name(value)}, which a 'pyg' field "
            "cannot store without pickle: use tensors, numpy arrays, str, int, float, "
            "bool, None, or lists, tuples and str-keyed dicts of these"
        )

    def tensor(self, value: torch.Tensor, where: str) -> dict:
        if value.layout != torch.strided or value.is_sparse:
            raise SampleError(
                f"graph attribute {where!r} is a sparse tensor (layout {value.layout}); "
                "a 'pyg' field stores dense tensors only: convert it with .to_dense() or "
                "store its indices and values as separate attributes"
            )
        if value.is_nested:
            raise SampleError(
                f"graph attribute {where!r} is a nested tensor; a 'pyg' field stores "
                "dense tensors only"
            )
        cls = type(value)
        if cls is torch.Tensor or cls is torch.nn.Parameter:
            return {"tensor": self.add(value, where)}
        if cls is self.pyg_edge_index():
            sparse_size = [value.sparse_size(0), value.sparse_size(1)]
            return {
                "edge_index": self.add(value.as_tensor(), where),
                "sparse_size": sparse_size,
                "sort_order": None if value.sort_order is None else str(value.sort_order),
                "is_undirected": bool(value.is_undirected),
            }
        if cls is self.pyg_index():
            return {
                "index": self.add(value.as_tensor(), where),
                "dim_size": value.dim_size,
                "is_sorted": bool(value.is_sorted),
            }
        raise SampleError(
            f"graph attribute {where!r} is a tensor subclass {_type_name(value)}, which a "
            "'pyg' field cannot store without pickle; store a plain torch.Tensor"
        )

    @staticmethod
    def pyg_edge_index() -> type:
        from torch_geometric import EdgeIndex

        return EdgeIndex

    @staticmethod
    def pyg_index() -> type:
        from torch_geometric import Index

        return Index

    def add(self, tensor: torch.Tensor, where: str) -> str:
        """Register one tensor as a safetensors entry holding only its own elements."""
        if tensor.dtype not in _ST_DTYPES.values():
            raise SampleError(
                f"graph attribute {where!r} has dtype {tensor.dtype}, which safetensors "
                f"cannot store (supported: {sorted(str(d) for d in _ST_DTYPES.values())})"
            )
        tensor = tensor.detach().cpu().resolve_conj().resolve_neg()
        nbytes = tensor.numel() * tensor.element_size()
        storage = tensor.untyped_storage()
        if (
            not tensor.is_contiguous()
            or tensor.storage_offset() != 0
            or storage.nbytes() != nbytes
            or (nbytes and storage.data_ptr() in self._storages)
        ):
            # A view into a larger storage (every graph of an InMemoryDataset), a
            # strided view, or memory already stored under another name: keep only
            # this tensor's own elements.
            tensor = tensor.clone(memory_format=torch.contiguous_format)
        if nbytes:
            self._storages.add(tensor.untyped_storage().data_ptr())
        name = str(len(self.tensors))
        self.tensors[name] = tensor
        return name

    # batching rules ----------------------------------------------------------------

    def rule(self, key: str, value: Any, store: Any, where: str) -> Any:
        """Record the batching rule(s) PyG's collate would ask the graph for."""
        if isinstance(value, torch.Tensor):
            return self.leaf(key, value, store, where, with_cat_dim=True)
        if isinstance(value, (int, float)):
            return self.leaf(key, value, store, where, with_cat_dim=False)
        if isinstance(value, Mapping):
            rules = {k: self.rule(k, v, store, f"{where}[{k!r}]") for k, v in value.items()}
            return {"dict": rules} if any(r is not None for r in rules.values()) else None
        if (
            isinstance(value, Sequence)
            and not isinstance(value, str)
            and len(value) > 0
            and isinstance(value[0], torch.Tensor)
        ):
            rules = [self.rule(key, v, store, f"{where}[{i}]") for i, v in enumerate(value)]
            return {"list": rules}
        return None

    def leaf(self, key: str, value: Any, store: Any, where: str, with_cat_dim: bool) -> Any:
        data = self.data
        try:
            cat_dim = data.__cat_dim__(key, value, store) if with_cat_dim else None
            inc = data.__inc__(key, value, store)
        except Exception as exc:  # PyG would fail the same way when batching it
            logger.debug("no batching rule for graph attribute %r: %s", where, exc)
            return None
        rule = [self.inc(inc, where)]
        if with_cat_dim:
            rule.insert(0, self.cat_dim(cat_dim, where))
        if self.exact:
            return rule
        try:
            default = [self.inc(self.base.__inc__(data, key, value, store), where)]
            if with_cat_dim:
                default.insert(0, self.base.__cat_dim__(data, key, value, store))
        except Exception:  # the default cannot even be computed: keep the stored rule
            default = None
        text = _canonical(rule)
        if default is None or _canonical(default) != text:
            if _canonical(self.custom.setdefault(key, rule)) != text:
                raise SampleError(
                    f"graph attribute name {key!r} (at {where!r}) has two different "
                    "custom batching rules in one store; a 'pyg' field keeps one rule "
                    "per attribute name"
                )
        return rule

    @staticmethod
    def cat_dim(cat_dim: Any, where: str) -> Any:
        if cat_dim is None or type(cat_dim) is int:
            return cat_dim
        raise SampleError(
            f"__cat_dim__ returned {cat_dim!r} for graph attribute {where!r}; a 'pyg' field "
            "supports an int or None"
        )

    @staticmethod
    def inc(inc: Any, where: str) -> Any:
        if type(inc) in (int, float, bool):
            return inc
        dtype_name = str(inc.dtype).removeprefix("torch.") if isinstance(inc, torch.Tensor) else ""
        if dtype_name in _INLINE_DTYPES:
            flat = inc.detach().cpu().reshape(-1).tolist()
            return {"tensor_value": [dtype_name, list(inc.shape), flat]}
        raise SampleError(
            f"__inc__ returned a {_type_name(inc)} for graph attribute {where!r}; a 'pyg' "
            "field supports int, float, bool or a real-valued tensor"
        )

    # stores --------------------------------------------------------------------------

    def store(self, store: Any) -> dict:
        key = store._key
        label = "data" if key is None else f"data[{key!r}]"
        attrs: dict[str, Any] = {}
        rules: dict[str, Any] = {}
        self.custom = {}
        for name, value in store.items():
            if type(name) is not str:
                raise SampleError(f"{label} has an attribute name {name!r} that is not a str")
            where = f"{label}.{name}"
            attrs[name] = self.value(value, where)
            rule = self.rule(name, value, store, where)
            if rule is not None:
                rules[name] = rule
        entry: dict[str, Any] = {"key": list(key) if isinstance(key, tuple) else key}
        if isinstance(store, self.pyg.storage.NodeStorage):
            try:
                num_nodes = store.num_nodes
            except Exception as exc:
                logger.debug("cannot infer num_nodes of %s: %s", label, exc)
                num_nodes = None
            entry["num_nodes"] = num_nodes if type(num_nodes) is int else None
        entry["attrs"] = attrs
        entry["rules"] = rules
        if self.custom:
            entry["custom"] = self.custom
        return entry


def _canonical(obj: Any) -> str:
    """JSON text that tells 1, 1.0 and True apart (for comparing rules)."""
    return json.dumps(obj, separators=(",", ":"))


def encode_graph(data: Any) -> bytes:
    """Encode one graph as the bytes of a ``pyg`` field (safetensors + JSON, no pickle).

    Args:
        data: a ``torch_geometric.data.Data`` or ``HeteroData`` (or a subclass). Its
            attributes may be tensors of any dtype safetensors stores (float64/32/16,
            bfloat16, int64/32/16/8, uint8/16/32/64, bool, complex64, float8), of any
            shape including 0-dim and empty, PyG ``EdgeIndex`` / ``Index``, numpy arrays
            of numbers, and str, int, float, bool, None, or lists, tuples and str-keyed
            dicts of all these. Tensors are stored detached and on the CPU; a
            ``torch.nn.Parameter`` comes back as a plain tensor.

    Returns:
        The encoded bytes. A tensor that is a view into a larger storage (every graph
        taken from an ``InMemoryDataset``) is stored by its own elements only, so the
        size is proportional to the graph itself. Encoding is deterministic.

    Raises:
        ImportError: torch_geometric or safetensors is not installed.
        SampleError: (a ``ValueError``) ``data`` is not a ``Data`` / ``HeteroData``, or
            an attribute cannot be stored without pickle (sparse tensors,
            ``SparseTensor``, arbitrary objects, unsupported dtypes); the message
            names the attribute.
    """
    pyg = _import_pyg("encoding 'pyg' fields")
    try:
        import safetensors.torch as st
    except ImportError as exc:
        raise missing_dependency("safetensors", "graphs", "encoding 'pyg' fields") from exc

    if isinstance(data, pyg.HeteroData):
        kind, base = "HeteroData", pyg.HeteroData
    elif isinstance(data, pyg.Data):
        kind, base = "Data", pyg.Data
    else:
        raise SampleError(
            f"cannot encode a {_type_name(data)} as a 'pyg' field: expected a "
            "torch_geometric.data.Data or HeteroData"
        )
    encoder = _Encoder(data, base, pyg)
    with warnings.catch_warnings():
        # Rule and num_nodes inference may warn ("Unable to accurately infer
        # 'num_nodes'"); those warnings belong to batching time, not to encoding.
        warnings.simplefilter("ignore")
        stores = [encoder.store(store) for store in data.stores]
    header: dict[str, Any] = {"version": SCHEMA_VERSION, "kind": kind}
    if type(data) is not base:
        header["class"] = _type_name(data)
    header["stores"] = stores
    metadata = {SCHEMA_KEY: json.dumps(header, separators=(",", ":"), allow_nan=True)}
    return st.save(encoder.tensors, metadata=metadata)


# --------------------------------------------------------------------------------------
# Decoding.


def _read_safetensors(buf: Any) -> tuple[dict, dict[str, torch.Tensor]]:
    """Parse a safetensors container from memory, strictly.

    The layout is safetensors' own (8-byte little-endian header length, JSON header,
    data section that the tensors tile exactly); it is read here rather than with
    ``safetensors.torch.load`` because that function does not return the metadata
    (the graph schema) and costs more per small graph than this whole reader.

    Returns the metadata dict and the tensors. The tensors are views into one
    private, writable copy of the data section (so a graph's tensors cost one
    allocation). Raises ValueError/TypeError/KeyError on malformed input.
    """
    view = memoryview(buf)
    if view.ndim != 1 or view.itemsize != 1:
        view = view.cast("B")
    size = len(view)
    if size < 8:
        raise ValueError(f"{size} bytes is shorter than a safetensors header")
    header_len = int.from_bytes(view[:8], "little")
    if header_len > size - 8:
        raise ValueError(f"header length {header_len} exceeds the {size - 8} bytes that follow")
    header = json.loads(str(view[8 : 8 + header_len], "utf-8"))
    if type(header) is not dict:
        raise ValueError("safetensors header is not a JSON object")
    metadata = header.pop("__metadata__", None)
    if type(metadata) is not dict:
        raise ValueError("safetensors header has no __metadata__ (not a shardflow graph)")
    data = bytearray(view[8 + header_len :])
    size = len(data)
    spans = []
    tensors: dict[str, torch.Tensor] = {}
    native = sys.byteorder == "little"
    for name, info in header.items():
        dtype = _ST_DTYPES[info["dtype"]]
        shape = info["shape"]
        start, end = info["data_offsets"]
        if type(shape) is not list or type(start) is not int or type(end) is not int:
            raise ValueError(f"tensor {name!r} has an invalid shape or data offsets")
        np_dtype = _NP_DTYPES.get(dtype)
        if np_dtype is not None and native and start % np_dtype.itemsize == 0:
            # The common case, and the cheapest zero-copy view on the buffer; numpy
            # refuses negative dims, negative offsets and views past the end.
            array = np.ndarray(shape, np_dtype, data, start)
            tensor = torch.from_numpy(array)
            if array.nbytes != end - start:
                raise ValueError(
                    f"tensor {name!r}: shape {shape} and dtype {dtype} do not fit data "
                    f"offsets {[start, end]}"
                )
        else:
            tensor = _tensor_without_numpy(data, shape, dtype, start, end, native)
        spans.append((start, end))
        tensors[name] = tensor
    spans.sort()
    reached = 0
    for start, end in spans:
        if start != reached:
            raise ValueError("safetensors data section has holes or overlapping tensors")
        reached = end
    if reached != size:
        raise ValueError(f"safetensors data section has {size - reached} trailing bytes")
    return metadata, tensors


def _tensor_without_numpy(
    data: bytearray, shape: list, dtype: torch.dtype, start: int, end: int, native: bool
) -> torch.Tensor:
    """A tensor numpy cannot view in place (bfloat16, float8, misaligned, big-endian host)."""
    nbytes = math.prod(shape) * dtype.itemsize
    if (shape and min(shape) < 0) or not 0 <= start <= end <= len(data) or nbytes != end - start:
        raise ValueError(f"shape {shape} and dtype {dtype} do not fit data offsets {[start, end]}")
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    if start % dtype.itemsize or not native:
        return _tensor_from_bytes(bytes(data[start:end]), dtype).view(shape)
    count = nbytes // dtype.itemsize
    return torch.frombuffer(data, dtype=dtype, count=count, offset=start).view(shape)


def _tensor_from_bytes(
    raw: bytes, dtype: torch.dtype, byteorder: str = sys.byteorder
) -> torch.Tensor:
    """A 1-D tensor from little-endian bytes, on any alignment and host byte order."""
    tensor = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    if byteorder != "little" and dtype.itemsize > 1:
        tensor = tensor.view(-1, dtype.itemsize).flip(1).reshape(-1)
    return tensor.view(dtype)


class _Decoder:
    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def value(self, enc: Any) -> Any:
        if type(enc) is not dict:
            if type(enc) in _SCALARS:
                return enc
            raise ValueError(f"unexpected value {enc!r} in the graph schema")
        name = enc.get("tensor")
        if name is not None:
            return self.tensors[name]
        if "list" in enc:
            return [self.value(v) for v in enc["list"]]
        if "dict" in enc:
            return {str(k): self.value(v) for k, v in enc["dict"].items()}
        if "tuple" in enc:
            return tuple(self.value(v) for v in enc["tuple"])
        if "ndarray" in enc:
            return self.tensors[enc["ndarray"]].numpy()
        if "edge_index" in enc:
            from torch_geometric import EdgeIndex

            return EdgeIndex(
                self.tensors[enc["edge_index"]],
                sparse_size=tuple(enc["sparse_size"]),
                sort_order=enc["sort_order"],
                is_undirected=bool(enc["is_undirected"]),
            )
        if "index" in enc:
            from torch_geometric import Index

            return Index(
                self.tensors[enc["index"]],
                dim_size=enc["dim_size"],
                is_sorted=bool(enc["is_sorted"]),
            )
        raise ValueError(f"unknown value tag {sorted(enc)!r} in the graph schema")

    @staticmethod
    def inc(enc: Any) -> Any:
        if type(enc) is dict:
            dtype_name, shape, flat = enc["tensor_value"]
            return torch.tensor(flat, dtype=_INLINE_DTYPES[dtype_name]).reshape(shape)
        if type(enc) in (int, float, bool):
            return enc
        raise ValueError(f"invalid increment {enc!r} in the graph schema")

    def custom_rule(self, name: str, leaf: Any) -> tuple[Any, Any]:
        """``(cat_dim, inc)`` of a stored custom rule; cat_dim is _DEFAULT for numbers."""
        if type(leaf) is not list or len(leaf) not in (1, 2):
            raise ValueError(f"invalid custom rule {leaf!r} for {name!r}")
        if len(leaf) == 1:
            return _DEFAULT, self.inc(leaf[0])
        cat_dim = leaf[0]
        if cat_dim is not None and type(cat_dim) is not int:
            raise ValueError(f"invalid cat_dim {cat_dim!r} for {name!r}")
        return cat_dim, self.inc(leaf[1])


def _store_key_from_json(key: Any) -> Any:
    if key is None or type(key) is str:
        return key
    if type(key) is list and len(key) == 3 and all(type(k) is str for k in key):
        return tuple(key)
    raise ValueError(f"invalid store key {key!r}")


def _build(schema: dict, tensors: dict[str, torch.Tensor], pyg: Any) -> Any:
    if type(schema) is not dict:
        raise ValueError("graph schema is not a JSON object")
    version = schema.get("version")
    if version != SCHEMA_VERSION:
        raise ValueError(
            f"graph schema version {version!r} is not supported (this shardflow reads "
            f"version {SCHEMA_VERSION})"
        )
    kind = schema["kind"]
    stores = schema["stores"]
    decoder = _Decoder(tensors)
    rules: dict = {}
    for store in stores:
        custom = store.get("custom")
        if custom:
            skey = _store_key_from_json(store["key"])
            for name, leaf in custom.items():
                rules[(skey, name)] = decoder.custom_rule(name, leaf)

    if kind == "Data":
        if len(stores) != 1 or stores[0]["key"] is not None:
            raise ValueError("a Data graph has exactly one store, with key null")
        data = _rule_classes()["StoredRulesData"]() if rules else pyg.Data()
        mapping = data._store._mapping  # a fresh store: no cache to invalidate
        for name, enc in stores[0]["attrs"].items():
            if type(enc) is dict and "tensor" in enc:
                mapping[name] = tensors[enc["tensor"]]
            else:
                value = decoder.value(enc)
                if value is not None:
                    mapping[name] = value
    elif kind == "HeteroData":
        cls = _rule_classes()["StoredRulesHeteroData"] if rules else pyg.HeteroData
        data = cls()
        for entry in stores:
            skey = _store_key_from_json(entry["key"])
            if skey is None:
                store = data._global_store
            elif type(skey) is str:
                store = data.get_node_store(skey)
            else:
                store = data.get_edge_store(*skey)
            for name, enc in entry["attrs"].items():
                store[name] = decoder.value(enc)
    else:
        raise ValueError(f"unknown graph kind {kind!r} (expected 'Data' or 'HeteroData')")
    if rules:
        data.__dict__[_RULES_ATTR] = rules
    return data


def decode_graph(buf: bytes | bytearray | memoryview) -> Any:
    """Decode the bytes of a ``pyg`` field back into a graph, without pickle.

    Args:
        buf: bytes written by :func:`encode_graph`.

    Returns:
        A ``torch_geometric.data.Data`` or ``HeteroData`` with every attribute of the
        original: tensors with the same dtype and shape (CPU, writable, views into
        one buffer private to this graph), and the same non-tensor values. When the
        original's batching rules differed from PyG's defaults (a ``Data`` subclass
        with its own ``__inc__`` / ``__cat_dim__``), a :class:`StoredRulesData` /
        :class:`StoredRulesHeteroData` that applies them (see the module docstring).

    Raises:
        ImportError: torch_geometric is not installed.
        DecodeError: the bytes are not a valid ``pyg`` field (truncated, corrupt,
            not safetensors, no or unknown graph schema).
    """
    pyg = _import_pyg("decoding 'pyg' fields")
    try:
        metadata, tensors = _read_safetensors(buf)
        text = metadata.get(SCHEMA_KEY)
        if type(text) is not str:
            raise ValueError(f"safetensors metadata has no {SCHEMA_KEY!r} entry")
        return _build(json.loads(text), tensors, pyg)
    except (ValueError, TypeError, KeyError, IndexError, AttributeError, RuntimeError,
            OverflowError, RecursionError) as exc:
        size = len(buf) if hasattr(buf, "__len__") else "?"
        raise DecodeError(f"invalid 'pyg' field ({size} bytes): {exc}") from exc
