"""Sample keys and field names.

A tar member name ``<key>.<field>`` is split by the webdataset rule: the key is
the member path up to the first dot of its basename, the field is the rest
(``a/b.v1/0001.seg.png`` is key ``a/b.v1/0001``, field ``seg.png``). Fields are
lower-cased on read; keys keep their case. Members whose basename starts with
``__`` or has no dot are not sample members.
"""

from __future__ import annotations

from ..errors import SampleError

__all__ = ["IMAGE_EXTENSIONS", "split_name", "check_key", "check_field", "codec_extension"]

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
            component, starts with ``/``, or contains a NUL character.
    """
    if not isinstance(key, str) or not key:
        raise SampleError(f"sample key must be a non-empty str, got {key!r}")
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
