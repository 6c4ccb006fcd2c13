"""Turning shardflow's fast read paths off, for tests that run every read both ways.

STYLE.md asks for one switch that turns every fast variant off: the library's is
``shardflow.fastpath`` (``SHARDFLOW_FAST_PATHS=0``). :func:`fast_paths` also turns each
fast path off here by the one call that chooses it (so the general path it falls back
to runs instead), so that each one can be turned off alone:

- ``bulk``: the bulk tar header walk and its grouped runs (``format.spans.bulk_members``,
  which ``format.members.member_runs`` calls; the general member-by-member loop reads
  instead),
- ``blocks``: the block step of the planned reader (``reader.runs.blocks``: every
  position goes through the general step),
- ``jpeg``: the JPEG decode without ``Image.open`` (``codecs.image._load_jpeg``),
- ``npy``: the cached ``.npy`` header parse (the ``npy`` codec: ``numpy.load`` instead).

All of them off also flips the library's switch (which also covers graph records and
the worker slot pool); all of them on sets it on, even in a run started with
``SHARDFLOW_FAST_PATHS=0``, so a test that compares the two settings compares them
there too. A name that is not found
fails loudly (``LookupError``), so a refactor that moves a fast path cannot turn "off"
into "on" silently. The patches are module attributes: DataLoader workers forked inside
the ``with`` see them too.
"""

from __future__ import annotations

import importlib
import io
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any, Union

import numpy as np
import pytest

__all__ = ["FAST_PATHS", "fast_paths", "FastSetting"]

FastSetting = Union[bool, str]
"""``True``: every fast path on (as shipped); ``False``: all off; a name of :data:`FAST_PATHS`: that one off."""


def _no_bulk(buf: bytes, pos: int, *args: object, **kwargs: object) -> tuple[list, int]:
    return [], pos


def _no_blocks(run: np.ndarray, sample: np.ndarray, wanted: np.ndarray) -> np.ndarray:
    return np.zeros(len(run), dtype=np.int64)


def _no_jpeg(*args: object, **kwargs: object) -> None:
    return None


def _npy_load(data: bytes, options: object) -> np.ndarray:
    return np.load(io.BytesIO(data), allow_pickle=False)


# name -> [(module, attribute, replacement)]; every entry must exist
_PATCHES: dict[str, list[tuple[str, str, Callable[..., Any]]]] = {
    "bulk": [("shardflow.format.spans", "bulk_members", _no_bulk)],
    "blocks": [("shardflow.reader.runs", "blocks", _no_blocks)],
    "jpeg": [("shardflow.codecs.image", "_load_jpeg", _no_jpeg)],
}
FAST_PATHS = (*_PATCHES, "npy")


def _off(mp: pytest.MonkeyPatch, names: Iterable[str]) -> None:
    for name in names:
        if name == "npy":
            from shardflow import codecs

            mp.setitem(codecs._DECODERS, "npy", _npy_load)
            continue
        for module, attr, replacement in _PATCHES[name]:
            mod = importlib.import_module(module)
            if not hasattr(mod, attr):
                raise LookupError(f"fast path {name!r}: {module}.{attr} is gone; update tests/fastpaths.py")
            mp.setattr(mod, attr, replacement)


@contextmanager
def fast_paths(setting: FastSetting) -> Iterator[None]:
    """Within the block, shardflow's fast read paths as ``setting`` says (see :data:`FastSetting`)."""
    from shardflow import fastpath

    with pytest.MonkeyPatch.context() as mp:
        if setting is not True:
            _off(mp, FAST_PATHS if setting is False else (setting,))
        if setting is not True and setting is not False:  # one fast path off: the switch as it is
            yield
            return
        before = fastpath.enabled()
        mp.setenv(fastpath.ENV, "1" if setting else "0")
        fastpath.set_enabled(setting)
        try:
            yield
        finally:
            fastpath.set_enabled(before)
