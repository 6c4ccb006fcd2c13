"""Convert an ImageFolder tree (``SRC/<class>/.../<image>``) into shards.

Conventions (torchvision's ``ImageFolder``, made safe for large trees):

- Classes are the sorted non-hidden subdirectories of ``SRC`` (symlinks
  followed); ``class_to_idx`` maps each class name to its position in that
  order. Files directly in ``SRC`` are not samples.
- Samples are the files inside a class directory, at any depth (symlinked
  directories are followed, as ``os.walk(followlinks=True)``; a symlink back to
  a directory on the current path is skipped), whose extension is in
  ``extensions``, case-insensitively (``.JPG`` counts). Other files are ignored
  and counted. Hidden entries (names starting with ``.``: ``.DS_Store``,
  ``.ipynb_checkpoints``) are never classes or samples.
- Order: classes in ``class_to_idx`` order; inside a directory its images
  sorted by name, then its subdirectories sorted by name, depth first.
- A class with no image is an error unless ``allow_empty`` (it keeps its index).

``SRC`` is a local folder or any fsspec URL (``s3://bucket/train``,
``gs://...``, ``memory://...``): a tree in a bucket and a local copy of it give
the same classes, keys, order, ``class_to_idx`` and shard bytes. The walk is a
stream (:mod:`shardflow.convert.walk`): one listing per directory
(``os.scandir``, or the store's paginated ``ls``), sorted per directory, never a
listing of the whole tree or bucket; memory holds one directory's names per level
of depth plus the descriptors of the shards in flight (see
:mod:`shardflow.convert.engine`).

Sample layout: field ``<ext>`` holds the file's bytes as stored (no re-encode),
``<ext>`` being its extension lower-cased (``jpg``, ``jpeg``, ``png``, ...), and
field ``cls`` the class index (ASCII integer).

Key rule (reversible, see :func:`key_to_path`): the key is the file's path
relative to ``SRC`` with the extension removed, ``/``-separated. Its last
component is escaped so that it holds no dot (the webdataset key/field split
stops at the first dot of the basename): ``%`` -> ``%25``, ``.`` -> ``%2E``,
``~`` -> ``%7E``, and a leading ``__`` -> ``%5F_`` (``__`` marks metadata
members). When two images in one directory share a stem (``x.jpg`` and
``x.png``), each of them gets its original extension appended after a ``~``
(``cat/x~jpg``, ``cat/x~png``), so keys never collide: ``cat/a.b.jpg`` is key
``cat/a%2Eb``, ``cat/x.jpg`` beside ``cat/x.PNG`` is ``cat/x~jpg`` and the other
``cat/x~PNG``.
"""

from __future__ import annotations

import logging
import os
import re
from collections import Counter
from collections.abc import Callable, Collection, Iterator
from concurrent.futures import ThreadPoolExecutor
from operator import itemgetter
from typing import Any

from ..errors import ConversionError
from ..format.keys import IMAGE_EXTENSIONS
from ..format.manifest import Manifest
from .engine import ConvertOptions, run_conversion
from .walk import Entry, LocalTree, Tree, extension, iter_dirs, open_tree

__all__ = [
    "IMAGE_EXTENSIONS",
    "convert_imagefolder",
    "find_classes",
    "count_images",
    "key_to_path",
]

log = logging.getLogger(__name__)


_ESCAPES = str.maketrans({"%": "%25", ".": "%2E", "~": "%7E"})
_UNESCAPE = re.compile(r"%([0-9A-F]{2})")
_EXTENSION = re.compile(r"[a-z0-9_+-]+")

# A descriptor, one per sample, built in the walking process and sent to workers:
# (key, field, path relative to SRC, class index, size in bytes, version: mtime in ns
# locally, the store's ETag or modification time in a bucket).
# Size and version make a re-run rewrite a shard whose files changed in place.
Descriptor = tuple[str, str, str, int, int, Any]

CHECK_BATCH = 64
"""Class folders one Dask task checks for images (the check before any shard is written)."""

