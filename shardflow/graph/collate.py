"""Collate graphs into one PyG ``Batch``, fast, with the result of ``Batch.from_data_list``.

For the common case (``Data`` graphs, as :func:`~shardflow.graph.decode_graph`
returns them, carrying the same attributes: plain tensors, numbers, strings) the
batch is built straight from the graphs' tensors: one ``torch.cat`` per attribute,
int64 increments added in one vectorised step, ``batch`` and ``ptr`` from the node
counts, the rules stored with graphs of user subclasses applied. The result equals
``Batch.from_data_list`` on the same graphs bit for bit: same keys in the same order,
same tensors and dtypes, same ``batch``, ``ptr``, ``_slice_dict``, ``_inc_dict`` and
``num_graphs``, so ``to_data_list()`` works. Everything else (``HeteroData``, objects
of user subclasses themselves, batches of batches, nested dicts or lists of tensors,
``EdgeIndex``/``Index``, attributes whose name contains ``batch`` or is ``ptr``) goes
through ``Batch.from_data_list``.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from shardflow.compat.pyg import data_attributes, data_store, set_batch_slices, set_num_nodes, store_attributes, store_key
from shardflow.errors import SampleError
from shardflow.graph.rules import DEFAULT_RULE, RULES_ATTR, import_pyg, rule_classes

logger = logging.getLogger(__name__)

# NodeStorage.num_nodes looks at these keys first (torch_geometric.data.storage.N_KEYS).
N_KEYS = frozenset({"x", "feat", "pos", "batch", "node_type", "n_id", "tf"})
# Values the fast path passes through as lists (PyG's "anything else" branch).
_LIST_SCALARS = (str, type(None), bytes, np.ndarray)
_PLAIN_ITEMS = (str, int, float, bool, type(None), list, tuple, dict)
_NUMBERS = (int, float, bool)
_BATCH_CLASSES: dict[type, type] = {}  # Data class -> its Batch class (DataBatch, ...)


def collate_graphs(
    graphs: Iterable[Any],
    *,
    follow_batch: Iterable[str] | None = None,
    exclude_keys: Iterable[str] | None = None,
) -> Any:
    """Collate graphs into one ``Batch``, equal to ``Batch.from_data_list``.

    Policy for graphs that differ in what they carry: every graph must have the same
    attribute names (and, for ``HeteroData``, the same node and edge types with the
    same attribute names per type) as the first one, ignoring the attributes named in
    ``exclude_keys``. PyG would silently drop attributes missing from the first graph
    or fail with a bare ``KeyError``; this raises a :class:`SampleError` naming the
    graph index and the attribute or type instead. Order of attributes may differ
    (the first graph's order is used, as in PyG).

    Args:
        graphs: ``Data`` or ``HeteroData`` objects (for example from
            :func:`~shardflow.graph.decode_graph`), all of the same kind.
        follow_batch: attribute names that also get an ``<attr>_batch`` assignment
            vector (int64, one entry per element along the concatenation dimension)
            and an ``<attr>_ptr`` vector (int64, ``num_graphs + 1`` offsets).
        exclude_keys: attribute names left out of the batch.

    Returns:
        A ``torch_geometric.data.Batch`` (``DataBatch`` / ``HeteroDataBatch``, or the
        batch class of the graphs' own class) with ``batch`` (int64 graph index of
        every node, shape ``(num_nodes,)``) and ``ptr`` (int64, shape
        ``(num_graphs + 1,)``). Increments follow each graph's ``__inc__`` /
        ``__cat_dim__``, including the rules stored with decoded graphs.

    Raises:
        ImportError: torch_geometric is not installed.
        SampleError: (a ``ValueError``) ``graphs`` is empty, holds something that is not
            a graph, mixes ``Data`` and ``HeteroData``, the graphs differ in attributes
            or node/edge types (see the policy above), or an attribute cannot be
            concatenated across graphs (for example mismatched feature sizes).
    """
    pyg = import_pyg("collating graphs")
    graphs = graphs if isinstance(graphs, list) else list(graphs)
    if not graphs:
        raise SampleError("cannot collate an empty list of graphs")
    follow = set(follow_batch or ())
    exclude = set(exclude_keys or ())
    _check_same_structure(graphs, exclude, pyg)

    first = graphs[0]
    cls = type(first)
    batch = None
    if (cls is pyg.Data or cls is rule_classes()["StoredRulesData"]) and all(
        type(g) is cls for g in graphs
    ):
        try:
            batch = _collate_data(graphs, cls, follow, exclude, pyg)
        except (RuntimeError, TypeError, IndexError) as exc:
            raise SampleError(f"cannot collate {len(graphs)} graphs: {exc}") from exc
    if batch is None:
        logger.debug("collating %d %s graphs with Batch.from_data_list", len(graphs), cls.__name__)
        try:
            batch = pyg.Batch.from_data_list(
                graphs, follow_batch=list(follow), exclude_keys=list(exclude)
            )
        except (RuntimeError, KeyError, IndexError, TypeError) as exc:
            raise SampleError(
                f"Batch.from_data_list failed on {len(graphs)} graphs: {exc}"
            ) from exc
    return batch


# --------------------------------------------------------------------------------------
# Structure check.


def _describe_difference(index: int, names: Iterable[Any], ref: Iterable[Any], what: str) -> str:
    names, ref = set(names), set(ref)
    missing = sorted(ref - names, key=str)
    if missing:
        found = f"has no {what.format(repr(missing[0]))}, which graph 0 has"
    else:
        extra = sorted(names - ref, key=str)
        found = f"has {what.format(repr(extra[0]))}, which graph 0 does not have"
    return (
        f"cannot collate graph {index}: it {found}; graphs in one batch must carry the "
        "same attributes (and node and edge types), except those in exclude_keys"
    )


def _check_same_structure(graphs: list, exclude: set, pyg: Any) -> None:
    """Apply the collation policy: same kind, same attributes, same node/edge types."""
    first = graphs[0]
    if not isinstance(first, pyg.data.BaseData):
        raise SampleError(f"cannot collate graph 0: it is a {type(first).__name__}, not a graph")
    hetero = isinstance(first, pyg.HeteroData)
    if not hetero and not isinstance(first, pyg.Data):
        return  # another BaseData kind (TemporalData, ...): PyG decides
    kind = pyg.HeteroData if hetero else pyg.Data
    first_cls = type(first)
    ref_stores = {store_key(store): store_attributes(store).keys() for store in first.stores}
    for index, graph in enumerate(graphs[1:], start=1):
        if type(graph) is not first_cls and (
            not isinstance(graph, kind) or (not hetero and isinstance(graph, pyg.HeteroData))
        ):
            raise SampleError(
                f"cannot collate graph {index}: it is a {type(graph).__name__}, while "
                f"graph 0 is a {first_cls.__name__}"
            )
        if not hetero:
            names = data_attributes(graph).keys()
            if names != ref_stores[None]:
                _check_names(index, None, names, ref_stores[None], exclude)
            continue
        for what, attr in (("node type {}", "node_types"), ("edge type {}", "edge_types")):
            mine, ref = getattr(graph, attr), getattr(first, attr)
            if set(mine) != set(ref):
                raise SampleError(_describe_difference(index, mine, ref, what))
        for store in graph.stores:
            names = store_attributes(store).keys()
            if names != ref_stores[store_key(store)]:
                _check_names(index, store_key(store), names, ref_stores[store_key(store)], exclude)


def _check_names(
    index: int, key: Any, names: Iterable[str], ref: Iterable[str], exclude: set
) -> None:
    mine = {n for n in names if n not in exclude}
    ref_names = {n for n in ref if n not in exclude}
    if mine != ref_names:
        what = "attribute {}" if key is None else f"attribute {{}} of {key!r}"
        raise SampleError(_describe_difference(index, mine, ref_names, what))


# --------------------------------------------------------------------------------------
# Fast path for homogeneous Data.


def cumsum_list(sizes: list[int]) -> list[int]:
    """``[0, s0, s0 + s1, ...]``: PyG's ``cumsum`` of a 1-D tensor, in Python."""
    return [0, *itertools.accumulate(sizes)]


def _on(tensor: torch.Tensor, device: Any) -> torch.Tensor:
    return tensor if device is None else tensor.to(device)


def int64_tensor(values: list[int]) -> torch.Tensor:
    """``torch.tensor(values)`` for Python ints (int64), several times faster."""
    return torch.from_numpy(np.array(values, dtype=np.int64))


def _num_nodes(graph: Any, store: Any, mapping: dict, plain: bool) -> Any:
    """``store.num_nodes``, without its overhead when the answer is the usual one."""
    if "num_nodes" in mapping:
        return mapping["num_nodes"]
    for key, value in mapping.items():
        if key in N_KEYS:
            if type(value) is torch.Tensor:
                # Data.__cat_dim__ is 0 for every name in N_KEYS.
                return value.shape[0] if plain else value.size(graph.__cat_dim__(key, value, store))
            break
    return store.num_nodes  # PyG's own inference (may warn, as PyG does)


def default_rule(name: str) -> tuple[int, bool]:
    """``(cat_dim, increments_by_num_nodes)`` of ``Data``'s defaults for a dense tensor."""
    if "index" in name or name == "face":
        return -1, True
    return 0, False


def _incs(repeats: list) -> tuple[torch.Tensor, bool]:
    """PyG's ``get_incs``: exclusive cumulative sum of the per-graph increments.

    Returns the increments tensor (length = number of graphs) and whether PyG adds
    them (``incs.dim() > 1 or incs[-1] != 0``).
    """
    if all(type(r) is int for r in repeats):
        cum = cumsum_list(repeats[:-1])
        return int64_tensor(cum), cum[-1] != 0
    from torch_geometric.utils import cumsum

    if isinstance(repeats[0], torch.Tensor):
        stacked = torch.stack(repeats, dim=0)
    else:
        stacked = torch.tensor(repeats)
    incs = cumsum(stacked[:-1])
    return incs, incs.dim() > 1 or int(incs[-1]) != 0


def _collate_data(graphs: list, cls: type, follow: set, exclude: set, pyg: Any) -> Any:
    """Build the batch of homogeneous ``Data`` graphs, or None to let PyG do it."""
    first = graphs[0]
    plain = cls is pyg.Data
    stores = list(map(data_store, graphs))
    mappings = list(map(store_attributes, stores))
    names = list(mappings[0])
    if any("batch" in name or name == "ptr" for name in names):
        return None  # data-dependent increments / PyG's own batch vectors
    rules = None if plain else [g.__dict__.get(RULES_ATTR) or {} for g in graphs]
    n = len(graphs)
    num_nodes = [_num_nodes(g, s, m, plain) for g, s, m in zip(graphs, stores, mappings)]

    out = new_batch(cls, pyg).stores_as(first)  # as PyG's collate (rules carry over)
    out_store = data_store(out)
    out_mapping = store_attributes(out_store)
    slice_dict: dict[str, Any] = {}
    inc_dict: dict[str, Any] = {}
    device = None
    for name in names:
        if name in exclude:
            continue
        values = [m[name] for m in mappings]
        if name == "num_nodes":
            set_num_nodes(out_store, values)
            out_store.num_nodes = sum(values)
            continue
        elem = values[0]
        elem_type = type(elem)
        if elem_type is torch.Tensor:
            if elem.layout != torch.strided or elem.is_nested:
                return None
            if any(type(v) is not torch.Tensor for v in values):
                return None
            cat_dim, by_num_nodes = default_rule(name)
            rule = rules[0].get((None, name)) if rules is not None else None
            if rule is not None and rule[0] != DEFAULT_RULE:
                cat_dim = rule[0]
            repeats = _repeats(name, by_num_nodes, rules, num_nodes)
            if repeats is None:
                return None
            value, slices, incs = _cat_tensors(values, elem, cat_dim, repeats)
            if value.is_cuda:
                device = value.device
        elif elem_type is int or elem_type is float or elem_type is bool:
            if any(type(v) not in _NUMBERS for v in values):
                return None
            repeats = _repeats(name, default_rule(name)[1], rules, num_nodes)
            if repeats is None or any(type(r) is not int for r in repeats):
                return None
            value = torch.tensor(values)
            incs, add = _incs(repeats)
            if add:
                value.add_(incs)
            slices = torch.arange(n + 1)
        elif isinstance(elem, _LIST_SCALARS) or (
            isinstance(elem, Sequence)
            and not isinstance(elem, Mapping)
            and (len(elem) == 0 or type(elem[0]) in _PLAIN_ITEMS)
        ):
            value, slices, incs = values, torch.arange(n + 1), None
        else:
            return None  # dicts, lists of tensors, SparseTensor, TensorFrame, ...
        out_mapping[name] = value
        slice_dict[name] = slices
        inc_dict[name] = incs
        if name in follow:
            sizes = slices[1:] - slices[:-1]
            out_mapping[f"{name}_batch"] = torch.repeat_interleave(
                torch.arange(n, device=device), _on(sizes, device)
            )
            out_mapping[f"{name}_ptr"] = _on(slices.clone(), device)

    if data_store(first).can_infer_num_nodes:
        out_mapping["batch"], out_mapping["ptr"] = _batch_vectors(num_nodes, device)

    set_batch_slices(out, n, slice_dict, inc_dict)
    return out


def _repeats(name: str, by_num_nodes: bool, rules: list[dict] | None, num_nodes: list) -> list | None:
    """Per graph, the increment of attribute ``name`` (PyG's ``__inc__``): the graph's node
    count or 0 by the default rule, or what the graph's stored rules say (``rules``, None for
    plain ``Data``); None where only PyG's own path can tell."""
    n = len(num_nodes)
    if rules is None or not any((None, name) in r for r in rules):
        if not by_num_nodes:
            return [0] * n
        if any(type(k) is not int for k in num_nodes):
            return None
        return num_nodes
    out = []
    for r, k in zip(rules, num_nodes):
        rule = r.get((None, name))
        if rule is not None:
            if isinstance(rule[1], str):
                return None  # an unknown increment: PyG's path raises the error
            out.append(rule[1])
        elif by_num_nodes:
            if type(k) is not int:
                return None
            out.append(k)
        else:
            out.append(0)
    return out


def _batch_vectors(num_nodes: list, device: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """PyG's ``batch`` (graph of each node, int64 of shape (nodes,)) and ``ptr`` (int64 of
    shape (graphs + 1,)) vectors."""
    counts = [k or 0 for k in num_nodes]
    ptr = cumsum_list(counts)
    if ptr[-1]:  # numpy: no intra-op threads (see _cat)
        batch = torch.from_numpy(np.repeat(np.arange(len(counts), dtype=np.int64), counts))
    else:  # (an empty one keeps torch's strides)
        batch = torch.zeros(0, dtype=torch.int64)
    return _on(batch, device), _on(int64_tensor(ptr), device)


def new_batch(cls: type, pyg: Any) -> Any:
    """``Batch(_base_cls=cls)`` without its per-call signature inspection."""
    batch_cls = _BATCH_CLASSES.get(cls)
    if batch_cls is None:
        batch_cls = _BATCH_CLASSES.setdefault(cls, type(pyg.Batch(_base_cls=cls)))
    # What DynamicInheritance.__call__ ends with, for a class whose __init__ needs no
    # arguments (Data and its subclasses here).
    return type.__call__(batch_cls)


# Small CPU tensors are concatenated, stacked and incremented through numpy: one plain
# copy in this thread. torch.cat and in-place adds split work over torch's intra-op
# threads from ~32k elements on, and a batch of 64 small graphs is just above that: with
# 2 threads on a busy machine, waking the second thread cost more than the copy
# (measured: 2,000 graphs/s with torch's default threads against 7,500 with one). The
# user's global thread setting is left alone.
NUMPY_DTYPES = frozenset({
    torch.float16, torch.float32, torch.float64, torch.int8, torch.int16, torch.int32, torch.int64,
    torch.uint8, torch.bool, torch.complex64, torch.complex128,
})  # fmt: skip


def _as_numpy(values: list[torch.Tensor]) -> list[np.ndarray] | None:
    """The tensors as numpy views when all are plain CPU tensors of one numpy dtype, else None."""
    dtype = values[0].dtype
    if dtype not in NUMPY_DTYPES:
        return None
    for v in values:
        if v.dtype is not dtype or v.device.type != "cpu" or v.requires_grad or v.is_conj() or v.is_neg():
            return None
    return [v.numpy() for v in values]


def _cat(values: list[torch.Tensor], dim: int, stack: bool) -> tuple[torch.Tensor, np.ndarray | None]:
    """``torch.stack``/``torch.cat`` of ``values``, and the result as numpy when it went that way."""
    arrays = _as_numpy(values)
    if arrays is not None:
        try:
            out = np.stack(arrays) if stack else np.concatenate(arrays, axis=dim)
        except ValueError:  # shapes that do not fit: torch's error is the one to report
            pass
        else:
            if out.size:  # (an empty result keeps torch's strides)
                return torch.from_numpy(out), out
    return (torch.stack(values) if stack else torch.cat(values, dim=dim)), None


def _cat_tensors(
    values: list[torch.Tensor], elem: torch.Tensor, cat_dim: Any, repeats: list
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PyG's tensor branch of ``_collate``: concatenate, slice, increment."""
    n = len(values)
    stack = cat_dim is None or elem.dim() == 0
    if stack:
        sizes = [1] * n
    else:
        sizes = [v.shape[cat_dim] for v in values]
    slices = int64_tensor(cumsum_list(sizes))
    incs, add = _incs(repeats)
    if not add:
        value, _ = _cat(values, cat_dim, stack)
        return value, slices, incs
    int64 = torch.int64
    if incs.dim() == 1 and incs.dtype == int64 and all(v.dtype == int64 for v in values):
        # int64 + int64 is exact: add all increments in one step after concatenating.
        value, array = _cat(values, cat_dim, stack)
        shape = [1] * value.dim()
        shape[0 if stack else cat_dim] = -1
        if array is not None:
            per_item = incs.numpy() if stack else np.repeat(incs.numpy(), sizes)
            array += per_item.reshape(shape)
        elif stack:
            value += incs.to(value.device).view(shape)
        else:
            per_item = torch.repeat_interleave(incs, int64_tensor(sizes), output_size=value.shape[cat_dim])
            value += per_item.to(value.device).view(shape)
        return value, slices, incs
    # Other dtypes: exactly PyG's arithmetic (type promotion of a 0-dim increment).
    if stack:
        values = [v.unsqueeze(0) for v in values]
    values = [v + inc.to(v.device) for v, inc in zip(values, incs)]
    return torch.cat(values, dim=cat_dim or 0), slices, incs
