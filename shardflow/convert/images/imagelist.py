"""The shuffled conversion of a local ImageFolder tree: a listing of names alone, cut into
chunks of the seeded order, and the worker step that reads a chunk.

The walk order streams descriptors that carry each file's size and version, taken by a
``stat`` in the listing process (:mod:`~shardflow.convert.images.imageclasses`). A shuffled
conversion cannot stream (the first sample written may be the last one walked): the whole
listing comes before the first write, so here it is kept as small and made as fast as it can
be. The listing keeps the names the walk finds and nothing else, no ``stat`` per file; each
worker takes a file's size and version from the file it opened (``fstat``) and hands them to
the engine (a :class:`~shardflow.convert.engine.groups.Versions` item), which records them in
the group's digest. A re-run takes them with a ``stat`` per file, for the groups an earlier run
finished only (:func:`identify_chunk`), before it keeps them.

The order is :func:`~shardflow.convert.engine.mixorder.input_order` over the walk order: the
same images, in the same permutation, as ``in_order(walk descriptors, "shuffled", seed)``, so
the same shards, byte for byte. Each group of ``group_size`` images of that order is one
:class:`Chunk`, one engine input (the engine runs with ``group_size=1``).

Memory (the converting process): per image its name (a ``str``: 60 bytes for ``0000000.jpg``)
and its slot in one list (8 bytes), 8 bytes of permutation and, while the permutation is
computed, 16 bytes more; per directory holding images, its path, class and first position.
About 90 bytes an image: 90 MB at 1,000,000 files.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...errors import ConversionError
from ..engine.groups import Versions
from ..engine.mixorder import input_order
from .imagecheck import BuildContext, checked, skipped
from .imageclasses import ClassWalk, dir_images
from .imagekeys import odd_key_names
from .walk import LocalTree, iter_dirs

__all__ = ["Chunk", "ImageListing", "build_chunk", "identify_chunk", "local_shuffle"]


@dataclass(frozen=True)
class Chunk:
    """The images of one group, in output order (pickled to a worker; its ``repr`` is what the
    group's digest hashes).

    Attributes:
        heads: the directories of these images, each as its path relative to the tree's
            root and a ``/``.
        labels: each directory's class index.
        dirs: each image's directory: int32 little-endian positions in ``heads``.
        names: each image's file name.
        odd: ``(position, key basename)`` for the images whose key basename is not their
            stem (:func:`~shardflow.convert.images.imagekeys.odd_key_names`).
    """

    heads: tuple[str, ...]
    labels: tuple[int, ...]
    dirs: bytes
    names: tuple[str, ...]
    odd: tuple[tuple[int, str], ...] = ()

    def files(self) -> Iterator[tuple[int, str]]:
        """``(directory position, path relative to the root)`` of each image, in order."""
        heads = self.heads
        for d, name in zip(np.frombuffer(self.dirs, dtype="<i4").tolist(), self.names):
            yield d, heads[d] + name


class ImageListing:
    """The images of a local tree, walked as :class:`ClassWalk` walks it, names only.

    :meth:`chunks` lists the tree (counting classes, fields and what it ignores in ``walk``,
    whose ``summary`` and ``less_skipped`` then serve the manifest) and cuts the shuffled
    order into chunks.

    Args:
        walk: the classes, their indices, the extensions and the record of what is ignored.
    """

    def __init__(self, walk: ClassWalk) -> None:
        self.walk = walk
        self.heads: list[str] = []
        self.labels: list[int] = []
        self.starts = array("q")  # each directory's first image
        self.names: list[str] = []  # every image's file name, in walk order
        self.odd: dict[int, str] = {}  # image number -> key basename, where not its stem

    def list(self) -> None:
        """Walk the tree (once: one ``os.scandir`` per directory, no ``stat`` per file)."""
        walk = self.walk
        for k, (index, cls) in enumerate(zip(walk.indices, walk.classes)):
            for rel, entries in iter_dirs(walk.tree, cls, walk.ignored):
                head = rel + "/"
                images, fields = dir_images(head, entries, walk.extensions, walk.ignored)
                if not images:
                    continue
                names = [e[0] for e in images]
                first = len(self.names)
                for i, base in odd_key_names(names).items():
                    self.odd[first + i] = base
                self.heads.append(head)
                self.labels.append(index)
                self.starts.append(first)
                self.names += names
                walk.class_counts[k] += len(names)
                walk.image_fields.update(fields)

    def chunks(self, seed: int, size: int) -> Iterator[Chunk]:
        """List the tree, then give its images in the shuffled order of ``seed``, ``size``
        at a time."""
        self.list()
        n = len(self.names)
        order = input_order(n, seed)
        starts = np.frombuffer(self.starts, dtype=np.int64) if n else np.zeros(0, np.int64)
        for first in range(0, n, size):
            numbers = order[first : first + size]
            used, local = np.unique(np.searchsorted(starts, numbers, side="right") - 1, return_inverse=True)
            picked = numbers.tolist()
            odd = tuple((j, self.odd[i]) for j, i in enumerate(picked) if i in self.odd) if self.odd else ()
            yield Chunk(
                heads=tuple(self.heads[d] for d in used.tolist()),
                labels=tuple(self.labels[d] for d in used.tolist()),
                dirs=local.astype("<i4").tobytes(),
                names=tuple([self.names[i] for i in picked]),
                odd=odd,
            )


def _versions(sizes: array, versions: array) -> str:
    """The :class:`Versions` text of files' sizes and modification times (ns), in order."""
    h = hashlib.sha256(np.asarray(sizes, dtype="<i8").tobytes())
    h.update(np.asarray(versions, dtype="<i8").tobytes())
    return h.hexdigest()


def build_chunk(chunks: list[Chunk], ctx: BuildContext) -> Iterator[Any]:
    """Engine build step (worker): each image of the chunks read (its size and version from
    the open file), checked and yielded as a sample, or a ``Skipped`` for a corrupt one; last,
    the :class:`~shardflow.convert.engine.groups.Versions` of every file read.

    Raises:
        ConversionError: a file cannot be read or changed while it was read; a corrupt
            image under ``on_error="raise"``.
    """
    tree = ctx.tree
    if not isinstance(tree, LocalTree):
        raise TypeError(f"build_chunk reads local trees, not {type(tree).__name__}")
    read = tree.read_versioned
    sizes, versions = array("q"), array("q")
    for chunk in chunks:
        heads, names, odd = chunk.heads, chunk.names, dict(chunk.odd)
        labels = [b"%d" % i for i in chunk.labels]
        for j, d in enumerate(np.frombuffer(chunk.dirs, dtype="<i4").tolist()):
            head, name = heads[d], names[j]
            rel = head + name
            try:
                data, size, version = read(rel)
            except OSError as e:
                raise ConversionError(f"{tree.url(rel)}: cannot read the image: {e}") from e
            if len(data) != size:
                raise ConversionError(f"{tree.url(rel)}: changed during the conversion ({size} bytes when opened, "
                                      f"{len(data)} read)")  # fmt: skip
            sizes.append(size)
            versions.append(version)
            data, why = checked(data, ctx)
            if why is None:
                dot = name.rfind(".")
                yield head + (odd[j] if j in odd else name[:dot]), {name[dot + 1 :].lower(): data, "cls": labels[d]}
            else:
                yield skipped(rel, why, ctx)
    yield Versions(_versions(sizes, versions))


def identify_chunk(chunks: list[Chunk], ctx: BuildContext) -> str:
    """The :class:`Versions` text :func:`build_chunk` yields for ``chunks``, from a ``stat``
    of every file (the engine's ``identify``: a re-run, before keeping a finished group).

    Raises:
        OSError: a file is gone.
    """
    tree = ctx.tree
    if not isinstance(tree, LocalTree):
        raise TypeError(f"identify_chunk reads local trees, not {type(tree).__name__}")
    sizes, versions = array("q"), array("q")
    for chunk in chunks:
        for _, rel in chunk.files():
            size, version = tree.stat(rel)
            sizes.append(size)
            versions.append(version)
    return _versions(sizes, versions)


def local_shuffle(tree: Any, client: Any, order: str) -> bool:
    """Whether a conversion takes this module's path: a shuffled order of a local tree,
    written by local processes (a Dask cluster's listing tasks and remote trees keep the
    streaming walk)."""
    return order == "shuffled" and client is None and isinstance(tree, LocalTree)
