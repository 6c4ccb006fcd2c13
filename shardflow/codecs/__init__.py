"""Field codecs, registered by extension.

A field's codec is chosen by the last extension of its name (``seg.png`` uses
the ``png`` codec); ``gz``, ``zst`` and ``xz`` are decompressed (within
:class:`~shardflow.format.limits.Limits`, see :mod:`shardflow.codecs.compressed`) and
then decoded by the extension before them (``x.npy.gz``). On write, ``bytes`` values are stored as given and other
values are encoded by the codec; on read, the codec decodes the bytes. Nothing
is unpickled unless :attr:`DecodeOptions.allow_pickle` is set.

Known extensions: see :func:`known_extensions`. Add your own with
:func:`register_codec`.

The image-field alias :data:`IMAGE_FIELD` (``"image"``) stands for whichever image
field a sample has (``jpg``, ``jpeg``, ``png``, ``webp``, ...), so that a folder mixing
JPEG and PNG files reads as one field; :func:`field_alternatives` expands it, and a
field named ``image`` decodes as an image.
"""

from __future__ import annotations

import dataclasses
import io
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import fastpath
from ..errors import DecodeError, SampleError
from .labels import decode_int, encode_int
from ..format.keys import IMAGE_EXTENSIONS, codec_extension
from ..format.limits import DEFAULT_LIMITS, MAX_GRAPH_EDGES, MAX_GRAPH_NODES, Limits
from ..format.npy import MAGIC, header_of
from .compressed import COMPRESSED_EXTENSIONS, compress_field, decompress_field

__all__ = [
    "DecodeOptions",
    "register_codec",
    "known_extensions",
    "encode_field",
    "decode_field",
    "preload",
    "IMAGE_FORMS",
    "IMAGE_FIELD",
    "field_alternatives",
    "is_image_field",
    "with_limits",
]

IMAGE_FORMS = ("pil", "numpy", "torch")

IMAGE_FIELD = "image"
"""The image-field alias: requested as a field (``fields=("image", "cls")``, a
``transform={"image": ...}``, the CLI's ``--field image``), it stands for whichever image
field a sample has, and the sample carries that field under the name ``image``."""


def field_alternatives(name: str) -> list[str]:
    """The stored field names a requested name stands for, in order of preference.

    A name may list alternatives separated by ``;`` (``"jpg;png"``: the first present
    wins); :data:`IMAGE_FIELD` among them expands to itself followed by every image
    extension (see :data:`shardflow.format.keys.IMAGE_EXTENSIONS`).

    Args:
        name: a requested field, e.g. ``"cls"``, ``"jpg;png"`` or ``"image"``.

    Returns:
        The field names to look for, without repeats: ``"image"`` gives
        ``["image", "jpg", "jpeg", "png", "webp", ...]``.
    """
    out: list[str] = []
    for alt in name.split(";"):
        for candidate in (alt, *IMAGE_EXTENSIONS) if alt == IMAGE_FIELD else (alt,):
            if candidate not in out:
                out.append(candidate)
    return out


def is_image_field(name: str) -> bool:
    """Whether a field name holds an image: its codec extension is an image format,
    or it is the alias :data:`IMAGE_FIELD`."""
    ext = codec_extension(name)
    return ext == IMAGE_FIELD or ext in IMAGE_EXTENSIONS


