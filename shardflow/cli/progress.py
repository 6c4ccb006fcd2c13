"""Progress bars for the command line.

A bar (count, rate, ETA) is shown with tqdm when standard error is a terminal;
in logs and pipes nothing is drawn. Library functions take the returned
callable as their ``progress`` argument: ``progress(n)`` adds ``n`` done units.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..storage import IOOptions


@contextmanager
def progress_bar(desc: str, total: int | None = None, unit: str = "it") -> Iterator[Callable[[int], None]]:
    """Yield ``update(n)``; draws a tqdm bar only on a terminal."""
    if not sys.stderr.isatty():
        yield lambda n: None
        return
    from tqdm import tqdm
    from tqdm.contrib.logging import logging_redirect_tqdm

    # log lines go above the bar (tqdm.write), not into it
    with tqdm(total=total, desc=desc, unit=unit, unit_scale=True, dynamic_ncols=True, file=sys.stderr) as bar, \
            logging_redirect_tqdm():
        yield bar.update


def total_samples(url: str, io: IOOptions) -> int | None:
    """The number of samples of a dataset, for a bar's total: from its manifest, or
    None when there is none (the bar then counts without an end)."""
    from ..sources.source import resolve_source

    counts = resolve_source(url, io).counts
    return int(counts.sum()) if counts is not None else None
