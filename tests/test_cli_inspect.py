"""``shardflow inspect``: summaries of real shards, exact counts in ``--json``."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from shardflow import ShardWriter
from shardflow.cli import main
from shardflow.format.manifest import MANIFEST_NAME, Manifest
from shardflow.inspect import head, summarize
from shardflow.writing.writer import write_manifest

CLASSES = {"cat": 0, "dog": 1, "fox": 2}
# 11 samples in shards of 4: labels 0,1,2,0,1,2,... -> cat 4, dog 4, fox 3
N = 11


def jpeg(i: int) -> bytes:
    rng = np.random.default_rng(i)
    arr = rng.integers(0, 256, (24 + i, 32, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, "JPEG")
    return buf.getvalue()


def write_images(folder: Path, n: int = N, max_count: int = 4, meta: dict | None = None) -> Path:
    with ShardWriter(str(folder / "train-%06d.tar"), max_count=max_count, meta=meta or {"class_to_idx": CLASSES}) as w:
        for i in range(n):
            w.write({"__key__": f"s{i:04d}", "jpg": jpeg(i), "cls": i % 3})
    return folder


@pytest.fixture
def images(tmp_path: Path) -> Path:
    return write_images(tmp_path / "images")


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    assert main(["inspect", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def tar_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.glob("*.tar"))


def test_json_exact_counts(images: Path, capsys: pytest.CaptureFixture[str]) -> None:
    info = run_json(capsys, str(images), "--workers", "1")
    assert info["manifest"] == str(images / MANIFEST_NAME)
    assert info["shards"] == 3
    assert info["samples"] == N
    assert info["bytes"] == tar_bytes(images)
    assert info["fields"] == {"cls": {"codec": "cls", "samples": N}, "jpg": {"codec": "jpg", "samples": N}}
    assert info["classes"] == [
        {"label": 0, "name": "cat", "samples": 4},
        {"label": 1, "name": "dog", "samples": 4},
        {"label": 2, "name": "fox", "samples": 3},
    ]
    assert info["classes_from"] == "samples"
    assert info["first_keys"] == [f"s{i:04d}" for i in range(10)]
    assert info["meta"] == {"class_to_idx": CLASSES}
    assert info["graphs"] is None
    assert info["errors"] == []


def test_text_summary(images: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", str(images), "--keys", "3"]) == 0
    out = capsys.readouterr().out
    assert "shards    3" in out
    assert "samples   11" in out
    assert "jpg  codec jpg  in 11 samples" in out
    assert "cat" in out and "fox" in out
    assert "first keys s0000, s0001, s0002\n" in out
    assert 'class_to_idx: {"cat": 0, "dog": 1, "fox": 2}' in out


def test_keys_option_and_process_pool_agree(images: Path, capsys: pytest.CaptureFixture[str]) -> None:
    one = run_json(capsys, str(images), "--workers", "1", "--keys", "3")
    two = run_json(capsys, str(images), "--workers", "2", "--keys", "3")
    assert one == two
    assert one["first_keys"] == ["s0000", "s0001", "s0002"]


def test_without_manifest_scans_shards(images: Path, capsys: pytest.CaptureFixture[str]) -> None:
    os.remove(images / MANIFEST_NAME)
    info = run_json(capsys, str(images))
    assert info["manifest"] is None and info["scanned"] is True
    assert info["shards"] == 3
    assert info["samples"] == N
    assert info["bytes"] == tar_bytes(images)
    assert info["fields"]["jpg"] == {"codec": "jpg", "samples": N}
    assert [c["samples"] for c in info["classes"]] == [4, 4, 3]
    assert all(c["name"] is None for c in info["classes"])  # no manifest, no class names


def test_class_counts_from_manifest_meta_without_scan(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # what `convert imagefolder` stores: counts keyed by class name
    folder = write_images(tmp_path / "m", meta={"class_to_idx": CLASSES, "class_counts": {"cat": 4, "dog": 4, "fox": 3}})
    info = run_json(capsys, str(folder))
    assert info["scanned"] is False
    assert info["classes_from"] == "meta"
    assert [(c["label"], c["name"], c["samples"]) for c in info["classes"]] == [(0, "cat", 4), (1, "dog", 4), (2, "fox", 3)]
    assert info["fields"]["jpg"] == {"codec": "jpg", "samples": None}
    assert info["samples"] == N
    assert info["first_keys"][:2] == ["s0000", "s0001"]


def test_stale_meta_counts_are_not_trusted(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = write_images(tmp_path / "m", meta={"class_to_idx": CLASSES, "class_counts": {"cat": 400}})
    info = run_json(capsys, str(folder))
    assert info["classes_from"] == "samples"
    assert [c["samples"] for c in info["classes"]] == [4, 4, 3]


def test_no_scan_reads_only_the_manifest(images: Path, capsys: pytest.CaptureFixture[str]) -> None:
    info = run_json(capsys, str(images), "--no-scan", "--keys", "2")
    assert info["scanned"] is False
    assert info["classes"] is None
    assert info["samples"] == N and info["shards"] == 3
    assert info["first_keys"] == ["s0000", "s0001"]


def test_manifest_count_mismatch_is_reported(images: Path) -> None:
    m = Manifest.loads((images / MANIFEST_NAME).read_bytes())
    shards = [type(s)(s.url, s.samples + (1 if k == 0 else 0), s.bytes, s.sha256, s.index) for k, s in enumerate(m.shards)]
    write_manifest(str(images / MANIFEST_NAME), Manifest(shards=shards, fields=m.fields, meta=m.meta))
    info = summarize(images, workers=1)
    assert info["samples"] == N + 1  # as the manifest says...
    assert info["errors"] == [f"the manifest lists {N + 1} samples, the shards hold {N}"]  # ...and the scan disagrees


def test_head_spread_reads_evenly_spaced_samples(images: Path) -> None:
    first = head(images, 3)
    assert [s["__key__"] for s in first] == ["s0000", "s0001", "s0002"]
    spread = head(images, 4, spread=True)
    assert [s["__key__"] for s in spread] == ["s0000", "s0002", "s0005", "s0008"]
    assert spread[2]["jpg"] == jpeg(5) and spread[2]["cls"] == b"2"


def test_missing_source_is_an_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "empty").mkdir()
    assert main(["inspect", str(tmp_path / "empty")]) == 1
    assert "no .tar shards" in capsys.readouterr().err


def test_graph_dataset(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("torch_geometric", reason="graph statistics need torch_geometric")
    pytest.importorskip("shardflow.graph", reason="shardflow.graph (the pyg codec) is not available yet")
    import torch
    from torch_geometric.data import Data, HeteroData

    nodes = [3, 5, 8, 4]
    with ShardWriter(str(tmp_path / "g" / "train-%06d.tar"), max_count=3) as w:
        for i, n in enumerate(nodes):
            edge_index = torch.stack([torch.arange(n), (torch.arange(n) + 1) % n])  # a ring: n edges
            w.write({"__key__": f"g{i}", "pyg": Data(x=torch.zeros(n, 2), edge_index=edge_index), "cls": i % 2})
    info = run_json(capsys, str(tmp_path / "g"))
    g = info["graphs"]["pyg"]
    assert g["graphs"] == 4
    assert g["kinds"] == {"Data": 4}
    assert g["nodes"] == {"min": 3, "mean": 5.0, "max": 8, "total": 20}
    assert g["edges"] == {"min": 3, "mean": 5.0, "max": 8, "total": 20}
    assert g["attributes"] == {"edge_index": "int64 [2, 3]", "x": "float32 [3, 2]"}
    assert info["fields"]["pyg"] == {"codec": "pyg", "samples": 4}
    assert [c["samples"] for c in info["classes"]] == [2, 2]

    with ShardWriter(str(tmp_path / "h" / "train-%06d.tar"), max_count=2) as w:
        for i in range(3):
            h = HeteroData()
            h["author"].x = torch.zeros(1 + i, 3)
            h["paper"].x = torch.zeros(4, 3)
            h["author", "writes", "paper"].edge_index = torch.stack([torch.arange(1 + i), torch.arange(1 + i)])
            w.write({"__key__": f"h{i}", "pyg": h})
    assert main(["inspect", str(tmp_path / "h")]) == 0
    out = capsys.readouterr().out
    assert "HeteroData x3" in out
    assert "node type author: min 1 · mean 2.0 · max 3" in out
    assert "edge type (author, writes, paper): min 1 · mean 2.0 · max 3" in out
    info = summarize(tmp_path / "h", workers=1)
    h = info["graphs"]["pyg"]
    assert h["nodes"] == {"min": 5, "mean": 6.0, "max": 7, "total": 18}
    assert h["node_types"]["paper"] == {"min": 4, "mean": 4.0, "max": 4, "total": 12}
    assert list(h["edge_types"]) == ["author|writes|paper"]


def test_remote_dataset_without_manifest(capsys: pytest.CaptureFixture[str], request: pytest.FixtureRequest) -> None:
    import fsspec

    root = f"memory://inspect-{request.node.name}"
    with ShardWriter(f"{root}/train-%06d.tar", max_count=4, manifest=False) as w:
        for i in range(6):
            w.write({"__key__": f"r{i}", "jpg": jpeg(i), "cls": i % 2})
    fs = fsspec.filesystem("memory")
    try:
        info = run_json(capsys, f"{root}/train-{{000000..000001}}.tar", "--workers", "1")
        assert info["manifest"] is None
        assert info["shards"] == 2 and info["samples"] == 6
        assert [c["samples"] for c in info["classes"]] == [3, 3]
        assert info["bytes"] == sum(fs.size(p) for p in fs.glob(root.split("://", 1)[1] + "/*.tar"))
    finally:
        fs.rm(root.split("://", 1)[1], recursive=True)


def test_help_and_inspect_of_image_shards_do_not_import_torch(tmp_path: Path) -> None:
    import subprocess
    import sys

    folder = write_images(tmp_path)
    script = (
        "import sys, contextlib, io\n"
        "from shardflow.cli import main\n"
        "out = io.StringIO()\n"
        "with contextlib.redirect_stdout(out):\n"
        "    try:\n"
        "        main(['--help'])\n"
        "    except SystemExit:\n"
        "        pass\n"
        f"    code = main(['inspect', {str(folder)!r}])\n"
        "print(code, 'samples   11' in out.getvalue(), 'torch' in sys.modules)\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True)
    assert proc.stdout.split() == ["0", "True", "False"]


def test_a_path_with_nothing_to_read_exits_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A mistyped path is not an empty dataset, nor a shard that went missing: the error
    names the path as given, before anything is read, and the exit code is 1."""
    missing = tmp_path / "no-such-folder"
    assert main(["inspect", str(missing), "--json"]) == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert f"error: {missing}: no such folder or file (a dataset is a folder of shards" in err