@dataclass(frozen=True)
class DecodeOptions:
    """How fields are decoded.

    Attributes:
        image: ``"pil"`` (RGB ``PIL.Image``), ``"numpy"`` (uint8 array, shape
            (H, W, 3)), ``"torch"`` (uint8 tensor, shape (3, H, W)), or None to
            keep image fields as encoded bytes.
        max_pixels: refuse images with more pixels than this (decompression
            bombs); a per-dataset limit, Pillow's global setting is untouched.
        exif_transpose: apply the EXIF Orientation tag (default True, as
            ``PIL.ImageOps.exif_transpose``).
        allow_pickle: decode ``pth``/``pt``/``pickle``/``pkl`` fields. Off by
            default: unpickling untrusted data runs arbitrary code.
        jpeg_decoder: ``"pillow"`` (default) or ``"simplejpeg"``, the faster
            libjpeg-turbo decoder for JPEGs decoded to RGB arrays or tensors
            (``pip install shardflow[jpeg]``; same pixels as Pillow in the tests;
            see :func:`shardflow.codecs.image.decode_image` for what still goes
            through Pillow).
        min_side: reduced decode: JPEGs decode at the largest libjpeg reduction (1/2, 1/4,
            1/8) that keeps the short side at least this many pixels; the exact resize is the
            transform's (:func:`shardflow.codecs.image.decode_image` says when pixels differ
            from a full decode). None (default): full size. Other formats are unaffected.
        max_graph_nodes: the most nodes a ``pyg`` graph (a ``Data``, or one
            node type of a ``HeteroData``) may declare through ``num_nodes`` or
            node-level rows, or imply through its largest ``edge_index`` id;
            default 2**24 (16,777,216). A larger graph is a ``DecodeError``
            naming this option.
        max_graph_edges: the most edges (columns) an ``edge_index`` may hold;
            default 2**28 (268,435,456).
        limits: the bounds on compressed fields (``.gz``/``.zst``/``.xz``: at most
            ``Limits.max_member_bytes``, and ``Limits.max_compression_ratio`` times
            their stored size); None (default): a dataset's ``IOOptions.limits``
            (the :data:`~shardflow.format.limits.DEFAULT_LIMITS` elsewhere).
    """

    image: str | None = "numpy"
    max_pixels: int | None = 178_956_970
    exif_transpose: bool = True
    allow_pickle: bool = False
    jpeg_decoder: str = "pillow"
    min_side: int | None = None
    max_graph_nodes: int = MAX_GRAPH_NODES
    max_graph_edges: int = MAX_GRAPH_EDGES
    limits: Limits | None = None

    def __post_init__(self) -> None:
        if isinstance(self.limits, dict):  # through dataclasses.asdict
            object.__setattr__(self, "limits", Limits(**self.limits))
        if self.limits is not None and not isinstance(self.limits, Limits):
            raise TypeError(f"limits must be a shardflow.format.limits.Limits or None, got {self.limits!r}")
        if self.image is not None and self.image not in IMAGE_FORMS:
            raise ValueError(f"image form must be one of {IMAGE_FORMS} or None, got {self.image!r}")
        if self.max_pixels is not None and self.max_pixels <= 0:
            raise ValueError(f"max_pixels must be positive, got {self.max_pixels}")
        if self.jpeg_decoder not in ("pillow", "simplejpeg"):
            raise ValueError(f"jpeg_decoder must be 'pillow' or 'simplejpeg', got {self.jpeg_decoder!r}")
        if self.jpeg_decoder == "simplejpeg":
            try:
                import simplejpeg  # noqa: F401
            except ImportError as e:
                raise ImportError(
                    "jpeg_decoder='simplejpeg' needs simplejpeg: pip install 'shardflow[jpeg]'"
                ) from e
        if self.min_side is not None and (
            isinstance(self.min_side, bool) or not isinstance(self.min_side, int) or self.min_side < 1
        ):
            raise ValueError(f"min_side must be a positive int or None, got {self.min_side!r}")
        for name in ("max_graph_nodes", "max_graph_edges"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")


def with_limits(options: DecodeOptions | None, limits: Limits) -> DecodeOptions | None:
    """``options`` with ``limits`` where it names none (a dataset's ``IOOptions.limits``)."""
    if options is None or options.limits is not None:
        return options
    return dataclasses.replace(options, limits=limits)


def preload(options: DecodeOptions | None, fields: Iterable[str] = ()) -> None:
    """Import the decoders ``options`` will use, now.

    A dataset calls this when it is built, so that DataLoader workers forked
    later inherit the loaded modules (Pillow and its plugins; with a graph field
    among ``fields``, the graph codec and ``torch_geometric``, whose import takes
    seconds) instead of each importing them before its first batch.

    Args:
        options: the dataset's decode options (None: raw bytes, nothing to import).
        fields: the names of the fields that will be decoded (the dataset's
            ``fields=``, else its manifest's); ``pyg`` fields bring in the graph codec.
    """
    if options is None:
        return
    if options.image is not None:
        from . import image

        image.Image.preinit()
    if any(codec_extension(f) == "pyg" for name in fields for f in field_alternatives(name)):
        try:
            from ..graph import decode  # noqa: F401 - the graph decoder's own imports
            from ..graph.rules import import_pyg

            import_pyg("decoding graph fields")
        except ImportError:
            return  # not installed: the first graph decoded raises the error that names the extra


Encoder = Callable[[Any, str], bytes]
Decoder = Callable[[bytes, DecodeOptions], Any]
_ENCODERS: dict[str, Encoder] = {}
_DECODERS: dict[str, Decoder] = {}


def register_codec(extension: str, encode: Encoder | None, decode: Decoder | None) -> None:
    """Register a codec for an extension (lower-case, no dot).

    Args:
        extension: e.g. ``"npy"``.
        encode: ``encode(value, extension) -> bytes``, or None for read-only.
        decode: ``decode(data, options) -> value``, or None to keep bytes.
    """
    if encode is not None:
        _ENCODERS[extension] = encode
    if decode is not None:
        _DECODERS[extension] = decode


def known_extensions() -> list[str]:
    """Sorted extensions that have a codec."""
    return sorted(set(_ENCODERS) | set(_DECODERS))


def encode_field(key: str, field: str, value: Any) -> bytes:
    """Encode one field value for writing.

    Args:
        key: the sample key (for error messages).
        field: the field name; its last extension picks the codec.
        value: ``bytes``/``bytearray``/``memoryview`` are stored as given;
            anything else is encoded by the codec.

    Raises:
        SampleError: no codec can encode the value (lists the known extensions),
            or the codec refused it.
    """
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    ext = codec_extension(field)
    if ext in COMPRESSED_EXTENSIONS and "." in field:
        return compress_field(ext, encode_field(key, field[: -len(ext) - 1], value))
    encode = _ENCODERS.get(ext)
    if encode is None:
        raise SampleError(
            f"sample {key!r}: no codec encodes a {type(value).__name__} into field {field!r}; pass bytes, "
            f"or use one of the extensions {', '.join(known_extensions())}"
        )
    try:
        return encode(value, ext)
    except SampleError:
        raise
    except Exception as e:
        raise SampleError(f"sample {key!r}: cannot encode field {field!r}: {e}") from e


def decode_field(field: str, data: bytes, options: DecodeOptions, *, graph_records: bool = False) -> Any:
    """Decode one field's bytes by its extension; unknown extensions stay bytes.

    Args:
        field: the field name; its last extension picks the codec.
        data: the field's bytes: ``bytes``, ``bytearray`` or ``memoryview``, all
            decoded alike by every codec (a multi-dimensional or non-byte view is
            read as its raw bytes).
        options: how to decode.
        graph_records: the samples go to the default collate, so a ``pyg`` field
            (with the built-in codec) may become a checked
            :class:`~shardflow.graph.records.GraphRecord` that the collate batches
            in one step, instead of a ``Data``; the checks and errors are the same.

    Raises:
        DecodeError: the codec failed (the caller adds shard and key), or a
            compressed field is damaged or over its cap (reason ``field_too_large``).
    """
    ext = codec_extension(field)
    if isinstance(data, memoryview) and (data.ndim != 1 or data.itemsize != 1):
        data = data.cast("B") if data.c_contiguous else data.tobytes()
    if ext in COMPRESSED_EXTENSIONS:
        inner, data = decompress_field(field, data, options.limits or DEFAULT_LIMITS)
        if "." not in field:  # a field named "gz": bytes, as before
            return data
        return decode_field(inner, data, options, graph_records=graph_records)
    decode = _DECODERS.get(ext)
    if decode is None:
        return data
    if graph_records and decode is _dec_graph:
        decode = _dec_graph_record
    try:
        return decode(data, options)
    except DecodeError as e:
        raise DecodeError(f"field {field!r}: {e}", reason=e.reason) from e
    except Exception as e:
        raise DecodeError(f"field {field!r}: {type(e).__name__}: {e}") from e


# ------------------------------------------------------------ built-in codecs


def _enc_text(value: Any, ext: str) -> bytes:
    if not isinstance(value, str):
        raise TypeError(f"expected str, got {type(value).__name__}")
    return value.encode("utf-8")


def _enc_json(value: Any, ext: str) -> bytes:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def _enc_npy(value: Any, ext: str) -> bytes:
    if hasattr(value, "detach"):  # torch tensor
        value = value.detach().cpu().numpy()
    arr = np.asarray(value)
    if arr.dtype == object:
        raise TypeError("object arrays cannot be stored without pickle")
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=False)
    return buf.getvalue()


