"""Validation of tar header fields, before the reader uses any of them.

Every number in a header (size, checksum) must be octal digits or a
non-negative GNU base-256 value; PAX record lengths must be decimal and fit
their header; a member's type must be one the reader understands (regular
files, links, devices, directories, fifos, GNU long names, PAX records), and
its size must be within :class:`~shardflow.format.limits.Limits`. The checks
name the shard, the byte offset, the member and the value found.
"""

from __future__ import annotations

from ..errors import SampleError, ShardFormatError
from .limits import Limits

__all__ = ["BLOCK", "REGULAR", "SKIP_DATA", "EXTENDED", "KNOWN", "parse_number", "parse_pax", "check_extended_size", "member_error"]

BLOCK = 512  # bytes in a tar block: a header, and the unit member data is padded to
REGULAR = (b"0", b"\0", b"7")  # regular file, old-style regular, contiguous file
SKIP_DATA = (b"1", b"2", b"3", b"4", b"5", b"6")  # links, devices, dirs, fifos: no sample
EXTENDED = (b"L", b"K", b"x", b"g")  # GNU long name/link, PAX per-member and global records
KNOWN = frozenset(REGULAR + SKIP_DATA + EXTENDED)
_TYPE_NAMES = {b"S": "GNU sparse", b"V": "GNU volume label", b"M": "GNU multi-volume", b"D": "GNU dump dir",
               b"N": "GNU old long name", b"X": "Solaris extended header", b"A": "Solaris ACL"}
_OCTAL = frozenset(b"01234567")


def parse_number(field: bytes, url: str, offset: int, what: str) -> int:
    """Parse a numeric header field: NUL/space padded octal digits, or GNU base-256.

    Only the digits 0-7 are accepted (no sign, no ``_``, no inner spaces), and a
    base-256 value must be >= 0: a negative size would send the reader back onto
    a header it has read.

    Raises:
        ShardFormatError: the field is neither (names the shard, byte and field).
    """
    if field and field[0] & 0x80:  # GNU base-256 (sizes >= 8 GiB)
        value = int.from_bytes(field[1:], "big")
        if field[0] & 0x40:
            value -= 1 << (8 * (len(field) - 1))
        if value < 0:
            raise ShardFormatError(
                f"{url}: header at byte {offset} has a negative base-256 {what} field ({value})"
            )
        return value
    text = field.split(b"\0", 1)[0].strip(b" ")
    if not text:
        return 0
    if not _OCTAL.issuperset(text):
        # the field's bytes are not quoted: a shard's bytes are not for error messages
        raise ShardFormatError(f"{url}: header at byte {offset} has a non-octal {what} field (not digits 0-7)")
    return int(text, 8)


def parse_pax(data: bytes, url: str, offset: int) -> dict[str, str]:
    """Parse PAX extended header records ``"<len> <key>=<value>\\n"``.

    Raises:
        ShardFormatError: a record's length is not decimal digits, is shorter
            than its own text, runs past the header's data, or lacks ``=``/newline.
    """
    out: dict[str, str] = {}
    pos = 0
    while pos < len(data):
        if data[pos] == 0:
            break
        space = data.find(b" ", pos, pos + 21)
        digits = data[pos:space] if space > pos else b""
        if not digits or not digits.isdigit():
            raise ShardFormatError(f"{url}: malformed PAX header at byte {offset} (a record length is not decimal)")
        length = int(digits)
        end = pos + length
        if length <= space + 1 - pos or end > len(data) or data[end - 1] != 0x0A:
            raise ShardFormatError(
                f"{url}: malformed PAX record at byte {offset}: length {length} at record offset {pos} "
                f"does not fit the header's {len(data)} bytes"
            )
        key, sep, value = data[space + 1 : end - 1].partition(b"=")
        if not sep:
            raise ShardFormatError(f"{url}: malformed PAX record at byte {offset} (no '=')")
        out[key.decode("utf-8", "surrogateescape")] = value.decode("utf-8", "surrogateescape")
        pos = end
    return out


def check_extended_size(size: int, typeflag: bytes, url: str, offset: int, name: str, limits: Limits) -> None:
    """Refuse an extended header larger than ``Limits.max_header_bytes``."""
    if typeflag in EXTENDED and size > limits.max_header_bytes:
        raise ShardFormatError(
            f"{url}: extended header ({typeflag.decode('latin-1')!r}) before {name!r} at byte {offset} declares "
            f"{size} bytes, over the limit of {limits.max_header_bytes} (Limits.max_header_bytes)",
            reason="header_too_large",
        )


def member_error(typeflag: bytes, pax: dict[str, str], name: str, url: str, offset: int, size: int,
                 limits: Limits) -> SampleError | None:
    """The error for a member that cannot be read as a sample's field, or None."""
    if typeflag not in KNOWN:
        kind = _TYPE_NAMES.get(typeflag, "unknown")
        return SampleError(
            f"{url}: member {name!r} at byte {offset} has tar type {typeflag!r} ({kind}), which shardflow does "
            "not read: re-create the shard with plain regular files",
            reason="unsupported_member",
        )
    sparse = sorted(k for k in pax if k.startswith("GNU.sparse."))
    if sparse:
        return SampleError(
            f"{url}: member {name!r} at byte {offset} is a PAX sparse file ({sparse[0]}), which shardflow does "
            "not read: re-create the shard without --sparse",
            reason="unsupported_member",
        )
    if size > limits.max_member_bytes:
        return SampleError(
            f"{url}: member {name!r} at byte {offset} declares {size} bytes, over the limit of "
            f"{limits.max_member_bytes} bytes (Limits.max_member_bytes; raise it to read larger members)",
            reason="member_too_large",
        )
    return None
