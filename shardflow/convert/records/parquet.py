"""``convert parquet``: one sample per row of Parquet files (a Hugging Face dataset, for one).

``SRC`` is a local path or any fsspec URL (``s3://``, ``hf://`` with the ``hf``
extra, ``memory://``): one ``.parquet`` file, a folder (every ``*.parquet`` under
it, at any depth), or a glob (``data/train-*.parquet``, Hugging Face's layout).
Files are taken in sorted order; a folder that holds the files of several
Hugging Face splits (``train-00000-of-00002.parquet`` beside ``test-...``) is
refused: name the split with a glob; so are the files of several configs
(``data/train-*``, ``extra/train-*``) unless ``merge_configs=True``
(:mod:`shardflow.convert.records.hflayout`).

Samples. Row ``i`` (counted over the files in order, from 0) becomes the sample
with key ``%09d % i`` (``000000042``; wider past 999,999,999 rows); each column
becomes a field by the column plan of :mod:`shardflow.convert.records.columns` (image
bytes unchanged under their real format, integers ``cls``, strings ``txt``,
other columns JSON; ``columns=`` picks and renames). The class names of a
``ClassLabel`` column, read from the Hugging Face features that ``datasets``
stores in the file's schema metadata (key ``huggingface``), go into the
manifest's ``meta``: ``class_to_idx`` (as ``convert imagefolder`` writes it)
for the column that becomes ``cls``, and ``columns`` lists every column with
its kind, field and class names. All files must hold the planned columns with
the same kinds and class names as the first.

Reading. Only the files' footers are read by this process (one small read
each, as the stream goes): the inputs of the conversion are *pieces*, ``(file,
row group, first row, end row)``, grouped so that each input holds exactly
``max_count`` rows (the last one fewer), and each task writes one input (one
shard; ``group_size`` counts inputs). Workers read their rows row group by row
group, yielding :data:`BATCH_ROWS` rows at a time; pyarrow decodes a row
group's selected columns whole, so a worker's memory holds one row group of
those columns, whatever the size of the files (Hugging Face writes image
datasets in row groups of 100 rows; docs/getting-data-in.md measures a file written as
one large row group). A row group that two shards share is read by both. A
re-run keeps the finished shards whose pieces, file sizes and modification
times (ETags remotely) are unchanged.

Order: by default a seeded shuffle, row groups then each shard's rows (``order="shuffled"``,
:mod:`shardflow.convert.records.parquetorder`: its memory is one shard's rows per worker);
``order="walk"``: the files' order. Keys stay the row numbers; ``meta`` records ``order``, ``order_seed``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ... import storage
from ...errors import ConversionError, missing_dependency
from ...format.manifest import Manifest
from ...storage.backends.filesystems import object_identity
from ...storage.urls import has_glob, local_path
from .columns import Column, encode_value, parse_columns, plan_columns
from ..engine.engine import ConvertOptions, run_conversion
from ..engine.mixorder import DEFAULT_ORDER, check_order, input_order, order_meta
from .hflayout import check_layout
from .imagepaths import check_images_root, read_image_path
from .parquetorder import OrderedPiece, RowGroup, cut_inputs, shuffled_inputs

__all__ = ["convert_parquet", "parquet_files", "count_rows", "BATCH_ROWS", "READ_BUFFER"]

log = logging.getLogger(__name__)

BATCH_ROWS = 128
"""Rows a worker decodes at once."""

READ_BUFFER = 8 << 20
"""Bytes pyarrow reads from a file at once (its ``buffer_size``; a remote file is read in ranges this large)."""

_KEY_WIDTH = 9

# A piece: (file URL, file version, row group, rows in that row group, first row, end row).
Piece = tuple[str, Any, int, int, int, int]


def _pyarrow() -> Any:
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise missing_dependency("pyarrow", "parquet", "convert parquet") from e
    return pq


def parquet_files(src: str, io: storage.IOOptions, *, merge_configs: bool = False) -> list[str]:
    """The Parquet files of ``src`` (a file, a folder or a glob), sorted.

    Args:
        src: a ``.parquet`` file, a folder of them or a glob.
        io: storage options.
        merge_configs: take the files of several Hugging Face configs together
            (:mod:`shardflow.convert.records.hflayout`).

    Raises:
        FileNotFoundError: nothing there, or no ``.parquet`` file in the folder / glob.
        ConversionError: the files of several Hugging Face configs (unless
            ``merge_configs``), or a folder holds the files of several splits.
        ImportError: the URL's filesystem package is missing (names the extra).
    """
    if has_glob(src):
        files = storage.list_glob(src, io)
        if not files:
            raise FileNotFoundError(f"{src}: no file matches")
        fixed = re.split(r"[*?\[]", src, maxsplit=1)[0]
        check_layout(src, files, fixed.rsplit("/", 1)[0] if "/" in fixed else "", merge_configs=merge_configs,
                     whole_folder=False)  # fmt: skip
        return files
    if storage.is_dir(src, io):
        root = src.rstrip("/") + "/"
        files = [f for f in storage.list_glob(storage.join_url(src, "**/*.parquet"), io)
                 if not any(part.startswith(".") for part in f.removeprefix(root).split("/"))]  # fmt: skip
        if not files:
            raise FileNotFoundError(f"{src}: no .parquet file in this folder")
        check_layout(src, files, root, merge_configs=merge_configs)
        return files
    if not storage.exists(src, io):
        raise FileNotFoundError(f"{src}: no such file or folder")
    return [src]


@contextlib.contextmanager
def _open(url: str, io: storage.IOOptions) -> Iterator[Any]:
    """A ``pyarrow.parquet.ParquetFile`` of a local path or fsspec URL."""
    pq = _pyarrow()
    if storage.is_local(url):
        with pq.ParquetFile(local_path(url), buffer_size=READ_BUFFER) as f:
            yield f
        return
    fs, path = storage.filesystem(url, io)
    with fs.open(path, "rb") as raw, pq.ParquetFile(raw, buffer_size=READ_BUFFER) as f:
        yield f


def _version(url: str, io: storage.IOOptions) -> Any:
    """What identifies this version of a file: size and mtime locally, the store's identity remotely."""
    if storage.is_local(url):
        st = os.stat(local_path(url))
        return (st.st_size, st.st_mtime_ns)
    fs, path = storage.filesystem(url, io)
    return tuple(sorted(object_identity(fs.info(path)).items()))


