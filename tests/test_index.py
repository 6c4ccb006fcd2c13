"""`shardflow index`: manifests for foreign shards give them exact splits and seeking."""

import gzip
import json

import numpy as np
import pytest
import webdataset as wds

import shardflow
from shardflow.cli import main
from shardflow.errors import SampleError
from shardflow.format.tar import END_OF_ARCHIVE, encode_member


def wds_shards(folder, n=20, per=7):
    with wds.ShardWriter(str(folder / "w-%06d.tar"), maxcount=per, verbose=0) as w:
        for i in range(n):
            w.write({"__key__": f"{i:04d}", "cls": i, "txt": f"sample {i}"})
    return sorted(str(p) for p in folder.glob("w-*.tar"))


def test_index_webdataset_shards_gives_exact_splits(tmp_path, capsys):
    urls = wds_shards(tmp_path)
    assert main(["index", str(tmp_path / "w-{000000..000002}.tar")]) == 0
    assert "indexed 3 shards, 20 samples" in capsys.readouterr().out
    m = json.loads((tmp_path / "shardflow.json").read_text())
    assert [s["samples"] for s in m["shards"]] == [7, 7, 6]
    assert m["fields"] == {"cls": "cls", "txt": "txt"}
    offsets = np.load(tmp_path / "w-000001.tar.idx.npy")
    assert offsets.shape == (8,) and offsets[0] == 0
    # rank 1 of 2 starts inside shard 1 (sample 10) by seeking with the offset index
    got = [[s["cls"] for s in shardflow.ShardDataset(str(tmp_path), rank=r, world_size=2)] for r in (0, 1)]
    assert got == [list(range(10)), list(range(10, 20))]
    # every offset points at the sample it claims
    for url in urls:
        offs = np.load(url + ".idx.npy")
        data = open(url, "rb").read()
        for i in range(len(offs) - 1):
            from shardflow.format.tar import iter_samples

            (k, _, _), = list(iter_samples([data[offs[i] : offs[i + 1]]], url, int(offs[i]), end=int(offs[i + 1])))
            assert k.isdigit()


def test_index_gzip_shard_has_no_offsets(tmp_path):
    raw = b"".join(encode_member(f"{i:03d}.txt", b"x" * i) for i in range(5)) + END_OF_ARCHIVE
    (tmp_path / "g.tar.gz").write_bytes(gzip.compress(raw))
    from shardflow.writing.indexing import index_shards

    m = index_shards([str(tmp_path / "g.tar.gz")])
    assert m.shards[0].samples == 5 and m.shards[0].index is None
    assert m.shards[0].compression == "gzip" and m.shards[0].frames is None
    assert [s["__key__"] for s in shardflow.ShardDataset(str(tmp_path), decode=None)] == ["000", "001", "002", "003", "004"]


def _tar(n):
    return b"".join(encode_member(f"{i:03d}.bin", bytes([i]) * (1000 + 37 * i)) for i in range(n)) + END_OF_ARCHIVE


def test_index_of_framed_zstd_shards_gives_back_their_frame_tables(tmp_path):
    """Framed shards moved without their manifest: indexed, they seek again, with the writer's own tables."""
    from shardflow.writing.indexing import index_shards

    with shardflow.ShardWriter(str(tmp_path / "w" / "z-%06d.tar"), max_count=300, compression="zstd") as w:
        for i in range(700):
            w.write({"__key__": f"{i:04d}", "bin": np.random.default_rng(i).bytes(1500)})
    (tmp_path / "i").mkdir()
    for p in sorted((tmp_path / "w").glob("*.tar.zst")):
        (tmp_path / "i" / p.name).write_bytes(p.read_bytes())
    m = index_shards(sorted(str(p) for p in (tmp_path / "i").glob("*.tar.zst")))
    for s in m.shards:
        assert (s.compression, s.frames) == ("zstd", s.url + ".frames.npy")
        for suffix in (".idx.npy", ".frames.npy"):
            assert (tmp_path / "i" / (s.url + suffix)).read_bytes() == (tmp_path / "w" / (s.url + suffix)).read_bytes()
    ds = shardflow.IndexedShardDataset(str(tmp_path / "i"), decode=None)
    assert [ds[i]["bin"] for i in (650, 3, 301)] == [np.random.default_rng(i).bytes(1500) for i in (650, 3, 301)]


def test_index_of_other_zstd_shards(tmp_path):
    """One frame with its size (``zstd file.tar``): a one-frame table. A streamed frame (no size in its
    header): no offset index, it streams whole. Both record the compression."""
    import zstandard

    from shardflow.writing.indexing import index_shards

    raw = _tar(40)
    (tmp_path / "one.tar.zst").write_bytes(zstandard.ZstdCompressor().compress(raw))
    (tmp_path / "streamed.tar.zst").write_bytes(zstandard.ZstdCompressor(write_content_size=False).compress(raw))
    m = index_shards([str(tmp_path / "one.tar.zst"), str(tmp_path / "streamed.tar.zst")])
    one, streamed = m.shards
    assert (one.compression, one.frames, one.index) == ("zstd", "one.tar.zst.frames.npy", "one.tar.zst.idx.npy")
    assert np.load(tmp_path / one.frames).tolist() == [[0, 0], [len(raw), (tmp_path / "one.tar.zst").stat().st_size]]
    assert (streamed.compression, streamed.frames, streamed.index) == ("zstd", None, None)
    ds = shardflow.IndexedShardDataset(str(tmp_path / "one.tar.zst"), decode=None)
    assert ds[17]["bin"] == bytes([17]) * (1000 + 37 * 17)
    got = [s["__key__"] for s in shardflow.ShardDataset(str(tmp_path), decode=None)]
    assert got == [f"{i:03d}" for i in range(40)] * 2


