"""The datasets users have: a folder mixing JPEG and PNG files of different sizes, end to end.

The folder is converted with the CLI, then read by ``shardflow bench``, drawn by
``shardflow show``, loaded by every image config in ``configs/`` (``bucket.yaml`` from moto's
S3 server, with its credentials from the environment as the file says) and by the README's
image snippet, run as written with a stand-in for torchvision's ``v2`` module. The graph
config runs on shards that ``shardflow convert pyg`` writes.
"""

from __future__ import annotations

import json
import logging
import re
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import shardflow
from shardflow.cli import main
from shardflow.config import load_config, loader_from_config
from shardflow.errors import SampleError
from shardflow.transforms import Resize

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"

# class -> [(file name, height, width)]: JPEG, .jpeg and PNG files, five sizes, a class with both
TREE = {
    "coins": [("a.jpg", 40, 30), ("b.jpg", 25, 50), ("c.jpeg", 33, 33)],
    "digits": [("0.png", 8, 8), ("1.png", 16, 12), ("2.png", 20, 20)],
    "mixed": [("x.jpg", 30, 40), ("y.png", 12, 18)],
}
N = sum(len(v) for v in TREE.values())


def write_tree(root: Path) -> dict[str, tuple[int, int]]:
    """Write the image folder; returns key -> (height, width)."""
    sizes = {}
    for c, (cls, files) in enumerate(TREE.items()):
        (root / cls).mkdir(parents=True)
        for j, (name, h, w) in enumerate(files):
            arr = np.random.default_rng(10 * c + j).integers(0, 256, (h, w, 3), dtype=np.uint8)
            fmt = "PNG" if name.endswith(".png") else "JPEG"
            Image.fromarray(arr).save(root / cls / name, format=fmt)
            sizes[f"{cls}/{name.split('.')[0]}"] = (h, w)
    return sizes


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> tuple[Path, dict[str, tuple[int, int]]]:
    base = tmp_path_factory.mktemp("mixed")
    sizes = write_tree(base / "src")
    rc = main(["convert", "imagefolder", str(base / "src"), str(base / "shards"), "--max-count", "3"])
    assert rc == 0
    return base / "shards", sizes


def test_the_converter_records_the_image_fields(converted):
    shards, _ = converted
    m = shardflow.ShardDataset(shards).manifest
    assert m.meta["image_fields"] == {"jpeg": 1, "jpg": 3, "png": 4}
    assert sorted(m.fields) == ["cls", "jpeg", "jpg", "png"]
    samples = list(shardflow.ShardDataset(shards, decode="torch", fields=("image", "cls")))
    assert len(samples) == N and all(s["image"].dtype == torch.uint8 for s in samples)


