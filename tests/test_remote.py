"""Training straight from buckets: ShardDataset, loader, writer and converter over
fsspec URLs (moto S3, a loopback HTTP server, memory://), read-ahead of the next
shard, dropped connections, changed objects, exhausted retries, compressed shards.

Every test compares keys and bytes with the samples as written, and counts exactly.
"""

from __future__ import annotations

import gzip
import io
import multiprocessing
import os
import re
import uuid

import fsspec
import numpy as np
import pytest

import shardflow
from shardflow.errors import RemoteReadError, ShardFormatError
from shardflow.format.manifest import MANIFEST_NAME
from shardflow.storage import IOOptions, ShardChangedError
from tests.servers import wait_until

FAST = IOOptions(backoff=0.0)


def payload(i: int, size: int = 1500) -> bytes:
    """Sample ``i``'s ``bin`` field: distinct bytes of a length that varies with ``i``."""
    return np.random.default_rng(i).integers(0, 256, size + (i * 37) % 500, dtype=np.uint8).tobytes()


def write(pattern: str, n: int, per: int, *, start: int = 0, size: int = 1500, **kwargs) -> dict[str, bytes]:
    """Write samples ``start .. start+n-1`` (``bin`` + ``cls``); returns key -> bin."""
    want = {}
    with shardflow.ShardWriter(pattern, max_count=per, **kwargs) as sink:
        for i in range(start, start + n):
            key = f"{i:06d}"
            want[key] = payload(i, size)
            sink.write({"__key__": key, "bin": want[key], "cls": i})
    return want


def got(items) -> list[tuple[str, bytes]]:
    return [(s["__key__"], s["bin"]) for s in items]


def in_order(want: dict[str, bytes]) -> list[tuple[str, bytes]]:
    return sorted(want.items())


def serve_folder(srv, folder, sub: str = "") -> None:
    for name in sorted(os.listdir(folder)):
        with open(os.path.join(folder, name), "rb") as f:
            srv.put(f"{sub}{name}", f.read())


# --------------------------------------------------------------------------- S3 (moto)


def test_s3_sources_and_storage_options(moto_server, s3_prefix, s3_options):
    base = s3_prefix + "ds"
    want = write(base + "/train-%06d.tar", 25, 10, storage_options=s3_options)
    fs = moto_server.fs()
    names = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(base, refresh=True))
    assert names == [MANIFEST_NAME] + [f"train-{i:06d}.tar{x}" for i in range(3) for x in ("", ".idx.npy")]
    urls = [f"{base}/train-{i:06d}.tar" for i in range(3)]
    sources = [base, base + "/", base + "/" + MANIFEST_NAME, base + "/train-{000000..000002}.tar", base + "/train-*.tar", urls]
    for source in sources:
        ds = shardflow.ShardDataset(source, decode=None, storage_options=s3_options)
        assert ds.sized and len(ds) == 25, source
        assert ds.urls == urls, source
        assert got(ds) == in_order(want), source
    # shuffled, through 2 DataLoader workers: every sample once, bytes intact
    ds = shardflow.ShardDataset(base, decode=None, shuffle=True, seed=3, storage_options=s3_options)
    seen = []
    for batch in shardflow.loader(ds, batch_size=4, num_workers=2, collate_fn=list):
        seen += got(batch)
    assert len(seen) == 25 and sorted(seen) == in_order(want)
    assert ds.stats["samples"] == 25 and ds.stats["skipped"] == 0


def test_s3_options_by_protocol_and_io(moto_server, s3_prefix, s3_options, monkeypatch):
    base = s3_prefix + "ds"
    want = write(base + "/train-%06d.tar", 6, 4, storage_options=s3_options)
    # only the options reach the server now (no endpoint in the environment): the folder
    # check, the manifest, the offset indexes and the shards all use them
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    ds = shardflow.ShardDataset(base, decode=None, io=IOOptions(storage_options={"s3": s3_options}))
    assert ds.sized and len(ds) == 6
    assert got(ds) == in_order(want)
    with pytest.raises(ValueError, match="not both"):
        shardflow.ShardDataset(base, io=IOOptions(), storage_options=s3_options)


