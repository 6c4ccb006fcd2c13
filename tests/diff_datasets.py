"""Random shard datasets for the differential suite (tests/test_differential.py).

A :class:`Spec` is a handful of numbers; :func:`write_dataset` turns it into a dataset
folder deterministically (everything random comes from ``Spec.seed``), so a failing
example replays from its printed spec alone (``SHARDFLOW_DIFF_REPLAY``, see
docs/testing.md). Samples have 1 to 64 fields of every codec of DESIGN.md section 1
(``jpg jpeg png webp cls idx txt json npy``, ``gz`` around any of them, unknown
extensions kept as bytes), field sizes from 0 B up, with ``Spec.big`` forcing fields of
exact sizes (across the 1 MiB and 4 MiB boundaries of the tar reader and of its 4 MiB
chunks, up to 8 MiB); keys with Unicode, long paths (> 100 and > 255 bytes: PAX
headers) and dots in directory names.
"""

from __future__ import annotations

import gzip
import io
import json
import random
import shutil
import tarfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from shardflow import ShardWriter
from shardflow.writing.indexing import index_shards
from shardflow.writing.writer import encode_sample_dict

__all__ = ["Spec", "LAYOUTS", "COMPRESSIONS", "BOUNDARIES", "BIG_KINDS", "WRITERS", "samples_of", "copy_dataset", "write_dataset", "writer_compresses", "spec_from_json"]

MIB = 1 << 20
BOUNDARIES = (MIB - 1, MIB, MIB + 1, 4 * MIB - 1, 4 * MIB, 4 * MIB + 1, 8 * MIB)
"""Field sizes around the reader's thresholds: members of 1 MiB and more are read into a
bytearray; 4 MiB is the default read block (a member crosses chunks)."""

LAYOUTS = ("indexed", "no_index", "bare")
"""``indexed``: manifest and offset index; ``no_index``: manifest without offset index;
``bare``: tar files alone (an unsized stream)."""

WRITERS = ("shardflow", "tarfile-gnu", "tarfile-pax")
"""Who writes the shards: :class:`ShardWriter`, or CPython ``tarfile`` as other tools do."""

COMPRESSIONS = ("none", "gzip", "zstd", "zstd-writer")
"""``gzip``/``zstd``: shards compressed after writing (``.tar.gz``/``.tar.zst`` from elsewhere,
indexed by ``index_shards`` unless bare); ``zstd-writer``: ``ShardWriter(compression="zstd")``."""


def writer_compresses() -> bool:
    """Whether ``ShardWriter`` takes ``compression=`` (engineer ``zstd``'s work); the
    ``zstd-writer`` examples run only then."""
    import inspect

    return "compression" in inspect.signature(ShardWriter).parameters


@dataclass(frozen=True)
class Spec:
    """One random dataset.

    Attributes:
        seed: every random choice of the content.
        samples: number of samples (>= 1).
        max_count: samples per shard (the writer rotates).
        layout: one of :data:`LAYOUTS`.
        compression: one of :data:`COMPRESSIONS`.
        big: exact sizes in bytes of extra large fields, spread over the samples.
        wide: one sample gets up to 64 fields.
        writer: ``"shardflow"`` (:class:`ShardWriter`) or one of :data:`WRITERS`' others: shards
            written by CPython ``tarfile`` (see :func:`_write_foreign`), indexed unless bare.
        big_kind: the codec of the large fields (one of :data:`BIG_KINDS`), or "" for each in turn.
    """

    seed: int
    samples: int
    max_count: int
    layout: str = "indexed"
    compression: str = "none"
    big: tuple[int, ...] = ()
    wide: bool = False
    big_kind: str = ""
    writer: str = "shardflow"

    def to_json(self) -> str:
        return json.dumps(asdict(self))



def spec_from_json(text: str) -> Spec:
    doc = json.loads(text)
    doc["big"] = tuple(doc.get("big", ()))
    return Spec(**doc)


# --------------------------------------------------------------------------- keys

