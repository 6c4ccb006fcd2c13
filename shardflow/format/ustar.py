"""The ustar header blocks the shard writer emits (:func:`shardflow.format.tar.encode_member`).

Deterministic metadata (mode 0644, uid and gid 0, mtime 0, no user or group names), so the
same samples give the same bytes: only the name, the size, the checksum and the type flag
vary. The parts that depend on the size alone (the size field, its byte sum, the data's
padding) are remembered for the first 4,096 sizes met: small files repeat their sizes, and
formatting them was a fifth of the time to write a small sample.
"""

from __future__ import annotations

from collections.abc import Mapping

from .headers import BLOCK

__all__ = ["header", "regular_member", "ascii_sample"]

_ZERO_BLOCK = b"\0" * BLOCK
_MODE_IDS = b"0000644\0" b"0000000\0" b"0000000\0"  # mode, uid, gid: bytes 100-124
_MTIME = b"00000000000\0"  # bytes 136-148
_AFTER_TYPE = b"\0" * 100 + b"ustar\0" + b"00" + b"\0" * 247  # link name, magic, version, the rest: 157-512
_FIXED_SUM = sum(_MODE_IDS) + sum(_MTIME) + sum(_AFTER_TYPE) + 8 * 0x20  # the checksum field counts as spaces
_REGULAR, _REGULAR_AFTER = ord("0"), b"0" + _AFTER_TYPE  # a regular file's type flag, and what follows it
_SIZE_PARTS: dict[int, tuple[bytes, int, bytes]] = {}
_SUFFIXES: dict[str, tuple[bytes, int] | None] = {}  # field -> (b"." + field, its byte sum); None: not ASCII


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


def _suffix(field: str) -> tuple[bytes, int] | None:
    got = _SUFFIXES.get(field, False)
    if got is False:
        raw = ("." + field).encode("utf-8", "surrogateescape")
        got = (raw, sum(raw)) if raw.isascii() else None
        if len(_SUFFIXES) < 1024:
            _SUFFIXES[field] = got
    return got


def ascii_sample(key: bytes, fields: Mapping[str, bytes]) -> list[bytes] | None:
    """``[header, data, padding]`` of each field of a sample, fields sorted, members named
    ``key.field`` (as :func:`regular_member` makes them, the key's byte sum taken once); None
    when a member name is not ASCII or longer than 100 bytes (the caller's general path).

    Args:
        key: the sample key, ASCII bytes.
        fields: field name -> bytes.
    """
    parts: list[bytes] = []
    base = _FIXED_SUM + _REGULAR + sum(key)
    room = 100 - len(key)
    for field in sorted(fields) if len(fields) > 1 else fields:
        suffix = _SUFFIXES.get(field, False)
        if suffix is False:
            suffix = _suffix(field)
        if suffix is None or len(suffix[0]) > room:
            return None
        data = fields[field]
        got = _SIZE_PARTS.get(len(data))
        middle, size_sum, pad = got if got is not None else _size_parts(len(data))
        check = base + suffix[1] + size_sum
        field_ = _CHECKS.get(check)
        if field_ is None:
            field_ = _check_field(check)
        parts += (b"".join((key, suffix[0], _NULS[room - len(suffix[0])], middle, field_, _REGULAR_AFTER)), data, pad)
    return parts


_NULS = [b"\0" * n for n in range(101)]  # a name's NUL padding to 100 bytes, by length
_CHECKS: dict[int, bytes] = {}  # checksum -> its field (a header's sum is at most 512 * 255)


def _check_field(check: int) -> bytes:
    got = b"%06o\0 " % check
    if len(_CHECKS) < 65536:
        _CHECKS[check] = got
    return got
