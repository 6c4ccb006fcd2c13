"""ShardDataset over real shards: sources (C10), bad input (C06, C07, C09), decoding and transforms."""

import json
import os

import numpy as np
import pytest

import shardflow
from shardflow.errors import MissingFieldError, SampleError, ShardflowError, TruncatedShardError
from shardflow.format.tar import END_OF_ARCHIVE, encode_member, encode_sample
from shardflow.urls import expand_urls

pytestmark = pytest.mark.usefixtures("fast_paths")  # the reader tests run with the fast paths on and off


def write(tmp_path, n=10, per=4, **fields):
    with shardflow.ShardWriter(str(tmp_path / "d-%06d.tar"), max_count=per) as w:
        for i in range(n):
            w.write({"__key__": f"{i:06d}", "cls": i, **{k: v(i) for k, v in fields.items()}})
    return str(tmp_path)


# ---------------------------------------------------------------- C10


def test_c10_brace_patterns():
    urls = expand_urls("train-{000000..000009}.tar")
    assert urls == [f"train-{i:06d}.tar" for i in range(10)]
    assert expand_urls("{a,b}-{0..1}.tar") == ["a-0.tar", "a-1.tar", "b-0.tar", "b-1.tar"]
    assert expand_urls("x-{0..1}.tar::y-{a,b}.tar") == ["x-0.tar", "x-1.tar", "y-a.tar", "y-b.tar"]


def test_c10_glob_on_fsspec_memory_and_zero_matches():
    import fsspec

    fs = fsspec.filesystem("memory")
    for name in ["c.tar", "a.tar", "b.tar", "notes.txt"]:
        fs.pipe(f"/c10/{name}", encode_sample("k", {"txt": b"x"}) + END_OF_ARCHIVE)
    assert expand_urls("memory://c10/*.tar") == ["memory:///c10/a.tar", "memory:///c10/b.tar", "memory:///c10/c.tar"]
    with pytest.raises(FileNotFoundError, match="no shards match"):
        expand_urls("memory://c10/*.tgz")
    ds = shardflow.ShardDataset("memory://c10/*.tar", decode=None)
    assert [s["__url__"] for s in ds] == ["memory:///c10/a.tar", "memory:///c10/b.tar", "memory:///c10/c.tar"]


def test_c10_list_passes_through_and_star_never_opened(tmp_path):
    d = write(tmp_path, n=8)
    urls = [os.path.join(d, "d-000001.tar"), os.path.join(d, "d-000000.tar")]
    assert shardflow.ShardDataset(urls).urls == urls
    assert [s["cls"] for s in shardflow.ShardDataset(urls)] == [4, 5, 6, 7, 0, 1, 2, 3]
    with pytest.raises(FileNotFoundError, match="no shards match"):
        shardflow.ShardDataset(os.path.join(d, "*.nothing"))
    # a pattern of this folder picks up the manifest beside it (counts known)
    assert len(shardflow.ShardDataset(os.path.join(d, "d-{000000..000001}.tar"))) == 8


# ---------------------------------------------------------------- C06


def test_c06_non_adjacent_members(tmp_path):
    shard = tmp_path / "c06.tar"
    shard.write_bytes(b"".join(encode_member(n, b"1") for n in ["000000.a", "000001.a", "000000.b", "000001.b"]) + END_OF_ARCHIVE)
    with pytest.raises(SampleError, match=r"c06\.tar: key '000000' reappears"):
        list(shardflow.ShardDataset([str(shard)], decode=None))


# ---------------------------------------------------------------- C07


def c07_shard(path, cut=True):
    data = b"".join(encode_sample(f"{i:06d}", {"cls": b"1", "jpg": b"\xff" * 3000}) for i in range(10)) + END_OF_ARCHIVE
    per = len(encode_sample("000000", {"cls": b"1", "jpg": b"\xff" * 3000}))
    path.write_bytes(data[: 6 * per + 1024 + 1500] if cut else data)
    return str(path)


def test_c07_truncated_shard_raise_and_skip(tmp_path):
    url = c07_shard(tmp_path / "cut.tar")
    with pytest.raises(TruncatedShardError, match="cut.tar"):
        list(shardflow.ShardDataset([url], decode=None))
    ds = shardflow.ShardDataset([url], decode=None, on_error="skip")
    assert [s["__key__"] for s in ds] == [f"{i:06d}" for i in range(6)]
    assert ds.stats["truncated_shard"] == 1 and ds.stats["samples"] == 6


