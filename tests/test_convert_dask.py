"""The Dask engine: a LocalCluster of 2 worker processes on 127.0.0.1 writes the same
bytes as local processes; a worker killed mid-run costs only its task (same bytes);
the CLI's --scheduler runs on a cluster by its address."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

import pytest

import shardflow
from shardflow.convert.engine.engine import ConvertOptions
from shardflow.convert.images.imagefolder import convert_imagefolder
from tests.helpers import tiny_image

distributed = pytest.importorskip("distributed", reason="the Dask engine needs shardflow[dask]")

pytestmark = pytest.mark.timeout(180)

N = 48


def sample_of(i: int):
    if i % 7 == 3:
        return None
    return [{"__key__": f"s{i:04d}-{j}", "bin": bytes([i % 256]) * (50 + 31 * i + j), "cls": i} for j in range(1 + i % 3)]


def dies_once(marker: Path, i: int):
    """Input 20 kills the worker process that runs it the first time (as a crash or an
    OOM kill would), leaving its shard half-written; the task's rerun goes through."""
    if i == 20 and not marker.exists():
        marker.write_text("killed once")
        os._exit(1)
    return sample_of(i)


@pytest.fixture(scope="module")
def cluster():
    from distributed import Client, LocalCluster

    with LocalCluster(
        n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1", dashboard_address=":0",
        worker_dashboard_address=":0",
    ) as cl, Client(cl) as client:  # fmt: skip
        yield cl, client


def folder_bytes(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file() and not p.name.startswith(".")}


def write(fn, dst: Path, **kw):
    return shardflow.write_shards(fn, range(N), str(dst), max_count=5, group_size=6, **kw)


def test_same_bytes_as_local_processes(cluster, tmp_path: Path) -> None:
    _, client = cluster
    log_length = client.scheduler_comm.recent_message_log.maxlen
    write(sample_of, tmp_path / "local", workers=2)
    write(sample_of, tmp_path / "dask", client=client)
    assert client.scheduler_comm.recent_message_log.maxlen == log_length  # the client is left as it was
    local = folder_bytes(tmp_path / "local")
    assert len([n for n in local if n.endswith(".tar")]) > 8
    assert folder_bytes(tmp_path / "dask") == local
    # the conversion record too (hidden file): same groups, same hashes
    assert (tmp_path / "dask" / ".shardflow-convert.json").read_bytes() == (tmp_path / "local" / ".shardflow-convert.json").read_bytes()


def test_worker_killed_mid_run_same_bytes(cluster, tmp_path: Path) -> None:
    _, client = cluster
    write(sample_of, tmp_path / "local", workers=1)
    write(functools.partial(dies_once, tmp_path / "marker"), tmp_path / "dask", client=client)
    assert (tmp_path / "marker").exists()  # a worker really died
    assert folder_bytes(tmp_path / "dask") == folder_bytes(tmp_path / "local")
    assert not [p.name for p in (tmp_path / "dask").iterdir() if p.name.endswith(".tmp")]  # its half shard removed
    client.wait_for_workers(2, timeout=60)  # the nanny restarted it


def test_imagefolder_on_dask(cluster, tmp_path: Path) -> None:
    _, client = cluster
    src = tmp_path / "tree"
    for c in range(4):
        for i in range(5 + c):
            (src / f"c{c}").mkdir(parents=True, exist_ok=True)
            (src / f"c{c}" / f"{i:03d}.jpg").write_bytes(tiny_image("JPEG", 10 * c + i))
    a = convert_imagefolder(str(src), str(tmp_path / "local"), options=ConvertOptions(max_count=4, workers=2))
    b = convert_imagefolder(str(src), str(tmp_path / "dask"), options=ConvertOptions(max_count=4), client=client)
    assert folder_bytes(tmp_path / "dask") == folder_bytes(tmp_path / "local")
    assert b.meta["class_counts"] == a.meta["class_counts"] == {"c0": 5, "c1": 6, "c2": 7, "c3": 8}


def test_cli_scheduler_address(cluster, tmp_path: Path) -> None:
    cl, _ = cluster
    src = tmp_path / "tree"
    (src / "a").mkdir(parents=True)
    for i in range(7):
        (src / "a" / f"{i}.png").write_bytes(tiny_image("PNG", i))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    cmd = [sys.executable, "-m", "shardflow.cli", "convert", "imagefolder", str(src)]
    done = subprocess.run([*cmd, str(tmp_path / "d"), "--max-count", "3", "--scheduler", cl.scheduler_address],
                          capture_output=True, text=True, env=env, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    local = subprocess.run([*cmd, str(tmp_path / "l"), "--max-count", "3", "--workers", "1"],
                           capture_output=True, text=True, env=env, timeout=120)  # fmt: skip
    assert local.returncode == 0, local.stderr
    assert folder_bytes(tmp_path / "d") == folder_bytes(tmp_path / "l")


def test_parquet_and_lmdb_on_dask(cluster, tmp_path: Path) -> None:
    """Both converters' tasks (row-group pieces; LMDB key ranges) run on Dask workers: same bytes."""
    pytest.importorskip("pyarrow")
    pytest.importorskip("lmdb")
    from shardflow.convert.records.lmdb import convert_lmdb
    from shardflow.convert.records.parquet import convert_parquet
    from tests.test_convert_lmdb import jpeg, make_lmdb
    from tests.test_convert_parquet import hf_dataset

    _, client = cluster
    hf_dataset(tmp_path / "hf", sizes=(13, 9), row_group_size=4)
    opts = ConvertOptions(max_count=5, workers=2)
    convert_parquet(tmp_path / "hf", str(tmp_path / "pq-local"), options=opts)
    convert_parquet(tmp_path / "hf", str(tmp_path / "pq-dask"), options=opts, client=client)
    assert folder_bytes(tmp_path / "pq-dask") == folder_bytes(tmp_path / "pq-local")
    make_lmdb(tmp_path / "db", {f"k{i:03d}".encode(): jpeg(i) for i in range(17)})
    convert_lmdb(tmp_path / "db", str(tmp_path / "db-local"), options=opts)
    convert_lmdb(tmp_path / "db", str(tmp_path / "db-dask"), options=opts, client=client)
    assert folder_bytes(tmp_path / "db-dask") == folder_bytes(tmp_path / "db-local")
    assert len([n for n in folder_bytes(tmp_path / "db-dask") if n.endswith(".tar")]) == 4
