"""One switch for every fast path of the read path, so that a reading bug can be bisected.

Where shardflow has a fast variant of a general path, the general path is the
reference and the fast one must give the same result. With the environment
variable ``SHARDFLOW_FAST_PATHS=0`` (read at import; DataLoader workers started
with ``spawn`` read it too), or :func:`set_enabled` (forked workers inherit it),
every one of them is off:

* the tar walk of plain members in bulk (:mod:`shardflow.format.spans`) and the
  samples grouped in bulk (:func:`shardflow.format.tar.iter_samples`): every
  header goes through the general path of :mod:`shardflow.format.members`;
* the block loop of :func:`shardflow.reader.read_planned`: every position alone;
* graph records decoded and batched in one step (:mod:`shardflow.loading.collation`):
  graphs decode to ``Data``/``HeteroData`` and batch through the general collate;
* the worker's slot pool and by-value tensors (:mod:`shardflow.loading.transfer`): batches
  travel the way torch sends them.

The reader tests run both ways (``tests/conftest.py``'s ``fast_paths`` fixture).
"""

from __future__ import annotations

import os

__all__ = ["ENV", "enabled", "set_enabled"]

ENV = "SHARDFLOW_FAST_PATHS"
"""The environment variable: ``0``, ``false``, ``off`` or ``no`` turns every fast path off."""

_on = os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "off", "no")


def enabled() -> bool:
    """Whether the fast paths are on (the default)."""
    return _on


def set_enabled(on: bool) -> None:
    """Turn every fast path on or off in this process (and in workers forked after)."""
    global _on
    _on = bool(on)
