"""Which field each column of a table becomes: the column plan of ``convert parquet``.

A column's *kind* comes from its Arrow type (and the Hugging Face feature type
stored in the file, when there is one):

- ``image``: a ``struct<bytes, path>`` column (Hugging Face's ``Image`` feature).
  Each value's bytes are stored unchanged under the field of their real format,
  found by magic bytes (:func:`shardflow.convert.records.content.image_format`): JPEG
  ``jpg``, PNG ``png``, WebP ``webp``, GIF ``gif``, TIFF ``tif``, BMP ``bmp``. A
  value that is no image, or an image whose bytes are not in the file (only a
  ``path``), is an error naming the row.
- ``bytes``: a binary column, or a ``struct<bytes, ...>`` of another Hugging Face
  feature type (``Audio``): an image value is stored as above, any other value
  unchanged under ``<column>.bin``.
- ``int``: integer columns: ``cls`` (ASCII integer). A Hugging Face ``ClassLabel``
  column's class names are kept with it.
- ``str``: string columns (dictionary-encoded too): ``txt`` (UTF-8).
- ``json``: everything else (floats, booleans, lists, structs, dates): ``<column>.json``.

Default field names: the bare extension (``jpg``/``png``, ``cls``, ``txt``) when
the column is the only one of its kind among those converted (image and bytes
columns counting as one kind), else ``<column>.<extension>`` (``coarse_label.cls``),
``<column>`` being the column name lower-cased with characters other than
``a-z 0-9 _ -`` replaced by ``_``. Columns whose name starts with ``__`` (a
pandas index, ``__index_level_0__``) are skipped unless named in ``columns``.

``columns`` (``--columns image:jpg,label:cls``) picks columns, in that order, and
optionally names their fields: ``COLUMN`` keeps the default name, ``COLUMN:FIELD``
renames. A ``FIELD`` whose last extension has a codec (``cls``, ``txt``,
``json``, ``npy``, an image format, ...) is used as given; otherwise the kind's
extension is appended (``label:target`` gives ``target.cls``; ``image:img`` gives
``img.jpg`` / ``img.png`` by each value's format); a bytes column's ``FIELD`` is
used as given (``audio:audio.flac``), its values unchanged. An image column renamed to an
image extension (``image:jpg``) must hold only that format (an error names the
first row that does not); ``image:image`` keeps every format under the one field
``image``, which reads back as an image. Null values are left out of the sample.
"""

from __future__ import annotations

import datetime
import decimal
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ...codecs import IMAGE_FIELD, encode_field, known_extensions
from ...errors import ConversionError
from ...format.keys import IMAGE_EXTENSIONS, check_field, codec_extension
from .content import IMAGE_FORMAT_NAMES, describe_head, image_format

__all__ = ["Column", "plan_columns", "column_kind", "parse_columns", "class_names", "encode_value"]

KINDS = ("image", "bytes", "int", "str", "json")
_DEFAULT_EXTENSION = {"int": "cls", "str": "txt", "json": "json", "bytes": "bin"}
_FORMAT_ALIASES = {"jpeg": "jpg", "tiff": "tif"}
_UNSAFE = re.compile(r"[^a-z0-9_-]")


@dataclass(frozen=True)
class Column:
    """One converted column (picklable; sent to the workers).

    Attributes:
        name: the column's name in the file.
        kind: one of ``image``, ``bytes``, ``int``, ``str``, ``json``.
        field: the field; for image values with ``per_format`` the prefix of
            ``<prefix>.<format>`` (``""``: the bare format).
        per_format: image values go to a field named by their format.
        expect: the one image format (``jpg``, ``png``, ...) the field allows, or None.
        class_names: a ``ClassLabel`` column's class names, index order.
    """

    name: str
    kind: str
    field: str
    per_format: bool = False
    expect: str | None = None
    class_names: tuple[str, ...] | None = None

    def image_field(self, fmt: str) -> str:
        """The field of an image value of format ``fmt``."""
        if not self.per_format:
            return self.field
        return f"{self.field}.{fmt}" if self.field else fmt

    def describe(self) -> str:
        """The field as the manifest's ``meta`` shows it (``<format>`` for per-format fields)."""
        if not self.per_format:
            return self.field
        return f"{self.field}.<format>" if self.field else "<format>"