def _dec_npy(data: bytes, options: DecodeOptions) -> np.ndarray:
    """Decode .npy bytes like ``np.load(allow_pickle=False)``, the header read by
    :func:`shardflow.format.npy.header_of` (each distinct one parsed once, with the fast
    paths on); anything else (not a ``.npy``, the ``"npy"`` fast path off) by ``np.load``."""
    if not fastpath.enabled("npy") or len(data) < 10 or bytes(data[:6]) != MAGIC or data[6] not in (1, 2, 3):
        return np.load(io.BytesIO(data), allow_pickle=False)
    shape, fortran, dtype, offset = header_of(data)
    if dtype.hasobject:
        raise ValueError("object arrays cannot be loaded without pickle")
    count = int(np.prod(shape, dtype=np.int64)) if shape else 1
    arr = np.frombuffer(data, dtype=dtype, count=count, offset=offset)
    return arr.reshape(shape, order="F" if fortran else "C").copy(order="K")


def _enc_image(value: Any, ext: str) -> bytes:
    from .image import encode_image

    return encode_image(value, ext)


def _dec_image(data: bytes, options: DecodeOptions) -> Any:
    if options.image is None:
        return data
    from .image import decode_image

    return decode_image(
        data,
        options.image,
        max_pixels=options.max_pixels,
        exif_transpose=options.exif_transpose,
        jpeg_decoder=options.jpeg_decoder,
        min_side=options.min_side,
    )