def _hf_features(schema: Any, url: str) -> dict[str, Any]:
    """The Hugging Face ``features`` in a file's schema metadata (``{}`` when none or not JSON).

    Raises:
        ConversionError: the metadata is JSON nested deeper than Python's recursion limit (named).
    """
    raw = (schema.metadata or {}).get(b"huggingface")
    if not raw:
        return {}
    try:
        info = json.loads(raw)
    except ValueError:
        return {}
    except RecursionError:
        raise ConversionError(f"{url}: the schema metadata 'huggingface' ({len(raw)} bytes) is JSON nested too "
                              "deeply to be Hugging Face features; remove it from the file") from None
    features = (info.get("info") or {}).get("features") if isinstance(info, dict) else None
    return features if isinstance(features, dict) else {}


@dataclass(frozen=True)
class _Context:
    columns: tuple[Column, ...]
    io: storage.IOOptions
    images_root: str | None = None  # the real path of the folder images referenced by path may be read from
    seed: int | None = None  # the shuffled order's seed (the inputs are shuffled ones); None: the walk


class _Listing:
    """The inputs, made as the files' footers are read; what ``meta`` records of them."""

    def __init__(self, files: list[str], plan: list[Column], io: storage.IOOptions, max_count: int) -> None:
        self.files, self.plan, self.io, self.max_count = files, plan, io, max_count
        self.rows: list[int] = []

    def groups(self) -> Iterator[RowGroup]:
        """Every row group, file by file, as each file's footer is read."""
        row = 0
        for url in self.files:
            with _open(url, self.io) as f:
                self._check(url, f.schema_arrow)
                meta = f.metadata
                groups = [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]
            version = _version(url, self.io)
            self.rows.append(sum(groups))
            for g, n in enumerate(groups):
                yield url, version, g, n, row
                row += n

    def _check(self, url: str, schema: Any) -> None:
        """Every file holds the planned columns, of the same kinds and class names as the first."""
        from .columns import class_names, column_kind

        features = _hf_features(schema, url)
        for c in self.plan:
            if c.name not in schema.names:
                raise ConversionError(f"{url}: no column {c.name!r} (the first file has it); its columns are "
                                      f"{', '.join(map(repr, schema.names))}")  # fmt: skip
            feature = features.get(c.name)
            kind = column_kind(schema.field(c.name).type, feature.get("_type") if isinstance(feature, dict) else None)
            if kind != c.kind:
                raise ConversionError(f"{url}: column {c.name!r} holds {kind} values, the first file's {c.kind}")
            if c.class_names is not None and features and class_names(features, c.name) != c.class_names:
                raise ConversionError(f"{url}: column {c.name!r} has other ClassLabel names than the first file")

    def summary(self) -> dict[str, Any]:
        return {"rows": sum(self.rows), "files": [{"url": u, "rows": n} for u, n in zip(self.files, self.rows)]}


