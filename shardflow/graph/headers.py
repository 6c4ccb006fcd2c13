"""Header templates: the safetensors header of a ``pyg`` field read without a JSON parse,
when a field of the same layout was read before.

The graphs of one dataset share a layout: their headers (the JSON of the tensor table
and, inside it, the graph schema) differ only in the numbers, the tensors' shapes
and data offsets and the schema's node count and increments. The first header of a
layout is parsed with ``json`` (and checked in full by the caller); :func:`learn`
then keeps a template of it: the text as a format string in which those numbers are
holes, everything else (names, dtypes, the schema, digits inside strings) literal.
:func:`match` accepts another header only if the template with the header's own
numbers filled in reproduces it byte for byte, and every number is a JSON integer
literal (no leading zero, at most 18 digits). Such a header is what ``json`` would
parse to the same structure with those numbers, so the caller's per-field checks
(offsets tiling the data section, shapes fitting their bytes, node ids within
bounds) are all that is left to do.
"""

from __future__ import annotations

import json
import re
import threading
from operator import itemgetter
from typing import Any

import numpy as np
import torch

from .collate import NUMPY_DTYPES
from .schema import NP_DTYPES, SCHEMA_KEY, ST_DTYPES

__all__ = ["ARRAY_DTYPES", "HeaderTemplate", "learn", "match"]

ARRAY_DTYPES: dict[torch.dtype, np.dtype] = {dt: NP_DTYPES[dt] for dt in NUMPY_DTYPES if dt in NP_DTYPES}
"""The dtypes a graph record holds as numpy arrays (and concatenates with numpy)."""

_DIGITS = b"0123456789"
_ONLY_DIGITS = bytes(c if 48 <= c <= 57 else 32 for c in range(256))  # every non-digit -> space
_RUN = re.compile(rb"[0-9]+")
_BAD_NUMBER = re.compile(rb" 0[0-9]| [0-9]{19}")  # not a JSON integer, or too long to be ours
_SENTINEL = 10**17
_MAX_LAYOUTS = 256
_MAX_PER_LAYOUT = 8

_TEMPLATES: dict[bytes, list[HeaderTemplate]] = {}  # header without its digits -> templates
_REFUSED: set[bytes] = set()
_RECENT: list[HeaderTemplate | None] = [None]  # the template :func:`match` found last
_LOCK = threading.Lock()


class HeaderTemplate:
    """One learned header layout.

    Attributes:
        fmt: the header text with ``%s`` for each number hole (``%`` doubled).
        runs: how many digit runs the header has (holes and literal digits).
        pick: picks the holes' runs out of all runs.
        needed: picks the shapes' and offsets' runs out of the holes' runs (the
            schema's node count and increments are holes that only need to be numbers).
        entries: per tensor entry, in header order: ``(numpy dtype, shape(numbers)
            -> the shape, position of the start offset, position of the end
            offset)``, positions into the numbers that ``needed`` picks.
        names: the graph's attribute names, in order.
        attr_entries: ``attr_entries(arrays of the entries)`` -> the arrays of the
            attributes, in order.
        chain: the entries' ``(start, end)`` positions in the order in which the learned
            header's tensors follow each other in the data section (see :meth:`tiles`).
    """

    __slots__ = ("attr_entries", "chain", "entries", "fmt", "names", "needed", "pick", "runs")

    def __init__(self, fmt: bytes, runs: int, holes: list[int], needed: list[int], entries: list[tuple],
                 names: tuple[str, ...], attr_entries: list[int], chain: list[tuple[int, int]]) -> None:
        self.fmt = fmt
        self.runs = runs
        self.pick = itemgetter(*holes)
        self.needed = _getter(needed)
        self.entries = entries
        self.names = names
        self.attr_entries = _getter(attr_entries)
        self.chain = chain

    def tiles(self, numbers: list[int], size: int) -> bool:
        """Whether the entries' offsets in ``numbers`` tile a data section of ``size``
        bytes in the learned order (each tensor starting where the one before it ends).
        False says only that they do not in that order:
        :func:`~shardflow.graph.decode.check_tiling` decides then."""
        reached = 0
        for s, e in self.chain:
            if numbers[s] != reached:
                return False
            reached = numbers[e]
        return reached == size


def match(text: bytes) -> tuple[HeaderTemplate, list[int]] | None:
    """The template that reproduces ``text`` and the numbers of its holes, or None."""
    text = text.rstrip(b" ")  # safetensors' padding, whose length follows the digits'
    recent = _RECENT[0]  # the graphs of a dataset share a layout: try the last one matched first
    if recent is not None:
        runs = text.translate(_ONLY_DIGITS).split()
        if len(runs) == recent.runs:
            picked = recent.pick(runs)
            if recent.fmt % picked == text:
                return _numbers(recent, picked)
    templates = _TEMPLATES.get(text.translate(None, _DIGITS))
    if not templates:
        return None
    runs = text.translate(_ONLY_DIGITS).split()
    for template in templates:
        if len(runs) != template.runs:
            continue
        picked = template.pick(runs)
        if template.fmt % picked != text:
            continue
        _RECENT[0] = template
        return _numbers(template, picked)
    return None


