"""Randomness keyed by the sample: a sample's augmentation depends on the sample alone.

Before a per-sample transform (and ``expand``) runs, torch's default CPU generator,
numpy's legacy global generator (``np.random.*``) and Python's ``random`` module are
seeded from ``(seed, epoch, key)``; before a user's ``collate_fn`` runs on a batch, from
``(seed, epoch, rank, batch index)`` (shardflow's own collate draws nothing, so a batch
it makes, of samples that no transform touched, is made without seeding or restoring
anything). So a random crop of sample ``k`` in epoch ``e`` is the same with 0 or 8
workers, on 1 or 4 ranks, in a rerun and after a resume, and differs between epochs.
Each sample is seeded afresh, so nothing one sample draws leaks into the next.
DESIGN.md §10.

Seeds are 64-bit values from BLAKE2b over the parts (stable across machines and
Python versions, unlike ``hash()``). Each generator takes its own bits of the seed, so
one sample's torch and numpy streams are unrelated: torch's default generator the low
32 bits (``torch.default_generator.manual_seed(seed)``; its Mersenne Twister keeps 32),
numpy's global ``RandomState`` the high 32 bits (``np.random.seed(seed >> 32)``) and
Python's ``random`` all 64 (``random.seed(seed)``). The generators are seeded directly:
not ``torch.manual_seed``, which also seeds every CUDA device (far slower in a
DataLoader worker), and Python's through the C ``seed`` that ``random.seed`` ends in
(the same state, without the wrapper's type checks).

Seeding all three costs a few microseconds per sample, most of it Python's
``random`` (its seeding expands the seed through a 624-word ``init_by_array``);
``sample_seeding=("torch",)`` seeds only torch's generator, enough for torchvision's
v2 transforms (docs/benchmarks.md has the figures per generator).

A transform that prefers an explicit generator to the global ones calls
:func:`sample_rng` (numpy) or :func:`sample_generator` (torch) while it runs:
both are seeded from the same per-sample seed.
"""

from __future__ import annotations

import functools
import hashlib
import random
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

import numpy as np
import torch

__all__ = [
    "GENERATORS", "generators", "Seeder", "sample_seed", "batch_seed", "sample_rng", "sample_generator",
    "current_seed", "GlobalRNGState", "restoring",
]

GENERATORS = ("torch", "numpy", "python")  # the global generators sample seeding can seed
T = TypeVar("T")
_current: list[int | None] = [None]  # the seed of the sample or batch being prepared (None: outside one)
_PYTHON = random.seed.__self__  # the Random instance behind the random.* functions
# the C seed() of random.Random's base: the state random.seed sets, without its wrapper's checks
_seed_python_c = super(random.Random, _PYTHON).seed


