"""Shards interoperate with webdataset and plain `tar`, both ways, with identical keys and bytes."""

import os
import subprocess

import numpy as np
import webdataset as wds

import shardflow

SAMPLES = [
    {"__key__": f"cls{i % 3}/{i:06d}", "jpg": os.urandom(100 + i), "cls": str(i % 3).encode(), "meta.json": b'{"i": %d}' % i}
    for i in range(25)
]


def raw(sample):
    return {k: v for k, v in sample.items() if k not in ("__url__", "__source__", "__local_path__")}


def test_webdataset_reads_shardflow_shards(tmp_path):
    with shardflow.ShardWriter(str(tmp_path / "s-%06d.tar"), max_count=10) as w:
        for s in SAMPLES:
            w.write(s)
    urls = sorted(str(p) for p in tmp_path.glob("*.tar"))
    assert len(urls) == 3
    got = [raw(s) for s in wds.WebDataset(urls, shardshuffle=False)]
    assert got == SAMPLES


def test_shardflow_reads_webdataset_shards(tmp_path):
    with wds.ShardWriter(str(tmp_path / "w-%06d.tar"), maxcount=10, verbose=0) as w:
        for s in SAMPLES:
            w.write(s)
    urls = sorted(str(p) for p in tmp_path.glob("*.tar"))
    ds = shardflow.ShardDataset(urls, decode=None)
    got = [raw(s) for s in ds]
    assert got == SAMPLES
    # a folder of foreign shards (no manifest) streams too
    assert [raw(s) for s in shardflow.ShardDataset(str(tmp_path), decode=None)] == SAMPLES


def test_shardflow_reads_tar_of_a_sorted_folder(tmp_path):
    src = tmp_path / "src"
    for s in SAMPLES[:6]:
        for field in ("cls", "jpg"):
            p = src / f"{s['__key__']}.{field}"
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(s[field])
    shard = tmp_path / "plain.tar"
    subprocess.run(["tar", "--sort=name", "-cf", str(shard), "-C", str(src), "."], check=True)
    got = [raw(s) for s in shardflow.ShardDataset([str(shard)], decode=None)]
    want = sorted(
        ({"__key__": "./" + s["__key__"], "cls": s["cls"], "jpg": s["jpg"]} for s in SAMPLES[:6]), key=lambda s: s["__key__"]
    )
    assert got == want


def test_decoded_values_match_webdataset_decoding(tmp_path):
    from PIL import Image
    import io

    rng = np.random.default_rng(0)
    imgs = [rng.integers(0, 255, (16, 20, 3), dtype=np.uint8) for _ in range(4)]
    with shardflow.ShardWriter(str(tmp_path / "i-%06d.tar")) as w:
        for i, a in enumerate(imgs):
            buf = io.BytesIO()
            Image.fromarray(a).save(buf, format="PNG")
            w.write({"__key__": f"{i:04d}", "png": buf.getvalue(), "cls": i})
    ours = list(shardflow.ShardDataset(str(tmp_path), decode="numpy"))
    theirs = list(wds.WebDataset(str(tmp_path / "i-000000.tar"), shardshuffle=False).decode("rgb8"))
    for a, b, src in zip(ours, theirs, imgs):
        assert a["__key__"] == b["__key__"]
        np.testing.assert_array_equal(a["png"], b["png"])
        np.testing.assert_array_equal(a["png"], src)
        assert a["cls"] == b["cls"]
