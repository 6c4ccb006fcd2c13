"""The classes and samples of an ImageFolder tree: which folders are classes, which files
are samples, and the streaming walk that lists them (in this process or as Dask tasks).

The rules are those of :mod:`shardflow.convert.images.imagefolder`; listing one directory
is :mod:`shardflow.convert.images.walk`'s job. ``--classes-from`` (:func:`classes_from`)
takes the class indices of another dataset (a training set's for its val split).
"""

from __future__ import annotations

import json
import logging
import unicodedata
from collections import Counter
from collections.abc import Iterator, Mapping
from operator import itemgetter
from typing import Any

from ...errors import ConversionError, redact
from .imagekeys import key_names
from .walk import Entry, Ignored, LocalTree, Tree, extension, iter_dirs

__all__ = [
    "Descriptor", "ClassWalk", "scan_root", "classes_from", "class_indices", "iter_class", "dir_images", "list_classes",
    "iter_images", "empty_classes", "LIST_BATCH", "LIST_AHEAD",
]  # fmt: skip

log = logging.getLogger(__name__)

# A descriptor, one per sample, built in the walking process and sent to workers:
# (key, field, path relative to SRC, class index, size in bytes, version: mtime in ns
# locally, the store's ETag or modification time in a bucket).
# Size and version make a re-run rewrite a shard whose files changed in place.
Descriptor = tuple[str, str, str, int, int, Any]

LIST_BATCH = 8
"""Class folders one Dask listing task lists."""

LIST_AHEAD = 8
"""Dask listing tasks run ahead of the writing (their descriptors wait on the workers)."""


def scan_root(tree: Tree, ignored: Ignored) -> list[str]:
    """The sorted class names of the tree's root; what is not a class goes to ``ignored``.

    A class is a non-hidden directory (a symlinked one only where
    :meth:`~shardflow.convert.images.walk.Tree.link_verdict` allows it).
    """
    classes: list[str] = []
    for entry in sorted(tree.scan(""), key=lambda e: e.name):
        why = None
        if entry.name.startswith("."):
            why = "hidden"
        elif not entry.is_dir:
            why = "not in a class folder"
        elif entry.link:
            why = tree.link_verdict(entry.name)
        if why is None:
            classes.append(entry.name)
            continue
        ignored.add(entry.name, why, is_dir=entry.is_dir)
        (log.warning if entry.link else log.debug)("%s: %s, not a class", redact(tree.url(entry.name)), why)
    _refuse_lookalikes(tree, classes)
    return classes


def _refuse_lookalikes(tree: Tree, classes: list[str]) -> None:
    """Refuse class folders whose names differ only in Unicode normalization ('café' written
    NFC and NFD): they would be two classes that print identically.

    Raises:
        ConversionError: names both folders, escaped so that they differ (``'caf\\xe9'``,
            ``'cafe\\u0301'``).
    """
    seen: dict[str, str] = {}
    for name in classes:
        other = seen.setdefault(unicodedata.normalize("NFC", name), name)
        if other != name:
            raise ConversionError(
                f"{redact(tree.url(''))}: class folders {ascii(other)} and {ascii(name)} differ only in their "
                f"Unicode normalization (both read {unicodedata.normalize('NFC', name)!r}); rename or merge one "
                "of them, as two classes they could not be told apart"
            )


def classes_from(source: str, storage_options: Mapping[str, Any] | None = None) -> dict[str, int]:
    """The class indices to reuse: another dataset's ``meta.class_to_idx``, or a list of names.

    Args:
        source: a dataset folder or manifest URL (its ``meta["class_to_idx"]``,
            as ``convert imagefolder`` writes it), a JSON file (a list of names,
            index = position, or an object ``{name: index}``), or a text file
            with one class name per line (blank lines ignored).
        storage_options: fsspec options for a remote ``source``.

    Returns:
        ``{class name: index}``.

    Raises:
        ConversionError: the source holds no class names, or they are not
            distinct names with distinct non-negative indices.
        FileNotFoundError: no such dataset or file.
    """
    from ... import storage
    from ...format.manifest import MANIFEST_NAME, Manifest

    io = storage.IOOptions(storage_options=dict(storage_options or {}))
    url = storage.join_url(source, MANIFEST_NAME) if storage.is_dir(source, io) else source
    text = b"".join(storage.iter_chunks(url, 0, None, io)).decode("utf-8-sig")
    try:
        value: Any = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, (list, dict)):  # a text list, even one whose single name parses as JSON ("7", "null")
        value = [line.strip() for line in text.splitlines() if line.strip()]
    if isinstance(value, dict) and value.get("format") == "shardflow":
        value = Manifest.loads(text, url=url).meta.get("class_to_idx")
        if not isinstance(value, dict):
            raise ConversionError(f"{url}: the manifest has no meta.class_to_idx (a dataset made by convert imagefolder has one)")
    return class_indices(value, url)


