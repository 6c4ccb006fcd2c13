"""Graph samples: PyTorch Geometric graphs as ``pyg`` fields, and their collation.

``encode_graph`` / ``decode_graph`` turn one ``Data`` or ``HeteroData`` into the bytes
of a ``pyg`` field and back (safetensors plus a JSON schema, never pickle; see
:mod:`shardflow.graph.codec`). ``collate_graphs`` builds the ``Batch`` of a list of
graphs, equal to ``Batch.from_data_list`` and several times faster for ordinary
``Data`` (see :mod:`shardflow.graph.collate`). torch_geometric and safetensors are
imported only when one of these functions is called.
"""

from __future__ import annotations

import sys
from typing import Any

from shardflow.graph.codec import decode_graph, encode_graph
from shardflow.graph.collate import collate_graphs

__all__ = ["collate_graphs", "decode_graph", "encode_graph", "is_graph", "to_shards", "collate_fn", "GraphCollate", "graph_structure"]

_PIPELINE = ("to_shards", "collate_fn", "GraphCollate", "graph_structure")


def __getattr__(name: str) -> Any:
    """``to_shards``, ``collate_fn``, ... from :mod:`shardflow.graph.pipeline`, imported on first use."""
    if name in _PIPELINE:
        from . import pipeline

        return getattr(pipeline, name)
    raise AttributeError(f"module 'shardflow.graph' has no attribute {name!r}")


def is_graph(obj: Any) -> bool:
    """Whether ``obj`` is a PyG graph (an instance of ``torch_geometric.data.BaseData``).

    Does not import torch_geometric: if it was never imported, no graph can exist.
    """
    module = sys.modules.get("torch_geometric.data.data")
    return module is not None and isinstance(obj, module.BaseData)