def _build(inputs: list[tuple[int, tuple[Piece, ...]]], ctx: _Context) -> Iterator[tuple[str, dict[str, bytes]]]:
    """Worker: read each input's pieces, batch by batch, and yield one sample per row.

    A file stays open while consecutive pieces read it (a shard of many row groups
    of one file reads its footer once).
    """
    if ctx.seed is not None:
        yield from _build_shuffled(inputs, ctx)  # type: ignore[arg-type]
        return
    with contextlib.ExitStack() as stack:
        opened: tuple[str, Any] | None = None
        for first, pieces in inputs:
            row = first
            for url, _, group, rows, start, end in pieces:
                if opened is None or opened[0] != url:
                    stack.close()
                    opened = (url, stack.enter_context(_open(url, ctx.io)))
                yield from _read_piece(opened[1], ctx.columns, row, url, group, rows, start, end, ctx.images_root)
                row += end - start


def _build_shuffled(inputs: list[tuple[int, tuple[OrderedPiece, ...]]], ctx: _Context) -> Iterator[tuple[str, dict[str, bytes]]]:
    """Worker: read each shard's pieces (as the walk does, batch by batch, each turned into
    Python values at once), then yield its rows in ``input_order(rows, seed)``
    (:mod:`shardflow.convert.records.parquetorder`)."""
    with contextlib.ExitStack() as stack:
        opened: tuple[str, Any] | None = None
        for _, pieces in inputs:
            rows: list[tuple[int, str, int, int, list[Any]]] = []  # (row number, file, row group, row in it, values)
            for url, _, group, n, start, end, row in pieces:
                if opened is None or opened[0] != url:
                    stack.close()
                    opened = (url, stack.enter_context(_open(url, ctx.io)))
                for batch, at in _piece_batches(opened[1], ctx.columns, url, group, n, start, end):
                    values = [_values(batch.column(i), c) for i, c in enumerate(ctx.columns)]
                    first = row + at - start
                    rows += [(first + j, url, group, at + j, [v[j] for v in values]) for j in range(batch.num_rows)]
            for i in input_order(len(rows), int(ctx.seed or 0)):
                number, url, group, at, row_values = rows[int(i)]
                key = f"{number:0{_KEY_WIDTH}d}"
                yield key, _fields(ctx.columns, row_values, key, url, group, at, ctx.images_root)


def _check_group(f: Any, url: str, group: int, rows: int) -> None:
    if group >= f.metadata.num_row_groups or f.metadata.row_group(group).num_rows != rows:
        raise ConversionError(f"{url}: row group {group} is not the one listed ({rows} rows): "
                              "the file changed during the conversion")  # fmt: skip


