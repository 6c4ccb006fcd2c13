"""The byte stream the tar reader consumes: cache, then retried reads, then read-ahead."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping

from ..accounting import count, timed_chunks
from .sharing.cache import cached_chunks
from .options import DEFAULT_OPTIONS, IOOptions
from .read_ahead import readahead
from .reading import check_range, retried_chunks
from .sharing.staged import staged_chunks
from .sharing.staging import scope_of
from .urls import is_local

__all__ = ["open_chunks"]


def open_chunks(url: str, start: int = 0, end: int | None = None,
                options: IOOptions = DEFAULT_OPTIONS, *,
                check_size: Callable[[int], None] | None = None,
                sha256: str | None = None, digest: str | None = None,
                opened: Callable[[int | None, Mapping[str, str]], None] | None = None) -> Iterator[bytes]:
    """The byte stream the tar reader consumes: cache, then retried reads, then read-ahead.

    With ``options.cache_dir`` set and a remote ``url``, the whole object is first
    downloaded once into the cache (atomically; concurrent threads and processes
    share one download), then ``[start, end)`` is served from the local copy. The
    read-ahead thread (``options.readahead`` chunks) starts at once, so a shard
    opened early is fetched while the previous one is consumed. With
    ``options.staging_scope`` set (a DataLoader worker, see
    :mod:`shardflow.storage.sharing.staging`), the bytes come through the rank's staging
    area, fetched once for all of its workers.

    Args:
        check_size: called with the object's size in bytes when it is first
            opened (no extra request: the open reports it); raise from it to
            refuse the object, e.g. a shard that changed since it was indexed.
        sha256: the manifest's digest of the object, checked at the end of a
            whole read from a store that sends no validator (see
            :func:`~shardflow.storage.reading.retried_chunks`).
        digest: the manifest's sha256 of the object, for any range: with
            ``options.cache_dir``, the cached copy is checked against it when
            filled and found by it again without a request (default: ``sha256``).
        opened: for a local file, called with its size and identity (``fstat`` of the
            file opened: ``dev``, ``ino``, ``size``, ``mtime``, ``ctime``) when it is
            first opened; not called for other stores.

    Returns:
        An iterator of ``bytes`` chunks as :func:`iter_chunks`; close it to release
        its thread, handles and cache entry early.
    """
    check_range(start, end)
    url = os.fspath(url)
    if is_local(url):
        # The kernel reads ahead on local files; a thread here only adds GIL hand-offs
        # (measured: ~20% of raw iteration time spent waiting on its queue).
        return timed_chunks(retried_chunks(url, start, end, options, check_size=check_size, sha256=sha256, opened=opened), True)
    if options.cache_dir is not None:
        source = cached_chunks(url, start, end, options, check_size, digest or sha256)
    elif scope_of(options) is not None:  # the rank's workers share the fetches, in threads of their own
        count("staged_reads")
        return timed_chunks(staged_chunks(url, start, end, options, check_size, sha256), True)
    else:
        source = retried_chunks(url, start, end, options, check_size=check_size, sha256=sha256)
    return timed_chunks(readahead(source, options.readahead), options.cache_dir is not None)
