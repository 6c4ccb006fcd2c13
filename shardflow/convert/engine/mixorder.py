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
Inputs known by number alone (a dataset's graph numbers, an array's rows) need no packing: their
order is :func:`input_order` itself, 8 bytes per input held (24 while it is computed).

Streams. An input that can only be read once, in order (the lines of a compressed file, a
generator of graphs), is shuffled within a window instead (:func:`window_shuffled`, the same
rule as the reader's window shuffle, :mod:`shardflow.planning.window`, without its wrap-around):
stream position ``j`` gets the key ``j + window * u_j``, ``u_j = (raw_j >> 11) * 2**-53`` where
``raw_j`` is the ``j``-th raw output of the same PCG64 stream, and the inputs leave in key order
(ties by position). An input therefore moves by less than ``window`` positions, either way (its
key lies in ``[j, j + window)``), and the inputs of any stretch of ``window`` positions are shuffled together. It needs no
length: an input leaves as soon as no later one can come before it, so at most ``window`` inputs
are held at once (plus :data:`DRAW_CHUNK` draws), whatever the stream's length.
"""

from __future__ import annotations

import heapq
import marshal
from array import array
from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

import numpy as np

from ...world import stable_seed

__all__ = ["ORDERS", "DEFAULT_ORDER", "DEFAULT_WINDOW", "PackedInputs", "check_order", "input_order", "in_order",
           "window_shuffled", "in_window_order", "order_meta"]

T = TypeVar("T")

ORDERS = ("shuffled", "walk")
"""The orders a converter writes in."""

DEFAULT_ORDER = "shuffled"

DEFAULT_WINDOW = 16_384
"""Inputs a stream's window shuffle holds at most (:func:`window_shuffled`): 16 MiB of lines of
1 KiB, for instance."""

DRAW_CHUNK = 4096
"""Raw draws :func:`window_shuffled` takes from the bit generator at once."""

_SEED_NAME = "convert-order"


def check_order(order: str) -> str:
    """``order`` if it is one of :data:`ORDERS`.

    Raises:
        ValueError: an unknown order.
    """
    if order not in ORDERS:
        raise ValueError(f"order must be one of {', '.join(ORDERS)}, got {order!r}")
    return order


def order_meta(order: str, seed: int, window: int | None = None) -> dict[str, Any]:
    """What a manifest's ``meta`` records of the order: ``order``, ``order_seed`` and, for a
    stream's window shuffle, ``order_window``."""
    meta: dict[str, Any] = {"order": order, "order_seed": int(seed)}
    if window is not None and order == "shuffled":
        meta["order_window"] = int(window)
    return meta


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
    keys = np.random.PCG64(stable_seed(_SEED_NAME, seed)).random_raw(n)
    return np.argsort(keys, kind="stable").astype(np.int64)


def in_order(inputs: Iterable[tuple[Any, ...]], order: str, seed: int) -> Iterator[tuple[Any, ...]]:
    """``inputs`` in the given order: ``"walk"`` passes them through as they come (a stream);
    ``"shuffled"`` takes them all (packed, see the module doc), then gives them out permuted.

    Raises:
        ValueError: an unknown order.
    """
    if check_order(order) == "walk":
        yield from inputs
        return
    packed = PackedInputs()
    for item in inputs:
        packed.add(item)
    for i in input_order(len(packed), seed):  # (not .tolist(): 36 bytes per input more)
        yield packed[int(i)]


def window_shuffled(inputs: Iterable[T], window: int, seed: int) -> Iterator[T]:
    """``inputs`` (a stream) in the window shuffle's order (see the module doc): input ``j`` has
    the key ``j + window * u_j`` and they leave in key order, ties by position; at most
    ``window`` inputs are held. ``window <= 1``: the stream's own order.

    Raises:
        ValueError: ``window < 1``.
    """
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    bits = np.random.PCG64(stable_seed(_SEED_NAME, seed))
    held: list[tuple[float, int, T]] = []
    keys: list[float] = []
    for j, item in enumerate(inputs):
        at = j % DRAW_CHUNK
        if at == 0:
            raw = bits.random_raw(DRAW_CHUNK)
            keys = (np.arange(j, j + DRAW_CHUNK, dtype=np.float64)
                    + window * ((raw >> np.uint64(11)).astype(np.float64) * 2.0**-53)).tolist()  # fmt: skip
        heapq.heappush(held, (keys[at], j, item))
        while held and held[0][0] < j + 1:  # every later input's key is at least its position, j + 1
            yield heapq.heappop(held)[2]
    while held:
        yield heapq.heappop(held)[2]


def in_window_order(inputs: Iterable[T], order: str, seed: int, window: int = DEFAULT_WINDOW) -> Iterator[T]:
    """A stream in the given order: ``"walk"`` as it comes, ``"shuffled"`` window-shuffled
    (:func:`window_shuffled`).

    Raises:
        ValueError: an unknown order, ``window < 1``.
    """
    if check_order(order) == "walk":
        return iter(inputs)
    return window_shuffled(inputs, window, seed)
