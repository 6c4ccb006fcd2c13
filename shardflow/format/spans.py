"""Plain tar members found in bulk: whole samples walked with the offset index, headers checked with numpy.

The tar reader (:mod:`.tar`) hands its buffer here for the common case, plain
members: ustar regular files (type ``"0"``, no name prefix, no extended header
before them) whose size and checksum fields are written as shardflow, GNU tar
and CPython ``tarfile`` write them (``"%011o\\0"``, ``"%06o\\0 "``). Every
check of the reader's general path is made here too; a run ends before the
first header that is anything else or fails a check, which the general path
then reads (and reports), so what is read is the same either way, bytes for
bytes.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from itertools import repeat
from typing import Any, Union

import numpy as np

from .headers import BLOCK
from .wholes import Frame, pairs, whole, whole_pairs

__all__ = ["SampleRun", "RUN", "bulk_members", "plain_members", "checked_members", "checked_samples", "indexed_heads"]

Member = tuple[str, int, "bytes | bytearray"]
Heads = Union[list[int], np.ndarray]  # header positions or data sizes: a walk's lists, or int64 arrays

_NONE = np.zeros(0, dtype=np.int64)

# the 6 digits of a checksum field: their octal value, and their sum
_CHK_WEIGHTS = np.stack([8 ** np.arange(5, -1, -1, dtype=np.int64), np.ones(6, dtype=np.int64)], axis=1)
_POW8_SIZE = 8 ** np.arange(10, -1, -1, dtype=np.int64)  # the 11 digits of a size field
# the bytes of a header the walk reads: size digits, its NUL, the checksum's NUL and space,
# the type flag and the first byte of the ustar name prefix
# (a column each: a step's numpy work then runs along all the samples at once)
_WALKED = np.array([*range(124, 135), 135, 154, 155, 156, 345], dtype=np.int64)[:, None]
_PLAIN = np.array([0, 0, 32, 48, 0], dtype=np.uint8)[:, None]  # what bytes 135, 154, 155, 156, 345 must be


def indexed_heads(
    buf: bytes, pos: int, base: int, stop: int, max_member: int, most: int, starts: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Header positions and sizes of the plain members of the whole samples at ``buf[pos:]``.

    The offset index says where each sample starts, so the walk from header to
    header runs for all samples at once, one numpy step per member of the
    longest sample rather than a few Python byte lookups per member. A member
    whose header is not plain, whose size is over ``max_member`` or whose data
    runs past its sample's end (a stale index) ends the run before it.

    Args:
        buf: buffered tar bytes; ``pos``: a header boundary in it, at absolute
            offset ``base + pos``; ``stop``: the absolute offset reading stops at
            (-1: none).
        max_member: :attr:`Limits.max_member_bytes`.
        most: the most samples walked.
        starts: int64 absolute offsets where samples start, strictly increasing
            (the offset index's entries for the range read, its end included).

    Returns:
        ``(heads, sizes)``: int64, positions in ``buf`` of the members' headers, in tar
        order, and their data sizes in bytes; both empty when ``base + pos`` is
        not a sample start or the first member is not plain (the caller then
        walks member by member).
    """
    first = base + pos
    i = int(np.searchsorted(starts, first))
    if i >= len(starts) - 1 or starts[i] != first:
        return _NONE, _NONE
    limit = base + len(buf) if stop < 0 else min(base + len(buf), stop)
    j = min(int(np.searchsorted(starts, limit, side="right")) - 1, i + most)  # spans wholly in buf
    if j <= i:
        return _NONE, _NONE
    span = starts[i : j + 1] - base
    p, e = span[:-1].copy(), span[1:]
    arr = np.frombuffer(buf, dtype=np.uint8)
    top = len(buf) - 1
    bad = len(buf)  # position of the first member that is not plain
    found_heads: list[np.ndarray] = []
    found_sizes: list[np.ndarray] = []
    live = np.arange(len(p))
    while live.size:
        q, end = p[live], e[live]
        fields = arr[np.minimum(q + _WALKED, top)]  # (16, samples)
        digits = fields[:11] - np.uint8(48)  # (uint8: a byte below "0" wraps above 7)
        size = _POW8_SIZE @ digits
        nxt = q + BLOCK + ((size + BLOCK - 1) & ~(BLOCK - 1))
        ok = (
            (fields[11:] == _PLAIN).all(axis=0)
            & (digits <= 7).all(axis=0)
            & (q + BLOCK <= end)
            & (size <= max_member)
            & (nxt <= end)
        )
        if not ok.all():
            bad = min(bad, int(q[~ok].min()))
        found_heads.append(q[ok])
        found_sizes.append(size[ok])
        p[live[ok]] = nxt[ok]
        live = live[ok & (nxt < end)]
    heads = np.concatenate(found_heads)
    order = np.argsort(heads, kind="stable")
    heads, sizes = heads[order], np.concatenate(found_sizes)[order]
    keep = heads < bad
    return heads[keep], sizes[keep]


