"""Decoding the bytes of a ``pyg`` field into a PyG graph (see :mod:`shardflow.graph.codec`)."""

from __future__ import annotations

import json
import math
import sys
from typing import Any

import numpy as np
import torch

from shardflow.compat.pyg import data_attributes, global_store
from shardflow.errors import DecodeError
from shardflow.format.limits import MAX_GRAPH_EDGES, MAX_GRAPH_NODES

from .bounds import check_graph
from .rules import DEFAULT_RULE, RULES_ATTR, import_pyg, rule_classes
from .schema import INLINE_DTYPES, NP_DTYPES, SCALARS, SCHEMA_KEY, SCHEMA_VERSION, ST_DTYPES

__all__ = ["check_tiling", "decode_graph", "entry_layout", "read_header"]


def read_header(buf: Any) -> tuple[memoryview, dict, dict, int]:
    """Parse the frame and JSON header of a safetensors container, strictly.

    The layout is safetensors' own (8-byte little-endian header length, JSON header,
    data section that the tensors tile exactly); it is read here rather than with
    ``safetensors.torch.load`` because that function does not return the metadata
    (the graph schema) and costs more per small graph than this whole reader.

    Returns:
        ``(view, metadata, entries, data_start)``: the bytes as a flat ``memoryview``,
        the ``__metadata__`` dict, the tensor entries ``{name: info}`` (not yet
        checked: see :func:`entry_layout`) and the offset of the data section in
        ``view``.

    Raises:
        ValueError: the frame or header is malformed, or has no ``__metadata__``.
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
    return view, metadata, header, 8 + header_len


def entry_layout(name: str, info: Any) -> tuple[torch.dtype, list, int, int]:
    """``(dtype, shape, start, end)`` of one header entry, its types checked.

    Raises:
        ValueError: an unknown dtype, or a shape or offsets that are not a list / ints.
    """
    dtype = ST_DTYPES.get(info.get("dtype")) if type(info) is dict and type(info.get("dtype")) is str else None
    if dtype is None:
        raise ValueError(f"tensor {name!r} has an unknown dtype {str(info.get('dtype') if type(info) is dict else info)[:40]!r} "
                         f"(known: {', '.join(sorted(ST_DTYPES))})")
    shape = info["shape"]
    start, end = info["data_offsets"]
    if type(shape) is not list or type(start) is not int or type(end) is not int:
        raise ValueError(f"tensor {name!r} has an invalid shape or data offsets")
    return dtype, shape, start, end


def check_tiling(spans: list[tuple[int, int]], size: int) -> None:
    """The tensors' ``(start, end)`` spans tile a data section of ``size`` bytes exactly.

    Raises:
        ValueError: holes, overlaps or trailing bytes.
    """
    spans.sort()
    reached = 0
    for start, end in spans:
        if start != reached:
            raise ValueError("safetensors data section has holes or overlapping tensors")
        reached = end
    if reached != size:
        raise ValueError(f"safetensors data section has {size - reached} trailing bytes")


def _read_safetensors(buf: Any) -> tuple[dict, dict[str, torch.Tensor]]:
    """Parse a safetensors container from memory, strictly (see :func:`read_header`).

    Returns the metadata dict and the tensors. The tensors are views into one
    private, writable copy of the data section (so a graph's tensors cost one
    allocation). Raises ValueError/TypeError/KeyError on malformed input.
    """
    view, metadata, header, data_start = read_header(buf)
    data = bytearray(view[data_start:])
    spans = []
    tensors: dict[str, torch.Tensor] = {}
    native = sys.byteorder == "little"
    for name, info in header.items():
        dtype, shape, start, end = entry_layout(name, info)
        np_dtype = NP_DTYPES.get(dtype)
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
    check_tiling(spans, len(data))
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
            if type(enc) in SCALARS:
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
            return torch.tensor(flat, dtype=INLINE_DTYPES[dtype_name]).reshape(shape)
        if type(enc) in (int, float, bool):
            return enc
        raise ValueError(f"invalid increment {enc!r} in the graph schema")

    def custom_rule(self, name: str, leaf: Any) -> tuple[Any, Any]:
        """``(cat_dim, inc)`` of a stored custom rule; cat_dim is DEFAULT_RULE for numbers."""
        if type(leaf) is not list or len(leaf) not in (1, 2):
            raise ValueError(f"invalid custom rule {leaf!r} for {name!r}")
        if len(leaf) == 1:
            return DEFAULT_RULE, self.inc(leaf[0])
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
        data = rule_classes()["StoredRulesData"]() if rules else pyg.Data()
        mapping = data_attributes(data)  # a fresh store: no cache to invalidate
        for name, enc in stores[0]["attrs"].items():
            if type(enc) is dict and "tensor" in enc:
                mapping[name] = tensors[enc["tensor"]]
            else:
                value = decoder.value(enc)
                if value is not None:
                    mapping[name] = value
    elif kind == "HeteroData":
        cls = rule_classes()["StoredRulesHeteroData"] if rules else pyg.HeteroData
        data = cls()
        for entry in stores:
            skey = _store_key_from_json(entry["key"])
            if skey is None:
                store = global_store(data)
            elif type(skey) is str:
                store = data.get_node_store(skey)
            else:
                store = data.get_edge_store(*skey)
            for name, enc in entry["attrs"].items():
                store[name] = decoder.value(enc)
    else:
        raise ValueError(f"unknown graph kind {kind!r} (expected 'Data' or 'HeteroData')")
    if rules:
        data.__dict__[RULES_ATTR] = rules
    return data


def decode_graph(
    buf: bytes | bytearray | memoryview, *, max_nodes: int = MAX_GRAPH_NODES, max_edges: int = MAX_GRAPH_EDGES
) -> Any:
    """Decode the bytes of a ``pyg`` field back into a graph, without pickle.

    Args:
        buf: bytes written by :func:`encode_graph`.
        max_nodes: the most nodes a graph (or node type) may declare or imply
            through an ``edge_index`` id (``DecodeOptions.max_graph_nodes``).
        max_edges: the most edges an ``edge_index`` may hold
            (``DecodeOptions.max_graph_edges``).

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
            not safetensors, no or unknown graph schema), or the graph is over
            a limit or holds node ids outside its nodes (see :mod:`.bounds`).
    """
    pyg = import_pyg("decoding 'pyg' fields")
    try:
        metadata, tensors = _read_safetensors(buf)
        text = metadata.get(SCHEMA_KEY)
        if type(text) is not str:
            raise ValueError(f"safetensors metadata has no {SCHEMA_KEY!r} entry")
        graph = _build(json.loads(text), tensors, pyg)
        check_graph(graph, max_nodes=max_nodes, max_edges=max_edges)
        return graph
    except (ValueError, TypeError, KeyError, IndexError, AttributeError, RuntimeError,
            OverflowError, RecursionError) as exc:
        size = len(buf) if hasattr(buf, "__len__") else "?"
        raise DecodeError(f"invalid 'pyg' field ({size} bytes): {exc}") from exc