def column_kind(arrow_type: Any, hf_type: str | None = None) -> str:
    """The kind (see the module docstring) of a column of ``arrow_type``.

    Args:
        arrow_type: a ``pyarrow.DataType``.
        hf_type: the column's Hugging Face feature ``_type`` (``"Image"``,
            ``"ClassLabel"``, ...) when the file records one.
    """
    import pyarrow as pa

    t = arrow_type
    if pa.types.is_dictionary(t):
        t = t.value_type
    if pa.types.is_struct(t):
        index = t.get_field_index("bytes")
        if index >= 0 and _is_binary(t.field(index).type):
            return "image" if hf_type in (None, "Image") else "bytes"
        return "json"
    if _is_binary(t):
        return "bytes"
    if pa.types.is_integer(t):
        return "int"
    if pa.types.is_string(t) or pa.types.is_large_string(t) or getattr(pa.types, "is_string_view", lambda _: False)(t):
        return "str"
    return "json"


def _is_binary(t: Any) -> bool:
    import pyarrow as pa

    view = getattr(pa.types, "is_binary_view", lambda _: False)
    return pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_fixed_size_binary(t) or view(t)


def class_names(hf_features: Mapping[str, Any], column: str) -> tuple[str, ...] | None:
    """A ``ClassLabel`` column's class names from the Hugging Face features, or None."""
    feature = hf_features.get(column)
    if isinstance(feature, Mapping) and feature.get("_type") == "ClassLabel":
        names = feature.get("names")
        if isinstance(names, list) and all(isinstance(n, str) for n in names):
            return tuple(names)
    return None


def parse_columns(text: str) -> list[tuple[str, str | None]]:
    """Parse ``--columns``: ``"image:jpg,label:cls,text"`` -> ``[("image", "jpg"), ("label", "cls"), ("text", None)]``.

    Raises:
        ValueError: an empty entry or field, or a column named twice.
    """
    out: list[tuple[str, str | None]] = []
    for entry in text.split(","):
        name, sep, field = entry.strip().partition(":")
        name = name.strip()
        if not name or (sep and not field.strip()):
            raise ValueError(f"--columns: bad entry {entry!r}; expected COLUMN or COLUMN:FIELD, comma-separated")
        out.append((name, field.strip() if sep else None))
    names = [n for n, _ in out]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"--columns names {', '.join(map(repr, twice))} more than once")
    return out


def _safe_name(column: str) -> str:
    return _UNSAFE.sub("_", column.lower())


def _named(name: str, kind: str, target: str, names: tuple[str, ...] | None) -> Column:
    """The column with the field the user gave it."""
    ext = codec_extension(target)
    if kind in ("image", "bytes") and (ext in IMAGE_EXTENSIONS or target == IMAGE_FIELD):
        expect = None if target == IMAGE_FIELD else _FORMAT_ALIASES.get(ext, ext)
        if expect is not None and expect not in IMAGE_FORMAT_NAMES:
            raise ConversionError(f"column {name!r}: field {target!r}: {ext} images are not recognised by their bytes; "
                                  f"use one of {', '.join(IMAGE_FORMAT_NAMES)} or 'image'")  # fmt: skip
        return Column(name, kind, target, expect=expect)
    if kind == "bytes" or ext in known_extensions():
        return Column(name, kind, target, class_names=names)
    if kind == "image":
        return Column(name, kind, target, per_format=True)
    return Column(name, kind, f"{target}.{_DEFAULT_EXTENSION[kind]}", class_names=names)


def plan_columns(
    schema: Any, hf_features: Mapping[str, Any], columns: Sequence[tuple[str, str | None]] | None, where: str
) -> list[Column]:
    """The column plan of a table.

    Args:
        schema: the file's ``pyarrow.Schema``.
        hf_features: the Hugging Face ``features`` recorded in it (``{}`` when none).
        columns: ``(column, field or None)`` pairs (:func:`parse_columns`), or
            None for every column not starting with ``__``.
        where: the file, for error messages.

    Raises:
        ConversionError: a named column is not in the file (the message lists
            those that are), a field is invalid, or two columns would write the
            same field.
    """
    present = list(schema.names)
    wanted = columns if columns is not None else [(n, None) for n in present if not n.startswith("__")]
    missing = [n for n, _ in wanted if n not in present]
    if missing:
        raise ConversionError(f"{where}: no column {', '.join(map(repr, missing))}; its columns are "
                              f"{', '.join(map(repr, present))}")  # fmt: skip
    if not wanted:
        raise ConversionError(f"{where}: no column to convert (columns: {', '.join(map(repr, present))})")
    kinds = {n: column_kind(schema.field(n).type, _hf_type(hf_features, n)) for n, _ in wanted}
    default_kind = {n: "image" if k == "bytes" else k for n, k in kinds.items()}
    plan = []
    for name, target in wanted:
        kind, names = kinds[name], class_names(hf_features, name) if kinds[name] == "int" else None
        if target is not None:
            plan.append(_named(name, kind, target, names))
            continue
        alone = sum(1 for n, _ in wanted if default_kind[n] == default_kind[name]) == 1
        prefix = "" if alone else _safe_name(name)
        if kind in ("image", "bytes"):
            plan.append(Column(name, kind, prefix, per_format=True))
        elif kind == "json" or not alone:
            plan.append(Column(name, kind, f"{_safe_name(name)}.{_DEFAULT_EXTENSION[kind]}", class_names=names))
        else:
            plan.append(Column(name, kind, _DEFAULT_EXTENSION[kind], class_names=names))
    _check_fields(plan, where)
    return plan


