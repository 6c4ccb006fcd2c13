"""Writing objects atomically: they appear at their URL only when complete."""

from __future__ import annotations

import contextlib
import fcntl
import os
import posixpath
import secrets
import tempfile
from collections.abc import Iterator
from typing import BinaryIO

from shardflow.errors import ShardflowError

from .errors import RemoteWriteError
from .filesystems import filesystem
from .options import DEFAULT_OPTIONS, IOOptions
from .urls import is_local, local_path, protocol

__all__ = ["open_output"]

# Stores where one PUT makes the whole object appear at once (never a partial one).
_ATOMIC_PUT_PROTOCOLS = frozenset(
    {"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "oss", "memory"}
)


@contextlib.contextmanager
def open_output(url: str, options: IOOptions = DEFAULT_OPTIONS) -> Iterator[BinaryIO]:
    """Write an object that appears at ``url`` only if the ``with`` block succeeds.

    Local paths: a temporary file in the same directory, fsynced and renamed over
    ``url`` (``os.replace``); parent directories are created. Remote URLs: a local
    temporary file (in ``options.cache_dir`` if set, else the system's temporary
    directory) uploaded at exit, in one PUT on object stores (s3, gs, az, memory)
    and through a temporary name then a move elsewhere.

    Yields:
        A writable binary file.

    Raises:
        RemoteWriteError: the upload failed (nothing is left at ``url``).
    """
    url = os.fspath(url)
    if is_local(url):
        with _local_output(local_path(url)) as f:
            yield f
        return
    fs, path = filesystem(url, options)
    fd, tmp = tempfile.mkstemp(prefix=".shardflow-upload-", dir=options.cache_dir)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
        proto = protocol(url)
        try:
            if proto in _ATOMIC_PUT_PROTOCOLS:
                fs.put_file(tmp, path)
            else:
                parent, name = posixpath.split(path.rstrip("/"))
                staged = posixpath.join(parent, f".{name}.{secrets.token_hex(6)}.tmp")
                with contextlib.suppress(Exception):
                    fs.makedirs(parent, exist_ok=True)
                try:
                    fs.put_file(tmp, staged)
                    fs.mv(staged, path)
                except BaseException:
                    with contextlib.suppress(Exception):
                        fs.rm(staged)
                    raise
        except ShardflowError:
            raise
        except Exception as exc:
            raise RemoteWriteError(f"writing {url} failed: {type(exc).__name__}: {exc}") from exc
        finally:
            with contextlib.suppress(Exception):
                fs.invalidate_cache(path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


@contextlib.contextmanager
def _local_output(path: str) -> Iterator[BinaryIO]:
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{os.path.basename(path)}.{secrets.token_hex(6)}.tmp")
    # os.open with 0o666 honours the umask, unlike mkstemp's 0o600
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    # held while the file is written: a temporary nobody holds is a crashed writer's (storage.locks)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
            os.replace(tmp, path)  # still locked: no sweep can take it for a dead writer's
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    with contextlib.suppress(OSError):  # make the rename durable
        dir_fd = os.open(parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
