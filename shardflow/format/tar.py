"""Streaming tar reader and deterministic tar writer.

The reader parses POSIX ustar, GNU (long names ``L``/``K``, base-256 sizes) and
PAX (``x``/``g`` records) headers from an iterator of byte chunks, checks every
header checksum, skips directories, links, device nodes and ``__``-prefixed
members, and groups adjacent members that share a key into samples (key and
field split as in the webdataset tar convention, see :mod:`.keys`). It reads
about 8x faster than iterating members with CPython ``tarfile``.

The writer emits ustar headers, with a PAX ``path`` record before any member
whose name is not ASCII or does not fit ustar's 100/155-byte fields, so names of
any length and any Unicode round-trip; CPython ``tarfile``, GNU tar and
webdataset read the result. Headers are deterministic: mtime 0, uid/gid 0, empty
user/group names, mode 0644.
"""

from __future__ import annotations

from collections.abc import Collection, Generator, Iterable, Iterator, Sequence
from itertools import chain, islice
from typing import Any
from zlib import adler32 as _adler

import numpy as np

from ..errors import SampleError, ShardFormatError, TruncatedShardError
from .keys import split_name
from .headers import BLOCK, EXTENDED, KNOWN, REGULAR, SKIP_DATA, check_extended_size, member_error, parse_number, parse_pax
from .limits import DEFAULT_LIMITS, Limits
from .spans import SampleRun, checked_members, checked_samples, indexed_heads

__all__ = [
    "BLOCK",
    "END_OF_ARCHIVE",
    "iter_members",
    "member_runs",
    "iter_samples",
    "scan_shard",
    "encode_member",
    "encode_sample",
    "sample_parts",
]

