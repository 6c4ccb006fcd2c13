"""Walking an ImageFolder tree as a stream, on local disk or in any fsspec store.

One directory is listed at a time (``os.scandir`` locally; the store's
paginated, delimiter-based listing, ``fs.ls``, for a bucket: never a listing of
the whole bucket), its names sorted, and the walk goes depth first; memory
holds one directory's entries per level of depth. A local tree and a copy of it
in a bucket give the same classes, samples, order and counts (a bucket has no
symlinks and no empty directories, so those cases only arise locally).

What is a class, a sample or ignored is the rule of
:mod:`shardflow.convert.imagefolder`; this module only lists.
"""

from __future__ import annotations

import logging
import os
import posixpath
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from .. import storage

__all__ = ["Entry", "Tree", "LocalTree", "RemoteTree", "open_tree", "extension"]

log = logging.getLogger(__name__)

_READ_FLAGS = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)


def extension(name: str) -> str:
    """Lower-cased extension after the last dot ('' when none)."""
    dot = name.rfind(".")
    return name[dot + 1 :].lower() if dot > 0 else ""


@dataclass(frozen=True)
class Entry:
    """One directory entry: name, kind, and for files size and a version token
    (``mtime_ns`` locally, the store's ETag or modification time remotely)."""

    name: str
    is_dir: bool
    is_file: bool
    size: int = -1
    version: Any = None


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

    def dir_id(self, rel: str) -> Any:
        """An identity of the directory (stops symlink loops); None if unreadable."""
        return rel

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
    """A folder on this machine (symlinks followed, as ``os.walk(followlinks=True)``)."""

    def __init__(self, root: str) -> None:
        self.root = root
        self._prefix = os.path.join(root, "")  # root and a separator: a file's path is this + rel

    def url(self, rel: str) -> str:
        return os.path.join(self.root, *rel.split("/")) if rel else self.root

    def scan(self, rel: str) -> Iterator[Entry]:
        with os.scandir(self.url(rel)) as it:
            for e in it:
                is_dir = e.is_dir()
                yield Entry(e.name, is_dir, not is_dir and e.is_file())

    def stat(self, rel: str) -> tuple[int, int]:
        """``(size in bytes, mtime in ns)`` of a file (symlinks followed)."""
        st = os.stat(self._prefix + rel)
        return st.st_size, st.st_mtime_ns

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


def open_tree(src: str, io: storage.IOOptions) -> Tree:
    """The tree at ``src``: a local folder (a path or ``file://``) or an fsspec URL."""
    if storage.is_local(src):
        return LocalTree(src[len("file://") :] if src.startswith("file://") else src)
    return RemoteTree(src, io)


def iter_dirs(tree: Tree, top: str, counts: dict[str, int]) -> Iterator[tuple[str, list[Entry]]]:
    """``(relative dir, its sorted entries)`` of ``top`` and its subdirectories, depth first.

    A directory's subdirectories are visited in sorted order after it. Symlink
    loops and unreadable directories are skipped and counted in
    ``counts["skipped_dirs"]`` (with a warning).
    """
    # (sorted subdirectories still to visit, directory id) for each directory on the current path
    stack: list[tuple[Iterator[str], Any]] = []
    rel: str | None = top
    ident = tree.dir_id(top)
    while rel is not None:
        entries = sorted(tree.scan(rel), key=lambda e: e.name)
        yield rel, entries
        dirs = [e.name for e in entries if e.is_dir and not e.name.startswith(".")]
        stack.append((iter([f"{rel}/{d}" for d in dirs]), ident))
        rel = None
        while stack and rel is None:
            child = next(stack[-1][0], None)
            if child is None:
                stack.pop()
                continue
            ident = tree.dir_id(child)
            if ident is None or any(ident == i for _, i in stack):
                counts["skipped_dirs"] += 1
                log.warning("%s: %s, skipped", tree.url(child), "unreadable" if ident is None else "a symlink loop")
                continue
            rel = child
