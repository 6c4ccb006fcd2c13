"""Hostile manifests and indexes (issue 25, case c): read with a size cap, deep nesting and NUL
bytes named, never a bare MemoryError, RecursionError or ValueError.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest

from shardflow import IndexedShardDataset, IOOptions, ShardDataset
from shardflow.errors import ManifestError
from shardflow.format.limits import Limits
from shardflow.format.manifest import Manifest

from .helpers import make_shards
from .test_hostile import MiB, peak_rss

pytestmark = pytest.mark.timeout(120)

HEAD = b'{"format": "shardflow", "version": 1, "shards": ['
ENTRY = b'{"url": "train-000000.tar", "samples": 1, "bytes": 10240},\n'


class _Endless(BaseHTTPRequestHandler):
    """Every GET: a manifest that never ends (no Content-Length), until the client goes."""

    protocol_version = "HTTP/1.0"

    def log_message(self, *args) -> None:
        pass

    def do_HEAD(self) -> None:
        self.send_response(200)
        self.end_headers()

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        piece = ENTRY * (1 << 14)
        try:
            self.wfile.write(HEAD)
            for _ in range(1 << 16):  # bounded: 60 GB at most, the client stops long before
                self.wfile.write(piece)
        except OSError:
            pass


@pytest.fixture
def endless_server():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Endless)
    srv.daemon_threads = True
    thread = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def test_an_endless_remote_manifest_stops_at_the_cap(endless_server: str) -> None:
    got = peak_rss(f"""
        from shardflow.format.limits import Limits
        io = shardflow.IOOptions(limits=Limits(max_manifest_bytes=32 << 20), retries=0)
        shardflow.ShardDataset({endless_server + "/data/shardflow.json"!r}, io=io)
    """)
    assert got["error"].startswith("ManifestError: "), got
    assert "is larger than 33554432 bytes (Limits.max_manifest_bytes)" in got["error"]
    assert got["peak"] < 32 * MiB + 64 * MiB, got["peak"] / MiB  # bound: the cap + 64 MiB (it was 2.6 GB)


def test_the_manifest_cap_covers_indexes_and_is_documented_in_limits(tmp_path: Path) -> None:
    tmp_path = make_shards(tmp_path, [20, 20])
    assert Limits().max_manifest_bytes == 256 * MiB
    small = IOOptions(limits=Limits(max_manifest_bytes=256))  # the manifest is 495 bytes
    with pytest.raises(ManifestError, match=r"shardflow.json is larger than 256 bytes \(Limits.max_manifest_bytes\)"):
        ShardDataset(str(tmp_path), io=small)
    manifest = json.loads((tmp_path / "shardflow.json").read_text())
    index = tmp_path / manifest["shards"][0]["index"]
    # an offset index padded far past what its header declares is cut at the cap, then refused
    index.write_bytes(index.read_bytes() + b"\0" * (2 * MiB))
    fits = IOOptions(limits=Limits(max_manifest_bytes=MiB))
    with pytest.raises(ManifestError, match=r"idx.npy is larger than 1048576 bytes \(Limits.max_manifest_bytes\)"):
        IndexedShardDataset(str(tmp_path), io=fits)[0]


@pytest.mark.parametrize("depth", [10_000, 200_000])
def test_a_deeply_nested_manifest_is_a_manifest_error(tmp_path: Path, depth: int) -> None:
    text = '{"format": "shardflow", "version": 1, "shards": [], "meta": ' + "[" * depth + "]" * depth + "}"
    (tmp_path / "shardflow.json").write_text(text)
    with pytest.raises(ManifestError, match="nested too deeply"):
        ShardDataset(str(tmp_path))
    with pytest.raises(ManifestError, match="nested too deeply"):
        Manifest.loads(text)


@pytest.mark.parametrize("name", ["url", "index", "sizes"])
def test_a_nul_in_a_listed_url_is_named(tmp_path: Path, name: str) -> None:
    tmp_path = make_shards(tmp_path, [2, 2])
    path = tmp_path / "shardflow.json"
    manifest = json.loads(path.read_text())
    manifest["shards"][0][name] = "train-000000.tar\0.x"
    path.write_text(json.dumps(manifest))
    with pytest.raises(ManifestError, match=rf"shard entry 0: {name} 'train-000000.tar\\x00.x' holds a control character"):
        ShardDataset(str(tmp_path))


def test_sizes_of_a_lowered_cap_are_exact(tmp_path: Path) -> None:
    tmp_path = make_shards(tmp_path, [2, 2])
    size = (tmp_path / "shardflow.json").stat().st_size
    ok = IOOptions(limits=Limits(max_manifest_bytes=size))
    assert len(ShardDataset(str(tmp_path), io=ok)) == 4  # exactly at the cap is fine
    with pytest.raises(ManifestError, match=f"larger than {size - 1} bytes"):
        ShardDataset(str(tmp_path), io=IOOptions(limits=Limits(max_manifest_bytes=size - 1)))
    assert np.iinfo(np.int64).max > size
