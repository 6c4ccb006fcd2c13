"""The order a converter writes its samples in: as walked, or a seeded shuffle of them.

A walk of an ImageFolder tree lists the classes one after the other, so shards written in walk
order hold a few classes each, and a streaming reader makes batches of a few classes. The
``"shuffled"`` order (the default of :func:`~shardflow.convert.images.imagefolder.convert_imagefolder`)
writes the walked inputs in a seeded uniform permutation instead: classes are mixed across
shards and within each shard, and any stretch of the stream is a uniform sample of the classes.

The permutation is a function of the walked inputs (their number and walk order) and the seed
alone: the keys of the inputs' permutation are the raw 64-bit outputs of numpy's PCG64 seeded with
``stable_seed("convert-order", seed)`` (the bit generator's stream is the same in every numpy
version), sorted stably. A re-run over the same tree writes the same shards, byte for byte, and
resumes a killed run (its finished shards hold the same inputs). The manifest records it as
``meta.order`` (``"shuffled"`` or ``"walk"``) and ``meta.order_seed``.

Memory. The whole walk is taken before the first input is given out (the first output may be the
last input walked). The inputs are kept packed: each as its :mod:`marshal` bytes (an image's key,
field, path, class, size and version: about 120 bytes for ImageNet's names) in one byte buffer,
plus 8 bytes of end offset and, while the order is computed, 16 bytes of key and position. About
140 bytes per input: 140 MB at 1,000,000 files, on top of the walk's own (constant) memory. (A local
ImageFolder tree converted by local processes takes a leaner path to the same order:
:mod:`shardflow.convert.images.imagelist`, names alone, about 90 bytes an image.)
"""

from __future__ import annotations

import marshal
from array import array
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

from ...world import stable_seed

__all__ = ["ORDERS", "DEFAULT_ORDER", "PackedInputs", "input_order", "in_order"]

ORDERS = ("shuffled", "walk")
"""The orders a converter writes in."""

DEFAULT_ORDER = "shuffled"


class PackedInputs:
    """Input tuples kept compactly: one byte buffer and an array of end offsets.

    Each tuple is stored as :mod:`marshal` bytes (C speed, exact for str, int, float, None and
    tuples of them); the bytes are made and read back by this process alone, never stored.
    """

    def __init__(self) -> None:
        self._blob = bytearray()
        self._ends = array("q")

    def add(self, item: tuple[Any, ...]) -> None:
        """Keep ``item`` (a tuple of str, int, float or None)."""
        self._blob += marshal.dumps(item)
        self._ends.append(len(self._blob))

    def __len__(self) -> int:
        return len(self._ends)

    def __getitem__(self, i: int) -> tuple[Any, ...]:
        start = self._ends[i - 1] if i else 0
        return marshal.loads(self._blob[start : self._ends[i]])


def input_order(n: int, seed: int) -> np.ndarray:
    """The shuffled order of ``n`` walked inputs: int64, shape (n,), a permutation of ``range(n)``
    (output position ``p`` writes input ``order[p]``)."""
    keys = np.random.PCG64(stable_seed("convert-order", seed)).random_raw(n)
    return np.argsort(keys, kind="stable").astype(np.int64)


def in_order(inputs: Iterable[tuple[Any, ...]], order: str, seed: int) -> Iterator[tuple[Any, ...]]:
    """``inputs`` in the given order: ``"walk"`` passes them through as they come (a stream);
    ``"shuffled"`` takes them all (packed, see the module doc), then gives them out permuted.

    Raises:
        ValueError: an unknown order.
    """
    if order not in ORDERS:
        raise ValueError(f"order must be one of {', '.join(ORDERS)}, got {order!r}")
    if order == "walk":
        yield from inputs
        return
    packed = PackedInputs()
    for item in inputs:
        packed.add(item)
    for i in input_order(len(packed), seed):  # (not .tolist(): 36 bytes per input more)
        yield packed[int(i)]
