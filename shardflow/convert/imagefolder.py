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

The walk is a stream: one ``os.scandir`` per directory, sorted per directory,
never a listing of the whole tree; memory holds one directory's names per level
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
from typing import Any

from ..errors import ConversionError
from ..format.keys import IMAGE_EXTENSIONS
from ..format.manifest import Manifest
from .engine import ConvertOptions, run_conversion

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
# (key, field, path relative to SRC, class index, size in bytes, mtime in ns).
# Size and mtime make a re-run rewrite a shard whose files changed in place.
Descriptor = tuple[str, str, str, int, int, int]


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


def _extension(name: str) -> str:
    """Lower-cased extension after the last dot ('' when none)."""
    dot = name.rfind(".")
    return name[dot + 1 :].lower() if dot > 0 else ""


def _normalize_extensions(extensions: Collection[str]) -> frozenset[str]:
    if isinstance(extensions, str):
        raise TypeError("extensions must be a collection of extensions, e.g. ('jpg', 'png'), not a str")
    exts = frozenset(e.lower().lstrip(".") for e in extensions)
    if not exts or not all(_EXTENSION.fullmatch(e) for e in exts):
        raise ValueError(f"invalid image extensions {sorted(extensions)!r}: expected names like 'jpg', 'png'")
    return exts


def find_classes(src: str | os.PathLike[str]) -> list[str]:
    """The class names of an ImageFolder tree.

    Args:
        src: the tree's root.

    Returns:
        The sorted names of the non-hidden subdirectories of ``src`` (symlinks
        followed).

    Raises:
        FileNotFoundError, NotADirectoryError: ``src`` is not a directory.
    """
    return _scan_root(os.fspath(src))[0]


def _scan_root(src: str) -> tuple[list[str], int, int]:
    """``(classes, ignored files, skipped directories)`` of the tree's root."""
    classes: list[str] = []
    files = dirs = 0
    with os.scandir(src) as it:
        for entry in it:
            is_dir = entry.is_dir()
            if is_dir and not entry.name.startswith("."):
                classes.append(entry.name)
                continue
            if is_dir:
                dirs += 1
            else:
                files += 1
            log.debug("%s: not a class directory, ignored", entry.path)
    return sorted(classes), files, dirs


