"""How shards are read and written: one frozen :class:`IOOptions` for every entry point."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..format.limits import DEFAULT_LIMITS, Limits
from ..errors import redacted_repr

__all__ = ["DEFAULT_OPTIONS", "IOOptions", "MAX_BACKOFF", "io_options"]

MAX_BACKOFF = 10.0
"""Seconds; the retry delay doubles from ``IOOptions.backoff`` up to this."""


@dataclass(frozen=True, repr=False)
class IOOptions:
    """How shards are read and written.

    Args:
        storage_options: keyword arguments for the fsspec filesystem (for s3fs:
            ``{"key": ..., "secret": ..., "client_kwargs": {"endpoint_url": ...}}``).
            When sources mix protocols, key them by protocol instead:
            ``{"s3": {...}, "https": {...}}``. Ignored for local paths.
        retries: attempts after a transient failure of a request (a read, an
            open, a ``HEAD``) before giving up; for reads the count restarts
            whenever a read makes progress. 0 disables retries.
        backoff: seconds before the first retry; doubled at each further retry of
            the same failure, capped at :data:`MAX_BACKOFF`.
        block_size: bytes per read, and so the size of the chunks yielded (local files:
            at most :data:`shardflow.storage.reading.LOCAL_READ`, 2 MiB).
        readahead: chunks buffered ahead by a background thread (0 = none).
        cache_dir: local directory caching whole remote shards, or ``None``.
        cache_limit: bytes; the cache evicts least recently used shards to stay
            below it. A shard larger than the limit is streamed uncached.
        limits: bounds on what shard, index and manifest bytes may declare
            (the largest member, the sample count per shard; see
            :class:`~shardflow.format.limits.Limits`).
        request_timeout: seconds one request may wait for the store: to connect,
            for the response's headers, for a ``HEAD``, or for the first byte of
            a read (a read that received some bytes returns them). A request
            over it fails as a transient error (retried). Default 30.
        part_deadline: seconds reading one shard part (one byte range: a
            shard, or the run of samples a reader seeks to) may spend waiting on
            the store in all, retries and backoff included (time the consumer
            spends between reads does not count). Over it, the read raises
            ``RemoteReadError`` (counted under ``on_error="skip"``): a store
            that trickles bytes or stalls on every request fails in bounded
            time. Default 900 (15 minutes: 1 GiB at 1.2 MB/s).
        trust_manifest_urls: open the shard, index and sizes URLs a manifest
            lists wherever they point. Off by default: a manifest's URLs must
            be relative paths that stay under the manifest's folder (no
            absolute path or URL, no other protocol, no ``::`` chain, no
            escaping ``..``), since whoever wrote the manifest chooses them.
        staging: share each remote fetch among the DataLoader workers of a rank
            (on by default): the first worker to need a part of a shard streams
            it into a staging file on local disk, the others read that file as
            it grows, so each byte is fetched once per rank per epoch, whatever
            ``num_workers`` (see docs/remote.md). Off: every worker streams the
            shards it reads itself. Not used with ``cache_dir`` (the cache
            already fetches each shard once) or in the main process.
        staging_dir: the local folder holding the staging areas (one per rank
            and epoch, removed when the epoch's workers are done), or ``None``
            for the system's temporary folder (``tempfile.gettempdir()``).
        staging_limit: bytes of fetched shard bytes a staging area keeps
            (default 2 GiB); past it, blocks every worker already read are
            removed first. Blocks being written or read are never removed, so
            the disk used is at most this plus 8 MiB per open shard part.
        cross_host_redirects: follow HTTP redirects to another host (scheme,
            host or port), without the URL's credentials, ``Authorization``,
            cookies or custom headers. Off by default: such a redirect is a
            ``RedirectError``. Redirects on the same host are followed, at most
            :data:`~shardflow.storage.backends.redirects.MAX_REDIRECTS` per request.
        allow_incomplete: read a dataset folder whose writer is still writing it
            (it holds the folder's lock) or whose conversion did not finish (its
            manifest says ``"complete": false``): the part finished so far. Off by
            default: such a folder is refused with ``IncompleteDatasetError``, which
            names the writer (see :mod:`shardflow.sources.listed`).
    """

    storage_options: Mapping[str, Any] = field(default_factory=dict)
    retries: int = 5
    backoff: float = 0.2
    block_size: int = 4 << 20
    readahead: int = 2
    cache_dir: str | None = None
    cache_limit: int = 32 << 30
    limits: Limits = DEFAULT_LIMITS
    request_timeout: float = 30.0
    part_deadline: float = 900.0
    trust_manifest_urls: bool = False
    staging: bool = True
    staging_dir: str | None = None
    staging_limit: int = 2 << 30
    cross_host_redirects: bool = False
    allow_incomplete: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.storage_options, Mapping):
            raise TypeError(
                f"storage_options must be a mapping, got {type(self.storage_options).__name__}"
            )
        # a plain dict copy: picklable for DataLoader workers, not aliased by the caller
        object.__setattr__(self, "storage_options", dict(self.storage_options))
        for name, low in (("retries", 0), ("block_size", 1), ("readahead", 0), ("cache_limit", 1),
                          ("staging_limit", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {value!r}")
            if value < low:
                raise ValueError(f"{name} must be >= {low}, got {value}")
        if not isinstance(self.staging, bool):
            raise TypeError(f"staging must be a bool, got {self.staging!r}")
        if self.staging_dir is not None:
            staging_dir = os.fspath(self.staging_dir)
            if not isinstance(staging_dir, str) or not staging_dir:
                raise ValueError(f"staging_dir must be a non-empty local path, got {self.staging_dir!r}")
            object.__setattr__(self, "staging_dir", staging_dir)
        for name in ("trust_manifest_urls", "cross_host_redirects", "allow_incomplete"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if not isinstance(self.limits, Limits):
            raise TypeError(f"limits must be a shardflow.format.limits.Limits, got {self.limits!r}")
        for name in ("request_timeout", "part_deadline"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"{name} must be a finite number of seconds > 0, got {value!r}")
        backoff = self.backoff
        if isinstance(backoff, bool) or not isinstance(backoff, (int, float)):
            raise TypeError(f"backoff must be a number of seconds, got {backoff!r}")
        if not math.isfinite(backoff) or backoff < 0:
            raise ValueError(f"backoff must be a finite number of seconds >= 0, got {backoff}")
        if self.cache_dir is not None:
            cache_dir = os.fspath(self.cache_dir)
            if not isinstance(cache_dir, str) or not cache_dir:
                raise ValueError(
                    f"cache_dir must be a non-empty local path, got {self.cache_dir!r}"
                )
            object.__setattr__(self, "cache_dir", cache_dir)

    def __repr__(self) -> str:  # never shows a secret (shardflow.errors)
        return redacted_repr(self)


DEFAULT_OPTIONS = IOOptions()


def io_options(io: IOOptions | None, storage_options: Mapping[str, Any] | None) -> IOOptions:
    """The :class:`IOOptions` of an entry point that takes both ``io=`` and the
    ``storage_options=`` shortcut (fsspec options only).

    Raises:
        ValueError: both are given.
    """
    if io is None:
        return IOOptions(storage_options=dict(storage_options or {}))
    if storage_options:
        raise ValueError("pass storage_options inside io= or as storage_options=, not both")
    return io
