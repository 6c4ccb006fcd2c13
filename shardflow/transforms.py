"""Per-field transforms: plug a function of one value (a torchvision transform) into a sample.

``ShardDataset(transform=...)`` takes a function of the whole sample dict. Most image
transforms (torchvision's ``v2.Resize``, ``v2.RandomResizedCrop``, ...) take one image
instead; :func:`map_fields` applies such functions field by field::

    from torchvision.transforms import v2
    ds = shardflow.ShardDataset(url, decode="torch", fields=("image", "cls"),
                                transform={"image": v2.Resize((224, 224))})
    # the same as transform=shardflow.map_fields(image=v2.Resize((224, 224)))

A mapping given as ``transform=`` is turned into a :class:`FieldMap` by the dataset.
:class:`Resize` is a dependency-free image resize for the same slot (what the ``resize``
key of a pipeline config and ``shardflow bench --resize`` use).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from .codecs import field_alternatives
from .errors import MissingFieldError

__all__ = ["Chain", "FieldMap", "Resize", "map_fields"]


class FieldMap:
    """A sample transform that applies one function per field.

    Picklable when its functions are, so it reaches DataLoader workers.

    Args:
        functions: field name -> ``fn(value) -> value``. A name may be the image-field
            alias ``"image"`` or list alternatives (``"jpg;png"``): the first field
            the sample has is transformed, under its own name.

    Raises:
        TypeError: a function is not callable, or a name is not a non-empty str.
    """

    def __init__(self, functions: Mapping[str, Callable[[Any], Any]]) -> None:
        for name, fn in functions.items():
            if not isinstance(name, str) or not name:
                raise TypeError(f"field names must be non-empty str, got {name!r}")
            if not callable(fn):
                raise TypeError(f"the transform of field {name!r} is not callable: {fn!r}")
        self.functions = dict(functions)
        self._lookup = [(name, field_alternatives(name), fn) for name, fn in self.functions.items()]

    def __call__(self, sample: Mapping[str, Any]) -> dict[str, Any]:
        """Return a copy of ``sample`` with each named field transformed.

        Raises:
            MissingFieldError: the sample has none of a name's fields (names the key and
                the fields present).
        """
        out = dict(sample)
        for name, alternatives, fn in self._lookup:
            found = next((alt for alt in alternatives if alt in out), None)
            if found is None:
                present = sorted(k for k in out if not k.startswith("__"))
                raise MissingFieldError(
                    f"sample {out.get('__key__')!r}: no field {name!r} to transform "
                    f"(fields present: {present})"
                )
            out[found] = fn(out[found])
        return out

    def __repr__(self) -> str:
        inner = ", ".join(f"{name!r}: {getattr(fn, '__qualname__', fn)!r}"
                          for name, fn in self.functions.items())
        return f"FieldMap({{{inner}}})"


def map_fields(functions: Mapping[str, Callable[[Any], Any]] | None = None, /,
               **by_name: Callable[[Any], Any]) -> FieldMap:
    """A sample transform applying one function per field (see :class:`FieldMap`).

    Args:
        functions: field name -> function; names that are not Python identifiers
            (``"seg.png"``) go here.
        **by_name: more field name -> function pairs (``image=v2.Resize(224)``).

    Returns:
        A picklable ``transform(sample) -> sample`` for ``ShardDataset(transform=...)``.
    """
    return FieldMap({**(functions or {}), **by_name})


class Resize:
    """Resize one decoded image to ``(height, width)`` pixels, in the form it came in.

    Takes what ``decode=`` gives: a ``PIL.Image``, a uint8 array of shape (H, W, C) or a
    uint8 tensor of shape (C, H, W) (C = 1, 3 or 4), and returns the same type with the
    new size; bilinear with antialiasing (Pillow's), aspect ratio not kept (as
    torchvision's ``v2.Resize((h, w))``). Picklable.

    Args:
        size: ``(height, width)`` in pixels, or one int for a square.

    Raises:
        ValueError: a size that is not one or two positive ints.
        TypeError: (when called) a value that is not a decoded image (bytes: the
            dataset was built with ``decode=None``).
    """

    def __init__(self, size: int | Sequence[int]) -> None:
        dims = (size, size) if isinstance(size, int) else tuple(size)
        if len(dims) != 2 or not all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in dims):
            raise ValueError(f"resize size must be a positive int or (height, width), got {size!r}")
        self.size: tuple[int, int] = (dims[0], dims[1])

    def __call__(self, img: Any) -> Any:
        from PIL import Image

        h, w = self.size
        if isinstance(img, Image.Image):
            return img.resize((w, h), Image.Resampling.BILINEAR)
        if type(img).__module__.startswith("torch"):
            import torch

            if img.dim() != 3 or img.dtype != torch.uint8:
                raise TypeError(f"Resize takes a uint8 tensor of shape (C, H, W), got {img.dtype} {tuple(img.shape)}")
            out = self._array(img.permute(1, 2, 0).numpy(), w, h)
            return torch.from_numpy(out).permute(2, 0, 1).contiguous()
        if isinstance(img, np.ndarray):
            return self._array(img, w, h)
        raise TypeError(f"Resize takes a decoded image (PIL image, uint8 array or tensor), got "
                        f"{type(img).__name__}; build the dataset with decode='numpy', 'torch' or 'pil'")

    @staticmethod
    def _array(arr: np.ndarray, w: int, h: int) -> np.ndarray:
        from PIL import Image

        if arr.dtype != np.uint8 or arr.ndim != 3 or arr.shape[2] not in (1, 3, 4):
            raise TypeError(f"Resize takes uint8 images with 1, 3 or 4 channels, got {arr.dtype} {arr.shape}")
        channels = arr.shape[2]
        pil = Image.fromarray(np.ascontiguousarray(arr[:, :, 0] if channels == 1 else arr))
        out = np.array(pil.resize((w, h), Image.Resampling.BILINEAR))  # writable, as decoded images are
        return out[:, :, None] if channels == 1 else out

    def __repr__(self) -> str:
        return f"Resize({self.size})"


class Chain:
    """Sample transforms applied one after the other (a returned None stops the chain)."""

    def __init__(self, *transforms: Callable[[Any], Any]) -> None:
        self.transforms = transforms

    def __call__(self, sample: Any) -> Any:
        for t in self.transforms:
            if sample is None:
                return None
            sample = t(sample)
        return sample

    def __repr__(self) -> str:
        return f"Chain{self.transforms!r}"
