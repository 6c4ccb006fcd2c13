"""Progress bars for the command line.

A bar (count, rate, ETA) is shown with tqdm when standard error is a terminal;
in logs and pipes nothing is drawn. Library functions take the returned
callable as their ``progress`` argument: ``progress(n)`` adds ``n`` done units.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager


@contextmanager
def progress_bar(desc: str, total: int | None = None, unit: str = "it") -> Iterator[Callable[[int], None]]:
    """Yield ``update(n)``; draws a tqdm bar only on a terminal."""
    if not sys.stderr.isatty():
        yield lambda n: None
        return
    from tqdm import tqdm

    with tqdm(total=total, desc=desc, unit=unit, unit_scale=True, dynamic_ncols=True, file=sys.stderr) as bar:
        yield bar.update
