"""What :func:`~shardflow.inspect.verify` reports: problems, each naming the shard,
the key and the reason."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["Problem", "VerifyReport"]



@dataclass(frozen=True)
class Problem:
    """One thing wrong with a dataset.

    Attributes:
        shard: the shard URL (or the manifest URL for dataset-level problems).
        key: the sample key, or None for a shard-level problem.
        reason: a constant tag: ``missing_shard``, ``sha256``, ``size``,
            ``sample_count``, ``offset_index``, ``truncated_shard``,
            ``bad_shard``, ``duplicate_field``, ``non_adjacent``, ``decode``,
            ``missing_field``, ``unlisted_field``, ``remote_read``, ...
        message: what was expected and what was found.
        field: the field concerned, if any.
    """

    shard: str
    key: str | None
    reason: str
    message: str
    field: str | None = None

    def __str__(self) -> str:
        where = self.shard if self.key is None else f"{self.shard} key {self.key!r}"
        return f"{where}: {self.reason}: {self.message}"

    def to_json(self) -> dict[str, Any]:
        return {"shard": self.shard, "key": self.key, "reason": self.reason, "field": self.field, "message": self.message}


class VerifyReport(list):
    """The problems :func:`verify` found (a ``list[Problem]``, empty when all is well).

    Attributes:
        shards: shards checked.
        samples: samples read.
        bytes: shard bytes read.
        manifest: the manifest URL checked against, or None.
        decoded: whether every field was decoded.
        seconds: wall time.
    """

    shards: int = 0
    samples: int = 0
    bytes: int = 0
    manifest: str | None = None
    decoded: bool = True
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self

    def bad_shards(self) -> list[str]:
        """Shards with at least one problem, in first-seen order."""
        return list(dict.fromkeys(p.shard for p in self if p.shard != self.manifest))
