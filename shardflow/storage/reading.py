"""Retried reads: a byte range streamed in chunks (reopened at the offset reached
after a transient failure) and one ranged read."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import time
from collections.abc import Callable, Iterator, Mapping

from shardflow.accounting import count, is_shard_data
from shardflow.errors import ManifestError, RemoteReadError, ShardflowError, redact, redact_cause
from shardflow.format.compression import GZIP_MAGIC, ZSTD_MAGIC

from .errors import ShardChangedError, ShortReadError, check_digest
from .backends.filesystems import filesystem, fresh_info, has_validator, identity_difference, is_http, is_memory
from .options import DEFAULT_OPTIONS, IOOptions
from .readers import LocalReader, open_reader, open_regular
from .retries import call_with_retries, is_io_error, is_transient, read_error, retry_delay
from .urls import is_local, local_path

logger = logging.getLogger(__name__)

LOCAL_READ = 2 << 20
"""The most bytes one read of a local file asks for (``IOOptions.block_size`` when smaller):
a page-cache copy into a fresh 4 MiB buffer costs twice the CPU of two 2 MiB ones (the
allocator maps and faults the larger one anew each time), the most of a raw pass's reading."""


def check_range(start: int, end: int | None) -> None:
    """Check a byte range ``[start, end)`` given by a caller.

    Raises:
        ValueError: ``start`` is not an int >= 0 or ``end`` is neither None nor an int >= start.
    """
    if isinstance(start, bool) or not isinstance(start, int) or start < 0:
        raise ValueError(f"start must be an int >= 0, got {start!r}")
    if end is not None and (isinstance(end, bool) or not isinstance(end, int) or end < start):
        raise ValueError(f"end must be None or an int >= start ({start}), got {end!r}")


def iter_chunks(url: str, start: int = 0, end: int | None = None,
                options: IOOptions = DEFAULT_OPTIONS) -> Iterator[bytes]:
    """Stream the bytes ``[start, end)`` of an object in chunks of ``options.block_size``.

    Args:
        url: a local path or any fsspec URL (``file://``, ``memory://``, ``s3://``,
            ``gs://``, ``http(s)://``).
        start: first byte, >= 0.
        end: byte after the last one; ``None`` reads to the end. An end beyond the
            object's size is clamped to it, as in slicing.
        options: retries, backoff, block size and storage options.

    Yields:
        Non-empty ``bytes`` chunks of at most ``options.block_size`` bytes whose
        concatenation is exactly the requested bytes, even when reads failed and
        were retried by reopening the object at the offset reached.

    Raises:
        ShardNotFoundError: the object does not exist.
        ShardChangedError: the object's size, ETag, mtime or version changed
            between two opens.
        RemoteReadError: a non-transient failure, or retries exhausted; the message
            names the URL and the byte offset reached.

    Nothing is opened before the first ``next()``; the file handle or connection is
    released when the generator finishes, is closed, or is garbage collected.
    """
    check_range(start, end)
    return retried_chunks(os.fspath(url), start, end, options)


def retried_chunks(url: str, start: int, end: int | None, options: IOOptions,
            expect: Mapping[str, str] | None = None,
            check_size: Callable[[int], None] | None = None,
            sha256: str | None = None,
            opened: Callable[[int | None, Mapping[str, str]], None] | None = None) -> Iterator[bytes]:
    """The chunk stream behind :func:`iter_chunks` (arguments checked by the caller).

    Args:
        expect: the object's identity from an earlier open; a different one raises
            :class:`ShardChangedError`.
        check_size: called with the object's size at the first open.
        sha256: the object's expected digest (the manifest's), for a whole read
            (``start == 0``, ``end is None``): when the store sends no validator
            (no ETag, Last-Modified or version), a reopen could join bytes of two
            versions of the same size, so the bytes read are hashed and a
            mismatch at the end raises :class:`ShardChangedError`.
        opened: called with the object's size (None when the store does not say)
            and identity at the first open (the staging area records them).
    """
    # a local file is read with plain reads: no fsspec filesystem to look up per open
    local = is_local(url) and "::" not in url
    fs, path = (None, local_path(url)) if local else filesystem(url, options)
    offset = start
    stop = end
    identity = dict(expect) if expect is not None else None
    reader = None
    failures = 0
    waited = 0.0  # seconds spent waiting on the store for this part (IOOptions.part_deadline)
    hasher = None  # the splicing guard (see sha256)
    try:
        while stop is None or offset < stop:
            began = time.monotonic()
            try:
                if reader is None:
                    reader = LocalReader(path, offset) if local else open_reader(fs, path, url, offset, stop, options, identity)
                    if identity is None:
                        identity = reader.identity
                        if check_size is not None and reader.size is not None:
                            check_size(reader.size)
                        if opened is not None:
                            opened(reader.size, identity)
                        if sha256 and start == 0 and end is None and not has_validator(identity):
                            hasher = hashlib.sha256()
                    else:
                        change = identity_difference(identity, reader.identity)
                        if change is not None:
                            raise ShardChangedError(f"{url} changed while being read, at byte {offset} ({change})")
                    if reader.size is not None:
                        stop = reader.size if stop is None else min(stop, reader.size)
                        if offset >= stop:
                            break
                want = min(options.block_size, LOCAL_READ) if local else options.block_size
                if stop is not None:
                    want = min(want, stop - offset)
                chunk = reader.read(want)
                if not chunk:
                    if stop is None:
                        break
                    raise ShortReadError(f"stream ended at byte {offset}, expected {stop} bytes")
                if len(chunk) > want:
                    chunk = chunk[:want]
            except ShardflowError:
                raise
            except Exception as exc:
                fatal = _fatal(url, offset, exc, seen=identity is not None)
                if fatal is exc:
                    raise  # not about the store (a bug, or torch's dead-worker RuntimeError)
                if fatal is not None:
                    raise fatal from redact_cause(exc)
                failures += 1
                if failures > options.retries:
                    raise read_error(url, offset, exc, failures) from redact_cause(exc)
                if reader is not None:
                    with contextlib.suppress(Exception):
                        reader.close()
                    reader = None
                wait = retry_delay(options, failures)
                waited += time.monotonic() - began + wait
                _check_deadline(url, start, stop, offset, waited, options, exc)
                logger.warning("reading %s failed at byte %d (%s: %s); reopening, retry %d/%d "
                               "in %.2fs", redact(url), offset, type(exc).__name__, redact(str(exc)), failures,
                               options.retries, wait)
                time.sleep(wait)
                continue
            failures = 0
            offset += len(chunk)
            waited += time.monotonic() - began
            _check_deadline(url, start, stop, offset, waited, options, None)
            if hasher is not None:
                hasher.update(chunk)
            yield chunk
        check_digest(url, hasher, sha256, " (the store sends no ETag or Last-Modified that would tell)")
    finally:
        if reader is not None:
            reader.close()