def _hf_type(hf_features: Mapping[str, Any], column: str) -> str | None:
    feature = hf_features.get(column)
    return feature.get("_type") if isinstance(feature, Mapping) else None


def _possible_fields(c: Column) -> list[str]:
    if c.per_format:
        out = [c.image_field(fmt) for fmt in IMAGE_FORMAT_NAMES]
        return out + ([f"{c.field or _safe_name(c.name)}.bin"] if c.kind == "bytes" else [])
    return [c.field]


def _check_fields(plan: list[Column], where: str) -> None:
    owner: dict[str, str] = {}
    for c in plan:
        for f in _possible_fields(c):
            if f.startswith("__"):
                raise ConversionError(f"{where}: column {c.name!r}: field {f!r} starts with '__' (metadata)")
            try:
                check_field("<any>", f)
            except Exception as e:
                raise ConversionError(f"{where}: column {c.name!r}: {e}") from None
            if f in owner and owner[f] != c.name:
                raise ConversionError(f"{where}: columns {owner[f]!r} and {c.name!r} would both write field {f!r}; "
                                      "name their fields with --columns COLUMN:FIELD")  # fmt: skip
            owner[f] = c.name


def _jsonable(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (datetime.date, datetime.time)):
        return value.isoformat()
    if isinstance(value, datetime.timedelta):
        return value.total_seconds()
    if isinstance(value, decimal.Decimal):
        return str(value)
    if isinstance(value, (bytes, bytearray)):
        raise TypeError("bytes inside a JSON value (store a binary column on its own)")
    return value


def encode_value(c: Column, key: str, value: Any, where: str) -> tuple[str, bytes]:
    """``(field, bytes)`` of one non-null value of column ``c``.

    Args:
        c: the column.
        key: the sample's key (for errors).
        value: the value as ``pyarrow``'s ``to_pylist`` gives it (an image
            struct's ``bytes`` already taken out; a ``dict`` with its ``path`` if
            the bytes are missing).
        where: the file and row, for errors.

    Raises:
        ConversionError: an image value that is not an image, of another format
            than the field allows, or not embedded; a ``ClassLabel`` value that
            names no class (not -1 and outside ``0..len(names) - 1``); a value
            the field's codec cannot encode.
    """
    if c.kind in ("image", "bytes"):
        if isinstance(value, Mapping):  # the struct without bytes
            raise ConversionError(f"{where}: column {c.name!r} holds no image bytes (path {value.get('path')!r}): "
                                  "pass --images-root DIR (images_root=) to read images referenced by path from "
                                  "that folder")  # fmt: skip
        fmt = image_format(value)
        if c.expect is not None and fmt != c.expect:
            found = IMAGE_FORMAT_NAMES.get(fmt or "", "not an image")
            raise ConversionError(f"{where}: column {c.name!r}: field {c.field!r} takes {IMAGE_FORMAT_NAMES[c.expect]} "
                                  f"images, this value is {found} ({describe_head(value)})")  # fmt: skip
        if fmt is None and c.kind == "image" and c.field != IMAGE_FIELD:
            raise ConversionError(f"{where}: column {c.name!r} holds a value that is no image format known "
                                  f"({', '.join(IMAGE_FORMAT_NAMES.values())}): {describe_head(value)}")  # fmt: skip
        if fmt is None and c.per_format:
            return f"{c.field or _safe_name(c.name)}.bin", bytes(value)
        return (c.image_field(fmt) if fmt is not None else c.field), bytes(value)
    if c.class_names is not None and isinstance(value, int) and not -1 <= value < len(c.class_names):
        # -1 is Hugging Face's "no label" (kept as it is); any other value names no class
        raise ConversionError(f"{where}: column {c.name!r}: label {value} is not one of the ClassLabel's "
                              f"{len(c.class_names)} classes (0-{len(c.class_names) - 1}, or -1 for none)")
    if c.kind == "json":
        try:
            value = _jsonable(value)
        except TypeError as e:
            raise ConversionError(f"{where}: column {c.name!r}: {e}") from None
    try:
        return c.field, encode_field(key, c.field, value)
    except Exception as e:
        raise ConversionError(f"{where}: column {c.name!r}: {e}") from e