def test_index_refuses_non_adjacent_shards(tmp_path):
    (tmp_path / "bad.tar").write_bytes(
        b"".join(encode_member(n, b"1") for n in ["000000.a", "000001.a", "000000.b"]) + END_OF_ARCHIVE
    )
    with pytest.raises(SampleError, match="000000"):
        from shardflow.writing.indexing import index_shards

        index_shards([str(tmp_path / "bad.tar")])
    assert not (tmp_path / "shardflow.json").exists()


def test_index_refuses_to_drop_shards_from_an_existing_manifest(tmp_path, capsys):
    """Indexing one shard of a converted folder would replace its manifest by a
    one-shard one, losing the others' counts and class_to_idx: refused, unless --force."""
    with shardflow.ShardWriter(str(tmp_path / "t-%06d.tar"), max_count=4, meta={"class_to_idx": {"a": 0}}) as w:
        for i in range(10):
            w.write({"__key__": f"{i:06d}", "cls": i})
    before = (tmp_path / "shardflow.json").read_text()
    assert main(["index", str(tmp_path / "t-000000.tar")]) == 1
    err = capsys.readouterr().err
    assert "shardflow.json lists 3 shards, 2 of which this run does not index (e.g. t-000001.tar)" in err
    assert "class_to_idx" in err and "--force" in err
    assert (tmp_path / "shardflow.json").read_text() == before  # untouched
    # all the shards: re-indexed in place; --force: replaced as asked
    assert main(["index", str(tmp_path)]) == 0
    assert len(shardflow.ShardDataset(str(tmp_path))) == 10
    assert main(["index", str(tmp_path / "t-000000.tar"), "--force"]) == 0
    assert len(shardflow.ShardDataset(str(tmp_path))) == 4


@pytest.mark.timeout(60)
def test_cli_index_of_a_bucket_folder_with_storage_options(moto_server, s3_prefix, capsys):
    # the README's "shardflow index writes one for shards from anywhere": a folder in a bucket, reached
    # through --storage-option like every other command
    opts = moto_server.storage_options
    fs = moto_server.fs()
    for i, n in enumerate([3, 2]):
        body = b"".join(encode_member(f"{i}{k:05d}.txt", f"s{i}-{k}".encode()) for k in range(n)) + END_OF_ARCHIVE
        fs.pipe(f"{s3_prefix}part-{i:06d}.tar", body)
    fs.pipe(f"{s3_prefix}notes.txt", b"not a shard")
    folder = s3_prefix.rstrip("/")
    assert main(["index", folder, "--storage-option", json.dumps(opts)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("indexed 2 shards, 5 samples, 7.0 KiB in ") and out.endswith(f"-> {s3_prefix}shardflow.json\n")
    manifest = json.loads(fs.cat(f"{s3_prefix}shardflow.json"))
    assert [(s["url"], s["samples"]) for s in manifest["shards"]] == [("part-000000.tar", 3), ("part-000001.tar", 2)]
    ds = shardflow.ShardDataset(folder, decode=None, storage_options=opts)
    assert len(ds) == 5
    assert [bytes(s["txt"]) for s in ds] == [b"s0-0", b"s0-1", b"s0-2", b"s1-0", b"s1-1"]
    # a pattern through the same options; an empty folder is named
    assert main(["index", f"{s3_prefix}part-{{000000..000001}}.tar", "--out", f"{s3_prefix}again",
                 "--storage-option", json.dumps(opts)]) == 0
    assert json.loads(fs.cat(f"{s3_prefix}again/shardflow.json"))["shards"][1]["samples"] == 2
    fs.pipe(f"{s3_prefix}empty/readme.txt", b"x")
    capsys.readouterr()
    assert main(["index", f"{s3_prefix}empty", "--storage-option", json.dumps(opts)]) == 1
    assert f"{s3_prefix}empty: no .tar shards in this folder" in capsys.readouterr().err


@pytest.mark.parametrize(
    "arr",
    [
        np.arange(1001, dtype=np.int64) * 512,  # what shardflow writes: the plain header
        np.zeros(1, dtype=np.int64),
        np.arange(4, dtype=np.uint32) * 512,
        np.arange(4, dtype=">i8") * 512,  # other headers: numpy's own parser
        np.asfortranarray(np.arange(6, dtype=np.int64).reshape(3, 2)),
        np.arange(6, dtype=np.int64).reshape(3, 2),
    ],
)
def test_index_files_parse_to_the_arrays_numpy_wrote(arr):
    import io

    from shardflow.format.manifest import decode_offsets, decode_sizes

    buf = io.BytesIO()
    np.save(buf, arr)
    if arr.ndim == 1:
        got = decode_offsets(buf.getvalue(), "idx", len(arr) - 1)
    else:
        got = decode_sizes(buf.getvalue(), "sizes", arr.shape[0], arr.shape[1])
    assert got.dtype == np.int64 and got.flags.writeable
    assert got.tolist() == arr.tolist()


def test_plain_index_header_that_lies_about_its_length_is_refused():
    import io

    from shardflow.errors import ManifestError
    from shardflow.format.manifest import decode_offsets

    buf = io.BytesIO()
    np.save(buf, np.arange(5, dtype=np.int64) * 512)
    data = buf.getvalue()
    with pytest.raises(ManifestError, match="holds 32 bytes of data"):
        decode_offsets(data[:-8], "idx", 4)  # one entry cut off
    lying = data.replace(b"(5,)", b"(6,)")
    with pytest.raises(ManifestError, match="holds 40 bytes of data, but its header declares 48"):
        decode_offsets(lying, "idx", 5)
