"""The resume contract shared by :class:`~shardflow.ShardDataset` and :class:`~shardflow.ShardLoader`.

A state is a plain dict (JSON-able, picklable) with constant keys
(:data:`STATE_KEYS`) and a version (:data:`STATE_VERSION`):

- ``kind``: ``"ShardDataset"`` (iterated directly) or ``"ShardLoader"``.
- ``version``: :data:`STATE_VERSION`; another version is refused.
- ``epoch``: the epoch the state resumes.
- ``remaining``: where that epoch stands (``[]``: nothing read yet, the epoch
  starts afresh). With a manifest, the epoch's *layout*: ``[[W0, k0], [W1, k1],
  ...]``, the world sizes it ran on and the steps (batches of every rank; samples
  for a dataset iterated directly) taken on each (:mod:`shardflow.planning.elastic`); the
  same on every rank, so a state saved on one rank loads on all, at any world
  size and worker count. Without a manifest: the units each worker stream has
  passed (same rank, world size and worker count needed).
- ``next_worker``: unsized: the stream the DataLoader takes the next batch from
  (0 with a manifest, where the batch order does not depend on the workers).
- ``config``: the configuration the position is valid for (shards, seed, shuffle,
  split, batch size; the world it was saved by); :func:`check_state` compares it
  with the loading object's and names every difference.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .errors import StateError

__all__ = [
    "STATE_VERSION",
    "STATE_KEYS",
    "ResumePoint",
    "parse_layout",
    "layout_position",
    "build_state",
    "check_state",
    "check_bounds",
    "MAX_EPOCH",
    "MAX_STAGES",
    "MAX_STREAMS",
]

STATE_VERSION = 3  # 3: buffer shuffles pick from PCG64 (order.BufferDraws); a state of 2 would resume another order
STATE_KEYS = ("kind", "version", "epoch", "remaining", "next_worker", "config")
MAX_EPOCH = 1 << 62
"""Epochs a state may name: ``[0, 2**62)`` (seeds are derived from the epoch in 64 bits)."""
MAX_STREAMS = 256
"""Worker streams (DataLoader workers per rank) an unsized state may list."""
MAX_STAGES = 1024
"""``(world size, steps)`` stages one epoch's state may list: a job restarted at another world size
more than 1024 times within one epoch is not one shardflow resumes."""


@dataclass(frozen=True)
class ResumePoint:
    """Where the next iteration resumes.

    Attributes:
        epoch: the epoch being resumed.
        layout: sized: the earlier ``(world size, steps)`` stages of the epoch,
            whose remaining samples the current world's plan shares out (empty:
            the epoch's own plan; see :mod:`shardflow.planning.elastic`).
        step: sized: batches of the current plan already taken (every rank alike).
        skip: unsized: ``skip[w]`` counts the units worker ``w`` skips.
        streams: unsized: ``streams[w]`` is the stream (worker position of the
            saved run: its shards and shuffle seed) that worker ``w`` continues.
    """

    epoch: int
    layout: tuple[tuple[int, int], ...] = ()
    step: int = 0
    skip: tuple[int, ...] = ()
    streams: tuple[int, ...] = ()


def parse_layout(remaining: Any, kind: str) -> list[tuple[int, int]]:
    """The ``[[world size, steps], ...]`` layout of a sized state, validated.

    Raises:
        StateError: not a list of ``[world size >= 1, steps >= 0]`` pairs.
    """
    ok = isinstance(remaining, (list, tuple)) and all(
        isinstance(e, (list, tuple)) and len(e) == 2 and all(isinstance(v, int) and not isinstance(v, bool) for v in e)
        and e[0] >= 1 and e[1] >= 0 for e in remaining
    )
    if not ok:
        raise StateError(
            f"{kind} state_dict: 'remaining' must list [world_size, steps] pairs for a dataset with a manifest, "
            f"got {remaining!r} (a state saved by an older shardflow, or without a manifest?)"
        )
    return [(int(w), int(k)) for w, k in remaining]


def layout_position(layout: Sequence[tuple[int, int]], world_size: int, step: int) -> list[list[int]]:
    """The ``remaining`` entry of a sized state: the epoch's earlier ``(world size, steps)``
    stages, then ``step`` steps taken on the current ``world_size`` ranks."""
    return [[int(w), int(k)] for w, k in layout] + [[int(world_size), int(step)]]


def build_state(kind: str, epoch: int, remaining: list[Any], next_worker: int, config: Mapping[str, Any]) -> dict[str, Any]:
    """A state dict with the :data:`STATE_KEYS`."""
    return {
        "kind": kind,
        "version": STATE_VERSION,
        "epoch": int(epoch),
        "next_worker": int(next_worker),
        "remaining": remaining,
        "config": dict(config),
    }


def check_state(
    state: Any, kind: str, now: Mapping[str, Any], *, ignored: Sequence[str] = (), extra: Sequence[str] = ()
) -> None:
    """Refuse a state that the loading object cannot honour.

    Args:
        state: the state dict to load.
        kind: the kind expected (``"ShardDataset"`` or ``"ShardLoader"``).
        now: the loading object's configuration (the ``config`` it would save).
        ignored: configuration keys allowed to differ.
        extra: further differences found by the caller (one phrase each).

    Raises:
        StateError: not a state of that kind, another version or keys missing,
            or a configuration difference; the message names each one as
            ``key: saved X, now Y``.
    """
    if not isinstance(state, Mapping) or state.get("kind") != kind:
        found = state.get("kind") if isinstance(state, Mapping) else type(state).__name__
        raise StateError(f"not a {kind} state_dict (kind={found!r})")
    if state.get("version") != STATE_VERSION:
        raise StateError(f"{kind} state version {state.get('version')!r} is not supported (expected {STATE_VERSION})")
    missing = [k for k in STATE_KEYS if k not in state]
    if missing:
        raise StateError(f"{kind} state_dict lacks the keys {missing} (a state has {list(STATE_KEYS)})")
    saved = state["config"]
    if not isinstance(saved, Mapping):
        raise StateError(f"{kind} state_dict: config must be a mapping, got {type(saved).__name__}")
    diffs = [f"{k}: saved {saved.get(k)!r}, now {now[k]!r}" for k in now if k not in ignored and saved.get(k) != now[k]]
    diffs.extend(extra)
    if diffs:
        raise StateError(
            f"cannot resume: the {kind} was configured differently when the state was saved ("
            + "; ".join(diffs)
            + "). Resuming needs the same shards, seed, shuffle, split, batch size and world size; "
            "with a manifest the number of workers may change"
        )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_bounds(state: Mapping[str, Any], kind: str, *, items: int | None, world_size: int, max_streams: int) -> None:
    """Refuse values of a (kind- and version-checked) state that no run of this dataset could
    have saved, before anything is sized or looped by them (a state file is as untrusted as a
    manifest: a world size of 1e9 or 200k stages would hang or exhaust the workers).

    Args:
        state: the state (its keys present).
        kind: named in errors.
        items: sized: the samples (items) of one epoch over all ranks; None: unsized.
        world_size: the loading world's size.
        max_streams: the most worker streams an unsized state may list.

    Bounds: ``epoch`` an int in ``[0, MAX_EPOCH)``; ``next_worker`` an int in ``[0, max_streams)``;
    sized: at most :data:`MAX_STAGES` stages, each world size at most ``max(items, world_size)``,
    each stage's steps at most ``items``; unsized: at most ``max_streams`` skips, each an int in
    ``[0, MAX_EPOCH)``.

    Raises:
        StateError: the first value out of bounds, named.
    """
    epoch, nxt = state["epoch"], state["next_worker"]
    if not _is_int(epoch) or not 0 <= epoch < MAX_EPOCH:
        raise StateError(f"{kind} state_dict: epoch {epoch!r} is not an int in [0, 2**62)")
    if not _is_int(nxt) or not 0 <= nxt < max_streams:
        raise StateError(f"{kind} state_dict: next_worker {nxt!r} is not an int in [0, {max_streams})")
    remaining = state["remaining"]
    if not isinstance(remaining, (list, tuple)):
        raise StateError(f"{kind} state_dict: 'remaining' is a {type(remaining).__name__}, not a list")
    if items is None:
        if len(remaining) > max_streams:
            raise StateError(f"{kind} state_dict: 'remaining' lists {len(remaining)} worker streams, more than "
                             f"{max_streams}")
        for skip in remaining:
            if not _is_int(skip) or not 0 <= skip < MAX_EPOCH:
                raise StateError(f"{kind} state_dict: skip {skip!r} in 'remaining' is not a count")
        return
    if len(remaining) > MAX_STAGES:
        raise StateError(f"{kind} state_dict: 'remaining' lists {len(remaining)} stages, more than {MAX_STAGES}")
    stages = parse_layout(remaining, kind)
    widest = max(items, world_size)
    for w, k in stages:
        if w > widest:
            raise StateError(f"{kind} state_dict: world size {w} in 'remaining' is more than the dataset's {items} "
                             f"samples and this world's {world_size} ranks")
        if k > items:
            raise StateError(f"{kind} state_dict: {k} steps in 'remaining' are more than the dataset's {items} samples")

