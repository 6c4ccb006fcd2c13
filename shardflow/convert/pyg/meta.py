"""What a PyG conversion records about its dataset: class, cheap counts, the resume fingerprint."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import warnings
from typing import Any

from ...compat.pyg import reset_database
from .workers import forget

__all__ = ["close_database", "dataset_info", "file_states", "fingerprint", "qualname"]

log = logging.getLogger(__name__)


def qualname(obj: Any) -> str:
    """``module.QualName`` of ``obj``'s class."""
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


def dataset_info(dataset: Any) -> dict[str, Any]:
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
            log.debug("no %s for %s: %s", name, qualname(dataset), e)
            continue
        if type(value) is int:
            out[name] = value
    forget(dataset, 0)  # the feature counts look at graph 0
    return out


def file_states(dataset: Any) -> list[Any]:
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


def fingerprint(*parts: Any) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(json.dumps(p, sort_keys=True, default=repr).encode())
        h.update(b"\0")
    return h.hexdigest()[:16]


def close_database(dataset: Any) -> None:
    """Close an ``OnDiskDataset``'s database connection before worker processes fork
    (a SQLite connection must not cross a fork); it reopens on next use."""
    try:
        from torch_geometric.data import OnDiskDataset
    except ImportError:  # pragma: no cover
        return
    if isinstance(dataset, OnDiskDataset):
        reset_database(dataset)
