"""Units in command-line output."""

from __future__ import annotations

import math

__all__ = ["human_bytes"]



def human_bytes(n: int | None) -> str:
    """``1536`` -> ``"1.5 KiB"``."""
    if n is None:
        return "?"
    if n < 1024:
        return f"{n} B"
    exp = min(int(math.log(n, 1024)), 4)
    return f"{n / 1024 ** exp:.1f} {['B', 'KiB', 'MiB', 'GiB', 'TiB'][exp]}"
