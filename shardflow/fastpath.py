"""One switch for every fast path of the read path, so that a reading bug can be bisected.

Where shardflow has a fast variant of a general path, the general path is the
reference and the fast one must give the same result. With the environment
variable ``SHARDFLOW_FAST_PATHS=0`` (read at import; DataLoader workers started
with ``spawn`` read it too), or :func:`set_enabled` (forked workers inherit it),
every one of them is off:

* ``"bulk"``: the tar walk of plain members in bulk (:mod:`shardflow.format.spans`)
  and the samples grouped in bulk (:func:`shardflow.format.tar.iter_samples`): every
  header goes through the general path of :mod:`shardflow.format.members`;
* ``"blocks"``: the block loop of :func:`shardflow.reader.read_planned`: every position alone;
* ``"jpeg"``: JPEGs decoded without ``Image.open`` (:mod:`shardflow.codecs.jpeg`):
  every image goes through ``Image.open``;
* ``"npy"``: ``.npy`` headers parsed once and cached (:mod:`shardflow.format.npy`):
  numpy's parser reads every one;
* graph records decoded and batched in one step (:mod:`shardflow.loading.collation`):
  graphs decode to ``Data``/``HeteroData`` and batch through the general collate;
* the worker's slot pool and by-value tensors (:mod:`shardflow.loading.transfer`): batches
  travel the way torch sends them.

The four named above can also be turned off one at a time (``set_enabled(False, "jpeg")``),
to find which one a difference comes from; the others have no name of their own.
The reader tests run both ways (``tests/conftest.py``'s ``fast_paths`` fixture).
"""

from __future__ import annotations

import os

__all__ = ["ENV", "NAMES", "enabled", "set_enabled"]

ENV = "SHARDFLOW_FAST_PATHS"
"""The environment variable: ``0``, ``false``, ``off`` or ``no`` turns every fast path off."""

NAMES = ("bulk", "blocks", "jpeg", "npy")
"""The fast paths that can be turned off alone (see the module docstring)."""

_on = os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "off", "no")
_off: frozenset[str] = frozenset()  # named paths off while the switch is on


def enabled(name: str | None = None) -> bool:
    """Whether the fast paths are on (the default); with ``name`` (one of :data:`NAMES`),
    whether that one is (the switch on and it not turned off alone)."""
    return _on and (name is None or name not in _off)


def set_enabled(on: bool, name: str | None = None) -> None:
    """Turn every fast path on or off in this process (and in workers forked after); with
    ``name``, only that one (the switch and the others as they are).

    Raises:
        ValueError: ``name`` is not one of :data:`NAMES`.
    """
    global _on, _off
    if name is None:
        _on, _off = bool(on), frozenset()
    elif name not in NAMES:
        raise ValueError(f"no fast path named {name!r} (one of {NAMES})")
    else:
        _off = _off - {name} if on else _off | {name}
