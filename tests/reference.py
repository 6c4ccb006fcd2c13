"""A small, obviously-correct reader of shardflow datasets, for differential tests.

It shares no code with shardflow: the tar is read by CPython ``tarfile`` (stream
mode), gzip by ``gzip``, zstd by ``zstandard``'s stream reader, the manifest by
``json``, and fields are decoded by the rules of DESIGN.md section 1 with
``json``, ``gzip``, ``numpy.load(allow_pickle=False)`` and Pillow. It is slow and
strict on purpose: a sample whose members are not adjacent, a field that repeats
within a sample or a manifest count that disagrees with the shard raises
:class:`ReferenceError` instead of being guessed at.

Use :func:`read_dataset` for a folder (its ``shardflow.json``, or its ``.tar*``
files in name order), :func:`expected` for what a reader yields of a sample, and
:func:`normalize_sample` to turn a sample, the reference's or shardflow's, into a
plain comparable value.
"""

from __future__ import annotations

import gzip
import io
import json
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
from PIL import Image, ImageOps

__all__ = ["RefSample", "ReferenceError", "read_dataset", "read_shard", "shard_files", "has_offset_index", "split_name", "decode", "expected",
           "normalize", "normalize_sample"]

GZIP_MAGIC = b"\x1f\x8b"
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
IMAGES = ("jpg", "jpeg", "png", "webp")
INTEGERS = ("cls", "idx")


class ReferenceError(Exception):
    """The dataset is not one the reference reads without guessing."""


@dataclass
class RefSample:
    """One sample: its key, the shard file it came from and its fields as stored (bytes)."""

    key: str
    shard: str
    fields: dict[str, bytes]


def _open_tar_stream(raw: BinaryIO) -> BinaryIO:
    """The tar bytes of a shard file: gzip and zstd found by their magic bytes, not the suffix."""
    head = raw.read(4)
    raw.seek(0)
    if head.startswith(GZIP_MAGIC):
        return gzip.GzipFile(fileobj=raw, mode="rb")
    if head.startswith(ZSTD_MAGIC):
        import zstandard

        return zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True)
    return raw


def split_name(name: str) -> tuple[str, str] | None:
    """The webdataset rule: key = path up to the first dot of the basename, field = the rest, lower-cased.

    None for members that are not sample members (basename starting with ``__``, no dot,
    an empty key or field).
    """
    directory, _, base = name.rpartition("/")
    if base.startswith("__"):
        return None
    dot = base.find(".")
    if dot <= 0 or dot == len(base) - 1:
        return None
    return (f"{directory}/{base[:dot]}" if directory else base[:dot]), base[dot + 1 :].lower()


def read_shard(path: str | Path) -> list[RefSample]:
    """Every sample of one shard file, in file order.

    Raises:
        ReferenceError: a key reappears after its sample ended, or a field repeats in a sample.
    """
    samples: list[RefSample] = []
    seen: set[str] = set()
    name = Path(path).name
    with open(path, "rb") as raw, tarfile.open(fileobj=_open_tar_stream(raw), mode="r|", encoding="utf-8") as tar:
        for member in tar:
            if not member.isreg():
                continue  # directories, links, devices: not samples
            split = split_name(member.name)
            if split is None:
                continue
            key, field = split
            data = tar.extractfile(member).read()
            if not samples or samples[-1].key != key:
                if key in seen:
                    raise ReferenceError(f"{path}: key {key!r} reappears after its sample ended")
                seen.add(key)
                samples.append(RefSample(key, name, {}))
            if field in samples[-1].fields:
                raise ReferenceError(f"{path}: sample {key!r} has field {field!r} twice")
            samples[-1].fields[field] = data
    return samples


def shard_files(folder: str | Path) -> list[Path]:
    """The shards of a folder in stream order: the manifest's list, else the ``.tar*`` files by name."""
    folder = Path(folder)
    manifest = folder / "shardflow.json"
    if manifest.exists():
        doc = json.loads(manifest.read_text(encoding="utf-8"))
        if doc.get("format") != "shardflow":
            raise ReferenceError(f"{manifest}: not a shardflow manifest")
        return [folder / entry["url"] for entry in doc["shards"]]
    return sorted(p for p in folder.iterdir() if p.name.endswith((".tar", ".tar.gz", ".tgz", ".tar.zst")))


def has_offset_index(folder: str | Path) -> bool:
    """Whether the folder's manifest gives every shard an offset index (random access, seeking)."""
    manifest = Path(folder) / "shardflow.json"
    if not manifest.exists():
        return False
    shards = json.loads(manifest.read_text(encoding="utf-8"))["shards"]
    return bool(shards) and all(entry.get("index") for entry in shards)


