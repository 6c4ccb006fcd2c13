"""The tar member walk: the regular-file members of a tar stream, every header checked.

Parses POSIX ustar, GNU (long names ``L``/``K``, base-256 sizes) and PAX
(``x``/``g`` records) headers from an iterator of byte chunks, and skips
directories, links and device nodes. Every header field is validated before it
is used (:mod:`.headers`): the checksum, a size that must be octal digits or a
non-negative base-256 number, the type flag (regular files, links, devices,
directories, fifos, GNU long names and PAX records are understood; anything
else, sparse files included, is not), and the sizes against the limits. Plain members (most of any shard) are walked many at a time
(:mod:`.spans`) with the same checks; everything else
goes header by header. :mod:`.tar` groups the members into samples.
"""

from __future__ import annotations

from collections.abc import Generator, Iterable, Iterator, Sequence
from typing import Any
from zlib import adler32 as _adler

import numpy as np

from ..errors import SampleError, ShardFormatError, TruncatedShardError
from .headers import BLOCK, EXTENDED, KNOWN, REGULAR, SKIP_DATA, check_extended_size, member_error, parse_number, parse_pax
from .limits import DEFAULT_LIMITS, Limits
from .. import fastpath
from . import spans
from .layouts import Layouts
from .spans import SampleRun

__all__ = ["Member", "iter_members", "member_runs"]

_ZERO_BLOCK = b"\0" * BLOCK
_BIG = 1 << 20  # members at least this large are read into one growing bytearray, never joined


def _refill(it: Iterator[bytes], buf: bytes, pos: int, base: int, need: int) -> tuple[bytes, int, bool]:
    """Return ``(buf, base, ok)`` with ``need`` bytes from ``buf[pos:]`` on, reading more chunks.

    The returned buffer starts at the old ``pos`` (absolute offset ``base``);
    ``ok`` is False when the stream ended first.
    """
    have = len(buf) - pos
    parts = [buf[pos:]] if have else []
    base += pos
    while have < need:
        chunk = next(it, None)
        if chunk is None:
            return b"".join(parts), base, False
        if chunk:
            parts.append(chunk)
            have += len(chunk)
    return (parts[0] if len(parts) == 1 else b"".join(parts)), base, True


def _take(
    it: Iterator[bytes], buf: bytes, pos: int, base: int, size: int, padded: int, keep: bool
) -> tuple[bytearray | None, bytes, int, int, bool]:
    """Consume ``padded`` bytes from ``buf[pos:]`` (``buf[0]`` at absolute offset
    ``base``) and the chunks after it.

    With ``keep``, the first ``size`` of them are collected into one bytearray
    that grows as chunks arrive (so memory follows the bytes that really come,
    not the size a header declares, and the member is never held twice);
    without, they are dropped as they pass. Only the member's bytes are copied:
    the chunk the padding ends in is returned as it is, with a position in it.

    Returns:
        ``(data, buf, base, pos, ok)``: the member's bytes (or None), the chunk
        where reading goes on, the absolute offset of its first byte, the position
        after the padding in it, and whether the stream did not end first.
    """
    data = bytearray(buf[pos : pos + size]) if keep else None
    got = min(len(buf) - pos, padded)
    if got == padded:
        return data, buf, base, pos + padded, True
    base += len(buf)
    while True:
        chunk = next(it, None)
        if chunk is None:
            return data, b"", base, 0, False
        n = len(chunk)
        if keep and got < size:
            data += memoryview(chunk)[: size - got]
        if got + n >= padded:
            return data, chunk, base, padded - got, True
        got += n
        base += n


Member = tuple[str, int, "bytes | bytearray | SampleError"]


def iter_members(
    chunks: Iterable[bytes], url: str, start: int = 0, *, end: int | None = None, limits: Limits = DEFAULT_LIMITS
) -> Generator[Member, None, int]:
    """Yield the regular-file members of a tar stream.

    The members of :func:`member_runs`, one by one (same arguments, errors and
    return value).
    """
    runs = member_runs(chunks, url, start, end=end, limits=limits)
    while True:
        try:
            run = next(runs)
        except StopIteration as done:
            return done.value
        yield from run