def class_indices(value: Any, where: str) -> dict[str, int]:
    """``value`` (a list of names, or ``{name: index}``) checked and made ``{name: index}``.

    Raises:
        ConversionError: empty, not names, repeated names or indices, negative indices.
    """
    if isinstance(value, list):
        value = {name: i for i, name in enumerate(value)} if len(set(map(str, value))) == len(value) else value
    if isinstance(value, list):
        repeated = sorted(n for n, c in Counter(map(str, value)).items() if c > 1)
        raise ConversionError(f"{where}: class names listed twice: {', '.join(map(repr, repeated))}")
    if not isinstance(value, dict) or not value:
        raise ConversionError(f"{where}: expected class names (a JSON list or object, or one name per line)")
    bad = [k for k, v in value.items() if not isinstance(k, str) or not k or isinstance(v, bool) or not isinstance(v, int) or v < 0]
    if bad:
        raise ConversionError(f"{where}: class indices must be non-negative ints of non-empty names; bad: {bad[:5]!r}")
    twice = sorted(i for i, c in Counter(value.values()).items() if c > 1)
    if twice:
        raise ConversionError(f"{where}: several classes share the indices {twice[:5]}")
    return dict(value)


def iter_class(tree: Tree, index: int, cls: str, extensions: frozenset[str], ignored: Ignored) -> Iterator[list[Descriptor]]:
    """The descriptors of one class, depth first, one list per directory that holds images;
    adds to ``ignored`` what is not a sample."""
    stat = tree.stat if isinstance(tree, LocalTree) else None
    for rel, entries in iter_dirs(tree, cls, ignored):
        head = rel + "/"
        images, fields = dir_images(head, entries, extensions, ignored)
        if not images:
            continue
        batch = []
        for entry, base, field in zip(images, key_names([e[0] for e in images]), fields):
            path = head + entry[0]
            size, version = stat(path) if stat is not None else (entry.size, entry.version)
            batch.append((head + base, field, path, index, size, version))
        yield batch


def dir_images(head: str, entries: list[Entry], extensions: frozenset[str],
               ignored: Ignored) -> tuple[list[Entry], list[str]]:  # fmt: skip
    """The image entries of one listed directory (``head``: its path and a slash), in the
    order given, and their fields (extensions lower-cased); adds to ``ignored`` the files that
    are not samples (hidden, not regular, another extension). Subdirectories are left out."""
    images: list[Entry] = []
    fields: list[str] = []
    for entry in entries:  # once per file of the tree: plain indexing, the extension inlined
        name, is_dir, is_file = entry[0], entry[1], entry[2]
        if is_dir:
            continue  # hidden and refused ones are named by iter_dirs
        dot = name.rfind(".")
        if name[0] == ".":
            ignored.add(head + name, "hidden", is_dir=False)
        elif not is_file:
            ignored.add(head + name, "not a regular file (a broken link?)", is_dir=False)
        elif (field := name[dot + 1 :].lower() if dot > 0 else "") in extensions:
            images.append(entry)
            fields.append(field)
        else:
            ignored.add(head + name, "not an image (extension)", is_dir=False)
    return images, fields


def list_classes(
    tree: Tree, indices: list[int], classes: list[str], extensions: frozenset[str]
) -> tuple[list[list[Descriptor]], Ignored]:
    """The descriptors of a few classes (with their indices), each class's in output order,
    and what was left out. The listing task of a Dask conversion; a local one streams
    :func:`iter_class`."""
    ignored = Ignored()
    found = [[d for batch in iter_class(tree, idx, cls, extensions, ignored) for d in batch]
             for idx, cls in zip(indices, classes)]  # fmt: skip
    return found, ignored


