"""Graph fields decoded for batching: checked arrays that one collate turns into a ``Batch``.

When a loader's default collate batches the samples, building one ``Data`` per graph
and then taking it apart again in ``Batch.from_data_list`` is per-sample work that a
batch can do once. :func:`decode_graph_record` parses and checks a ``pyg`` field as
:func:`~shardflow.graph.decode_graph` does (the same header and schema, the same
limits on nodes, edges and node ids), but for the common layout (a plain ``Data``
whose attributes are all dense tensors of a dtype numpy has) it returns a
:class:`GraphRecord`: the attribute names and numpy views of the tensors in the
field's bytes, and the graph's node count. :func:`collate_records` concatenates the
records of a batch straight into one ``Batch`` (one ``numpy.concatenate`` per
attribute, the ``edge_index`` increments added in one step, ``batch`` and ``ptr``
from the node counts), equal to ``Batch.from_data_list`` on the decoded graphs: same
keys in the same order, dtypes, values, ``_slice_dict``, ``_inc_dict``, so
``to_data_list()`` works. Everything runs in the calling thread (numpy), whatever
torch's intra-op thread count.

Every other field (``HeteroData``, stored custom rules, numbers, strings or nested
values among the attributes, names that PyG batches by their data such as
``*batch*``, ``ptr`` and ``num_nodes``, bfloat16, ...), and every field that fails a
check, goes through :func:`~shardflow.graph.decode_graph`, so its errors are exactly
those of the ordinary decode. A batch of records that do not line up (different
attributes, dtypes or feature sizes) is left to the ordinary collate, which raises
its usual error.
"""

from __future__ import annotations

import json
import struct
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from shardflow.compat.pyg import data_attributes, set_batch_slices
from shardflow.format.limits import MAX_GRAPH_EDGES, MAX_GRAPH_NODES

from .bounds import NODE_LEVEL
from .collate import N_KEYS, cumsum_list, default_rule, int64_tensor, new_batch
from .decode import check_tiling, decode_graph, entry_layout, read_header
from .headers import ARRAY_DTYPES, learn, match
from .rules import import_pyg
from .schema import SCHEMA_KEY, SCHEMA_VERSION

__all__ = ["GraphRecord", "collate_records", "decode_graph_record"]

# Names by which PyG's NodeStorage.can_infer_num_nodes answers True (besides "*node*").
_INFER_KEYS = frozenset({"num_nodes", "x", "pos", "batch", "adj", "adj_t", "edge_index", "face"})
_INT64 = np.dtype("<i8")
_PYG: list[bool] = []  # [True] once torch_geometric imported
_UINT64 = np.dtype("<u8")
_MAX = np.maximum.reduce  # (ndarray.max() without its Python wrapper)
_U64 = struct.Struct("<Q").unpack_from
_LITTLE = sys.byteorder == "little"


class GraphRecord:
    """One checked ``pyg`` field of the common layout, ready to be batched.

    Attributes:
        buf: the field's bytes (the arrays are read-only views into them).
        names: the attribute names (a tuple), in the graph's order.
        arrays: one numpy array per name (a sequence), the tensor's dtype and shape.
        num_nodes: PyG's ``num_nodes`` of the graph (rows of its first node-level tensor).
        can_infer: PyG's ``can_infer_num_nodes`` (whether a batch gets ``batch`` / ``ptr``).
        max_nodes: the ``max_nodes`` limit the field was checked against.
        max_edges: the ``max_edges`` limit the field was checked against.
    """

    __slots__ = ("arrays", "buf", "can_infer", "max_edges", "max_nodes", "names", "num_nodes")

    def __init__(self, buf: Any, names: tuple[str, ...], arrays: Sequence[np.ndarray], num_nodes: int, can_infer: bool,
                 max_nodes: int, max_edges: int) -> None:
        self.buf = buf
        self.names = names
        self.arrays = arrays
        self.num_nodes = num_nodes
        self.can_infer = can_infer
        self.max_nodes = max_nodes
        self.max_edges = max_edges

    def build(self) -> Any:
        """The graph itself: what :func:`~shardflow.graph.decode_graph` returns for the field."""
        return decode_graph(self.buf, max_nodes=self.max_nodes, max_edges=self.max_edges)

    def __repr__(self) -> str:
        shapes = ", ".join(f"{n}={list(a.shape)}" for n, a in zip(self.names, self.arrays))
        return f"GraphRecord({shapes}, num_nodes={self.num_nodes})"


