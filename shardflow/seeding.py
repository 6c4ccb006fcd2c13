"""Randomness keyed by the sample: a sample's augmentation depends on the sample alone.

Before a per-sample transform (and ``expand``) runs, torch's default CPU generator,
numpy's legacy global generator (``np.random.*``) and Python's ``random`` module are
seeded from ``(seed, epoch, key)``; before a batch is collated, from
``(seed, epoch, rank, batch index)``. So a random crop of sample ``k`` in epoch ``e``
is the same with 0 or 8 workers, on 1 or 4 ranks, in a rerun and after a resume,
and differs between epochs. Each sample is seeded afresh, so nothing one sample
draws leaks into the next. DESIGN.md §10.

Seeds are 64-bit values from BLAKE2b over the parts (stable across machines and
Python versions, unlike ``hash()``). The generators are seeded directly
(``torch.default_generator.manual_seed``, not ``torch.manual_seed``, which also
seeds every CUDA device and costs ~100 us in a DataLoader worker).

A transform that prefers an explicit generator to the global ones calls
:func:`sample_rng` (numpy) or :func:`sample_generator` (torch) while it runs:
both are seeded from the same per-sample seed.
"""

from __future__ import annotations

import functools
import hashlib
import random
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import numpy as np
import torch

__all__ = ["Seeder", "sample_seed", "batch_seed", "sample_rng", "sample_generator", "current_seed", "GlobalRNGState", "restoring"]

_MASK32 = 0xFFFFFFFF
T = TypeVar("T")
_current: list[int | None] = [None]  # the seed of the sample or batch being prepared (None: outside one)


def _digest(prefix: bytes, part: bytes) -> int:
    h = hashlib.blake2b(prefix, digest_size=8)
    h.update(part)
    return int.from_bytes(h.digest(), "little")


def _prefix(kind: str, seed: int, epoch: int) -> bytes:
    return f"shardflow/{kind}/{int(seed)}/{int(epoch)}/".encode()


def sample_seed(seed: int, epoch: int, key: str) -> int:
    """The 64-bit seed of sample ``key`` in ``epoch`` of a dataset seeded ``seed``.

    Args:
        seed: the dataset's seed (``ShardDataset(seed=...)``).
        epoch: the epoch (``set_epoch``).
        key: the sample's ``__key__``.

    Returns:
        An int in ``[0, 2**64)``; equal inputs give equal seeds on every machine.
    """
    return _digest(_prefix("sample", seed, epoch), key.encode("utf-8", "surrogatepass"))


def batch_seed(seed: int, epoch: int, rank: int, index: int) -> int:
    """The 64-bit seed of batch ``index`` of ``rank`` in ``epoch`` (see :func:`sample_seed`)."""
    return _digest(_prefix("batch", seed, epoch), f"{int(rank)}/{int(index)}".encode())


def _seed_globals(value: int) -> None:
    """Seed torch's default CPU generator, numpy's global and Python's ``random`` from ``value``."""
    _current[0] = value
    torch.default_generator.manual_seed(value)
    np.random.seed(value & _MASK32)  # the legacy global generator takes 32 bits
    random.seed(value)


class Seeder:
    """Seeds the global generators per sample and per batch, for one epoch of one dataset.

    Args:
        seed: the dataset's seed.
        epoch: the epoch being read.
        rank: this process's rank (batch seeds only; sample seeds do not depend on it).
        enabled: False to leave the global generators alone (``ShardDataset(sample_seeding=False)``).
    """

    __slots__ = ("enabled", "_sample", "_batch", "_rank")

    def __init__(self, seed: int, epoch: int, rank: int = 0, enabled: bool = True) -> None:
        self.enabled = enabled
        self._sample = _prefix("sample", seed, epoch)
        self._batch = _prefix("batch", seed, epoch)
        self._rank = int(rank)

    def sample(self, key: str) -> None:
        """Seed the global generators for the sample ``key`` (a no-op when disabled)."""
        if self.enabled:
            _seed_globals(_digest(self._sample, key.encode("utf-8", "surrogatepass")))

    def batch(self, index: int) -> None:
        """Seed the global generators for batch ``index`` of this rank's epoch."""
        if self.enabled:
            _seed_globals(_digest(self._batch, f"{self._rank}/{int(index)}".encode()))

    def done(self) -> None:
        """Mark the end of a sample's or batch's preparation (``sample_rng`` raises after it)."""
        _current[0] = None

    def wrap(self, fn: Callable[[Any], Any]) -> Callable[[Any], Any]:
        """``fn(sample)`` run with the generators seeded for ``sample["__key__"]``."""
        if not self.enabled:
            return fn

        @functools.wraps(fn)  # errors name the user's transform, not this wrapper
        def seeded(sample: Any) -> Any:
            self.sample(sample["__key__"])
            try:
                return fn(sample)
            finally:
                _current[0] = None

        return seeded


def current_seed() -> int:
    """The seed of the sample (or batch) being prepared in this process.

    Raises:
        RuntimeError: when called outside a per-sample transform, ``expand`` or collate
            run by a :class:`~shardflow.ShardDataset` with sample seeding on.
    """
    value = _current[0]
    if value is None:
        raise RuntimeError(
            "shardflow.sample_rng() is only defined inside a per-sample transform, expand or collate_fn "
            "run by a ShardDataset with sample_seeding=True"
        )
    return value


def sample_rng() -> np.random.Generator:
    """A numpy ``Generator`` (PCG64) seeded for the sample (or batch) being prepared.

    Call it inside a transform: the same sample gives the same draws in every run,
    worker layout and resume, like the global generators. Raises ``RuntimeError``
    outside a transform (see :func:`current_seed`).
    """
    return np.random.Generator(np.random.PCG64(current_seed()))


def sample_generator() -> torch.Generator:
    """A CPU ``torch.Generator`` seeded for the sample (or batch) being prepared.

    For torch code that takes ``generator=`` (``torch.rand(..., generator=g)``,
    ``torch.randperm``). Raises ``RuntimeError`` outside a transform.
    """
    g = torch.Generator()
    g.manual_seed(current_seed())
    return g


class GlobalRNGState:
    """The three global generators' states, saved and restored around data loading.

    With ``num_workers=0`` the samples are prepared in the training process: the
    loader saves the states before it prepares a batch and restores them after, so
    the training loop's own draws (dropout, initialisation) do not depend on the data.
    """

    __slots__ = ("_torch", "_numpy", "_python")

    def __init__(self) -> None:
        self._torch = torch.default_generator.get_state()
        self._numpy = np.random.get_state()
        self._python = random.getstate()

    def restore(self) -> None:
        """Put the saved states back."""
        torch.default_generator.set_state(self._torch)
        np.random.set_state(self._numpy)
        random.setstate(self._python)
        _current[0] = None


def restoring(items: Iterator[T]) -> Iterator[T]:
    """``items``, with the global generators put back after each item is made.

    Every ``next()`` runs with the caller's generator states saved first and
    restored before the item is handed over, so the seeding done while making it
    (and the transform's draws) leave no trace in the consuming process. Closing
    this generator closes ``items``.
    """
    try:
        while True:
            saved = GlobalRNGState()
            try:
                item = next(items)
            except StopIteration:
                return
            finally:
                saved.restore()
            yield item
    finally:
        close = getattr(items, "close", None)
        if close is not None:
            close()
