"""Wording shared by the commands' output: counts with their noun in the right number."""

from __future__ import annotations

__all__ = ["counted"]


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """``counted(1, "shard") == "1 shard"``, ``counted(1200, "sample") == "1,200 samples"``."""
    return f"{n:,} {noun if n == 1 else (plural or noun + 's')}"