LIST_BATCH = 8
"""Class folders one Dask listing task lists."""

LIST_AHEAD = 8
"""Dask listing tasks run ahead of the writing (their descriptors wait on the workers)."""

READ_THREADS = 16
"""Objects a worker reads at once from a bucket (in order; at most twice as many held)."""


def _escape(stem: str) -> str:
    out = stem.translate(_ESCAPES)
    if out.startswith("__"):
        out = "%5F" + out[1:]
    return out


def _key_names(images: list[str]) -> list[str]:
    """The key basenames of one directory's image files (names with an extension), in order.

    See the module docstring: the stem escaped, plus ``~<extension>`` when several
    images of the directory share the stem.
    """
    stems = [name.rpartition(".") for name in images]
    shared = Counter(stem for stem, _, _ in stems)
    return [_escape(stem) + (f"~{ext}" if shared[stem] > 1 else "") for stem, _, ext in stems]


def key_to_path(key: str) -> tuple[str, str | None]:
    """Invert the key rule of this module.

    Args:
        key: a key written by :func:`convert_imagefolder`.

    Returns:
        ``(path, extension)``: the file's path relative to ``SRC`` without its
        extension (``/``-separated), and its extension as spelled on disk when
        the key records it (stems shared by several images of one directory),
        else None (the extension is then the sample's image field, lower-cased).
    """
    head, slash, base = key.rpartition("/")
    stem, tilde, ext = base.partition("~")
    name = _UNESCAPE.sub(lambda m: chr(int(m.group(1), 16)), stem)
    return head + slash + name, (ext if tilde else None)


def _normalize_extensions(extensions: Collection[str]) -> frozenset[str]:
    if isinstance(extensions, str):
        raise TypeError("extensions must be a collection of extensions, e.g. ('jpg', 'png'), not a str")
    exts = frozenset(e.lower().lstrip(".") for e in extensions)
    if not exts or not all(_EXTENSION.fullmatch(e) for e in exts):
        raise ValueError(f"invalid image extensions {sorted(extensions)!r}: expected names like 'jpg', 'png'")
    return exts


def find_classes(src: str | os.PathLike[str], storage_options: dict[str, Any] | None = None) -> list[str]:
    """The class names of an ImageFolder tree.

    Args:
        src: the tree's root, a local folder or an fsspec URL.
        storage_options: fsspec options for a remote ``src``.

    Returns:
        The sorted names of the non-hidden subdirectories of ``src`` (symlinks
        followed).

    Raises:
        FileNotFoundError, NotADirectoryError: ``src`` is not a directory.
    """
    return _scan_root(_tree(src, storage_options))[0]


def _tree(src: str | os.PathLike[str], storage_options: dict[str, Any] | None) -> Tree:
    from .. import storage

    return open_tree(os.fspath(src), storage.IOOptions(storage_options=dict(storage_options or {})))


def _scan_root(tree: Tree) -> tuple[list[str], int, int]:
    """``(classes, ignored files, skipped directories)`` of the tree's root."""
    classes: list[str] = []
    files = dirs = 0
    for entry in tree.scan(""):
        if entry.is_dir and not entry.name.startswith("."):
            classes.append(entry.name)
            continue
        if entry.is_dir:
            dirs += 1
        else:
            files += 1
        log.debug("%s: not a class directory, ignored", tree.url(entry.name))
    return sorted(classes), files, dirs


def list_classes(
    tree: Tree, first: int, classes: list[str], extensions: frozenset[str]
) -> tuple[list[list[Descriptor]], dict[str, int]]:
    """The descriptors of a few consecutive classes (class ``first`` onwards), each class's in
    output order, and the counts of what was skipped.

    The listing task of a Dask conversion; a local conversion streams :func:`iter_class`.
    """
    counts = {"ignored_files": 0, "skipped_dirs": 0}
    found = [[d for batch in iter_class(tree, first + k, cls, extensions, counts) for d in batch]
             for k, cls in enumerate(classes)]  # fmt: skip
    return found, counts