def test_s3_writer_shard_appears_only_when_complete(moto_server, s3_prefix, s3_options):
    fs = moto_server.fs()
    base = s3_prefix + "w"
    shard = lambda i: f"{base}/train-{i:06d}.tar"  # noqa: E731
    sink = shardflow.ShardWriter(base + "/train-%06d.tar", max_count=500, storage_options=s3_options)
    for i in range(499):
        sink.write({"__key__": f"{i:06d}", "x.npy": np.full(3, i), "y.txt": str(i)})
    fs.invalidate_cache()
    assert not fs.exists(shard(0)) and not fs.exists(base + "/" + MANIFEST_NAME)
    for i in range(499, 700):
        sink.write({"__key__": f"{i:06d}", "x.npy": np.full(3, i), "y.txt": str(i)})
    fs.invalidate_cache()
    assert fs.exists(shard(0)) and not fs.exists(shard(1))  # shard 1 holds 200 so far
    sink.abort()  # the crash of C08: shard 1 never appears, the manifest lists shard 0 only
    names = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(base, refresh=True))
    assert names == [MANIFEST_NAME, "train-000000.tar", "train-000000.tar.idx.npy"]  # no temporary left
    ds = shardflow.ShardDataset(base, decode="numpy", storage_options=s3_options)
    samples = list(ds)
    assert len(ds) == 500 and [s["__key__"] for s in samples] == [f"{i:06d}" for i in range(500)]
    assert all(s["y.txt"] == str(i) and s["x.npy"].tolist() == [i] * 3 for i, s in enumerate(samples))