def member_runs(
    chunks: Iterable[bytes],
    url: str,
    start: int = 0,
    *,
    end: int | None = None,
    limits: Limits = DEFAULT_LIMITS,
    starts: np.ndarray | None = None,
    grouped: bool = False,
    layouts: Layouts | None = None,
) -> Generator[Sequence[Member] | SampleRun, None, int]:
    """Yield the regular-file members of a tar stream, in runs.

    A run is a list of members parsed together (see :func:`.spans.plain_members`) or a single
    member read by the general path; consumers loop over a run with no generator step per member.

    Args:
        chunks: the tar's bytes from offset ``start`` on, in chunks of any size.
        url: shard URL, used in error messages.
        start: absolute byte offset of the first chunk's first byte (a header).
        end: absolute offset at which to stop (a header boundary), or None for
            the end-of-archive marker or end of stream.
        limits: the largest member and extended header read (see :class:`Limits`).
        starts: int64 absolute offsets where samples start, strictly increasing (the offset
            index's entries for the range, its end included), or None. With them, the plain
            members of whole samples are walked for many samples at once (see
            :func:`.spans.indexed_heads`); what is read is the same.
        grouped: runs of plain members in the common case come as a :class:`.spans.SampleRun`,
            already grouped into samples (iterating one still gives its members).
        layouts: the file's kept layouts (:mod:`.layouts`: grouped runs checked before), or None.

    Yields:
        ``(name, header_offset, data)``: the member path (PAX/GNU long names
        applied), the absolute offset of its first header block (the long-name
        headers included) and its bytes: ``bytes``, or for members of 1 MiB and
        more a ``bytearray`` filled in place (never joined, so never held twice).
        A member that cannot be read (sparse, a type not understood, larger
        than ``limits.max_member_bytes``) is yielded with a :class:`SampleError`
        as its data, before its bytes are skipped unread, so the caller decides
        whether that fails the shard or only its sample.

    Returns:
        (as the generator's return value) the offset where reading stopped: the
        end-of-archive marker, ``end``, or the end of the stream.

    Raises:
        TruncatedShardError: the stream ends inside a header or member data, or
            is empty (0 bytes) when read from offset 0.
        ShardFormatError: a header checksum or field is invalid, an extended
            header is over ``limits.max_header_bytes``, or a member runs past ``end``.
            Its ``offset`` is where the damaged member's first header starts,
            its ``member`` the member's name when its header was sound.
    """
    it = iter(chunks)
    buf = b""
    pos = 0
    base = start  # absolute offset of buf[0]
    ext = _Extended()
    empty = True
    stop = end if end is not None else -1
    run = 16  # members in the next bulk run (see spans.plain_members)
    bulk, walk = fastpath.enabled("bulk"), (layouts.bulk_members if layouts is not None else spans.bulk_members)
    offset = start
    member: str | None = None  # the regular member whose header was read, for errors
    try:
        while True:
            offset = base + pos
            member = None
            if offset == stop:
                return offset
            if len(buf) - pos < BLOCK:
                buf, base = _refilled(it, buf, pos, base, url, start, empty, ext.first_offset)
                pos = 0
            empty = False
            if bulk and ext.first_offset is None and not ext.global_pax and (type(buf) is bytes or type(buf) is bytearray) and len(buf) - pos >= 2 * BLOCK:
                members, pos = walk(buf, pos, base, stop, limits.max_member_bytes, run, starts, grouped)
                run = min(2 * run, spans.RUN)  # short runs first: the first sample comes soon
                if members:
                    yield members
                    continue
            header = buf[pos : pos + BLOCK]
            if header[0] == 0 and header == _ZERO_BLOCK:
                if ext.first_offset is not None:
                    raise TruncatedShardError(f"{url}: end-of-archive marker at byte {offset} right after an extended header")
                return offset
            size, typeflag, padded, member, bad = ext.header(header, url, offset, stop, limits)
            pos += BLOCK
            if bad is not None:  # before its bytes are skipped: a caller that raises need not wait for them
                yield ((member, ext.first_offset, bad),)
            keep = bad is None and typeflag not in SKIP_DATA
            data, buf, base, pos = _data(it, buf, pos, base, size, padded, keep, url, header, ext, offset)
            if bad is None and typeflag in REGULAR:
                yield ((member, ext.first_offset, data),)
            elif bad is None and typeflag in EXTENDED and ext.applied(typeflag, data, url, offset):
                continue  # the record applies to the next header
            ext.clear()  # directories, links, devices and fifos are not samples
    except ShardFormatError as e:
        ext.blame(e, offset, member)
        raise