def iter_class(
    tree: Tree, index: int, cls: str, extensions: frozenset[str], counts: dict[str, int]
) -> Iterator[list[Descriptor]]:
    """The descriptors of one class, depth first, one list per directory that holds images;
    adds to ``counts`` what is not a sample."""
    stat = tree.stat if isinstance(tree, LocalTree) else None
    for rel, entries in iter_dirs(tree, cls, counts):
        images: list[Entry] = []
        fields: list[str] = []
        for entry in entries:
            if entry.name.startswith("."):
                counts["skipped_dirs" if entry.is_dir else "ignored_files"] += 1
                log.debug("%s: hidden, ignored", tree.url(f"{rel}/{entry.name}"))
            elif entry.is_dir:
                continue
            elif entry.is_file and (field := extension(entry.name)) in extensions:
                images.append(entry)
                fields.append(field)
            else:
                counts["ignored_files"] += 1
                log.debug("%s: not an image file, ignored", tree.url(f"{rel}/{entry.name}"))
        if not images:
            continue
        head = rel + "/"
        batch = []
        for entry, base, field in zip(images, _key_names([e.name for e in images]), fields):
            path = head + entry.name
            size, version = stat(path) if stat is not None else (entry.size, entry.version)
            batch.append((head + base, field, path, index, size, version))
        yield batch


class _Walk:
    """The streaming walk of the class directories (in this process, or as Dask tasks)."""

    def __init__(self, tree: Tree, classes: list[str], extensions: frozenset[str], client: Any) -> None:
        self.tree = tree
        self.classes = classes
        self.extensions = extensions
        self.client = client
        self.class_counts = [0] * len(classes)
        self.image_fields: Counter[str] = Counter()  # field (the file extension) -> images stored in it
        self.counts = {"ignored_files": 0, "skipped_dirs": 0}

    def descriptors(self) -> Iterator[Descriptor]:
        """Every sample's descriptor, in output order."""
        for idx, batches in enumerate(self._classes()):
            for batch in batches:
                self.class_counts[idx] += len(batch)
                self.image_fields.update(map(itemgetter(1), batch))
                yield from batch

    def _classes(self) -> Iterator[Iterator[list[Descriptor]]]:
        if self.client is None:
            for idx, cls in enumerate(self.classes):
                yield iter_class(self.tree, idx, cls, self.extensions, self.counts)
            return
        # one listing task per LIST_BATCH classes, LIST_AHEAD tasks ahead of the writing (a group
        # of 10,000 files spans many classes: fewer would stall the writing), results taken in
        # order; the listings go before the write tasks queued on the workers
        futures: list[Any] = []
        for first in range(0, len(self.classes), LIST_BATCH):
            names = self.classes[first : first + LIST_BATCH]
            futures.append(
                self.client.submit(list_classes, self.tree, first, names, self.extensions, pure=False, priority=10)
            )
            if len(futures) > LIST_AHEAD:
                yield from self._take(futures.pop(0))
        while futures:
            yield from self._take(futures.pop(0))

    def _take(self, future: Any) -> Iterator[Iterator[list[Descriptor]]]:
        found, counts = future.result()
        del future  # its result leaves the worker's memory
        for k, v in counts.items():
            self.counts[k] += v
        for descriptors in found:
            yield iter([descriptors])

    def summary(self) -> dict[str, Any]:
        """Counts for the manifest's ``meta`` (call after the walk)."""
        return {"class_counts": dict(zip(self.classes, self.class_counts)),
                "image_fields": dict(sorted(self.image_fields.items())), **self.counts}


def _has_image(tree: Tree, cls: str, extensions: frozenset[str]) -> bool:
    """Whether a class directory holds an image at any depth; stops at the first one."""
    return next(_images(tree, cls, extensions), None) is not None


