"""Batches bounded by cost (graph datasets whose sizes vary by orders of magnitude):
the loader's ``max_cost``, and the greedy cut of an epoch's order into batches."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ..errors import ShardflowError

__all__ = ["cost_batches", "cost_budgets", "split_to"]


def cost_batches(costs: np.ndarray, max_cost: int | Sequence[int], max_count: int) -> list[int]:
    """Greedy batch ends over a cost sequence: a batch takes samples while the
    summed cost stays within ``max_cost`` and its size within ``max_count``.

    ``costs``: int64, shape (n,) for one cost, or (n, C) with ``max_cost`` a
    sequence of C budgets, every one of which a batch respects (a sample over a
    budget on its own gets a batch of its own)."""
    if costs.ndim == 1:
        costs = costs[:, None]
    budgets = [int(max_cost)] if isinstance(max_cost, (int, np.integer)) else [int(b) for b in max_cost]
    if costs.shape[1] != len(budgets):
        raise ValueError(f"{costs.shape[1]} cost columns for {len(budgets)} budgets")
    if len(budgets) == 1:  # the common case, without the per-column loop
        return _one_budget(costs[:, 0].tolist(), budgets[0], max_count)
    ends: list[int] = []
    totals = [0] * len(budgets)
    count = 0
    pairs = list(zip(range(len(budgets)), budgets))
    for i, row in enumerate(costs.tolist()):
        if count and (count >= max_count or any(totals[j] + row[j] > b for j, b in pairs)):
            ends.append(i)
            totals = [0] * len(budgets)
            count = 0
        for j in range(len(budgets)):
            totals[j] += row[j]
        count += 1
    if count:
        ends.append(len(costs))
    return ends


def cost_budgets(max_cost: Any, cost: Any = "num_nodes") -> tuple[tuple[str, ...], tuple[int, ...]] | None:
    """Normalize the loader's ``max_cost``/``cost`` into ``(columns, budgets)``.

    Args:
        max_cost: None (batch by count), an int >= 1 (a budget for the column
            ``cost``), or a mapping of size columns to budgets, e.g.
            ``{"num_nodes": 20000, "num_edges": 80000}``: every budget is respected.
        cost: the column of an int ``max_cost`` (``"num_nodes"``, ``"num_edges"``).

    Raises:
        TypeError: ``max_cost`` or ``cost`` of another type (the message says what is allowed).
        ValueError: a budget below 1, or an empty mapping.
    """
    allowed = ("max_cost must be None, an int >= 1 (a budget of the size column named by cost=, e.g. 'num_nodes' "
               "or 'num_edges'), or a mapping of size columns to int budgets, e.g. {'num_nodes': 20000, 'num_edges': 80000}")
    if max_cost is None:
        return None
    if isinstance(max_cost, Mapping):
        items = list(max_cost.items())
        if not items:
            raise ValueError(f"{allowed}; got an empty mapping")
    elif isinstance(max_cost, (int, np.integer)) and not isinstance(max_cost, bool):
        if not isinstance(cost, str) or not cost:
            raise TypeError(f"cost must name a size column (e.g. 'num_nodes' or 'num_edges'), got {cost!r}")
        items = [(cost, max_cost)]
    else:
        raise TypeError(f"{allowed}; got {max_cost!r}")
    for name, budget in items:
        if not isinstance(name, str) or not name:
            raise TypeError(f"{allowed}; got the column {name!r}")
        if isinstance(budget, bool) or not isinstance(budget, (int, np.integer)) or budget < 1:
            raise ValueError(f"{allowed}; got {budget!r} for {name!r}")
    return tuple(n for n, _ in items), tuple(int(b) for _, b in items)


def _one_budget(costs: list[int], max_cost: int, max_count: int) -> list[int]:
    ends: list[int] = []
    total = 0
    count = 0
    for i, c in enumerate(costs):
        if count and (total + c > max_cost or count >= max_count):
            ends.append(i)
            total = 0
            count = 0
        total += c
        count += 1
    if count:
        ends.append(len(costs))
    return ends


def split_to(ends: list[int], target: int) -> list[int]:
    """Split the batches with the most samples until there are ``target`` of them."""
    ends = list(ends)
    while len(ends) < target:
        starts = [0, *ends[:-1]]
        sizes = [e - b for b, e in zip(starts, ends)]
        i = max(range(len(sizes)), key=lambda j: (sizes[j], -j))
        if sizes[i] < 2:
            raise ShardflowError(
                f"cannot give every rank {target} cost-bounded batches: a rank has only {ends[-1]} samples"
            )
        ends.insert(i, starts[i] + sizes[i] // 2)
    return ends
