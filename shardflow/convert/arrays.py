"""``convert arrays``: one sample per row of a ``.npy``, ``.npz`` or HDF5 array.

Row ``i`` of the chosen array becomes the sample with key ``%09d % i``
(``000000042``; wider past 999,999,999 rows) and the field

- ``npy``: the row as a ``.npy`` (exact dtype and shape, no pickle), or
- ``png`` / ``jpg`` with ``as_image=``: the row encoded as an image (uint8
  rows of shape (H, W), (H, W, 1) or (H, W, 3); ``png`` also takes (H, W, 4)),

plus, with ``labels=``, ``cls`` (the label as an ASCII int) when the labels are a
1-D integer array, else ``label.npy`` (the label row as a ``.npy``).

Memory. The descriptors streamed to the conversion engine are row numbers,
never row data: each worker opens the source itself and reads its shard's rows
``chunk_rows`` at a time, so a worker holds about one chunk of rows whatever
the source size. How rows are read, per source:

- ``.npy``: ``np.load(path, mmap_mode="r")``, the rows copied out 4 MiB at a
  time, each piece through a fresh map that is closed at once (mapped pages
  that were read count in the resident set until they are unmapped).
- ``.npz`` members stored without compression (``np.savez``): memory-mapped at
  their offset inside the zip, like a ``.npy``.
- ``.npz`` members stored compressed (``np.savez_compressed``) cannot be
  memory-mapped: rows are read by decompressing the member as a stream, so every
  shard decompresses the member from its start up to its own rows (CPU time
  grows with the square of the member size; memory stays at one chunk).
  ``np.load(file.npz)[name]`` would read the whole member into memory; for big
  data prefer ``.npy`` or HDF5. A compressed Fortran-ordered member is read whole.
- HDF5 (``h5py``, the ``hdf5`` extra): rows ``[start, stop)`` read per chunk
  straight into the chunk's array (``Dataset.read_direct``), so only the HDF5
  chunks that hold those rows are read and decompressed.

The source is a local file (memory mapping needs one). Re-running a conversion
keeps the finished shards when the source file (size and mtime), array, labels
and encoding are unchanged.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import struct
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..codecs import encode_field
from ..compat.numpy import read_array_header
from ..errors import ConversionError, missing_dependency
from ..format.manifest import Manifest
from .engine import ConvertOptions, run_conversion

__all__ = ["ArraySpec", "convert_arrays", "default_max_count", "inspect_array", "IMAGE_FORMATS"]

log = logging.getLogger(__name__)

IMAGE_FORMATS = ("png", "jpg")
"""Values accepted for ``as_image``."""

DEFAULT_CHUNK_BYTES = 64 << 20
"""Bytes of rows a worker reads at once when ``chunk_rows`` is not given."""

DEFAULT_SHARD_BYTES = 1 << 30
"""Raw row bytes per shard aimed at when no ``options`` are given."""

_NPY_MAGIC = b"\x93NUMPY"
_ZIP_MAGICS = (b"PK\x03\x04", b"PK\x05\x06")
_HDF5_MAGIC = b"\x89HDF\r\n\x1a\n"
_KEY_WIDTH = 9
_SKIP_PIECE = 16 << 20  # bytes discarded per read when skipping inside a compressed member
_MAP_PIECE = 4 << 20  # bytes copied per memory map when reading rows of a .npy / stored .npz member


@dataclass(frozen=True)
class ArraySpec:
    """Where an array lives and what it holds (picklable; sent to workers).

    Attributes:
        kind: ``"npy"``, ``"npz"`` or ``"hdf5"``.
        path: the local file.
        name: the ``.npz`` member (without ``.npy``) or HDF5 dataset path; None for ``.npy``.
        shape: the whole array's shape; rows are ``shape[0]``.
        dtype: the element dtype.
        fortran: stored in Fortran (column-major) order.
        offset: for an uncompressed ``.npz`` member, the byte offset of its data
            in the zip file (-1 otherwise).
        compressed: an ``.npz`` member stored compressed.
    """

    kind: str
    path: str
    name: str | None
    shape: tuple[int, ...]
    dtype: np.dtype
    fortran: bool = False
    offset: int = -1
    compressed: bool = False

    @property
    def rows(self) -> int:
        return self.shape[0]

    @property
    def row_shape(self) -> tuple[int, ...]:
        return self.shape[1:]

    @property
    def row_bytes(self) -> int:
        return int(np.prod(self.row_shape, dtype=np.int64)) * self.dtype.itemsize

    def describe(self) -> str:
        """``path`` or ``path:name``, as given on the command line."""
        return self.path if self.name is None else f"{self.path}:{self.name}"


# ------------------------------------------------------------------ finding arrays


def _sniff(path: str) -> str:
    """The container kind of a local file, from its magic bytes."""
    with open(path, "rb") as f:
        head = f.read(8)
        if head.startswith(_NPY_MAGIC):
            return "npy"
        if head[:4] in _ZIP_MAGICS:
            return "npz"
        # HDF5's signature is at 0 or, after a user block, at 512, 1024, 2048, ...
        pos = 0
        while True:
            if head == _HDF5_MAGIC:
                return "hdf5"
            pos = 512 if pos == 0 else pos * 2
            f.seek(pos)
            head = f.read(8)
            if len(head) < 8:
                break
    raise ConversionError(f"{path}: not a .npy, .npz or HDF5 file (unknown magic bytes)")


def _split_source(src: str) -> tuple[str, str | None]:
    """``file.h5:group/data`` -> (``file.h5``, ``group/data``); plain files pass through."""
    if os.path.isfile(src):
        return src, None
    path, sep, name = src.rpartition(":")
    if sep and path and os.path.isfile(path):
        return path, name or None
    if "://" in src:
        raise ConversionError(f"{src}: convert arrays reads local files only (memory mapping needs one); copy it locally first")
    raise FileNotFoundError(f"{src}: no such file")


def _check_dtype(where: str, dtype: np.dtype) -> np.dtype:
    if dtype.hasobject:
        raise ConversionError(
            f"{where}: dtype {dtype} holds Python objects (variable-length strings?), which cannot be stored "
            "without pickle; convert them to a fixed-size dtype first"
        )
    return dtype


def _npy_header(f: Any, where: str) -> tuple[tuple[int, ...], bool, np.dtype]:
    """Read a .npy header from a file object; returns (shape, fortran_order, dtype)."""
    try:
        shape, fortran, dtype = read_array_header(f, np.lib.format.read_magic(f))
    except ValueError as e:
        raise ConversionError(f"{where}: not a valid .npy: {e}") from e
    return tuple(int(x) for x in shape), bool(fortran), np.dtype(dtype)


def _inspect_npy(path: str) -> ArraySpec:
    with open(path, "rb") as f:
        shape, fortran, dtype = _npy_header(f, path)
    return ArraySpec("npy", path, None, shape, dtype, fortran)


def _inspect_npz(path: str, name: str | None) -> ArraySpec:
    with zipfile.ZipFile(path) as zf:
        members = [n[: -len(".npy")] for n in zf.namelist() if n.endswith(".npy")]
        if name is None:
            if len(members) != 1:
                raise ConversionError(f"{path}: holds the arrays {members}; choose one with --array NAME (array=)")
            name = members[0]
        if name not in members:
            raise ConversionError(f"{path}: no array {name!r}; it holds {members}")
        info = zf.getinfo(name + ".npy")
        where = f"{path}:{name}"
        with zf.open(info) as member:
            shape, fortran, dtype = _npy_header(member, where)
            header_len = member.tell()
    compressed = info.compress_type != zipfile.ZIP_STORED
    offset = -1
    if not compressed:
        with open(path, "rb") as f:  # the local file header: 30 bytes, then name and extra field
            f.seek(info.header_offset)
            local = f.read(30)
            if local[:4] != b"PK\x03\x04":
                raise ConversionError(f"{where}: corrupt zip local header")
            name_len, extra_len = struct.unpack("<HH", local[26:30])
            offset = info.header_offset + 30 + name_len + extra_len + header_len
    return ArraySpec("npz", path, name, shape, dtype, fortran, offset, compressed)


def _h5py() -> Any:
    try:
        import h5py
    except ImportError as e:
        raise missing_dependency("h5py", "hdf5", "converting HDF5 arrays") from e
    return h5py


def _inspect_hdf5(path: str, name: str | None) -> ArraySpec:
    h5py = _h5py()
    with h5py.File(path, "r") as f:
        datasets: list[str] = []
        f.visititems(lambda n, obj: datasets.append(n) if isinstance(obj, h5py.Dataset) else None)
        if name is None:
            if len(datasets) != 1:
                raise ConversionError(
                    f"{path}: holds the datasets {datasets}; choose one with {path}:NAME or --array NAME (array=)"
                )
            name = datasets[0]
        name = name.strip("/")
        obj = f.get(name)
        if not isinstance(obj, h5py.Dataset):
            raise ConversionError(f"{path}: no dataset {name!r}; it holds {datasets}")
        return ArraySpec("hdf5", path, name, tuple(int(x) for x in obj.shape), np.dtype(obj.dtype))


def inspect_array(src: str | os.PathLike, array: str | None = None) -> ArraySpec:
    """Find an array and read its shape and dtype (no row data is read).

    Args:
        src: a ``.npy``, ``.npz`` or HDF5 file (kind found by magic bytes), or
            ``file.h5:group/dataset`` / ``file.npz:name``.
        array: the ``.npz`` member or HDF5 dataset (instead of ``:name``); may be
            omitted when the file holds exactly one.

    Raises:
        FileNotFoundError: no such file.
        ConversionError: unknown file kind, ambiguous or missing array, an
            object dtype, or a 0-d array (no rows).
        ImportError: an HDF5 file without ``h5py`` installed.
    """
    path, name = _split_source(os.fspath(src))
    if name is not None and array is not None and name.strip("/") != array.strip("/"):
        raise ConversionError(f"{src}: names the array {name!r} but array={array!r} was also given")
    name = name if name is not None else array
    kind = _sniff(path)
    if kind == "npy":
        if name is not None:
            raise ConversionError(f"{path}: a .npy holds one array; drop --array/:{name}")
        spec = _inspect_npy(path)
    elif kind == "npz":
        spec = _inspect_npz(path, name)
    else:
        spec = _inspect_hdf5(path, name)
    _check_dtype(spec.describe(), spec.dtype)
    if not spec.shape:
        raise ConversionError(f"{spec.describe()}: a 0-d array has no rows to turn into samples")
    return spec


# ------------------------------------------------------------------ reading rows


class RowReader:
    """Reads row ranges of an :class:`ArraySpec` in a worker; use as a context manager.

    :meth:`read` returns a C-contiguous copy of rows ``[start, stop)`` with the
    array's dtype, shape ``(stop - start, *row_shape)``. Nothing of earlier
    chunks stays mapped or buffered.
    """

    def __init__(self, spec: ArraySpec) -> None:
        self.spec = spec
        self._h5: Any = None
        self._stream: Any = None  # (zipfile, member file, next row) for compressed npz members
        self._whole: np.ndarray | None = None

    def __enter__(self) -> RowReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._h5 is not None:
            self._h5.close()
            self._h5 = None
        self._close_stream()
        self._whole = None

    def _close_stream(self) -> None:
        if self._stream is not None:
            zf, member, _ = self._stream
            member.close()
            zf.close()
            self._stream = None

    def read(self, start: int, stop: int) -> np.ndarray:
        spec = self.spec
        if not 0 <= start <= stop <= spec.rows:
            raise IndexError(f"{spec.describe()}: rows [{start}, {stop}) outside 0..{spec.rows}")
        if stop == start:
            return np.empty((0, *spec.row_shape), dtype=spec.dtype)
        if spec.kind == "hdf5":
            if self._h5 is None:
                self._h5 = _h5py().File(spec.path, "r")
            out = np.empty((stop - start, *spec.row_shape), dtype=spec.dtype)
            self._h5[spec.name].read_direct(out, np.s_[start:stop], np.s_[0 : stop - start])
            return out
        if spec.kind == "npy" or not spec.compressed:
            return self._read_mapped(start, stop)
        if spec.fortran:
            return self._read_whole(start, stop)
        return self._read_stream(start, stop)

    def _read_mapped(self, start: int, stop: int) -> np.ndarray:
        """Copy rows out of a fresh memory map per piece of :data:`_MAP_PIECE` bytes.

        Pages of a file mapping that were read count in the resident set until
        the mapping is closed, so mapping the whole chunk at once would hold the
        chunk twice (the copy and the mapped pages); piece by piece it is held
        once plus one piece.
        """
        spec = self.spec
        out = np.empty((stop - start, *spec.row_shape), dtype=spec.dtype)
        step = max(1, _MAP_PIECE // max(spec.row_bytes, 1))
        for a in range(start, stop, step):
            b = min(stop, a + step)
            if spec.kind == "npy":
                mm = np.load(spec.path, mmap_mode="r", allow_pickle=False)
            else:
                mm = np.memmap(spec.path, dtype=spec.dtype, mode="r", offset=spec.offset, shape=spec.shape,
                               order="F" if spec.fortran else "C")
            try:
                out[a - start : b - start] = mm[a:b]
            finally:
                base = getattr(mm, "_mmap", None)
                del mm
                if base is not None:
                    with contextlib.suppress(BufferError):  # a view still alive keeps it mapped
                        base.close()
        return out

    def _read_whole(self, start: int, stop: int) -> np.ndarray:
        if self._whole is None:
            log.warning("%s: compressed Fortran-ordered .npz member: reading it whole into memory", self.spec.describe())
            with np.load(self.spec.path, allow_pickle=False) as z:
                self._whole = z[self.spec.name]
        return np.ascontiguousarray(self._whole[start:stop])

    def _read_stream(self, start: int, stop: int) -> np.ndarray:
        spec = self.spec
        row = spec.row_bytes
        if self._stream is None or self._stream[2] > start:
            self._close_stream()
            zf = zipfile.ZipFile(spec.path)
            member = zf.open(spec.name + ".npy")
            _npy_header(member, spec.describe())
            self._stream = (zf, member, 0)
        zf, member, at = self._stream
        skip = (start - at) * row
        while skip:
            got = len(member.read(min(skip, _SKIP_PIECE)))
            if not got:
                raise ConversionError(f"{spec.describe()}: member ends before row {start}")
            skip -= got
        out = np.empty((stop - start, *spec.row_shape), dtype=spec.dtype)
        view = memoryview(out.reshape(-1).view(np.uint8)) if out.size else memoryview(b"")
        filled = 0
        while filled < len(view):
            got = member.readinto(view[filled:])
            if not got:
                raise ConversionError(f"{spec.describe()}: member ends inside row {start + filled // max(row, 1)}")
            filled += got
        self._stream = (zf, member, stop)
        return out


# ------------------------------------------------------------------ conversion


@dataclass(frozen=True)
class _Context:
    """What every worker needs to build its shards."""

    data: ArraySpec
    field: str
    labels: ArraySpec | None
    label_field: str | None
    chunk_rows: int


def _runs(rows: list[int], chunk: int) -> Iterator[tuple[int, int]]:
    """Cut row numbers into ``[start, stop)`` runs of consecutive rows, each at most ``chunk`` long."""
    i = 0
    while i < len(rows):
        start = rows[i]
        j = i + 1
        while j < len(rows) and j - i < chunk and rows[j] == start + (j - i):
            j += 1
        yield start, start + (j - i)
        i = j


def _build(descriptors: list[tuple[str, int]], ctx: _Context) -> Iterator[tuple[str, dict[str, bytes]]]:
    """Worker: read this shard's rows chunk by chunk and encode one sample per row."""
    rows = [row for _, row in descriptors]
    with contextlib.ExitStack() as stack:
        data = stack.enter_context(RowReader(ctx.data))
        labels = stack.enter_context(RowReader(ctx.labels)) if ctx.labels is not None else None
        for start, stop in _runs(rows, ctx.chunk_rows):
            block = data.read(start, stop)
            lab = labels.read(start, stop) if labels is not None else None
            for j in range(stop - start):
                key = f"{start + j:0{_KEY_WIDTH}d}"
                fields = {ctx.field: encode_field(key, ctx.field, block[j])}
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


