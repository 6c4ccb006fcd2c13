"""PyTorch Geometric internals that shardflow's graph code uses (:mod:`shardflow.graph`).

PyG keeps a graph's attributes in storage objects: ``Data._store`` (one
``GlobalStorage``), ``HeteroData._global_store`` (the graph-level one), each storage's
attributes in its dict ``_mapping`` and its node or edge type in ``_key``. A storage's
per-graph node counts of a batch sit in ``_num_nodes``; a ``Batch`` made by
``Batch.from_data_list`` carries ``_num_graphs``, ``_slice_dict`` and ``_inc_dict``
(what ``get_example`` and ``to_data_list`` read back). An ``OnDiskDataset`` holds its
database connection in ``_db`` (None: connect on next use). shardflow decodes graphs straight
into those dicts and builds batches as PyG's collate does, skipping the per-attribute
``__setattr__`` machinery. The getters are ``operator.attrgetter`` (no Python frame:
they run once per graph in the collate loop).
"""

from __future__ import annotations

from operator import attrgetter
from typing import Any

__all__ = [
    "REQUIRED",
    "data_store",
    "data_attributes",
    "global_store",
    "store_attributes",
    "store_key",
    "set_num_nodes",
    "set_batch_slices",
    "reset_database",
    "missing",
]

REQUIRED = (
    "Data._store",
    "HeteroData._global_store",
    "BaseStorage._mapping",
    "BaseStorage._key",
    "GlobalStorage._num_nodes",
    "Batch._num_graphs",
    "Batch._slice_dict",
    "Batch._inc_dict",
    "OnDiskDataset._db",
)
"""The private names used here (``tests/test_compat.py`` checks each one on real PyG objects)."""

data_store = attrgetter("_store")
"""``data_store(data)``: the ``GlobalStorage`` of a ``Data`` graph (or batch)."""

data_attributes = attrgetter("_store._mapping")
"""``data_attributes(data)``: a ``Data`` graph's ``{name: value}`` dict, live (writes go into the graph)."""

global_store = attrgetter("_global_store")
"""``global_store(data)``: the graph-level storage of a ``HeteroData`` graph."""

store_attributes = attrgetter("_mapping")
"""``store_attributes(store)``: a storage's ``{name: value}`` dict, live."""

store_key = attrgetter("_key")
"""``store_key(store)``: a storage's node type (str), edge type (3-tuple), or None for the global one."""


def set_num_nodes(store: Any, counts: list[int]) -> None:
    """Keep a batch storage's per-graph node counts, as PyG's collate does for ``num_nodes``."""
    store._num_nodes = counts


def set_batch_slices(batch: Any, n: int, slice_dict: dict[str, Any], inc_dict: dict[str, Any]) -> None:
    """Record in a ``Batch`` how it was put together (its ``n`` graphs, each attribute's
    slices and increments), as ``Batch.from_data_list`` does, so that ``get_example``,
    ``index_select`` and ``to_data_list`` work on it."""
    batch._num_graphs = n
    batch._slice_dict = slice_dict
    batch._inc_dict = inc_dict


def reset_database(dataset: Any) -> None:
    """Close the database connection of the PyG ``OnDiskDataset`` ``dataset`` if it is open,
    and forget it (``close()`` keeps the closed handle; None makes its ``db`` connect again)."""
    if getattr(dataset, "_db", None) is not None:
        dataset.close()
        dataset._db = None


def missing() -> list[str]:
    """The names of :data:`REQUIRED` that the installed PyG does not have (all, without PyG)."""
    try:
        import inspect

        import torch
        from torch_geometric.data import Batch, Data, HeteroData, OnDiskDataset
    except ImportError:
        return list(REQUIRED)
    data = Data(x=torch.zeros(2, 1), num_nodes=2)
    hetero = HeteroData()
    hetero["paper"].x = torch.zeros(2, 1)
    batch = Batch.from_data_list([data, data])
    store = getattr(data, "_store", None)
    found = {
        "Data._store": store is not None,
        "HeteroData._global_store": hasattr(hetero, "_global_store"),
        "BaseStorage._mapping": isinstance(getattr(store, "_mapping", None), dict),
        "BaseStorage._key": hasattr(hetero["paper"], "_key") and hetero["paper"]._key == "paper",
        "GlobalStorage._num_nodes": "_num_nodes" in vars(getattr(batch, "_store", object())),
        "Batch._num_graphs": getattr(batch, "_num_graphs", None) == 2,
        "Batch._slice_dict": isinstance(getattr(batch, "_slice_dict", None), dict),
        "Batch._inc_dict": isinstance(getattr(batch, "_inc_dict", None), dict),
        "OnDiskDataset._db": "self._db = None" in inspect.getsource(OnDiskDataset.close)
        or "self._db:" in inspect.getsource(OnDiskDataset.__init__),
    }
    return [name for name in REQUIRED if not found[name]]