def _checked_headers(buf: bytes, heads: Heads, sizes: Heads) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The header blocks ``(n, 512)`` uint8 of the members at ``heads`` before the first bad
    checksum (the sum of the header's bytes, the field as spaces; 6 octal digits), and
    ``heads`` and ``sizes`` (int64) cut to them."""
    heads, sizes = np.asarray(heads, dtype=np.int64), np.asarray(sizes, dtype=np.int64)
    # headers sit a whole number of blocks apart: index the buffer's blocks, not its bytes
    skew = int(heads[0]) % BLOCK
    blocks = np.frombuffer(buf, dtype=np.uint8, count=(len(buf) - skew) // BLOCK * BLOCK, offset=skew)
    hdr = blocks.reshape(-1, BLOCK)[(heads - skew) // BLOCK]
    digits = hdr[:, 148:154] - np.uint8(48)  # (uint8: a byte below "0" wraps above 7)
    if bool((digits > 7).any()):  # not 6 octal digits: the general path reads (and reports) that header
        n = int(np.argmax((digits > 7).any(axis=1)))
        hdr, heads, sizes, digits = hdr[:n], heads[:n], sizes[:n], digits[:n]
    value, field = (digits.astype(np.int64) @ _CHK_WEIGHTS).T  # the field's octal value, its digits' sum
    # the sum of the header's bytes with the field (6 digits, 2 bytes after) read as 8 spaces;
    # (uint32 holds any header's sum, 512 * 255, and sums twice as fast as int64 here)
    computed = hdr.sum(axis=1, dtype=np.uint32).astype(np.int64) - field - hdr[:, 154] - hdr[:, 155] + (256 - 6 * 48)
    good = value == computed
    if not good.all():
        n = int(np.argmin(good))  # the general path reads (and reports) the bad one
        hdr, heads, sizes = hdr[:n], heads[:n], sizes[:n]
    return hdr, heads, sizes


def checked_members(buf: bytes, base: int, heads: Heads, sizes: Heads) -> list[tuple[str, int, bytes]]:
    """The members whose plain headers start at ``heads``, up to the first bad checksum.

    Args:
        buf: buffered tar bytes, at absolute offset ``base``.
        heads: positions of plain headers in ``buf``, in tar order (a walk's result);
            ``sizes``: their data sizes in bytes.

    Returns:
        ``(name, header offset, data)`` of each member before the first whose
        checksum (the sum of its header bytes, the field as spaces) does not
        match, or whose checksum field is not 6 octal digits.
    """
    if not len(heads):
        return []
    _, checked, lengths = _checked_headers(buf, heads, sizes)
    at, size_of = checked.tolist(), lengths.tolist()
    find = buf.find
    data = buf if type(buf) is bytes else memoryview(buf)  # a bytearray read in place: bytes all the same
    return [
        (buf[p : n if n >= 0 else p + 100].decode("utf-8", "surrogateescape"), base + p, bytes(data[p + BLOCK : p + BLOCK + size]))
        for p, n, size in zip(at, map(find, repeat(b"\0"), at, [p + 100 for p in at]), size_of)
    ]


class SampleRun:
    """Plain members parsed together and already grouped into samples (see :func:`checked_samples`).

    A sample's ``{field: bytes}`` is made only when it is taken (:meth:`sample`,
    :meth:`samples`): a reader handing samples on one by one then holds one at a
    time, not the run's thousand dicts and payload copies at once (which cost
    cache misses, and the cyclic garbage collector's passes that a thousand new
    container objects held at once set off).

    Attributes:
        keys: the samples' keys, in tar order (all different).
        offsets: the absolute offset of each sample's first header.
        end: the position in the buffer after the run's last member.
        stop: the absolute offset after the run's last member.

    Iterating it gives its members, ``(name, header offset, data)``, as
    :func:`checked_members` does (for a reader that needs them one by one).
    """

    __slots__ = ("keys", "offsets", "end", "stop", "_args", "_fields", "_lo", "_hi", "_bounds")

    def __init__(self, keys: list[str], offsets: list[int], fields: list[str] | tuple[str, ...], bounds: list[int] | int,
                 args: tuple[bytes, int, np.ndarray, np.ndarray]) -> None:
        self.keys, self.offsets, self._args, self._fields, self._bounds = keys, offsets, args, fields, bounds
        lo = args[2] + BLOCK
        self._lo, self._hi = lo.tolist(), (lo + args[3]).tolist()
        self.end = self._hi[-1] + (-int(args[3][-1]) % BLOCK)  # after the last member's padding
        self.stop = args[1] + self.end

    def on(self, buf: bytes) -> SampleRun:
        """The same run over ``buf``: the same file's bytes at the same offsets (:mod:`.layouts`)."""
        run = SampleRun.__new__(SampleRun)
        run.keys, run.offsets, run.end, run.stop, run._args = self.keys, self.offsets, self.end, self.stop, (buf, *self._args[1:])
        run._fields, run._lo, run._hi, run._bounds = self._fields, self._lo, self._hi, self._bounds
        return run

    def _members(self, j: int) -> tuple[int, int]:
        """The members ``[a, b)`` of sample ``j``."""
        k = self._bounds
        return (k * j, k * j + k) if type(k) is int else (k[j], k[j + 1])

    def _names(self, a: int, b: int) -> Iterable[str]:
        """The field names of members ``[a, b)`` (one sample's, or every second one's)."""
        fields = self._fields
        return fields[a:b] if type(fields) is list else fields  # a tuple: every sample's fields

    def sample(self, j: int) -> dict[str, bytes]:
        """Sample ``j``'s ``{field: bytes}``, in member order (a new dict)."""
        a, b = self._members(j)
        buf = self._args[0]
        if type(buf) is not bytes:  # a bytearray read in place: the fields are bytes all the same
            view = memoryview(buf)
            return {f: view[x:y].tobytes() for f, x, y in zip(self._names(a, b), self._lo[a:b], self._hi[a:b])}
        return {f: buf[x:y] for f, x, y in zip(self._names(a, b), self._lo[a:b], self._hi[a:b])}

    def items(self, first: int, last: int, frame: Frame | None = None) -> Iterator[tuple[str, int, dict[str, Any]]]:
        """``(key, offset, fields)`` of samples ``first`` to ``last`` (excluded), each made as it is taken
        (see :meth:`sample`); with ``frame``, each sample whole in place of its fields (:func:`whole`)."""
        keys, offsets = self.keys[first:last], self.offsets[first:last]
        if self._bounds != 2:
            made = map(self.sample, range(first, last))
            return zip(keys, offsets, made if frame is None else map(whole, keys, made, repeat(frame)))
        a, b = 2 * first, 2 * last
        fields, lo, hi = self._fields, self._lo, self._hi
        if type(fields) is list:
            f0, f1 = fields[a:b:2], fields[a + 1 : b : 2]
        else:
            f0, f1 = repeat(fields[0]), repeat(fields[1])
        args = (self._args[0], keys, offsets, f0, lo[a:b:2], hi[a:b:2], f1, lo[a + 1 : b : 2], hi[a + 1 : b : 2])
        return pairs(*args) if frame is None else whole_pairs(*frame, *args)

    def __iter__(self) -> Iterator[tuple[str, int, bytes]]:
        return iter(checked_members(*self._args))