def _fatal(url: str, offset: int, exc: Exception, *, seen: bool) -> BaseException | None:
    """What to raise at once for a failed read, or None when a retry may help: ``exc``
    itself when it is not about the store, else an error naming the URL and offset
    (:class:`ShardChangedError` when an object already ``seen`` disappeared)."""
    if is_transient(exc):
        return None
    if not is_io_error(exc):
        return exc
    if isinstance(exc, FileNotFoundError) and seen:
        return ShardChangedError(f"{url} changed while being read: it disappeared at byte {offset}")
    return read_error(url, offset, exc, 0)


def _check_deadline(url: str, start: int, stop: int | None, offset: int, waited: float,
                    options: IOOptions, exc: BaseException | None) -> None:
    """Raise once a part has waited on the store longer than ``options.part_deadline``."""
    if waited <= options.part_deadline:
        return
    end = "the end" if stop is None else f"byte {stop}"
    cause = f"; last failure: {type(exc).__name__}: {exc}" if exc is not None else ""
    raise RemoteReadError(
        f"reading {url} from byte {start} to {end}: reached byte {offset} only, after {waited:.1f} s of "
        f"waiting on the store, past the deadline of {options.part_deadline:g} s (IOOptions.part_deadline){cause}"
    ) from redact_cause(exc)


def read_range(url: str, start: int, end: int, options: IOOptions = DEFAULT_OPTIONS) -> bytes:
    """Read the bytes ``[start, end)`` of an object (random access), with retries.

    An ``end`` beyond the object's size is clamped to it. Raises as :func:`iter_chunks`.
    """
    if end is None:
        raise ValueError("read_range needs an end offset; use iter_chunks to read to the end")
    check_range(start, end)
    url = os.fspath(url)
    if start == end:
        return b""
    if is_local(url):
        path = local_path(url)

        def read_local() -> bytes:
            with open_regular(path) as f:
                f.seek(start)
                parts, want = [], end - start
                while want:
                    part = f.read(want)
                    if not part:
                        break
                    parts.append(part)
                    want -= len(part)
                return b"".join(parts)

        data = call_with_retries(url, start, options, read_local)
        if is_shard_data(url):
            count("bytes_local", len(data))
        return data
    fs, path = filesystem(url, options)
    if is_http(fs) or is_memory(fs):
        return b"".join(retried_chunks(url, start, end, options))

    def read_remote() -> bytes:
        try:
            return fs.cat_file(path, start=start, end=end)
        except OSError as exc:  # S3 and friends answer 416 for a start past the end
            if "range" in str(exc).lower() and start >= fresh_info(fs, path, options.request_timeout)["size"]:
                return b""
            raise

    data = call_with_retries(url, start, options, read_remote)
    shard = is_shard_data(url)
    count("requests" if shard else "meta_requests")
    count("bytes_network" if shard else "meta_bytes", len(data))
    return data[: end - start]


def is_compressed(url: str, options: IOOptions = DEFAULT_OPTIONS) -> bool:
    """Whether an object starts with the gzip or zstd magic bytes."""
    magic = read_range(url, 0, 4, options)
    return magic.startswith(GZIP_MAGIC) or magic.startswith(ZSTD_MAGIC)


def read_small(url: str, options: IOOptions = DEFAULT_OPTIONS, what: str = "manifest") -> bytes:
    """Read a whole manifest, journal, conversion record or index, within
    ``options.limits.max_manifest_bytes`` (an endless or huge body stops there).

    Memory: the cap plus one chunk (``options.block_size``).

    Raises:
        ManifestError: the object is larger than the cap (names the option).
        FileNotFoundError, ShardflowError: as :func:`iter_chunks`.
    """
    cap = options.limits.max_manifest_bytes
    out = bytearray()
    chunks = iter_chunks(url, 0, None, options)
    try:
        for chunk in chunks:
            if len(out) + len(chunk) > cap:
                raise ManifestError(
                    f"{url} is larger than {cap} bytes (Limits.max_manifest_bytes), too large for a {what}",
                    reason="manifest_too_large",
                )
            out += chunk
    finally:
        chunks.close()
    return bytes(out)

