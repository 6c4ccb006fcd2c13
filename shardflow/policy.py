"""The bad-input policy of a dataset (``on_error``) and the counters it keeps.

Every reader stage that meets a bad sample or a bad shard hands the error to
:meth:`ErrorPolicy.handle`, which raises it or counts it; no stage tests the
mode itself. The counters become ``dataset.stats``.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any

from .errors import ShardflowError

__all__ = ["ErrorPolicy", "ON_ERROR", "CONVERT_ON_ERROR", "merge_snapshots"]

log = logging.getLogger(__name__)

ON_ERROR = ("raise", "skip", "warn")
"""The values of ``on_error`` (also accepted by :mod:`shardflow.config`)."""

CONVERT_ON_ERROR = tuple(mode for mode in ON_ERROR if mode != "warn")
"""The values of :data:`ON_ERROR` a conversion takes for a bad input (``convert imagefolder``'s
corrupt image): ``"skip"`` leaves it out and names it in the manifest, so there is no
separate ``"warn"``."""


class ErrorPolicy:
    """The dataset's bad-input policy and its counters.

    Args:
        mode: ``"raise"`` raises the error (it names shard, key and reason);
            ``"skip"`` drops the whole sample and counts it; ``"warn"`` does
            the same and logs a warning for the first :attr:`WARN_EACH` of a
            pass, then one total per pass (samples dropped, by reason).
        max_consecutive: under skip/warn, raise after this many bad samples in
            a row with no good one (a pass that can yield nothing fails fast).

    Attributes:
        stats: counters: ``samples`` (yielded), ``skipped`` (samples dropped),
            and one counter per reason (``truncated_shard``, ``missing_field``,
            ``decode``, ``transform``, ``duplicate_field``, ``non_adjacent``,
            ``bad_shard``, ``remote_read``, ...); shard-level reasons count
            shards, ``lost_samples`` counts the samples they took with them,
            ``filtered`` the samples a transform dropped by returning None.

    Raises:
        ValueError: ``mode`` is not one of :data:`ON_ERROR`.
    """

    WARN_EACH = 10
    """Under ``"warn"``, the bad samples of a pass logged one by one; the rest are counted
    and reported in the total that :meth:`check_end` logs."""

    def __init__(self, mode: str = "raise", max_consecutive: int = 1000) -> None:
        if mode not in ON_ERROR:
            raise ValueError(f"on_error must be one of {ON_ERROR}, got {mode!r}")
        self.mode = mode
        self.max_consecutive = max_consecutive
        self.stats: Counter[str] = Counter()
        self.bad_shards: dict[str, set[str]] = {}
        self._run = 0  # bad samples since the last good one (as of ``stats["samples"] == self._good``)
        self._good = 0
        self._warned = 0
        self._last: ShardflowError | None = None

    def handle(
        self, err: ShardflowError, *, samples: int = 1, shard: str | None = None, cause: BaseException | None = None
    ) -> None:
        """Raise ``err`` (under ``"raise"``, chained to ``cause`` when given) or count it.

        Args:
            err: the error; its ``reason`` names the counter.
            samples: samples dropped with it (0 for a shard-level error whose
                lost samples are counted by :meth:`lost` as they are reached).
            shard: the shard's URL for a shard-level problem: the reason then
                counts distinct shards.
            cause: the exception ``err`` stands for (a transform's, an expand's).

        Raises:
            ShardflowError: ``err`` under ``"raise"``; under skip/warn, a
                :class:`ShardflowError` once :attr:`max_consecutive` bad samples
                came in a row.
        """
        if self.mode == "raise":
            if cause is not None:
                raise err from cause
            raise err
        if shard is not None:
            urls = self.bad_shards.setdefault(err.reason, set())
            urls.add(shard)
            self.stats[err.reason] = len(urls)
        else:
            self.stats[err.reason] += 1
        self.stats["skipped"] += samples
        good = self.stats["samples"]
        if good != self._good:  # a sample was yielded since the last bad one
            self._run, self._good = 0, good
        self._run += samples
        self._last = err
        if self.mode == "warn":
            self._warned += 1
            if self._warned <= self.WARN_EACH:
                log.warning("skipped %d sample(s): %s", samples, err)
            if self._warned == self.WARN_EACH:
                log.warning("on_error='warn': further bad samples are counted, not logged; "
                            "the total follows at the end of the pass")
        if self._run >= self.max_consecutive:
            raise ShardflowError(
                f"{self._run} bad samples in a row and none good (on_error={self.mode!r}); last error: {err}"
            ) from err

    def lost(self, samples: int = 1) -> None:
        """Count ``samples`` lost with a shard whose error :meth:`handle` counted already."""
        self.stats["lost_samples"] += samples
        self.stats["skipped"] += samples

    def filtered(self) -> None:
        """Count a sample that a transform dropped by returning None (not an error)."""
        self.stats["filtered"] += 1

    def good(self) -> None:
        """Record a yielded sample: ``stats["samples"] += 1``, which a hot loop may do itself
        (the run of bad samples in a row restarts whenever that counter moves)."""
        self.stats["samples"] += 1

    def snapshot(self) -> dict[str, Any]:
        """The counters plus the bad shards per reason, for merging across workers."""
        out: dict[str, Any] = dict(self.stats)
        if self.bad_shards:
            out["bad_shards"] = {reason: sorted(urls) for reason, urls in self.bad_shards.items()}
        return out

    def check_end(self) -> None:
        """At the end of a pass: fail if everything was dropped; under ``"warn"``, log
        the total dropped (by reason) when there was any.

        Raises:
            ShardflowError: the pass yielded no sample and dropped some.
        """
        if self.mode == "warn" and self.stats["skipped"]:
            reasons = {k: v for k, v in self.stats.items() if k not in ("samples", "skipped") and v}
            log.warning("on_error='warn': skipped %d of %d samples in this pass (%s)",
                        self.stats["skipped"], self.stats["skipped"] + self.stats["samples"],
                        ", ".join(f"{k} {v}" for k, v in sorted(reasons.items())))
        if self.stats["samples"] == 0 and self.stats["skipped"] > 0 and self._last is not None:
            raise ShardflowError(
                f"the pass yielded no sample: all {self.stats['skipped']} were dropped "
                f"({dict(self.stats)}); last error: {self._last}"
            ) from self._last


def merge_snapshots(snapshots: Iterable[Mapping[str, Any]]) -> Counter[str]:
    """Sum the workers' :meth:`ErrorPolicy.snapshot` counters; shard-level problems count each
    shard once (several workers may read parts of the same bad shard)."""
    total: Counter[str] = Counter()
    shards: dict[str, set[str]] = {}
    for stats in snapshots:
        for key, value in stats.items():
            if key == "bad_shards":
                for reason, urls in value.items():
                    shards.setdefault(reason, set()).update(urls)
            else:
                total[key] += value
    for reason, urls in shards.items():
        total[reason] = len(urls)
    return total
