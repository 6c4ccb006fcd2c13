"""Plain-iterable PyG sources (a generator, an ``IterableDataset``): encoded and written by this process."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator
from typing import Any

from .schema import graph_schema, merge_schemas
from .workers import SCHEMA_GRAPHS, encode_one, graph_key

__all__ = ["StreamState", "build_encoded"]


class _Encoded:
    """A graph encoded in this process (plain-iterable sources): the descriptor is the sample.

    Its ``repr`` (what the engine hashes to decide whether a finished shard can be
    kept on a re-run) is the key and a hash of the bytes, not the bytes.
    """

    __slots__ = ("key", "data", "sizes", "_digest")

    def __init__(self, key: str, data: bytes, sizes: tuple[int, int]) -> None:
        self.key = key
        self.data = data
        self.sizes = sizes
        self._digest = hashlib.blake2b(data, digest_size=16).hexdigest()

    def __repr__(self) -> str:
        return f"{self.key}:{len(self.data)}:{self._digest}"


def build_encoded(descriptors: list[_Encoded], field_name: str) -> Iterator[tuple[Any, ...]]:
    """Engine build step: the graphs this process encoded, as samples."""
    for d in descriptors:
        yield d.key, {field_name: d.data}, d.sizes


class StreamState:
    """What a plain-iterable conversion learns while it streams: count and schema.

    The schema merges the first :data:`SCHEMA_GRAPHS` graphs and every later graph
    whose structure (:func:`shardflow.graph.graph_structure`) was not seen before.
    """

    def __init__(self) -> None:
        self.count = 0
        self.schema: dict[str, Any] | None = None
        self.observed = 0
        self._seen: set[tuple[Any, ...]] = set()

    def encode(self, graphs: Iterable[Any]) -> Iterator[_Encoded]:
        from ...graph.structure import graph_structure

        for i, graph in enumerate(graphs):
            data, sizes = encode_one(i, graph)
            self._observe(i, graph, graph_structure(graph))
            self.count = i + 1
            yield _Encoded(graph_key(i), data, sizes)

    def _observe(self, index: int, graph: Any, structure: tuple[Any, ...]) -> None:
        if index < SCHEMA_GRAPHS or structure not in self._seen:
            self._seen.add(structure)
            self.schema = merge_schemas(self.schema, graph_schema(graph))
            self.observed += 1
