"""Samples made from the spans of a run's members (:class:`.spans.SampleRun`): one dict each, made
as it is taken; as fields (``{field: bytes}``) or whole, the dict a reader hands on (:data:`Frame`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from types import MappingProxyType
from typing import Any

__all__ = ["Frame", "raw_sample", "whole", "pairs", "whole_pairs"]

_NO_FIELDS: Mapping[str, Any] = MappingProxyType({})

Frame = tuple[str, int]
"""``(url, source)``: a sample comes whole, ``{"__key__": key, "__url__": url, **fields, "__source__": source}``."""


def raw_sample(key: str, url: str, fields: Mapping[str, Any] = _NO_FIELDS) -> dict[str, Any]:
    """The sample dict that readers hand on: ``{"__key__": key, "__url__": url, **fields}``
    (fields as read: ``{field: bytes}``, in member order). Built here, and in :func:`whole_pairs`
    (the same dict, tagged, in one literal: a raw pass's hot loop)."""
    return {"__key__": key, "__url__": url, **fields}


def whole(key: str, fields: dict[str, Any], frame: Frame) -> dict[str, Any]:
    """The whole sample of ``fields`` (see :data:`Frame`): :func:`raw_sample`, ``__source__`` last."""
    sample = raw_sample(key, frame[0], fields)
    sample["__source__"] = frame[1]
    return sample


def pairs(buf: bytes, keys: list[str], offsets: list[int], f0: Iterable[str], lo0: list[int], hi0: list[int],
          f1: Iterable[str], lo1: list[int], hi1: list[int]) -> Iterator[tuple[str, int, dict[str, bytes]]]:
    """The samples of two members each (the common case), one dict each as it is taken."""
    if type(buf) is not bytes:  # a bytearray read in place (reader/scattered.py): the fields are bytes all the same
        view = memoryview(buf)
        for k, o, a, x, y, b, u, v in zip(keys, offsets, f0, lo0, hi0, f1, lo1, hi1):
            yield k, o, {a: view[x:y].tobytes(), b: view[u:v].tobytes()}
        return
    for k, o, a, x, y, b, u, v in zip(keys, offsets, f0, lo0, hi0, f1, lo1, hi1):
        yield k, o, {a: buf[x:y], b: buf[u:v]}


def whole_pairs(url: str, source: int, buf: bytes, keys: list[str], offsets: list[int], f0: Iterable[str],
                lo0: list[int], hi0: list[int], f1: Iterable[str], lo1: list[int], hi1: list[int]
                ) -> Iterator[tuple[str, int, dict[str, Any]]]:
    """:func:`pairs`, each sample whole (:func:`whole` in one dict literal: the hot loop of a raw pass;
    a field named ``__key__`` or ``__url__`` takes that key's value in its place, as in :func:`raw_sample`)."""
    if type(buf) is not bytes:  # a bytearray read in place (see pairs)
        frame = (url, source)
        for k, o, fields in pairs(buf, keys, offsets, f0, lo0, hi0, f1, lo1, hi1):
            yield k, o, whole(k, fields, frame)
        return
    for k, o, a, x, y, b, u, v in zip(keys, offsets, f0, lo0, hi0, f1, lo1, hi1):
        yield k, o, {"__key__": k, "__url__": url, a: buf[x:y], b: buf[u:v], "__source__": source}
