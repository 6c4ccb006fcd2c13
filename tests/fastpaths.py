"""Turning shardflow's fast read paths off, for tests that run every read both ways.

STYLE.md asks for one switch that turns every fast variant off: the library's is
``shardflow.fastpath`` (``SHARDFLOW_FAST_PATHS=0``). :func:`fast_paths` sets it, or turns
one named fast path off alone (``shardflow.fastpath.set_enabled(False, name)``, the
general path it falls back to then runs instead):

- ``bulk``: the bulk tar header walk and its grouped runs (``format.spans``; the general
  member-by-member loop of ``format.members`` reads instead),
- ``blocks``: the block step of the planned reader (``reader.runs.blocks``: every
  position goes through the general step),
- ``jpeg``: the JPEG decode without ``Image.open`` (``codecs.image``),
- ``npy``: the cached ``.npy`` header parse (``format.npy``; the ``npy`` codec: ``numpy.load``).

All of them off turns the library's switch off (which also covers graph records and
the worker slot pool); all of them on turns it on, even in a run started with
``SHARDFLOW_FAST_PATHS=0``, so a test that compares the two settings compares them
there too. A name the library does not know fails loudly (``ValueError``), so a refactor
that drops a fast path cannot turn "off" into "on" silently. The setting is the
process's: DataLoader workers forked inside the ``with`` see it too.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Union

import pytest

from shardflow import fastpath

__all__ = ["FAST_PATHS", "fast_paths", "FastSetting"]

FastSetting = Union[bool, str]
"""``True``: every fast path on (as shipped); ``False``: all off; a name of :data:`FAST_PATHS`: that one off."""

FAST_PATHS = fastpath.NAMES


@contextmanager
def fast_paths(setting: FastSetting) -> Iterator[None]:
    """Within the block, shardflow's fast read paths as ``setting`` says (see :data:`FastSetting`)."""
    before = fastpath.enabled()
    with pytest.MonkeyPatch.context() as mp:
        if setting is True or setting is False:
            mp.setenv(fastpath.ENV, "1" if setting else "0")  # for spawned workers
            fastpath.set_enabled(setting)
        else:  # one fast path off: the switch as it is
            fastpath.set_enabled(False, setting)
        try:
            yield
        finally:
            fastpath.set_enabled(before)
