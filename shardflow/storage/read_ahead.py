"""Read-ahead: a chunk stream run in a background thread."""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from collections.abc import Iterator

logger = logging.getLogger(__name__)

__all__ = ["readahead"]

_READAHEAD_POLL = 0.05  # seconds between checks of the stop flag in the producer
_READAHEAD_JOIN = 2.0  # seconds close() waits for the producer thread
_END = object()


class _Failure:
    __slots__ = ("exc",)

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


def _put(q: queue.Queue, item: object, stop: threading.Event) -> bool:
    while not stop.is_set():
        try:
            q.put(item, timeout=_READAHEAD_POLL)
            return True
        except queue.Full:
            continue
    return False


def _produce(chunks: Iterator[bytes], q: queue.Queue, stop: threading.Event) -> None:
    # Runs in the read-ahead thread. It must not reference the _ReadAhead object,
    # so that dropping the last reference to it stops this thread.
    try:
        for chunk in chunks:
            if not _put(q, chunk, stop):
                return
        _put(q, _END, stop)
    except BaseException as exc:  # handed to the consumer, which raises it
        _put(q, _Failure(exc), stop)
    finally:
        close = getattr(chunks, "close", None)
        if close is not None:
            try:
                close()
            except Exception:
                logger.warning("closing a read-ahead source failed", exc_info=True)


class _ReadAhead(Iterator[bytes]):
    """The iterator returned by :func:`readahead`."""

    def __init__(self, chunks: Iterator[bytes], depth: int) -> None:
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._finished = False
        self._thread = threading.Thread(
            target=_produce, args=(chunks, self._queue, self._stop),
            name="shardflow-readahead", daemon=True,
        )
        self._thread.start()

    def __iter__(self) -> _ReadAhead:
        return self

    def __next__(self) -> bytes:
        if self._finished:
            raise StopIteration
        item = self._queue.get()
        if item is _END:
            self.close()
            raise StopIteration
        if isinstance(item, _Failure):
            self.close()
            raise item.exc
        return item

    def close(self) -> None:
        """Stop the thread, close the source and drop buffered chunks."""
        if self._finished:
            return
        self._finished = True
        self._stop.set()
        with contextlib.suppress(queue.Empty):
            while True:
                self._queue.get_nowait()
        if threading.current_thread() is not self._thread:
            self._thread.join(_READAHEAD_JOIN)
            if self._thread.is_alive():
                logger.debug("a read-ahead thread is still in a read after %.0fs; it stops "
                             "when that read returns", _READAHEAD_JOIN)

    def __enter__(self) -> _ReadAhead:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()


def readahead(chunks: Iterator[bytes], depth: int) -> Iterator[bytes]:
    """Run ``chunks`` in a background thread, keeping up to ``depth`` chunks ready.

    The thread starts at once (so a shard starts downloading before it is read).
    Exceptions of the source are raised by ``next()``. ``close()`` on the returned
    iterator, or dropping it, stops the thread and closes the source (in that
    thread), releasing its handles. ``depth == 0`` returns ``chunks`` unchanged.

    Args:
        chunks: the source iterator.
        depth: chunks buffered ahead, >= 0.
    """
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 0:
        raise ValueError(f"readahead depth must be an int >= 0, got {depth!r}")
    if depth == 0:
        return chunks
    return _ReadAhead(iter(chunks), depth)