def read_dataset(folder: str | Path) -> tuple[list[RefSample], list[int]]:
    """Every sample of a dataset folder in stored order, and the sample count of each shard.

    Raises:
        ReferenceError: a shard is ill-formed (see :func:`read_shard`), or the manifest's count
            of a shard differs from what the shard holds.
    """
    folder = Path(folder)
    manifest = folder / "shardflow.json"
    listed = None
    if manifest.exists():
        listed = [entry["samples"] for entry in json.loads(manifest.read_text(encoding="utf-8"))["shards"]]
    samples: list[RefSample] = []
    counts: list[int] = []
    for j, path in enumerate(shard_files(folder)):
        got = read_shard(path)
        if listed is not None and listed[j] != len(got):
            raise ReferenceError(f"{path}: the manifest lists {listed[j]} samples, the shard holds {len(got)}")
        samples.extend(got)
        counts.append(len(got))
    return samples, counts


def _image(data: bytes) -> np.ndarray:
    """uint8, shape (H, W, 3): Pillow's RGB conversion (alpha dropped) after the EXIF orientation."""
    with Image.open(io.BytesIO(data)) as img:
        img = ImageOps.exif_transpose(img)
        return np.asarray(img.convert("RGB"))


def decode(field: str, data: bytes, image: str | None = "numpy") -> Any:
    """Decode a field by its last extension (DESIGN.md section 1); unknown extensions stay bytes.

    Args:
        field: the field name (``seg.png``, ``npy.gz``).
        data: its stored bytes.
        image: ``"numpy"`` (uint8, shape (H, W, 3)), ``"torch"`` (uint8 tensor, shape (3, H, W))
            or None (image bytes kept).
    """
    ext = field.rsplit(".", 1)[-1]
    if ext == "gz":
        inner = gzip.decompress(data)
        return decode(field[: -len(".gz")], inner, image) if "." in field else inner
    if ext in IMAGES:
        if image is None:
            return bytes(data)
        array = _image(data)
        if image == "torch":
            import torch

            return torch.from_numpy(array.transpose(2, 0, 1).copy())
        return array
    if ext in INTEGERS:
        return int(data.decode("ascii").strip())
    if ext == "txt":
        return data.decode("utf-8")
    if ext == "json":
        return json.loads(data.decode("utf-8"))
    if ext == "npy":
        return np.load(io.BytesIO(data), allow_pickle=False)
    return bytes(data)


def expected(sample: RefSample, mode: str | None) -> dict[str, Any]:
    """What a shardflow reader with ``decode=mode`` yields for ``sample``: ``__key__``, ``__url__``
    (the shard's file name) and the fields decoded (``mode`` None: every field as stored bytes)."""
    out: dict[str, Any] = {"__key__": sample.key, "__url__": sample.shard}
    for name, data in sample.fields.items():
        out[name] = bytes(data) if mode is None else decode(name, data, mode)
    return out


def normalize_sample(sample: dict[str, Any]) -> tuple:
    """A sample dict in a plain, exactly comparable form: ``__key__``, the basename of ``__url__``
    and the fields (see :func:`normalize`); other ``__`` entries such as ``__source__`` are dropped."""
    out = {}
    for k, v in sample.items():
        if k == "__url__":
            out[k] = str(v).rsplit("/", 1)[-1]
        elif k == "__key__" or not k.startswith("__"):
            out[k] = normalize(v)
    return tuple(sorted(out.items()))


def normalize(value: Any) -> Any:
    """A plain, exactly comparable form of a decoded value.

    Arrays and tensors become ``(kind, dtype, shape, bytes in C order)``, bytes-likes ``bytes``,
    floats their hex form (so -0.0 and 0.0 differ), JSON objects sorted item tuples.
    """
    if isinstance(value, dict):
        return ("dict", tuple(sorted((k, normalize(v)) for k, v in value.items())))
    if isinstance(value, np.ndarray):
        return ("ndarray", value.dtype.str, value.shape, np.ascontiguousarray(value).tobytes())
    if type(value).__module__ == "torch" and type(value).__name__ == "Tensor":
        array = value.numpy()
        return ("tensor", array.dtype.str, array.shape, np.ascontiguousarray(array).tobytes())
    if isinstance(value, (bytes, bytearray, memoryview)):
        return ("bytes", bytes(value))
    if isinstance(value, list):
        return ("list", tuple(normalize(v) for v in value))
    if isinstance(value, float):
        return ("float", value.hex())
    if isinstance(value, bool):
        return ("bool", value)
    if isinstance(value, int):
        return ("int", value)
    return (type(value).__name__, value)
