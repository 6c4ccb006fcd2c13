"""Convert an ImageFolder tree (``SRC/<class>/.../<image>``) into shards.

Conventions (torchvision's ``ImageFolder``, made safe for large trees):

- Classes are the sorted non-hidden subdirectories of ``SRC``; ``class_to_idx``
  maps each class name to its position in that order, or, with
  ``classes_from=`` (``--classes-from``), to its index in another dataset's
  ``class_to_idx`` (a val split gets its training set's indices; a class folder
  that list lacks is an error naming it). Files directly in ``SRC`` are not samples.
- Samples are the files inside a class directory, at any depth, whose
  extension is in ``extensions``, case-insensitively (``.JPG`` counts), and
  whose header checks out (:mod:`shardflow.convert.images.imagecheck`: a corrupt image
  is skipped and named in ``meta.skipped``, or refused with ``on_error="raise"``).
  Other files are ignored, counted and named (``meta.ignored``). Hidden entries
  (names starting with ``.``: ``.DS_Store``, ``.ipynb_checkpoints``) are never
  classes or samples.
- Symlinks: a symlinked directory (a class folder included) that leads back
  into the tree (``dog/all -> ..``, ``dog/cats -> ../cat``) is never followed,
  and one that leads out of it only with ``follow_links=True``
  (``--follow-links``); each is skipped and named in ``meta.ignored`` (see
  :mod:`shardflow.convert.images.walk`). A symlinked file is the file it points to.
- Order: by default a seeded shuffle of all images (``order="shuffled"``,
  :mod:`shardflow.convert.engine.mixorder`), so that every shard mixes the classes. The walk
  order (``order="walk"``) is classes in ``class_to_idx`` order; inside a directory its
  images sorted by name, then its subdirectories sorted by name, depth first.
- A class with no image is an error unless ``allow_empty`` (it keeps its index).

``SRC`` is a local folder or any fsspec URL (``s3://bucket/train``,
``gs://...``, ``memory://...``): a tree in a bucket and a local copy of it give
the same classes, keys, order, ``class_to_idx`` and shard bytes. The walk is a
stream (:mod:`shardflow.convert.images.walk`): one listing per directory
(``os.scandir``, or the store's paginated ``ls``), sorted per directory, never a
listing of the whole tree or bucket; memory holds one directory's names per level
of depth plus the descriptors of the shards in flight (see
:mod:`shardflow.convert.engine.engine`).

Sample layout: field ``<ext>`` holds the file's bytes as stored (no re-encode),
``<ext>`` being its extension lower-cased (``jpg``, ``jpeg``, ``png``, ...), and
field ``cls`` the class index (ASCII integer).

Keys: :mod:`shardflow.convert.images.imagekeys` (the file's path without its extension,
the last component escaped so that it holds no dot; reversible with
:func:`key_to_path`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Any

from ...codecs.resize import DEFAULT_QUALITY
from ...errors import ConversionError
from ...format.keys import IMAGE_EXTENSIONS
from ...format.manifest import Manifest
from ..engine.engine import ConvertOptions, run_conversion
from ..engine.mixorder import DEFAULT_ORDER, ORDERS, in_order
from .imagecheck import BuildContext, build
from .imageclasses import ClassWalk, class_indices, empty_classes, iter_images, scan_root
from .imageclasses import classes_from as read_classes
from .imagelist import ImageListing, build_chunk, identify_chunk, local_shuffle
from .imagekeys import key_names, key_to_path
from .walk import Ignored, LocalTree, Tree, open_tree

__all__ = [
    "IMAGE_EXTENSIONS",
    "ORDERS",
    "DEFAULT_ORDER",
    "convert_imagefolder",
    "find_classes",
    "count_images",
    "key_names",
    "key_to_path",
]

log = logging.getLogger(__name__)

_EXTENSION = re.compile(r"[a-z0-9_+-]+")

CHECK_BATCH = 64
"""Class folders one Dask task checks for images (the check before any shard is written)."""


def _normalize_extensions(extensions: Collection[str]) -> frozenset[str]:
    if isinstance(extensions, str):
        raise TypeError("extensions must be a collection of extensions, e.g. ('jpg', 'png'), not a str")
    exts = frozenset(e.lower().lstrip(".") for e in extensions)
    if not exts or not all(_EXTENSION.fullmatch(e) for e in exts):
        raise ValueError(f"invalid image extensions {sorted(extensions)!r}: expected names like 'jpg', 'png'")
    return exts


def _tree(src: str | os.PathLike[str], storage_options: Mapping[str, Any] | None, follow_links: bool) -> Tree:
    from ... import storage

    return open_tree(os.fspath(src), storage.IOOptions(storage_options=dict(storage_options or {})), follow_links)


def find_classes(
    src: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None, *, follow_links: bool = False
) -> list[str]:
    """The class names of an ImageFolder tree.

    Args:
        src: the tree's root, a local folder or an fsspec URL.
        storage_options: fsspec options for a remote ``src``.
        follow_links: take symlinked class folders that lead out of the tree.

    Returns:
        The sorted names of the non-hidden subdirectories of ``src`` (symlinks
        into the tree left out; see the module docstring).

    Raises:
        FileNotFoundError, NotADirectoryError: ``src`` is not a directory.
    """
    return scan_root(_tree(src, storage_options, follow_links), Ignored())


def count_images(
    src: str | os.PathLike[str],
    extensions: Collection[str] = IMAGE_EXTENSIONS,
    storage_options: Mapping[str, Any] | None = None,
    *,
    follow_links: bool = False,
) -> dict[str, int]:
    """Count the images of every class, as :func:`convert_imagefolder` takes them (before
    the header check).

    One listing pass that keeps counts only (no names kept, no sorting, no
    ``stat`` of image files); the CLI uses it for the progress bar's total.

    Returns:
        ``{class name: image count}`` in sorted class order.
    """
    tree = _tree(src, storage_options, follow_links)
    exts = _normalize_extensions(extensions)
    return {cls: sum(1 for _ in iter_images(tree, cls, exts)) for cls in scan_root(tree, Ignored())}


def _check_destination(src: str, dst: str) -> None:
    from ... import storage

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


def _class_indices(where: str, classes: list[str], given: Mapping[str, int] | None, origin: str) -> dict[str, int]:
    """``class_to_idx``: positions in sorted order, or ``given``'s indices (every folder listed)."""
    if given is None:
        return {c: i for i, c in enumerate(classes)}
    missing = [c for c in classes if c not in given]
    if missing:
        raise ConversionError(
            f"{where}: class folder(s) {', '.join(map(repr, missing))} are not among the {len(given)} classes of "
            f"{origin} ({', '.join(map(repr, list(given)[:10]))}{', ...' if len(given) > 10 else ''}); rename or "
            "remove them, or convert without --classes-from",
            reason="unknown_class",
        )
    absent = [c for c in given if c not in set(classes)]
    if absent:
        log.info("%s: %d class(es) of %s have no folder here: %s", where, len(absent), origin, ", ".join(absent[:10]))
    return dict(sorted(((c, given[c]) for c in classes), key=lambda kv: kv[1]))


