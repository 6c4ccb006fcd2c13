"""Google Cloud Storage and Azure Blob for real: fake-gcs-server and Azurite on loopback.

The same checks run on both (``cloud`` is parametrized): ShardWriter writes shards to
``gs://`` / ``az://`` (a shard appears only when complete), ShardDataset reads them by
folder, glob and brace pattern and through DataLoader workers, a connection cut in the
middle of a shard's body costs no sample and repeats none, a run resumed mid-epoch
finishes the epoch exactly, the local cache serves a second epoch, and the imagefolder
converter writes straight into a bucket. Every test compares keys and bytes.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

import shardflow
from shardflow.format.manifest import MANIFEST_NAME
from shardflow.loading.shardloader import loader as make_loader
from shardflow.storage import IOOptions, ShardChangedError, iter_chunks
from tests.helpers import assert_resumes
from tests.servers import DroppingProxy
from tests.test_remote import got, in_order, write

pytestmark = pytest.mark.timeout(120)

FAST = IOOptions(backoff=0.0)


def jpeg_bytes(seed: int) -> bytes:
    from PIL import Image

    arr = np.random.default_rng(seed).integers(0, 256, (12, 10, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="JPEG", quality=95)
    return buf.getvalue()


@dataclass
class Cloud:
    """One emulated bucket for one test: a fresh prefix, options, a cutting proxy."""

    name: str
    prefix: str
    storage_options: dict[str, Any]
    proxy: DroppingProxy
    proxied_options: dict[str, Any]
    emulator: Any

    def fs(self):
        return self.emulator.fs()


@pytest.fixture(params=["gs", "az"])
def cloud(request: pytest.FixtureRequest) -> Cloud:
    if request.param == "gs":
        emulator = request.getfixturevalue("gcs_server")
        prefix = request.getfixturevalue("gcs_prefix")
        proxy = request.getfixturevalue("gcs_proxy")
    else:
        emulator = request.getfixturevalue("azurite")
        prefix = request.getfixturevalue("az_prefix")
        proxy = request.getfixturevalue("az_proxy")
    return Cloud(request.param, prefix, emulator.storage_options, proxy, emulator.through(proxy),
                 emulator)


def test_write_then_read_by_folder_glob_and_pattern(cloud):
    base = cloud.prefix + "ds"
    want = write(base + "/train-%06d.tar", 25, 10, storage_options=cloud.storage_options)
    fs = cloud.fs()
    names = sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(base, refresh=True))
    assert names == [MANIFEST_NAME] + [f"train-{i:06d}.tar{x}" for i in range(3) for x in ("", ".idx.npy")]
    urls = [f"{base}/train-{i:06d}.tar" for i in range(3)]
    for source in [base, base + "/", base + "/train-{000000..000002}.tar", base + "/train-*.tar", urls]:
        ds = shardflow.ShardDataset(source, decode=None, storage_options=cloud.storage_options)
        assert ds.sized and len(ds) == 25, source
        assert ds.urls == urls, source
        assert got(ds) == in_order(want), source
    ds = shardflow.ShardDataset(base, decode=None, shuffle=True, seed=3,
                                storage_options=cloud.storage_options)
    seen = []
    for batch in make_loader(ds, batch_size=4, num_workers=2, collate_fn=list, timeout=60):
        seen += got(batch)
    assert len(seen) == 25 and sorted(seen) == in_order(want)


def test_a_shard_appears_only_when_complete(cloud):
    base = cloud.prefix + "w"
    sink = shardflow.ShardWriter(base + "/train-%06d.tar", max_count=50,
                                 storage_options=cloud.storage_options)
    for i in range(70):
        sink.write({"__key__": f"{i:06d}", "txt": str(i)})
    sink.abort()  # a crash: shard 1 (20 samples so far) never appears
    names = sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in cloud.fs().ls(base, refresh=True))
    assert names == [MANIFEST_NAME, "train-000000.tar", "train-000000.tar.idx.npy"]
    ds = shardflow.ShardDataset(base, decode=None, storage_options=cloud.storage_options)
    assert len(ds) == 50 and [s["txt"] for s in ds] == [str(i).encode() for i in range(50)]


def test_a_connection_cut_mid_shard_loses_and_repeats_nothing(cloud):
    base = cloud.prefix + "cut"
    want = write(base + "/train-%06d.tar", 60, 30, size=20_000, storage_options=cloud.storage_options)
    io = IOOptions(storage_options=cloud.proxied_options, block_size=1 << 16, backoff=0.0, readahead=0)
    ds = shardflow.ShardDataset(base, decode=None, io=io)
    assert len(ds) == 60  # the manifest was read through the proxy, before the cut is armed
    cloud.proxy.drop_after(300_000)  # in the middle of the first shard's body (~630 kB)
    assert got(ds) == in_order(want)
    assert cloud.proxy.drops == 1
    assert ds.stats["skipped"] == 0


def test_resume_mid_epoch_through_workers(cloud):
    base = cloud.prefix + "resume"
    write(base + "/train-%06d.tar", 40, 10, storage_options=cloud.storage_options)

    def make():
        ds = shardflow.ShardDataset(base, decode=None, shuffle=True, seed=5,
                                    storage_options=cloud.storage_options)
        return make_loader(ds, batch_size=4, num_workers=2, timeout=60)

    epoch, _next = assert_resumes(make, k=3, check_next_epoch=False)
    assert len(epoch) == 10


def test_cache_serves_the_second_epoch(cloud, tmp_path):
    base = cloud.prefix + "cache"
    want = write(base + "/train-%06d.tar", 30, 10, size=5000, storage_options=cloud.storage_options)
    shard_bytes = sum(cloud.fs().size(f"{base}/train-{i:06d}.tar") for i in range(3))
    cache = tmp_path / "cache"
    io = IOOptions(storage_options=cloud.proxied_options, cache_dir=str(cache))
    assert got(shardflow.ShardDataset(base, decode=None, io=io)) == in_order(want)
    first = cloud.proxy.sent
    assert first > shard_bytes  # the shards came through the proxy once
    cached = sorted(p.name.split("-", 1)[1] for p in cache.iterdir() if not p.name.startswith("."))
    assert [n for n in cached if n.endswith(".tar")] == [f"train-{i:06d}.tar" for i in range(3)]
    # the second epoch reads the shards from local disk: only the manifest and the
    # objects' metadata (to see that they did not change) cross the network
    assert got(shardflow.ShardDataset(base, decode=None, io=io)) == in_order(want)
    assert cloud.proxy.sent - first < shard_bytes // 3


def test_imagefolder_converter_writes_to_the_bucket(cloud, tmp_path):
    imagefolder = pytest.importorskip("shardflow.convert.images.imagefolder")
    from shardflow.convert.engine.engine import ConvertOptions
    src = tmp_path / "tree"
    files = {}
    for c, cls in enumerate(["cat", "dog"]):
        (src / cls).mkdir(parents=True)
        for j in range(3):
            files[(c, j)] = data = jpeg_bytes(10 * c + j)
            (src / cls / f"{j:04d}.jpg").write_bytes(data)
    dst = cloud.prefix + "converted"
    imagefolder.convert_imagefolder(
        str(src), dst, options=ConvertOptions(max_count=4, workers=2,
                                              storage_options=cloud.storage_options))
    samples = list(shardflow.ShardDataset(dst, decode=None, storage_options=cloud.storage_options))
    assert sorted((int(s["cls"]), s["jpg"]) for s in samples) == sorted(
        (c, data) for (c, _j), data in files.items())


# --------------------------------------------------------------------------- the streaming readers

BIG = np.random.default_rng(7).integers(0, 256, 1 << 20, dtype=np.uint8).tobytes()
# GCS has a streaming reader of ours; Azure Blob goes through adlfs's file object
READERS = {"gs": "GCSReader", "az": "FileReader"}


def test_a_shard_is_read_by_the_cloud_s_streaming_reader(cloud):
    from shardflow.storage import readers
    from shardflow.storage.backends.filesystems import filesystem

    url = cloud.prefix + "x.tar"
    cloud.fs().pipe(url, BIG)
    io = IOOptions(storage_options=cloud.storage_options)
    fs, path = filesystem(url, io)
    reader = readers.open_reader(fs, path, url, 1000, None, io)
    try:
        assert type(reader).__name__ == "Metered"  # counting its request and bytes (shardflow.accounting)
        assert type(reader.reader).__name__ == READERS[cloud.name]
        assert reader.size == len(BIG) and {"generation", "etag"} & set(reader.identity)
        got = b""
        while chunk := reader.read(300_000):
            got += chunk
        assert got == BIG[1000:]
    finally:
        reader.close()
    # a range that ends before the object does, and one starting at its end
    assert b"".join(iter_chunks(url, 5, 70_000, options=io)) == BIG[5:70_000]
    assert b"".join(iter_chunks(url, len(BIG), options=io)) == b""


def test_a_dropped_stream_reopens_at_the_offset(cloud):
    cloud.fs().pipe(cloud.prefix + "x.tar", BIG)
    io = IOOptions(storage_options=cloud.proxied_options, block_size=1 << 16, backoff=0.001)
    cloud.proxy.drop_after(len(BIG) // 3)
    assert b"".join(iter_chunks(cloud.prefix + "x.tar", options=io)) == BIG
    assert cloud.proxy.drops == 1


def test_gcs_object_changed_before_a_reopen_is_refused(gcs_server, gcs_prefix, gcs_proxy):
    """The reopen after a drop asks for the generation first seen: a replaced object is
    refused, so two versions are never spliced."""
    url = gcs_prefix + "x.tar"
    fs = gcs_server.fs()
    fs.pipe(url, BIG)
    io = IOOptions(storage_options=gcs_server.through(gcs_proxy), block_size=1 << 16, backoff=0.001)
    gcs_proxy.drop_after(len(BIG) // 2, hold=True)  # the one GET stalls half-way...
    chunks = iter_chunks(url, options=io)
    got = [next(chunks)]
    fs.pipe(url, bytes(len(BIG)))  # ...the object is replaced (a new generation)...
    gcs_proxy.release()  # ...and then the connection drops
    with pytest.raises(ShardChangedError, match=r"x\.tar changed while being read, at byte \d+ \(generation \d+ is gone\)"):
        for chunk in chunks:
            got.append(chunk)
    data = b"".join(got)
    assert gcs_proxy.drops == 1
    assert 1 << 16 <= len(data) < len(BIG) and data == BIG[: len(data)]  # old bytes only
