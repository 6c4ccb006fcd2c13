"""The shard cache against a changing store and a full disk (issue 25, case j).

- A fill is checked against the manifest's sha256 when the manifest has one: an object that changed
  since it was indexed is a ``ShardChangedError`` and is never cached (it was served every epoch).
- Without a digest, only objects with validators (ETag, Last-Modified) are cached; others stream.
- A full cache disk (ENOSPC while filling) reads the shard uncached and warns once.
"""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path

import pytest

from shardflow import IOOptions, ShardDataset
from shardflow.storage import ShardChangedError
from shardflow.storage.sharing import cache as cache_module

from .helpers import make_shards

pytestmark = pytest.mark.timeout(60)


def _served(tmp_path: Path, srv, sizes=(4, 4)) -> str:
    folder = make_shards(tmp_path, list(sizes))
    for p in folder.iterdir():
        srv.put(f"d/{p.name}", p.read_bytes())
    return srv.url + "/d/"


def _cached(cache: Path) -> list[str]:
    return sorted(p.name for p in cache.iterdir() if not p.name.startswith("."))


def _change(srv, name: str) -> None:
    """Rewrite a served shard in place, same size (a sample's text changed)."""
    path = srv.root / "d" / name
    data = bytearray(path.read_bytes())
    at = data.index(b"\x00\x00\x00", 600)  # inside the first member's data padding
    data[at] = 0x41
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("validators", [True, False])
def test_a_fill_that_does_not_match_the_manifest_digest_is_refused(tmp_path: Path, flaky_http_server, validators) -> None:
    srv = flaky_http_server
    srv.faults.no_validators = not validators
    url = _served(tmp_path, srv)
    _change(srv, "train-000001.tar")
    cache = tmp_path / "cache"
    io = IOOptions(cache_dir=str(cache), retries=0)
    with pytest.raises(ShardChangedError, match=r"train-000001.tar: .*sha256 .* manifest lists"):
        [s["__key__"] for s in ShardDataset(url, decode=None, io=io)]
    assert all("train-000001" not in n for n in _cached(cache))  # nothing served from a bad copy later


def test_without_a_digest_or_validators_nothing_is_cached(tmp_path: Path, flaky_http_server) -> None:
    srv = flaky_http_server
    srv.faults.no_validators = True
    url = _served(tmp_path, srv)
    cache = tmp_path / "cache"
    io = IOOptions(cache_dir=str(cache), retries=0)
    (srv.root / "d" / "shardflow.json").unlink()  # no manifest: no sha256
    urls = [url + "train-000000.tar", url + "train-000001.tar"]
    assert len([s for s in ShardDataset(urls, decode=None, io=io)]) == 8
    assert _cached(cache) == []
    srv.faults.no_validators = False
    assert len([s for s in ShardDataset(urls, decode=None, io=io)]) == 8
    assert len(_cached(cache)) == 2  # with an ETag they are


def test_a_full_cache_disk_reads_uncached_and_warns_once(tmp_path: Path, http_server, monkeypatch, caplog) -> None:
    url = _served(tmp_path, http_server, sizes=(4, 4, 4))

    def full(out, chunk: bytes) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(cache_module, "write_fill", full)
    cache = tmp_path / "cache"
    caplog.set_level(logging.WARNING)
    ds = ShardDataset(url, decode=None, io=IOOptions(cache_dir=str(cache)))
    for _ in range(2):
        assert [s["__key__"] for s in ds] == [f"{i:06d}" for i in range(12)]
    warned = [r.getMessage() for r in caplog.records if "no space left" in r.getMessage().lower()]
    assert len(warned) == 1, warned
    assert _cached(cache) == [] and not [p for p in cache.iterdir() if p.name.startswith(".tmp-")]
