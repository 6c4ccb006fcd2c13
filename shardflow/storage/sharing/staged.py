"""Remote reads shared through a rank's staging area (:mod:`shardflow.storage.sharing.staging`).

A shard is cut into blocks of :data:`~shardflow.storage.sharing.staged_blocks.BLOCK` bytes,
each a file in the staging area. A reader that needs bytes of block ``j``:

- reads them from the block's file when they are there (a block file only grows,
  written in order, so its size says how far it is written);
- else, when a live worker holds the block's claim (an exclusive ``flock`` on
  ``<h>.<j>.claim``), waits for the file to grow;
- else claims the block itself (``O_EXCL``, or the lock of a claim whose holder
  died: its file is continued at the byte offset it reached) and starts a
  :class:`Fetch`: one streaming request from there on, written block after block
  in a thread of its own (not at the pace of its reader, so no worker waits on
  another's consumer), each next block claimed before the current one is
  complete, until the reader's end or a block that another worker claimed first.

So each byte is fetched once per staging area, in about one request per shard
part. The fetch goes through :func:`~shardflow.storage.reading.retried_chunks`
(retries, resumption at the byte offset, deadlines); its first open records the
object's size and identity (``<h>.meta``), and every later fetch of the object
asks for that identity, so the bytes of one object come from one version.

A reader that reached its end marks each block it read past (``<h>.<j>.done``, a
byte at its worker's offset); the last of the rank's workers to do so removes the
block. Over ``staging_limit``, complete blocks no reader holds are removed, the
most read first (a reader holds a shared ``flock`` on the block it reads).
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import replace

from shardflow.errors import RemoteReadError, redact

from ..errors import check_digest
from ..backends.filesystems import has_validator
from ..options import IOOptions
from ..reading import retried_chunks
from .areas import open_private
from .staged_blocks import StagedObject
from .areas import same_file
from .staging import held_here, let_go, scope_of, unstaged
from .staging_faults import disk_full, stall_seconds

logger = logging.getLogger(__name__)

__all__ = ["Fetch", "PREFETCH_BYTES", "prefetch", "staged_chunks"]

FETCH_CHUNK = 64 << 10  # bytes per read of a fetch: how often waiting readers see progress (a reader
# waiting for a first batch's samples sees them as they come, not a quarter MiB later)
READ_CHUNK = 1 << 20  # bytes per chunk given to the tar reader
_POLL_FIRST, _POLL_MAX = 0.0005, 0.01  # seconds between looks at a block being written


class Fetch(threading.Thread):
    """One streaming request written into a staging area, block after block.

    Starts at block ``first`` (continuing its file where it ends), holding its claim
    (``claim_fd``); claims each next block before the current one is complete, and
    stops at ``end`` (None: the object's end) or at a block another worker claimed
    first. A failure is kept in :attr:`error` (raised
    by the reader that started it); its claims are released with the thread.
    """

    def __init__(self, obj: StagedObject, first: int, claim_fd: int, end: int | None, start: int = 0) -> None:
        super().__init__(name="shardflow-staging", daemon=True)
        self.obj = obj
        self.first = first
        self.begin = start  # a fresh first block's file starts here (the reader's first byte)
        self.end = end
        self.claims = {first: held_here(claim_fd)}
        self.error: BaseException | None = None
        self.opened = threading.Event()  # set once the store answered (or the fetch ended)

    def covers(self, j: int) -> bool:
        return self.first <= j and (self.end is None or j * self.obj.block < self.end)

    def run(self) -> None:
        try:
            self._stream()
        except BaseException as exc:  # noqa: BLE001 - raised by the reader that started the fetch
            self.error = disk_full(exc, self.obj.url, self.obj.scope.root, self.obj.options) or exc
            logger.debug("staging %s from block %d failed: %s", redact(self.obj.url), self.first, redact(str(exc)))
        finally:
            for fd in self.claims.values():
                let_go(fd)
            self.claims.clear()
            self.opened.set()

    def _stream(self) -> None:
        obj = self.obj
        # the size another fetch recorded bounds this request (_until) even when this thread
        # runs before its reader read the meta file: without it, the request ran to the
        # object's end and the store sent the bytes of blocks other fetches have
        obj.load_meta()
        j = self.first
        written = obj.written(j)
        if not os.path.lexists(obj.block_path(j)) and self.begin > j * obj.block:  # from the reader's first byte on
            obj.set_first(j, self.begin - j * obj.block)
        base = obj.first(j)  # bytes of block j before its file (0 for every later block)
        off = j * obj.block + base + written
        full = obj.block_len(j)
        if full is not None and off >= j * obj.block + full:
            return  # completed meanwhile
        options = replace(unstaged(obj.options), block_size=FETCH_CHUNK)
        obj.make_room()
        out = held_here(open_private(obj.block_path(j), os.O_WRONLY | os.O_CREAT))
        self._claim_next(j)
        chunks = retried_chunks(obj.url, off, self._until(j), options, expect=obj.identity if obj.known else None,
                                opened=self._opened)
        try:
            for chunk in chunks:
                if obj.size is None:
                    return  # no size to stage by: readers stream themselves
                view = memoryview(chunk)
                while view:
                    n = min(len(view), (j + 1) * obj.block - off)
                    os.pwrite(out, view[:n], off - j * obj.block - base)
                    off += n
                    view = view[n:]
                    if off < (j + 1) * obj.block:
                        continue
                    let_go(out)
                    out = -1
                    let_go(self.claims.pop(j))
                    j, base = j + 1, 0
                    if j not in self.claims:
                        return  # another worker fetches the next block
                    obj.make_room()
                    out = held_here(open_private(obj.block_path(j), os.O_WRONLY | os.O_CREAT))
                    self._claim_next(j)
        finally:
            chunks.close()
            if out >= 0:
                let_go(out)

    def _opened(self, size: int | None, identity: Mapping[str, str]) -> None:
        try:
            self.obj.record_meta(size, identity)
        except OSError as exc:  # called inside the retried request: a full disk is no store failure
            full = disk_full(exc, self.obj.url, self.obj.scope.root, self.obj.options)
            if full is None:
                raise
            raise full from exc
        self.opened.set()

    def _until(self, j: int) -> int | None:
        """Where this fetch's request ends: its end, or the start of the first later block
        another worker has (the store would send bytes that no block of this fetch takes)."""
        obj = self.obj
        limit = self.end if self.end is not None else obj.size
        k = j + 1
        while limit is None or k * obj.block < limit:
            if k not in self.claims and (os.path.lexists(obj.block_path(k)) or os.path.lexists(obj.block_path(k) + ".claim")):
                return k * obj.block
            if limit is None:  # size unknown before the first open: no other fetch recorded it yet
                break
            k += 1
        return self.end

    def _claim_next(self, j: int) -> None:
        """Claim block ``j + 1`` before block ``j`` is complete, so that a reader that
        finishes block ``j`` waits for this stream instead of starting its own."""
        obj = self.obj
        start = (j + 1) * obj.block
        if (self.end is not None and start >= self.end) or (obj.size is not None and start >= obj.size):
            return
        fd = obj.claim(j + 1)
        if fd is None:
            return
        if obj.written(j + 1):  # started by a worker that died, or already there: not this stream's
            os.close(fd)
            return
        self.claims[j + 1] = held_here(fd)


PREFETCH_BYTES = 8 << 20
"""How far :func:`prefetch` fetches into an object (rounded up to whole blocks): the first
batches' bytes, not whole large shards, in the process that trains."""


def prefetch(url: str, options: IOOptions) -> Fetch | None:
    """Start fetching the first :data:`PREFETCH_BYTES` of ``url`` into ``options.staging_scope``'s
    area, in a thread: the bytes a rank's first batches wait for, requested by the main
    process as its DataLoader workers start (they read them from the area as they come).

    The fetch is the one a worker starts (:class:`Fetch`: retried, resumed at the byte offset,
    recording the object's size and identity for every later fetch); it ends at a block
    boundary, where the worker that reads on claims the next block. Its failure is only
    logged: the claim is freed with the thread, and the worker that needs the bytes
    continues the block itself at the offset its file reached.

    Returns:
        The started fetch, or None when block 0 is written or claimed already.

    Raises:
        ValueError: ``options`` has no ``staging_scope``.
    """
    scope = scope_of(options)
    if scope is None:
        raise ValueError("prefetch needs options.staging_scope")
    obj = StagedObject(scope, url, options)
    if obj.written(0):
        return None
    fd = obj.claim(0)
    if fd is None:
        return None
    blocks = max(1, -(-PREFETCH_BYTES // obj.block))
    fetch = Fetch(obj, 0, fd, blocks * obj.block)
    fetch.start()
    return fetch


def staged_chunks(url: str, start: int, end: int | None, options: IOOptions,
                  check_size: Callable[[int], None] | None = None,
                  sha256: str | None = None) -> Iterator[bytes]:
    """The bytes ``[start, end)`` of ``url`` through ``options.staging_scope``'s staging area.

    The first block's fetch starts at once unless ``options.readahead`` is 0 (no
    read-ahead thread is needed above: fetches run in threads of their own). Chunks and errors are those of
    :func:`~shardflow.storage.reading.retried_chunks`
    (a fetch's failure is raised by the reader that started it; another reader
    continues the fetch itself); ``check_size`` and ``sha256`` as there.

    Raises:
        RemoteReadError: no byte came for ``options.part_deadline`` seconds.
    """
    scope = scope_of(options)
    if scope is None:
        raise ValueError("staged_chunks needs options.staging_scope")
    reader = _Reader(StagedObject(scope, url, options), end)
    obj = reader.obj
    j = start // obj.block
    if options.readahead and not obj.written(j):
        reader.fetch(j, start)  # at once: a shard opened ahead streams while the one before is read
    return _chunks(reader, start, check_size, sha256)


def _chunks(reader: _Reader, start: int, check_size: Callable[[int], None] | None,
            sha256: str | None) -> Iterator[bytes]:
    try:
        yield from reader.chunks(start, check_size, sha256)
    except OSError as exc:
        full = disk_full(exc, reader.obj.url, reader.obj.scope.root, reader.obj.options)
        if full is None:
            raise
        raise full from exc
    finally:
        reader.close()


class _Reader:
    """One reader of a staged object: its open block, and the fetches it started."""

    def __init__(self, obj: StagedObject, end: int | None) -> None:
        self.obj = obj
        self.end = end
        self.fetches: list[Fetch] = []
        self.fd = -1
        self.block = -1
        self.base = 0  # where the open block's file starts within the block
        self.finished = False
        self.passed: list[int] = []  # blocks read past
        self.stalled = False  # a claim's live holder wrote nothing for stall_seconds: read around it

    def chunks(self, start: int, check_size: Callable[[int], None] | None,
               sha256: str | None) -> Iterator[bytes]:
        obj, end = self.obj, self.end
        pos = start
        hasher = None
        checked = False
        quiet_since = time.monotonic()
        delay = _POLL_FIRST
        while True:
            stop = end
            if obj.load_meta():
                if obj.size is None:  # the store does not say: no blocks to wait for
                    options = unstaged(obj.options)
                    yield from retried_chunks(obj.url, pos, end, options, check_size=check_size)
                    break
                if not checked:
                    checked = True
                    if check_size is not None:
                        check_size(obj.size)
                    if sha256 and start == 0 and end is None and not has_validator(obj.identity or {}):
                        hasher = hashlib.sha256()
                stop = obj.size if end is None else min(end, obj.size)
                if pos >= stop:
                    break
            j = pos // obj.block
            piece = self._piece(j, pos, stop)
            if piece is None:  # before where the block's file starts: fetched by another worker from there on
                below = min(j * obj.block + self.base, stop if stop is not None else j * obj.block + self.base)
                options = unstaged(obj.options)
                for piece in retried_chunks(obj.url, pos, below, options, expect=obj.identity):
                    if hasher is not None:
                        hasher.update(piece)
                    yield piece
                    pos += len(piece)
                continue
            if piece:
                if hasher is not None:
                    hasher.update(piece)
                yield piece
                pos += len(piece)
                if pos == (j + 1) * obj.block or (obj.size is not None and pos == obj.size):
                    self._drop_block()
                    self.passed.append(j)
                quiet_since, delay = time.monotonic(), _POLL_FIRST
                continue
            self._raise_failed(j)
            if self.fetch(j, pos):
                continue
            waited = time.monotonic() - quiet_since
            if (waited > stall_seconds(obj.options) or self.stalled) and not self._fetching(j):
                for piece in self._around_stalled(j, pos, stop, waited):
                    if hasher is not None:
                        hasher.update(piece)
                    yield piece
                    pos += len(piece)
                quiet_since = time.monotonic()
                continue
            if waited > obj.options.part_deadline:
                raise RemoteReadError(
                    f"reading {obj.url}: byte {pos} was not staged within {waited:.1f} s "
                    f"(IOOptions.part_deadline={obj.options.part_deadline:g}); another worker fetches it"
                )
            time.sleep(delay)
            delay = min(2 * delay, _POLL_MAX)
        self.finished = True
        # marked once the consumer read to the end only: a stream closed early (the first
        # batch's samples read first, then the rest from the shard's start) reads them again
        for j in self.passed:
            obj.passed(j)
        check_digest(obj.url, hasher, sha256, "")

    def _piece(self, j: int, pos: int, stop: int | None) -> bytes | None:
        """Bytes of block ``j`` from ``pos`` on that are written already (maybe none);
        None when ``pos`` lies before where the block's file starts."""
        if self.block != j:
            self._drop_block()
            path = self.obj.block_path(j)
            try:
                fd = open_private(path, os.O_RDONLY)
            except FileNotFoundError:
                return b""
            fcntl.flock(fd, fcntl.LOCK_SH)  # kept from removal over staging_limit while read
            if not same_file(fd, path):
                os.close(fd)
                return b""
            self.fd, self.block, self.base = fd, j, self.obj.first(j)
        off = pos - j * self.obj.block - self.base
        if off < 0:
            return None
        avail = os.fstat(self.fd).st_size - off
        if avail <= 0:
            return b""
        n = min(avail, READ_CHUNK)
        if stop is not None:
            n = min(n, stop - pos)
        return os.pread(self.fd, n, off)

    def _fetching(self, j: int) -> bool:
        """Whether a fetch this reader started is writing block ``j`` (its own: never read around)."""
        return any(f.covers(j) and f.is_alive() for f in self.fetches)

    def _around_stalled(self, j: int, pos: int, stop: int | None, waited: float) -> Iterator[bytes]:
        """The rest of block ``j`` (to ``stop``) from the store itself, not through the area: its
        claim's live holder wrote nothing for ``waited`` seconds (see
        :mod:`~shardflow.storage.sharing.staging_faults`). Later blocks a live worker holds are read
        so at once; those written, or claimed here, are still shared."""
        obj = self.obj
        if not self.stalled:
            self.stalled = True
            logger.warning("staging %s: block %d's fetch wrote nothing for %.1f s; reading around it", obj.url, j,
                           waited)
        upto = (j + 1) * obj.block if stop is None else min((j + 1) * obj.block, stop)
        options = replace(obj.options, staging_scope=None)
        yield from retried_chunks(obj.url, pos, upto, options, expect=obj.identity if obj.known else None)

    def _drop_block(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
        self.fd, self.block = -1, -1

    def _raise_failed(self, j: int) -> None:
        # a fetch's error is set before its claims are let go, so it is raised here even while
        # the thread still ends: waiting for it to end let this reader claim the freed block and
        # fetch it again (a second request that fails the same way, on a full disk)
        for f in self.fetches:
            if f.error is not None and f.covers(j):
                raise f.error

    def fetch(self, j: int, pos: int) -> bool:
        """Claim block ``j`` and start fetching it (a fresh block from ``pos`` on); False
        when a live worker holds its claim."""
        obj = self.obj
        fd = obj.claim(j)
        if fd is None:
            return False
        full = obj.block_len(j)
        if full is not None and obj.first(j) + obj.written(j) >= full:
            os.close(fd)  # completed meanwhile
            return True
        # from this reader's byte to its end, not to block bounds: the bytes around a rank's part
        # of a shard are other ranks' (a worker of this rank reading past it fetches the rest)
        fetch = Fetch(obj, j, fd, self.end, pos)
        self.fetches = [f for f in self.fetches if f.is_alive() or f.error is not None]
        self.fetches.append(fetch)
        fetch.start()
        return True

    def close(self) -> None:
        # A fetch goes on after its reader stopped early: the bytes it gets are those
        # the rank's other workers, or this one's next stream of the shard, read next
        # (stopping would waste what the store already sent into the connection).
        self._drop_block()
