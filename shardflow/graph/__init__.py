"""Graph samples: PyTorch Geometric graphs as ``pyg`` fields.

``encode_graph`` / ``decode_graph`` turn one ``Data`` or ``HeteroData`` into the bytes
of a ``pyg`` field and back (safetensors plus a JSON schema, never pickle; see
:mod:`shardflow.graph.codec`). Batches of graphs are built by :func:`shardflow.collate`
(the loader's default), equal to ``Batch.from_data_list`` and several times faster for
ordinary ``Data`` (the engine is :mod:`shardflow.graph.collate`);
:func:`graph_structure` says what graphs batched together must share. Writing a PyG
dataset into shards is a converter: :func:`shardflow.convert.pyg.to_shards`.
torch_geometric and safetensors are imported only when one of these functions is called.
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["decode_graph", "encode_graph", "graph_structure", "is_graph"]

# public name -> the submodule that defines it; imported on first use, so that
# is_graph() (called by every ShardWriter.write) does not import torch
_LAZY = {
    "decode_graph": "codec",
    "encode_graph": "codec",
    "graph_structure": "structure",
}


def __getattr__(name: str) -> Any:
    """The names of :data:`__all__` from their submodules, imported on first use."""
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'shardflow.graph' has no attribute {name!r}")


def is_graph(obj: Any) -> bool:
    """Whether ``obj`` is a PyG graph (an instance of ``torch_geometric.data.BaseData``).

    Does not import torch_geometric: if it was never imported, no graph can exist.
    """
    module = sys.modules.get("torch_geometric.data.data")
    return module is not None and isinstance(obj, module.BaseData)