END_OF_ARCHIVE = b"\0" * (2 * BLOCK)
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
) -> Generator[Sequence[Member] | SampleRun, None, int]:
    """Yield the regular-file members of a tar stream, in runs.

    A run is a list of members parsed together (see :func:`_plain_members`) or
    a single member read by the general path; consumers loop over a run with no
    generator step per member.

    Every header field is validated before it is used: the checksum, a size
    that must be octal digits or a non-negative base-256 number, the type flag
    (regular files, links, devices, directories, fifos, GNU long names and PAX
    records are understood; anything else, sparse files included, is not), and
    the sizes against ``limits``.

    Args:
        chunks: the tar's bytes from offset ``start`` on, in chunks of any size.
        url: shard URL, used in error messages.
        start: absolute byte offset of the first chunk's first byte (a header).
        end: absolute offset at which to stop (a header boundary), or None for
            the end-of-archive marker or end of stream.
        limits: the largest member and extended header read (see :class:`Limits`).
        starts: int64 absolute offsets where samples start, strictly increasing
            (the offset index's entries for the range, its end included), or
            None. With them, the plain members of whole samples are walked for
            many samples at once (see :func:`.spans.indexed_heads`); what is
            read is the same.
        grouped: runs of plain members in the common case come as a
            :class:`.spans.SampleRun`, already grouped into samples (iterating
            one still gives its members).

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
    long_name: str | None = None
    pax: dict[str, str] = {}
    global_pax: dict[str, str] = {}
    first_offset: int | None = None
    empty = True
    stop = end if end is not None else -1
    run = 16  # members in the next bulk run (see _plain_members)
    offset = start
    member: str | None = None  # the regular member whose header was read, for errors
    try:
        while True:
            offset = base + pos
            member = None
            if offset == stop:
                return offset
            if len(buf) - pos < BLOCK:
                buf, base, ok = _refill(it, buf, pos, base, BLOCK)
                pos = 0
                if not ok:
                    if not buf and not empty and first_offset is None:
                        # Every tar writer ends with the end-of-archive marker; a stream that stops
                        # on a member boundary without it was cut short, and its last sample may
                        # be missing members, so it must not be yielded as complete.
                        raise TruncatedShardError(
                            f"{url}: ends at byte {offset} without the tar end-of-archive marker: the shard was cut short"
                        )
                    if not buf and start == 0 and empty:
                        raise TruncatedShardError(f"{url}: empty file (0 bytes), not a tar archive")
                    raise TruncatedShardError(f"{url}: truncated inside a tar header at byte {offset}")
            empty = False
            if first_offset is None and not global_pax and type(buf) is bytes and len(buf) - pos >= 2 * BLOCK:
                # Plain members (most of any shard) parsed in bulk, same checks, see _plain_members
                members: list[Member] = []
                bound = stop
                if starts is not None:
                    # every whole sample in the buffer at once: a numpy step costs about the same for
                    # 16 samples as for 1,000, so a short first run would only repeat the overhead
                    heads, sizes = indexed_heads(buf, pos, base, stop, limits.max_member_bytes, _RUN, starts)
                    members, pos = _bulk_run(buf, pos, base, heads, sizes, grouped)
                    if not members:  # mid-sample (after a member read by the general path): walk to the next start
                        after = int(np.searchsorted(starts, offset, side="right"))
                        if after < len(starts):
                            bound = int(starts[after]) if stop < 0 else min(stop, int(starts[after]))
                if not members:
                    members, pos = _plain_members(buf, pos, base, bound, limits.max_member_bytes, run, grouped)
                run = min(2 * run, _RUN)  # short runs first: the first sample comes soon
                if members:
                    yield members
                    continue
            header = buf[pos : pos + BLOCK]
            if header[0] == 0 and header == _ZERO_BLOCK:
                if first_offset is not None:
                    raise TruncatedShardError(f"{url}: end-of-archive marker at byte {offset} right after an extended header")
                return offset
            chk = header[148:156]
            # sum of the header's bytes with the checksum field as spaces (POSIX ustar);
            # adler32's first half seeded with 0 is that sum mod 65521, and exact for
            # 256 bytes (at most 65,280), 4x faster than sum() over the block
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
            typeflag = header[156:157]
            padded = (size + BLOCK - 1) & ~(BLOCK - 1)
            if stop >= 0 and offset + BLOCK + padded > stop:
                raise ShardFormatError(
                    f"{url}: member at byte {offset} ({size} bytes) runs past byte {stop}, where the offset index "
                    "says the next sample starts: the index does not match the shard (re-run `shardflow index`)",
                    reason="stale_index",
                )
            if typeflag in REGULAR or typeflag not in KNOWN:
                name = member = _member_name(header, long_name, pax, global_pax, url, offset)
                bad = member_error(typeflag, pax, name, url, offset, size, limits)
            else:
                name, bad = "", None
                check_extended_size(size, typeflag, url, offset, _header_name(header, long_name, pax), limits)
            pos += BLOCK
            if first_offset is None:
                first_offset = offset
            if bad is not None:  # before its bytes are skipped: a caller that raises need not wait for them
                yield ((name, first_offset, bad),)
            keep = bad is None and typeflag not in SKIP_DATA
            if len(buf) - pos >= padded:
                data: bytes | bytearray | None = buf[pos : pos + size] if keep else None
                pos += padded
            else:  # the member runs into the next chunks: copy its bytes only, not the chunks
                data, buf, base, pos, ok = _take(it, buf, pos, base, size, padded, keep)
                if not ok:
                    raise _truncated(url, header, long_name, pax, offset, size)
                if keep and size < _BIG:
                    data = bytes(data)  # members under 1 MiB are bytes (see the docstring)
            if bad is not None:
                pass
            elif typeflag in REGULAR:
                yield ((name, first_offset, data),)
            elif typeflag == b"L":
                long_name = bytes(data).split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
                continue
            elif typeflag == b"x":
                pax = parse_pax(data, url, offset)
                continue
            elif typeflag == b"g":
                global_pax = parse_pax(data, url, offset)
                if any(k.startswith("GNU.sparse.") for k in global_pax):
                    raise ShardFormatError(f"{url}: global PAX header at byte {offset} declares sparse files, "
                                           "which shardflow does not read", reason="unsupported_member")
            elif typeflag == b"K":
                continue  # GNU long link name: applies to the next header, not a sample
            # directories, links, devices and fifos are not samples
            long_name = None
            pax = {}
            first_offset = None
    except ShardFormatError as e:
        if e.offset is None:  # where the damage starts: a sample boundary, if the index has it there
            e.offset = first_offset if first_offset is not None else offset
        if e.member is None:
            e.member = member
        raise


_RUN = 4096  # most members parsed in one run (their headers are gathered: 2 MiB)
_GROUPED_MIN = 8  # fewer members go one by one: numpy's fixed cost per call would outweigh grouping them


def _plain_members(
    buf: bytes, pos: int, base: int, stop: int, max_member: int, most: int = _RUN, grouped: bool = False
) -> tuple[list[Member] | SampleRun, int]:
    """The run of plain members at ``buf[pos:]``, their headers checked together with numpy.

    A plain member is the common case: a ustar regular file (type ``"0"``, no
    name prefix, no extended header before it) whose size and checksum are
    written as shardflow, GNU tar and CPython ``tarfile`` write them
    (``"%011o\\0"``, ``"%06o\\0 "``), and whose data is in ``buf``. For those,
    every check of the general path is made here too (checksum, octal digits,
    the member-size limit, not past ``stop``); the run ends before the first
    header that is anything else or fails a check, which the general path then
    reads (and reports). Walking from header to header takes a few byte
    lookups per member; checksums and names are then computed for the whole
    run at once.

    Args:
        buf: buffered bytes; ``pos``: a header boundary in it, at absolute offset
            ``base + pos``; ``stop``: the absolute offset to stop at (-1: none).
        max_member: :attr:`Limits.max_member_bytes`.
        most: the most members in the run.
        grouped: see :func:`_bulk_run`.

    Returns:
        ``(members, pos)``: ``(name, header offset, data)`` of each member of the
        run (or a :class:`.spans.SampleRun`), and the position after it.
    """
    heads: list[int] = []
    sizes: list[int] = []
    end = len(buf)
    p = pos
    while p + BLOCK <= end and len(heads) < most:
        if buf[p + 156] != 48 or buf[p + 345] or buf[p + 135] or buf[p + 154] or buf[p + 155] != 32:
            break
        field = buf[p + 124 : p + 135]
        if not field.isdigit():
            break
        try:
            size = int(field, 8)
        except ValueError:  # an 8 or 9
            break
        nxt = p + BLOCK + ((size + BLOCK - 1) & ~(BLOCK - 1))
        if nxt > end or size > max_member or (stop >= 0 and (base + p == stop or base + nxt > stop)):
            break
        heads.append(p)
        sizes.append(size)
        p = nxt
    return _bulk_run(buf, pos, base, heads, sizes, grouped)


def _bulk_run(
    buf: bytes, pos: int, base: int, heads: list[int], sizes: list[int], grouped: bool
) -> tuple[list[Member] | SampleRun, int]:
    """The members of a walk (``heads``, ``sizes``) up to the first bad checksum, and the
    position after them (``pos`` when there are none). With ``grouped``, the common case
    comes as a :class:`.spans.SampleRun` (see :func:`.spans.checked_samples`)."""
    if not heads:
        return [], pos
    if grouped and len(heads) >= _GROUPED_MIN:
        found = checked_samples(buf, base, heads, sizes)
        if found is not None:
            return found, found.end
    members = checked_members(buf, base, heads, sizes)
    if not members:
        return [], pos
    last = len(members) - 1
    return members, heads[last] + BLOCK + ((sizes[last] + BLOCK - 1) & ~(BLOCK - 1))


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


def iter_samples(
    chunks: Iterable[bytes],
    url: str,
    start: int = 0,
    *,
    end: int | None = None,
    limit: int | None = None,
    sample_errors: str = "raise",
    limits: Limits = DEFAULT_LIMITS,
    starts: Collection[int] | None = None,
    walk_starts: Collection[int] | None = None,
) -> Iterator[tuple[str, int, dict[str, bytes] | SampleError]]:
    """Group a tar stream's members into samples.

    Args:
        chunks: the tar's bytes from ``start`` on (see :func:`iter_members`).
        url: shard URL, for error messages.
        start: absolute offset of the first byte given (a sample's first header).
        end: absolute offset at which to stop, or None.
        limit: stop after this many samples, or None.
        sample_errors: ``"raise"`` raises sample-level errors (below);
            ``"yield"`` yields ``(key, offset, SampleError)`` for the bad sample
            instead and goes on with the next one.
        limits: the largest member and extended header read (see :class:`Limits`).
        starts: the offsets where samples start (the offset index's entries
            for this range), or None. They tell a damaged header that starts a
            sample from one inside a sample (see below), and they are where
            samples begin: a member at one starts a sample even if it has the
            key before it, a key that changes between them is an error, so one
            item is yielded per sample the index lists (a reader that seeks
            with the index counts on it: a damaged shard never shifts samples).
        walk_starts: offsets where samples are said to start (an offset index,
            its end included), or None: used only to walk plain headers for
            many samples at once (see :func:`member_runs`). Never trusted: a
            sample's walk must land exactly on the next offset, so what is read
            is the same with any offsets, right, stale or none.

    Yields:
        ``(key, offset, fields)``: the key, the absolute offset of the sample's
        first header, and ``{field: bytes}`` in member order. A sample is
        yielded only once it is known to be complete: the next key starts, the
        archive ends, ``end`` is reached, or the stream is damaged right after
        it where the next sample starts (the damaged member's header was sound
        and names another key, or ``starts`` holds its offset). A truncated or
        corrupt shard so never yields a partial sample, and loses no complete
        one it can tell.

    Raises:
        SampleError: a key reappears after its sample was closed (members of a
            sample are not adjacent; with ``starts``, also a member at a sample
            start with the key before it, or a key change between two starts,
            both ``reason`` ``non_adjacent``), a field repeats within a sample, or a
            member cannot be read (``reason`` ``unsupported_member`` for sparse
            files and types not understood, ``member_too_large`` over
            ``limits.max_member_bytes``).
        TruncatedShardError, ShardFormatError: see :func:`iter_members`.
    """
    if limit is not None and limit <= 0:
        return
    closed: set[str] = set()
    bounds, at_start = _bounds(starts)
    key: str | None = None
    fields: dict[str, bytes] | SampleError | None = {}  # None: the sample's error was yielded already
    sample_offset = start
    count = 0
    try:
        for run in member_runs(chunks, url, start, end=end, limits=limits, starts=_increasing(walk_starts), grouped=True):
            if type(run) is SampleRun and (bounds is None or _fits(run, key, bounds)):
                # grouped already (the common case): whole samples at once
                got = _grouped(run, key, fields, sample_offset, closed)
                if got is not None:
                    n, done, key, fields, sample_offset = got
                    if limit is not None and count + n >= limit:
                        yield from islice(done, limit - count)
                        return
                    count += n
                    yield from done
                    continue
            for name, offset, data in run:  # a run is a list: no generator step per member
                # key/field split as in split_name(), inlined: this loop runs once per member
                slash = name.rfind("/") + 1
                dot = name.find(".", slash)
                if dot <= slash or dot == len(name) - 1 or name.startswith("__", slash):
                    if isinstance(data, SampleError) and sample_errors == "raise":
                        raise data  # not a sample's member, but not one shardflow understands either
                    continue
                k = name[:dot]
                field = name[dot + 1 :]
                if not field.islower() and field != field.lower():
                    field = field.lower()
                opens = at_start is not None and offset in at_start
                if k != key and at_start is not None and not opens and key is not None:
                    if type(fields) is dict:  # the index says the sample goes on to the next start
                        fields = _key_error(url, k, offset, (name, key))
                        if sample_errors == "raise":
                            raise fields
                    continue
                if k != key or opens:
                    if key is not None:
                        if fields is not None:
                            yield key, sample_offset, fields
                            count += 1
                            if limit is not None and count >= limit:
                                return
                        closed.add(key)
                    key, fields, sample_offset = k, {}, offset
                    if k in closed:
                        fields = _key_error(url, k, offset)
                        if sample_errors == "raise":
                            raise fields
                if type(fields) is not dict:  # None or a SampleError: the sample is dropped
                    continue
                if type(data) is not bytes and isinstance(data, SampleError):
                    if sample_errors == "raise":
                        raise data
                    # reported at once, before the member's bytes are skipped (and before a cut in them
                    # is found); the sample's other members are then dropped as they come
                    yield k, sample_offset, data
                    count += 1
                    if limit is not None and count >= limit:
                        return
                    fields = None
                    continue
                if field in fields:
                    bad = SampleError(f"{url}: sample {k!r} has the field {field!r} twice (second copy at byte "
                                      f"{offset})", reason="duplicate_field")
                    if sample_errors == "raise":
                        raise bad
                    fields = bad
                    continue
                fields[field] = data
    except ShardFormatError as e:
        if key is not None and type(fields) is dict and fields and _ends_sample(e, key, starts):
            yield key, sample_offset, fields
        raise
    if key is not None and fields is not None:
        yield key, sample_offset, fields


def _grouped(
    run: SampleRun, key: str | None, fields: Any, offset: int, closed: set[str]
) -> tuple[int, Iterator[tuple[str, int, Any]], str, Any, int] | None:
    """The samples that a grouped run completes, for :func:`iter_samples`.

    Args:
        run: the run; ``key``, ``fields``, ``offset``: the open sample (its key,
            ``{field: bytes}``, a SampleError or None, and its first header's
            offset; key None before the first); ``closed``: the keys of the
            samples closed before it (updated).

    Returns:
        ``(n, done, key, fields, offset)``: how many samples to yield and an
        iterator over them, in order (the open one first when the run closes
        it; made as they are taken, so that no list of them is held), and the
        sample now open (the run's last); or None, changing nothing, where the run must go member by
        member: it goes on with the open sample and repeats one of its fields, or
        a key of it was closed before or is the open one.
    """
    keys = run.keys
    head = 0
    if keys[0] == key:  # the open sample goes on in this run
        if type(fields) is not dict or not fields.keys().isdisjoint(run.fields[0]):
            return None
        head = 1
    if not closed.isdisjoint(keys[head:]) or (not head and key in keys):
        return None  # a key reappears (the open one included): the member path names the error
    if head:
        fields.update(run.fields[0])
    last = len(keys) - 1
    if last < head:
        return 0, iter(()), key, fields, offset  # type: ignore[arg-type]
    done: Iterator[tuple[str, int, Any]] = zip(keys[head:last], run.offsets[head:last], run.fields[head:last])
    n = last - head
    if key is not None:
        if fields is not None:
            done, n = chain(((key, offset, fields),), done), n + 1
        closed.add(key)
    closed.update(keys[head:last])
    return n, done, keys[last], run.fields[last], run.offsets[last]


def _key_error(url: str, k: str, offset: int, inside: tuple[str, str] | None = None) -> SampleError:
    """The error for a sample whose key ``k`` (its member at byte ``offset``) breaks adjacency:
    it reappears after its sample was closed, or, ``inside`` ``(member name, open key)``,
    it changes where the offset index says the open sample goes on."""
    if inside is not None:
        return SampleError(
            f"{url}: member {inside[0]!r} at byte {offset} has the key {k!r} inside sample {inside[1]!r}, which "
            "the offset index says goes on to the next sample start: the shard is damaged (or the index "
            "stale: re-run `shardflow index`)",
            reason="non_adjacent",
        )
    return SampleError(
        f"{url}: key {k!r} reappears at byte {offset} after its sample was closed: the members of a sample "
        "must be adjacent in the tar (re-create the shard with `shardflow` or `tar --sort=name`)",
        reason="non_adjacent",
    )


def _bounds(starts: Collection[int] | None) -> tuple[np.ndarray | None, frozenset[int] | None]:
    """``starts`` as int64 offsets (sorted, as an index's are) and as a set, or ``(None, None)``."""
    if starts is None:
        return None, None
    bounds = np.asarray(starts, dtype=np.int64)
    return bounds, frozenset(bounds.tolist())


def _fits(run: SampleRun, key: str | None, bounds: np.ndarray) -> bool:
    """Whether the samples of ``run`` begin exactly at the sample starts ``bounds`` in its
    range (the first one going on with the open sample ``key`` when it has that key)."""
    begun = run.offsets[1:] if run.keys[0] == key else run.offsets
    lo, hi = np.searchsorted(bounds, (run.offsets[0], run.stop)).tolist()
    return hi - lo == len(begun) and bool((bounds[lo:hi] == begun).all())


def _increasing(starts: Collection[int] | None) -> np.ndarray | None:
    """``starts`` as int64 offsets if they strictly increase (as a sound index's do), else None."""
    if starts is None or len(starts) < 2:
        return None
    arr = np.asarray(starts, dtype=np.int64)
    return arr if arr.ndim == 1 and bool((arr[1:] > arr[:-1]).all()) else None


def _ends_sample(err: ShardFormatError, key: str, starts: Collection[int] | None) -> bool:
    """Whether the damage ``err`` reports starts a new sample (so the one before it is complete)."""
    if starts is not None and err.offset is not None and err.offset in starts:
        return True
    if err.member is None:
        return False
    split = split_name(err.member)
    return split is not None and split[0] != key


def scan_shard(
    chunks: Iterable[bytes], url: str, *, limits: Limits = DEFAULT_LIMITS
) -> tuple[list[str], list[int], dict[str, int]]:
    """Scan a whole shard for its offset index.

    Args:
        chunks: the shard's (decompressed) bytes from offset 0 on.
        url: named in errors.
        limits: see :func:`iter_members`.

    Returns:
        ``(keys, offsets, fields)``: sample keys in order; ``len(keys) + 1``
        offsets (sample ``i`` spans ``[offsets[i], offsets[i+1])``, the last
        entry is where the end-of-archive marker or the stream's end is); and
        how many samples carry each field.

    Raises:
        SampleError: members of a sample are not adjacent, a field repeats, or
            a member cannot be read (see :func:`iter_samples`).
        TruncatedShardError, ShardFormatError: see :func:`iter_members`.
    """
    keys: list[str] = []
    offsets: list[int] = []
    fields: dict[str, int] = {}
    seen: set[str] = set()
    current: set[str] = set()
    gen = iter_members(chunks, url, 0, limits=limits)
    while True:
        try:
            name, offset, data = next(gen)
        except StopIteration as stop:
            offsets.append(stop.value)
            return keys, offsets, fields
        if isinstance(data, SampleError):
            raise data
        split = split_name(name)
        if split is None:
            continue
        key, field = split
        if not keys or keys[-1] != key:
            if key in seen:
                raise SampleError(f"{url}: key {key!r} reappears at byte {offset} after its sample was closed", reason="non_adjacent")
            seen.add(key)
            keys.append(key)
            offsets.append(offset)
            current = set()
        if field in current:
            raise SampleError(f"{url}: sample {key!r} has the field {field!r} twice", reason="duplicate_field")
        current.add(field)
        fields[field] = fields.get(field, 0) + 1


# ---------------------------------------------------------------- writing


# The fixed parts of every header this writer emits (ustar, deterministic metadata): only the
# name, the size, the checksum and the type vary, so a header is these parts joined.
_MODE_IDS = b"0000644\0" b"0000000\0" b"0000000\0"  # mode, uid, gid: bytes 100-124
_MTIME = b"00000000000\0"  # bytes 136-148
_AFTER_TYPE = b"\0" * 100 + b"ustar\0" + b"00" + b"\0" * 247  # link name, magic, version, the rest: 157-512
_FIXED_SUM = sum(_MODE_IDS) + sum(_MTIME) + sum(_AFTER_TYPE) + 8 * 0x20  # the checksum field counts as spaces


def _header(name: bytes, size: int, typeflag: bytes) -> bytes:
    """One ustar header block with deterministic metadata (its checksum is the byte sum of
    the block with the checksum field read as spaces, as the reader checks it)."""
    if len(name) > 100:
        raise ValueError("ustar name longer than 100 bytes")
    if size < 8**11:
        size_field = b"%011o\0" % size
    else:  # GNU base-256 for sizes of 8 GiB and more
        size_field = b"\x80" + size.to_bytes(11, "big")
    check = _FIXED_SUM + sum(name) + sum(size_field) + typeflag[0]
    return b"".join((name, _ZERO_BLOCK[len(name) : 100], _MODE_IDS, size_field, _MTIME,
                     b"%06o\0 " % check, typeflag, _AFTER_TYPE))  # fmt: skip


def _pax_record(key: str, value: str) -> bytes:
    payload = f" {key}={value}\n".encode("utf-8", "surrogateescape")
    length = len(payload) + 1
    while len(str(length)) + len(payload) != length:
        length = len(str(length)) + len(payload)
    return str(length).encode() + payload


def _pad(n: int) -> bytes:
    return b"\0" * (-n % BLOCK)


def _member_parts(name: str, data: bytes) -> list[bytes]:
    raw = name.encode("utf-8", "surrogateescape")
    if len(raw) <= 100 and raw.isascii():
        return [_header(raw, len(data), b"0"), data, _ZERO_BLOCK[: -len(data) % BLOCK]]
    record = _pax_record("path", name)
    short = raw[:100].decode("ascii", "replace").encode("ascii", "replace")[:100]
    return [_header(b"././@PaxHeader", len(record), b"x"), record, _pad(len(record)),
            _header(short, len(data), b"0"), data, _ZERO_BLOCK[: -len(data) % BLOCK]]  # fmt: skip


def encode_member(name: str, data: bytes) -> bytes:
    """Encode one regular-file member: header(s), data and padding.

    Names that are ASCII and at most 100 bytes get a plain ustar header; any
    other name gets a PAX ``path`` record first (POSIX.1-2001), read by CPython
    ``tarfile``, GNU tar and webdataset.
    """
    return b"".join(_member_parts(name, data))


def sample_parts(key: str, fields: dict[str, bytes]) -> list[bytes]:
    """The pieces of :func:`encode_sample`'s bytes, in order (joined, they are its result):
    a writer can copy them into its buffer without joining them first."""
    parts: list[bytes] = []
    for field in sorted(fields):
        parts += _member_parts(f"{key}.{field}", fields[field])
    return parts


def encode_sample(key: str, fields: dict[str, bytes]) -> bytes:
    """Encode one sample: its members adjacent and sorted by field."""
    return b"".join(sample_parts(key, fields))