def _digest(prefix: bytes, part: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(prefix + part, digest_size=8).digest(), "little")


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
        torch's generator is seeded with it (and keeps its low 32 bits), numpy's
        global with ``seed >> 32``, Python's ``random`` with all of it.
    """
    return _digest(_prefix("sample", seed, epoch), key.encode("utf-8", "surrogatepass"))


def batch_seed(seed: int, epoch: int, rank: int, index: int) -> int:
    """The 64-bit seed of batch ``index`` of ``rank`` in ``epoch`` (see :func:`sample_seed`)."""
    return _digest(_prefix("batch", seed, epoch), f"{int(rank)}/{int(index)}".encode())


def generators(option: bool | str | Iterable[str] | None) -> tuple[str, ...]:
    """The generators a ``sample_seeding`` option names, in :data:`GENERATORS` order.

    Args:
        option: True (all three), False or None (none), one name, or several
            names out of ``"torch"``, ``"numpy"``, ``"python"``.

    Returns:
        A tuple of names; empty when seeding is off.

    Raises:
        ValueError: a name that is not one of :data:`GENERATORS`.
        TypeError: neither a bool nor names (an int, say).
    """
    if isinstance(option, (bool, np.bool_)):
        return GENERATORS if option else ()
    if option is None:
        return ()
    if not isinstance(option, (str, Iterable)):
        raise TypeError(f"sample_seeding must be True, False or generator names out of {list(GENERATORS)}, got {option!r}")
    names = {option} if isinstance(option, str) else set(option)
    unknown = sorted(str(n) for n in names - set(GENERATORS))
    if unknown:
        raise ValueError(f"sample_seeding names unknown generators {unknown}; known: {list(GENERATORS)} (or True / False)")
    return tuple(g for g in GENERATORS if g in names)


def _seed_globals(value: int, which: tuple[bool, bool, bool]) -> None:
    """Seed the chosen global generators (torch, numpy, python) from ``value``, exactly as
    ``torch.default_generator.manual_seed(value)``, ``np.random.seed(value >> 32)`` and
    ``random.seed(value)`` would."""
    _current[0] = value
    if which[0]:
        torch.default_generator.manual_seed(value)
    if which[1]:
        np.random.seed(value >> 32)
    if which[2]:
        _seed_python_c(value)
        _PYTHON.gauss_next = None  # random.seed clears gauss()'s cached draw; so must we


class Seeder:
    """Seeds the global generators per sample and per batch, for one epoch of one dataset.

    Args:
        seed: the dataset's seed.
        epoch: the epoch being read.
        rank: this process's rank (batch seeds only; sample seeds do not depend on it).
        enabled: the generators to seed (see :func:`generators`): True for all three,
            False to leave them alone (``ShardDataset(sample_seeding=False)``).
    """

    __slots__ = ("enabled", "_which", "_sample", "_batch", "_rank")

    def __init__(self, seed: int, epoch: int, rank: int = 0, enabled: bool | str | Iterable[str] = True) -> None:
        names = generators(enabled)
        self.enabled = bool(names)
        self._which = tuple(g in names for g in GENERATORS)
        # the prefix hashed once: each key continues a copy (the digest of prefix + key, cheaper)
        self._sample = hashlib.blake2b(_prefix("sample", seed, epoch), digest_size=8)
        self._batch = _prefix("batch", seed, epoch)
        self._rank = int(rank)

    def sample(self, key: str) -> None:
        """Seed the global generators for the sample ``key`` (a no-op when disabled)."""
        if self.enabled:
            h = self._sample.copy()
            h.update(key.encode("utf-8", "surrogatepass"))
            _seed_globals(int.from_bytes(h.digest(), "little"), self._which)

    def batch(self, index: int) -> None:
        """Seed the global generators for batch ``index`` of this rank's epoch."""
        if self.enabled:
            _seed_globals(_digest(self._batch, f"{self._rank}/{int(index)}".encode()), self._which)

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
    """Global generators' states, saved and restored around data loading.

    With ``num_workers=0`` the samples are prepared in the training process: the
    loader saves the states before it prepares a batch and restores them after, so
    the training loop's own draws (dropout, initialisation) do not depend on the data.

    Args:
        names: the generators to save (those sample seeding touches; see :func:`generators`).
    """

    __slots__ = ("_torch", "_numpy", "_python")

    def __init__(self, names: tuple[str, ...] = GENERATORS) -> None:
        self._torch = torch.default_generator.get_state() if "torch" in names else None
        self._numpy = np.random.get_state() if "numpy" in names else None
        self._python = random.getstate() if "python" in names else None

    def restore(self) -> None:
        """Put the saved states back."""
        if self._torch is not None:
            torch.default_generator.set_state(self._torch)
        if self._numpy is not None:
            np.random.set_state(self._numpy)
        if self._python is not None:
            random.setstate(self._python)
        _current[0] = None


def restoring(items: Iterator[T], names: tuple[str, ...] = GENERATORS) -> Iterator[T]:
    """``items``, with the global generators ``names`` put back after each item is made.

    Every ``next()`` runs with the caller's generator states saved first and
    restored before the item is handed over, so the seeding done while making it
    (and the transform's draws) leave no trace in the consuming process. Closing
    this generator closes ``items``.
    """
    try:
        while True:
            saved = GlobalRNGState(names)
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