def _check_empty(where: str, tree: Tree, classes: list[str], exts: frozenset[str], client: Any,
                 allow_empty: bool) -> None:  # fmt: skip
    empty = _empty_classes(tree, classes, exts, client)
    if not empty:
        return
    listed = ", ".join(repr(c) for c in empty)
    if not allow_empty:
        raise ConversionError(
            f"{where}: {len(empty)} of {len(classes)} classes have no images ({listed}); "
            f"image extensions: {', '.join(sorted(exts))}. Remove them, or pass allow_empty=True "
            "(--allow-empty) to keep them with their class index",
            reason="empty_class",
        )
    log.warning("%s: classes with no images kept (allow_empty): %s", where, listed)


def convert_imagefolder(
    src: str | os.PathLike[str],
    dst: str,
    *,
    allow_empty: bool = False,
    options: ConvertOptions = ConvertOptions(),
    progress: Callable[[int], None] | None = None,
    extensions: Collection[str] = IMAGE_EXTENSIONS,
    client: Any = None,
    classes_from: str | os.PathLike[str] | Mapping[str, int] | list[str] | None = None,
    on_error: str = "skip",
    follow_links: bool = False,
    max_side: int | None = None,
    quality: int = DEFAULT_QUALITY, order: str = DEFAULT_ORDER, seed: int = 0,
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
        classes_from: the class indices to use: a dataset folder or manifest
            URL (its ``meta.class_to_idx``), a JSON or text file of class names
            (see :func:`~shardflow.convert.images.imageclasses.classes_from`), or the
            mapping or list itself. Every class folder must be in it.
        on_error: a corrupt image: ``"skip"`` (named in ``meta.skipped``, with
            a warning) or ``"raise"``.
        follow_links: follow symlinked directories that lead out of the tree.
        max_side: shrink images with a longer side once, as they are packed
            (:mod:`shardflow.codecs.resize`); smaller ones are kept byte for byte.
        quality: JPEG/WebP quality (1..100) of the images ``max_side`` re-encodes.
        order, seed: ``"shuffled"`` (default, seeded: :mod:`~shardflow.convert.engine.mixorder`) or ``"walk"``.

    Returns:
        The manifest. Its ``meta`` holds ``class_to_idx``, ``source`` (absolute
        path or URL of ``src``), ``extensions``, ``class_counts`` (samples written per
        class: corrupt images skipped are not counted), ``image_fields`` (samples per image field, e.g. ``{"jpg": 1200,
        "png": 800}``: a sample has one of them, which ``fields=("image", ...)``
        reads as one), ``ignored_files`` (files in ``src`` or in class folders that are
        not samples: hidden, not images, not regular), ``skipped_dirs``
        (hidden directories, symlinks into or out of the tree, loops),
        ``ignored`` (the first 1,000 of both, ``{"path", "reason"}``), and
        ``skipped_count`` / ``skipped`` (corrupt images left out, named with the
        reason, the first 1,000); ``order``, ``order_seed``; with ``max_side``, ``resize``.

    Raises:
        ConversionError: ``src`` has no class folder; some classes have no
            image (one error naming all of them, raised before any shard is
            written); a class folder is not in ``classes_from``; ``dst`` is
            inside ``src``; an image could not be read, changed during the
            conversion, or (``on_error="raise"``) is corrupt.
        DestinationExistsError: ``dst`` holds another dataset (and not
            ``options.overwrite``).
        FileNotFoundError, NotADirectoryError: ``src`` is not a directory.
    """
    src = os.fspath(src)
    dst = os.fspath(dst)
    exts = _normalize_extensions(extensions)
    ctx = BuildContext(open_tree(src, options.io, follow_links), on_error, max_side, quality)
    _check_destination(src, dst)
    tree = ctx.tree
    ignored = Ignored()
    classes = scan_root(tree, ignored)
    where = tree.url("")
    if not classes:
        raise ConversionError(f"{where}: no class folders (expected SRC/<class>/<image>, e.g. {where}/cat/0001.jpg)")
    given, origin = _given_classes(classes_from, options.storage_options)
    class_to_idx = _class_indices(where, classes, given, origin)
    classes = list(class_to_idx)
    _check_empty(where, tree, classes, exts, client, allow_empty)
    walk = ClassWalk(tree, classes, list(class_to_idx.values()), exts, client, ignored)
    meta, identity = _meta(tree, class_to_idx, exts, origin if given is not None else None, ctx)
    inputs, build_step, identify, options = _ordered(walk, order, int(seed), options)
    return run_conversion(
        dst, inputs, build_step,
        context=ctx,
        meta={**meta, "order": order, "order_seed": int(seed)},
        meta_at_end=walk.summary, skipped_meta=walk.less_skipped,  # counts of the samples written
        options=options, progress=progress,
        identity=identity,
        client=client, identify=identify,
    )


def _ordered(walk: ClassWalk, order: str, seed: int, options: ConvertOptions) -> tuple[Iterable[Any], Any, Any, ConvertOptions]:
    """The inputs in ``order``, the build and identify steps that take them, and the options
    to run them with: a shuffled local tree lists names alone and gives each group of images
    as one input (:mod:`~shardflow.convert.images.imagelist`); otherwise the walk's descriptors
    (:func:`~shardflow.convert.engine.mixorder.in_order`).

    Raises:
        ValueError: an unknown order.
    """
    if order not in ORDERS:
        raise ValueError(f"order must be one of {', '.join(ORDERS)}, got {order!r}")
    if local_shuffle(walk.tree, walk.client, order):
        inputs = ImageListing(walk).chunks(seed, options.group_size or options.max_count)
        return inputs, build_chunk, identify_chunk, dataclasses.replace(options, group_size=1)
    return in_order(walk.descriptors(), order, seed), build, None, options


def _meta(tree: Tree, class_to_idx: dict[str, int], exts: frozenset[str], classes_from: str | None,
          ctx: BuildContext) -> tuple[dict[str, Any], dict[str, Any]]:  # fmt: skip
    """The manifest's ``meta`` at the start, and the identity a re-run must match to keep shards."""
    source = os.path.abspath(tree.root) if isinstance(tree, LocalTree) else tree.root
    meta: dict[str, Any] = {"class_to_idx": class_to_idx, "source": source, "extensions": sorted(exts)}
    if classes_from is not None:
        meta["classes_from"] = classes_from
    identity: dict[str, Any] = {"converter": "imagefolder", "source": source}
    if ctx.max_side is not None:
        meta["resize"] = identity["resize"] = {"max_side": ctx.max_side, "quality": ctx.quality}
    return meta, identity


def _given_classes(
    classes_from: str | os.PathLike[str] | Mapping[str, int] | list[str] | None, storage_options: Mapping[str, Any]
) -> tuple[Mapping[str, int] | None, str]:
    """``(class_to_idx, where it came from)`` of ``classes_from`` (None: not given); see
    :func:`convert_imagefolder`."""
    if isinstance(classes_from, (str, os.PathLike)):
        origin = os.fspath(classes_from)
        return read_classes(origin, storage_options), origin
    if classes_from is None:
        return None, "classes_from"
    value = dict(classes_from) if isinstance(classes_from, Mapping) else list(classes_from)
    return class_indices(value, "classes_from"), "classes_from"


def _empty_classes(tree: Tree, classes: list[str], extensions: frozenset[str], client: Any) -> list[str]:
    """The classes with no image (checked by Dask tasks of :data:`CHECK_BATCH` classes with a client)."""
    if client is None:
        return empty_classes(tree, classes, extensions)
    batches = [classes[i : i + CHECK_BATCH] for i in range(0, len(classes), CHECK_BATCH)]
    futures = [client.submit(empty_classes, tree, b, extensions, pure=False, priority=10) for b in batches]
    return [c for found in client.gather(futures) for c in found]
