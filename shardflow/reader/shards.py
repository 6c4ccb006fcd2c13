"""Reading without a plan (no manifest: whole shards in order), and putting planned
reads back into yield order."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from .. import storage
from ..errors import SampleError, ShardflowError, ShardFormatError
from ..format.tar import raw_sample
from ..policy import ErrorPolicy
from ..sources.source import ShardSet
from .segments import close, open_shard

__all__ = ["read_shards", "emit_in_order"]

Sample = dict[str, Any]


def read_shards(
    shard_ids: Sequence[int], source: ShardSet, io: storage.IOOptions, policy: ErrorPolicy
) -> Iterator[Sample | None]:
    """Read whole shards in order (no manifest): every sample, errors per policy.

    Each shard is opened when the previous one starts, so it downloads meanwhile.

    Yields:
        Each sample as a dict (``__key__``, ``__url__``, its fields as bytes), or
        None for one that was dropped.
    """
    ahead = open_shard(source, shard_ids[0], io) if shard_ids else None
    try:
        for j, shard in enumerate(shard_ids):
            url = source.urls[shard]
            it, ahead = ahead, None
            if j + 1 < len(shard_ids):
                ahead = open_shard(source, shard_ids[j + 1], io)
            try:
                for key, _, fields in it:
                    if isinstance(fields, SampleError):
                        policy.handle(fields)
                        yield None
                        continue
                    yield raw_sample(key, url, fields)
            except ShardflowError as e:
                policy.handle(e, samples=0, shard=url)
                if isinstance(e, ShardFormatError) and (e.offset or e.member is not None):
                    # the damaged sample (past the start, or named by a sound header: not a file that
                    # is no tar at all); without a manifest, how many followed it is unknown
                    policy.lost()
            finally:
                it.close()
    finally:
        close(ahead)


def emit_in_order(items: Iterator[tuple[int, Sample | None]], order: np.ndarray) -> Iterator[Sample | None]:
    """Yield items by ``order`` (positions), buffering those read early.

    The buffer holds at most the shuffle buffer's size plus the interleave
    look-ahead, because the order was made by simulating that buffer.
    """
    stash: dict[int, Sample | None] = {}
    try:
        if order.size < 2 or bool(np.all(order[1:] > order[:-1])):
            # yield order is read order (no shuffle buffer): no reordering to do
            for _, s in items:
                yield s
            return
        for pos in order.tolist():
            while pos not in stash:
                p, s = next(items)
                stash[p] = s
            yield stash.pop(pos)
    finally:
        close(items)