_DIRS = ("a", "B", "v1.2", "a.b.c", "with space", "é", "漢字", "x-y_z", "e\u0301", "Ω.d", "tab\there")
_BASES = ("k", "Key", "ß", "🙂", "img", "0001", "ünï", "x y", "d-", "A_b")


def _key(rng: random.Random, i: int) -> str:
    depth = rng.choice((0, 0, 1, 1, 2, 3))
    parts = [rng.choice(_DIRS) for _ in range(depth)]
    if rng.random() < 0.15:  # a long path: > 100 bytes (ustar name field) or > 255 (name + prefix)
        parts.append("long" * rng.choice((30, 80)))
    elif rng.random() < 0.1:
        parts.append("ü" * 60)  # 120 bytes of UTF-8 in one component
    parts.append(f"{rng.choice(_BASES)}{i}")
    return "/".join(parts)


# --------------------------------------------------------------------------- fields

_EXTS = ("bin", "txt", "json", "npy", "cls", "idx", "jpg", "jpeg", "png", "webp", "gz")
_WEIGHTS = (3, 3, 2, 3, 2, 1, 2, 1, 2, 1, 3)
_GZ_INNER = ("txt", "json", "npy", "bin", "cls", "png")
BIG_KINDS = ("npy", "bin", "txt", "gz", "png")
"""Codecs of the large fields: sized exactly (npy, bin, txt), about (gz: its inner bytes) or an
image of about 1.2 MiB whatever the size (png: noise, so that it does not compress)."""
_SMALL = (0, 1, 2, 7, 100, 511, 512, 513, 1000, 3000, 20000)


def _small_size(rng: random.Random) -> int:
    return rng.choice(_SMALL) if rng.random() < 0.6 else int(rng.expovariate(1 / 400))


def _npy(rng: random.Random, nrng: np.random.Generator, size: int | None) -> np.ndarray:
    """An array of a random dtype and shape; with ``size`` (>= 128), a uint8 array whose ``.npy``
    is exactly ``size`` bytes."""
    if size is not None:
        arr = nrng.integers(0, 256, size - 128, dtype=np.uint8)
        extra = len(_npy_bytes(arr[:0])) - 128  # the header of a 1-D uint8 array is 128 bytes
        return arr[: len(arr) - extra] if extra > 0 else arr
    dtype = rng.choice(("u1", "<i2", ">i4", "<f4", "<f8", "?", "<c8", "<U3", "<i8", ">f2", "S4", "M8[s]", "rec"))
    shape = rng.choice(((), (0,), (3,), (2, 3), (1, 0, 2), (4, 1, 2), (rng.randint(1, 50),)))
    count = int(np.prod(shape)) if shape else 1
    if dtype == "rec":  # a structured dtype (its descr is a list)
        arr = np.zeros(shape, dtype=[("a", "<i4"), ("b", ">f8"), ("c", "S2")])
        if count:
            arr.reshape(-1)["a"] = nrng.integers(-1000, 1000, count)
            arr.reshape(-1)["b"] = nrng.standard_normal(count)
    elif dtype in ("S4", "M8[s]"):
        arr = nrng.integers(0, 2**31, count).astype(dtype).reshape(shape)
    elif dtype == "<U3":
        arr = np.array(["", "a", "ßé", "漢字x"] * count, dtype=dtype)[:count].reshape(shape)
    elif dtype == "?":
        arr = nrng.integers(0, 2, count).astype(bool).reshape(shape)
    else:
        arr = nrng.standard_normal(count).astype(np.float64) * 1000
        arr = arr.astype(np.dtype(dtype)).reshape(shape)
    if arr.ndim >= 2 and rng.random() < 0.5:
        arr = np.asfortranarray(arr)
    return arr