def _numbers(template: HeaderTemplate, picked: tuple[bytes, ...]) -> tuple[HeaderTemplate, list[int]] | None:
    """``(template, the needed numbers)`` of a header that ``template`` reproduces with the
    digit runs ``picked`` in its holes; None where one is not a JSON integer of ours."""
    if _BAD_NUMBER.search(b" " + b" ".join(picked)):
        return None
    return template, list(map(int, template.needed(picked)))


def learn(text: bytes) -> None:
    """Keep a template of ``text``, a header that the caller parsed, checked and found to
    be of the record layout (see :mod:`shardflow.graph.records`)."""
    text = text.rstrip(b" ")  # (JSON the same without it)
    key = text.translate(None, _DIGITS)
    known = _TEMPLATES.get(key, ())
    if key in _REFUSED or len(known) >= _MAX_PER_LAYOUT or len(_TEMPLATES) >= _MAX_LAYOUTS:
        return
    try:
        template = _template(text)
    except (ValueError, TypeError, KeyError, IndexError, AttributeError, RecursionError):
        template = None
    with _LOCK:
        if template is None:
            _REFUSED.add(key)
        else:
            _TEMPLATES[key] = [*known, template]


def _getter(positions: list[int]) -> Any:
    """``f(numbers) -> tuple of numbers[p] for p in positions`` (for one or none too)."""
    if len(positions) >= 2:
        return itemgetter(*positions)
    if positions:
        (p,) = positions
        return lambda numbers: (numbers[p],)
    return lambda numbers: ()


def _ints(tree: Any) -> list[int]:
    """Every int in a parsed JSON tree."""
    if type(tree) is int:
        return [tree]
    if type(tree) is dict:
        tree = list(tree.values())
    if type(tree) is list:
        return [i for item in tree for i in _ints(item)]
    return []


def _parse(text: bytes) -> tuple[dict, dict]:
    header = json.loads(text)
    schema = json.loads(header.pop("__metadata__")[SCHEMA_KEY])
    return header, schema


def _template(text: bytes) -> HeaderTemplate | None:
    if b"\\u" in text or b"%" in text:  # escapes whose digits are not numbers; (and no % to double)
        return None
    runs = list(_RUN.finditer(text))
    parts, pos = [], 0
    for i, found in enumerate(runs):  # every digit run -> a sentinel number of its own
        parts += [text[pos : found.start()], str(_SENTINEL + i).encode()]
        pos = found.end()
    header, schema = _parse(text)
    marked, marked_schema = _parse(b"".join([*parts, text[pos:]]))

    def hole(value: Any) -> int:
        if type(value) is not int or not _SENTINEL <= value < _SENTINEL + len(runs):
            raise ValueError("not a number of the header")
        return value - _SENTINEL

    if len(header) != len(marked):
        return None  # duplicate names that differ only in digits
    entries, index, holes, needed = [], {}, set(), set()
    for (name, info), (_, marked_info) in zip(header.items(), marked.items()):
        dims = [hole(d) for d in marked_info["shape"]]
        start, end = (hole(v) for v in marked_info["data_offsets"])
        entries.append((ARRAY_DTYPES[ST_DTYPES[info["dtype"]]], dims, start, end))
        index[name] = len(entries) - 1
        holes.update([*dims, start, end])
        needed.update([*dims, start, end])
    store, marked_store = schema["stores"][0], marked_schema["stores"][0]
    for free in (marked_store.get("num_nodes"), marked_store.get("rules")):
        holes.update(i - _SENTINEL for i in _ints(free) if _SENTINEL <= i < _SENTINEL + len(runs))
    attrs = store["attrs"]
    if len(attrs) != len(marked_store["attrs"]):
        return None
    order = sorted(holes)
    if len(order) < 2:
        return None  # (itemgetter of one index returns the item, not a tuple)
    position = {run: k for k, run in enumerate(order)}
    fmt, pos = [], 0
    for i, found in enumerate(runs):
        fmt += [text[pos : found.start()], b"%s" if i in position else found.group()]
        pos = found.end()
    fmt.append(text[pos:])
    wanted = sorted(needed)
    at = {run: k for k, run in enumerate(wanted)}
    starts = [info["data_offsets"][0] for info in header.values()]
    chain = [(at[entries[k][2]], at[entries[k][3]]) for k in sorted(range(len(entries)), key=starts.__getitem__)]
    entries = [(dtype, _getter([at[d] for d in dims]), at[s], at[e]) for dtype, dims, s, e in entries]
    return HeaderTemplate(b"".join(fmt), len(runs), order, [position[run] for run in wanted], entries,
                          tuple(attrs), [index[enc["tensor"]] for enc in attrs.values()], chain)
