"""The dataset manifest ``shardflow.json`` and the per-shard offset index.

Manifest (JSON)::

    {"format": "shardflow", "version": 1,
     "shards": [{"url": "train-000000.tar", "samples": 500, "bytes": 1234,
                 "sha256": "...", "index": "train-000000.tar.idx.npy"}, ...],
     "fields": {"jpg": "jpg", "cls": "cls"},
     "meta": {"class_to_idx": {...}, "source": "..."}}

Shard URLs are relative to the manifest's folder (absolute URLs are kept as
given). The offset index of a shard is a ``.npy`` (int64, shape (samples + 1,),
no pickle): entry ``i`` is the byte offset of sample ``i``'s first tar header and
the last entry is the offset just after the last sample, so sample ``i`` spans
bytes ``[idx[i], idx[i+1])``.
"""

from __future__ import annotations

import io
import json
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import ManifestError
from .keys import codec_extension
from .compression import COMPRESSED_SUFFIXES
from .limits import Limits
from .npy import header_of

__all__ = [
    "MANIFEST_NAME",
    "COMPRESSIONS",
    "FORMAT_VERSION",
    "JOURNAL_SUFFIX",
    "ShardInfo",
    "Manifest",
    "check_counts",
    "encode_offsets",
    "decode_offsets",
    "decode_sizes",
    "load_npy",
    "parse_json",
]

MANIFEST_NAME = "shardflow.json"
COMPRESSIONS = ("zstd", "gzip")
"""The ``compression`` values a shard entry may have (None: a plain tar); shardflow writes
``"zstd"``, ``shardflow index`` records either."""
FORMAT_VERSION = 1
JOURNAL_SUFFIX = ".journal"
"""A writer's journal of finished shards is ``shardflow.json.journal`` beside the shards."""


@dataclass(frozen=True)
class ShardInfo:
    """One shard's manifest entry.

    Attributes:
        url: path relative to the manifest's folder, or an absolute URL.
        samples: number of samples.
        bytes: size of the shard file in bytes.
        sha256: hex digest of the shard file.
        index: relative path of the offset index ``.npy``, or None.
        sizes: relative path of the per-sample sizes ``.npy`` (int64, shape
            (samples, C), columns named by the manifest's ``meta["size_columns"]``,
            e.g. ``num_nodes``/``num_edges`` for graphs), or None. Used to batch
            by cost.
        compression: ``"zstd"`` for a ``.tar.zst`` shard (written by shardflow
            in independent frames, or indexed), ``"gzip"`` for an indexed
            ``.tar.gz``, None for a plain tar.
        frames: relative path of the frame table ``.npy`` of a framed zstd
            shard (see :mod:`shardflow.format.frames`), or None. The offset
            index then holds tar (uncompressed) offsets.
    """

    url: str
    samples: int
    bytes: int
    sha256: str | None = None
    index: str | None = None
    sizes: str | None = None
    compression: str | None = None
    frames: str | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"url": self.url, "samples": self.samples, "bytes": self.bytes, "sha256": self.sha256}
        if self.index:
            out["index"] = self.index
        if self.sizes:
            out["sizes"] = self.sizes
        if self.compression:
            out["compression"] = self.compression
        if self.frames:
            out["frames"] = self.frames
        return out


@dataclass
class Manifest:
    """A dataset manifest.

    Attributes:
        shards: entries in stream order.
        fields: field name -> codec extension, for every field seen.
        meta: free-form metadata (``class_to_idx``, source, graph schema, ...).
        url: where the manifest was read from or will be written (set by the
            loader); shard URLs resolve against its folder.
    """

    shards: list[ShardInfo]
    fields: dict[str, str] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)
    url: str | None = None

    @property
    def num_samples(self) -> int:
        """Total samples over all shards."""
        return sum(s.samples for s in self.shards)

    def to_json(self) -> dict[str, Any]:
        return {
            "format": "shardflow",
            "version": FORMAT_VERSION,
            "shards": [s.to_json() for s in self.shards],
            "fields": dict(sorted(self.fields.items())),
            "meta": self.meta,
        }

    def dumps(self) -> bytes:
        """Deterministic JSON bytes (sorted fields, 1-space indent)."""
        return (json.dumps(self.to_json(), indent=1, ensure_ascii=False) + "\n").encode("utf-8")

    @classmethod
    def loads(cls, data: bytes | str, url: str | None = None) -> Manifest:
        """Parse manifest JSON.

        Raises:
            ManifestError: not JSON, not a shardflow manifest, a newer version,
                no ``shards`` list, or an entry whose ``url`` is not a string,
                whose ``samples``/``bytes`` are not integers (or a negative count).
        """
        where = url or "<manifest>"
        obj = parse_json(data, where)
        if not isinstance(obj, dict) or obj.get("format") != "shardflow":
            raise ManifestError(f"{where}: not a shardflow manifest (no \"format\": \"shardflow\")")
        version = obj.get("version")
        if not isinstance(version, int) or version > FORMAT_VERSION:
            raise ManifestError(f"{where}: manifest version {version!r} is not supported (this shardflow reads <= {FORMAT_VERSION})")
        entries = obj.get("shards")
        if not isinstance(entries, list):
            raise ManifestError(f"{where}: \"shards\" is {_kind(entries)}, not a list of shard entries")
        shards = [_shard_entry(entry, i, where) for i, entry in enumerate(entries)]
        for name in ("fields", "meta"):
            if not isinstance(obj.get(name, {}), dict):
                raise ManifestError(f"{where}: \"{name}\" is {_kind(obj[name])}, not an object")
        return cls(shards=shards, fields=dict(obj.get("fields", {})), meta=dict(obj.get("meta", {})), url=url)


