"""convert arrays: .npy / .npz / HDF5 rows -> shards, read back exactly."""

from __future__ import annotations

import io

import json
import os

import h5py
import numpy as np
import pytest

import shardflow
from shardflow.cli import main
from shardflow.convert.records.arrays import RowReader, convert_arrays, inspect_array
from shardflow.convert.engine.engine import ConvertOptions
from shardflow.errors import ConversionError
from tests.order_reference import reference_permutation

ROWS = 5000


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    """5,000 x 64 x 64 x 3 uint8 rows and int64 labels, saved as .npy files."""
    folder = tmp_path_factory.mktemp("arrays")
    rng = np.random.default_rng(1234)
    x = rng.integers(0, 256, size=(ROWS, 64, 64, 3), dtype=np.uint8)
    y = rng.integers(0, 1000, size=ROWS, dtype=np.int64)
    np.save(folder / "x.npy", x)
    np.save(folder / "y.npy", y)
    return folder, x, y


def read_stream(dst):
    return list(shardflow.ShardDataset(str(dst), decode="numpy"))


@pytest.mark.parametrize("as_image", [None, "png"])
def test_npy_rows_round_trip_stream_and_indexed(images, tmp_path, as_image):
    folder, x, y = images
    dst = tmp_path / "out"
    m = convert_arrays(
        folder / "x.npy", str(dst), labels=folder / "y.npy", as_image=as_image, chunk_rows=300,
        options=ConvertOptions(max_count=1000, workers=2),
    )  # fmt: skip
    field = as_image or "npy"
    assert m.num_samples == ROWS and len(m.shards) == 5
    assert m.meta["rows"] == ROWS and m.meta["row_shape"] == [64, 64, 3] and m.meta["dtype"] == "|u1"
    assert m.meta["field"] == field and m.meta["labels"]["field"] == "cls"
    assert set(m.fields) == {field, "cls"}

    assert m.meta["order"] == "shuffled" and m.meta["order_seed"] == 0
    order = reference_permutation(ROWS)  # the default order: position p holds row order[p]
    got = read_stream(dst)
    assert [s["__key__"] for s in got] == [f"{i:09d}" for i in order]
    for i, s in zip(order, got):
        assert s[field].dtype == np.uint8 and s[field].shape == (64, 64, 3)
        assert np.array_equal(s[field], x[i]), i
        assert s["cls"] == y[i]

    ds = shardflow.IndexedShardDataset(str(dst), decode="numpy")
    assert len(ds) == ROWS
    for p in range(ROWS):
        s, i = ds[p], order[p]
        assert s["__key__"] == f"{i:09d}"
        assert np.array_equal(s[field], x[i]) and s["cls"] == y[i], i