def _images(tree: Tree, top: str, extensions: frozenset[str]) -> Iterator[str]:
    """The images under ``top`` in no particular order (listings only, no sorting)."""
    seen = {tree.dir_id(top)}
    todo = [top]
    while todo:
        rel = todo.pop()
        subdirs = []
        for entry in tree.scan(rel):
            if entry.name.startswith("."):
                continue
            if entry.is_dir:
                subdirs.append(f"{rel}/{entry.name}")
            elif entry.is_file and extension(entry.name) in extensions:
                yield entry.name
        for sub in subdirs:
            ident = tree.dir_id(sub)
            if ident is not None and ident not in seen:
                seen.add(ident)
                todo.append(sub)


def count_images(
    src: str | os.PathLike[str],
    extensions: Collection[str] = IMAGE_EXTENSIONS,
    storage_options: dict[str, Any] | None = None,
) -> dict[str, int]:
    """Count the images of every class, as :func:`convert_imagefolder` takes them.

    One listing pass that keeps counts only (no names kept, no sorting, no
    ``stat`` of image files); the CLI uses it for the progress bar's total.

    Returns:
        ``{class name: image count}`` in class order.
    """
    tree = _tree(src, storage_options)
    exts = _normalize_extensions(extensions)
    return {cls: sum(1 for _ in _images(tree, cls, exts)) for cls in _scan_root(tree)[0]}


def _read_in_order(tree: Tree, descriptors: list[Descriptor]) -> Iterator[bytes]:
    """The files' bytes in order; from a bucket :data:`READ_THREADS` objects at a time."""
    if isinstance(tree, LocalTree):
        for d in descriptors:
            yield tree.read(d[2], d[4])
        return
    with ThreadPoolExecutor(READ_THREADS, thread_name_prefix="shardflow-read") as pool:
        window: list[Any] = []
        for d in descriptors:
            window.append(pool.submit(tree.read, d[2]))
            if len(window) >= 2 * READ_THREADS:
                yield window.pop(0).result()
        for fut in window:
            yield fut.result()


def _build(descriptors: list[Descriptor], tree: Tree) -> Iterator[tuple[str, dict[str, bytes]]]:
    """Engine build step (worker): read each image's bytes as stored."""
    reads = _read_in_order(tree, descriptors)
    for key, field, rel, idx, size, _ in descriptors:
        try:
            data = next(reads)
        except (OSError, ValueError) as e:
            raise ConversionError(f"{tree.url(rel)}: cannot read the image: {e}") from e
        if len(data) != size:
            raise ConversionError(
                f"{tree.url(rel)}: changed during the conversion ({size} bytes when listed, {len(data)} when read)"
            )
        yield key, {field: data, "cls": b"%d" % idx}


def _check_destination(src: str, dst: str) -> None:
    from .. import storage

    if storage.is_local(src) != storage.is_local(dst):
        return
    if storage.is_local(dst):
        strip = lambda u: u[len("file://") :] if u.startswith("file://") else u  # noqa: E731
        inner, outer = os.path.realpath(strip(dst)), os.path.realpath(strip(src))
        sep = os.sep
    else:
        inner, outer, sep = dst.rstrip("/"), src.rstrip("/"), "/"
    if inner == outer or inner.startswith(outer.rstrip(sep) + sep):
        raise ConversionError(f"destination {dst!r} is inside the source tree {src!r}: it would be read as a class; choose a folder outside it")


