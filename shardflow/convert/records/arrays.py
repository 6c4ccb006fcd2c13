"""``convert arrays``: one sample per row of a ``.npy``, ``.npz`` or HDF5 array.

Row ``i`` of the chosen array becomes the sample with key ``%09d % i``
(``000000042``; wider past 999,999,999 rows) and the field

- ``npy``: the row as a ``.npy`` (exact dtype and shape, no pickle), or
- ``png`` / ``jpg`` with ``as_image=``: the row encoded as an image (uint8
  rows of shape (H, W), (H, W, 1) or (H, W, 3); ``png`` also takes (H, W, 4)),

plus, with ``labels=``, ``cls`` (the label as an ASCII int) when the labels are a
1-D integer array, else ``label.npy`` (the label row as a ``.npy``).

How rows are read, and what a worker holds: :mod:`shardflow.convert.records.arraysource`.
Default chunk: :data:`DEFAULT_MEMORY_BYTES` of rows for all the workers together,
so that a conversion holds about that much row data whatever the worker count.

Order: by default the rows are written in a seeded shuffle (``order="shuffled"``,
:func:`~shardflow.convert.engine.mixorder.input_order`'s permutation of the row numbers), so that
an array stored class after class gives shards that mix the classes; ``order="walk"`` writes row
0, 1, 2, ... Keys stay the row numbers either way; ``meta`` records ``order`` and ``order_seed``.
Memory of the shuffle: the permutation, 8 bytes per row (24 while it is computed: 240 MB at 10
million rows), in this process; a worker reads a chunk's rows sorted and puts them back in order
(:meth:`~shardflow.convert.records.arraysource.RowReader.take`: the chunk, once). Reads
are row by row in random places: from a memory-mapped file the page cache serves them; an HDF5
chunk or a compressed ``.npz`` member is decompressed once per chunk of rows that touches it.

The source is a local file (memory mapping needs one). Re-running a conversion
keeps the finished shards when the source file (size and mtime), array, labels
and encoding are unchanged.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...codecs import encode_field
from ...errors import ConversionError
from ...format.manifest import Manifest
from .arraysource import ArraySpec, RowReader, inspect_array, split_source
from ..engine.engine import ConvertOptions, run_conversion
from ..engine.mixorder import DEFAULT_ORDER, check_order, input_order, order_meta

__all__ = ["ArraySpec", "RowReader", "convert_arrays", "default_chunk_rows", "default_max_count", "inspect_array",
           "IMAGE_FORMATS"]

log = logging.getLogger(__name__)

IMAGE_FORMATS = ("png", "jpg")
"""Values accepted for ``as_image``."""

DEFAULT_MEMORY_BYTES = 32 << 20
"""Bytes of rows the workers of a local conversion hold together when ``chunk_rows`` is not
given: each reads ``DEFAULT_MEMORY_BYTES / workers`` at once (a Dask worker, on a machine of its
own, the whole of it). A worker holds its chunk plus a fixed ~10 MiB (its imports, one shard's
tar buffers), so 2 workers converting 64 x 64 x 3 uint8 rows grow by ~90 MiB together, not the
~170 MiB that one 64 MiB chunk per worker gave (``tools/bench_arrays_memory.py``)."""

DEFAULT_SHARD_BYTES = 1 << 30
"""Raw row bytes per shard aimed at when no ``options`` are given."""

_KEY_WIDTH = 9


# ------------------------------------------------------------------ conversion


@dataclass(frozen=True)
class _Context:
    """What every worker needs to build its shards."""

    data: ArraySpec
    field: str
    labels: ArraySpec | None
    label_field: str | None
    chunk_rows: int


def _build(descriptors: list[tuple[str, int]], ctx: _Context) -> Iterator[tuple[str, dict[str, bytes]]]:
    """Worker: read this shard's rows chunk by chunk (``chunk_rows`` rows, in the order given)
    and encode one sample per row."""
    rows = [row for _, row in descriptors]
    with contextlib.ExitStack() as stack:
        data = stack.enter_context(RowReader(ctx.data))
        labels = stack.enter_context(RowReader(ctx.labels)) if ctx.labels is not None else None
        for at in range(0, len(rows), ctx.chunk_rows):
            part = rows[at : at + ctx.chunk_rows]
            block, where = data.take(part)  # row part[j] at block[where[j]]
            lab = labels.rows(part) if labels is not None else None
            for j, row in enumerate(part):
                key = f"{row:0{_KEY_WIDTH}d}"
                fields = {ctx.field: encode_field(key, ctx.field, block[where[j]])}
                if lab is not None and ctx.label_field is not None:
                    value = int(lab[j]) if ctx.label_field == "cls" else lab[j]
                    fields[ctx.label_field] = encode_field(key, ctx.label_field, value)
                yield key, fields
            del block, lab


def _check_image_rows(spec: ArraySpec, fmt: str) -> None:
    shape = spec.row_shape
    channels = (1, 3, 4) if fmt == "png" else (1, 3)
    ok = spec.dtype == np.uint8 and (len(shape) == 2 or (len(shape) == 3 and shape[2] in channels))
    if not ok:
        want = "(H, W), (H, W, 1), (H, W, 3)" + (" or (H, W, 4)" if fmt == "png" else "")
        raise ConversionError(
            f"{spec.describe()}: rows of dtype {spec.dtype} and shape {shape} cannot be stored as {fmt}: "
            f"uint8 rows of shape {want} are needed; store them as npy (drop --as)"
        )


def _labels_of(labels: str | os.PathLike, data: ArraySpec) -> tuple[ArraySpec, str]:
    """The labels' array and their field: ``cls`` for 1-D integers, else ``label.npy``.

    Raises:
        ConversionError: the labels have another row count than the data.
    """
    spec = _resolve_labels(labels, data)
    if spec.rows != data.rows:
        raise ConversionError(f"labels {spec.describe()} have {spec.rows} rows but {data.describe()} has {data.rows}")
    return spec, "cls" if (spec.dtype.kind in "iu" and len(spec.shape) == 1) else "label.npy"


def _meta(spec: ArraySpec, field: str, label_spec: ArraySpec | None, label_field: str | None) -> dict[str, Any]:
    """The manifest's ``meta`` of an arrays conversion (see :func:`convert_arrays`)."""
    return {
        "converter": "arrays",
        "source": spec.describe(),
        "array": spec.name,
        "dtype": _descr(spec.dtype),
        "row_shape": list(spec.row_shape),
        "rows": spec.rows,
        "field": field,
        "labels": None
        if label_spec is None
        else {
            "source": label_spec.describe(),
            "field": label_field,
            "dtype": _descr(label_spec.dtype),
            "row_shape": list(label_spec.row_shape),
        },
    }


