"""One shard being written: :class:`ShardFile`, the piece every writer and converter shares.

It writes a shard's tar bytes under a temporary name, with their sha256 and the
offset index, and makes them appear at the shard's name only when complete and
durable (see :func:`shardflow.storage.open_output`).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import posixpath
from collections.abc import Mapping, Sequence
from contextlib import ExitStack
from typing import Any, BinaryIO

from .. import storage
from ..errors import SampleError
from ..format.frames import FRAME_BYTES, FRAMES_SUFFIX, FrameWriter
from ..format.manifest import ShardInfo, encode_offsets
from ..format.tar import END_OF_ARCHIVE, sample_parts
from ..storage.urls import local_path

__all__ = ["ShardFile", "WRITE_CHUNK", "COMPRESSIONS"]

COMPRESSIONS = ("zstd",)
"""The ``compression`` a shard can be written with (None: a plain tar)."""

WRITE_CHUNK = 1 << 20  # bytes a shard buffers before writing, hashing and starting their writeback


class ShardFile:
    """One shard being written: tar bytes, sha256 and the offset index.

    Use as a context manager; the shard appears at ``url`` only if the block
    exits without an exception. :attr:`info` is set after a clean exit.

    Samples are gathered in a buffer and written, hashed and (local shards)
    handed to the kernel's writeback in chunks of :data:`WRITE_CHUNK` bytes, so
    that the fsync at the end waits for the last chunk only. A local shard, its
    offset index and its sizes index are each fsynced, then renamed to their names.

    Args:
        url: final shard URL (local path or fsspec URL).
        index_url: where to write the offset index ``.npy``, or None.
        io: how the shard is written (fsspec storage options, temporary files).
        sync_dir: fsync the local folder once after the last rename, so that all
            three are durable at their names when the block exits; False leaves
            that to the caller (a conversion fsyncs the folder before each record
            that lists new shards, once for many).
        staged: (local shards) leave the three files at temporary names, written
            but not fsynced nor renamed, listed in :attr:`staged` as ``(temporary,
            final path)`` for the caller to pass to
            :func:`~shardflow.storage.commit_staged` (a conversion's worker writes
            the next shard meanwhile; its parent commits them).
        compression: ``"zstd"``: the tar bytes are stored as independent zstd
            frames (see :mod:`shardflow.format.frames`), with a frame table
            ``<url>.frames.npy`` beside the offset index; None: a plain tar.
            Offsets, :attr:`size` and so ``max_bytes`` count tar bytes; the
            manifest's ``bytes`` and ``sha256`` are those of the stored file.

    Raises:
        ValueError: an unknown ``compression``.
        ImportError: ``"zstd"`` without the ``zstandard`` package.
    """

    def __init__(self, url: str, index_url: str | None = None, io: storage.IOOptions | None = None,
                 *, sync_dir: bool = True, staged: bool = False, compression: str | None = None) -> None:  # fmt: skip
        self.check_compression(compression)
        self.compression = compression
        self._frames = FrameWriter(url) if compression == "zstd" else None
        self._stored = 0  # bytes in the shard's file (the compressed ones when compressing)
        self.url = url
        self.index_url = index_url
        self.io = io or storage.IOOptions()
        self.offsets: list[int] = []
        self.keys: set[str] = set()
        self.fields: set[str] = set()
        self.sizes: list[tuple[int, ...]] = []
        self.size = 0
        self.info: ShardInfo | None = None
        self._sha = hashlib.sha256()
        self._stack = ExitStack()
        self._out: BinaryIO | None = None
        self._local = storage.is_local(url)
        self._sync_dir = sync_dir and self._local
        self._staging = staged and self._local
        self.staged: list[tuple[str, str]] = []
        # the pieces written since the last chunk (joined once per chunk: a growing bytearray
        # was reallocated ~100 times per shard) and their size
        self._parts: list[bytes] = []
        self._buffered = 0
        self._written = 0  # bytes handed to the file (the rest of ``size`` is in the buffer)

    @staticmethod
    def check_compression(compression: str | None) -> None:
        """Raise ``ValueError`` unless ``compression`` is None or one of :data:`COMPRESSIONS`."""
        if compression not in (None, *COMPRESSIONS):
            raise ValueError(f"compression must be None or one of {list(COMPRESSIONS)}, got {compression!r}")

    def __enter__(self) -> ShardFile:
        if self._staging:
            self._out, tmp = self._stack.enter_context(storage.open_staged(local_path(self.url)))
            self.staged.append((tmp, local_path(self.url)))
        else:
            self._out = self._stack.enter_context(storage.open_output(self.url, self.io, sync_dir=False))
        return self

    def _write_file(self, url: str, data: bytes) -> None:
        """A small file beside the shard (an index), written as the shard is."""
        if self._staging:
            with storage.open_staged(local_path(url)) as (f, tmp):
                f.write(data)
            self.staged.append((tmp, local_path(url)))
        else:
            with storage.open_output(url, self.io, sync_dir=False) as f:
                f.write(data)

    def write(self, key: str, fields: Mapping[str, bytes], sizes: Sequence[int] | None = None) -> int:
        """Append one encoded sample; returns its size in bytes.

        Args:
            key: the sample key.
            fields: field name -> encoded bytes.
            sizes: the sample's row of the sizes index (e.g. ``(num_nodes,
                num_edges)``); samples written without one (not graphs) get
                zeros if other samples of the shard have one.

        Raises:
            SampleError: the key was already written to this shard, or a sizes
                row's length differs from the shard's.
            ValueError: written outside the with-block.
        """
        if self._out is None:
            raise ValueError(f"{self.url}: ShardFile written outside its with-block")
        if key in self.keys:
            raise SampleError(f"{self.url}: key {key!r} written twice to the same shard")
        parts = sample_parts(key, fields)  # first: a sample that cannot be encoded changes nothing
        if sizes is not None:
            row = tuple(int(v) for v in sizes)
            if self.sizes and len(row) != len(self.sizes[0]):
                raise SampleError(f"{self.url}: sample {key!r}: sizes row {row} has another length than the shard's")
            if not self.sizes and self.offsets:  # earlier samples had none (not graphs): size 0
                self.sizes = [(0,) * len(row)] * len(self.offsets)
            self.sizes.append(row)
        elif self.sizes:
            self.sizes.append((0,) * len(self.sizes[0]))
        self.keys.add(key)
        start = self.size
        whole = sum(map(len, parts))
        if whole < WRITE_CHUNK or max(map(len, fields.values()), default=0) < WRITE_CHUNK:
            self._parts += parts
            self._buffered += whole
        else:
            for part in parts:
                if len(part) < WRITE_CHUNK:
                    self._parts.append(part)
                    self._buffered += len(part)
                else:  # a large payload goes to the file as it is, not through the buffer
                    self._flush()
                    self._emit(part)
        self.offsets.append(start)
        self.size = self._written + self._buffered
        if self._frames is not None:
            if self._buffered + self._frames.held >= FRAME_BYTES:  # a frame ends between samples
                self._flush()
                self._store(self._frames.sample_end())
        elif self._buffered >= WRITE_CHUNK:
            self._flush()
        self.fields.update(fields)
        return self.size - start

    def _close(self, exc_type: Any, exc: Any, tb: Any) -> None:
        try:
            self._stack.__exit__(exc_type, exc, tb)
        finally:
            self._out = None
            self._parts = []

    def _flush(self) -> None:
        if self._parts:
            data = b"".join(self._parts)
            self._parts.clear()
            self._buffered = 0
            self._emit(data)

    def _emit(self, data: bytes) -> None:
        self._store(data if self._frames is None else self._frames.add(data))
        self._written += len(data)

    def _store(self, data: bytes) -> None:
        if not data:
            return
        self._out.write(data)  # type: ignore[union-attr]
        self._sha.update(data)
        if self._local:
            storage.start_writeback(self._out, self._stored, len(data))  # type: ignore[arg-type]
        self._stored += len(data)

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            end = self.size
            try:
                self._parts.append(END_OF_ARCHIVE)
                self._flush()
                if self._frames is not None:
                    self._store(self._frames.finish())
            except BaseException as e:
                self._close(type(e), e, e.__traceback__)  # nothing appears at the shard's name
                self.staged.clear()
                raise
            self.size = self._written
        self._close(exc_type, exc, tb)
        if exc_type is not None:
            self.staged.clear()  # the temporary was removed with the block's failure
            return
        index_rel = sizes_rel = frames_rel = None
        try:
            if self.index_url is not None:
                self._write_file(self.index_url, encode_offsets([*self.offsets, end]))
                index_rel = posixpath.basename(self.index_url)
                if self._frames is not None:  # the index's tar offsets are found through it
                    self._write_file(self.url + FRAMES_SUFFIX, self._frames.table.encode())
                    frames_rel = posixpath.basename(self.url) + FRAMES_SUFFIX
            if self.sizes:
                self._write_file(self.url + ".sizes.npy", encode_offsets(self.sizes))
                sizes_rel = posixpath.basename(self.url) + ".sizes.npy"
        except BaseException:
            for tmp, _ in self.staged:  # no half-staged shard left behind
                with contextlib.suppress(FileNotFoundError):
                    os.remove(tmp)
            self.staged.clear()
            raise
        if self._sync_dir and not self._staging:  # one fsync of the folder: the renames of all three durable
            storage.sync_directory(os.path.dirname(os.path.abspath(local_path(self.url))))
        self.info = ShardInfo(
            url=posixpath.basename(self.url),
            samples=len(self.offsets),
            bytes=self._stored,
            sha256=self._sha.hexdigest(),
            index=index_rel,
            sizes=sizes_rel,
            compression=self.compression,
            frames=frames_rel,
        )
