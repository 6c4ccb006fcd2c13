"""shardflow: pack training data into tar shards and stream them into PyTorch.

The public names, imported on first use so that ``import shardflow`` stays light (the module each
comes from in brackets; docs/architecture.md says what every package is for, README.md shows them
in use):

- :class:`ShardWriter` (``writing.writer``): write samples into tar shards plus a
  ``shardflow.json`` manifest.
- :func:`write_shards` (``convert.engine.write``): ``fn`` over a stream of inputs, in parallel
  (local processes or Dask), deterministic and resumable: the general form of every converter.
- :class:`ShardDataset` (``dataset``): a streaming ``IterableDataset`` over shards, local or any
  fsspec URL.
- :class:`Source` (``sources.source``): one of several sources of a dataset (a union, or a
  weighted mixture).
- :class:`IndexedShardDataset` (``indexed``): map-style random access through the offset index.
- :class:`ShuffleConfig` (``planning.plan``), :class:`IOOptions` (``storage``),
  :class:`DecodeOptions` (``codecs``): how an epoch is shuffled, how shards are read and written,
  how fields are decoded.
- :func:`loader` (``loading.shardloader``): a :class:`ShardLoader`, a DataLoader with the right
  settings, with ``state_dict()`` for resumption; :func:`collate` (``loading.collation``) is its
  default ``collate_fn``.
- :mod:`shardflow.config`: a pipeline in one YAML file (``shardflow.config.loader_from_config``).
- :func:`map_fields`: per-field transforms (a torchvision transform for the ``image`` field);
  :mod:`shardflow.transforms` has it and a dependency-free ``Resize``.
- :func:`sample_rng` / :func:`sample_generator` (``seeding``): numpy / torch generators seeded for
  the sample a transform is preparing.
- :class:`ShardflowError` (``errors``): the base of every error shardflow raises, each also a
  subclass of the fitting builtin (``ValueError``, ``OSError``, ...).
"""

from __future__ import annotations

from typing import Any

from .errors import ShardflowError

__version__ = "0.1.0"
__all__ = [
    "ShardWriter",
    "write_shards",
    "ShardDataset",
    "Source",
    "IndexedShardDataset",
    "ShuffleConfig",
    "IOOptions",
    "DecodeOptions",
    "loader",
    "ShardLoader",
    "collate",
    "config",
    "map_fields",
    "sample_rng",
    "sample_generator",
    "transforms",
    "ShardflowError",
    "__version__",
]

_LAZY = {
    "ShardWriter": ("writing.writer", "ShardWriter"),
    "write_shards": ("convert.engine.write", "write_shards"),
    "ShardDataset": ("dataset", "ShardDataset"),
    "Source": ("sources.source", "Source"),
    "IndexedShardDataset": ("indexed", "IndexedShardDataset"),
    "ShuffleConfig": ("planning.plan", "ShuffleConfig"),
    "IOOptions": ("storage", "IOOptions"),
    "DecodeOptions": ("codecs", "DecodeOptions"),
    "loader": ("loading.shardloader", "loader"),
    "ShardLoader": ("loading.shardloader", "ShardLoader"),
    "collate": ("loading.collation", "collate"),
    "map_fields": ("transforms", "map_fields"),
    "sample_rng": ("seeding", "sample_rng"),
    "sample_generator": ("seeding", "sample_generator"),
}

# modules reachable as attributes after a plain ``import shardflow``, as after ``import shardflow.config``
_MODULES = frozenset({"config", "transforms"})


def __getattr__(name: str) -> Any:
    """Import public names on first use, so ``import shardflow`` stays light."""
    if name in _MODULES:
        import importlib

        return importlib.import_module(f".{name}", __name__)
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        value = getattr(importlib.import_module(f".{module}", __name__), attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'shardflow' has no attribute {name!r}")
