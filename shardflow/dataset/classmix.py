"""Whether a dataset's shuffle can use the window shuffle (:mod:`shardflow.window`).

The window shuffle reads every sample on its own through its shard's offset index. That is
cheap for plain ``.tar`` shards on local disk, and costly elsewhere: from a bucket each sample
would be a request of its own (the bytes over the link would stay 1x, the requests would not),
and a compressed shard would decompress a frame per sample. There the shuffle stays the shard
interleave and the shuffle buffer (``window`` set to 0), and the order is that of
``ShuffleConfig(window=0)``. So it is for shards that a converter wrote in a shuffled order
(``meta.order == "shuffled"``): their classes are mixed already, and reading them in order
is faster.
"""

from __future__ import annotations

import logging
from dataclasses import replace

from .. import storage
from ..errors import ShardflowError
from ..plan import ShuffleConfig
from ..source import ShardSet

__all__ = ["effective_shuffle", "window_readable", "written_mixed"]

log = logging.getLogger(__name__)


def window_readable(source: ShardSet, io: storage.IOOptions) -> bool:
    """True when every shard is a plain (uncompressed: its first bytes say so, a local read of
    4 bytes per shard) ``.tar`` on local disk with an offset index."""
    if not source.urls or not all(
        storage.is_local(url) and url.endswith(".tar") and index is not None
        for url, index in zip(source.urls, source.index_urls)
    ):
        return False
    try:
        return not any(storage.is_compressed(url, io) for url in source.urls)
    except (OSError, ShardflowError):  # a missing or unreadable shard: reading it will say so
        return False


def written_mixed(source: ShardSet) -> bool:
    """True when the manifest says its converter wrote the samples in a shuffled order
    (``meta.order``, :mod:`shardflow.convert.mixorder`): the shards are mixed already."""
    manifest = source.manifest
    return manifest is not None and isinstance(manifest.meta, dict) and manifest.meta.get("order") == "shuffled"


def effective_shuffle(shuffle: ShuffleConfig, source: ShardSet, io: storage.IOOptions) -> ShuffleConfig:
    """``shuffle``, with the window off (0) when the shards are mixed already (read in order, as
    stored, is as fast as reading gets) or cannot be read by random access cheaply."""
    if shuffle.window <= 1:
        return shuffle
    if written_mixed(source):
        return replace(shuffle, window=0)
    if window_readable(source, io):
        return shuffle
    log.debug("window shuffle off: shards that are remote, compressed or without an offset index are read in order")
    return replace(shuffle, window=0)
