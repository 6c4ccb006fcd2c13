"""IndexedShardDataset: random access by global index through the offset index."""

from __future__ import annotations

import gzip
import os
import pickle
import shutil

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

import shardflow
from shardflow.errors import ManifestError, ShardFormatError
from shardflow.format.manifest import MANIFEST_NAME, Manifest
from shardflow.writing.writer import ShardWriter, write_manifest
from tests.helpers import handles_under

SIZES = (37, 1, 50, 12, 37)  # shards of uneven size
N = sum(SIZES)


def sample(i: int) -> dict:
    rng = np.random.default_rng(i)
    return {
        "__key__": f"s{i:05d}",
        "cls": i,
        "npy": rng.standard_normal((3, 1 + i % 4)).astype(np.float32),
        "txt": "é" * (i % 7) + str(i),
        # sizes that cross 512-byte tar blocks in every way
        "bin": rng.bytes(int(rng.integers(0, 3000))),
    }


def write_dataset(folder, *, index: bool = True, sizes=SIZES) -> str:
    """One ShardWriter per shard size; one manifest listing them all."""
    os.makedirs(folder, exist_ok=True)
    combined = Manifest(shards=[])
    i = 0
    for s, size in enumerate(sizes):
        w = ShardWriter(f"{folder}/train-%06d.tar", max_count=size, start_shard=s, manifest=False, index=index)
        with w:
            for _ in range(size):
                w.write(sample(i))
                i += 1
        combined.shards.extend(w.manifest.shards)
        combined.fields.update(w.manifest.fields)
    write_manifest(f"{folder}/{MANIFEST_NAME}", combined)
    return str(folder)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return write_dataset(tmp_path_factory.mktemp("indexed") / "ds")


def same(a: dict, b: dict) -> bool:
    if a.keys() != b.keys():
        return False
    for k in a:
        x, y = a[k], b[k]
        if isinstance(x, np.ndarray):
            if not (x.dtype == y.dtype and np.array_equal(x, y)):
                return False
        elif x != y:
            return False
    return True


def test_every_index_equals_sequential_reading(dataset):
    seq = list(shardflow.ShardDataset(dataset, decode="numpy"))
    ds = shardflow.IndexedShardDataset(dataset, decode="numpy")
    assert len(ds) == N == len(seq)
    order = np.random.default_rng(0).permutation(N)  # random order: the cache is used out of order
    for i in order:
        assert same(ds[int(i)], seq[i]), i
    for i in range(N):
        assert same(ds[i], seq[i])
        assert same(ds[i - N], seq[i])  # negative indices
    assert ds[np.int64(5)]["__key__"] == "s00005"
    assert ds[torch.tensor(7)]["__key__"] == "s00007"
    expected = sample(40)
    got = ds[40]
    assert got["cls"] == 40 and got["txt"] == expected["txt"] and got["bin"] == expected["bin"]
    assert np.array_equal(got["npy"], expected["npy"]) and got["__url__"].endswith("train-000002.tar")


def test_decode_none_and_transform(dataset):
    raw = shardflow.IndexedShardDataset(dataset, decode=None)
    assert raw[3]["cls"] == b"3" and raw[3]["txt"] == sample(3)["txt"].encode()
    ds = shardflow.IndexedShardDataset(dataset, transform=key_and_label)
    assert [ds[i] for i in range(3)] == [("s00000", 0), ("s00001", 1), ("s00002", 2)]


def test_index_error_and_locate(dataset):
    ds = shardflow.IndexedShardDataset(dataset)
    for bad in (N, N + 10, -N - 1):
        with pytest.raises(IndexError, match=rf"out of range for a dataset of {N} samples"):
            ds[bad]
    with pytest.raises(TypeError):
        ds[1.5]
    assert ds.locate(0) == (0, 0) and ds.locate(37) == (1, 0) and ds.locate(38) == (2, 0) and ds.locate(-1) == (4, 36)
    # map-style: plain iteration walks the indexes until IndexError
    assert [s["__key__"] for s in ds] == [f"s{i:05d}" for i in range(N)]


def key_and_label(sample):
    return sample["__key__"], sample["cls"]


def test_distributed_sampler_with_workers_covers_every_index(dataset):
    ds = shardflow.IndexedShardDataset(dataset, max_open=2, transform=key_and_label)
    ds[0]  # a warm cache (with an open descriptor) must not leak into forked workers
    seen = []
    for rank in range(2):
        sampler = DistributedSampler(ds, num_replicas=2, rank=rank, shuffle=True, seed=0)
        loader = DataLoader(ds, batch_size=16, sampler=sampler, num_workers=2, multiprocessing_context="fork")
        keys, labels = [], []
        for batch_keys, batch_labels in loader:
            keys += batch_keys
            labels += batch_labels.tolist()
        assert keys == [f"s{i:05d}" for i in sampler]  # the sampler's order, exactly
        assert labels == list(sampler)
        seen += labels
    pad = (-N) % 2  # DistributedSampler pads to a multiple of the world size
    assert sorted(set(seen)) == list(range(N)) and len(seen) == N + pad


