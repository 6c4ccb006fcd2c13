"""``shardflow show``: a PNG grid of real images (or graphs), one tile per sample."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from shardflow import ShardWriter
from shardflow.cli import main
from shardflow.show import BACKGROUND, CAPTION_HEIGHT, render_grid

N = 12


def color(i: int) -> tuple[int, int, int]:
    return ((37 * i + 20) % 200, (91 * i + 10) % 200, (53 * i + 60) % 200)  # never white


def png(i: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (20 + 3 * i, 30), color(i)).save(buf, "PNG")  # solid: resizing keeps the colour
    return buf.getvalue()


@pytest.fixture
def images(tmp_path: Path) -> Path:
    folder = tmp_path / "images"
    with ShardWriter(str(folder / "train-%06d.tar"), max_count=5, meta={"class_to_idx": {"a": 0, "b": 1}}) as w:
        for i in range(N):
            w.write({"__key__": f"k{i:03d}", "png": png(i), "cls": i % 2})
    return folder


def test_grid_size_tiles_and_labels(images: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "grid.png"
    assert main(["show", str(images), "--out", str(out), "--n", "6", "--cols", "4", "--tile", "64"]) == 0
    assert f"wrote {out} (256x192 px)" in capsys.readouterr().out
    grid = Image.open(out)
    grid.load()
    tile, cell_h = 64, 64 + CAPTION_HEIGHT
    assert grid.size == (4 * tile, 2 * cell_h)  # 6 samples in 4 columns: 2 rows
    arr = np.asarray(grid.convert("RGB")).astype(int)
    assert arr.std() > 10  # not blank
    # samples spread over the 12: 0, 2, 4, 6, 8, 10; each tile shows its own image, centred
    for slot, i in enumerate(range(0, N, 2)):
        x, y = (slot % 4) * tile, (slot // 4) * cell_h
        assert tuple(arr[y + tile // 2, x + tile // 2]) == color(i), f"tile {slot} does not show sample {i}"
        caption = arr[y + tile : y + cell_h, x : x + tile]
        assert (caption != BACKGROUND).any(), f"tile {slot} has no caption"
    for slot in (6, 7):  # no sample: untouched background
        x, y = (slot % 4) * tile, (slot // 4) * cell_h
        assert (arr[y : y + cell_h, x : x + tile] == BACKGROUND).all()


def test_first_n_and_fewer_samples_than_columns(images: Path) -> None:
    grid = render_grid(images, n=3, cols=4, tile=48, spread=False)
    assert grid.size == (3 * 48, 48 + CAPTION_HEIGHT)  # columns shrink to the samples shown
    arr = np.asarray(grid).astype(int)
    for slot in range(3):
        assert tuple(arr[24, slot * 48 + 24]) == color(slot)


def test_whole_small_dataset(images: Path) -> None:
    grid = render_grid(images, n=100, cols=5, tile=32)
    assert grid.size == (5 * 32, 3 * (32 + CAPTION_HEIGHT))  # all 12 samples, 3 rows


def test_unknown_field_is_an_error(images: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["show", str(images), "--out", str(tmp_path / "x.png"), "--field", "jpg"]) == 1
    err = capsys.readouterr().err
    assert "'jpg'" in err and "['cls', 'png']" in err
    assert not (tmp_path / "x.png").exists()


def test_graph_grid(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib", reason="drawing graphs needs matplotlib")
    pytest.importorskip("networkx", reason="drawing graphs needs networkx")
    pytest.importorskip("torch_geometric", reason="graph fields need torch_geometric")
    pytest.importorskip("shardflow.graph", reason="shardflow.graph (the pyg codec) is not available yet")
    import torch
    from torch_geometric.data import Data

    with ShardWriter(str(tmp_path / "g" / "train-%06d.tar"), max_count=4) as w:
        for i in range(5):
            n = 4 + i
            edge_index = torch.stack([torch.arange(n), (torch.arange(n) + 1) % n])
            w.write({"__key__": f"g{i}", "pyg": Data(edge_index=edge_index, num_nodes=n), "cls": i})
    out = tmp_path / "graphs.png"
    assert main(["show", str(tmp_path / "g"), "--out", str(out), "--n", "5", "--cols", "3", "--tile", "100"]) == 0
    grid = Image.open(out).convert("RGB")
    assert grid.size == (300, 200)
    arr = np.asarray(grid).astype(int)
    assert arr.std() > 5
    for slot in range(5):  # every tile has drawing (nodes, edges, title) on the white page
        x, y = (slot % 3) * 100, (slot // 3) * 100
        assert (arr[y : y + 100, x : x + 100] < 200).any(), f"graph tile {slot} is empty"
    assert (arr[100:200, 200:300] == 255).all()  # the sixth cell holds nothing
