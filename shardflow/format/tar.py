"""Tar shards: samples read from a tar stream, and the deterministic tar writer.

The reader groups adjacent members that share a key into samples (key and
field split as in the webdataset tar convention, see :mod:`.keys`), over the
member walk of :mod:`.members`, which parses POSIX ustar, GNU and PAX headers
and checks every one, faster than iterating members with CPython ``tarfile``
(docs/benchmarks.md).

The writer emits ustar headers, with a PAX ``path`` record before any member
whose name is not ASCII or does not fit ustar's 100/155-byte fields, so names of
any length and any Unicode round-trip; CPython ``tarfile``, GNU tar and
webdataset read the result. Headers are deterministic: mtime 0, uid/gid 0, empty
user/group names, mode 0644.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Collection, Generator, Iterable, Iterator, Mapping
from itertools import chain, islice
from typing import Any

import numpy as np

from .. import fastpath
from ..errors import SampleError, ShardFormatError
from .headers import BLOCK
from .keys import KeySet, split_name
from .layouts import Layouts
from .limits import DEFAULT_LIMITS, Limits
from .members import iter_members, member_runs
from .spans import SampleRun
from .wholes import Frame, raw_sample, whole
from .ustar import ascii_sample, header, regular_member

__all__ = [
    "BLOCK",
    "END_OF_ARCHIVE",
    "iter_members",
    "member_runs",
    "iter_samples",
    "scan_shard",
    "raw_sample",
    "encode_member",
    "encode_sample",
    "sample_parts",
]

END_OF_ARCHIVE = b"\0" * (2 * BLOCK)
_ZERO_BLOCK = b"\0" * BLOCK


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
    layouts: Layouts | None = None,
    frame: Frame | None = None,
) -> Generator[tuple[str, int, dict[str, Any] | SampleError], None, int | None]:
    """Group a tar stream's members into samples: the one place that decides where a sample
    ends (runs the bulk walk grouped already are checked against the same open sample and
    closed keys as single members, see :class:`_Grouping`).

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
        layouts: the kept layouts of the file ``chunks`` come from (see
            :mod:`.layouts`), or None.
        frame: ``(url, source)``: each sample comes whole in place of its fields
            (``{"__key__", "__url__", fields..., "__source__"}``, see :func:`.wholes.whole`).

    Yields:
        ``(key, offset, fields)``: the key, the absolute offset of the sample's
        first header, and ``{field: bytes}`` in member order. A sample is
        yielded only once it is known to be complete: the next key starts, the
        archive ends, ``end`` is reached, or the stream is damaged right after
        it where the next sample starts (the damaged member's header was sound
        and names another key, or ``starts`` holds its offset). A truncated or
        corrupt shard so never yields a partial sample, and loses no complete
        one it can tell.

    Returns:
        (as the generator's return value) the offset where the walk stopped (the
        end-of-archive marker, ``end`` or the stream's end, see :func:`member_runs`),
        or None when ``limit`` samples were given first.

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
        return None
    group = _Grouping(url, starts, sample_errors, limit, start, frame)
    walk = member_runs(chunks, url, start, end=end, limits=limits, starts=_increasing(walk_starts),
                       grouped=fastpath.enabled("bulk"), layouts=layouts)
    stopped: list[int] = []
    try:
        for run in _kept(walk, stopped):
            if type(run) is SampleRun:  # grouped already (the common case): whole samples at once
                done = group.whole(run)
                if done is not None:
                    yield from done
                    if group.full:
                        return None
                    continue
            yield from group.members(run) if frame is None else _wholes(group.members(run), frame)
            if group.full:
                return None
    except ShardFormatError as e:
        if group.key is not None and type(group.fields) is dict and group.fields and _ends_sample(e, group.key, starts):
            yield from _wholes(((group.key, group.offset, group.fields),), frame)
        raise
    if group.key is not None and group.fields is not None:
        yield from _wholes(((group.key, group.offset, group.fields),), frame)
    return stopped[0]


def _wholes(items: Iterable[tuple[str, int, Any]], frame: Frame | None) -> Iterable[tuple[str, int, Any]]:
    """``items``, each sample whole with ``frame`` (a SampleError as it is)."""
    if frame is None:
        return items
    return ((k, o, whole(k, f, frame) if type(f) is dict else f) for k, o, f in items)


def _kept(walk: Generator[Any, None, int], stopped: list[int]) -> Iterator[Any]:
    """The runs of ``walk``; its return value (where it stopped) is appended to ``stopped``."""
    stopped.append((yield from walk))


class _Grouping:
    """The members of a tar stream grouped into samples, run after run, for :func:`iter_samples`
    (whose arguments ``url``, ``starts``, ``sample_errors`` and ``limit`` it takes).

    Attributes:
        key, fields, offset: the open sample: its key (None before the first), its
            ``{field: bytes}`` (a SampleError, or None once its error was yielded) and its
            first header's offset.
        full: ``limit`` samples were given: stop.
    """

    def __init__(self, url: str, starts: Collection[int] | None, sample_errors: str, limit: int | None, start: int,
                 frame: Frame | None) -> None:
        self.url, self.sample_errors, self.limit, self.frame = url, sample_errors, limit, frame
        self.closed = KeySet()  # memory per key bounded, whatever its length
        self.bounds = None if starts is None else np.asarray(starts, dtype=np.int64)  # sorted, as an index's are
        self._listed: list[int] | None = None  # the bounds as a sorted list (bisect), made once a member needs them
        self.key: str | None = None
        self.fields: dict[str, bytes] | SampleError | None = {}
        self.offset, self.count, self.full = start, 0, False

    def whole(self, run: SampleRun) -> Iterator[tuple[str, int, Any]] | None:
        """The samples a grouped run completes, or None where it must go member by member."""
        if self.bounds is not None and not _fits(run, self.key, self.bounds):
            return None
        got = _grouped(run, self.key, self.fields, self.offset, self.closed, self.frame)
        if got is None:
            return None
        n, done, self.key, self.fields, self.offset = got
        if self.limit is not None and self.count + n >= self.limit:
            self.full = True
            return islice(done, self.limit - self.count)
        self.count += n
        return done

    def members(self, run: Iterable[Any]) -> Iterator[tuple[str, int, dict[str, bytes] | SampleError]]:
        """The samples that the members of ``run`` complete (and bad ones, as ``sample_errors`` says)."""
        if self._listed is None and self.bounds is not None:  # the first member that needs them (a set cost 0.35 ms)
            self._listed = sorted(self.bounds.tolist())
        url, sample_errors, limit, closed, at_start = self.url, self.sample_errors, self.limit, self.closed, self._listed
        key, fields, sample_offset, count = self.key, self.fields, self.offset, self.count
        try:
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
                opens = at_start is not None and (i := bisect_left(at_start, offset)) < len(at_start) and at_start[i] == offset
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
                                self.full = True
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
                        self.full = True
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
        finally:
            self.key, self.fields, self.offset, self.count = key, fields, sample_offset, count


def _grouped(
    run: SampleRun, key: str | None, fields: Any, offset: int, closed: KeySet, frame: Frame | None
) -> tuple[int, Iterator[tuple[str, int, Any]], str, Any, int] | None:
    """The samples that a grouped run completes, for :func:`iter_samples`.

    Args:
        run: the run; ``key``, ``fields``, ``offset``: the open sample (its key,
            ``{field: bytes}``, a SampleError or None, and its first header's
            offset; key None before the first); ``closed``: the keys of the
            samples closed before it (updated); ``frame``: see :func:`iter_samples`.

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
        more = run.sample(0)
        if type(fields) is not dict or not fields.keys().isdisjoint(more):
            return None
        head = 1
    if not closed.isdisjoint(keys[head:]) or (not head and key in keys):
        return None  # a key reappears (the open one included): the member path names the error
    if head:
        fields.update(more)
    last = len(keys) - 1
    if last < head:
        return 0, iter(()), key, fields, offset  # type: ignore[arg-type]
    done = run.items(head, last, frame)
    n = last - head
    if key is not None:
        if fields is not None:
            done, n = chain(_wholes(((key, offset, fields),), frame), done), n + 1
        closed.add(key)
    closed.update(keys[head:last])
    return n, done, keys[last], run.sample(last), run.offsets[last]


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
    """Scan a whole shard for its offset index: its samples as :func:`iter_samples` groups them.

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
    samples = iter_samples(chunks, url, 0, limits=limits)
    while True:
        try:
            key, offset, sample = next(samples)
        except StopIteration as stop:
            offsets.append(stop.value)
            return keys, offsets, fields
        keys.append(key)
        offsets.append(offset)
        for field in sample:  # (sample_errors "raise": always a dict)
            fields[field] = fields.get(field, 0) + 1


# ---------------------------------------------------------------- writing


def _pax_record(key: str, value: str) -> bytes:
    payload = f" {key}={value}\n".encode("utf-8", "surrogateescape")
    length = len(payload) + 1
    while len(str(length)) + len(payload) != length:
        length = len(str(length)) + len(payload)
    return str(length).encode() + payload


def _member_parts(name: str, data: bytes) -> list[bytes]:
    raw = name.encode("utf-8", "surrogateescape")
    if len(raw) <= 100 and raw.isascii():
        return regular_member(raw, data)
    record = _pax_record("path", name)
    short = raw[:100].decode("ascii", "replace").encode("ascii", "replace")[:100]
    return [header(b"././@PaxHeader", len(record), b"x"), record, _ZERO_BLOCK[: -len(record) % BLOCK],
            header(short, len(data), b"0"), data, _ZERO_BLOCK[: -len(data) % BLOCK]]  # fmt: skip


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
    raw = key.encode("utf-8", "surrogateescape")
    if raw.isascii():  # the usual sample: plain ustar members, made in one step
        fast = ascii_sample(raw, fields)
        if fast is not None:
            return fast
    parts: list[bytes] = []
    for field in sorted(fields):
        parts += _member_parts(f"{key}.{field}", fields[field])
    return parts


def encode_sample(key: str, fields: dict[str, bytes]) -> bytes:
    """Encode one sample: its members adjacent and sorted by field."""
    return b"".join(sample_parts(key, fields))