def test_bench_reads_the_mixed_folder(converted, capsys):
    shards, _ = converted
    # without --fields the image fields are read as one ("image"); sizes differ: the bench
    # resizes them by default (and says so); --resize none gives the error, which names --resize
    assert main(["bench", str(shards), "--workers", "0", "--batch-size", "4", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["resize"] == [224, 224] and out["resize_is_bench_default"] and out["samples"] == N
    assert main(["bench", str(shards), "--workers", "0", "--batch-size", "4", "--resize", "none"]) == 1
    err = capsys.readouterr().err
    assert "cannot batch field 'image'" in err and "--resize H,W" in err
    assert main(["bench", str(shards), "--workers", "2", "--batch-size", "4", "--resize", "24", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["samples"] == N and out["batches"] == 2 and out["epoch_complete"]
    assert out["config"]["fields"] == ["image", "cls"] and out["config"]["resize"] == [24, 24]
    assert out["skipped"] == 0 and out["mib_per_s"] > 0


def test_show_draws_every_image_of_the_mixed_folder(converted, tmp_path, capsys):
    shards, _ = converted
    out = tmp_path / "grid.png"
    assert main(["show", str(shards), "--out", str(out), "--n", str(N), "--cols", "4", "--tile", "64"]) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    grid = np.asarray(Image.open(out).convert("RGB"))
    cell_h = grid.shape[0] // 2  # 8 samples in 2 rows of 4
    for i in range(N):
        y, x = (i // 4) * cell_h, (i % 4) * 64
        tile = grid[y + 4 : y + 60, x + 4 : x + 60]
        # random pixels, not the white background nor a red "no field" notice
        assert tile.std() > 20, f"tile {i} is empty"


def test_images_config_runs_on_the_converted_folder(converted):
    shards, sizes = converted
    cfg = load_config(CONFIGS / "images.yaml").replace(source=str(shards), num_workers=2, batch_size=4)
    batches = list(loader_from_config(cfg))
    assert [b["image"].shape for b in batches] == [torch.Size([4, 3, 224, 224])] * 2
    assert sorted(k for b in batches for k in b["__key__"]) == sorted(sizes)
    assert sorted(int(c) for b in batches for c in b["cls"]) == [0, 0, 0, 1, 1, 1, 2, 2]


def test_bucket_config_runs_from_s3_and_reports_skipped_totals(moto_server, s3_prefix, tmp_path,
                                                              monkeypatch, caplog):
    """bucket.yaml as written: credentials and endpoint from the environment, shards
    converted straight into the bucket (nested --storage-option); the converter leaves the
    corrupt image out and names it (the reader's on_error=warn has nothing left to skip)."""
    src = tmp_path / "src"
    write_tree(src)
    (src / "digits" / "3.png").write_bytes(b"\x89PNG\r\n\x1a\n broken")  # one bad image
    dst = s3_prefix + "datasets/images"
    rc = main(["convert", "imagefolder", str(src), dst, "--max-count", "3",
               "--storage-option", "key=testing", "--storage-option", "secret=testing",
               "--storage-option", f"client_kwargs.endpoint_url={moto_server.endpoint_url}",
               "--storage-option", '{"client_kwargs": {"region_name": "us-east-1"}}'])
    assert rc == 0
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("S3_ENDPOINT_URL", moto_server.endpoint_url)
    cfg = load_config(CONFIGS / "bucket.yaml")
    assert cfg.on_error == "warn" and cfg.fields == ("image", "cls")
    cfg = cfg.replace(source=dst + "/shardflow.json", num_workers=0, batch_size=4,
                      cache_dir=str(tmp_path / "cache"))
    loader = loader_from_config(cfg)
    with caplog.at_level(logging.WARNING, logger="shardflow"):
        keys = [k for b in loader for k in b["__key__"]]
    assert len(keys) == N and "digits/3" not in keys
    assert loader.dataset.stats["skipped"] == 0
    skipped = loader.dataset.manifest.meta["skipped"]
    assert [e["path"] for e in skipped] == ["digits/3.png"] and skipped[0]["reason"].startswith("corrupt image")


def test_warn_logs_the_first_bad_samples_then_a_total(tmp_path, caplog):
    with shardflow.ShardWriter(str(tmp_path / "s-%06d.tar"), max_count=100) as w:
        for i in range(60):
            w.write({"__key__": f"{i:03d}", "cls": i})
    # a transform raising for odd classes: 30 bad samples
    ds = shardflow.ShardDataset(tmp_path, on_error="warn",
                                transform={"cls": lambda c: c if c % 2 == 0 else 1 / 0})
    with caplog.at_level(logging.WARNING, logger="shardflow"):
        assert [s["cls"] for s in ds] == list(range(0, 60, 2))
    lines = [r.getMessage() for r in caplog.records]
    assert sum(m.startswith("skipped 1 sample(s)") for m in lines) == 10
    assert sum("further bad samples are counted, not logged" in m for m in lines) == 1
    assert lines[-1] == "on_error='warn': skipped 30 of 60 samples in this pass (transform 30)"
    assert len(lines) == 12


class RandomResizedCrop:
    """Stand-in for ``torchvision.transforms.v2.RandomResizedCrop`` (torchvision is not a
    dependency): the same call signature, a plain resize of a uint8 (3, H, W) tensor."""

    def __init__(self, size: int, antialias: bool = True) -> None:
        self.resize = Resize(size)

    def __call__(self, img: torch.Tensor) -> torch.Tensor:
        assert isinstance(img, torch.Tensor) and img.dtype == torch.uint8 and img.shape[0] == 3
        return self.resize(img)


def readme_image_snippet() -> str:
    text = (ROOT / "README.md").read_text()
    section = text[text.index("### Images"):text.index("### Graphs")]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_readme_image_snippet_runs_on_the_mixed_folder(converted, monkeypatch):
    shards, sizes = converted
    v2 = types.ModuleType("torchvision.transforms.v2")
    v2.RandomResizedCrop = RandomResizedCrop
    transforms = types.ModuleType("torchvision.transforms")
    transforms.v2 = v2
    tv = types.ModuleType("torchvision")
    tv.transforms = transforms
    for name, mod in {"torchvision": tv, "torchvision.transforms": transforms,
                      "torchvision.transforms.v2": v2}.items():
        monkeypatch.setitem(sys.modules, name, mod)
    code = readme_image_snippet()
    # the snippet as written, on this folder, at this machine's scale
    for old, new in [('"~/shards/imagenet-train"', repr(str(shards))), ("range(90)", "range(2)"),
                     ("batch_size=256", "batch_size=3"), ("num_workers=8", "num_workers=2"),
                     ("        ...\n", "        seen.append(batch)\n")]:
        assert old in code, old
        code = code.replace(old, new)
    seen: list = []
    exec(compile(code, "README.md", "exec"), {"seen": seen})
    assert len(seen) == 4  # 2 epochs of 8 samples in batches of 3, drop_last: 2 each
    for batch in seen:
        assert batch["image"].shape == (3, 3, 224, 224) and batch["image"].dtype == torch.uint8
        assert batch["cls"].dtype == torch.int64 and set(batch["__key__"]) <= set(sizes)
    assert [k for b in seen[:2] for k in b["__key__"]] != [k for b in seen[2:] for k in b["__key__"]]


def test_mixed_sizes_without_a_resize_are_an_error_that_says_how(converted):
    shards, _ = converted
    ds = shardflow.ShardDataset(shards, decode="torch", fields=("image", "cls"))
    with pytest.raises(SampleError, match=r"cannot batch field 'image'.*transform=\{'image': "
                                          r"torchvision\.transforms\.v2\.Resize\(\(224, 224\)\)\}"):
        list(shardflow.loader(ds, batch_size=8))


def test_graphs_config_runs_on_pyg_converter_shards(tmp_path):
    pytest.importorskip("torch_geometric")
    dst = tmp_path / "graphs"
    assert main(["convert", "pyg", "tests.test_convert_pyg:graph_list", str(dst),
                 "--kwargs", json.dumps({"num_graphs": 12}), "--max-count", "5"]) == 0
    cfg = load_config(CONFIGS / "graphs.yaml").replace(source=str(dst), num_workers=0, batch_size=5)
    batches = list(loader_from_config(cfg))
    assert [b["graph.pyg"].num_graphs for b in batches] == [5, 5, 2]