def _read_piece(f: Any, columns: Sequence[Column], row: int, url: str, group: int, rows: int, start: int,
                end: int, images_root: str | None = None) -> Iterator[tuple[str, dict[str, bytes]]]:  # fmt: skip
    """The samples of rows ``start:end`` of one row group, ``row`` being the first one's number."""
    for batch, at in _piece_batches(f, columns, url, group, rows, start, end):
        yield from _samples(batch, columns, row, url, group, at, images_root)
        row += batch.num_rows


def _piece_batches(f: Any, columns: Sequence[Column], url: str, group: int, rows: int, start: int,
                   end: int) -> Iterator[tuple[Any, int]]:  # fmt: skip
    """Rows ``start:end`` of one row group, :data:`BATCH_ROWS` at a time: ``(batch, its first row
    in the row group)``."""
    _check_group(f, url, group, rows)
    at = 0
    names = [c.name for c in columns]
    for batch in f.iter_batches(batch_size=BATCH_ROWS, row_groups=[group], columns=names, use_threads=False):
        lo, hi = max(start - at, 0), min(end - at, batch.num_rows)
        if lo < hi:
            yield batch.slice(lo, hi - lo), at + lo
        at += batch.num_rows
        if at >= end:
            return


def _values(array: Any, c: Column) -> list[Any]:
    """The column's values as Python objects: an image struct's bytes (or, where they are
    missing, the struct itself, so the error can show its path); None for a null."""
    if c.kind in ("image", "bytes") and hasattr(array, "field") and array.type.get_field_index("bytes") >= 0:
        data = array.field("bytes").to_pylist()
        nulls = array.is_null().to_pylist()
        structs = array.to_pylist() if any(d is None for d in data) else None
        return [None if null else (d if d is not None else structs[i]) for i, (d, null) in enumerate(zip(data, nulls))]
    return array.to_pylist()


def _samples(batch: Any, columns: Sequence[Column], row: int, url: str, group: int,
             start: int, images_root: str | None = None) -> Iterator[tuple[str, dict[str, bytes]]]:  # fmt: skip
    values = [_values(batch.column(i), c) for i, c in enumerate(columns)]
    for j in range(batch.num_rows):
        key = f"{row + j:0{_KEY_WIDTH}d}"
        yield key, _fields(columns, [column[j] for column in values], key, url, group, start + j, images_root)


def _fields(columns: Sequence[Column], values: Sequence[Any], key: str, url: str, group: int, at: int,
            images_root: str | None) -> dict[str, bytes]:  # fmt: skip
    """One row's fields: row ``at`` of row group ``group`` of ``url``, its column values ``values``."""
    fields: dict[str, bytes] = {}
    for c, v in zip(columns, values):
        if v is not None:
            where = f"{url} (row group {group}, row {at}, key {key})"
            if isinstance(v, Mapping) and images_root is not None and c.kind in ("image", "bytes"):
                v = read_image_path(v, url, images_root, where)  # an image referenced by path
            name, data = encode_value(c, key, v, where)
            fields[name] = data
    return fields


def _meta(src: str, files: list[str], plan: list[Column]) -> dict[str, Any]:
    classes = [c for c in plan if c.class_names is not None]
    main = [c for c in classes if c.field == "cls"] or (classes if len(classes) == 1 else [])
    meta: dict[str, Any] = {
        "converter": "parquet",
        "source": os.path.abspath(local_path(src)) if storage.is_local(src) else src,
        "key": "row number over the files in order, from 0",
        "columns": [
            {"column": c.name, "kind": c.kind, "field": c.describe(),
             **({"class_names": list(c.class_names)} if c.class_names is not None else {})}
            for c in plan
        ],  # fmt: skip
    }
    if main:
        meta["class_to_idx"] = {name: i for i, name in enumerate(main[0].class_names or ())}
    return meta


