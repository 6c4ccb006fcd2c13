"""Encoding one PyG graph as the bytes of a ``pyg`` field (see :mod:`shardflow.graph.codec`)."""

from __future__ import annotations

import json
import logging
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from shardflow.compat.pyg import store_key
from shardflow.errors import SampleError, missing_dependency

from .rules import import_pyg
from .schema import INLINE_DTYPES, SCALARS, SCHEMA_KEY, SCHEMA_VERSION, ST_DTYPES

__all__ = ["encode_graph"]

logger = logging.getLogger(__name__)



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
        if cls in SCALARS:
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
        if tensor.dtype not in ST_DTYPES.values():
            raise SampleError(
                f"graph attribute {where!r} has dtype {tensor.dtype}, which safetensors "
                f"cannot store (supported: {sorted(str(d) for d in ST_DTYPES.values())})"
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
        if dtype_name in INLINE_DTYPES:
            flat = inc.detach().cpu().reshape(-1).tolist()
            return {"tensor_value": [dtype_name, list(inc.shape), flat]}
        raise SampleError(
            f"__inc__ returned a {_type_name(inc)} for graph attribute {where!r}; a 'pyg' "
            "field supports int, float, bool or a real-valued tensor"
        )

    # stores --------------------------------------------------------------------------

    def store(self, store: Any) -> dict:
        key = store_key(store)
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
    pyg = import_pyg("encoding 'pyg' fields")
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