class ClassWalk:
    """The streaming walk of the class directories (in this process, or as Dask tasks).

    Args:
        tree: the source tree.
        classes: the class folders, in output order.
        indices: each class's index (its position, or ``--classes-from``'s).
        extensions: image extensions.
        client: a Dask client, or None.
        ignored: what the root's scan left out (the walk adds to it).
    """

    def __init__(self, tree: Tree, classes: list[str], indices: list[int], extensions: frozenset[str],
                 client: Any, ignored: Ignored) -> None:  # fmt: skip
        self.tree = tree
        self.classes = classes
        self.indices = indices
        self.extensions = extensions
        self.client = client
        self.class_counts = [0] * len(classes)
        self.image_fields: Counter[str] = Counter()  # field (the file extension) -> images stored in it
        self.ignored = ignored

    def descriptors(self) -> Iterator[Descriptor]:
        """Every sample's descriptor, in output order."""
        for k, batches in enumerate(self._classes()):
            for batch in batches:
                self.class_counts[k] += len(batch)
                self.image_fields.update(map(itemgetter(1), batch))
                yield from batch

    def _classes(self) -> Iterator[Iterator[list[Descriptor]]]:
        if self.client is None:
            for idx, cls in zip(self.indices, self.classes):
                yield iter_class(self.tree, idx, cls, self.extensions, self.ignored)
            return
        # one listing task per LIST_BATCH classes, LIST_AHEAD tasks ahead of the writing (a group
        # of 10,000 files spans many classes: fewer would stall the writing), results taken in
        # order; the listings go before the write tasks queued on the workers
        futures: list[Any] = []
        for first in range(0, len(self.classes), LIST_BATCH):
            span = slice(first, first + LIST_BATCH)
            futures.append(self.client.submit(list_classes, self.tree, self.indices[span], self.classes[span],
                                              self.extensions, pure=False, priority=10))  # fmt: skip
            if len(futures) > LIST_AHEAD:
                yield from self._take(futures.pop(0))
        while futures:
            yield from self._take(futures.pop(0))

    def _take(self, future: Any) -> Iterator[Iterator[list[Descriptor]]]:
        found, ignored = future.result()
        del future  # its result leaves the worker's memory
        self.ignored.update(ignored)
        for descriptors in found:
            yield iter([descriptors])

    def less_skipped(self, skipped: list[str]) -> dict[str, Any]:
        """``class_counts`` and ``image_fields`` without the images the build skipped (their
        paths ``<class>/.../<name>.<ext>``, as :class:`~shardflow.convert.groups.Skipped` names
        them), so that they add up to the samples written."""
        position = {c: k for k, c in enumerate(self.classes)}
        counts, fields = list(self.class_counts), Counter(self.image_fields)
        for rel in skipped:
            k = position.get(rel.split("/", 1)[0])
            if k is not None:
                counts[k] -= 1
                fields[extension(rel.rsplit("/", 1)[-1])] -= 1
        return {"class_counts": dict(zip(self.classes, counts)),
                "image_fields": {f: n for f, n in sorted(fields.items()) if n > 0}}

    def summary(self) -> dict[str, Any]:
        """Counts and names for the manifest's ``meta`` (call after the walk)."""
        return {
            "class_counts": dict(zip(self.classes, self.class_counts)),
            "image_fields": dict(sorted(self.image_fields.items())),
            "ignored_files": self.ignored.files,
            "skipped_dirs": self.ignored.dirs,
            "ignored": [{"path": p, "reason": r} for p, r in self.ignored.named],
            "skipped_count": 0,  # corrupt images: the engine sets both when its build skipped any
            "skipped": [],
        }


def iter_images(tree: Tree, top: str, extensions: frozenset[str]) -> Iterator[str]:
    """The images under ``top`` in no particular order (listings only, no sorting), with the
    walk's rules for hidden entries and symlinked directories."""
    seen = {tree.dir_id(""), tree.dir_id(top)}
    todo = [top]
    while todo:
        rel = todo.pop()
        subdirs = []
        for entry in tree.scan(rel):
            if entry.name.startswith("."):
                continue
            if entry.is_dir:
                sub = f"{rel}/{entry.name}"
                if not entry.link or tree.link_verdict(sub) is None:
                    subdirs.append(sub)
            elif entry.is_file and extension(entry.name) in extensions:
                yield entry.name
        for sub in subdirs:
            ident = tree.dir_id(sub)
            if ident is not None and ident not in seen:
                seen.add(ident)
                todo.append(sub)


def empty_classes(tree: Tree, classes: list[str], extensions: frozenset[str]) -> list[str]:
    """Those of ``classes`` that hold no image (each check stops at the first image)."""
    return [c for c in classes if next(iter_images(tree, c, extensions), None) is None]
