"""Walking an ImageFolder tree as a stream, on local disk or in any fsspec store.

One directory is listed at a time (``os.scandir`` locally; the store's
paginated, delimiter-based listing, ``fs.ls``, for a bucket: never a listing of
the whole bucket), its names sorted, and the walk goes depth first; memory
holds one directory's entries per level of depth. A local tree and a copy of it
in a bucket give the same classes, samples, order and counts (a bucket has no
symlinks and no empty directories, so those cases only arise locally).

Symlinked directories (local trees). A link whose target (``os.path.realpath``)
is the root or lies inside the tree is never followed: its images are already
walked under their own path (or it is a loop, like ``dog/all -> ..``), so
following it would pack them twice, under the wrong class. A link that leads
out of the tree is not followed either unless ``follow_links=True``
(``--follow-links``): a tree's content is then what lies under its root. Both
are skipped and named (:class:`Ignored`), from the root down: a class folder
that is such a link is skipped too. Symlinked *files* are taken as the file
they point to (a split made of links to the original images converts).

What is a class, a sample or ignored is the rule of
:mod:`shardflow.convert.images.imagefolder`; this module only lists.
"""

from __future__ import annotations

import logging
import os
import posixpath
from operator import itemgetter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from ... import storage
from ...errors import redact

__all__ = ["Entry", "Ignored", "Tree", "LocalTree", "RemoteTree", "open_tree", "extension", "iter_dirs"]

log = logging.getLogger(__name__)

_READ_FLAGS = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)

IGNORED_NAMED = 1000
"""Entries :class:`Ignored` names (the first ones in walk order); its counts are always exact."""


def extension(name: str) -> str:
    """Lower-cased extension after the last dot ('' when none)."""
    dot = name.rfind(".")
    return name[dot + 1 :].lower() if dot > 0 else ""


class Entry(NamedTuple):
    """One directory entry: name, kind, and for files size and a version token
    (``mtime_ns`` locally, the store's ETag or modification time remotely);
    ``link``: a symlink to a directory. (A tuple: made once per file of the tree, it costs a
    third of a frozen dataclass.)"""

    name: str
    is_dir: bool
    is_file: bool
    size: int = -1
    version: Any = None
    link: bool = False


@dataclass
class Ignored:
    """What a walk left out: exact counts, and the first :data:`IGNORED_NAMED` entries named.

    Attributes:
        files: files that are not samples (hidden, not images, not regular files).
        dirs: directories not walked (hidden, symlinks into or out of the tree,
            loops, unreadable).
        named: ``(path relative to the root, reason)`` in walk order.
    """

    files: int = 0
    dirs: int = 0
    named: list[tuple[str, str]] = field(default_factory=list)

    def add(self, path: str, reason: str, *, is_dir: bool) -> None:
        """Count one entry left out, and name it while fewer than the limit are named."""
        if is_dir:
            self.dirs += 1
        else:
            self.files += 1
        if len(self.named) < IGNORED_NAMED:
            self.named.append((path, reason))

    def update(self, other: Ignored) -> None:
        """Add another walk's record (a Dask listing task's) after this one's."""
        self.files += other.files
        self.dirs += other.dirs
        self.named.extend(other.named[: max(0, IGNORED_NAMED - len(self.named))])


class Tree:
    """A source tree; paths are ``/``-separated, relative to its root ('' is the root)."""

    root: str

    def scan(self, rel: str) -> Iterator[Entry]:
        """The entries of one directory, unsorted (lazily where the store allows:
        a caller that stops early reads no further).

        Raises:
            OSError: it cannot be listed (FileNotFoundError, NotADirectoryError).
        """
        raise NotImplementedError

    def listing(self, rel: str) -> list[Entry]:
        """The entries of one directory, all of them, sorted by name (:meth:`scan`'s)."""
        return sorted(self.scan(rel), key=_name)

    def dir_id(self, rel: str) -> Any:
        """An identity of the directory (stops symlink loops); None if unreadable."""
        return rel

    def link_verdict(self, rel: str) -> str | None:
        """Why the symlinked directory ``rel`` is not followed, or None to follow it
        (see the module docstring)."""
        return None

    def url(self, rel: str) -> str:
        """The URL or path of an entry."""
        raise NotImplementedError

    def read(self, rel: str, size: int = -1) -> bytes:
        """One file's bytes.

        Args:
            rel: the file's path.
            size: its size when listed, if known; a result of another length
                means the file changed since (the caller checks it).
        """
        raise NotImplementedError