def test_spawned_workers_get_a_pickled_copy(dataset):
    ds = shardflow.IndexedShardDataset(dataset, transform=key_and_label)
    ds[0]
    sampler = DistributedSampler(ds, num_replicas=2, rank=1, shuffle=True, seed=3)
    loader = DataLoader(ds, batch_size=32, sampler=sampler, num_workers=1, multiprocessing_context="spawn")
    labels = [y for _, ys in loader for y in ys.tolist()]
    assert labels == list(sampler)


def test_pickle_has_no_open_handles(dataset):
    ds = shardflow.IndexedShardDataset(dataset)
    before = handles_under(dataset)
    for i in range(N):
        ds[i]
    assert handles_under(dataset) - before == len(SIZES)  # one per shard, all cached (max_open=16)
    clone = pickle.loads(pickle.dumps(ds))
    assert handles_under(dataset) - before == len(SIZES)  # the copy opened nothing
    assert same(clone[60], ds[60])
    ds.close()
    clone.close()
    assert handles_under(dataset) == before
    with pytest.raises(TypeError, match=r"cannot be pickled"):
        pickle.dumps(shardflow.IndexedShardDataset(dataset, transform=lambda s: s))


def test_max_open_bounds_descriptors(dataset):
    ds = shardflow.IndexedShardDataset(dataset, max_open=2)
    seq = list(shardflow.ShardDataset(dataset))
    before = handles_under(dataset)
    for i in np.random.default_rng(1).permutation(N):
        assert same(ds[int(i)], seq[i])
        assert handles_under(dataset) - before <= 2
    with pytest.raises(ValueError, match=r"max_open"):
        shardflow.IndexedShardDataset(dataset, max_open=0)


def test_missing_index_is_a_clear_error(tmp_path):
    folder = write_dataset(tmp_path / "noidx", index=False, sizes=(3, 4))
    with pytest.raises(ManifestError, match=r"2 of 2 shards have no offset index.*shardflow index"):
        shardflow.IndexedShardDataset(folder)
    folder = write_dataset(tmp_path / "lost", sizes=(3, 4))
    os.remove(f"{folder}/train-000001.tar.idx.npy")
    ds = shardflow.IndexedShardDataset(folder)
    assert ds[2]["cls"] == 2
    with pytest.raises(ManifestError, match=r"train-000001.tar.idx.npy is missing; run `shardflow index`"):
        ds[3]
    shutil.copy(f"{folder}/train-000000.tar", f"{tmp_path}/bare.tar")  # no manifest at all
    with pytest.raises(ManifestError, match=r"no shardflow.json manifest.*shardflow index"):
        shardflow.IndexedShardDataset([f"{tmp_path}/bare.tar"])


def test_stale_index_is_detected(tmp_path):
    folder = write_dataset(tmp_path / "stale", sizes=(5,))
    idx = np.load(f"{folder}/train-000000.tar.idx.npy")
    # an index of another shard: sample 0 "spans" samples 0 and 1, the last one the end-of-archive block
    fake = np.array([idx[0], idx[2], idx[3], idx[4], idx[5], idx[5] + 512], dtype=np.int64)
    np.save(f"{folder}/train-000000.tar.idx.npy", fake)
    ds = shardflow.IndexedShardDataset(folder)
    with pytest.raises(ManifestError, match=r"hold 2 samples instead of 1; the offset index does not match"):
        ds[0]
    with pytest.raises(ManifestError, match=r"hold 0 samples instead of 1"):
        ds[4]


def test_compressed_shards_are_refused(tmp_path):
    folder = write_dataset(tmp_path / "gz", sizes=(4, 4))
    path = f"{folder}/train-000001.tar"
    with open(path, "rb") as f:
        data = f.read()
    with open(path, "wb") as f:  # compressed content under a .tar name: found by magic bytes
        f.write(gzip.compress(data))
    ds = shardflow.IndexedShardDataset(folder)
    assert ds[3]["cls"] == 3
    with pytest.raises(ShardFormatError, match=r"compressed shard; random access needs plain .tar shards"):
        ds[4]
    os.rename(path, path + ".gz")
    m = Manifest.loads(open(f"{folder}/{MANIFEST_NAME}", "rb").read())
    m.shards[1] = type(m.shards[1])(url="train-000001.tar.gz", samples=4, bytes=len(data), index=m.shards[1].index)
    write_manifest(f"{folder}/{MANIFEST_NAME}", m)
    with pytest.raises(ShardFormatError, match=r"train-000001.tar.gz: compressed shard"):
        shardflow.IndexedShardDataset(folder)