def convert_parquet(
    src: str | os.PathLike[str],
    dst: str,
    *,
    columns: str | Sequence[tuple[str, str | None]] | None = None,
    options: ConvertOptions = ConvertOptions(),
    progress: Callable[[int], None] | None = None,
    client: Any = None,
    merge_configs: bool = False,
    images_root: str | os.PathLike[str] | None = None,
    order: str = DEFAULT_ORDER,
    seed: int = 0,
) -> Manifest:
    """Convert Parquet files into shards, one sample per row (see the module docstring).

    Args:
        src: a ``.parquet`` file, a folder of them or a glob; local or fsspec URL.
        dst: destination folder (local or fsspec URL).
        columns: which columns, and their fields: ``"image:jpg,label:cls"`` or
            ``[("image", "jpg"), ("label", None)]`` (None: the default name);
            None converts every column whose name does not start with ``__``.
        options: shard size (rows per shard), workers, resume, storage options
            (used for ``src`` and ``dst``). ``group_size`` counts shards' worth
            of rows per task (default 1).
        progress: ``progress(n)`` after every finished shard of ``n`` rows.
        client: a ``dask.distributed.Client``: write the shards as tasks on its
            cluster (its workers must reach ``src`` and ``dst``).
        merge_configs: convert the files of several Hugging Face configs
            (``data/``, ``extra/``) into one dataset (default: refused,
            :mod:`shardflow.convert.records.hflayout`).
        images_root: a local folder: image values that hold only a ``path``
            (``datasets``' ``to_parquet()`` of local images) are read from it
            (:mod:`shardflow.convert.records.imagepaths`; default: such a value is an error).
        order, seed: ``"shuffled"`` (default: row groups, then each shard's rows, in seeded
            permutations; see :mod:`~shardflow.convert.records.parquetorder`) or ``"walk"``.

    Returns:
        The manifest; ``meta`` holds ``source``, ``columns`` (each column's kind,
        field and class names), ``class_to_idx`` (of a ``ClassLabel`` column
        written as ``cls``), ``rows``, ``files`` (each file's rows), ``order`` and ``order_seed``.

    Raises:
        FileNotFoundError: no Parquet file at ``src``.
        ImportError: pyarrow (extra ``parquet``) or the URL's filesystem package
            (``hf://``: extra ``hf``) is missing.
        ConversionError: a named column is missing (the message lists the
            file's columns), files disagree on their columns, a value cannot be
            stored (names the file, row group, row and key); several Hugging
            Face configs or splits (names them).
        ImagePathError: an image path leads out of ``images_root``.
        ValueError: an unknown ``order``.
    """
    check_order(order)
    src = os.fspath(src)
    _pyarrow()
    io = options.io
    files = parquet_files(src, io, merge_configs=merge_configs)
    root = check_images_root(images_root) if images_root is not None else None
    with _open(files[0], io) as f:
        schema = f.schema_arrow
    wanted = parse_columns(columns) if isinstance(columns, str) else columns
    plan = plan_columns(schema, _hf_features(schema, files[0]), wanted, files[0])
    if options.group_size is None:
        options = dataclasses.replace(options, group_size=1)  # each input is one shard's rows
    listing = _Listing(files, plan, io, options.max_count)
    meta = {**_meta(src, files, plan), **order_meta(order, seed)}
    if order == "walk":
        inputs = cut_inputs(listing.groups(), options.max_count, numbered=False)
    else:
        inputs = shuffled_inputs(listing.groups(), options.max_count, int(seed))
    return run_conversion(
        dst,
        inputs,
        _build,
        context=_Context(tuple(plan), io, root, None if order == "walk" else int(seed)),
        meta=meta,
        meta_at_end=listing.summary,
        options=options,
        progress=progress,
        identity={"converter": "parquet", "source": meta["source"]},
        client=client,
    )


def count_rows(src: str, storage_options: Mapping[str, Any] | None = None, *, merge_configs: bool = False) -> int:
    """Rows in the Parquet files of ``src`` (their footers only): the progress bar's total."""
    io = storage.IOOptions(storage_options=dict(storage_options or {}))
    total = 0
    for url in parquet_files(src, io, merge_configs=merge_configs):
        with _open(url, io) as f:
            total += f.metadata.num_rows
    return total
