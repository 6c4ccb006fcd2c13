"""Sample keys and field names.

A tar member name ``<key>.<field>`` is split by the webdataset rule: the key is
the member path up to the first dot of its basename, the field is the rest
(``a/b.v1/0001.seg.png`` is key ``a/b.v1/0001``, field ``seg.png``). Fields are
lower-cased on read; keys keep their case. Members whose basename starts with
``__`` or has no dot are not sample members.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

from ..errors import SampleError

__all__ = ["IMAGE_EXTENSIONS", "MAX_KEY_BYTES", "KeySet", "split_name", "check_key", "check_field", "codec_extension"]

MAX_KEY_BYTES = 1 << 16
"""The longest key (UTF-8 bytes) a writer writes: 64 KiB, well within what readers read
(``Limits.max_header_bytes``, 1 MiB, bounds a GNU long name or PAX header)."""
_SHORT = 64  # keys up to this many characters are kept as they are in a KeySet


class KeySet:
    """The keys of the samples a reader closed in one shard, for duplicate detection, kept
    in memory that does not grow with the keys' length: a key of more than 64 characters
    is kept as its 16-byte BLAKE2b digest (a collision is a 2**-64 chance at 2**32 keys).
    Supports ``add``, ``update``, ``in`` and ``isdisjoint`` like a set of keys."""

    __slots__ = ("_items",)

    def __init__(self) -> None:
        self._items: set[str | bytes] = set()

    @staticmethod
    def _token(key: str) -> str | bytes:
        if len(key) <= _SHORT:
            return key
        return hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=16).digest()

    def add(self, key: str) -> None:
        self._items.add(self._token(key))

    def update(self, keys: Iterable[str]) -> None:
        keys = list(keys)
        # a reader adds every key of a shard: all short ones (the rule) go in as they are, at C speed
        self._items.update(keys if _all_short(keys) else map(self._token, keys))

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and self._token(key) in self._items

    def isdisjoint(self, keys: Iterable[str]) -> bool:
        keys = list(keys)
        if _all_short(keys):  # a short key is kept as itself (a str: never equal to a digest)
            return self._items.isdisjoint(keys)
        return not any(k in self for k in keys)

    def __len__(self) -> int:
        return len(self._items)


def _all_short(keys: list[str]) -> bool:
    """Whether every one of ``keys`` (str) is kept as itself in a :class:`KeySet`."""
    return not keys or max(map(len, keys)) <= _SHORT


IMAGE_EXTENSIONS: tuple[str, ...] = (
    "jpg", "jpeg", "png", "webp", "ppm", "pgm", "pbm", "bmp", "tif", "tiff", "gif",
)  # fmt: skip
"""Field extensions decoded as images (lower case, no dot): common formats Pillow reads.
The one list: the image codec, the image-folder converter and ``shardflow show`` use it."""


def split_name(name: str) -> tuple[str, str] | None:
    """Split a member name into ``(key, field)``.

    Args:
        name: tar member path, ``/``-separated.

    Returns:
        ``(key, field)`` with the field lower-cased, or ``None`` when the member
        is not part of a sample (basename starts with ``__``, has no dot, or the
        key or field would be empty).
    """
    slash = name.rfind("/") + 1
    if name.startswith("__", slash):
        return None
    dot = name.find(".", slash)
    if dot <= slash or dot == len(name) - 1:
        return None
    return name[:dot], name[dot + 1 :].lower()


def check_key(key: object) -> str:
    """Validate a key for writing, so that it reads back unchanged.

    Args:
        key: the sample's ``__key__``.

    Returns:
        The key as ``str``.

    Raises:
        SampleError: the key is not a non-empty string, its basename contains a
            dot or starts with ``__``, it has an empty, ``.`` or ``..`` path
            component, starts with ``/``, contains a NUL character, or is longer
            than :data:`MAX_KEY_BYTES` in UTF-8.
    """
    if not isinstance(key, str) or not key:
        raise SampleError(f"sample key must be a non-empty str, got {key!r}")
    if len(key) > MAX_KEY_BYTES // 4 and len(key.encode("utf-8", "surrogatepass")) > MAX_KEY_BYTES:
        size = len(key.encode("utf-8", "surrogatepass"))
        raise SampleError(f"sample key {key[:40]!r}... is {size} bytes long, over the limit of {MAX_KEY_BYTES} "
                          "(shardflow.format.keys.MAX_KEY_BYTES)", reason="key_too_long")
    base = key.rsplit("/", 1)[-1]
    problem = None
    if "." in base:
        problem = "its basename contains a dot, so the key/field split would read it back differently"
    elif base.startswith("__"):
        problem = "its basename starts with '__', which readers treat as metadata, not a sample"
    elif key.startswith("/"):
        problem = "it is an absolute path"
    elif "\x00" in key:
        problem = "it contains a NUL character"
    elif any(part in ("", ".", "..") for part in key.split("/")):
        problem = "it has an empty, '.' or '..' path component"
    if problem:
        raise SampleError(f"invalid sample key {key!r}: {problem}")
    return key


def check_field(key: str, field: object) -> str:
    """Validate a field name for writing.

    Raises:
        SampleError: the field is empty, not lower-case, contains ``/`` or NUL,
            or starts or ends with a dot.
    """
    if not isinstance(field, str) or not field:
        raise SampleError(f"sample {key!r}: field name must be a non-empty str, got {field!r}")
    if field != field.lower():
        raise SampleError(f"sample {key!r}: field {field!r} must be lower-case (fields are lower-cased on read)")
    if "/" in field or "\x00" in field or field.startswith(".") or field.endswith("."):
        raise SampleError(f"sample {key!r}: invalid field name {field!r}")
    return field


def codec_extension(field: str) -> str:
    """The extension that chooses a field's codec: the part after the last dot."""
    return field.rsplit(".", 1)[-1]