class _Extended:
    """The header-by-header path's state: what the extended headers read so far (GNU long
    names, PAX records) say about the next member, and where its first header starts."""

    __slots__ = ("long_name", "pax", "global_pax", "first_offset")

    def __init__(self) -> None:
        self.long_name: str | None = None
        self.pax: dict[str, str] = {}
        self.global_pax: dict[str, str] = {}
        self.first_offset: int | None = None  # of the member being read (extended headers included)

    def header(
        self, header: bytes, url: str, offset: int, stop: int, limits: Limits
    ) -> tuple[int, bytes, int, str | None, SampleError | None]:
        """``(size, typeflag, padded size, name, error)`` of the header block at ``offset``:
        ``name`` for a regular member (or one of a type not understood, else None), ``error``
        when that member cannot be read (its bytes are then skipped unread).

        Raises:
            ShardFormatError: a bad checksum or field, an extended header over the limit.
        """
        size, typeflag, padded = _checked_header(header, url, offset, stop, self.long_name, self.pax)
        if self.first_offset is None:
            self.first_offset = offset
        if typeflag in REGULAR or typeflag not in KNOWN:
            name = _member_name(header, self.long_name, self.pax, self.global_pax, url, offset)
            return size, typeflag, padded, name, member_error(typeflag, self.pax, name, url, offset, size, limits)
        check_extended_size(size, typeflag, url, offset, _header_name(header, self.long_name, self.pax), limits)
        return size, typeflag, padded, None, None

    def applied(self, typeflag: bytes, data: Any, url: str, offset: int) -> bool:
        """Apply an extended header's record; True when it applies to the next header."""
        self.long_name, self.pax, self.global_pax, goes_on = _extended(
            typeflag, data, url, offset, self.long_name, self.pax, self.global_pax
        )
        return goes_on

    def blame(self, error: ShardFormatError, offset: int, member: str | None) -> None:
        """Say in ``error`` where the damage starts (the first header of the member being
        read: a sample boundary, if the index has it there) and which member it hit."""
        if error.offset is None:
            error.offset = self.first_offset if self.first_offset is not None else offset
        if error.member is None:
            error.member = member

    def clear(self) -> None:
        """A member was read: the next one starts afresh (global PAX records stay)."""
        self.long_name = None
        self.pax = {}
        self.first_offset = None


def _data(
    it: Iterator[bytes], buf: bytes, pos: int, base: int, size: int, padded: int, keep: bool, url: str,
    header: bytes, ext: _Extended, offset: int,
) -> tuple[bytes | bytearray | None, bytes, int, int]:
    """``(data, buf, base, pos)``: the member's bytes from ``buf[pos:]`` on (None unless
    ``keep``) and where reading goes on after its padding. A member that runs into the next
    chunks has only its bytes copied, not the chunks (see :func:`_take`); under 1 MiB it
    comes as ``bytes``.

    Raises:
        TruncatedShardError: the stream ends first.
    """
    if len(buf) - pos >= padded:
        return (buf[pos : pos + size] if keep else None), buf, base, pos + padded
    data, buf, base, pos, ok = _take(it, buf, pos, base, size, padded, keep)
    if not ok:
        raise _truncated(url, header, ext.long_name, ext.pax, offset, size)
    if keep and size < _BIG:
        data = bytes(data)  # members under 1 MiB are bytes (see member_runs)
    return data, buf, base, pos


def _refilled(
    it: Iterator[bytes], buf: bytes, pos: int, base: int, url: str, start: int, empty: bool, pending: int | None
) -> tuple[bytes, int]:
    """``(buf, base)`` holding at least a header block from ``buf[pos:]`` on (see :func:`_refill`).

    Raises:
        TruncatedShardError: the stream ended first (``pending``: the offset of an
            extended header read for the next member, or None).
    """
    offset = base + pos
    buf, base, ok = _refill(it, buf, pos, base, BLOCK)
    if ok:
        return buf, base
    if not buf and not empty and pending is None:
        # Every tar writer ends with the end-of-archive marker; a stream that stops
        # on a member boundary without it was cut short, and its last sample may
        # be missing members, so it must not be yielded as complete.
        raise TruncatedShardError(
            f"{url}: ends at byte {offset} without the tar end-of-archive marker: the shard was cut short"
        )
    if not buf and start == 0 and empty:
        raise TruncatedShardError(f"{url}: empty file (0 bytes), not a tar archive")
    raise TruncatedShardError(f"{url}: truncated inside a tar header at byte {offset}")