def _resolve_labels(labels: str | os.PathLike, data: ArraySpec) -> ArraySpec:
    """A labels path (``file``, ``file:name``), or a name inside the data's own .npz/HDF5 file."""
    text = os.fspath(labels)
    try:
        path, _ = _split_source(text)
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
            fit in 64 MiB (:data:`DEFAULT_CHUNK_BYTES`), at most one shard's.
        options: shard size, workers, resume, storage options. Default: shards of
            10,000 rows or fewer, about 1 GiB of raw row data at most.
        progress: ``progress(n)`` after every finished shard of ``n`` rows.
        client: a ``dask.distributed.Client``: write the shards as tasks on its
            cluster (its workers must reach the source and ``dst``); None: local
            processes.

    Returns:
        The manifest; its ``meta`` holds ``source``, ``array``, ``dtype`` (numpy
        descr), ``row_shape``, ``rows``, ``field`` and ``labels``.

    Raises:
        FileNotFoundError: ``src`` or ``labels`` does not exist.
        ConversionError: see :func:`inspect_array`; labels whose row count
            differs from the data's; rows that cannot be stored as ``as_image``;
            a worker failed.
        ValueError: bad ``as_image`` or ``chunk_rows``.
    """
    if as_image is not None and as_image not in IMAGE_FORMATS:
        raise ValueError(f"as_image must be one of {IMAGE_FORMATS} or None, got {as_image!r}")
    if chunk_rows is not None and chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    spec = inspect_array(src, array)
    field = as_image or "npy"
    if as_image is not None:
        _check_image_rows(spec, as_image)
    label_spec = label_field = None
    if labels is not None:
        label_spec = _resolve_labels(labels, spec)
        if label_spec.rows != spec.rows:
            raise ConversionError(
                f"labels {label_spec.describe()} have {label_spec.rows} rows but {spec.describe()} has {spec.rows}"
            )
        label_field = "cls" if (label_spec.dtype.kind in "iu" and len(label_spec.shape) == 1) else "label.npy"
    row_bytes = max(spec.row_bytes, 1)
    if options is None:
        options = ConvertOptions(max_count=default_max_count(spec))
    chunk = chunk_rows or max(1, DEFAULT_CHUNK_BYTES // row_bytes)
    chunk = min(chunk, options.max_count)
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
    meta = {
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
    # one descriptor per row: a tag of the source and settings (so a resumed run never keeps
    # shards of another file or encoding) and the row number; rows are read in the workers
    descriptors = ((tag, i) for i in range(spec.rows))
    return run_conversion(
        dst, descriptors, _build, context=ctx, meta=meta, options=options, progress=progress, client=client
    )
