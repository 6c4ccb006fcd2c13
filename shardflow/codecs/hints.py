"""What to suggest when a requested image field is missing: the ``"image"`` alias.

ImageNet's files are ``.JPEG`` with a few PNGs among them, so a dataset converted from it has
samples with ``jpeg`` (or ``jpg``) and samples with ``png``; ``fields=("jpg", "cls")`` then fails
on the first sample that is not a ``jpg``. The alias ``"image"`` takes whichever image field a
sample has (:func:`shardflow.codecs.field_alternatives`).
"""

from __future__ import annotations

from collections.abc import Iterable

from . import IMAGE_FIELD, is_image_field

__all__ = ["missing_field_hint"]


def missing_field_hint(name: str, present: Iterable[str]) -> str:
    """The end of a missing-field message: ``""``, or, when ``name`` asks for image formats
    and another image field is present, ``"; its images are stored as 'png': ask for 'image'..."``.

    Args:
        name: the requested field (``"jpg"``, ``"jpg;png"``).
        present: the fields the sample (or the dataset) has.
    """
    others = sorted(p for p in present if p != name and is_image_field(p))
    if not others or not all(is_image_field(a) and a != IMAGE_FIELD for a in name.split(";")):
        return ""
    return (f"; its images are stored as {', '.join(map(repr, others))}: ask for {IMAGE_FIELD!r} "
            f"(fields=({IMAGE_FIELD!r}, ...)), which takes whichever image format a sample has")
