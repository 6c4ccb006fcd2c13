"""Checked layouts of local shards, kept in the process for the next pass over the same file.

The bulk walk (:mod:`.spans`) checks every header of a buffer (sizes, checksums,
names, samples' adjacency) and finds where each sample's fields lie. Those checks
depend only on the buffer's bytes, where they lie in the file, and the walk's
arguments. A second pass over a file that has not changed since (same device,
inode, size, mtime and ctime, as ``fstat`` of the open file reports them at open)
reads the same bytes at the same offsets: its buffers take the layout found
before (:class:`.spans.SampleRun`) and skip the header checks. The payloads are
still read from the file: a sample's bytes are always the bytes read now.

A file written since gets a new ctime (writes, truncation, ``utime``, a rename
over it all set it; no call sets it back), so its layout is checked again. A
timestamp is only as fine as the filesystem's clock: a file whose ctime is less
than :data:`SETTLED_NS` before the open may still change within the same tick, so
its layout is not kept (git's "racily clean" entries, the same care). What the
file holds while it is being read is not covered (nor is it without the cache: a
file rewritten under a reader gives a mix of both versions).

Only local files are kept (their identity says ``dev`` and ``ctime``), at most
:data:`MAX_SAMPLES` samples for the whole process, the files used longest ago
dropped first. ``SHARDFLOW_FAST_PATHS=0`` turns it off with the bulk walk.
"""

from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import numpy as np

from . import spans
from .spans import SampleRun

__all__ = ["Layouts", "MAX_SAMPLES", "SETTLED_NS", "clear", "held"]

MAX_SAMPLES = 1 << 16
"""The most samples whose layouts the process keeps (~320 bytes each: keys, offsets; ~20 MiB in all)."""

SETTLED_NS = 2_000_000_000
"""How long before the open a file's ctime must lie for its layout to be kept, in ns: more
than a coarse filesystem clock's tick, so that no later change can leave the ctime as it was."""

_VERSION = ("dev", "ino", "size", "mtime", "ctime")  # the identity keys of a local file (storage.readers.local)


class _File:
    """The layouts kept for one version of one file: walk arguments -> :class:`SampleRun` (no buffer)."""

    __slots__ = ("version", "runs", "starts", "samples")

    def __init__(self, version: tuple[str, ...]) -> None:
        self.version = version
        self.runs: dict[tuple[Any, ...], SampleRun] = {}
        self.starts: np.ndarray | None = None  # the offset index the runs were walked with
        self.samples = 0


_lock = threading.Lock()
_files: OrderedDict[tuple[str, str], _File] = OrderedDict()  # (dev, ino) -> its last version's layouts
_held = 0  # samples kept, all files together


def _reset_lock() -> None:
    global _lock
    _lock = threading.Lock()  # a child forked while another thread held it


os.register_at_fork(after_in_child=_reset_lock)


def held() -> int:
    """How many samples' layouts the process keeps now."""
    return _held


def clear() -> None:
    """Drop every kept layout."""
    global _held
    with _lock:
        _files.clear()
        _held = 0


def _bind(identity: Mapping[str, str]) -> _File | None:
    """The layouts of the file version ``identity`` describes (made empty when it is new), or
    None when it cannot be kept: not a local file's identity, or a ctime too recent."""
    if any(k not in identity for k in _VERSION):
        return None
    version = tuple(identity[k] for k in _VERSION)
    try:
        ctime = int(identity["ctime"])
    except ValueError:
        return None
    if ctime > time.time_ns() - SETTLED_NS:
        return None
    name = version[:2]
    global _held
    with _lock:
        kept = _files.get(name)
        if kept is not None and kept.version != version:  # changed since: its old layouts go
            _held -= kept.samples
            del _files[name]
            kept = None
        if kept is None:
            kept = _files[name] = _File(version)
        _files.move_to_end(name)
        return kept


def _keep(file: _File, key: tuple[Any, ...], run: SampleRun) -> None:
    """Keep ``run``'s layout (without its buffer), dropping the files used longest ago beyond
    :data:`MAX_SAMPLES`."""
    global _held
    n = len(run.keys)
    with _lock:
        if _files.get(file.version[:2]) is not file or key in file.runs:
            return  # dropped meanwhile (or kept by another stream of the same file)
        file.runs[key] = run.on(b"")
        file.samples += n
        _held += n
        while _held > MAX_SAMPLES and _files:
            _, old = _files.popitem(last=False)
            _held -= old.samples


class Layouts:
    """One stream's access to the kept layouts of the file it reads.

    Made before the stream opens; :meth:`opened` (the storage layer's ``opened``
    callback) binds it to the file's version. :meth:`bulk_members` is
    :func:`.spans.bulk_members` with the layouts kept.
    """

    __slots__ = ("_file", "_starts")

    def __init__(self) -> None:
        self._file: _File | None = None
        self._starts: np.ndarray | None = None  # the offset index already compared with the file's

    def opened(self, size: int | None, identity: Mapping[str, str]) -> None:
        """Bind to the version of the file just opened (``identity``: its ``fstat`` as
        :class:`~shardflow.storage.readers.LocalReader` reports it; ``size`` unused)."""
        self._file = _bind(identity)

    def bulk_members(
        self, buf: bytes, pos: int, base: int, stop: int, max_member: int, run: int, starts: np.ndarray | None,
        grouped: bool,
    ) -> tuple[list[spans.Member] | SampleRun, int]:
        """:func:`.spans.bulk_members` (same arguments and result), its grouped runs kept for the
        next read of the same bytes and taken from there when they were."""
        file = self._file
        if file is None or not grouped:
            return spans.bulk_members(buf, pos, base, stop, max_member, run, starts, grouped)
        if starts is not None and starts is not self._starts:  # a stream's index: compared once
            global _held
            with _lock:
                if file.starts is None or not np.array_equal(file.starts, starts):
                    file.runs.clear()  # walked with another index
                    _held -= file.samples
                    file.samples, file.starts = 0, starts.copy()
            self._starts = starts
        key = (base, pos, len(buf), stop, max_member, run, starts is None)
        kept = file.runs.get(key)
        if kept is not None:
            return kept.on(buf), kept.end
        members, end = spans.bulk_members(buf, pos, base, stop, max_member, run, starts, grouped)
        if type(members) is SampleRun:
            _keep(file, key, members)
        return members, end
