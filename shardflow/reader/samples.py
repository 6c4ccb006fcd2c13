"""Per-sample stages after reading: select fields, decode, transform, expand, batch.

Each is a plain generator over samples (``None`` marks a dropped sample, so that
positions stay aligned until :func:`batched`), with a one-sample form used where
one stored sample is prepared at a time (one-to-many samples).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

from ..codecs import DecodeOptions, decode_field, field_alternatives
from ..errors import DecodeError, MissingFieldError, SampleError
from ..policy import ErrorPolicy

__all__ = [
    "wanted_fields",
    "select_one",
    "select_fields",
    "decode_one",
    "decode",
    "apply_transform",
    "expand_each",
    "batched",
]

Sample = dict[str, Any]


def expand_each(samples: Iterator[Sample | None], prepare: Callable[[Sample], list[Any] | None], k: int) -> Iterator[Any]:
    """Replace each sample by its ``k`` prepared items (``k`` Nones when it was dropped)."""
    for s in samples:
        items = prepare(s) if s is not None else None
        if items is None:
            yield from [None] * k
        else:
            yield from items


def wanted_fields(fields: Sequence[str]) -> list[tuple[str, list[str]]]:
    """``(name, alternatives)`` of each requested field (``"jpg;png"``, ``"image"``), for :func:`select_one`."""
    return [(f.split(";")[0], field_alternatives(f)) for f in fields]


def select_one(s: Sample, wanted: list[tuple[str, list[str]]], policy: ErrorPolicy) -> Sample | None:
    """One sample of :func:`select_fields`."""
    out: Sample = {"__key__": s["__key__"], "__url__": s["__url__"]}
    for name, alternatives in wanted:
        for alt in alternatives:
            if alt in s:
                out[name] = s[alt]
                break
        else:
            present = sorted(k for k in s if not k.startswith("__"))
            policy.handle(
                MissingFieldError(f"{s['__url__']}: sample {s['__key__']!r} has no field {name!r} (fields present: {present})")
            )
            return None
    if "__source__" in s:  # set as the sample was read
        out["__source__"] = s["__source__"]
    return out


def select_fields(samples: Iterator[Sample | None], fields: Sequence[str], policy: ErrorPolicy) -> Iterator[Sample | None]:
    """Keep ``__key__``, ``__url__`` and the requested fields; a missing one is an error.

    A requested name may list alternatives separated by ``;`` (``"jpg;png"``):
    the first present is kept under the first name. ``"image"`` stands for
    whichever image field a sample has (see :func:`shardflow.codecs.field_alternatives`).
    """
    wanted = wanted_fields(fields)
    for s in samples:
        yield None if s is None else select_one(s, wanted, policy)


def decode_one(s: Sample, options: DecodeOptions, policy: ErrorPolicy, graph_records: bool = False) -> Sample | None:
    """One sample of :func:`decode`."""
    try:
        for name, value in s.items():
            if not name.startswith("__"):
                s[name] = decode_field(name, value, options, graph_records=graph_records)
    except DecodeError as e:
        policy.handle(DecodeError(f"{s['__url__']}: sample {s['__key__']!r}: cannot decode {e}", reason=e.reason))
        return None
    return s


def decode(
    samples: Iterator[Sample | None], options: DecodeOptions, policy: ErrorPolicy, graph_records: bool = False
) -> Iterator[Sample | None]:
    """Decode every field by its extension (see :mod:`shardflow.codecs`); ``graph_records``:
    as :func:`~shardflow.codecs.decode_field` (the samples go to the default collate)."""
    for s in samples:
        yield None if s is None else decode_one(s, options, policy, graph_records)


def apply_transform(samples: Iterator[Sample | None], transform: Callable[[Sample], Any], policy: ErrorPolicy) -> Iterator[Any]:
    """Apply the user's per-sample transform; a raised exception follows the policy,
    a returned None drops the sample (counted as ``filtered``)."""
    name = getattr(transform, "__qualname__", repr(transform))
    for s in samples:
        if s is None:
            yield None
            continue
        try:
            out = transform(s)
        except Exception as e:
            err = SampleError(
                f"{s.get('__url__')}: sample {s.get('__key__')!r}: transform {name} raised {type(e).__name__}: {e}",
                reason="transform",
            )
            policy.handle(err, cause=e)
            yield None
            continue
        if out is None:
            policy.filtered()
        yield out


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
        yield index, (collate(group) if group else None)