class LocalTree(Tree):
    """A folder on this machine.

    Args:
        root: the folder.
        follow_links: follow symlinked directories that lead out of the tree
            (links into the tree are never followed; see the module docstring).
    """

    def __init__(self, root: str, follow_links: bool = False) -> None:
        self.root = root
        self.follow_links = follow_links
        self._prefix = os.path.join(root, "")  # root and a separator: a file's path is this + rel
        self._real = os.path.realpath(root)

    def url(self, rel: str) -> str:
        return os.path.join(self.root, *rel.split("/")) if rel else self.root

    def scan(self, rel: str) -> Iterator[Entry]:
        with os.scandir(self.url(rel)) as it:
            for e in it:
                is_dir = e.is_dir()
                yield Entry(e.name, is_dir, not is_dir and e.is_file(), -1, None, is_dir and e.is_symlink())

    def listing(self, rel: str) -> list[Entry]:
        # once per file of the tree: the entries made in one comprehension (no generator, no
        # NamedTuple constructor call), a file's with one test (what is a file is no folder)
        make = tuple.__new__
        with os.scandir(self.url(rel)) as it:
            entries = [make(Entry, (e.name, False, True, -1, None, False)) if e.is_file()
                       else make(Entry, (e.name, d := e.is_dir(), False, -1, None, d and e.is_symlink()))
                       for e in it]  # fmt: skip
        entries.sort(key=_name)
        return entries

    def link_verdict(self, rel: str) -> str | None:
        path = self.url(rel)
        target = os.path.realpath(path)
        if _within(target, self._real):
            parent = os.path.realpath(os.path.dirname(path))
            if _within(parent, target):
                return f"a symlink loop (to {_shown(target, self._real)}, a folder above it)"
            return f"a symlink into the tree (to {_shown(target, self._real)}: its images are walked there)"
        if not self.follow_links:
            return f"a symlink out of the tree (to {target}; --follow-links / follow_links=True follows it)"
        return None

    def stat(self, rel: str) -> tuple[int, int]:
        """``(size in bytes, mtime in ns)`` of a file (symlinks followed)."""
        st = os.stat(self._prefix + rel)
        return st.st_size, st.st_mtime_ns

    def read_versioned(self, rel: str) -> tuple[bytes, int, int]:
        """``(bytes, size, mtime in ns)`` of a file (symlinks followed): size and version
        from the open file (``fstat``), the bytes read from it after; they differ in
        length only when the file changed in between (the caller checks it).

        Raises:
            OSError: the file cannot be opened or read.
        """
        fd = os.open(self._prefix + rel, _READ_FLAGS)
        try:
            st = os.fstat(fd)
            size = st.st_size
            data = os.read(fd, size + 1)
            if len(data) > size:  # it grew since: read it all, for the caller to see the change
                chunks = [data]
                while chunk := os.read(fd, 1 << 20):
                    chunks.append(chunk)
                data = b"".join(chunks)
            return data, size, st.st_mtime_ns
        finally:
            os.close(fd)

    def dir_id(self, rel: str) -> Any:
        try:
            st = os.stat(self.url(rel))
        except OSError:
            return None
        return st.st_dev, st.st_ino

    def read(self, rel: str, size: int = -1) -> bytes:
        # os-level calls: one open, one read and one close per file of the listed size (the
        # builtin open adds an fstat, an ioctl and a read at the end of the file)
        fd = os.open(self._prefix + rel, _READ_FLAGS)
        try:
            data = os.read(fd, size + 1) if size >= 0 else b""
            if len(data) == size:
                return data  # the listed size, read in one call: all of it
            chunks = [data]
            while chunk := os.read(fd, 1 << 20):  # a short read, a changed file, or the size unknown
                chunks.append(chunk)
            return b"".join(chunks)
        finally:
            os.close(fd)


def _within(path: str, folder: str) -> bool:
    """Whether ``path`` is ``folder`` or lies under it (both real paths)."""
    return path == folder or path.startswith(os.path.join(folder, ""))


def _shown(target: str, root: str) -> str:
    """A real path inside the tree, shown relative to its root ('.' for the root)."""
    return os.path.relpath(target, root).replace(os.sep, "/")


_VERSION_KEYS = ("ETag", "etag", "md5Hash", "generation", "LastModified", "last_modified", "mtime", "updated")


