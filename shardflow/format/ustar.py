"""The ustar header blocks the shard writer emits (:func:`shardflow.format.tar.encode_member`).

Deterministic metadata (mode 0644, uid and gid 0, mtime 0, no user or group names), so the
same samples give the same bytes: only the name, the size, the checksum and the type flag
vary. The parts that depend on the size alone (the size field, its byte sum, the data's
padding) are remembered for the first 4,096 sizes met: small files repeat their sizes, and
formatting them was a fifth of the time to write a small sample.
"""

from __future__ import annotations

from .headers import BLOCK

__all__ = ["header", "regular_member"]

_ZERO_BLOCK = b"\0" * BLOCK
_MODE_IDS = b"0000644\0" b"0000000\0" b"0000000\0"  # mode, uid, gid: bytes 100-124
_MTIME = b"00000000000\0"  # bytes 136-148
_AFTER_TYPE = b"\0" * 100 + b"ustar\0" + b"00" + b"\0" * 247  # link name, magic, version, the rest: 157-512
_FIXED_SUM = sum(_MODE_IDS) + sum(_MTIME) + sum(_AFTER_TYPE) + 8 * 0x20  # the checksum field counts as spaces
_REGULAR, _REGULAR_AFTER = ord("0"), b"0" + _AFTER_TYPE  # a regular file's type flag, and what follows it
_SIZE_PARTS: dict[int, tuple[bytes, int, bytes]] = {}


def _size_parts(size: int) -> tuple[bytes, int, bytes]:
    """A member of ``size`` bytes: its header's bytes 100-148 (mode, ids, size, mtime), the byte
    sum of its size field, and its padding."""
    got = _SIZE_PARTS.get(size)
    if got is None:  # GNU base-256 sizes from 8 GiB
        field = b"%011o\0" % size if size < 8**11 else b"\x80" + size.to_bytes(11, "big")
        got = (_MODE_IDS + field + _MTIME, sum(field), _ZERO_BLOCK[: -size % BLOCK])
        if len(_SIZE_PARTS) < 4096:
            _SIZE_PARTS[size] = got
    return got


def header(name: bytes, size: int, typeflag: bytes) -> bytes:
    """One ustar header block (its checksum is the byte sum of the block with the checksum
    field read as spaces, as the reader checks it).

    Raises:
        ValueError: ``name`` is longer than 100 bytes.
    """
    if len(name) > 100:
        raise ValueError("ustar name longer than 100 bytes")
    middle, size_sum, _ = _size_parts(size)
    check = _FIXED_SUM + sum(name) + size_sum + typeflag[0]
    return b"".join((name.ljust(100, b"\0"), middle, b"%06o\0 " % check, typeflag, _AFTER_TYPE))


def regular_member(name: bytes, data: bytes) -> list[bytes]:
    """``[header, data, padding]`` of a regular file; ``name`` ASCII, at most 100 bytes
    (:func:`header` for type ``0``, in one step: the path of nearly every member written)."""
    middle, size_sum, pad = _size_parts(len(data))
    check = _FIXED_SUM + sum(name) + size_sum + _REGULAR
    return [b"".join((name.ljust(100, b"\0"), middle, b"%06o\0 " % check, _REGULAR_AFTER)), data, pad]
