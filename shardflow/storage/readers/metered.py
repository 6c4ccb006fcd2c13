"""A remote reader that counts its request and the bytes it receives (:mod:`shardflow.accounting`)."""

from __future__ import annotations

from typing import Any

from shardflow.accounting import count, is_shard_data

__all__ = ["Metered"]


class Metered:
    """``reader`` (opened: one request counted now), counting the bytes each ``read`` returns
    as shard data or, for manifests and indexes, as metadata. Everything else is ``reader``'s."""

    __slots__ = ("reader", "received")

    def __init__(self, reader: Any, url: str) -> None:
        self.reader = reader
        shard = is_shard_data(url)
        self.received = "bytes_network" if shard else "meta_bytes"
        count("requests" if shard else "meta_requests")

    def read(self, n: int) -> bytes:
        chunk = self.reader.read(n)
        count(self.received, len(chunk))
        return chunk

    def close(self) -> None:
        self.reader.close()

    def __getattr__(self, name: str) -> Any:  # identity, size, ...
        return getattr(self.reader, name)