def _jpeg(seed: int) -> bytes:
    from PIL import Image

    arr = np.random.default_rng(seed).integers(0, 256, (12, 10, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="JPEG", quality=95)
    return buf.getvalue()


def test_imagefolder_converter_writes_to_s3(moto_server, s3_prefix, s3_options, tmp_path):
    imagefolder = pytest.importorskip("shardflow.convert.images.imagefolder")
    from shardflow.convert.engine.engine import ConvertOptions

    src = tmp_path / "tree"
    files = {}
    for c, cls in enumerate(["cat", "dog"]):
        (src / cls).mkdir(parents=True)
        for j in range(3):
            data = _jpeg(10 * c + j)
            (src / cls / f"{j:04d}.jpg").write_bytes(data)
            files[(cls, j)] = data
    dst = s3_prefix + "converted"
    manifest = imagefolder.convert_imagefolder(
        str(src), dst, options=ConvertOptions(max_count=4, workers=2, storage_options=s3_options)
    )
    assert manifest.meta["class_to_idx"] == {"cat": 0, "dog": 1}
    assert [s.samples for s in manifest.shards] == [4, 2]
    ds = shardflow.ShardDataset(dst, decode=None, storage_options=s3_options)
    samples = list(ds)
    assert len(ds) == 6 and len(samples) == 6
    assert sorted((int(s["cls"]), s["jpg"]) for s in samples) == sorted(
        (0 if cls == "cat" else 1, data) for (cls, _j), data in files.items()
    )
    decoded = list(shardflow.ShardDataset(dst, decode="numpy", storage_options=s3_options))
    assert all(s["jpg"].shape == (12, 10, 3) for s in decoded)


# --------------------------------------------------------------------------- HTTP and memory://


def test_http_with_and_without_manifest(http_server, tmp_path):
    srv = http_server
    want = write(str(tmp_path / "d" / "train-%06d.tar"), 25, 10)
    serve_folder(srv, tmp_path / "d", "with/")
    urls = [srv.url_for(f"with/train-{i:06d}.tar") for i in range(3)]
    for source in [srv.url + "/with/" + MANIFEST_NAME, srv.url + "/with", srv.url + "/with/train-{000000..000002}.tar", urls]:
        ds = shardflow.ShardDataset(source, decode=None)
        assert ds.sized and len(ds) == 25 and ds.urls == urls, source
        assert got(ds) == in_order(want), source
    # the same shards without manifest nor offset indexes: an unsized stream
    for name in os.listdir(tmp_path / "d"):
        if name.endswith(".tar"):
            srv.put("bare/" + name, (tmp_path / "d" / name).read_bytes())
    for source in [srv.url + "/bare/train-{000000..000002}.tar", srv.url + "/bare"]:
        ds = shardflow.ShardDataset(source, decode=None)
        assert not ds.sized, source
        with pytest.raises(TypeError):
            len(ds)
        assert got(ds) == in_order(want), source
    ds = shardflow.ShardDataset(srv.url + "/bare/train-{000000..000002}.tar", decode=None)
    seen = [kb for batch in shardflow.loader(ds, batch_size=4, num_workers=2, collate_fn=list) for kb in got(batch)]
    assert sorted(seen) == in_order(want) and len(seen) == 25


def test_folder_check_is_retried_not_mistaken_for_a_shard(flaky_http_server, tmp_path):
    srv = flaky_http_server
    want = write(str(tmp_path / "d" / "train-%06d.tar"), 12, 5)
    serve_folder(srv, tmp_path / "d")
    srv.faults.fail_next = 2  # the folder check meets two 503s
    ds = shardflow.ShardDataset(srv.url, decode=None, io=FAST)
    assert ds.sized and ds.urls == [srv.url_for(f"train-{i:06d}.tar") for i in range(3)]
    assert got(ds) == in_order(want) and srv.stats.failures == 2
    # a shard URL is not probed as a folder (over HTTP that would download it)
    srv.reset_stats()
    ds = shardflow.ShardDataset(srv.url_for("train-000001.tar"), decode=None)
    assert srv.stats.gets_by_path.get("train-000001.tar", 0) == 0
    assert ds.sized and len(ds) == 5 and got(ds) == in_order(want)[5:10]


def test_memory_filesystem_round_trip():
    base = f"memory://remote-{uuid.uuid4().hex}/ds"
    want = write(base + "/train-%06d.tar", 9, 4)
    assert sorted(fsspec.filesystem("memory").ls(base, detail=False))[0].endswith(MANIFEST_NAME)
    for source in [base, base + "/" + MANIFEST_NAME, base + "/train-{000000..000002}.tar"]:
        ds = shardflow.ShardDataset(source, decode=None)
        assert len(ds) == 9 and got(ds) == in_order(want), source


_SERVER = """
import sys
sys.path.insert(0, sys.argv[2])
from tests.servers import Faults, FileHTTPServer
srv = FileHTTPServer(sys.argv[1], Faults(latency=float(sys.argv[3]))).start()
print(srv.url, flush=True)
sys.stdin.read()
"""


def collect_garbage(sample):
    """A transform that runs the cyclic garbage collector, as a long worker does by
    itself sooner or later."""
    import gc

    gc.collect()
    return sample


def test_main_process_reads_after_workers_were_forked(tmp_path):
    """DataLoader workers forked from a process that read over HTTP must leave its
    pooled connections alone: the next dataset built in the main process reads.
    (The server runs in another process, as a real one would: its sockets are not
    the reader's.)"""
    import subprocess
    import sys
    import threading

    want = write(str(tmp_path / "d" / "train-%06d.tar"), 12, 4)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    server = subprocess.Popen([sys.executable, "-c", _SERVER, str(tmp_path / "d"), root, "0.02"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        url = server.stdout.readline().strip()
        for _epoch in range(3):  # a new dataset per epoch, as a training script may build
            result = {}

            def build_and_read() -> None:  # in a thread, so that a hang fails the test
                result["main"] = got(shardflow.ShardDataset(url, decode=None))
                result["ds"] = shardflow.ShardDataset(url, decode=None, transform=collect_garbage)

            thread = threading.Thread(target=build_and_read, daemon=True)
            thread.start()
            thread.join(30)
            assert not thread.is_alive(), "a request of the main process hangs"
            assert result["main"] == in_order(want)
            loader = shardflow.loader(result["ds"], batch_size=4, num_workers=2, collate_fn=list)
            assert sorted(kb for batch in loader for kb in got(batch)) == in_order(want)
            del loader
    finally:
        server.stdin.close()
        server.wait(30)


# --------------------------------------------------------------------------- requests per epoch


def test_an_epoch_of_whole_shards_is_one_get_per_shard(http_server, tmp_path):
    """Whole shards stream from their start: no offset index to fetch, and the
    size check against the manifest comes with the shard's own response."""
    srv = http_server
    want = write(str(tmp_path / "d" / "train-%06d.tar"), 30, 10)
    serve_folder(srv, tmp_path / "d")
    ds = shardflow.ShardDataset(srv.url, decode=None)
    srv.reset_stats()
    assert got(ds) == in_order(want)
    assert srv.stats.gets_by_path == {f"train-{i:06d}.tar": 1 for i in range(3)}


def test_sparse_remote_reads_read_through_instead_of_a_request_per_gap(http_server, tmp_path):
    """Rank 1 of 7 takes every 7th sample: locally each gap is seeked over; remotely
    a seek is a request, so gaps smaller than REMOTE_SEEK_BYTES are read through."""
    from shardflow.reader.runs import plan_runs

    srv = http_server
    want = write(str(tmp_path / "d" / "train-%06d.tar"), 200, 100)
    serve_folder(srv, tmp_path / "d")
    ds = shardflow.ShardDataset(srv.url, decode=None, rank=1, world_size=7, shuffle=False)
    plan = ds.plan(0)
    positions = np.arange(len(plan.read_sample))
    sparse = positions[positions % 25 == 0]  # 8 samples, 24 unneeded between each
    local = shardflow.ShardDataset(str(tmp_path / "d"), decode=None, rank=1, world_size=7, shuffle=False)
    assert len(plan_runs(local.plan(0), sparse, local.shards, 1)[0]) == len(sparse)  # a seek per sample
    assert len(plan_runs(plan, sparse, ds.shards, 1)[0]) <= 2  # one run per shard
    # and reading a rank's share remotely: one GET per shard part, the right samples
    srv.reset_stats()
    assert got(ds) == got(local) and len(got(local)) == 29  # 200 samples over 7 ranks, padded
    assert sum(v for k, v in srv.stats.gets_by_path.items() if k.endswith(".tar")) <= 2


# --------------------------------------------------------------------------- read-ahead of the next shard


def test_next_shard_streams_while_this_one_is_read(http_server, tmp_path):
    srv = http_server
    write(str(tmp_path / "d" / "train-%06d.tar"), 30, 10)
    serve_folder(srv, tmp_path / "d")
    gets = lambda i: srv.stats.gets_by_path.get(f"train-{i:06d}.tar", 0)  # noqa: E731
    ds = shardflow.ShardDataset(srv.url, decode=None)
    it = iter(ds)
    assert next(it)["__key__"] == "000000"
    # shard 1 is being fetched while shard 0 is read; shard 2 waits for its turn
    assert wait_until(lambda: gets(1) == 1)
    assert gets(0) == 1 and gets(2) == 0
    for _ in range(10):
        next(it)  # into shard 1: now shard 2 streams ahead
    assert wait_until(lambda: gets(2) == 1)
    it.close()
    # read-ahead off: nothing is fetched before it is needed
    srv.reset_stats()
    it = iter(shardflow.ShardDataset(srv.url, decode=None, io=IOOptions(readahead=0)))
    next(it)
    assert gets(0) == 1 and gets(1) == 0
    it.close()


def test_unsized_stream_reads_ahead_too(http_server, tmp_path):
    srv = http_server
    write(str(tmp_path / "d" / "train-%06d.tar"), 20, 10, manifest=False, index=False)
    serve_folder(srv, tmp_path / "d")
    ds = shardflow.ShardDataset(srv.url + "/train-{000000..000001}.tar", decode=None)
    assert not ds.sized
    it = iter(ds)
    next(it)
    assert wait_until(lambda: srv.stats.gets_by_path.get("train-000001.tar", 0) == 1)
    it.close()


# --------------------------------------------------------------------------- surviving the network


@pytest.fixture
def flaky_data(flaky_http_server, tmp_path):
    """30 samples in 3 shards of ~20 KB on the flaky server, plus what was written."""
    srv = flaky_http_server
    want = write(str(tmp_path / "d" / "train-%06d.tar"), 30, 10)
    serve_folder(srv, tmp_path / "d")
    return srv, want


@pytest.mark.parametrize("reset", [False, True], ids=["close", "reset"])
def test_dropped_connections_one_epoch_exact(flaky_data, reset):
    srv, want = flaky_data
    srv.faults.drop_after = 7_000  # each response cut after 7000 body bytes
    srv.faults.reset = reset
    srv.faults.max_drops = None if not reset else 6
    # a reset can discard the bytes already received (aiohttp drops an incomplete body), so all 6
    # resets may land on one shard without progress: allow more retries than resets
    ds = shardflow.ShardDataset(srv.url, decode=None, io=IOOptions(backoff=0.0, retries=8))
    assert got(ds) == in_order(want)
    assert ds.stats["samples"] == 30 and ds.stats["skipped"] == 0
    assert srv.stats.drops >= (6 if reset else 9)


def test_dropped_connections_shuffled_through_workers(flaky_data):
    srv, want = flaky_data
    srv.faults.drop_after = 7_000
    ds = shardflow.ShardDataset(srv.url, decode=None, shuffle=True, seed=1, io=FAST)
    seen = [kb for batch in shardflow.loader(ds, batch_size=4, num_workers=2, collate_fn=list) for kb in got(batch)]
    assert len(seen) == 30 and sorted(seen) == in_order(want)
    assert ds.stats["samples"] == 30 and ds.stats["skipped"] == 0
    assert srv.stats.drops > 0


def test_dropped_connections_unsized(flaky_http_server, tmp_path):
    srv = flaky_http_server
    want = write(str(tmp_path / "d" / "train-%06d.tar"), 30, 10, manifest=False, index=False)
    serve_folder(srv, tmp_path / "d")
    srv.faults.drop_after = 7_000
    ds = shardflow.ShardDataset(srv.url + "/train-{000000..000002}.tar", decode=None, io=FAST)
    assert not ds.sized
    assert got(ds) == in_order(want)
    assert srv.stats.drops >= 9


def test_object_changed_between_reads(flaky_data):
    srv, want = flaky_data
    srv.faults.drop_after = 7_000
    srv.faults.max_drops = 1
    srv.faults.drop_only = "train-000000.tar"  # not shard 1, which may be requested first
    srv.faults.change_on_drop = b"\0" * 1024  # the first shard is rewritten after the drop
    url = srv.url_for("train-000000.tar")
    with pytest.raises(ShardChangedError) as info:
        list(shardflow.ShardDataset(srv.url, decode=None, io=FAST))
    assert url in str(info.value) and "changed" in str(info.value)
    assert srv.stats.changes == 1


def test_object_changed_skip_counts_the_lost_samples(flaky_data, tmp_path):
    srv, want = flaky_data
    srv.faults.drop_after = 7_000
    srv.faults.max_drops = 1
    srv.faults.drop_only = "train-000000.tar"  # not shard 1, which may be requested first
    srv.faults.change_on_drop = b"\0" * 1024
    srv.faults.linger = 0.5  # the reader takes the 7000 bytes before it sees the cut, however loaded the machine
    ds = shardflow.ShardDataset(srv.url, decode=None, io=FAST, on_error="skip")
    # The first 7000 bytes of shard 0 arrived. A sample is complete once the next
    # sample's first member (its bin) is: sample j is kept iff that ends by byte 7000.
    offsets = np.load(os.path.join(tmp_path, "d", "train-000000.tar.idx.npy"))
    ends = [int(offsets[j + 1]) + 512 + (len(want[f"{j + 1:06d}"]) + 511) // 512 * 512 for j in range(9)]
    kept = sum(1 for e in ends if e <= 7000)
    assert kept == 1
    assert got(ds) == in_order(want)[:kept] + in_order(want)[10:]
    assert ds.stats["remote_read"] == 1
    assert ds.stats["lost_samples"] == 10 - kept == ds.stats["skipped"]
    assert ds.stats["samples"] == 20 + kept


def _retry_case(srv, tmp_path):
    """Shard 1 of 3 has big samples; every response reaching byte ``cut`` of a file is
    cut there, inside the ``cls`` header of shard 1's sample 6 (the other files are
    smaller than ``cut``). Returns (cut, what was written)."""
    want = write(str(tmp_path / "d" / "train-%06d.tar"), 10, 10, size=200)
    want.update(write(str(tmp_path / "d" / "train-%06d.tar"), 10, 10, start=10, size=3000, start_shard=1, manifest=False))
    want.update(write(str(tmp_path / "d" / "train-%06d.tar"), 10, 10, start=20, size=200, start_shard=2, manifest=False))
    # one manifest for the three shards
    from shardflow.writing.indexing import index_shards

    index_shards([str(tmp_path / "d" / f"train-{i:06d}.tar") for i in range(3)])
    offsets = np.load(tmp_path / "d" / "train-000001.tar.idx.npy")
    bin_member = 512 + (len(want["000016"]) + 511) // 512 * 512
    cut = int(offsets[6]) + bin_member + 100
    assert all(os.path.getsize(tmp_path / "d" / n) < cut for n in os.listdir(tmp_path / "d") if "000001.tar" not in n)
    serve_folder(srv, tmp_path / "d")
    srv.faults.drop_at = cut
    return cut, want


def test_retries_exhausted_raise_names_url_and_offset(flaky_http_server, tmp_path):
    srv = flaky_http_server
    cut, _ = _retry_case(srv, tmp_path)
    ds = shardflow.ShardDataset(srv.url, decode=None, io=IOOptions(retries=2, backoff=0.0))
    with pytest.raises(RemoteReadError) as info:
        list(ds)
    message = str(info.value)
    assert srv.url_for("train-000001.tar") in message
    assert f"at byte {cut}" in message and "after 2 retries" in message
    assert not isinstance(info.value, ShardChangedError)


@pytest.mark.parametrize("sized", [True, False], ids=["manifest", "no-manifest"])
def test_retries_exhausted_skip_counts_lost_tail_and_goes_on(flaky_http_server, tmp_path, sized):
    srv = flaky_http_server
    _, want = _retry_case(srv, tmp_path)
    io_opts = IOOptions(retries=2, backoff=0.0)
    source = srv.url if sized else [srv.url_for(f"train-{i:06d}.tar") for i in range(3)]
    if not sized:
        os.remove(os.path.join(srv.root, MANIFEST_NAME))
    ds = shardflow.ShardDataset(source, decode=None, io=io_opts, on_error="skip")
    assert ds.sized is sized
    kept = [f"{i:06d}" for i in range(16)] + [f"{i:06d}" for i in range(20, 30)]
    assert got(ds) == [(k, want[k]) for k in kept]
    assert ds.stats["remote_read"] == 1 and ds.stats["samples"] == 26
    if sized:  # the manifest says how many samples the shard took with it
        assert ds.stats["lost_samples"] == 4 and ds.stats["skipped"] == 4
    else:
        assert ds.stats["lost_samples"] == 0


def test_retries_exhausted_through_workers(flaky_http_server, tmp_path):
    srv = flaky_http_server
    _, want = _retry_case(srv, tmp_path)
    ds = shardflow.ShardDataset(srv.url, decode=None, io=IOOptions(retries=2, backoff=0.0), on_error="skip")
    seen = [kb for batch in shardflow.loader(ds, batch_size=5, num_workers=2, collate_fn=list) for kb in got(batch)]
    kept = [f"{i:06d}" for i in range(16)] + [f"{i:06d}" for i in range(20, 30)]
    assert sorted(seen) == [(k, want[k]) for k in kept]  # batches of the two workers alternate
    assert ds.stats["remote_read"] == 1 and ds.stats["lost_samples"] == 4
    assert ds.stats["samples"] == 26 and ds.stats["skipped"] == 4
    # on_error="raise": re-raised in the main process, naming the shard and the offset
    ds = shardflow.ShardDataset(srv.url, decode=None, io=IOOptions(retries=1, backoff=0.0))
    with pytest.raises(RemoteReadError, match=re.escape(srv.url_for("train-000001.tar")) + ".* at byte") as info:
        list(shardflow.loader(ds, batch_size=5, num_workers=2))
    # the workers are gone although the traceback (kept in `info`) still holds the iterator; the
    # loader ends a worker that does not exit in time with SIGTERM, which a loaded machine may
    # deliver a moment after the raise: waited for (a worker the iterator kept would never go)
    assert info.traceback and wait_until(lambda: multiprocessing.active_children() == [])


# --------------------------------------------------------------------------- compressed shards


def _compress(kind: str, data: bytes) -> bytes:
    if kind == "gz":
        return gzip.compress(data)
    zstandard = pytest.importorskip("zstandard")
    return zstandard.ZstdCompressor().compress(data)


@pytest.mark.parametrize("kind", ["gz", "zst"])
def test_compressed_shards_stream_local_and_http(kind, tmp_path, http_server):
    want = write(str(tmp_path / "plain" / "train-%06d.tar"), 25, 10)
    folder = tmp_path / kind
    folder.mkdir()
    for i in range(3):  # named .tar: detected by magic bytes, not by suffix
        name = f"train-{i:06d}.tar"
        (folder / name).write_bytes(_compress(kind, (tmp_path / "plain" / name).read_bytes()))
        http_server.put(f"{kind}/{name}", (folder / name).read_bytes())
    local_urls = [str(folder / f"train-{i:06d}.tar") for i in range(3)]
    http_urls = [http_server.url_for(f"{kind}/train-{i:06d}.tar") for i in range(3)]
    for urls in (local_urls, http_urls):
        ds = shardflow.ShardDataset(urls, decode=None)
        assert got(ds) == in_order(want)
    # indexed (a manifest with counts): exact splits. A gzip shard gets no offset index; a zstd
    # frame that declares its size gets a one-frame table, so it seeks (docs/compression.md)
    from shardflow.writing.indexing import index_shards

    manifest = index_shards(local_urls)
    seekable = kind == "zst"
    assert [s.index is not None for s in manifest.shards] == [seekable] * 3
    assert [s.frames is not None for s in manifest.shards] == [seekable] * 3
    assert [s.compression for s in manifest.shards] == [{"zst": "zstd", "gz": "gzip"}[kind]] * 3
    ranks = [list(shardflow.ShardDataset(str(folder), decode=None, rank=r, world_size=2)) for r in range(2)]
    assert [len(r) for r in ranks] == [13, 13]  # 25 samples, padded to 26
    assert sorted({k for r in ranks for k in (s["__key__"] for s in r)}) == sorted(want)


def test_gzip_content_encoding_is_not_undone_twice(http_server, tmp_path):
    want = write(str(tmp_path / "plain" / "train-%06d.tar"), 12, 12)
    body = gzip.compress((tmp_path / "plain" / "train-000000.tar").read_bytes())
    url = http_server.put("enc/train-000000.tar", body)
    http_server.faults.content_encoding = {"enc/train-000000.tar": "gzip"}
    assert got(shardflow.ShardDataset([url], decode=None)) == in_order(want)
    loader = shardflow.loader(shardflow.ShardDataset([url], decode=None), batch_size=5, num_workers=2, collate_fn=list)
    assert sorted(kb for b in loader for kb in got(b)) == in_order(want)


def test_random_access_on_compressed_shards_is_refused(tmp_path):
    write(str(tmp_path / "d" / "train-%06d.tar"), 100, 50, size=100)
    for name in os.listdir(tmp_path / "d"):
        if name.endswith(".tar"):  # compressed after the manifest and offset indexes were written
            path = tmp_path / "d" / name
            path.write_bytes(gzip.compress(path.read_bytes()))
    # map-style dataset: found by magic bytes when the shard is opened
    ix = shardflow.IndexedShardDataset(str(tmp_path / "d"), decode=None)
    with pytest.raises(ShardFormatError, match=r"train-000000\.tar: compressed shard") as info:
        ix[3]
    assert info.value.reason == "compressed_shard"
    # streaming: a whole shard is read from its start, decompressed, without the index
    keys = [f"{i:06d}" for i in range(100)]
    assert [s["__key__"] for s in shardflow.ShardDataset(str(tmp_path / "d"), decode=None)] == keys
    # a part further in needs the offset index (rank 1 of 4: samples 25-49): a clear error
    with pytest.raises(ShardFormatError, match=r"train-000000\.tar: compressed shard .*offset index") as info:
        list(shardflow.ShardDataset(str(tmp_path / "d"), decode=None, rank=1, world_size=4))
    assert info.value.reason == "compressed_shard"
    ds = shardflow.ShardDataset(str(tmp_path / "d"), decode=None, rank=1, world_size=4, on_error="skip")
    with pytest.raises(shardflow.errors.ShardflowError, match="yielded no sample"):
        list(ds)
    assert ds.stats["compressed_shard"] == 1 and ds.stats["lost_samples"] == 25


# --------------------------------------------------------------------------- reading only one's own samples


def _corrupt_header(path: str, sample: int) -> None:
    """Flip a byte of sample ``sample``'s first member name: a bad header checksum, same size."""
    offsets = np.load(path + ".idx.npy")
    data = bytearray(open(path, "rb").read())
    data[int(offsets[sample]) + 10] ^= 0x01
    open(path, "wb").write(bytes(data))


@pytest.mark.parametrize("on_error", ["raise", "skip"])
@pytest.mark.parametrize("where", ["local", "http"])
def test_a_corrupt_sample_outside_the_share_does_not_touch_it(http_server, tmp_path, on_error, where):
    """Rank 1 of 2 owns samples 20-39; sample 5 is corrupt. Reading from the shard's
    start (no index fetch) or through a gap meets it, so the reader goes on through
    the offset index: rank 1 yields its 20 samples, rank 0 reports the error."""
    want = write(str(tmp_path / "d" / "train-%06d.tar"), 40, 40, size=200)
    _corrupt_header(str(tmp_path / "d" / "train-000000.tar"), 5)
    serve_folder(http_server, tmp_path / "d")
    source = str(tmp_path / "d") if where == "local" else http_server.url
    kw = dict(decode=None, world_size=2, shuffle=False, on_error=on_error)
    rank1 = shardflow.ShardDataset(source, rank=1, **kw)
    assert got(rank1) == in_order(want)[20:] and dict(rank1.stats) == {"samples": 20}
    rank0 = shardflow.ShardDataset(source, rank=0, **kw)
    if on_error == "raise":
        with pytest.raises(ShardFormatError, match=r"train-000000\.tar: bad tar header checksum at byte"):
            list(rank0)
    else:
        # exact skip: the index says sample 5 starts at the damaged header, so sample 4 is
        # complete; reading goes on through the index at sample 6
        assert got(rank0) == in_order(want)[:5] + in_order(want)[6:20]
        assert rank0.stats["bad_shard"] == 1 and rank0.stats["lost_samples"] == 1


@pytest.mark.parametrize("on_error", ["raise", "skip"])
def test_a_shard_cut_right_after_the_share_still_yields_it(tmp_path, on_error):
    """Rank 2 of 5 owns samples 4 and 5; the shard is cut inside sample 6's header.
    Read from the start, sample 5 would only be complete once 6's header parsed: the
    index's end offset bounds it instead."""
    want = write(str(tmp_path / "d" / "train-%06d.tar"), 10, 10, size=200)
    path = tmp_path / "d" / "train-000000.tar"
    offsets = np.load(str(path) + ".idx.npy")
    path.write_bytes(path.read_bytes()[: int(offsets[6]) + 100])
    ds = shardflow.ShardDataset(str(tmp_path / "d"), decode=None, rank=2, world_size=5, shuffle=False, on_error=on_error)
    assert got(ds) == in_order(want)[4:6] and dict(ds.stats) == {"samples": 2}


def test_each_store_is_read_by_its_row_of_the_reader_table(tmp_path) -> None:
    """``READERS`` names the reader of each filesystem class fsspec gives; a filesystem no row
    matches (a zip archive) is read by the generic reader, through fsspec's own file object."""
    import zipfile

    import fsspec

    from shardflow.storage.readers import READERS, FileReader, MemoryReader, open_reader

    def row(fs) -> str | None:
        return next((name for name, matches, _ in READERS if matches(fs)), None)

    assert row(fsspec.filesystem("file")) == "local"
    assert row(fsspec.filesystem("memory")) == "memory"
    assert row(fsspec.filesystem("https")) == "http"
    assert row(fsspec.filesystem("s3", anon=True)) == "s3"
    assert row(fsspec.filesystem("gcs", token="anon")) == "gcs"
    archive = tmp_path / "a.zip"
    with zipfile.ZipFile(archive, "w") as z:
        z.writestr("x.bin", b"0123456789")
    zfs = fsspec.filesystem("zip", fo=str(archive))
    assert row(zfs) is None
    reader = open_reader(zfs, "x.bin", f"zip://x.bin::{archive}", 3, None, IOOptions())
    assert isinstance(reader.reader, FileReader)
    assert reader.read(100) == b"3456789"
    reader.close()
    mem = fsspec.filesystem("memory")
    mem.pipe("/t/y.bin", b"abcdef")
    got = open_reader(mem, "/t/y.bin", "memory://t/y.bin", 2, None, IOOptions())
    assert isinstance(got.reader, MemoryReader) and got.read(10) == b"cdef"
    got.close()