def decode_graph_record(
    buf: bytes | bytearray | memoryview, *, max_nodes: int = MAX_GRAPH_NODES, max_edges: int = MAX_GRAPH_EDGES
) -> Any:
    """Decode a ``pyg`` field for batching: a :class:`GraphRecord`, or the graph itself.

    Args:
        buf: bytes written by :func:`~shardflow.graph.encode_graph`; kept by the record.
        max_nodes: as for :func:`~shardflow.graph.decode_graph`.
        max_edges: as for :func:`~shardflow.graph.decode_graph`.

    Returns:
        A :class:`GraphRecord` for a plain ``Data`` of dense numpy-dtype tensors that
        passes every check of ``decode_graph``; otherwise ``decode_graph(buf, ...)``
        (a ``Data`` / ``HeteroData``).

    Raises:
        ImportError: torch_geometric is not installed.
        DecodeError: as :func:`~shardflow.graph.decode_graph` (which decides every
            field that is not a record).
    """
    if not _PYG:
        import_pyg("decoding 'pyg' fields")
        _PYG.append(True)
    try:
        record = _record(buf, max_nodes, max_edges)
    except (ValueError, TypeError, KeyError, IndexError, AttributeError, OverflowError, RecursionError):
        record = None  # decode_graph reports it
    return record if record is not None else decode_graph(buf, max_nodes=max_nodes, max_edges=max_edges)


def _schema_attrs(metadata: dict) -> dict | None:
    """The attrs of the one store of a plain ``Data`` schema without custom rules, or None."""
    text = metadata.get(SCHEMA_KEY)
    if type(text) is not str:
        return None
    schema = json.loads(text)
    if type(schema) is not dict or schema.get("version") != SCHEMA_VERSION or schema.get("kind") != "Data":
        return None
    stores = schema.get("stores")
    if type(stores) is not list or len(stores) != 1 or type(stores[0]) is not dict:
        return None
    store = stores[0]
    attrs = store.get("attrs")
    if "key" not in store or store["key"] is not None or store.get("custom") or type(attrs) is not dict:
        return None
    return attrs


def _record(buf: Any, max_nodes: int, max_edges: int) -> GraphRecord | None:
    if not _LITTLE:
        return None
    if type(buf) is bytes:  # (the common case: numpy and struct read bytes as they are)
        view = buf
    else:
        view = memoryview(buf)
        if view.ndim != 1 or view.itemsize != 1:
            view = view.cast("B")
    if len(view) < 8:
        return None
    (header_len,) = _U64(view)
    if header_len > len(view) - 8:
        return None
    text = view[8 : 8 + header_len] if view is buf else bytes(view[8 : 8 + header_len])
    found = match(text)
    if found is not None:  # a layout seen before: its numbers are all that is new
        template, numbers = found
        data_start = 8 + header_len
        arrays = []
        for np_dtype, shape, s, e in template.entries:  # (_entry_arrays, for numbers known to be >= 0)
            start = numbers[s]
            array = np.ndarray(shape(numbers), np_dtype, view, data_start + start)  # numpy checks it fits
            if array.nbytes != numbers[e] - start:
                return None
            arrays.append(array)
        if not template.tiles(numbers, len(view) - data_start):  # (in another order, or not at all)
            check_tiling([(numbers[s], numbers[e]) for _, _, s, e in template.entries], len(view) - data_start)
        return _finish(buf, template.names, template.attr_entries(arrays), max_nodes, max_edges)
    record = _parsed_record(buf, max_nodes, max_edges)
    if record is not None:
        learn(text)
    return record