def test_chunks_much_smaller_than_source(tmp_path):
    """A source 20x the chunk: every row written once, exactly, in the walk's order or the
    shuffled one (memory is measured by tools/bench_arrays_memory.py)."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal((2000, 3, 5)).astype(np.float64)
    np.save(tmp_path / "x.npy", x)
    for order, rows in (("walk", list(range(2000))), ("shuffled", reference_permutation(2000))):
        m = convert_arrays(tmp_path / "x.npy", str(tmp_path / order), chunk_rows=100, order=order,
                           options=ConvertOptions(max_count=2000, workers=1))
        assert len(m.shards) == 1 and m.num_samples == 2000 and m.meta["order"] == order
        got = np.stack([s["npy"] for s in read_stream(tmp_path / order)])
        assert got.dtype == np.float64 and np.array_equal(got, x[rows])


def test_row_reader_reads_ranges_of_every_kind(tmp_path):
    rng = np.random.default_rng(3)
    x = rng.integers(-(2**31), 2**31, size=(101, 4, 3), dtype=np.int32)
    np.save(tmp_path / "c.npy", x)
    np.save(tmp_path / "f.npy", np.asfortranarray(x))
    np.savez(tmp_path / "s.npz", x=x, f=np.asfortranarray(x))
    np.savez_compressed(tmp_path / "z.npz", x=x, f=np.asfortranarray(x))
    with h5py.File(tmp_path / "h.h5", "w") as f:
        f.create_dataset("g/x", data=x, chunks=(7, 4, 3), compression="gzip")
    sources = ["c.npy", "f.npy", "s.npz:x", "s.npz:f", "z.npz:x", "z.npz:f", "h.h5:g/x"]
    for src in sources:
        spec = inspect_array(str(tmp_path / src))
        assert spec.shape == x.shape and spec.dtype == x.dtype, src
        with RowReader(spec) as r:
            # forward, backward (reopens a compressed stream) and empty ranges
            for a, b in [(0, 10), (10, 11), (50, 101), (3, 40), (7, 7), (100, 101)]:
                got = r.read(a, b)
                assert got.flags.c_contiguous and np.array_equal(got, x[a:b]), (src, a, b)
            with pytest.raises(IndexError):
                r.read(100, 102)


def test_npz_members_and_labels_by_name(tmp_path):
    rng = np.random.default_rng(5)
    x = rng.integers(0, 256, size=(300, 8, 8), dtype=np.uint8)
    y = rng.integers(0, 5, size=300, dtype=np.uint8)
    np.savez_compressed(tmp_path / "d.npz", images=x, labels=y)
    with pytest.raises(ConversionError, match=r"choose one with --array"):
        convert_arrays(tmp_path / "d.npz", str(tmp_path / "bad"))
    with pytest.raises(ConversionError, match=r"no array 'nope'.*images"):
        convert_arrays(tmp_path / "d.npz", str(tmp_path / "bad"), array="nope")
    m = convert_arrays(tmp_path / "d.npz", str(tmp_path / "out"), array="images", labels="labels",
                       as_image="png", options=ConvertOptions(max_count=64, workers=2))
    assert m.meta["source"].endswith("d.npz:images") and m.meta["labels"]["field"] == "cls"
    got = read_stream(tmp_path / "out")
    assert [int(s["__key__"]) for s in got] == reference_permutation(300)  # a compressed member, shuffled
    for s in got:
        i = int(s["__key__"])
        assert np.array_equal(s["png"][..., 0], x[i]) and s["cls"] == y[i]  # grey decodes to RGB


def tensor_crop(sample):
    """Transform: the top-left 20 x 20 crop of the matrix (module level: picklable)."""
    return sample["npy"][:20, :20]


def test_hdf5_matrices_exact_and_cropped(tmp_path):
    rng = np.random.default_rng(11)
    mats = rng.standard_normal((8, 512, 512)).astype(np.float32)
    targets = rng.standard_normal((8, 2)).astype(np.float32)
    path = tmp_path / "fields.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("sim/velocity", data=mats, chunks=(1, 512, 512))
        f.create_dataset("sim/target", data=targets)
    with pytest.raises(ConversionError, match=r"holds the datasets"):
        convert_arrays(path, str(tmp_path / "bad"))
    m = convert_arrays(f"{path}:sim/velocity", str(tmp_path / "out"), labels="sim/target",
                       options=ConvertOptions(max_count=3, workers=2))
    assert len(m.shards) == 3 and m.meta["dtype"] == "<f4" and m.meta["row_shape"] == [512, 512]
    assert m.meta["array"] == "sim/velocity" and m.meta["labels"]["field"] == "label.npy"
    got = read_stream(tmp_path / "out")
    order = reference_permutation(8)
    assert [int(s["__key__"]) for s in got] == order
    for i, s in zip(order, got):
        assert s["npy"].dtype == np.float32 and np.array_equal(s["npy"], mats[i])
        assert np.array_equal(s["label.npy"], targets[i])
    crops = shardflow.IndexedShardDataset(str(tmp_path / "out"), transform=tensor_crop)
    assert len(crops) == 8
    for p in range(8):
        assert np.array_equal(crops[p], mats[order[p], :20, :20])
    # --array NAME gives the same shards as FILE:NAME (byte-identical without the labels' field)
    m2 = convert_arrays(path, str(tmp_path / "out2"), array="/sim/velocity", options=ConvertOptions(max_count=3, workers=1))
    m3 = convert_arrays(f"{path}:sim/velocity", str(tmp_path / "out3"), options=ConvertOptions(max_count=3, workers=2))
    assert m2.num_samples == 8 and [s.sha256 for s in m2.shards] == [s.sha256 for s in m3.shards]


def test_exact_dtypes_and_structured_rows(tmp_path):
    rows = np.zeros(4, dtype=[("a", "<i2"), ("b", ">f8", (2,))])
    rows["a"] = [1, -2, 3, -4]
    rows["b"] = [[0.5, 1], [2, 3], [4, 5], [6, 7.25]]
    np.save(tmp_path / "s.npy", rows)
    np.save(tmp_path / "b.npy", np.array([[True, False], [False, True]]))
    np.save(tmp_path / "c.npy", (np.arange(6) + 1j).astype(np.complex64).reshape(3, 2))
    for name in ("s", "b", "c"):
        ref = np.load(tmp_path / f"{name}.npy")
        convert_arrays(tmp_path / f"{name}.npy", str(tmp_path / name), options=ConvertOptions(workers=1))
        got = [s["npy"] for s in read_stream(tmp_path / name)]
        assert len(got) == len(ref)
        for a, b in zip(got, ref[reference_permutation(len(ref))]):
            assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def test_resume_keeps_shards_and_notices_changed_settings(tmp_path, images):
    folder, x, _ = images
    src = tmp_path / "small.npy"
    np.save(src, x[:200])
    dst = tmp_path / "out"
    opts = ConvertOptions(max_count=50, workers=1)
    convert_arrays(src, str(dst), options=opts)
    before = {p.name: p.stat().st_mtime_ns for p in dst.glob("*.tar")}
    m = convert_arrays(src, str(dst), options=opts)  # nothing changed: every shard kept
    assert {p.name: p.stat().st_mtime_ns for p in dst.glob("*.tar")} == before and m.num_samples == 200
    m = convert_arrays(src, str(dst), as_image="png", options=opts)  # another encoding: rewritten
    assert m.fields.keys() >= {"png"}
    got = read_stream(dst)
    assert [int(s["__key__"]) for s in got] == reference_permutation(200)
    assert all("png" in s and "npy" not in s and np.array_equal(s["png"], x[int(s["__key__"])]) for s in got)


def test_refuses_what_cannot_round_trip(tmp_path):
    np.save(tmp_path / "f.npy", np.zeros((3, 4, 4), np.float32))
    with pytest.raises(ConversionError, match=r"cannot be stored as png"):
        convert_arrays(tmp_path / "f.npy", str(tmp_path / "o1"), as_image="png")
    np.save(tmp_path / "o.npy", np.array([1, "a"], dtype=object), allow_pickle=True)
    with pytest.raises(ConversionError, match=r"Python objects"):
        convert_arrays(tmp_path / "o.npy", str(tmp_path / "o2"))
    np.save(tmp_path / "s.npy", np.float32(3))
    with pytest.raises(ConversionError, match=r"0-d array"):
        convert_arrays(tmp_path / "s.npy", str(tmp_path / "o3"))
    np.save(tmp_path / "y.npy", np.arange(2))
    with pytest.raises(ConversionError, match=r"have 2 rows but .* has 3"):
        convert_arrays(tmp_path / "f.npy", str(tmp_path / "o4"), labels=tmp_path / "y.npy")
    (tmp_path / "t.txt").write_text("hello")
    with pytest.raises(ConversionError, match=r"not a .npy, .npz or HDF5"):
        convert_arrays(tmp_path / "t.txt", str(tmp_path / "o5"))
    with pytest.raises(FileNotFoundError):
        convert_arrays(tmp_path / "missing.npy", str(tmp_path / "o6"))
    with pytest.raises(ValueError, match=r"as_image"):
        convert_arrays(tmp_path / "f.npy", str(tmp_path / "o7"), as_image="gif")


def test_empty_array_gives_empty_manifest(tmp_path):
    np.save(tmp_path / "e.npy", np.zeros((0, 3), np.int8))
    m = convert_arrays(tmp_path / "e.npy", str(tmp_path / "out"), options=ConvertOptions(workers=1))
    assert m.num_samples == 0 and m.meta["rows"] == 0


def test_rows_in_any_order_come_back_in_that_order(tmp_path):
    """RowReader.rows (a shuffled conversion's chunk): each kind of source gives x[rows], in the
    order asked, for runs, gaps and reversed rows alike."""
    x = np.arange(61 * 3 * 2, dtype=np.int32).reshape(61, 3, 2)
    np.save(tmp_path / "x.npy", x)
    np.savez(tmp_path / "s.npz", x=x)
    np.savez_compressed(tmp_path / "c.npz", x=x, f=np.asfortranarray(x))
    np.save(tmp_path / "f.npy", np.asfortranarray(x))
    with h5py.File(tmp_path / "h.h5", "w") as f:
        f.create_dataset("x", data=x, chunks=(7, 3, 2), compression="gzip")
    sources = [str(tmp_path / n) for n in ("x.npy", "f.npy", "s.npz:x", "c.npz:x", "c.npz:f", "h.h5:x")]
    rng = np.random.default_rng(5)
    cases = [[], [7], list(range(10, 20)), [60, 0, 30], list(range(60, -1, -1))]
    cases += [rng.permutation(61)[: rng.integers(1, 61)].tolist() for _ in range(20)]
    for src in sources:
        with RowReader(inspect_array(src)) as reader:
            for rows in cases:
                got = reader.rows(rows)
                assert got.shape == (len(rows), 3, 2) and got.flags.c_contiguous
                assert np.array_equal(got, x[rows]), (src, rows)
        with RowReader(inspect_array(src)) as reader, pytest.raises(IndexError):
            reader.rows([3, 61])


def test_cli(tmp_path, images, capsys):
    folder, x, y = images
    src = tmp_path / "d.npz"
    np.savez(src, x=x[:120], y=y[:120])
    rc = main(["convert", "arrays", f"{src}:x", str(tmp_path / "out"), "--labels", "y", "--as", "png",
               "--max-count", "50", "--chunk-rows", "16", "--workers", "2"])
    assert rc == 0 and "120 rows" in capsys.readouterr().out
    manifest = json.loads((tmp_path / "out" / "shardflow.json").read_text())
    assert [s["samples"] for s in manifest["shards"]] == [50, 50, 20]
    assert manifest["meta"]["order"] == "shuffled"
    got = read_stream(tmp_path / "out")
    assert [int(s["__key__"]) for s in got] == reference_permutation(120)
    assert all(np.array_equal(s["png"], x[i]) and s["cls"] == y[i] for i, s in ((int(s["__key__"]), s) for s in got))
    assert main(["convert", "arrays", str(tmp_path / "nope.npy"), str(tmp_path / "o")]) == 1
    assert "no such file" in capsys.readouterr().err
    assert os.path.exists(tmp_path / "out" / "train-000000.tar.idx.npy")


def test_default_chunk_is_shared_by_the_workers(tmp_path, monkeypatch):
    """Without chunk_rows, the workers together hold DEFAULT_MEMORY_BYTES of rows: a worker
    reads 32 MiB / workers at once (here 1 MiB rows: 32 rows alone, 16 each for 2 workers)."""
    from shardflow.convert.records import arrays
    from shardflow.convert.engine.engine import ConvertOptions

    x = np.lib.format.open_memmap(tmp_path / "x.npy", mode="w+", dtype=np.uint8, shape=(70, 1024, 1024))
    x[:] = np.arange(70, dtype=np.uint8)[:, None, None]
    x.flush()
    del x
    spec = inspect_array(tmp_path / "x.npy")
    assert arrays.DEFAULT_MEMORY_BYTES == 32 << 20
    assert [arrays.default_chunk_rows(spec, w) for w in (1, 2, 3, 64)] == [32, 16, 10, 1]
    reads: list[int] = []
    real = RowReader.take
    monkeypatch.setattr(RowReader, "take", lambda self, rows: reads.append(len(rows)) or real(self, rows))
    m = convert_arrays(tmp_path / "x.npy", str(tmp_path / "out"), options=ConvertOptions(max_count=50, workers=1))
    assert m.num_samples == 70 and reads == [32, 18, 20]  # shard 0: 50 rows, shard 1: 20 rows
    import shardflow

    got = [np.load(io.BytesIO(bytes(s["npy"]))) for s in shardflow.ShardDataset(str(tmp_path / "out"), decode=None)]
    rows = reference_permutation(70)
    assert [(g.shape, int(g[0, 0]), int(g[-1, -1])) for g in got] == [((1024, 1024), i, i) for i in rows]