def test_c07_truncated_after_manifest_counts_lost_samples(tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    with shardflow.ShardWriter(str(d / "s-%06d.tar"), max_count=100) as w:
        for i in range(10):
            w.write({"__key__": f"{i:06d}", "cls": b"1", "jpg": b"\xff" * 3000})
    full = (d / "s-000000.tar").read_bytes()
    per = len(encode_sample("000000", {"cls": b"1", "jpg": b"\xff" * 3000}))
    (d / "s-000000.tar").write_bytes(full[: 6 * per + 1024 + 1500])
    ds = shardflow.ShardDataset(str(d), decode=None, on_error="skip")
    assert [s["__key__"] for s in ds] == [f"{i:06d}" for i in range(6)]
    assert ds.stats["truncated_shard"] == 1 and ds.stats["lost_samples"] == 4


def test_c07_zero_byte_and_empty_tar(tmp_path):
    zero = tmp_path / "zero.tar"
    zero.write_bytes(b"")
    empty = tmp_path / "empty.tar"
    empty.write_bytes(b"\0" * 1024)
    good = c07_shard(tmp_path / "good.tar", cut=False)
    with pytest.raises(TruncatedShardError, match="zero.tar: empty file"):
        list(shardflow.ShardDataset([str(zero)], decode=None))
    ds = shardflow.ShardDataset([str(zero), good], decode=None, on_error="skip")
    assert len(list(ds)) == 10 and ds.stats["truncated_shard"] == 1
    ds = shardflow.ShardDataset([str(empty), good], decode=None)
    assert len(list(ds)) == 10 and ds.stats["skipped"] == 0


# ---------------------------------------------------------------- C09


def c09_shard(tmp_path):
    shard = tmp_path / "c09.tar"
    members = [("s0", {"jpg": b"j", "cls": b"0"}), ("s1", {"jpg": b"j"}), ("s2", {"jpg": b"j", "cls": b"2", "json": b"{}"}), ("s3", {"cls": b"3"})]
    shard.write_bytes(b"".join(encode_sample(k, f) for k, f in members) + END_OF_ARCHIVE)
    return str(shard)


def test_c09_missing_field_raise_and_skip(tmp_path):
    url = c09_shard(tmp_path)
    with pytest.raises(MissingFieldError) as e:
        list(shardflow.ShardDataset([url], decode=None, fields=("jpg", "cls")))
    msg = str(e.value)
    assert "c09.tar" in msg and "'s1'" in msg and "'cls'" in msg and "['jpg']" in msg
    ds = shardflow.ShardDataset([url], decode=None, fields=("jpg", "cls"), on_error="skip")
    assert [s["__key__"] for s in ds] == ["s0", "s2"]
    assert ds.stats["skipped"] == 2 and ds.stats["missing_field"] == 2
    assert sorted(next(iter(ds))) == ["__key__", "__source__", "__url__", "cls", "jpg"]


def test_c09_field_no_sample_has_fails_fast(tmp_path):
    with shardflow.ShardWriter(str(tmp_path / "f-%06d.tar")) as w:
        for i in range(5):
            w.write({"__key__": f"{i:04d}", "input.jpg": b"x"})
    with pytest.raises(MissingFieldError, match=r"'jpg'.*\['input.jpg'\]"):
        shardflow.ShardDataset(str(tmp_path), fields=("jpg",))
    # without a manifest: skip mode still fails instead of yielding nothing forever
    os.remove(tmp_path / "shardflow.json")
    ds = shardflow.ShardDataset(str(tmp_path), fields=("jpg",), on_error="skip")
    with pytest.raises(ShardflowError, match="yielded no sample"):
        list(ds)


# ---------------------------------------------------------------- decoding & transforms


def test_decode_forms_and_fields(tmp_path):
    from PIL import Image
    import io

    img = np.arange(6 * 5 * 3, dtype=np.uint8).reshape(6, 5, 3)
    buf = io.BytesIO()
    Image.fromarray(img).save(buf, format="PNG")
    with shardflow.ShardWriter(str(tmp_path / "x-%06d.tar")) as w:
        w.write({"__key__": "a", "png": buf.getvalue(), "cls": 7, "txt": "héllo", "meta.json": {"k": [1, 2]}, "x.npy": np.eye(2, dtype=np.float16)})
    (s,) = shardflow.ShardDataset(str(tmp_path), decode="numpy")
    assert s["png"].shape == (6, 5, 3) and (s["png"] == img).all()
    assert s["cls"] == 7 and s["txt"] == "héllo" and s["meta.json"] == {"k": [1, 2]}
    assert s["x.npy"].dtype == np.float16 and (s["x.npy"] == np.eye(2)).all()
    (t,) = shardflow.ShardDataset(str(tmp_path), decode="torch")
    assert tuple(t["png"].shape) == (3, 6, 5) and (t["png"].permute(1, 2, 0).numpy() == img).all()
    (r,) = shardflow.ShardDataset(str(tmp_path), decode=None)
    assert r["png"] == buf.getvalue() and r["cls"] == b"7"


def test_transform_error_names_key_and_skip_counts(tmp_path):
    d = write(tmp_path, n=6)

    def boom(s):
        if s["cls"] == 3:
            raise RuntimeError("bad crop")
        return s

    with pytest.raises(SampleError, match=r"sample '000003': transform .*boom raised RuntimeError: bad crop"):
        list(shardflow.ShardDataset(d, transform=boom))
    ds = shardflow.ShardDataset(d, transform=boom, on_error="skip")
    assert [s["cls"] for s in ds] == [0, 1, 2, 4, 5]
    assert ds.stats["transform"] == 1 and ds.stats["skipped"] == 1


def test_a_per_field_transform_of_a_missing_field_is_named_as_the_user_wrote_it(tmp_path):
    """The error names the per-field transform the user passed, not the seeding wrapper
    around it (sample seeding is on by default)."""
    d = write(tmp_path, n=2)

    def crop(x):
        return x

    with pytest.raises(SampleError) as raised:
        list(shardflow.ShardDataset(d, transform={"img": crop}))
    message = str(raised.value)
    assert "sample '000000': transform FieldMap({'img': " in message and "crop" in message
    assert "no field 'img' to transform (fields present: ['cls'])" in message
    assert "Seeder" not in message and "<locals>.seeded" not in message


def test_undecodable_image_names_shard_and_key(tmp_path):
    with shardflow.ShardWriter(str(tmp_path / "b-%06d.tar")) as w:
        w.write({"__key__": "good", "jpg": b"\xff\xd8 not really", "cls": 1})
    with pytest.raises(SampleError, match=r"b-000000\.tar: sample 'good': cannot decode field 'jpg'"):
        list(shardflow.ShardDataset(str(tmp_path)))


def test_manifest_written_by_writer(tmp_path):
    d = write(tmp_path, n=10, per=4, **{"x.npy": lambda i: np.zeros(2)})
    m = json.loads(open(os.path.join(d, "shardflow.json")).read())
    assert m["format"] == "shardflow" and m["version"] == 1
    assert [s["samples"] for s in m["shards"]] == [4, 4, 2]
    assert m["fields"] == {"cls": "cls", "x.npy": "npy"}
    assert all(os.path.getsize(os.path.join(d, s["url"])) == s["bytes"] for s in m["shards"])
    assert len(shardflow.ShardDataset(d)) == 10


def test_writer_is_deterministic(tmp_path):
    a = write(tmp_path / "a", n=9)
    b = write(tmp_path / "b", n=9)
    for name in ["d-000000.tar", "d-000001.tar", "d-000002.tar", "shardflow.json"]:
        assert open(os.path.join(a, name), "rb").read() == open(os.path.join(b, name), "rb").read()


def test_writer_refuses_dotted_keys(tmp_path):
    with shardflow.ShardWriter(str(tmp_path / "k-%06d.tar")) as w:
        with pytest.raises(SampleError, match="contains a dot"):
            w.write({"__key__": "img.001", "cls": 1})


# ---------------------------------------------------------------- found in review


def gnu_tar(path, n=10):
    import io
    import tarfile

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as t:
        for i in range(n):
            for field, data in (("cls", b"1"), ("jpg", bytes([i]) * 3000)):
                info = tarfile.TarInfo(f"{i:06d}.{field}")
                info.size = len(data)
                t.addfile(info, io.BytesIO(data))
    path.write_bytes(buf.getvalue())
    return str(path)


def test_cut_on_a_member_boundary_is_truncation_not_a_partial_sample(tmp_path):
    url = gnu_tar(tmp_path / "s.tar")
    data = open(url, "rb").read()
    open(url, "wb").write(data[:10240])  # ends right after 000002.cls: no jpg, no end marker
    with pytest.raises(TruncatedShardError, match="without the tar end-of-archive marker"):
        list(shardflow.ShardDataset([url], decode=None))
    ds = shardflow.ShardDataset([url], decode=None, on_error="skip")
    assert [(s["__key__"], sorted(s)) for s in ds] == [(f"{i:06d}", ["__key__", "__source__", "__url__", "cls", "jpg"]) for i in range(2)]
    assert ds.stats["truncated_shard"] == 1


def test_shard_replaced_after_indexing_is_refused(tmp_path):
    from shardflow.errors import ManifestError

    d = write(tmp_path, n=8, per=4)
    bigger = gnu_tar(tmp_path / "other.tar", n=4)
    os.replace(bigger, os.path.join(d, "d-000001.tar"))
    with pytest.raises(ManifestError, match=r"d-000001\.tar: the shard has \d+ bytes but the manifest lists \d+"):
        list(shardflow.ShardDataset(d, decode=None))
    ds = shardflow.ShardDataset(d, decode=None, on_error="skip")
    assert [s["__key__"] for s in ds] == [f"{i:06d}" for i in range(4)]
    assert ds.stats["changed_shard"] == 1 and ds.stats["lost_samples"] == 4


@pytest.mark.parametrize("workers", [0, 2])
def test_skip_keeps_the_planned_number_of_batches(tmp_path, workers):
    with shardflow.ShardWriter(str(tmp_path / "t-%06d.tar"), max_count=4) as w:
        for i in range(8):
            w.write({"__key__": f"{i:06d}", "cls": i, **({"txt": "t"} if i not in (0, 1) else {})})
    counts = []
    for rank in range(2):
        ds = shardflow.ShardDataset(str(tmp_path), decode=None, rank=rank, world_size=2, fields=("cls", "txt"), on_error="skip")
        loader = shardflow.loader(ds, batch_size=2, num_workers=workers)
        batches = [b["__key__"] for b in loader]
        counts.append((len(loader), len(batches)))
        if rank == 0:  # batch 0 lost both samples: batch 1 is repeated in its place
            assert batches == [["000002", "000003"], ["000002", "000003"]]
            assert ds.stats["repeated_batches"] == 1 and ds.stats["missing_field"] == 2
    assert counts == [(2, 2), (2, 2)]


def test_a_bad_shard_read_by_two_workers_counts_once(tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    with shardflow.ShardWriter(str(d / "s-%06d.tar"), max_count=100) as w:
        for i in range(10):
            w.write({"__key__": f"{i:06d}", "cls": b"1", "jpg": b"\xff" * 3000})
    full = (d / "s-000000.tar").read_bytes()
    (d / "s-000000.tar").write_bytes(full[: len(full) // 2])
    ds = shardflow.ShardDataset(str(d), decode=None, on_error="skip")
    list(shardflow.loader(ds, batch_size=2, num_workers=2))
    assert ds.stats["truncated_shard"] == 1


def test_query_strings_are_not_globs_and_list_globs_are_refused(tmp_path):
    assert expand_urls("https://h/x-{0..1}.tar?token=a") == ["https://h/x-0.tar?token=a", "https://h/x-1.tar?token=a"]
    with pytest.raises(ValueError, match="never opened as a literal name"):
        shardflow.ShardDataset([str(tmp_path / "train-*.tar")])


def test_all_empty_shards_yield_nothing_without_error(tmp_path):
    from shardflow.writing.indexing import index_shards

    (tmp_path / "e.tar").write_bytes(b"\0" * 1024)
    index_shards([str(tmp_path / "e.tar")])
    ds = shardflow.ShardDataset(str(tmp_path))
    assert len(ds) == 0 and list(ds) == []
    assert len(shardflow.loader(ds, batch_size=2)) == 0 and list(shardflow.loader(ds, batch_size=2)) == []


def test_a_home_relative_source_is_expanded(tmp_path, monkeypatch):
    """``ShardDataset("~/shards")`` (the README's example) reads the folder in $HOME."""
    monkeypatch.setenv("HOME", str(tmp_path))
    with shardflow.ShardWriter(str(tmp_path / "shards" / "t-%06d.tar"), max_count=2) as w:
        for i in range(3):
            w.write({"__key__": f"{i:06d}", "cls": i})
    for source in ("~/shards", "~/shards/shardflow.json", ["~/shards/t-000000.tar", "~/shards/t-000001.tar"]):
        ds = shardflow.ShardDataset(source, decode=None)
        assert len(ds) == 3 and [s["__key__"] for s in ds] == ["000000", "000001", "000002"], source
        assert ds.urls[0] == str(tmp_path / "shards" / "t-000000.tar")


def test_a_misspelt_folder_is_refused_when_the_dataset_is_built(tmp_path):
    """A local path with nothing at it (and no pattern in it) is a FileNotFoundError that
    names it at once, not a one-shard dataset whose shard is missing at the first read."""
    d = write(tmp_path / "train", n=2)
    assert len(shardflow.ShardDataset(d)) == 2
    typo = str(tmp_path / "trian")
    with pytest.raises(FileNotFoundError, match=r"trian: no such folder or file \(a dataset is a folder of shards"):
        shardflow.ShardDataset(typo)
    with pytest.raises(FileNotFoundError, match="no such folder or file"):
        shardflow.ShardDataset(str(tmp_path / "train" / "nested" / "x"))
