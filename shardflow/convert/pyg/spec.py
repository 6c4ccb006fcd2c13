"""Dataset specs of ``convert pyg``: an importable ``module:callable`` that builds the graphs.

A spec is picklable, so that a worker process not started by ``fork`` (or a Dask
worker) can build the same dataset again. :func:`is_indexable` tells which of the
two kinds of source a spec gave (see :mod:`shardflow.convert.pyg`).
"""

from __future__ import annotations

import dataclasses
import importlib
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from ...errors import ConversionError

__all__ = ["DatasetSpec", "is_graph", "is_indexable"]


def is_graph(obj: Any) -> bool:
    """Whether ``obj`` is a ``torch_geometric`` ``Data`` or ``HeteroData`` (imported lazily)."""
    from ...graph import is_graph as graph_check

    return graph_check(obj)


@dataclass(frozen=True)
class DatasetSpec:
    """An importable dataset: ``target(**kwargs, root=root)`` (picklable; sent to workers).

    Attributes:
        target: ``"module:attr"`` (``attr`` may be dotted: ``module:Class.factory``)
            or ``"module.attr"``.
        kwargs: keyword arguments of the call (JSON values on the command line).
        root: passed as ``root=`` when not None (the folder of a PyG dataset).
    """

    target: str
    kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    root: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.target, str) or not self.target.strip():
            raise ValueError(f"a dataset spec is 'module:callable', got {self.target!r}")
        if not isinstance(self.kwargs, Mapping):
            raise TypeError(f"dataset kwargs must be a mapping, got {type(self.kwargs).__name__}")
        if "root" in self.kwargs and self.root is not None:
            raise ValueError("give the dataset root once: as root= or inside kwargs, not both")

    def describe(self) -> str:
        """``target`` plus its arguments, as one line."""
        args = dict(self.kwargs)
        if self.root is not None:
            args["root"] = self.root
        return self.target if not args else f"{self.target} {json.dumps(args, sort_keys=True, default=str)}"

    def token(self) -> str:
        """A stable text identifying this spec (cache key and fingerprint part)."""
        return json.dumps([self.target, dict(self.kwargs), self.root], sort_keys=True, default=repr)

    def resolve(self) -> Any:
        """Import the target object (not called yet).

        Raises:
            ConversionError: the module or attribute cannot be imported.
        """
        module_name, sep, attr = self.target.partition(":")
        if not sep:
            module_name, _, attr = self.target.rpartition(".")
        if not module_name or not attr:
            raise ConversionError(
                f"dataset spec {self.target!r}: expected 'module:callable' "
                "(for example 'torch_geometric.datasets:TUDataset')"
            )
        try:
            obj: Any = importlib.import_module(module_name)
        except ImportError as e:
            raise ConversionError(f"dataset spec {self.target!r}: cannot import module {module_name!r}: {e}") from e
        for part in attr.split("."):
            try:
                obj = getattr(obj, part)
            except AttributeError:
                raise ConversionError(
                    f"dataset spec {self.target!r}: {module_name!r} has no attribute {attr!r}"
                ) from None
        return obj

    def open(self) -> Any:
        """Build the dataset (or iterable of graphs) the spec names.

        Raises:
            ConversionError: import failure, arguments given for a non-callable
                target, or the call raised (the cause is chained).
        """
        target = self.resolve()
        if not callable(target) or is_graph(target):  # a Data is callable, yet a value
            if self.kwargs or self.root is not None:
                raise ConversionError(
                    f"dataset spec {self.target!r} is a {type(target).__name__}, not a callable: "
                    "it takes no kwargs or root"
                )
            return target
        kwargs = dict(self.kwargs)
        if self.root is not None:
            kwargs["root"] = self.root
        try:
            return target(**kwargs)
        except Exception as e:
            raise ConversionError(f"building the dataset {self.describe()} failed: {type(e).__name__}: {e}") from e



def is_indexable(obj: Any) -> bool:
    """Whether ``obj`` is a dataset with ``len()`` and ``[i]`` (converted by worker
    processes, each taking its own graphs), not a plain iterable of graphs."""
    if isinstance(obj, (str, bytes, Mapping, Iterator)) or is_graph(obj):
        return False
    try:
        from torch.utils.data import IterableDataset

        if isinstance(obj, IterableDataset):
            return False
    except ImportError:  # pragma: no cover - torch is a dependency
        pass
    return hasattr(type(obj), "__len__") and hasattr(type(obj), "__getitem__")

