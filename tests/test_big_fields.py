"""Fields of 0.5-3 MiB, of every codec, through every reader path, against a reference reader
(stdlib tarfile + Pillow, numpy.load, json): members of 1 MiB and more arrive as bytearray."""

from __future__ import annotations

import gzip
import io
import json
import tarfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from shardflow import IndexedShardDataset, ShardDataset, ShardWriter
from shardflow.writing.indexing import index_shards

MiB = 1 << 20


def _npy_from_bytearray_fails() -> bool:
    from shardflow.codecs import DecodeOptions, decode_field
    from shardflow.errors import DecodeError

    buf = io.BytesIO()
    np.save(buf, np.zeros(3, np.uint8))
    try:
        decode_field("npy", bytearray(buf.getvalue()), DecodeOptions())
    except (TypeError, DecodeError):
        return True
    return False


pytestmark = [
    pytest.mark.usefixtures("fast_paths"),
    # fixed in the codecs by the `safety` branch (695b945): the marker goes away with it
    pytest.mark.xfail(_npy_from_bytearray_fails(), reason="a .npy member of 1 MiB+ arrives as bytearray and the "
                      "codec's cached header parse hashes it", raises=Exception, strict=False),
]


def _sample(i: int) -> dict[str, bytes]:
    rng = np.random.default_rng(i)
    noise = rng.integers(0, 256, (700, 700, 3), dtype=np.uint8)  # incompressible: ~1.4 MiB as PNG
    png, jpg = io.BytesIO(), io.BytesIO()
    Image.fromarray(noise).save(png, format="PNG")
    Image.fromarray(noise).save(jpg, format="JPEG", quality=98)
    arr = io.BytesIO()
    np.save(arr, rng.integers(0, 256, (3 * MiB - 256,), dtype=np.uint8), allow_pickle=False)
    text = rng.integers(0, 10**9, MiB // 8).astype(str)
    return {
        "png": png.getvalue(), "jpg": jpg.getvalue(), "npy": arr.getvalue(),
        "txt": " ".join(text).encode(), "json": json.dumps(text[: MiB // 16].tolist()).encode(),
        "bin.gz": gzip.compress(rng.bytes(MiB // 2 + 7), compresslevel=1),
        "cls": str(i).encode(),
    }  # fmt: skip


def _reference(tar: Path) -> dict[str, dict[str, object]]:
    out: dict[str, dict[str, object]] = {}
    with tarfile.open(tar) as t:
        for m in t.getmembers():
            key, field = m.name.split(".", 1)
            data = t.extractfile(m).read()
            if field in ("png", "jpg"):
                value: object = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
            elif field == "npy":
                value = np.load(io.BytesIO(data), allow_pickle=False)
            elif field == "json":
                value = json.loads(data)
            elif field == "txt":
                value = data.decode()
            elif field == "cls":
                value = int(data)
            else:
                value = gzip.decompress(data)
            out.setdefault(key, {})[field] = value
    return out


@pytest.fixture(scope="module")
def big(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("big")
    with ShardWriter(str(folder / "train-%06d.tar"), max_count=3) as w:
        for i in range(6):
            w.write({"__key__": f"{i:06d}", **_sample(i)})
    sizes = [len(v) for v in _sample(0).values()]
    assert sum(MiB // 2 <= n <= 3 * MiB for n in sizes) == len(sizes) - 1  # all but cls
    return folder


def _check(samples: list[dict[str, object]], reference: dict[str, dict[str, object]]) -> None:
    assert sorted(s["__key__"] for s in samples) == sorted(reference)
    for s in samples:
        want = reference[s["__key__"]]
        for field, value in want.items():
            got = s[field]
            if isinstance(value, np.ndarray):
                assert isinstance(got, np.ndarray) and got.dtype == value.dtype and np.array_equal(got, value), field
            else:
                assert got == value, field


@pytest.mark.parametrize("path", ["stored", "shuffled", "resumed", "unsized", "indexed"])
def test_big_fields_of_every_codec_decode_on_every_path(big: Path, tmp_path: Path, path: str) -> None:
    reference: dict[str, dict[str, object]] = {}
    for tar in sorted(big.glob("*.tar")):
        reference.update(_reference(tar))
    if path == "indexed":
        ds = IndexedShardDataset(big, decode="numpy")
        samples = [ds[i] for i in range(len(ds))]
    elif path == "unsized":
        bare = tmp_path / "bare"
        bare.mkdir()
        for tar in big.glob("*.tar"):
            (bare / tar.name).write_bytes(tar.read_bytes())
        samples = list(ShardDataset(bare, decode="numpy", shuffle=4))
    elif path == "resumed":
        ds = ShardDataset(big, decode="numpy", shuffle=4)
        it = iter(ds)
        head = [next(it) for _ in range(2)]
        state = ds.state_dict()
        again = ShardDataset(big, decode="numpy", shuffle=4)
        again.load_state_dict(state)
        samples = head + list(again)
    else:
        samples = list(ShardDataset(big, decode="numpy", shuffle=4 if path == "shuffled" else False))
    _check(samples, reference)
