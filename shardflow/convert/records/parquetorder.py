"""The shuffled order of ``convert parquet``: row groups in a seeded permutation, then the rows
of each shard in a seeded permutation.

A row-level permutation of the whole dataset would make every shard read a few rows out of
thousands of row groups, and pyarrow decodes a row group's selected columns whole: every row
group would be decoded once per shard (a hundredfold and more). So the permutation is in two
levels, each a :func:`~shardflow.convert.engine.mixorder.input_order` permutation:

1. the row groups of all the files (in file order, then row group order) are taken in
   ``input_order(row groups, seed)``, and cut into shards of ``max_count`` rows as the walk cuts
   them (a row group may straddle two shards): a shard holds ``max_count / rows per row group``
   row groups drawn from anywhere (Hugging Face writes image datasets in row groups of 100 rows:
   100 row groups per shard of 10,000);
2. the rows of each shard (its pieces' rows, in that order) are written in
   ``input_order(rows of the shard, seed)``.

Each row group is still read by one shard (two where it straddles), as in the walk. Memory:
this process lists every row group first (the footers, read one by one), packed (about 100
bytes each: the file's URL and version, the row group's number and rows); a worker holds the
selected columns of one shard's rows (as pyarrow decodes them: binary columns such as images at
their stored size), plus one row group while it reads it; the walk holds one row group. Bound it
with ``max_count`` (or ``order="walk"``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from ..engine.mixorder import PackedInputs, input_order

__all__ = ["RowGroup", "OrderedPiece", "cut_inputs", "shuffled_inputs"]

RowGroup = tuple[str, Any, int, int, int]
"""A row group: (file URL, file version, row group number, its rows, the number of its first row
over the files in order)."""

OrderedPiece = tuple[str, Any, int, int, int, int, int]
"""A piece of a shuffled input: (file URL, file version, row group, its rows, first row, end row
in the row group, the number of its first row over the files)."""


def shuffled_inputs(groups: Iterable[RowGroup], max_count: int, seed: int) -> Iterator[tuple[int, tuple[OrderedPiece, ...]]]:
    """The inputs of a shuffled conversion: :func:`cut_inputs` of the row groups in the seeded
    permutation, each piece with the number of its first row."""
    packed = PackedInputs()
    for group in groups:
        packed.add(group)
    return cut_inputs((packed[int(i)] for i in input_order(len(packed), seed)), max_count, numbered=True)


def cut_inputs(groups: Iterable[RowGroup], max_count: int, *, numbered: bool) -> Iterator[tuple[int, tuple[Any, ...]]]:
    """Row groups cut into inputs of ``max_count`` rows (the last one fewer): ``(position of the
    input's first row, its pieces)``, a piece ``(file, version, row group, its rows, first row, end
    row)`` plus, ``numbered``, the number of its first row over the files."""
    pieces: list[Any] = []
    first = total = 0
    for url, version, g, n, row in groups:
        start = 0
        while start < n:
            take = min(n - start, max_count - (total - first))
            piece = (url, version, g, n, start, start + take)
            pieces.append((*piece, row + start) if numbered else piece)
            start += take
            total += take
            if total - first == max_count:
                yield first, tuple(pieces)
                pieces, first = [], total
    if pieces:
        yield first, tuple(pieces)