def _checked_header(
    header: bytes, url: str, offset: int, stop: int, long_name: str | None, pax: dict[str, str]
) -> tuple[int, bytes, int]:
    """``(size, typeflag, padded size)`` of the header block at ``offset``, checksum and size checked.

    Raises:
        ShardFormatError: a bad checksum or size field, or a member that runs past ``stop``.
    """
    chk = header[148:156]
    # sum of the header's bytes with the checksum field as spaces (POSIX ustar);
    # adler32's first half seeded with 0 is that sum mod 65521, and exact for
    # 256 bytes (at most 65,280), and faster than sum() over the block (docs/benchmarks.md)
    computed = _adler(header[:256], 0) % 65536 + _adler(header[256:], 0) % 65536 - sum(chk) + 256
    stored = parse_number(chk, url, offset, "checksum")
    if stored != computed and stored != _signed_checksum(header):
        raise ShardFormatError(
            f"{url}: bad tar header checksum at byte {offset} (stored {stored}, computed {computed}); "
            "the shard is corrupt or not a tar archive"
        )
    try:
        size = parse_number(header[124:136], url, offset, "size")
    except ShardFormatError as e:
        e.member = _header_name(header, long_name, pax)  # the checksum holds: the name is the writer's
        raise
    padded = (size + BLOCK - 1) & ~(BLOCK - 1)
    if stop >= 0 and offset + BLOCK + padded > stop:
        raise ShardFormatError(
            f"{url}: member at byte {offset} ({size} bytes) runs past byte {stop}, where the offset index "
            "says the next sample starts: the index does not match the shard (re-run `shardflow index`)",
            reason="stale_index",
        )
    return size, header[156:157], padded


def _extended(
    typeflag: bytes,
    data: Any,
    url: str,
    offset: int,
    long_name: str | None,
    pax: dict[str, str],
    global_pax: dict[str, str],
) -> tuple[str | None, dict[str, str], dict[str, str], bool]:
    """An extended header (GNU long name ``L`` or link ``K``, PAX ``x`` or global ``g``) applied:
    ``(long_name, pax, global_pax, goes_on)``, ``goes_on`` when it applies to the next header.

    Raises:
        ShardFormatError: a bad PAX record, or a global one that declares sparse files.
    """
    if typeflag == b"L":
        return bytes(data).split(b"\0", 1)[0].decode("utf-8", "surrogateescape"), pax, global_pax, True
    if typeflag == b"x":
        return long_name, parse_pax(data, url, offset), global_pax, True
    if typeflag == b"g":
        global_pax = parse_pax(data, url, offset)
        if any(k.startswith("GNU.sparse.") for k in global_pax):
            raise ShardFormatError(f"{url}: global PAX header at byte {offset} declares sparse files, "
                                   "which shardflow does not read", reason="unsupported_member")
        return long_name, pax, global_pax, False
    return long_name, pax, global_pax, True  # K: GNU long link name, for the next header, not a sample


def _member_name(
    header: bytes, long_name: str | None, pax: dict[str, str], global_pax: dict[str, str], url: str, offset: int
) -> str:
    if pax:
        if "size" in pax:
            raise ShardFormatError(f"{url}: PAX size override at byte {offset} is not supported")
        return pax.get("path") or long_name or _ustar_name(header)
    if long_name is not None:
        return long_name
    if global_pax:
        return global_pax.get("path") or _ustar_name(header)
    if header[345] == 0:
        return header[0:100].split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
    return _ustar_name(header)


def _truncated(url: str, header: bytes, long_name: str | None, pax: dict[str, str], offset: int, size: int) -> TruncatedShardError:
    return TruncatedShardError(
        f"{url}: truncated inside member {_header_name(header, long_name, pax)!r} "
        f"(header at byte {offset}, {size} bytes expected)"
    )


def _signed_checksum(header: bytes) -> int:
    """Checksum computed with signed bytes, as some historic tar writers did."""
    return sum(b - 256 if b > 127 else b for b in header[:148] + header[156:]) + 256


def _ustar_name(header: bytes) -> str:
    name = header[0:100].split(b"\0", 1)[0]
    if header[257:262] == b"ustar":
        prefix = header[345:500].split(b"\0", 1)[0]
        if prefix:
            name = prefix + b"/" + name
    return name.decode("utf-8", "surrogateescape")


def _header_name(header: bytes, long_name: str | None, pax: dict[str, str]) -> str:
    return pax.get("path") or long_name or _ustar_name(header)


