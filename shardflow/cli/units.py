"""Units and counts in command-line output: sizes in IEC units (KiB, MiB: powers of 1024,
in every command), counts with their noun in the right number."""

from __future__ import annotations

import math

__all__ = ["counted", "human_bytes"]



def human_bytes(n: int | None) -> str:
    """``1536`` -> ``"1.5 KiB"``."""
    if n is None:
        return "?"
    if n < 1024:
        return f"{n} B"
    exp = min(int(math.log(n, 1024)), 4)
    return f"{n / 1024 ** exp:.1f} {['B', 'KiB', 'MiB', 'GiB', 'TiB'][exp]}"


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """``counted(1, "shard") == "1 shard"``, ``counted(1200, "sample") == "1,200 samples"``."""
    return f"{n:,} {noun if n == 1 else (plural or noun + 's')}"