def convert_imagefolder(
    src: str | os.PathLike[str],
    dst: str,
    *,
    allow_empty: bool = False,
    options: ConvertOptions = ConvertOptions(),
    progress: Callable[[int], None] | None = None,
    extensions: Collection[str] = IMAGE_EXTENSIONS,
    client: Any = None,
) -> Manifest:
    """Convert an ImageFolder tree into tar shards plus ``shardflow.json``.

    See the module docstring for which files are samples, their order and the
    key rule. Each sample has the field ``<ext>`` (the file's bytes as stored,
    ``<ext>`` its extension lower-cased) and ``cls`` (int class index). The
    output is byte-identical for the same tree whatever ``options.workers``,
    the engine (local processes or Dask) and where the tree is (a folder or a
    bucket); a re-run keeps the shards a crashed or finished run completed (a
    shard is rewritten when any of its files changed path, size or version).

    Args:
        src: the tree's root: a local folder or an fsspec URL (``s3://bucket/train``).
        dst: destination folder, local or fsspec URL (not inside ``src``).
        allow_empty: keep classes with no image (with their index) instead of
            raising.
        options: shard size, prefix, workers, resume, overwrite, storage options
            (used for both ``src`` and ``dst``).
        progress: ``progress(n)`` is called with the sample count of every
            finished (or kept) shard.
        extensions: file extensions taken as images (case-insensitive).
        client: a ``dask.distributed.Client``: list each class folder and write
            the shards as tasks on its cluster (its workers must reach ``src``
            and ``dst``); None: local processes.

    Returns:
        The manifest. Its ``meta`` holds ``class_to_idx``, ``source`` (absolute
        path or URL of ``src``), ``extensions``, ``class_counts`` (images per
        class), ``image_fields`` (images per image field, e.g. ``{"jpg": 1200,
        "png": 800}``: a sample has one of them, which ``fields=("image", ...)``
        reads as one), ``ignored_files`` (files in ``src`` or in class folders that are
        not samples: hidden, not images, not regular) and ``skipped_dirs``
        (hidden directories, symlink loops).

    Raises:
        ConversionError: ``src`` has no class folder; some classes have no
            image (one error naming all of them, raised before any shard is
            written); ``dst`` is inside ``src``; an image could not be read or
            changed during the conversion.
        DestinationExistsError: ``dst`` holds another dataset (and not
            ``options.overwrite``).
        FileNotFoundError, NotADirectoryError: ``src`` is not a directory.
    """
    src = os.fspath(src)
    dst = os.fspath(dst)
    exts = _normalize_extensions(extensions)
    _check_destination(src, dst)
    tree = open_tree(src, options.io)
    classes, ignored_files, skipped_dirs = _scan_root(tree)
    where = tree.url("")
    if not classes:
        raise ConversionError(f"{where}: no class folders (expected SRC/<class>/<image>, e.g. {where}/cat/0001.jpg)")
    empty = _empty_classes(tree, classes, exts, client)
    if empty:
        listed = ", ".join(repr(c) for c in empty)
        if not allow_empty:
            raise ConversionError(
                f"{where}: {len(empty)} of {len(classes)} classes have no images ({listed}); "
                f"image extensions: {', '.join(sorted(exts))}. Remove them, or pass allow_empty=True "
                "(--allow-empty) to keep them with their class index",
                reason="empty_class",
            )
        log.warning("%s: classes with no images kept (allow_empty): %s", where, listed)
    walk = _Walk(tree, classes, exts, client)
    walk.counts["ignored_files"] = ignored_files
    walk.counts["skipped_dirs"] = skipped_dirs
    source = os.path.abspath(tree.root) if isinstance(tree, LocalTree) else tree.root
    meta = {
        "class_to_idx": {c: i for i, c in enumerate(classes)},
        "source": source,
        "extensions": sorted(exts),
    }
    return run_conversion(
        dst,
        walk.descriptors(),
        _build,
        context=tree,
        meta=meta,
        meta_at_end=walk.summary,
        options=options,
        progress=progress,
        identity={"converter": "imagefolder", "source": source},
        client=client,
    )


def _empty_classes(tree: Tree, classes: list[str], extensions: frozenset[str], client: Any) -> list[str]:
    """The classes with no image (checked by Dask tasks of :data:`CHECK_BATCH` classes with a client)."""
    if client is None:
        return empty_classes(tree, classes, extensions)
    batches = [classes[i : i + CHECK_BATCH] for i in range(0, len(classes), CHECK_BATCH)]
    futures = [client.submit(empty_classes, tree, b, extensions, pure=False, priority=10) for b in batches]
    return [c for found in client.gather(futures) for c in found]


def empty_classes(tree: Tree, classes: list[str], extensions: frozenset[str]) -> list[str]:
    """Those of ``classes`` that hold no image (each check stops at the first image)."""
    return [c for c in classes if not _has_image(tree, c, extensions)]
