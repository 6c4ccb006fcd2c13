"""Arrays for ``convert arrays``: finding one in a ``.npy``, ``.npz`` or HDF5 file
(:func:`inspect_array`) and reading its rows chunk by chunk (:class:`RowReader`).

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

Rows in any order (:meth:`RowReader.take`, a shuffled conversion's chunk): sorted first, then
taken through a fresh map per :data:`_MAP_PIECE` bytes of rows (``.npy``, stored ``.npz``), or
read run by run of consecutive rows in ascending order (HDF5: one ``read_direct`` per run; a
compressed ``.npz`` member: one forward pass over the member per chunk). They stay sorted, with
where each asked row is, so memory holds the chunk once, as for a range.
"""

from __future__ import annotations

import contextlib
import logging
import os
import struct
import zipfile
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...errors import ConversionError, missing_dependency
from ...format.npy import read_header

__all__ = ["ArraySpec", "RowReader", "inspect_array", "split_source"]

log = logging.getLogger(__name__)

_NPY_MAGIC = b"\x93NUMPY"
_ZIP_MAGICS = (b"PK\x03\x04", b"PK\x05\x06")
_HDF5_MAGIC = b"\x89HDF\r\n\x1a\n"
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


def split_source(src: str) -> tuple[str, str | None]:
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
        shape, fortran, dtype = read_header(f)
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
    path, name = split_source(os.fspath(src))
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

    def rows(self, rows: list[int]) -> np.ndarray:
        """Rows ``rows`` (any order, no repeats) as one C-contiguous array, in that order:
        shape ``(len(rows), *row_shape)`` (a copy of :meth:`take`'s block).

        Raises:
            IndexError: a row outside the array.
        """
        block, where = self.take(rows)
        return np.ascontiguousarray(block[where])

    def take(self, rows: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """Rows ``rows`` (any order, no repeats) read in ascending order: ``(block, where)``,
        ``block`` C-contiguous of shape ``(len(rows), *row_shape)``, row ``rows[j]`` at
        ``block[where[j]]`` (``where`` int64, shape ``(len(rows),)``).

        Raises:
            IndexError: a row outside the array.
        """
        n = len(rows)
        if n and rows[-1] - rows[0] == n - 1 and all(b == a + 1 for a, b in zip(rows, rows[1:])):
            return self.read(rows[0], rows[-1] + 1), np.arange(n, dtype=np.int64)  # consecutive: one range
        want = np.asarray(rows, dtype=np.int64)
        by_row = np.argsort(want, kind="stable")
        ordered = want[by_row]
        if n and (ordered[0] < 0 or ordered[-1] >= self.spec.rows):
            raise IndexError(f"{self.spec.describe()}: rows {rows[:5]}... outside 0..{self.spec.rows}")
        where = np.empty(n, dtype=np.int64)
        where[by_row] = np.arange(n, dtype=np.int64)
        if not n:
            return np.empty((0, *self.spec.row_shape), dtype=self.spec.dtype), where
        if self.spec.kind == "npy" or (self.spec.kind == "npz" and not self.spec.compressed):
            return (self._take_mapped(ordered) if self.spec.fortran else self._take_read(ordered)), where
        out = np.empty((n, *self.spec.row_shape), dtype=self.spec.dtype)
        at = 0
        for run in np.split(ordered, np.flatnonzero(np.diff(ordered) != 1) + 1):
            out[at : at + len(run)] = self.read(int(run[0]), int(run[-1]) + 1)
            at += len(run)
        return out, where

    def _take_read(self, ordered: np.ndarray) -> np.ndarray:
        """Sorted rows of a C-ordered ``.npy`` or stored ``.npz`` member, each run of consecutive
        rows read with one ``preadv`` straight into the block: no mapped pages to count (a map
        would fault in pages around every scattered row)."""
        spec = self.spec
        out = np.empty((len(ordered), *spec.row_shape), dtype=spec.dtype)
        row = spec.row_bytes
        if not row:
            return out
        raw = out.reshape(-1).view(np.uint8)
        with open(spec.path, "rb", buffering=0) as f:
            offset = spec.offset
            if spec.kind == "npy":
                _npy_header(f, spec.describe())
                offset = f.tell()
            at = 0
            for run in np.split(ordered, np.flatnonzero(np.diff(ordered) != 1) + 1):
                view, pos = memoryview(raw[at * row : (at + len(run)) * row]), offset + int(run[0]) * row
                while len(view):
                    got = os.preadv(f.fileno(), [view], pos)
                    if not got:
                        raise ConversionError(f"{spec.describe()}: the file ends inside row {int(run[0])}")
                    view, pos = view[got:], pos + got
                at += len(run)
        return out

    def _take_mapped(self, ordered: np.ndarray) -> np.ndarray:
        """Sorted rows copied out of a fresh memory map per :data:`_MAP_PIECE` bytes of them."""
        spec = self.spec
        out = np.empty((len(ordered), *spec.row_shape), dtype=spec.dtype)
        step = max(1, _MAP_PIECE // max(spec.row_bytes, 1))
        for a in range(0, len(ordered), step):
            mm = self._map()
            try:
                out[a : a + step] = mm[ordered[a : a + step]]
            finally:
                base = getattr(mm, "_mmap", None)
                del mm
                self._close(base)
        return out

    def _map(self) -> np.ndarray:
        spec = self.spec
        if spec.kind == "npy":
            return np.load(spec.path, mmap_mode="r", allow_pickle=False)
        return np.memmap(spec.path, dtype=spec.dtype, mode="r", offset=spec.offset, shape=spec.shape,
                         order="F" if spec.fortran else "C")  # fmt: skip

    @staticmethod
    def _close(base: Any) -> None:
        """Close a map's ``mmap`` (its array dropped first: a view still alive keeps it mapped)."""
        if base is not None:
            with contextlib.suppress(BufferError):
                base.close()

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
            mm = self._map()
            try:
                out[a - start : b - start] = mm[a:b]
            finally:
                base = getattr(mm, "_mmap", None)
                del mm
                self._close(base)
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
