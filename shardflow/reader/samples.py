"""Per-sample stages after reading: prepare (select, tag, decode, expand), transform, batch.

:class:`Prepare` is the one per-sample path of every dataset; the stages are
plain generators over samples (``None`` marks a dropped sample, so that
positions stay aligned until :func:`batched`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from .. import accounting
from ..codecs import DecodeOptions, decode_field, field_alternatives
from ..codecs.hints import missing_field_hint
from ..errors import DecodeError, MissingFieldError, SampleError
from ..expand import Expand
from ..format.tar import raw_sample
from ..policy import ErrorPolicy
from ..seeding import Seeder
from ..world import stable_seed

__all__ = ["Prepare", "tag_source", "check_fields", "transform_error", "prepared", "expand_each", "apply_transform", "batched"]

Sample = dict[str, Any]


def tag_source(sample: Sample, by_url: Mapping[str, int] | None) -> Sample:
    """Set ``__source__``, the index of the sample's source in the dataset's list (0 for one
    source; ``by_url``: shard URL -> source index, None for one source). The one place it is set."""
    sample["__source__"] = by_url.get(sample["__url__"], 0) if by_url else 0
    return sample


def check_fields(manifest: Any, fields: Sequence[str] | None) -> None:
    """Refuse ``fields`` that name a field no shard of ``manifest`` has (nothing to check
    without a manifest, or one that lists no fields).

    Raises:
        MissingFieldError: names the field and lists those that exist.
    """
    if fields is None or manifest is None or not manifest.fields:
        return
    for f in fields:
        if not any(alt in manifest.fields for alt in field_alternatives(f)):
            raise MissingFieldError(
                f"no shard of {manifest.url} has the field {f!r}; the fields that exist are {sorted(manifest.fields)}"
                + missing_field_hint(f, manifest.fields)
            )


class Prepare:
    """One read sample made ready: its fields selected, ``__source__`` set, decoded, and
    with one-to-many samples expanded into its items. Used by every dataset.

    Args:
        policy: where errors go (a missing field, a field that cannot decode, an
            ``expand`` that raises).
        fields: the field names to keep (see :meth:`select`), or None for all.
        sources: shard URL -> source index, or None (one source).
        decode: how to decode (None: fields stay bytes).
        graph_records: decode graph fields into records for the default collate
            (see :func:`~shardflow.codecs.decode_field`).
        expand: one-to-many samples, or None; its generator is seeded from
            ``(seed, epoch, key)``.
        seed, epoch: for ``expand``.
        seeder: seeds the global generators for the sample right before ``expand``
            runs, and marks its end after (see :mod:`shardflow.seeding`), or None.
    """

    def __init__(
        self,
        policy: ErrorPolicy,
        *,
        fields: Sequence[str] | None = None,
        sources: Mapping[str, int] | None = None,
        decode: DecodeOptions | None = None,
        graph_records: bool = False,
        expand: Expand | None = None,
        seed: int = 0,
        epoch: int = 0,
        seeder: Seeder | None = None,
    ) -> None:
        self._policy = policy
        # (name, alternatives) of each requested field ("jpg;png", "image")
        self._wanted = [(f.split(";")[0], field_alternatives(f)) for f in fields] if fields is not None else None
        self._sources = sources
        self._decode = decode
        self._records = graph_records
        self._expand = expand
        self._seed, self._epoch = seed, epoch
        self._seeder = seeder

    def one(self, sample: Sample) -> Sample | None:
        """The sample selected, tagged and decoded, or None when it was dropped (counted)."""
        s = self.select(sample) if self._wanted is not None else sample
        if s is None:
            return None
        tag_source(s, self._sources)
        return self.decoded(s) if self._decode is not None else s

    def tags_only(self) -> bool:
        """Whether :meth:`one` only sets ``__source__`` to 0: all fields kept, none decoded, one
        source (so :func:`prepared` may tag the samples without calling it)."""
        return self._wanted is None and self._decode is None and not self._sources

    def items(self, sample: Sample) -> list[Any] | None:
        """:meth:`one`, then the ``expand.count`` items of the sample (None: dropped)."""
        s = self.one(sample)
        expand = self._expand
        if s is None or expand is None:
            return None
        rng = np.random.Generator(np.random.PCG64(stable_seed("expand", self._seed, self._epoch, s["__key__"])))
        try:
            if self._seeder is not None:
                self._seeder.sample(s["__key__"])
            try:
                items = list(expand.fn(s, rng))
            finally:
                if self._seeder is not None:
                    self._seeder.done()
            if len(items) != expand.count:
                raise ValueError(f"returned {len(items)} items, expected count={expand.count}")
        except Exception as e:
            err = SampleError(f"{s['__url__']}: sample {s['__key__']!r}: expand raised {type(e).__name__}: {e}", reason="expand")
            self._policy.handle(err, cause=e)
            return None
        return items

    def select(self, s: Sample) -> Sample | None:
        """``__key__``, ``__url__`` and the requested fields; a missing one is an error.

        A requested name may list alternatives separated by ``;`` (``"jpg;png"``):
        the first present is kept under the first name. ``"image"`` stands for
        whichever image field a sample has (see :func:`shardflow.codecs.field_alternatives`).
        """
        out: Sample = raw_sample(s["__key__"], s["__url__"])
        for name, alternatives in self._wanted or ():
            for alt in alternatives:
                if alt in s:
                    out[name] = s[alt]
                    break
            else:
                present = sorted(k for k in s if not k.startswith("__"))
                self._policy.handle(MissingFieldError(
                    f"{s['__url__']}: sample {s['__key__']!r} has no field {name!r} (fields present: {present})"
                    + missing_field_hint(name, present)
                ))
                return None
        return out

    def decoded(self, s: Sample) -> Sample | None:
        """Every field decoded by its extension (see :mod:`shardflow.codecs`), in place."""
        try:
            for name, value in s.items():
                if not name.startswith("__"):
                    s[name] = decode_field(name, value, self._decode, graph_records=self._records)
        except DecodeError as e:
            err = DecodeError(f"{s['__url__']}: sample {s['__key__']!r}: cannot decode {e}", reason=e.reason)
            self._policy.handle(err, cause=e)
            return None
        return s


def prepared(samples: Iterator[Sample | None], prepare: Prepare) -> Iterator[Sample | None]:
    """:meth:`Prepare.one` of every sample (None stays None)."""
    if prepare.tags_only():  # raw samples of one source: two calls a sample fewer on the hot path
        return _tagged(samples)
    return _prepared(samples, prepare.one)


def _prepared(samples: Iterator[Sample | None], one: Callable[[Sample], Sample | None]) -> Iterator[Sample | None]:
    for s in samples:
        yield None if s is None else one(s)


def _tagged(samples: Iterator[Sample | None]) -> Iterator[Sample | None]:
    """:meth:`Prepare.one` where it only tags (see :meth:`Prepare.tags_only`): ``__source__`` 0,
    as :func:`tag_source` sets it for one source."""
    for s in samples:
        if s is not None:
            s["__source__"] = 0
        yield s


def expand_each(samples: Iterator[Sample | None], prepare: Prepare, k: int) -> Iterator[Any]:
    """Replace each sample by its ``k`` items (:meth:`Prepare.items`; ``k`` Nones when it was dropped)."""
    for s in samples:
        items = prepare.items(s) if s is not None else None
        if items is None:
            yield from [None] * k
        else:
            yield from items


def apply_transform(samples: Iterator[Sample | None], transform: Callable[[Sample], Any], policy: ErrorPolicy) -> Iterator[Any]:
    """Apply the user's per-sample transform; a raised exception follows the policy,
    a returned None drops the sample (counted as ``filtered``)."""
    for s in samples:
        if s is None:
            yield None
            continue
        try:
            out = transform(s)
        except Exception as e:
            policy.handle(transform_error(s, transform, e), cause=e)
            yield None
            continue
        if out is None:
            policy.filtered()
        yield out


def transform_error(sample: Sample, transform: Callable[[Sample], Any], e: Exception) -> SampleError:
    """The error of a transform that raised ``e`` on ``sample``: it names the shard, the key
    and the user's transform (not the seeding wrapper: ``functools.wraps``' ``__wrapped__``)."""
    fn = getattr(transform, "__wrapped__", transform)
    name = getattr(fn, "__qualname__", repr(fn))
    return SampleError(
        f"{sample.get('__url__')}: sample {sample.get('__key__')!r}: transform {name} raised {type(e).__name__}: {e}",
        reason="transform",
    )


_END = object()


def batched(
    items: Iterator[Any], sizes: Sequence[int], collate: Callable[[list[Any]], Any], before: Callable[[int], None] | None = None
) -> Iterator[tuple[int, Any]]:
    """Group items into batches of the planned sizes, dropping Nones.

    Yields ``(index, batch)`` for every planned batch, ``index`` its number in
    ``sizes``, so the number of batches never changes; a batch whose samples
    were dropped (``on_error="skip"``) is shorter, and one whose samples were
    *all* dropped is ``(index, None)`` (the loader repeats a neighbouring batch
    in its place, so every DDP rank still takes the same number of steps).
    ``before(index)``, when given, runs just before ``collate`` (the batch's seeding).
    """
    for index, size in enumerate(sizes):
        group = []
        for _ in range(size):
            item = next(items, _END)
            if item is _END:
                break
            if item is not None:
                group.append(item)
        if group and before is not None:
            before(index)
        t = accounting.clock()
        batch = collate(group) if group else None
        accounting.add_ns("collate", accounting.clock() - t)
        yield index, batch