def _dir_id(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


class _Walk:
    """The streaming walk of the class directories; counts what it sees."""

    def __init__(self, src: str, classes: list[str], extensions: frozenset[str]) -> None:
        self.src = src
        self.classes = classes
        self.extensions = extensions
        self.class_counts = [0] * len(classes)
        self.ignored_files = 0
        self.skipped_dirs = 0

    def _list(self, path: str) -> tuple[list[str], list[str]]:
        """One directory's image names and subdirectory names, both sorted."""
        images: list[str] = []
        dirs: list[str] = []
        with os.scandir(path) as it:
            for entry in it:
                name = entry.name
                if name.startswith("."):
                    if entry.is_dir():
                        self.skipped_dirs += 1
                    else:
                        self.ignored_files += 1
                    log.debug("%s: hidden, ignored", entry.path)
                elif entry.is_dir():
                    dirs.append(name)
                elif _extension(name) in self.extensions and entry.is_file():
                    images.append(name)
                else:
                    self.ignored_files += 1
                    log.debug("%s: not an image file, ignored", entry.path)
        images.sort()
        dirs.sort()
        return images, dirs

    def _class_files(self, cls: str) -> Iterator[tuple[str, str, str]]:
        """``(relative directory, image name, key basename)`` of one class, depth first.

        The relative directory starts with the class name and ends with ``/``.
        """
        root = os.path.join(self.src, cls)
        # (sorted subdirectories still to visit, directory id) for each directory on
        # the current path; the ids stop symlink loops
        stack: list[tuple[Iterator[str], tuple[int, int] | None]] = []
        rel: str | None = ""
        ident = _dir_id(root)
        while rel is not None:
            images, dirs = self._list(os.path.join(root, rel) if rel else root)
            prefix = f"{cls}/{rel}"
            for name, base in zip(images, _key_names(images)):
                yield prefix, name, base
            stack.append((iter([f"{rel}{d}/" for d in dirs]), ident))
            rel = None
            while stack and rel is None:
                child = next(stack[-1][0], None)
                if child is None:
                    stack.pop()
                    continue
                path = os.path.join(root, child)
                ident = _dir_id(path)
                if ident is None or any(ident == i for _, i in stack):
                    self.skipped_dirs += 1
                    log.warning("%s: %s, skipped", path, "unreadable" if ident is None else "a symlink loop")
                    continue
                rel = child

    def descriptors(self) -> Iterator[Descriptor]:
        """Every sample's descriptor, in output order."""
        for idx, cls in enumerate(self.classes):
            for prefix, name, base in self._class_files(cls):
                rel = prefix + name
                st = os.stat(os.path.join(self.src, rel))
                self.class_counts[idx] += 1
                yield prefix + base, _extension(name), rel, idx, st.st_size, st.st_mtime_ns

    def summary(self) -> dict[str, Any]:
        """Counts for the manifest's ``meta`` (call after the walk)."""
        return {
            "class_counts": dict(zip(self.classes, self.class_counts)),
            "ignored_files": self.ignored_files,
            "skipped_dirs": self.skipped_dirs,
        }


def _has_image(root: str, extensions: frozenset[str]) -> bool:
    """Whether a class directory holds an image at any depth; stops at the first one."""
    seen = {_dir_id(root)}
    todo = [root]
    while todo:
        path = todo.pop()
        subdirs = []
        with os.scandir(path) as it:
            for entry in it:
                if entry.name.startswith("."):
                    continue
                if entry.is_dir():
                    subdirs.append(entry.path)
                elif _extension(entry.name) in extensions and entry.is_file():
                    return True
        for sub in subdirs:
            ident = _dir_id(sub)
            if ident is not None and ident not in seen:
                seen.add(ident)
                todo.append(sub)
    return False


def count_images(
    src: str | os.PathLike[str], extensions: Collection[str] = IMAGE_EXTENSIONS
) -> dict[str, int]:
    """Count the images of every class, as :func:`convert_imagefolder` takes them.

    One ``os.scandir`` pass that keeps counts only (no names, no sorting, no
    ``stat`` of image files); the CLI uses it for the progress bar's total.

    Returns:
        ``{class name: image count}`` in class order.
    """
    src = os.fspath(src)
    exts = _normalize_extensions(extensions)
    return {cls: _count_class(os.path.join(src, cls), exts) for cls in find_classes(src)}


def _count_class(root: str, extensions: frozenset[str]) -> int:
    seen = {_dir_id(root)}
    todo = [root]
    count = 0
    while todo:
        with os.scandir(todo.pop()) as it:
            for entry in it:
                if entry.name.startswith("."):
                    continue
                if entry.is_dir():
                    ident = _dir_id(entry.path)
                    if ident is not None and ident not in seen:
                        seen.add(ident)
                        todo.append(entry.path)
                elif _extension(entry.name) in extensions and entry.is_file():
                    count += 1
    return count


def _build(descriptors: list[Descriptor], src: str) -> Iterator[tuple[str, dict[str, bytes]]]:
    """Engine build step (worker process): read each image's bytes as stored."""
    for key, field, rel, idx, size, _ in descriptors:
        path = os.path.join(src, rel)
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError as e:
            raise ConversionError(f"{path}: cannot read the image: {e}") from e
        if len(data) != size:
            raise ConversionError(f"{path}: changed during the conversion ({size} bytes when listed, {len(data)} when read)")
        yield key, {field: data, "cls": b"%d" % idx}


def _check_destination(src: str, dst: str) -> None:
    if "://" in dst and not dst.startswith("file://"):
        return
    local = dst[len("file://") :] if dst.startswith("file://") else dst
    real_src = os.path.realpath(src)
    real_dst = os.path.realpath(local)
    if real_dst == real_src or real_dst.startswith(real_src.rstrip(os.sep) + os.sep):
        raise ConversionError(f"destination {dst!r} is inside the source tree {src!r}: it would be read as a class; choose a folder outside it")


def convert_imagefolder(
    src: str | os.PathLike[str],
    dst: str,
    *,
    allow_empty: bool = False,
    options: ConvertOptions = ConvertOptions(),
    progress: Callable[[int], None] | None = None,
    extensions: Collection[str] = IMAGE_EXTENSIONS,
) -> Manifest:
    """Convert an ImageFolder tree into tar shards plus ``shardflow.json``.

    See the module docstring for which files are samples, their order and the
    key rule. Each sample has the field ``<ext>`` (the file's bytes as stored,
    ``<ext>`` its extension lower-cased) and ``cls`` (int class index). The
    output is byte-identical for the same tree whatever ``options.workers``; a
    re-run keeps the shards a crashed or finished run completed (a shard is
    rewritten when any of its files changed path, size or mtime).

    Args:
        src: the tree's root (a local folder).
        dst: destination folder, local or fsspec URL (not inside ``src``).
        allow_empty: keep classes with no image (with their index) instead of
            raising.
        options: shard size, prefix, workers, resume, storage options.
        progress: ``progress(n)`` is called with the sample count of every
            finished (or kept) shard.
        extensions: file extensions taken as images (case-insensitive).

    Returns:
        The manifest. Its ``meta`` holds ``class_to_idx``, ``source`` (absolute
        path of ``src``), ``extensions``, ``class_counts`` (images per class),
        ``ignored_files`` (files in ``src`` or in class folders that are not
        samples: hidden, not images, not regular) and ``skipped_dirs`` (hidden
        directories, symlink loops).

    Raises:
        ConversionError: ``src`` has no class folder; some classes have no
            image (one error naming all of them, raised before any shard is
            written); ``dst`` is inside ``src``; an image could not be read or
            changed during the conversion.
        FileNotFoundError, NotADirectoryError: ``src`` is not a directory.
    """
    src = os.fspath(src)
    dst = os.fspath(dst)
    exts = _normalize_extensions(extensions)
    _check_destination(src, dst)
    classes, ignored_files, skipped_dirs = _scan_root(src)
    if not classes:
        raise ConversionError(f"{src}: no class folders (expected SRC/<class>/<image>, e.g. {src}/cat/0001.jpg)")
    empty = [c for c in classes if not _has_image(os.path.join(src, c), exts)]
    if empty:
        listed = ", ".join(repr(c) for c in empty)
        if not allow_empty:
            raise ConversionError(
                f"{src}: {len(empty)} of {len(classes)} classes have no images ({listed}); "
                f"image extensions: {', '.join(sorted(exts))}. Remove them, or pass allow_empty=True "
                "(--allow-empty) to keep them with their class index",
                reason="empty_class",
            )
        log.warning("%s: classes with no images kept (allow_empty): %s", src, listed)
    walk = _Walk(src, classes, exts)
    walk.ignored_files = ignored_files
    walk.skipped_dirs = skipped_dirs
    source = os.path.abspath(src)
    meta = {
        "class_to_idx": {c: i for i, c in enumerate(classes)},
        "source": source,
        "extensions": sorted(exts),
    }
    return run_conversion(
        dst,
        walk.descriptors(),
        _build,
        context=source,
        meta=meta,
        meta_at_end=walk.summary,
        options=options,
        progress=progress,
    )