def _entry_arrays(view: memoryview, data_start: int, layouts: list[tuple]) -> list[np.ndarray] | None:
    """The entries' arrays, views into ``view``; None where a shape does not fit its offsets.

    Raises:
        ValueError: the offsets do not tile the data section (see :func:`check_tiling`).
    """
    arrays = []
    spans = []
    for np_dtype, shape, start, end in layouts:
        if np_dtype is None or start < 0:
            return None
        array = np.ndarray(shape, np_dtype, view, data_start + start)  # numpy checks it fits the buffer
        if array.nbytes != end - start:
            return None
        spans.append((start, end))
        arrays.append(array)
    check_tiling(spans, len(view) - data_start)
    return arrays


def _parsed_record(buf: Any, max_nodes: int, max_edges: int) -> GraphRecord | None:
    """The record of a header parsed with json (a layout not seen before)."""
    view, metadata, header, data_start = read_header(buf)
    attrs = _schema_attrs(metadata)
    if attrs is None:
        return None
    layouts = []
    for entry, info in header.items():
        dtype, shape, start, end = entry_layout(entry, info)
        layouts.append((ARRAY_DTYPES.get(dtype), shape, start, end))
    arrays = _entry_arrays(view, data_start, layouts)
    if arrays is None:
        return None
    entries = dict(zip(header, arrays))
    names = []
    chosen = []
    for name, enc in attrs.items():
        if type(enc) is not dict or len(enc) != 1 or "batch" in name or name == "ptr" or name == "num_nodes":
            return None
        entry = enc.get("tensor")
        if type(entry) is not str:
            return None
        names.append(name)
        chosen.append(entries[entry])
    return _finish(buf, tuple(names), chosen, max_nodes, max_edges)


def _finish(buf: Any, names: tuple[str, ...], arrays: Sequence[np.ndarray], max_nodes: int, max_edges: int) -> GraphRecord | None:
    """The record, after the bounds checks of :func:`~shardflow.graph.bounds.check_graph`;
    None where the graph might not pass them (then ``decode_graph`` decides and names the
    problem) or where PyG would infer its node count otherwise."""
    plan = _PLANS.get(names)
    if plan is None:
        plan = _PLANS[names] = _plan(names)
    node_level, edges, first_n_key, can_infer = plan
    nodes = None
    for k in node_level:  # check_graph's declared node count: rows of the first of NODE_LEVEL
        if arrays[k].ndim:
            nodes = arrays[k].shape[0]
            break
    if nodes is not None and nodes > max_nodes:
        return None
    if edges is not None:
        ids = arrays[edges]
        if ids.dtype != _INT64 or ids.ndim != 2 or ids.shape[0] != 2 or ids.shape[1] > max_edges:
            return None
        # One reduction: as uint64 a negative id is above every bound.
        if ids.size and int(_MAX(ids.view(_UINT64), None)) >= (max_nodes if nodes is None else min(nodes, max_nodes)):
            return None
    if first_n_key is None or not arrays[first_n_key].ndim:
        return None  # PyG infers the node count otherwise (and warns): the graph decides
    return GraphRecord(buf, names, arrays, arrays[first_n_key].shape[0], can_infer, max_nodes, max_edges)


_PLANS: dict[tuple[str, ...], tuple] = {}


def _plan(names: tuple[str, ...]) -> tuple:
    """``(indices of NODE_LEVEL names in their order, index of edge_index, index of the first
    N_KEYS name (PyG's NodeStorage.num_nodes takes its rows), can_infer_num_nodes)``."""
    node_level = [names.index(n) for n in NODE_LEVEL if n in names]
    edges = names.index("edge_index") if "edge_index" in names else None
    first_n_key = next((k for k, n in enumerate(names) if n in N_KEYS), None)
    can_infer = any(n in _INFER_KEYS or "node" in n for n in names)
    if len(_PLANS) > 1024:
        _PLANS.clear()
    return node_level, edges, first_n_key, can_infer