class RemoteTree(Tree):
    """A prefix in an fsspec store (``s3://bucket/train``, ``gs://...``, ``memory://...``).

    Args:
        root: the tree's URL.
        io: storage options for the store.
    """

    def __init__(self, root: str, io: storage.IOOptions) -> None:
        self.root = root.rstrip("/")
        self.io = io
        self._fs: Any = None
        self._path = ""

    @property
    def fs(self) -> Any:
        if self._fs is None:  # built lazily: a tree sent to a worker builds its own
            self._fs, self._path = storage.filesystem(self.root, self.io)
            self._path = self._path.rstrip("/")
        return self._fs

    def __getstate__(self) -> dict[str, Any]:
        return {"root": self.root, "io": self.io, "_fs": None, "_path": ""}

    def _full(self, rel: str) -> str:
        if self._fs is None:
            self.fs  # noqa: B018 - sets the store's path of the root
        return f"{self._path}/{rel}" if rel else self._path

    def url(self, rel: str) -> str:
        return f"{self.root}/{rel}" if rel else self.root

    def scan(self, rel: str) -> Iterator[Entry]:
        return iter(self._list(rel))

    def _list(self, rel: str) -> list[Entry]:
        path = self._full(rel)
        try:
            infos = self.fs.ls(path, detail=True)
        finally:
            # listings are not kept: a million-file walk must not grow fsspec's cache
            invalidate = getattr(self.fs, "invalidate_cache", None)
            if invalidate is not None:
                invalidate(path)
        if not infos and not self.fs.isdir(path):
            raise FileNotFoundError(f"{self.url(rel)}: no such folder")
        out = []
        for info in infos:
            name = posixpath.basename(str(info["name"]).rstrip("/"))
            if str(info["name"]).rstrip("/") == path or not name:
                continue  # the folder's own marker object
            if info.get("type") == "directory":
                out.append(Entry(name, True, False))
            else:
                version = next((str(info[k]) for k in _VERSION_KEYS if info.get(k) is not None), None)
                out.append(Entry(name, False, True, int(info.get("size") or 0), version))
        return out

    def read(self, rel: str, size: int = -1) -> bytes:
        # start=0: one GET (s3fs sends a HEAD first for a plain cat_file, to split big objects)
        return self.fs.cat_file(self._full(rel), start=0)


def open_tree(src: str, io: storage.IOOptions, follow_links: bool = False) -> Tree:
    """The tree at ``src``: a local folder (a path or ``file://``) or an fsspec URL.

    ``follow_links``: see :class:`LocalTree` (a bucket has no symlinks).
    """
    if storage.is_local(src):
        return LocalTree(src[len("file://") :] if src.startswith("file://") else src, follow_links)
    return RemoteTree(src, io)


_name = itemgetter(0)  # an Entry's name


def iter_dirs(tree: Tree, top: str, ignored: Ignored) -> Iterator[tuple[str, list[Entry]]]:
    """``(relative dir, its sorted entries)`` of ``top`` and its subdirectories, depth first.

    A directory's subdirectories are visited in sorted order after it. Hidden
    directories, symlinked directories that :meth:`Tree.link_verdict` refuses,
    symlink loops (outside the tree, with ``follow_links``) and unreadable
    directories are not entered; they are added to ``ignored`` (the last three
    with a warning).
    """
    # (sorted subdirectories still to visit, directory id) for each directory on the current
    # path, from the root down (a link back to the root or a class is a loop)
    stack: list[tuple[Iterator[str], Any]] = [(iter(()), tree.dir_id(""))]
    rel: str | None = top
    ident = tree.dir_id(top)
    while rel is not None:
        entries = tree.listing(rel)
        yield rel, entries
        dirs = []
        for e in entries:
            if not e.is_dir:
                continue
            path = f"{rel}/{e.name}"
            why = "hidden" if e.name.startswith(".") else tree.link_verdict(path) if e.link else None
            if why is None:
                dirs.append(path)
                continue
            ignored.add(path, why, is_dir=True)
            (log.debug if why == "hidden" else log.warning)("%s: %s, skipped", redact(tree.url(path)), why)
        stack.append((iter(dirs), ident))
        rel = None
        while stack and rel is None:
            child = next(stack[-1][0], None)
            if child is None:
                stack.pop()
                continue
            ident = tree.dir_id(child)
            if ident is None or any(ident == i for _, i in stack):
                why = "unreadable" if ident is None else "a symlink loop"
                ignored.add(child, why, is_dir=True)
                log.warning("%s: %s, skipped", redact(tree.url(child)), why)
                continue
            rel = child
