"""Storage layer: byte streams over local paths and any fsspec URL.

Everything that touches bytes on disk or on a remote store goes through here:

- :func:`iter_chunks` streams a byte range of an object in blocks and survives
  transient failures by reopening at the byte offset already reached, after
  checking that the object did not change in between;
- :func:`read_range` is one ranged read (random access), with the same retries;
- :func:`readahead` runs a chunk stream in a background thread;
- :func:`open_chunks` composes local cache -> :func:`iter_chunks` -> read-ahead and
  is the entry point of the tar reader;
- :func:`open_framed` / :func:`read_framed_range` serve tar offsets of a framed
  ``.tar.zst`` shard, decompressing only the frames that hold them;
- :func:`decompressing_chunks` undoes gzip / zstd compression found by magic bytes;
- :func:`open_output` writes an object atomically (it appears only when complete);
  :func:`open_staged` / :func:`commit_staged` split that in two steps (written, then durable and named);
  :func:`start_writeback` and :func:`sync_directory` make the fsyncs of many files cheaper;
- :func:`join_url`, :func:`is_local`, :func:`exists`, :func:`is_dir`, :func:`list_glob`, :func:`object_size`;
- :func:`filesystem` gives the fsspec filesystem of a URL (listing and removing objects).

Remote I/O is fsspec's (``s3://``, ``gs://``, ``http(s)://``, ``memory://`` ...). HTTP
bodies are read raw: ``Accept-Encoding: identity`` is sent and a ``Content-Encoding``
the server applies anyway is not undone, so the bytes read are the stored object's
bytes (their size and sha256 match the manifest) and a gzip body is gunzipped by
:func:`decompressing_chunks` like any ``.tar.gz`` shard.

One module per job:

- ``options``: :class:`IOOptions`; ``errors``: the errors raised here;
- ``urls``: URL strings (protocols, joining, brace patterns); ``listing``: globs;
- ``filesystems``: fsspec filesystems, per-protocol options, object identity;
- ``fork``: fork hooks (registered on import); ``retries``: the retry policy;
- ``readers/``: one reader per protocol (local, memory, HTTP, S3, any other fsspec store);
- ``reading``: retried range reads; ``read_ahead``: a thread per stream; ``cache``: the local shard cache;
- ``staging``: a rank's staging area (its workers share remote fetches); ``staged``: reads through it;
- ``streams``: :func:`open_chunks`; ``framed``: framed zstd shards in tar offsets; ``metadata``: size / existence / directory;
- ``output``: atomic writes.
"""

from __future__ import annotations

from shardflow.format.compression import GZIP_MAGIC, ZSTD_MAGIC, decompressing_chunks

from .backends import fork  # noqa: F401 - registers the fork hooks
from .errors import (DestinationLockedError, NotRegularFileError, RemoteWriteError, ShardChangedError, ShardNotFoundError,
                     SymlinkError, UnsafeFolderError)
from .backends.filesystems import filesystem
from .framed import open_framed, read_framed_range
from .listing import expand_urls, list_glob
from .backends.metadata import exists, is_dir, object_size
from .options import MAX_BACKOFF, IOOptions, io_options
from .writing.output import (
    commit_staged,
    create_file,
    open_output,
    open_staged,
    refuse_symlink,
    start_writeback,
    sync_directory,
)
from .read_ahead import readahead
from .reading import is_compressed, iter_chunks, read_range, read_small
from .readers import open_regular, regular_fd
from .backends.redirects import MAX_REDIRECTS, RedirectError
from .sharing.staged import prefetch
from .sharing.areas import job_id
from .sharing.staging import StagedOptions, enter_area, leave_prefetch, let_go, scope_of, staged_epoch, staging_for
from .streams import open_chunks
from .urls import is_local, join_url

__all__ = [
    "GZIP_MAGIC",
    "IOOptions",
    "MAX_BACKOFF",
    "RemoteWriteError",
    "ShardChangedError",
    "ShardNotFoundError",
    "NotRegularFileError",
    "SymlinkError",
    "UnsafeFolderError",
    "ZSTD_MAGIC",
    "decompressing_chunks",
    "exists",
    "expand_urls",
    "filesystem",
    "is_compressed",
    "is_dir",
    "io_options",
    "is_local",
    "iter_chunks",
    "join_url",
    "list_glob",
    "object_size",
    "open_chunks",
    "open_framed",
    "read_framed_range",
    "open_output",
    "DestinationLockedError",
    "read_range",
    "MAX_REDIRECTS",
    "RedirectError",
    "create_file",
    "refuse_symlink",
    "open_regular",
    "regular_fd",
    "read_small",
    "readahead",
    "start_writeback",
    "sync_directory",
    "open_staged",
    "commit_staged",
    "staged_epoch",
    "prefetch",
    "enter_area",
    "leave_prefetch",
    "let_go",
    "staging_for",
    "job_id",
    "scope_of",
    "StagedOptions",
]