def _resolve_labels(labels: str | os.PathLike, data: ArraySpec) -> ArraySpec:
    """A labels path (``file``, ``file:name``), or a name inside the data's own .npz/HDF5 file."""
    text = os.fspath(labels)
    try:
        path, _ = split_source(text)
    except FileNotFoundError:
        path = None
    if path is not None:
        return inspect_array(text)
    if data.kind in ("npz", "hdf5"):
        return inspect_array(data.path, text)
    raise FileNotFoundError(f"labels {text!r}: no such file (a name is looked up only inside .npz and HDF5 sources)")


def _fingerprint(*parts: Any) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(repr(p).encode("utf-8", "surrogateescape"))
        h.update(b"\0")
    return h.hexdigest()[:16]


def _file_state(spec: ArraySpec) -> tuple[Any, ...]:
    st = os.stat(spec.path)
    return (os.path.abspath(spec.path), spec.name, st.st_size, st.st_mtime_ns)


def _descr(dtype: np.dtype) -> Any:
    return np.lib.format.dtype_to_descr(dtype)


def default_chunk_rows(spec: ArraySpec, workers: int) -> int:
    """Rows a worker reads at once by default: :data:`DEFAULT_MEMORY_BYTES` shared by ``workers``
    (at least one row)."""
    return max(1, DEFAULT_MEMORY_BYTES // max(workers, 1) // max(spec.row_bytes, 1))


def default_max_count(spec: ArraySpec) -> int:
    """Rows per shard when none are given: 10,000, or fewer so that a shard holds about
    :data:`DEFAULT_SHARD_BYTES` of raw row data."""
    return max(1, min(10_000, DEFAULT_SHARD_BYTES // max(spec.row_bytes, 1)))


def convert_arrays(
    src: str | os.PathLike,
    dst: str,
    *,
    array: str | None = None,
    labels: str | os.PathLike | None = None,
    as_image: str | None = None,
    chunk_rows: int | None = None,
    options: ConvertOptions | None = None,
    progress: Callable[[int], None] | None = None,
    client: Any = None,
    order: str = DEFAULT_ORDER,
    seed: int = 0,
) -> Manifest:
    """Convert the rows of a ``.npy``, ``.npz`` or HDF5 array into shards, one sample per row.

    Sample ``i`` has key ``%09d % i`` and the field ``npy`` (row ``i`` with its
    exact dtype and shape) or, with ``as_image``, ``png``/``jpg``; with
    ``labels``, also ``cls`` (1-D integer labels) or ``label.npy`` (anything else).
    See the module docstring for how each kind of source is read.

    Args:
        src: a local ``.npy``, ``.npz`` or HDF5 file (kind found by magic
            bytes), or ``file.h5:group/dataset`` / ``file.npz:name``.
        dst: destination folder (local or fsspec URL).
        array: the ``.npz`` member or HDF5 dataset, if ``src`` does not name it
            and the file holds more than one.
        labels: per-row labels, ``labels[i]`` for row ``i``: a file path
            (``labels.npy``, ``y.h5:labels``) or the name of another array in
            the same ``.npz``/HDF5 file. Must have as many rows as the data.
        as_image: ``"png"`` (lossless) or ``"jpg"`` (lossy, quality 95): store
            uint8 rows of shape (H, W) or (H, W, 3) as images.
        chunk_rows: rows a worker reads and holds at once; default as many as
            fit in :data:`DEFAULT_MEMORY_BYTES` (32 MiB) divided by the number of
            local workers, at most one shard's.
        options: shard size, workers, resume, storage options. Default: shards of
            10,000 rows or fewer, about 1 GiB of raw row data at most.
        progress: ``progress(n)`` after every finished shard of ``n`` rows.
        client: a ``dask.distributed.Client``: write the shards as tasks on its
            cluster (its workers must reach the source and ``dst``); None: local
            processes.
        order, seed: ``"shuffled"`` (default: the rows in a seeded permutation, see the module
            docstring) or ``"walk"`` (row 0, 1, 2, ...).

    Returns:
        The manifest; its ``meta`` holds ``source``, ``array``, ``dtype`` (numpy
        descr), ``row_shape``, ``rows``, ``field``, ``labels``, ``order`` and ``order_seed``.

    Raises:
        FileNotFoundError: ``src`` or ``labels`` does not exist.
        ConversionError: see :func:`inspect_array`; labels whose row count
            differs from the data's; rows that cannot be stored as ``as_image``;
            a worker failed.
        ValueError: bad ``as_image``, ``chunk_rows`` or ``order``.
    """
    check_order(order)
    if as_image is not None and as_image not in IMAGE_FORMATS:
        raise ValueError(f"as_image must be one of {IMAGE_FORMATS} or None, got {as_image!r}")
    if chunk_rows is not None and chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    spec = inspect_array(src, array)
    field = as_image or "npy"
    if as_image is not None:
        _check_image_rows(spec, as_image)
    label_spec, label_field = _labels_of(labels, spec) if labels is not None else (None, None)
    if options is None:
        options = ConvertOptions(max_count=default_max_count(spec))
    workers = 1 if client is not None else options.workers or os.cpu_count() or 1
    chunk = min(chunk_rows or default_chunk_rows(spec, workers), options.max_count)
    if spec.kind == "npz" and spec.compressed:
        log.warning(
            "%s is a compressed .npz member: it cannot be memory-mapped, so each shard decompresses it from the "
            "start; for big arrays use .npy or HDF5",
            spec.describe(),
        )
    ctx = _Context(spec, field, label_spec, label_field, chunk)
    tag = _fingerprint(
        _file_state(spec), _descr(spec.dtype), spec.shape, field,
        None if label_spec is None else (_file_state(label_spec), _descr(label_spec.dtype), label_spec.shape),
    )  # fmt: skip
    meta = {**_meta(spec, field, label_spec, label_field), **order_meta(order, seed)}
    # one descriptor per row: a tag of the source and settings (so a resumed run never keeps
    # shards of another file or encoding) and the row number; rows are read in the workers
    numbers = range(spec.rows) if order == "walk" else input_order(spec.rows, int(seed))
    descriptors = ((tag, int(i)) for i in numbers)
    return run_conversion(
        dst, descriptors, _build, context=ctx, meta=meta, options=options, progress=progress, client=client
    )
