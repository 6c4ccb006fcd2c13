"""convert lmdb: one sample per key, the value's bytes unchanged; pickles refused unless opted in.

The reference is lmdb's own read of the database (a cursor over every key); the shards are
read back with the reference reader (stdlib ``tarfile``).
"""

from __future__ import annotations

import io
import json
import pickle
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

lmdb = pytest.importorskip("lmdb")
from PIL import Image  # noqa: E402

import shardflow  # noqa: E402
from shardflow.cli import main  # noqa: E402
from shardflow.codecs import DecodeOptions  # noqa: E402
from shardflow.convert.engine.engine import ConvertOptions  # noqa: E402
from shardflow.convert.records.lmdb import convert_lmdb, original_key, tar_key  # noqa: E402
from shardflow.errors import ConversionError, PickledValueError  # noqa: E402
from shardflow.format.keys import check_key  # noqa: E402
from tests.order_reference import reference_permutation  # noqa: E402
from tests.reference import read_dataset  # noqa: E402


def jpeg(i: int) -> bytes:
    rng = np.random.default_rng(i)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (5 + i % 4, 7, 3), dtype=np.uint8)).save(buf, "JPEG", quality=85)
    return buf.getvalue()


def png(i: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.full((3, 4), i, dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def make_lmdb(path: Path, items: dict[bytes, bytes], subdir: bool = True) -> None:
    env = lmdb.open(str(path), map_size=1 << 26, subdir=subdir)
    with env.begin(write=True) as txn:
        for k, v in items.items():
            txn.put(k, v)
    env.close()


def reference(path: Path, subdir: bool = True) -> list[tuple[bytes, bytes]]:
    """lmdb's own read: every (key, value) in key order."""
    env = lmdb.open(str(path), readonly=True, lock=False, subdir=subdir)
    try:
        with env.begin() as txn:
            return list(txn.cursor().iternext())
    finally:
        env.close()


def shuffled(ref: list) -> list:
    """``ref`` (key order) in the default, shuffled order of the converters."""
    return [ref[i] for i in reference_permutation(len(ref))]


def tar_samples(dst: Path) -> list[dict]:
    """Every sample of the dataset's shards, in manifest order, read by the reference reader (``tarfile``)."""
    return [{"__key__": s.key, **s.fields} for s in read_dataset(dst)[0]]


def test_fifty_jpeg_values_keys_preserved_bytes_unchanged(tmp_path, capsys):
    make_lmdb(tmp_path / "db", {f"img_{i:05d}".encode(): jpeg(i) for i in range(50)})
    dst = tmp_path / "out"
    assert main(["convert", "lmdb", str(tmp_path / "db"), str(dst)]) == 0
    assert "50 keys of" in capsys.readouterr().out
    ref = reference(tmp_path / "db")
    got = tar_samples(dst)
    assert len(ref) == 50
    assert got == [{"__key__": k.decode(), "jpg": v} for k, v in shuffled(ref)]
    meta = json.loads((dst / "shardflow.json").read_text())["meta"]
    assert meta["order"] == "shuffled" and meta["order_seed"] == 0
    assert meta["entries"] == 50 and meta["keys"]["changed"] == 0 and meta["keys"]["examples"] == {}


@pytest.mark.parametrize("order", ["shuffled", "walk"])
def test_key_ranges_in_parallel_with_escaped_keys(tmp_path, order):
    """Shuffled: each worker looks its keys up; walk: each reads its key range with a cursor."""
    items = {f"n0144/{i:03d}.JPEG".encode(): jpeg(i) for i in range(40)}
    items.update({b"__len__x": png(1), b"a//b": png(2), "é/ü~".encode(): png(3)})
    buf = io.BytesIO()
    np.save(buf, np.arange(6, dtype=np.int16).reshape(2, 3))
    items[b"\xff\xfe"] = buf.getvalue()
    make_lmdb(tmp_path / "db", items)
    m = convert_lmdb(tmp_path / "db", str(tmp_path / "out"), options=ConvertOptions(max_count=16, workers=2),
                     order=order)
    assert [s.samples for s in m.shards] == [16, 16, 12] and m.meta["order"] == order
    ref = reference(tmp_path / "db")
    ref = shuffled(ref) if order == "shuffled" else ref
    got = tar_samples(tmp_path / "out")
    assert [original_key(s["__key__"]) for s in got] == [k for k, _ in ref]
    for sample, (k, v) in zip(got, ref):
        (field,) = set(sample) - {"__key__"}
        assert sample[field] == v
        assert field == ("jpg" if v.startswith(b"\xff\xd8") else "png" if v.startswith(b"\x89PNG") else "npy")
    keys = {original_key(s["__key__"]): s["__key__"] for s in got}
    assert keys[b"n0144/007.JPEG"] == "n0144/007%2EJPEG"
    assert keys[b"__len__x"] == "%5F_len__x" and keys[b"a//b"] == "a%2F/b" and keys[b"\xff\xfe"] == "%FF%FE"
    assert keys["é/ü~".encode()] == "é/ü%7E"
    assert m.meta["keys"]["changed"] == 44
    arr = next(s for s in shardflow.ShardDataset(str(tmp_path / "out"), decode="numpy") if "npy" in s)["npy"]
    assert arr.tolist() == [[0, 1, 2], [3, 4, 5]]


def test_a_pickled_value_is_refused_naming_the_key(tmp_path):
    items = {f"{i:03d}".encode(): jpeg(i) for i in range(5)}
    items[b"__len__"] = pickle.dumps(5)
    make_lmdb(tmp_path / "db", items)
    with pytest.raises(PickledValueError, match=r"the value of key '__len__' is a pickle \(protocol \d\); shardflow never unpickles"):
        convert_lmdb(tmp_path / "db", str(tmp_path / "out"), options=ConvertOptions(workers=1))
    assert main(["convert", "lmdb", str(tmp_path / "db"), str(tmp_path / "o2"), "--workers", "1"]) == 1
    # opted in: stored unchanged under "pickle", unpickled only by a reader that opts in too
    convert_lmdb(tmp_path / "db", str(tmp_path / "out"), allow_pickle=True, options=ConvertOptions(workers=1))
    got = {s["__key__"]: s for s in tar_samples(tmp_path / "out")}
    assert got["%5F_len__"] == {"__key__": "%5F_len__", "pickle": pickle.dumps(5)}
    raw = {s["__key__"]: s for s in shardflow.ShardDataset(str(tmp_path / "out"), decode=None)}
    assert raw["%5F_len__"]["pickle"] == pickle.dumps(5)
    opted = shardflow.ShardDataset(str(tmp_path / "out"), decode=DecodeOptions(image=None, allow_pickle=True))
    assert {s["__key__"]: s for s in opted}["%5F_len__"]["pickle"] == 5


def test_values_of_no_known_format_need_a_field(tmp_path):
    make_lmdb(tmp_path / "db", {b"a": jpeg(0), b"b": b"hello"})
    with pytest.raises(ConversionError, match=r"the value of key 'b' \(5 bytes starting b'hello'\) is no image or \.npy"):
        convert_lmdb(tmp_path / "db", str(tmp_path / "out"), options=ConvertOptions(workers=1))
    convert_lmdb(tmp_path / "db", str(tmp_path / "out"), field="bin", options=ConvertOptions(workers=1))
    got = tar_samples(tmp_path / "out")
    assert got == shuffled([{"__key__": "a", "bin": jpeg(0)}, {"__key__": "b", "bin": b"hello"}])


def test_a_data_file_environment_and_source_errors(tmp_path):
    make_lmdb(tmp_path / "one.mdb", {b"k1": png(1), b"k2": png(2)}, subdir=False)
    m = convert_lmdb(tmp_path / "one.mdb", str(tmp_path / "out"), options=ConvertOptions(workers=1))
    assert m.num_samples == 2
    assert tar_samples(tmp_path / "out") == [{"__key__": k.decode(), "png": v}
                                             for k, v in shuffled(reference(tmp_path / "one.mdb", subdir=False))]  # fmt: skip
    with pytest.raises(FileNotFoundError, match="no such LMDB environment"):
        convert_lmdb(tmp_path / "nothing", str(tmp_path / "o2"))
    with pytest.raises(ConversionError, match="must be a local path"):
        convert_lmdb("s3://bucket/db", str(tmp_path / "o3"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConversionError, match="cannot open as an LMDB environment"):
        convert_lmdb(tmp_path / "empty", str(tmp_path / "o4"))


@settings(max_examples=300, deadline=None)
@given(st.binary(min_size=1, max_size=60))
def test_the_key_rule_is_tar_safe_and_reversible(raw):
    key = tar_key(raw)
    assert check_key(key) == key
    assert original_key(key) == raw
