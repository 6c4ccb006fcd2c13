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

from itertools import repeat

import numpy as np

from .headers import BLOCK

__all__ = ["checked_members", "indexed_heads"]

_POW8_CHK = 8 ** np.arange(5, -1, -1, dtype=np.int64)  # the 6 digits of a checksum field
_POW8_SIZE = 8 ** np.arange(10, -1, -1, dtype=np.int64)  # the 11 digits of a size field
# the bytes of a header the walk reads: size digits, its NUL, the checksum's NUL and space,
# the type flag and the first byte of the ustar name prefix
_WALKED = np.array([*range(124, 135), 135, 154, 155, 156, 345], dtype=np.int64)
_PLAIN = np.array([0, 0, 32, 48, 0], dtype=np.uint8)  # what bytes 135, 154, 155, 156, 345 must be


def indexed_heads(
    buf: bytes, pos: int, base: int, stop: int, max_member: int, most: int, starts: np.ndarray
) -> tuple[list[int], list[int]]:
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
        ``(heads, sizes)``: positions in ``buf`` of the members' headers, in tar
        order, and their data sizes in bytes; both empty when ``base + pos`` is
        not a sample start or the first member is not plain (the caller then
        walks member by member).
    """
    first = base + pos
    i = int(np.searchsorted(starts, first))
    if i >= len(starts) - 1 or starts[i] != first:
        return [], []
    limit = base + len(buf) if stop < 0 else min(base + len(buf), stop)
    j = min(int(np.searchsorted(starts, limit, side="right")) - 1, i + most)  # spans wholly in buf
    if j <= i:
        return [], []
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
        fields = arr[np.minimum(q[:, None] + _WALKED, top)]
        digits = fields[:, :11].astype(np.int64) - 48
        size = digits @ _POW8_SIZE
        nxt = q + BLOCK + ((size + BLOCK - 1) & ~(BLOCK - 1))
        ok = (
            (fields[:, 11:] == _PLAIN).all(axis=1)
            & ((digits >= 0) & (digits <= 7)).all(axis=1)
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
    return heads[keep].tolist(), sizes[keep].tolist()


def checked_members(
    buf: bytes, base: int, heads: list[int], sizes: list[int]
) -> list[tuple[str, int, bytes]]:
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
    if not heads:
        return []
    # headers sit a whole number of blocks apart: index the buffer's blocks, not its bytes
    skew = heads[0] % BLOCK
    blocks = np.frombuffer(buf, dtype=np.uint8, count=(len(buf) - skew) // BLOCK * BLOCK, offset=skew)
    hdr = blocks.reshape(-1, BLOCK)[(np.asarray(heads, dtype=np.int64) - skew) // BLOCK]
    chk = hdr[:, 148:154].astype(np.int64) - 48
    computed = hdr.sum(axis=1, dtype=np.int64) - hdr[:, 148:156].sum(axis=1, dtype=np.int64) + 256
    good = (chk @ _POW8_CHK == computed) & ((chk >= 0) & (chk <= 7)).all(axis=1)
    if not good.all():
        n = int(np.argmin(good))  # the general path reads (and reports) the bad one
        heads, sizes = heads[:n], sizes[:n]
    find = buf.find
    return [
        (buf[p : n if n >= 0 else p + 100].decode("utf-8", "surrogateescape"), base + p, buf[p + BLOCK : p + BLOCK + size])
        for p, n, size in zip(heads, map(find, repeat(b"\0"), heads, [p + 100 for p in heads]), sizes)
    ]