def collate_records(
    records: list[GraphRecord], *, follow_batch: set[str] | frozenset[str] = frozenset(),
    exclude_keys: set[str] | frozenset[str] = frozenset(),
) -> Any:
    """One ``Batch`` of the records' graphs, equal to ``Batch.from_data_list`` on them.

    Args:
        records: the records of one batch (at least one).
        follow_batch: attributes that also get ``<attr>_batch`` and ``<attr>_ptr``.
        exclude_keys: attributes left out.

    Returns:
        A ``DataBatch`` (tensors int64 ``batch`` of shape ``(num_nodes,)`` and ``ptr``
        of shape ``(num_graphs + 1,)`` included), or None when the records do not line
        up (attribute names, dtypes or shapes differ, an increment on a tensor that is
        not int64, an empty attribute): the caller collates the graphs themselves,
        which gives PyG's result or its error.
    """
    try:
        return _collate_records(records, follow_batch, exclude_keys)
    except (ValueError, IndexError):  # shapes that do not concatenate: the graphs' collate says why
        return None


def _collate_records(records: list[GraphRecord], follow: Any, exclude: Any) -> Any:
    first = records[0]
    names = first.names
    if any(r.names is not names and r.names != names for r in records):  # (one layout: the same tuple)
        return None
    pyg = import_pyg("collating graphs")
    n = len(records)
    num_nodes = [r.num_nodes for r in records]
    node_incs = cumsum_list(num_nodes[:-1])
    out = new_batch(pyg.Data, pyg)
    mapping = data_attributes(out)
    slice_dict: dict[str, Any] = {}
    inc_dict: dict[str, Any] = {}
    for j, name in enumerate(names):
        if name in exclude:
            continue
        arrays = [r.arrays[j] for r in records]
        dtype = arrays[0].dtype
        if any(a.dtype is not dtype and a.dtype != dtype for a in arrays):  # (numpy's dtypes are mostly singletons)
            return None  # torch's type promotion: the graphs' collate does it
        cat_dim, by_nodes = default_rule(name)
        stack = arrays[0].ndim == 0
        if stack:
            sizes = [1] * n
            value = np.stack(arrays)
        else:
            sizes = [a.shape[cat_dim] for a in arrays]
            value = np.concatenate(arrays, axis=cat_dim)
        if not value.size:
            return None  # (torch.cat's strides for an empty result)
        incs = node_incs if by_nodes else [0] * n
        if incs[-1] != 0:
            if dtype != _INT64:
                return None  # PyG's type promotion of the increment
            shape = [1] * value.ndim
            shape[0 if stack else cat_dim] = -1
            per_item = np.asarray(incs, dtype=np.int64) if stack else np.repeat(np.asarray(incs, dtype=np.int64), sizes)
            value += per_item.reshape(shape)
        slices = int64_tensor(cumsum_list(sizes))
        mapping[name] = torch.from_numpy(value)
        slice_dict[name] = slices
        inc_dict[name] = int64_tensor(incs)
        if name in follow:
            mapping[f"{name}_batch"] = torch.from_numpy(np.repeat(np.arange(n, dtype=np.int64), sizes))
            mapping[f"{name}_ptr"] = slices.clone()
    if first.can_infer:
        ptr = cumsum_list(num_nodes)
        if ptr[-1]:
            mapping["batch"] = torch.from_numpy(np.repeat(np.arange(n, dtype=np.int64), num_nodes))
        else:  # (an empty one keeps torch's strides)
            mapping["batch"] = torch.zeros(0, dtype=torch.int64)
        mapping["ptr"] = int64_tensor(ptr)
    set_batch_slices(out, n, slice_dict, inc_dict)
    return out
