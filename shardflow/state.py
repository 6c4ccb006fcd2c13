"""The resume contract shared by :class:`~shardflow.ShardDataset` and :class:`~shardflow.loading.ShardLoader`.

A state is a plain dict (JSON-able, picklable) with constant keys
(:data:`STATE_KEYS`) and a version (:data:`STATE_VERSION`):

- ``kind``: ``"ShardDataset"`` (iterated directly) or ``"ShardLoader"``.
- ``version``: :data:`STATE_VERSION`; another version is refused.
- ``epoch``: the epoch the state resumes.
- ``remaining``: what is left of that epoch, per stream (``[]``: nothing read yet,
  the epoch starts afresh). Sized: runs ``[start, stop)`` of batch numbers per
  worker; unsized: the units each worker stream has passed.
- ``next_worker``: the stream the DataLoader takes the next batch from.
- ``config``: the configuration the position is valid for (shards, seed, shuffle,
  split, batch size, world); :func:`check_state` compares it with the loading
  object's and names every difference.
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
    "encode_runs",
    "decode_runs",
    "build_state",
    "check_state",
]

STATE_VERSION = 1
STATE_KEYS = ("kind", "version", "epoch", "remaining", "next_worker", "config")


@dataclass(frozen=True)
class ResumePoint:
    """Where the next iteration resumes: the remaining units per worker.

    Attributes:
        epoch: the epoch being resumed.
        assignment: sized: ``assignment[w]`` lists the batch numbers worker
            ``w`` still yields, in order.
        skip: unsized: ``skip[w]`` counts the units worker ``w`` skips.
        streams: unsized: ``streams[w]`` is the stream (worker position of the
            saved run: its shards and shuffle seed) that worker ``w`` continues.
    """

    epoch: int
    assignment: tuple[tuple[int, ...], ...]
    skip: tuple[int, ...] = ()
    streams: tuple[int, ...] = ()


def encode_runs(ids: Sequence[int]) -> list[list[int]]:
    """Compress an ordered list of ints into ``[start, stop)`` runs (for a compact state)."""
    out: list[list[int]] = []
    for i in ids:
        if out and out[-1][1] == i:
            out[-1][1] = i + 1
        else:
            out.append([int(i), int(i) + 1])
    return out


def decode_runs(runs: Sequence[Sequence[int]]) -> list[int]:
    """The ints of :func:`encode_runs` runs, in order."""
    return [i for a, b in runs for i in range(int(a), int(b))]


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
