"""The constructor arguments of :class:`~shardflow.dataset.ShardDataset` that take several
forms, each made into one (a shuffle, a decode), and the check that a transform can reach
spawned DataLoader workers."""

from __future__ import annotations

import pickle
from dataclasses import replace
from typing import Any

from ..codecs import DecodeOptions, with_limits
from ..planning.plan import ShuffleConfig
from ..storage import IOOptions

__all__ = ["shuffle_config", "decode_options", "check_picklable_transform"]


def shuffle_config(shuffle: bool | int | ShuffleConfig | None) -> ShuffleConfig:
    """A ``shuffle=`` argument as a :class:`ShuffleConfig` (True: the defaults; an int: the
    buffer size; False/None: off).

    Raises:
        ValueError: any other value.
    """
    if isinstance(shuffle, ShuffleConfig):
        return shuffle
    if shuffle is True:
        return ShuffleConfig()
    if shuffle is False or shuffle is None:
        return ShuffleConfig.off()
    if isinstance(shuffle, int) and shuffle >= 0:
        return ShuffleConfig(buffer=shuffle)
    raise ValueError(f"shuffle must be a bool, a buffer size or a ShuffleConfig, got {shuffle!r}")


def decode_options(decode: str | DecodeOptions | None, max_pixels: int | None, io: IOOptions) -> DecodeOptions | None:
    """A ``decode=`` argument (a name, options or None) with ``max_pixels`` and the members'
    size limits of ``io`` applied (compressed fields)."""
    if isinstance(decode, DecodeOptions) or decode is None:
        out = decode
    else:
        out = DecodeOptions(image=decode)
    if max_pixels is not None:
        out = replace(out or DecodeOptions(image=None), max_pixels=max_pixels)
    return with_limits(out, io.limits)


def check_picklable_transform(transform: Any) -> None:
    """Raise a clear TypeError if a user transform cannot reach spawned DataLoader workers."""
    if transform is None:
        return
    try:
        pickle.dumps(transform)
    except Exception as e:
        raise TypeError(
            f"the transform {transform!r} cannot be pickled ({e}), so it cannot reach DataLoader "
            "workers started with 'spawn' or 'forkserver'; define it at module level (not a lambda or a "
            "local function), or use the 'fork' start method"
        ) from e
