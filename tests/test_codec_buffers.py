"""Every codec decodes ``bytes``, ``bytearray`` and ``memoryview`` alike, for fields of
0.5-3 MiB (members of 1 MiB and more reach the decoders as ``bytearray``), checked
against the reference decoders (``numpy.load``, ``json``, Pillow, ``gzip``)."""

import gzip
import io
import json

import numpy as np
import pytest

from shardflow.codecs import DecodeOptions, decode_field, known_extensions

MiB = 1 << 20
SIZES = (MiB // 2, MiB, 3 * MiB - 4096)  # below, at and past the 1 MiB boundary
FORMS = (bytes, bytearray, memoryview)


def _npy(size: int, seed: int) -> bytes:
    arr = np.random.default_rng(seed).integers(0, 255, size=(size - 128) // 4, dtype=np.int32).reshape(-1, 1)
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=False)
    return buf.getvalue()


def _image(size: int, ext: str) -> bytes:
    from PIL import Image

    side = int((size / 3) ** 0.5) + 1
    img = Image.fromarray(np.random.default_rng(side).integers(0, 255, size=(side, side, 3), dtype=np.uint8))
    img = img.convert({"pgm": "L", "pbm": "1", "gif": "P"}.get(ext, "RGB"))
    buf = io.BytesIO()
    fmt = {"jpg": "JPEG", "jpeg": "JPEG", "tif": "TIFF", "pgm": "PPM", "pbm": "PPM", "image": "PNG"}.get(ext, ext.upper())
    img.save(buf, format=fmt, **({"quality": 95} if fmt == "JPEG" else {"lossless": True} if fmt == "WEBP" else {}))
    return buf.getvalue()


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("form", FORMS)
def test_npy_of_any_size_and_buffer(size, form):
    data = _npy(size, size)
    out = decode_field("x.npy", form(bytearray(data)) if form is memoryview else form(data), DecodeOptions())
    ref = np.load(io.BytesIO(data), allow_pickle=False)
    assert out.dtype == np.int32 and out.shape == ref.shape == ((size - 128) // 4, 1)
    np.testing.assert_array_equal(out, ref)
    out[0, 0] = -1  # a copy of its own, writable
    assert ref[0, 0] != -1


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("form", FORMS)
def test_text_int_json_gz_of_any_size_and_buffer(size, form):
    text = ("héllo wörld " * (size // 13 + 1))[: size // 2]
    doc = {"k": "x" * size, "n": [1, 2.5, None]}
    raw_json = json.dumps(doc).encode()
    opts = DecodeOptions()
    assert decode_field("a.txt", form(text.encode()), opts) == text
    assert decode_field("a.json", form(raw_json), opts) == doc
    assert decode_field("a.cls", form(b" " * size + b"42\n"), opts) == 42
    zipped = gzip.compress(_npy(size, 1), compresslevel=1)
    np.testing.assert_array_equal(
        decode_field("a.npy.gz", form(zipped), opts), np.load(io.BytesIO(gzip.decompress(zipped)))
    )
    unknown = bytes(range(256)) * (size // 256)
    assert bytes(decode_field("a.bin", form(unknown), opts)) == unknown


IMAGES = ["jpg", "jpeg", "png", "webp", "bmp", "gif", "tif", "tiff", "ppm", "pgm", "pbm", "image"]


@pytest.mark.parametrize("ext", IMAGES)
@pytest.mark.parametrize("form", FORMS)
def test_images_of_any_size_and_buffer(ext, form):
    from PIL import Image

    data = _image(16 * MiB if ext == "pbm" else MiB + MiB // 2, ext)
    assert len(data) > MiB // 2, len(data)
    ref = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
    for image in ("numpy", "torch", "pil"):
        out = decode_field(f"a.{ext}", form(data), DecodeOptions(image=image))
        arr = np.asarray(out) if image == "pil" else (out.permute(1, 2, 0).numpy() if image == "torch" else out)
        np.testing.assert_array_equal(arr, ref)


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("form", FORMS)
def test_graphs_of_any_size_and_buffer(size, form):
    torch = pytest.importorskip("torch")
    pyg = pytest.importorskip("torch_geometric.data")
    from shardflow.codecs import encode_field

    n = size // 64
    g = pyg.Data(x=torch.arange(n * 8, dtype=torch.float32).view(n, 8),
                 edge_index=torch.stack([torch.arange(n), torch.arange(n).flip(0)]))
    data = encode_field("k", "g.pyg", g)
    assert len(data) > size // 2
    for records in (False, True):
        out = decode_field("g.pyg", form(data), DecodeOptions(), graph_records=records)
        if records and not hasattr(out, "x"):
            out = out.build()
        assert torch.equal(out.x, g.x) and torch.equal(out.edge_index, g.edge_index)


@pytest.mark.parametrize("form", FORMS)
def test_pickle_fields_of_any_buffer(form):
    torch = pytest.importorskip("torch")
    t = torch.arange(MiB // 4, dtype=torch.int32)
    buf = io.BytesIO()
    torch.save({"t": t}, buf)
    data = buf.getvalue()
    assert bytes(decode_field("a.pth", form(data), DecodeOptions())) == data  # not opted in: bytes
    assert torch.equal(decode_field("a.pt", form(data), DecodeOptions(allow_pickle=True))["t"], t)
    import pickle

    plain = pickle.dumps({"a": list(range(MiB // 8))})
    for ext in ("pkl", "pickle"):
        assert decode_field(f"a.{ext}", form(plain), DecodeOptions(allow_pickle=True)) == pickle.loads(plain)


def test_every_registered_codec_is_covered():
    covered = {"npy", "txt", "text", "json", "cls", "cls2", "idx", "index", "label", "pyg", "pth", "pt", "pickle",
               "pkl", *IMAGES}
    assert set(known_extensions()) <= covered, set(known_extensions()) - covered