def parse_json(data: bytes | str, where: str) -> Any:
    """``json.loads`` of untrusted manifest bytes, every failure a :class:`ManifestError`.

    Raises:
        ManifestError: not valid JSON, or nested deeper than Python's recursion
            limit allows (a manifest of ``[[[[...`` a megabyte deep).
    """
    try:
        return json.loads(data)
    except ValueError as e:
        raise ManifestError(f"{where}: not valid JSON: {e}") from e
    except RecursionError:
        raise ManifestError(f"{where}: not a manifest: its JSON is nested too deeply") from None


def _kind(value: Any) -> str:
    if value is None:
        return "missing"
    name = type(value).__name__
    return f"{'an' if name[0] in 'aeiou' else 'a'} {name}"


_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def _shard_entry(entry: Any, i: int, where: str) -> ShardInfo:
    """One ``shards`` entry, checked: ``url`` a non-empty string, ``samples`` and ``bytes``
    integers (not strings or floats, which a reader would round), the rest strings or null."""
    if not isinstance(entry, dict):
        raise ManifestError(f"{where}: shard entry {i} is {_kind(entry)}, not an object")
    url = entry.get("url")
    if not isinstance(url, str) or not url:
        raise ManifestError(f"{where}: shard entry {i} has no url (url is {url!r})")
    samples, size = entry.get("samples"), entry.get("bytes", -1)
    for name, value in (("samples", samples), ("bytes", size)):
        if type(value) is not int:
            raise ManifestError(f"{where}: shard entry {i} ({url!r}): {name} is {value!r}, not an integer")
    if samples < 0:
        raise ManifestError(f"{where}: shard entry {i} has a negative sample count")
    for name in ("sha256", "index", "sizes", "compression", "frames"):
        if entry.get(name) is not None and not isinstance(entry[name], str):
            raise ManifestError(f"{where}: shard entry {i} ({url!r}): {name} is {entry[name]!r}, not a string")
    if entry.get("compression") not in (None, *COMPRESSIONS):
        raise ManifestError(f"{where}: shard entry {i} ({url!r}): compression {entry['compression']!r} is not one "
                            f"of {list(COMPRESSIONS)}")
    for name in ("url", "index", "sizes", "frames"):
        value = entry.get(name)
        if value is not None and _CONTROL.search(value):  # a NUL cannot be opened; others forge log lines
            raise ManifestError(f"{where}: shard entry {i}: {name} {value!r} holds a control character",
                                reason="manifest_url")
    return ShardInfo(url=url, samples=samples, bytes=size, sha256=entry.get("sha256"),
                     index=entry.get("index"), sizes=entry.get("sizes"),
                     compression=entry.get("compression"), frames=entry.get("frames"))


def fields_of(names: Iterable[str]) -> dict[str, str]:
    """Map field names to their codec extension."""
    return {name: codec_extension(name) for name in names}


def encode_offsets(offsets: Sequence[Any] | np.ndarray) -> bytes:
    """Serialize an offset index (or a sizes index) as ``.npy`` bytes (int64, no pickle)."""
    buf = io.BytesIO()
    np.save(buf, np.asarray(offsets, dtype=np.int64), allow_pickle=False)
    return buf.getvalue()


_COMPRESSED = tuple(s[s.rindex(".") :] for s in COMPRESSED_SUFFIXES)  # .gz, .tgz, .zst, .zstd: any last one
_BLOCK = 512  # tar headers start on 512-byte blocks


