"""One-to-many samples: several training items from one stored sample.

An :class:`Expand` turns one decoded sample into exactly ``count`` items (for
example ``k`` random crops of a large matrix, or the tiles of an image). The
dataset applies it *before* the shuffle buffer, so the items of one sample
spread across batches, and plans epochs in items: ``len()``, the rank split,
batches and resumption all count ``count`` items per stored sample. Each
sample is read and decoded once per epoch. Randomness is drawn from a
generator seeded by ``(seed, epoch, key)``, so the items are the same for the
same seed and epoch, whatever the rank, worker or resumption point.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["Expand", "random_crops", "tiles"]


@dataclass(frozen=True)
class Expand:
    """A one-to-many stage.

    Attributes:
        fn: ``fn(sample, rng) -> list of count items``; ``sample`` is the
            decoded sample dict, ``rng`` a ``numpy.random.Generator`` seeded by
            ``(seed, epoch, key)``. Must be picklable for DataLoader workers
            started with spawn (a module-level function or a dataclass).
        count: items per sample, fixed (so epochs can be planned from counts).
    """

    fn: Callable[[dict[str, Any], np.random.Generator], Sequence[Any]]
    count: int

    def __post_init__(self) -> None:
        if not isinstance(self.count, int) or self.count < 1:
            raise ValueError(f"Expand.count must be a positive int, got {self.count!r}")


def _hw(arr: Any) -> tuple[int, int, bool]:
    """Height, width and whether the array is channels-first (a CHW torch tensor)."""
    if hasattr(arr, "permute") and arr.ndim == 3 and arr.shape[0] in (1, 3, 4) and arr.shape[-1] not in (1, 3, 4):
        return int(arr.shape[1]), int(arr.shape[2]), True
    return int(arr.shape[0]), int(arr.shape[1]), False


@dataclass(frozen=True)
class _Crops:
    field: str
    size: tuple[int, int]
    count: int

    def __call__(self, sample: dict[str, Any], rng: np.random.Generator) -> list[dict[str, Any]]:
        arr = sample[self.field]
        h, w, chw = _hw(arr)
        ch, cw = self.size
        if ch > h or cw > w:
            raise ValueError(f"crop {ch}x{cw} is larger than field {self.field!r} of {h}x{w}")
        ys = rng.integers(0, h - ch + 1, self.count)
        xs = rng.integers(0, w - cw + 1, self.count)
        out = []
        for j, (y, x) in enumerate(zip(ys.tolist(), xs.tolist())):
            crop = arr[:, y : y + ch, x : x + cw] if chw else arr[y : y + ch, x : x + cw]
            item = dict(sample)
            item[self.field] = crop.copy() if hasattr(crop, "copy") else crop.clone()
            item["__key__"] = f"{sample['__key__']}#{j}"
            item["crop_yx"] = (y, x)
            out.append(item)
        return out


@dataclass(frozen=True)
class _Tiles:
    field: str
    size: tuple[int, int]
    grid: tuple[int, int]

    def __call__(self, sample: dict[str, Any], rng: np.random.Generator) -> list[dict[str, Any]]:
        arr = sample[self.field]
        h, w, chw = _hw(arr)
        th, tw = self.size
        rows, cols = self.grid
        if rows * th > h or cols * tw > w:
            raise ValueError(f"{rows}x{cols} tiles of {th}x{tw} do not fit field {self.field!r} of {h}x{w}")
        out = []
        for r in range(rows):
            for c in range(cols):
                y, x = r * th, c * tw
                tile = arr[:, y : y + th, x : x + tw] if chw else arr[y : y + th, x : x + tw]
                item = dict(sample)
                item[self.field] = tile.copy() if hasattr(tile, "copy") else tile.clone()
                item["__key__"] = f"{sample['__key__']}#{r * cols + c}"
                item["crop_yx"] = (y, x)
                out.append(item)
        return out


def random_crops(field: str, size: int | tuple[int, int], count: int) -> Expand:
    """``count`` random crops of ``size`` (pixels, (height, width)) from an array field.

    The field must hold an array shaped (H, W, ...) or a CHW tensor. Each item
    keeps the sample's other fields, gets ``__key__`` ``"<key>#<j>"`` and
    ``crop_yx`` (the crop's top-left corner). Crop positions are uniform and
    reproducible per ``(seed, epoch, key)``.
    """
    hw = (size, size) if isinstance(size, int) else tuple(size)
    return Expand(_Crops(field, hw, count), count)  # type: ignore[arg-type]


def tiles(field: str, size: int | tuple[int, int], grid: tuple[int, int]) -> Expand:
    """The ``rows x cols`` tiles of ``size`` from the top-left corner, row by row."""
    hw = (size, size) if isinstance(size, int) else tuple(size)
    return Expand(_Tiles(field, hw, tuple(grid)), grid[0] * grid[1])  # type: ignore[arg-type]