def _enc_graph(value: Any, ext: str) -> bytes:
    from ..graph import encode_graph

    return encode_graph(value)


def _dec_graph(data: bytes, options: DecodeOptions) -> Any:
    from ..graph import decode_graph

    return decode_graph(data, max_nodes=options.max_graph_nodes, max_edges=options.max_graph_edges)


def _dec_graph_record(data: bytes, options: DecodeOptions) -> Any:
    decode = _GRAPH_RECORDS.get("decode")
    if decode is None:  # imported on first use (torch_geometric with it), once
        from ..graph.records import decode_graph_record

        decode = _GRAPH_RECORDS["decode"] = decode_graph_record
    return decode(data, max_nodes=options.max_graph_nodes, max_edges=options.max_graph_edges)


_GRAPH_RECORDS: dict[str, Any] = {}


def _dec_pickle(data: bytes, options: DecodeOptions) -> Any:
    if not options.allow_pickle:
        return data
    import torch

    return torch.load(io.BytesIO(data), weights_only=False)  # explicit user opt-in


def _dec_plain_pickle(data: bytes, options: DecodeOptions) -> Any:
    """A ``pickle``/``pkl`` field holds ``pickle.dumps`` bytes, which ``torch.load`` refuses
    ("Invalid magic number"): ``pth``/``pt`` are torch's files, these plain pickles."""
    if not options.allow_pickle:
        return data
    import pickle

    return pickle.loads(data)  # explicit user opt-in


for _ext in ("txt", "text"):
    register_codec(_ext, _enc_text, lambda d, o: str(d, "utf-8"))  # str() takes any buffer
for _ext in ("cls", "cls2", "idx", "index", "label"):
    register_codec(_ext, encode_int, decode_int)
register_codec("json", _enc_json, lambda d, o: json.loads(d if isinstance(d, (bytes, bytearray)) else bytes(d)))
register_codec("npy", _enc_npy, _dec_npy)
for _ext in IMAGE_EXTENSIONS:
    register_codec(_ext, _enc_image, _dec_image)
register_codec(IMAGE_FIELD, None, _dec_image)  # the alias: bytes of any image format
register_codec("pyg", _enc_graph, _dec_graph)
for _ext in ("pth", "pt"):
    register_codec(_ext, None, _dec_pickle)
for _ext in ("pickle", "pkl"):
    register_codec(_ext, None, _dec_plain_pickle)
