"""Turning shardflow's fast read paths off, for tests that run every read both ways.

STYLE.md asks for one switch that turns every fast variant off. Until the library has
it, :func:`fast_paths` turns them off here, each by the one call that chooses it
(so the general path it falls back to runs instead):

- the bulk tar header walk and its grouped runs (``format.tar``: ``_plain_members``,
  ``indexed_heads``, which ``member_runs`` calls; the general member-by-member loop
  reads instead),
- the block path of ``stages.read_planned`` (``_blocks``: every position goes through
  the general step),
- the JPEG decode without ``Image.open`` (``codecs.image._load_jpeg``),
- the cached ``.npy`` header parse (the ``npy`` codec: ``numpy.load`` instead).

The patches are module attributes: DataLoader workers forked inside the ``with`` see
them too. Replace the body by the library's switch once it lands (engineer
``refactor``, issue 21), keeping this one entry point.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest

from shardflow import codecs, stages
from shardflow.codecs import image
from shardflow.format import tar

__all__ = ["fast_paths", "FAST_PATHS"]

FAST_PATHS = ("tar bulk walk", "read_planned blocks", "jpeg without Image.open", "npy header cache")


def _no_bulk(buf: bytes, pos: int, *args: object, **kwargs: object) -> tuple[list, int]:
    return [], pos


def _no_heads(*args: object, **kwargs: object) -> tuple[list, list]:
    return [], []


def _no_blocks(run: np.ndarray, sample: np.ndarray, wanted: np.ndarray) -> np.ndarray:
    return np.zeros(len(run), dtype=np.int64)


def _npy_load(data: bytes, options: object) -> np.ndarray:
    return np.load(io.BytesIO(data), allow_pickle=False)


@contextmanager
def fast_paths(on: bool) -> Iterator[None]:
    """Within the block, shardflow's fast read paths are on (as shipped) or all off."""
    if on:
        yield
        return
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tar, "_plain_members", _no_bulk)
        mp.setattr(tar, "indexed_heads", _no_heads)
        mp.setattr(stages, "_blocks", _no_blocks)
        mp.setattr(image, "_load_jpeg", lambda *a, **k: None)
        mp.setitem(codecs._DECODERS, "npy", _npy_load)
        yield
