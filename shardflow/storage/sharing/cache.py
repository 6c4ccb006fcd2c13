"""The local shard cache: whole remote shards downloaded once, shared by threads and
processes, evicted least recently used first."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import posixpath
import re
import secrets
import time
from collections.abc import Callable, Iterator, Mapping
from typing import BinaryIO

from shardflow.accounting import count
from shardflow.errors import RemoteReadError, redact

from ..errors import ShardChangedError, check_digest
from .areas import lock_held, open_private, own_file_size, private_folder, same_file
from ..backends.filesystems import filesystem, fresh_info, has_validator, object_identity
from ..options import IOOptions
from ..reading import retried_chunks
from ..retries import call_with_retries

logger = logging.getLogger(__name__)


class ShardCache:
    """Whole remote shards kept in a local directory, shared by threads and processes.

    Layout: ``<key>-<name>`` data files (key from the URL and the object's identity,
    so a changed object gets a new entry), ``.tmp-<key>-<size>-<token>`` downloads
    in progress, ``.locks/<key>`` lock files (while an entry is in use: its last user
    removes it), ``.lock`` guarding eviction. A reader
    holds a shared ``flock`` on its entry's lock file, a download an exclusive one;
    eviction only removes entries whose lock it can take at once, least recently
    used first (use time is the data file's mtime, touched on every open).

    The cache keeps to ``limit`` whichever way it was filled: eviction runs before
    each download, when a process first opens the cache with a given limit (a cache
    filled under a larger limit shrinks to a lowered one), and after each hit that
    finds it over the limit (another process's, or a lowered, limit).

    The folder is this user's alone: made 0700 when missing, and refused when it is a
    symbolic link, another user's, or writable by others (an ``UnsafeFolderError``: a
    planted entry would be served without a request). Its files are opened with
    ``O_NOFOLLOW``, and an entry is served only when it is a regular file of this user's
    (not a link) of the size the store reported, or the one pinned to the manifest's
    digest that its fill was checked against.

    Raises:
        UnsafeFolderError: the folder (or its ``.locks``) is not safe to use.
    """

    _opened: set[tuple[str, int]] = set()  # (root, limit) already shrunk by this process

    def __init__(self, root: str, limit: int) -> None:
        self.root = root
        self.limit = limit
        parent = os.path.dirname(os.path.abspath(root))
        os.makedirs(parent, exist_ok=True)
        private_folder(root, "shard cache", private=False)  # an existing cache may be readable by others
        private_folder(os.path.join(root, ".locks"), "shard cache", private=False)
        if (root, limit) not in ShardCache._opened:
            ShardCache._opened.add((root, limit))
            self.shrink()

    def usage(self) -> int:
        """Bytes of the cached shards and of the downloads in progress (at their final size)."""
        used = 0
        with os.scandir(self.root) as it:
            for e in it:
                if not e.is_file(follow_symlinks=False) or e.name == ".lock":
                    continue
                with contextlib.suppress(FileNotFoundError):
                    if e.name.startswith(".tmp-"):
                        parts = e.name.split("-")
                        used += int(parts[2]) if len(parts) > 3 and parts[2].isdigit() else e.stat().st_size
                    elif not e.name.startswith("."):
                        used += e.stat(follow_symlinks=False).st_size
        return used

    def shrink(self) -> None:
        """Evict unused shards, least recently used first, until the cache fits its limit
        (shards in use stay; they go once released, at a later shrink). A look without the
        lock first: a cache within its limit costs one listing."""
        if self.usage() <= self.limit:
            return
        with self._global_lock():
            if not self._make_room(0):
                logger.info("shard cache %s: over its limit of %d bytes while shards are in use",
                            self.root, self.limit)

    @staticmethod
    def key(url: str, identity: Mapping[str, str]) -> str:
        text = url + "\n" + "\n".join(f"{k}={v}" for k, v in sorted(identity.items()))
        return hashlib.sha256(text.encode()).hexdigest()[:32]

    def _data_path(self, key: str, url: str) -> str:
        name = re.sub(r"[^A-Za-z0-9._-]", "_", posixpath.basename(url.rstrip("/")))[-80:]
        return os.path.join(self.root, f"{key}-{name}")

    @contextlib.contextmanager
    def entry(self, url: str, options: IOOptions, sha256: str | None = None) -> Iterator[str | None]:
        """Yield the local path of ``url``'s cached copy (downloading it if needed),
        held in use until exit; ``None`` when it cannot be cached (no size reported,
        larger than the limit, no room left beside shards in use, a full disk, or
        neither ``sha256`` nor a validator to check a copy by: see :func:`cacheable`).

        A copy filled and checked against ``sha256`` (the manifest's digest) is found
        again by that digest without a request: it holds the very bytes the manifest
        lists, so a later epoch reads its shards from the cache without asking the
        store (a new manifest, a new digest, a new entry). Else the object's identity
        (one ``HEAD``) names the copy, and a changed object gets a fresh entry."""
        import fcntl

        pinned = self._pinned(url, sha256) if sha256 else None
        if pinned is not None:
            lock_fd, lock_path, data = pinned
            count("cache_hits")
            try:
                self._touch(data)
                yield data
            finally:
                self._release(lock_fd, lock_path)
            return
        fs, path = filesystem(url, options)
        info = call_with_retries(url, 0, options, lambda: fresh_info(fs, path, options.request_timeout))
        size = info.get("size")
        identity = object_identity(info)
        if size is None or size > self.limit or not cacheable(self.root, identity, sha256):
            yield None
            return
        key = self.key(url, identity)
        data = self._data_path(key, url)
        lock_path = os.path.join(self.root, ".locks", key)
        lock_fd: int | None = None
        try:
            for _attempt in range(5):
                lock_fd = self._lock(lock_path, fcntl.LOCK_SH)
                if self._present(data, size):
                    count("cache_hits")
                    self.shrink()  # a hit: no download evicted anything (this entry is held)
                    break
                self._release(lock_fd, lock_path)
                lock_fd = self._lock(lock_path, fcntl.LOCK_EX)
                if not self._present(data, size):
                    if not self._download(url, key, data, size, identity, options, sha256):
                        yield None
                        return
                    count("cache_fills")
                    if sha256:  # the fill was checked against it
                        self._pin(url, sha256, data)
                # converting EX -> SH is not atomic; eviction may slip in: check again
                fcntl.flock(lock_fd, fcntl.LOCK_SH)
                if self._present(data, size) and same_file(lock_fd, lock_path):
                    break
                self._release(lock_fd, lock_path)
                lock_fd = None
            else:
                yield None
                return
            self._touch(data)
            yield data
        finally:
            if lock_fd is not None:
                self._release(lock_fd, lock_path)

    @staticmethod
    def _touch(data: str) -> None:
        with contextlib.suppress(OSError):  # the use time that LRU eviction sorts by
            now = time.time_ns()
            os.utime(data, ns=(now, now))

    def _pin_path(self, url: str, sha256: str) -> str:
        return os.path.join(self.root, ".pin-" + self.key(url, {"sha256": sha256}))

    def _pin(self, url: str, sha256: str, data: str) -> None:
        """Name the copy ``data`` by the digest it was checked against (a symbolic link,
        skipped by the size count and eviction; dangling once the copy is evicted)."""
        pin = self._pin_path(url, sha256)
        tmp = f"{pin}.{secrets.token_hex(6)}"
        with contextlib.suppress(OSError):
            os.symlink(os.path.basename(data), tmp)
            os.replace(tmp, pin)

    def _pinned(self, url: str, sha256: str) -> tuple[int, str, str] | None:
        """``(lock descriptor, lock path, copy)`` of the copy pinned to ``sha256``, held
        in use (a shared lock on its entry), or None when there is none (any more)."""
        import fcntl

        try:
            name = os.readlink(self._pin_path(url, sha256))
        except OSError:
            return None
        if os.sep in name or name.startswith("."):
            return None  # not one this cache wrote
        data = os.path.join(self.root, name)
        lock_path = os.path.join(self.root, ".locks", name.split("-", 1)[0])
        fd = self._lock(lock_path, fcntl.LOCK_SH)
        if own_file_size(data) is not None:  # (complete: a copy is renamed into place once filled and checked)
            return fd, lock_path, data
        self._release(fd, lock_path)
        return None

    @classmethod
    def _lock(cls, path: str, how: int) -> int:
        """Open and ``flock`` the lock file ``path``; returns its descriptor.

        The last user of an entry removes its lock file (so none is left behind), and may
        do so between this process's open and its flock: the lock then guards a file no
        longer at ``path``, so it is dropped and the file opened again.
        """
        import fcntl

        for _attempt in range(1000):
            fd = open_private(path, os.O_RDWR | os.O_CREAT)
            try:
                fcntl.flock(fd, how)
                if same_file(fd, path):
                    return fd
            except BaseException:
                os.close(fd)
                raise
            os.close(fd)
        raise OSError(f"shard cache: lock file {path} was replaced 1,000 times in a row")


    @classmethod
    def _release(cls, fd: int, path: str) -> None:
        """Unlock and close ``fd``; remove the lock file when no other process holds it."""
        import fcntl

        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if same_file(fd, path):
                os.unlink(path)
        except (BlockingIOError, FileNotFoundError):
            pass  # in use elsewhere: its last user removes it
        finally:
            os.close(fd)

    @staticmethod
    def _present(data: str, size: int) -> bool:
        return own_file_size(data) == size

    @contextlib.contextmanager
    def _global_lock(self) -> Iterator[None]:
        import fcntl

        fd = open_private(os.path.join(self.root, ".lock"), os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def _download(self, url: str, key: str, data: str, size: int,
                  identity: Mapping[str, str], options: IOOptions, sha256: str | None = None) -> bool:
        import fcntl

        with self._global_lock():
            if not self._make_room(size):
                logger.warning("shard cache %s: no room for %s (%d bytes) within %d bytes "
                               "beside shards in use; streaming it uncached",
                               self.root, url, size, self.limit)
                return False
            tmp = os.path.join(self.root, f".tmp-{key}-{size}-{secrets.token_hex(6)}")
            fd = open_private(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
            fcntl.flock(fd, fcntl.LOCK_EX)  # marks the download alive for _make_room
        try:
            written = fill(tmp, fd, url, options, identity, sha256)
            if written is None:  # the cache's disk is full
                os.unlink(tmp)
                return False
            if written != size:
                raise RemoteReadError(f"caching {url}: got {written} bytes, expected {size}")
            os.replace(tmp, data)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        finally:
            os.close(fd)
        return True

    def _make_room(self, need: int) -> bool:
        """Evict unused shards, oldest use first, until ``need`` more bytes fit.

        Called with the global lock held. Downloads in progress count with their
        final size; those left by dead processes are removed.
        """
        import fcntl

        used = 0
        entries = []
        with os.scandir(self.root) as it:
            for e in it:
                if not e.is_file(follow_symlinks=False) or e.name == ".lock":
                    continue
                try:
                    st = e.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                if e.name.startswith(".tmp-"):
                    if lock_held(e.path) is False:  # nobody writes it: a dead download
                        with contextlib.suppress(FileNotFoundError):
                            os.unlink(e.path)
                        continue
                    parts = e.name.split("-")
                    used += int(parts[2]) if len(parts) > 3 and parts[2].isdigit() else st.st_size
                elif not e.name.startswith("."):
                    used += st.st_size
                    entries.append((st.st_mtime_ns, e.name, e.path, st.st_size))
        if used + need <= self.limit:
            return True
        for _mtime, name, path, nbytes in sorted(entries):
            lock_path = os.path.join(self.root, ".locks", name.split("-", 1)[0])
            fd = open_private(lock_path, os.O_RDWR | os.O_CREAT)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue  # in use
            if not same_file(fd, lock_path):  # its last user removed it: a new user holds the new one
                os.close(fd)
                continue
            try:
                os.unlink(path)
                used -= nbytes
                logger.debug("shard cache %s: evicted %s (%d bytes)", self.root, name, nbytes)
            except FileNotFoundError:
                pass
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(lock_path)  # held exclusively: nobody uses the entry
                os.close(fd)
            if used + need <= self.limit:
                return True
        return False



def cached_chunks(url: str, start: int, end: int | None, options: IOOptions,
                   check_size: Callable[[int], None] | None, sha256: str | None = None) -> Iterator[bytes]:
    """The bytes ``[start, end)`` of ``url`` served from its cached local copy
    (downloaded first when missing, and checked against ``sha256``, the manifest's
    digest, when given), or streamed when it cannot be cached."""
    cache = ShardCache(options.cache_dir, options.cache_limit)
    with cache.entry(url, options, sha256) as local:
        if local is not None:
            yield from retried_chunks(local, start, end, options, check_size=check_size)
        else:
            yield from retried_chunks(url, start, end, options, check_size=check_size, sha256=sha256)


# ------------------------------------------------------------ what a fill may be trusted with

_FULL_FOR = 60.0  # seconds a cache whose disk was full is not filled again (in this process)
_full_since: dict[str, float] = {}


def cacheable(root: str, identity: Mapping[str, str], sha256: str | None) -> bool:
    """Whether a copy of an object can be cached: there is something to check it by (the
    manifest's sha256, or a validator that changes with the object: ETag, Last-Modified,
    version; a size alone does not), and the cache's disk was not found full lately."""
    if sha256 is None and not has_validator(identity):
        return False
    since = _full_since.get(root)
    return since is None or time.monotonic() - since > _FULL_FOR


def write_fill(out: BinaryIO, chunk: bytes) -> None:
    """Write a chunk of a fill (one call, so tests can make the disk full)."""
    out.write(chunk)


def fill(tmp: str, fd: int, url: str, options: IOOptions, identity: Mapping[str, str],
         sha256: str | None) -> int | None:
    """Download ``url`` into the cache's temporary ``tmp`` (open as ``fd``), checking the
    bytes against ``sha256``; returns the bytes written, or None when the disk is full
    (ENOSPC/EDQUOT: warned once per cache directory, the shard is then read uncached).

    Raises:
        ShardChangedError: the bytes do not hash to ``sha256`` (nothing is cached).
    """
    hasher = hashlib.sha256() if sha256 else None
    root = os.path.dirname(tmp)
    try:
        with os.fdopen(os.dup(fd), "wb") as out:
            for chunk in retried_chunks(url, 0, None, options, expect=identity):
                write_fill(out, chunk)
                if hasher is not None:
                    hasher.update(chunk)
            out.flush()
            written = out.tell()
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        if root not in _full_since:
            logger.warning("shard cache %s: no space left on its disk (%s); reading %s and the next shards "
                           "uncached", root, e.strerror, redact(url))
        _full_since[root] = time.monotonic()
        return None
    check_digest(url, hasher, sha256, " (not cached)")
    return written