def _text(rng: random.Random, nrng: np.random.Generator, size: int) -> str:
    if size > 4096 or rng.random() < 0.5:
        return nrng.integers(32, 127, size, dtype=np.uint8).tobytes().decode("ascii")
    alphabet = "abc XYZ\n\té漢字🙂ß\u0301"
    return "".join(rng.choice(alphabet) for _ in range(max(0, size // 2)))


def _json(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.randrange(8 if depth < 3 else 5)
    if kind == 0:
        return rng.randint(-(2**40), 2**40)
    if kind == 1:
        return rng.choice((0.0, -0.0, 1.5, -2.25e-7, 1e300, 3.141592653589793))
    if kind == 2:
        return rng.choice(("", "a", "é漢字🙂", "quote\"back\\slash", "\u0000nul"))
    if kind == 3:
        return rng.choice((True, False))
    if kind == 4:
        return None
    if kind in (5, 6):
        return {rng.choice(("a", "b", "__key__", "ü", "")) + str(j): _json(rng, depth + 1) for j in range(rng.randint(0, 4))}
    return [_json(rng, depth + 1) for _ in range(rng.randint(0, 4))]


_IMAGE_MODES = {
    "png": ("RGB", "L", "RGBA", "LA", "P", "1"),
    "webp": ("RGB", "RGBA"),
    "jpg": ("RGB", "L", "CMYK"),
}


def _image(rng: random.Random, nrng: np.random.Generator, ext: str, big: bool) -> bytes:
    """Encoded image bytes: PNG in 8-bit modes (palette, 1-bit, with alpha), WebP lossy or
    lossless, JPEG baseline or progressive, any subsampling, grey, CMYK, with an EXIF orientation at times."""
    side = (rng.randint(1, 40), rng.randint(1, 40)) if not big else (700, 600)
    kind = "jpg" if ext in ("jpg", "jpeg") else ext
    mode = rng.choice(_IMAGE_MODES[kind]) if not big else "RGB"
    pixels = nrng.integers(0, 256, (side[1], side[0], 4), dtype=np.uint8)
    if mode in ("RGB", "RGBA", "CMYK"):
        img = Image.fromarray(pixels[:, :, : len(mode)].copy(), mode)
    else:
        img = Image.fromarray(pixels[:, :, 0].copy(), "L")
        if mode == "LA":
            img = Image.merge("LA", (img, Image.fromarray(pixels[:, :, 1].copy(), "L")))
        elif mode == "P":
            img = Image.fromarray(pixels[:, :, :3].copy(), "RGB").quantize(rng.choice((2, 16, 256)))
            if rng.random() < 0.5:
                img.info["transparency"] = 0
        elif mode == "1":
            img = img.convert("1")
    buf = io.BytesIO()
    if kind == "jpg":
        options: dict[str, Any] = {"quality": rng.choice((50, 90, 100)), "progressive": rng.random() < 0.3}
        if mode != "CMYK":
            options["subsampling"] = rng.choice((0, 1, 2))
        if rng.random() < 0.25:
            exif = Image.Exif()
            exif[0x0112] = rng.randint(1, 8)  # Orientation: the reader turns the image
            options["exif"] = exif.tobytes()
        img.save(buf, "JPEG", **options)
    elif kind == "webp":
        img.save(buf, "WEBP", lossless=rng.random() < 0.5, quality=80)
    else:
        img.save(buf, "PNG", compress_level=rng.choice((0, 1, 6)))
    return buf.getvalue()


def _value(rng: random.Random, nrng: np.random.Generator, ext: str, size: int | None) -> Any:
    """A field value for the writer: bytes (stored as given) or a value its codec encodes.
    ``size``: the stored size wanted exactly (bin, txt, npy) or about (gz), or None: a small one."""
    if ext == "gz":
        inner = rng.choice(_GZ_INNER) if size is None else rng.choice(("bin", "txt", "npy"))
        value = _value(rng, nrng, inner, size)
        return inner, value
    small = size is None
    n = _small_size(rng) if small else size
    if ext == "bin":
        return nrng.bytes(n)
    if ext == "txt":
        return _text(rng, nrng, n) if small else nrng.integers(97, 123, n, dtype=np.uint8).tobytes().decode("ascii")
    if ext == "npy":
        arr = _npy(rng, nrng, None if small else n)
        return arr if rng.random() < 0.7 else _npy_bytes(arr)
    if ext in ("cls", "idx"):
        value = rng.choice((0, 1, -3, 7, 999, 2**63 - 1, -(2**63), rng.randint(0, 10**6)))  # int64, the codec's range
        return rng.choice((b"%d\n", b" %d ", b"%d")) % value if rng.random() < 0.2 else value
    if ext == "json":
        doc = _json(rng)
        return b"null" if doc is None else doc  # the writer refuses None values
    return _image(rng, nrng, ext, big=not small)


def _npy_bytes(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=False)
    return buf.getvalue()


def _field_name(rng: random.Random, ext: str, j: int, taken: set[str]) -> str:
    if ext not in taken and rng.random() < 0.5:
        return ext
    prefix = rng.choice(("f", "seg", "é", "x.y", "a-b"))
    return f"{prefix}{j}.{ext}"


def _fields(rng: random.Random, nrng: np.random.Generator, n: int, big: list[int], kind: str) -> dict[str, Any]:
    """``n`` small fields plus one field per size in ``big`` (of codec ``kind``, or of each of
    :data:`BIG_KINDS` in turn)."""
    out: dict[str, Any] = {}
    wanted = [(rng.choices(_EXTS, _WEIGHTS)[0], None) for _ in range(n)]
    start = rng.randrange(len(BIG_KINDS))
    wanted += [(kind or BIG_KINDS[(start + j) % len(BIG_KINDS)], size) for j, size in enumerate(big)]
    for j, (ext, size) in enumerate(wanted):
        if ext == "png" and size is not None:  # an image of about 1.2 MiB (noise does not compress)
            value: Any = _image(rng, nrng, "png", big=True)
        else:
            value = _value(rng, nrng, ext, size)
        if ext == "gz":
            inner, inner_value = value
            name = _field_name(rng, f"{inner}.gz", j, set(out))
            if isinstance(inner_value, bytes):  # bytes are stored as given: gzip them here
                inner_value = gzip.compress(inner_value, compresslevel=rng.choice((1, 9)), mtime=0)
            value = inner_value
        else:
            name = _field_name(rng, ext, j, set(out))
        while name in out:
            name = f"f{j}-{len(out)}.{name.rsplit('.', 1)[-1]}"
        out[name] = value
    return out


def samples_of(spec: Spec) -> list[dict[str, Any]]:
    """The sample dicts of ``spec``, as given to the writer."""
    rng = random.Random(spec.seed)
    nrng = np.random.default_rng(spec.seed)
    big_of: dict[int, list[int]] = {}
    for size in spec.big:
        big_of.setdefault(rng.randrange(spec.samples), []).append(size)
    wide_at = rng.randrange(spec.samples) if spec.wide else -1
    keys: set[str] = set()
    out = []
    for i in range(spec.samples):
        key = _key(rng, i)
        while key in keys:
            key += "x"
        keys.add(key)
        n = rng.randint(1, 64) if i == wide_at else rng.choice((1, 1, 2, 3, 4))
        sample = {"__key__": key}
        sample.update(_fields(rng, nrng, n, big_of.get(i, []), spec.big_kind))
        out.append(sample)
    return out


def write_dataset(spec: Spec, folder: Path) -> list[dict[str, Any]]:
    """Write ``spec``'s dataset into ``folder`` (created; it must not exist); returns the samples written."""
    samples = samples_of(spec)
    folder.mkdir(parents=True)
    if spec.writer != "shardflow":
        _write_foreign(spec, samples, folder)
        if spec.compression == "none" and spec.layout != "bare":
            index_shards([str(p) for p in sorted(folder.glob("*.tar"))], workers=1)
    else:
        pattern = str(folder / "train-%06d.tar")
        kw: dict[str, Any] = {}
        if spec.compression == "zstd-writer":
            pattern += ".zst"
            kw["compression"] = "zstd"
        manifest = spec.layout != "bare" and spec.compression in ("none", "zstd-writer")
        with ShardWriter(pattern, max_count=spec.max_count, manifest=manifest, index=spec.layout == "indexed", **kw) as w:
            for sample in samples:
                w.write(sample)
    if spec.compression in ("gzip", "zstd") or (spec.compression == "zstd-writer" and spec.writer != "shardflow"):
        _compress(folder, spec)  # (tarfile's shards: "zstd-writer" is zstd after writing)
    return samples


def _write_foreign(spec: Spec, samples: list[dict[str, Any]], folder: Path) -> None:
    """Shards as other tools write them, with CPython ``tarfile``: GNU or PAX headers (a PAX global
    header at times), members of a sample in random order with some extensions upper-cased, real
    mtimes and owners, and members that are no samples between samples: directories, a symlink,
    ``__``-prefixed and dot-less files."""
    rng = random.Random(spec.seed + 1)
    fmt = tarfile.GNU_FORMAT if spec.writer == "tarfile-gnu" else tarfile.PAX_FORMAT
    for n, start in enumerate(range(0, len(samples), spec.max_count)):
        pax = {"comment": "written elsewhere"} if fmt == tarfile.PAX_FORMAT and rng.random() < 0.5 else None
        with tarfile.open(folder / f"train-{n:06d}.tar", "w", format=fmt, pax_headers=pax, encoding="utf-8") as tar:
            for i, sample in enumerate(samples[start : start + spec.max_count]):
                if rng.random() < 0.3:
                    _add(tar, rng, rng.choice(("__meta__.json", "README", "dir/__x.txt", "notes/")), b"{}")
                if rng.random() < 0.2:
                    link = tarfile.TarInfo(f"link{i}.txt")
                    link.type, link.linkname = tarfile.SYMTYPE, "elsewhere.txt"
                    tar.addfile(link)
                key, fields = encode_sample_dict(sample)
                names = list(fields)
                rng.shuffle(names)
                for name in names:
                    stored = name.upper() if rng.random() < 0.2 else name  # fields are lower-cased on read
                    _add(tar, rng, f"{key}.{stored}", fields[name])


def _add(tar: tarfile.TarFile, rng: random.Random, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name.rstrip("/"))
    if name.endswith("/"):
        info.type = tarfile.DIRTYPE
        tar.addfile(info)
        return
    info.size, info.mtime, info.mode = len(data), rng.randint(0, 2**32), 0o640
    info.uid, info.gid, info.uname, info.gname = 1000, 1000, "someone", "users"
    tar.addfile(info, io.BytesIO(data))


def _compress(folder: Path, spec: Spec) -> None:
    """Compress each tar after writing, as shards made elsewhere are; index them unless bare."""
    import zstandard

    rng = random.Random(spec.seed + 2)
    suffix = ".gz" if spec.compression == "gzip" else ".zst"  # zstd, or zstd-writer for tarfile's shards
    shards = []
    for tar in sorted(folder.glob("*.tar")):
        data = tar.read_bytes()
        # one gzip member or zstd frame, or several (cut anywhere, as concatenated streams are)
        cuts = sorted(rng.sample(range(1, len(data)), min(len(data) - 1, rng.choice((0, 0, 1, 3)))))
        pieces = [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)])]
        if spec.compression == "gzip":
            packed = b"".join(gzip.compress(p, compresslevel=1, mtime=0) for p in pieces)
        else:
            packed = b"".join(zstandard.ZstdCompressor(level=1).compress(p) for p in pieces)
        out = tar.with_name(tar.name + suffix)
        out.write_bytes(packed)
        tar.unlink()
        shards.append(str(out))
    for stale in [*folder.glob("*.npy"), *folder.glob("shardflow.json")]:
        stale.unlink()
    if spec.layout != "bare":
        index_shards(shards, workers=1)


def copy_dataset(folder: Path, dest: Path) -> None:
    """A copy of a dataset folder (the files a reader sees)."""
    shutil.copytree(folder, dest)
