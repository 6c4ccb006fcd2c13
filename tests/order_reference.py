"""The converters' orders (:mod:`shardflow.convert.engine.mixorder`), computed here from its
documentation alone, with numpy's PCG64 and hashlib, so that a test compares the written order
with an independent reference instead of the helper that made it.

- seed: the first 8 bytes (little-endian) of SHA-256 of ``"convert-order/<seed>"``;
- shuffled: the inputs sorted, stably, by the raw 64-bit outputs of PCG64(seed);
- window shuffle of a stream: input ``j`` keyed ``j + window * (raw_j >> 11) * 2**-53``, the
  inputs sorted stably by key.
"""

from __future__ import annotations

import hashlib

import numpy as np


def order_seed(seed: int) -> int:
    return int.from_bytes(hashlib.sha256(f"convert-order/{seed}".encode()).digest()[:8], "little")


def reference_permutation(n: int, seed: int = 0) -> list[int]:
    """Output position ``p`` holds input ``result[p]``."""
    raw = np.random.PCG64(order_seed(seed)).random_raw(n)
    return sorted(range(n), key=lambda i: (int(raw[i]), i))


def reference_window(n: int, window: int, seed: int = 0) -> list[int]:
    """The window shuffle of ``n`` stream positions: output ``p`` holds position ``result[p]``."""
    raw = np.random.PCG64(order_seed(seed)).random_raw(n)
    keys = [j + window * (float(int(raw[j]) >> 11) * 2.0**-53) for j in range(n)]
    return sorted(range(n), key=lambda j: (keys[j], j))


def reference_parquet(group_rows: list[int], max_count: int, seed: int = 0) -> list[int]:
    """``convert parquet``'s shuffled order, as row numbers over the files in order: the row
    groups (``group_rows[g]`` rows each, in file order) permuted, their rows cut into shards of
    ``max_count``, each shard's rows permuted."""
    firsts = [sum(group_rows[:g]) for g in range(len(group_rows))]
    rows = [firsts[g] + j for g in reference_permutation(len(group_rows), seed) for j in range(group_rows[g])]
    out: list[int] = []
    for a in range(0, len(rows), max_count):
        shard = rows[a : a + max_count]
        out += [shard[i] for i in reference_permutation(len(shard), seed)]
    return out