def mixture_config(tmp_path, s3_prefix, s3_options, monkeypatch):
    """A local source of 10 samples and an S3 source (moto) of 7 whose storage options are its
    own: the config-level options point at a closed port, and the environment names no endpoint."""
    import yaml

    from shardflow import ShardWriter

    with ShardWriter(str(tmp_path / "local" / "train-%06d.tar"), max_count=4) as w:
        for i in range(10):
            w.write({"__key__": f"l{i:03d}", "cls": i % 3})
    with ShardWriter(s3_prefix + "remote/train-%06d.tar", max_count=4, storage_options=s3_options) as w:
        for i in range(7):
            w.write({"__key__": f"r{i:03d}", "cls": 5})
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    cfg = tmp_path / "mix.yaml"
    cfg.write_text(yaml.safe_dump({
        "source": [{"url": str(tmp_path / "local"), "weight": 1},
                   {"url": s3_prefix + "remote", "weight": 1, "storage_options": s3_options}],
        "samples_per_epoch": 10,
        "storage_options": {"client_kwargs": {"endpoint_url": "http://127.0.0.1:9"}},
    }))
    return cfg


def test_mixture_config_reads_each_source_with_its_own_options(moto_server, s3_prefix, s3_options, tmp_path,
                                                                monkeypatch, capsys):
    cfg = mixture_config(tmp_path, s3_prefix, s3_options, monkeypatch)
    assert main(["inspect", str(cfg), "--scan", "--workers", "1", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["errors"] == []
    assert [p["samples"] for p in info["sources"]] == [10, 7]
    assert info["samples"] == 17 and info["fields"]["cls"]["samples"] == 17
    assert {c["label"]: c["samples"] for c in info["classes"]} == {0: 4, 1: 3, 2: 3, 5: 7}
    assert main(["inspect", str(cfg), "--no-scan", "--keys", "12", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["first_keys"] == [f"l{i:03d}" for i in range(10)] + ["r000", "r001"]