def test_remote_memory_and_http(dataset, http_server):
    seq = list(shardflow.ShardDataset(dataset))
    import fsspec

    fs = fsspec.filesystem("memory")
    for name in os.listdir(dataset):
        with open(f"{dataset}/{name}", "rb") as f:
            fs.pipe(f"/indexed-test/{name}", f.read())
            http_server.put(f"indexed/{name}", open(f"{dataset}/{name}", "rb").read())
    for url in ("memory://indexed-test", f"{http_server.url}/indexed/shardflow.json"):
        ds = shardflow.IndexedShardDataset(url, max_open=2)
        assert len(ds) == N
        for i in np.random.default_rng(2).permutation(N)[:40]:
            got = ds[int(i)]
            assert same({k: v for k, v in got.items() if k != "__url__"}, {k: v for k, v in seq[i].items() if k != "__url__"})
            assert got["__url__"].startswith(url.rsplit("/shardflow.json", 1)[0])
        assert same(pickle.loads(pickle.dumps(ds))[N - 1] | {"__url__": ""}, ds[-1] | {"__url__": ""})


def write_mixed(folder) -> str:
    """12 samples: PNG or JPEG images (one field name each), a label; ``k04``'s JPEG cannot be
    decoded and ``k07`` has no label."""
    import io

    from PIL import Image

    def encoded(fmt: str, v: int) -> bytes:
        buf = io.BytesIO()
        Image.new("RGB", (4, 3), (v, 2 * v, 3 * v)).save(buf, format=fmt)
        return buf.getvalue()

    with ShardWriter(f"{folder}/m-%06d.tar", max_count=5) as w:
        for i in range(12):
            s: dict = {"__key__": f"k{i:02d}", "cls": i}
            if i == 4:
                s["jpg"] = b"not a jpeg"
            elif i % 3 == 0:
                s["png"] = encoded("PNG", i)
            else:
                s["jpg"] = encoded("JPEG", i)
            if i == 7:
                del s["cls"]
            w.write(s)
    return str(folder)


def test_fields_and_skip_match_the_streaming_dataset(tmp_path):
    folder = write_mixed(tmp_path)
    fields = ("image", "cls")
    stream = shardflow.ShardDataset(folder, fields=fields, on_error="skip")
    streamed = {s["__key__"]: s for s in stream}
    ix = shardflow.IndexedShardDataset(folder, fields=fields, on_error="skip")
    got = [ix[i] for i in range(len(ix))]
    assert len(ix) == 12 and sorted(streamed) == [f"k{i:02d}" for i in range(12) if i not in (4, 7)]
    # a bad sample's index returns the next one that reads; every other index its own sample
    assert [s["__key__"] for s in got] == [f"k{i:02d}" for i in (0, 1, 2, 3, 5, 5, 6, 8, 8, 9, 10, 11)]
    for s in got:
        assert s.keys() == {"__key__", "__url__", "__source__", "image", "cls"}
        assert same(s, streamed[s["__key__"]])
    assert got[3]["image"].shape == (3, 4, 3) and got[3]["cls"] == 3  # "image" took the PNG of k03
    assert {k: v for k, v in ix.stats.items() if k != "samples"} == {k: v for k, v in stream.stats.items() if k != "samples"}
    assert (ix.stats["skipped"], ix.stats["missing_field"], ix.stats["decode"], ix.stats["samples"]) == (2, 1, 1, 12)


def test_fields_and_raise_match_the_streaming_dataset(tmp_path):
    from shardflow.errors import DecodeError, MissingFieldError

    folder = write_mixed(tmp_path)
    ix = shardflow.IndexedShardDataset(folder, fields=("cls",), decode=None)
    assert ix[3] == {"__key__": "k03", "__url__": ix.urls[0], "__source__": 0, "cls": b"3"}
    with pytest.raises(MissingFieldError) as indexed:
        ix[7]
    with pytest.raises(MissingFieldError) as streamed:
        list(shardflow.ShardDataset(folder, fields=("cls",), decode=None))
    assert str(indexed.value) == str(streamed.value) and "'k07'" in str(indexed.value)
    with pytest.raises(DecodeError, match="'k04'"):
        shardflow.IndexedShardDataset(folder)[4]
    # a field no shard has, and a str for fields, are refused at construction as ShardDataset refuses them
    with pytest.raises(MissingFieldError, match="'txt'"):
        shardflow.IndexedShardDataset(folder, fields=("txt",))
    with pytest.raises(TypeError, match="sequence"):
        shardflow.IndexedShardDataset(folder, fields="cls")
    with pytest.raises(ValueError, match="on_error"):
        shardflow.IndexedShardDataset(folder, on_error="ignore")


def test_warn_logs_the_bad_sample_and_a_loader_batches_every_index(tmp_path, caplog):
    folder = write_mixed(tmp_path)
    ix = shardflow.IndexedShardDataset(folder, fields=("image", "cls"), on_error="warn")
    with caplog.at_level("WARNING", logger="shardflow.policy"):
        assert ix[-8]["__key__"] == "k05"  # k04 cannot be decoded
    assert any("'k04'" in r.getMessage() for r in caplog.records)
    # torch's default collate takes every index: no None reaches it
    batches = list(DataLoader(ix, batch_size=6))
    assert [b["cls"].tolist() for b in batches] == [[0, 1, 2, 3, 5, 5], [6, 8, 8, 9, 10, 11]]