_COLS = np.arange(100, dtype=np.uint8)[:, None]  # a name's columns, down the rows of its transpose
_COLS1 = _COLS + np.uint8(1)  # column + 1, for the last "/"
_A = np.uint8(65)  # "A": names - _A < 26 for upper-case letters (uint8 arithmetic wraps)
_NEAR = 32


def _split_names(hdr: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None:
    """The names of the headers ``hdr`` (``(m, 512)`` uint8) split as :func:`.keys.split_name`
    splits them, for all at once; None unless every one is the common case (see
    :func:`checked_samples`).

    Returns:
        ``(names, t, nul, dot, same)``: the names, ``(m, w)`` uint8 (``w``: the longest
        one's length and its NUL), ``t`` the same transposed (``(w, m)``: numpy's steps
        then run along all names at once, not along one short name at a time), each
        name's length and key length (int64, ``(m,)``), and whether a member has the key
        of the one before it (bool, ``(m,)``).
    """
    if not bool((hdr[:, 99] == 0).all()):  # a NUL ends every name
        return None
    rows = np.arange(len(hdr))
    zero = hdr[:, :_NEAR] == 0  # names are most often short: their NULs are looked for near the start first
    nul = zero.argmax(axis=1)
    if not bool(zero[rows, nul].all()):
        nul = (hdr[:, :100] == 0).argmax(axis=1)
    w = int(nul.max()) + 1
    names = np.ascontiguousarray(hdr[:, :w])  # the columns any name reaches: the work follows the names' length
    if int(names.max()) >= 128:  # ASCII only
        return None
    t = np.ascontiguousarray(names.T)
    cols = _COLS[:w]
    # basename start: one past the last "/" (0 without one); key/field split: the basename's first "."
    slash = ((t == 47) * _COLS1[:w]).max(axis=0)
    dots = (t == 46) & (cols >= slash)
    dot = dots.argmax(axis=0)
    ok = dots[dot, rows] & (dot > slash) & (dot < nul - 1)
    ok &= (t[slash, rows] != 95) | (t[np.minimum(slash + 1, w - 1), rows] != 95)  # no "__" basename
    if not bool(ok.all()):
        return None
    upper = (t - _A) < 26
    if bool(upper.any()) and bool((upper & (cols > dot)).any()):  # a field in upper case
        return None
    same = np.zeros(len(nul), dtype=bool)
    if len(nul) > 1:  # the same key length, and the same bytes before it
        same[1:] = (dot[1:] == dot[:-1]) & ((t[:, 1:] == t[:, :-1]) | (cols >= dot[1:])).all(axis=0)
    return names, t, nul, dot, same


def _common_fields(t: np.ndarray, nul: np.ndarray, dot: np.ndarray, k: int) -> bool:
    """Whether every sample of ``k`` members (names transposed, ``t``; name and key lengths
    ``nul``, ``dot``) has the first sample's field names, in its order."""
    for j in range(k):
        d, n = int(dot[j]), int(nul[j])
        if not ((dot[j::k] == d).all() and (nul[j::k] == n).all() and (t[d:n, j::k] == t[d:n, j : j + 1]).all()):
            return False
    return True


def checked_samples(buf: bytes, base: int, heads: Heads, sizes: Heads) -> SampleRun | None:
    """The members at ``heads`` (plain headers, checked as :func:`checked_members` does)
    grouped into samples, with the key and field split done for all of them at once.

    Only for the common case; anything else returns None and the caller goes member
    by member (where every rule is applied and every error named): an ASCII name
    shorter than 100 bytes with a non-empty key (its basename not starting with
    ``__``) and a non-empty lower-case field (the split as in :func:`.keys.split_name`),
    a sample's members adjacent (no key of the run appears twice, apart from its
    members), and no field twice in a sample. The run's last sample may go on in
    the members after it: the caller decides (its reader has the next ones).

    Returns:
        A :class:`SampleRun`, or None (nothing checked out, or not the common case).
    """
    if not len(heads):
        return None
    hdr, heads, sizes = _checked_headers(buf, heads, sizes)
    m = len(heads)
    split = _split_names(hdr) if m else None
    if split is None:
        return None
    names, t, nul, dot, same = split
    w = names.shape[1]
    text = names.tobytes().decode("ascii")
    at = np.arange(0, m * w, w)
    first = np.flatnonzero(~same)
    d = int(dot[0])
    if bool((dot[first] == d).all()):  # keys of one length (the most common): one numpy cast makes them all
        keys = names[first, :d].view(f"S{d}").ravel().astype(f"U{d}").tolist()
    else:
        keys = [text[a:b] for a, b in zip(at[first].tolist(), (at + dot)[first].tolist())]
    if len(set(keys)) != len(keys):
        return None
    k = m // len(first)  # members per sample, if every sample has as many
    regular = k * len(first) == m and bool((first == np.arange(0, m, k)).all())
    bounds: list[int] | int = k if regular else [*first.tolist(), m]
    fields: list[str] | tuple[str, ...]
    if type(bounds) is int and _common_fields(t, nul, dot, k):  # the fields once, not once a sample
        fields = tuple(text[a:b] for a, b in zip((at[:k] + dot[:k] + 1).tolist(), (at[:k] + nul[:k]).tolist()))
        if len(set(fields)) != k:
            return None
    else:
        fields = [text[a:b] for a, b in zip((at + dot + 1).tolist(), (at + nul).tolist())]
        ends = [*range(0, m + 1, bounds)] if type(bounds) is int else bounds
        if any(len(set(fields[a:b])) != b - a for a, b in zip(ends, ends[1:])):  # a field twice in a sample
            return None
    return SampleRun(keys, (heads[first] + base).tolist(), fields, bounds, (buf, base, heads, sizes))


def bulk_members(
    buf: bytes, pos: int, base: int, stop: int, max_member: int, run: int, starts: np.ndarray | None, grouped: bool
) -> tuple[list[Member] | SampleRun, int]:
    """Plain members (most of any shard) at ``buf[pos:]`` parsed in bulk, with the same
    checks (see :func:`plain_members`); ``run``: the most members walked without the index; ``([], pos)`` when the next header is not one."""
    members: list[Member] | SampleRun = []
    bound = stop
    if starts is not None:
        # every whole sample in the buffer at once: a numpy step costs about the same for
        # 16 samples as for 1,000, so a short first run would only repeat the overhead
        heads, sizes = indexed_heads(buf, pos, base, stop, max_member, RUN, starts)
        members, pos = _bulk_run(buf, pos, base, heads, sizes, grouped)
        if not members:  # mid-sample (after a member read by the general path): walk to the next start
            after = int(np.searchsorted(starts, base + pos, side="right"))
            if after < len(starts):
                bound = int(starts[after]) if stop < 0 else min(stop, int(starts[after]))
                if bound - base - pos <= _NEAR_START:  # a sample's rest (one cut by a chunk's end): the general
                    return [], pos  # path reads its few members for less than numpy's fixed cost per call
    if not members:
        members, pos = plain_members(buf, pos, base, bound, max_member, run, grouped)
    return members, pos


RUN = 4096
"""The most members parsed in one run (their headers are gathered: 2 MiB)."""
_NEAR_START = 16 * 1024  # bytes to the next indexed sample start under which a walk is not worth numpy
_GROUPED_MIN = 8  # fewer members go one by one: numpy's fixed cost per call would outweigh grouping them


def plain_members(
    buf: bytes, pos: int, base: int, stop: int, max_member: int, most: int = RUN, grouped: bool = False
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
    buf: bytes, pos: int, base: int, heads: Heads, sizes: Heads, grouped: bool
) -> tuple[list[Member] | SampleRun, int]:
    """The members of a walk (``heads``, ``sizes``) up to the first bad checksum, and the
    position after them (``pos`` when there are none). With ``grouped``, the common case
    comes as a :class:`SampleRun` (see :func:`checked_samples`)."""
    if not len(heads):
        return [], pos
    if grouped and len(heads) >= _GROUPED_MIN:
        found = checked_samples(buf, base, heads, sizes)
        if found is not None:
            return found, found.end
    members = checked_members(buf, base, heads, sizes)
    if not members:
        return [], pos
    last = len(members) - 1
    return members, int(heads[last]) + BLOCK + ((int(sizes[last]) + BLOCK - 1) & ~(BLOCK - 1))
