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
The code: :mod:`~shardflow.graph.schema` (constants), :mod:`~shardflow.graph.encode`,
:mod:`~shardflow.graph.decode`, :mod:`~shardflow.graph.rules` (stored batching rules).
"""

from __future__ import annotations

from typing import Any

from .decode import decode_graph
from .encode import encode_graph
from .rules import rule_classes, stored_rules
from .schema import SCHEMA_KEY, SCHEMA_VERSION

__all__ = ["SCHEMA_KEY", "SCHEMA_VERSION", "decode_graph", "encode_graph", "stored_rules"]


def __getattr__(name: str) -> Any:
    # PEP 562: the StoredRules* classes exist once asked for, so that pickle (DataLoader
    # workers) finds them by name without this module importing PyG eagerly.
    if name in ("StoredRulesData", "StoredRulesHeteroData"):
        return rule_classes()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