def check_counts(manifest: Manifest, limits: Limits) -> None:
    """Refuse sample counts that a shard's size cannot hold, before anything is sized by them.

    A sample takes at least one tar header block, so a plain shard of ``b``
    bytes holds at most ``b // limits.min_sample_bytes`` samples; a compressed
    one (``.gz``/``.tgz``/``.zst`` URL) at most ``limits.max_compression_ratio``
    times that. Shards whose size the manifest does not give are not checked.

    Raises:
        ManifestError: a shard declares more (names the shard, both numbers and
            the option), reason ``"manifest"``.
    """
    where = manifest.url or "<manifest>"
    for info in manifest.shards:
        if info.bytes < 0:
            continue
        ratio = limits.max_compression_ratio if info.compression or info.url.endswith(_COMPRESSED) else 1
        cap = info.bytes * ratio // limits.min_sample_bytes
        if info.samples > cap:
            raise ManifestError(
                f"{where}: shard {info.url!r} declares {info.samples} samples in {info.bytes} bytes, more than "
                f"it can hold ({cap}: a sample takes at least Limits.min_sample_bytes={limits.min_sample_bytes} "
                f"bytes{', at Limits.max_compression_ratio=' + str(ratio) if ratio > 1 else ''})"
            )


def load_npy(data: bytes, url: str, what: str, shape: tuple[int, ...]) -> np.ndarray:
    """An integer ``.npy`` of exactly ``shape`` (-1: any length on that axis), its header
    checked before any array is allocated.

    The header is parsed by :func:`.npy.header_of` (numpy's parser: nothing is
    evaluated) and the data then read with ``np.frombuffer``: nothing is unpickled.
    """
    try:
        head = header_of(data)
    except Exception as e:  # noqa: BLE001 - numpy raises ValueError/OSError/SyntaxError on bad headers
        raise ManifestError(f"{url}: {what} is not a valid .npy: {e}", reason="bad_index") from e
    found, fortran, dtype, at = head
    fits = len(found) == len(shape) and all(w in (-1, f) for f, w in zip(found, shape))
    if not fits or dtype.kind not in "iu" or dtype.hasobject:
        raise ManifestError(
            f"{url}: {what} has shape {found} and dtype {dtype}, expected int64 {shape}", reason="bad_index"
        )
    shape = tuple(found)
    count = int(np.prod(shape))
    if len(data) - at != dtype.itemsize * count:
        raise ManifestError(
            f"{url}: {what} holds {len(data) - at} bytes of data, but its header declares "
            f"{dtype.itemsize * count}",
            reason="bad_index",
        )
    arr = np.frombuffer(data, dtype=dtype, count=count, offset=at).reshape(shape, order="F" if fortran else "C")
    if arr.dtype.kind == "u" and arr.size and int(arr.max()) > np.iinfo(np.int64).max:
        raise ManifestError(f"{url}: {what} holds {int(arr.max())}, past any int64 offset", reason="bad_index")
    return np.array(arr, dtype=np.int64)  # a writable copy, in native byte order


def decode_sizes(data: bytes, url: str, samples: int, columns: int) -> np.ndarray:
    """Parse a per-sample sizes index and check it fits the shard.

    Raises:
        ManifestError: not an integer array of shape (samples, columns), or a
            negative size.
    """
    arr = load_npy(data, url, "sizes index", (samples, columns))
    if arr.size and int(arr.min()) < 0:
        raise ManifestError(f"{url}: sizes index holds the negative size {int(arr.min())}", reason="bad_index")
    return arr


def decode_offsets(data: bytes, url: str, samples: int, size: int = -1) -> np.ndarray:
    """Parse an offset index and check it fits the shard.

    Args:
        data: the ``.npy`` file's bytes.
        url: the index URL, named in errors.
        samples: the shard's sample count (the manifest's).
        size: the shard's size in bytes, or -1 if unknown.

    Returns:
        int64 offsets, shape (samples + 1,).

    Raises:
        ManifestError: (reason ``"bad_index"``) not an integer vector of
            ``samples + 1`` entries; an offset that is negative, not on a
            512-byte tar block, not strictly increasing, or past the shard's end.
    """
    arr = load_npy(data, url, "offset index", (samples + 1,))
    if int(arr[0]) < 0:
        raise ManifestError(f"{url}: offset index starts at the negative offset {int(arr[0])}", reason="bad_index")
    if samples and np.any(np.diff(arr) <= 0):
        i = int(np.argmax(np.diff(arr) <= 0))
        raise ManifestError(
            f"{url}: offset index is not strictly increasing (entry {i + 1} is {int(arr[i + 1])}, after {int(arr[i])})",
            reason="bad_index",
        )
    off = arr % _BLOCK != 0
    if np.any(off):
        i = int(np.argmax(off))
        raise ManifestError(
            f"{url}: offset index entry {i} ({int(arr[i])}) is not on a 512-byte tar block", reason="bad_index"
        )
    if size >= 0 and int(arr[-1]) > size:
        raise ManifestError(
            f"{url}: offset index ends at byte {int(arr[-1])}, past the end of the shard's {size} bytes",
            reason="bad_index",
        )
    return arr
