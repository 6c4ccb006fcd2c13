"""The files of one remote object in a staging area (see :mod:`shardflow.storage.sharing.staged`):
its meta file (size and identity), its blocks, their claims and read marks.

Every file is opened with ``O_NOFOLLOW`` (:func:`~shardflow.storage.sharing.areas.open_private`):
a symbolic link in an area is an ``UnsafeFolderError``, never followed."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import threading
from collections.abc import Mapping

from ..errors import ShardChangedError
from ..backends.filesystems import identity_difference
from ..options import IOOptions
from .areas import lock_held, open_private, same_file
from .staging import StagingScope

logger = logging.getLogger(__name__)

__all__ = ["BLOCK", "StagedObject", "read_text", "remove_block", "write_text"]

BLOCK = 8 << 20
"""Bytes per staged block: the unit of claims, of removal and of the disk bound."""


class StagedObject:
    """One remote object in a staging area: its meta file and block files."""

    def __init__(self, scope: StagingScope, url: str, options: IOOptions) -> None:
        self.scope = scope
        self.url = url
        self.options = options
        h = hashlib.sha256(url.encode()).hexdigest()[:32]
        self.base = os.path.join(scope.root, h)
        self.size: int | None = None
        self.identity: dict[str, str] | None = None
        self.known = False  # meta read
        self.block = BLOCK  # bytes per block (read once: the module's value when made)

    def block_path(self, j: int) -> str:
        return f"{self.base}.{j}"

    def block_len(self, j: int) -> int | None:
        """Bytes of block ``j`` once complete (None: size not known yet)."""
        if not self.known or self.size is None:
            return None
        return max(0, min(self.block, self.size - j * self.block))

    def load_meta(self) -> bool:
        """Read the object's size and identity if a fetch recorded them; whether known."""
        if self.known:
            return True
        try:
            meta = json.loads(read_text(self.base + ".meta"))
        except FileNotFoundError:
            return False
        self.size, self.identity, self.known = meta["size"], meta["identity"], True
        return True

    def record_meta(self, size: int | None, identity: Mapping[str, str]) -> None:
        """Record size and identity at a fetch's first open; one version per area.

        Raises:
            ShardChangedError: another fetch recorded another version of the object.
        """
        if self.load_meta():
            change = identity_difference(self.identity or {}, identity)
            if change is not None or (size is not None and size != self.size):
                raise ShardChangedError(f"{self.url} changed during the epoch ({change or 'its size changed'})")
            return
        tmp = f"{self.base}.meta.{os.getpid()}.{threading.get_ident()}"
        write_text(tmp, json.dumps({"size": size, "identity": dict(identity)}))
        try:
            os.link(tmp, self.base + ".meta")  # fails when another fetch recorded it first
        except FileExistsError:
            self.known = False
            self.record_meta(size, identity)
            return
        finally:
            os.unlink(tmp)
        self.size, self.identity, self.known = size, dict(identity), True

    def claim(self, j: int) -> int | None:
        """Take block ``j``'s claim; its locked descriptor, or None when a live worker holds it."""
        path = f"{self.base}.{j}.claim"
        try:
            fd = open_private(path, os.O_RDWR | os.O_CREAT | os.O_EXCL)
        except FileExistsError:
            try:
                fd = open_private(path, os.O_RDWR)
            except FileNotFoundError:
                return None  # removed meanwhile: the caller looks again
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        if not same_file(fd, path):
            os.close(fd)
            return None
        return fd

    def first(self, j: int) -> int:
        """Where block ``j``'s file starts within the block: 0, or where the fetch that
        started it began (a rank's part of a shard starting inside the block)."""
        try:
            return int(read_text(f"{self.base}.{j}.first") or 0)
        except (FileNotFoundError, ValueError):
            return 0

    def set_first(self, j: int, first: int) -> None:
        """Record where block ``j``'s file starts (by its claim's holder, before writing it)."""
        write_text(f"{self.base}.{j}.first", str(first))

    def written(self, j: int) -> int:
        try:
            return os.lstat(self.block_path(j)).st_size
        except FileNotFoundError:
            return 0

    def passed(self, j: int) -> None:
        """This worker read past block ``j``; the rank's last worker to do so removes it."""
        path = f"{self.base}.{j}.done"
        n = self.scope.num_workers
        try:
            fd = open_private(path, os.O_RDWR | os.O_CREAT)
        except FileNotFoundError:
            return  # the area is gone
        try:
            os.pwrite(fd, b"\1", self.scope.worker)
            marks = os.pread(fd, n, 0)
        finally:
            os.close(fd)
        if marks.count(b"\1") >= n:
            remove_block(self.base, j)

    def make_room(self) -> None:
        """Remove complete blocks nobody reads, the most read first, while the area
        holds more than ``staging_limit`` bytes minus one block."""
        root = self.scope.root
        blocks = []
        used = 0
        with os.scandir(root) as it:
            for e in it:
                parts = e.name.split(".")
                if len(parts) != 2 or not parts[1].isdigit():
                    continue
                with contextlib.suppress(FileNotFoundError):
                    st = e.stat()
                    used += st.st_size
                    blocks.append((e.path, st.st_size, st.st_mtime_ns))
        if used + self.block <= self.options.staging_limit:
            return

        def reads(path: str) -> int:
            try:
                fd = open_private(path + ".done", os.O_RDONLY)
            except FileNotFoundError:
                return 0
            try:
                return os.pread(fd, 1 << 16, 0).count(b"\1")
            finally:
                os.close(fd)

        for path, nbytes, _ in sorted(blocks, key=lambda b: (-reads(b[0]), b[2])):
            if used + self.block <= self.options.staging_limit:
                return
            base, j = path.rsplit(".", 1)
            claim = f"{path}.claim"
            try:
                fd = open_private(path, os.O_RDONLY)
            except FileNotFoundError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # readers hold it shared
                if lock_held(claim) is True or not self._complete_on_disk(base, int(j), nbytes):
                    continue
                remove_block(base, int(j))
                used -= nbytes
            except BlockingIOError:
                continue
            finally:
                os.close(fd)
        logger.debug("staging area %s: %d bytes in use, over staging_limit=%d", root, used, self.options.staging_limit)

    def _complete_on_disk(self, base: str, j: int, nbytes: int) -> bool:
        if base != self.base:
            return nbytes == self.block  # another object's block: full-sized ones are surely complete
        full = self.block_len(j)
        return full is not None and self.first(j) + nbytes == full


def remove_block(base: str, j: int) -> None:
    for suffix in ("", ".done", ".claim", ".first"):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(f"{base}.{j}{suffix}")


def read_text(path: str, limit: int = 1 << 16) -> str:
    """The text of a small file of an area (at most ``limit`` bytes), not through a symbolic link.

    Raises:
        UnsafeFolderError: ``path`` is a symbolic link.
        FileNotFoundError: there is none.
    """
    fd = open_private(path, os.O_RDONLY)
    try:
        return os.pread(fd, limit, 0).decode("utf-8")
    finally:
        os.close(fd)


def write_text(path: str, text: str) -> None:
    """Write a small file of an area (created or truncated), not through a symbolic link."""
    fd = open_private(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        os.write(fd, text.encode("utf-8"))
    finally:
        os.close(fd)
