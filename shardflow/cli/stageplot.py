"""The stage breakdown of ``shardflow bench --plot``: where the workers' time went."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["draw_stages", "stage_line"]


def draw_stages(ax: Any, stages: Mapping[str, float], sentence: str = "") -> None:
    """Draw worker seconds per stage (:mod:`shardflow.accounting`) as horizontal bars on a
    matplotlib ``ax``, each labelled with its share; ``sentence``: the report's verdict, as the
    title."""
    names = list(stages)
    secs = [stages[n] for n in names]
    total = sum(secs) or 1.0
    bars = ax.barh(names, secs, color="#4477aa", alpha=0.7)
    for bar, s in zip(bars, secs):
        ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, f" {s / total:.0%}", va="center", fontsize=8)
    ax.invert_yaxis()  # innermost stage (fetch) on top, in pipeline order
    ax.set_xlabel("worker seconds (all workers)")
    ax.set_title(sentence, fontsize=7, wrap=True)
    ax.grid(axis="x", alpha=0.3)


def stage_line(stages: Mapping[str, float]) -> str:
    """``"fetch 2%, read 10%, ..."``: each stage's share of the workers' time."""
    total = sum(stages.values())
    if total <= 0:
        return "not timed"
    return ", ".join(f"{k} {v / total:.0%}" for k, v in stages.items())
