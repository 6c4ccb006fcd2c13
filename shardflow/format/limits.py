"""Limits on what untrusted shard bytes may declare.

Every size, count and offset that shardflow reads from a shard, an offset
index or a manifest is checked before it is used; where a value could be
legitimate but costly (a member's size, a graph's node count), the bound is
one of these options, and the error it raises names the option so the user
can raise it. (Decoding limits, on image pixels and graph sizes, are
:class:`~shardflow.codecs.DecodeOptions` fields.) ``docs/security.md`` lists them with their defaults.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Limits", "DEFAULT_LIMITS", "MAX_GRAPH_NODES", "MAX_GRAPH_EDGES"]

MAX_GRAPH_NODES = 1 << 24
"""Default ``DecodeOptions.max_graph_nodes``: 16,777,216 nodes per graph (per node type).

Nodes need no bytes of their own (an ``edge_index`` id implies them), yet each
costs memory when graphs are batched (``batch``/``ptr`` vectors, node features):
at this limit a graph's ``batch`` vector alone is 128 MiB."""
MAX_GRAPH_EDGES = 1 << 28
"""Default ``DecodeOptions.max_graph_edges``: 268,435,456 edges per graph (per edge type)."""


@dataclass(frozen=True)
class Limits:
    """Bounds on sizes declared by shard, index and manifest bytes.

    Args:
        max_member_bytes: the largest tar member (after decompression) that is
            read, in bytes; default 1 GiB. A larger member is an error that
            names this option (under ``on_error="skip"``: its sample is
            dropped and counted as ``member_too_large``), and its bytes are
            skipped without being held in memory.
        max_header_bytes: the largest GNU long name or PAX extended header, in
            bytes; default 1 MiB.
        min_sample_bytes: the fewest bytes one sample takes in an uncompressed
            shard: a manifest that declares more than ``bytes // min_sample_bytes``
            samples for a shard is refused before anything is allocated for it.
            Default 512 (one tar header block: a sample cannot take less).
        max_compression_ratio: for a compressed shard (``.tar.gz``/``.tar.zst``)
            the declared samples may be at most ``bytes * max_compression_ratio
            // min_sample_bytes``; a compressed field (``.gz``/``.zst``/``.xz``)
            may hold at most this many times its stored bytes (and at most
            ``max_member_bytes``). Default 1000. For a framed ``.tar.zst`` also
            the most tar bytes its frame table may declare per compressed byte.
        max_frame_bytes: the largest zstd frame of a framed ``.tar.zst`` shard
            (see :mod:`shardflow.format.frames`), compressed or decompressed, in
            bytes; default 64 MiB (shardflow writes frames of at most 4 MiB). A
            frame is held whole while it is decompressed: this bounds that memory.
        max_manifest_bytes: the largest manifest, journal, conversion record,
            offset or sizes index read (whole, into memory); default 256 MiB.

    Raises:
        TypeError, ValueError: a limit is not a positive int.
    """

    max_member_bytes: int = 1 << 30
    max_header_bytes: int = 1 << 20
    min_sample_bytes: int = 512
    max_compression_ratio: int = 1000
    max_frame_bytes: int = 64 << 20
    max_manifest_bytes: int = 256 << 20

    def __post_init__(self) -> None:
        for name in self.__dataclass_fields__:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"Limits.{name} must be an int, got {value!r}")
            if value < 1:
                raise ValueError(f"Limits.{name} must be >= 1, got {value}")


DEFAULT_LIMITS = Limits()
