"""``shardflow bench``: real shards streamed through ``shardflow.loader`` and timed."""

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
from shardflow.format.manifest import MANIFEST_NAME

N = 24


def jpeg(i: int) -> bytes:
    rng = np.random.default_rng(i)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)).save(buf, "JPEG")
    return buf.getvalue()


@pytest.fixture
def images(tmp_path: Path) -> Path:
    folder = tmp_path / "images"
    with ShardWriter(str(folder / "train-%06d.tar"), max_count=8) as w:
        for i in range(N):
            w.write({"__key__": f"k{i:03d}", "jpg": jpeg(i), "cls": i % 4})
    return folder


def tar_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.glob("*.tar"))


def bench_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    assert main(["bench", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_one_epoch_in_process(images: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = bench_json(capsys, str(images), "--workers", "0", "--batch-size", "5", "--decode", "torch")
    assert out["samples"] == N
    assert out["batches"] == 5  # 5, 5, 5, 5, 4
    assert out["epoch_complete"] is True
    assert out["samples_per_s"] > 0 and out["mib_per_s"] > 0
    assert out["first_batch_s"] > 0
    assert out["bytes"] == tar_bytes(images) and out["bytes_from"] == "manifest shard sizes"
    assert out["config"]["decode"] == "torch" and out["config"]["batch_size"] == 5


def test_text_summary_with_workers_and_shuffle(images: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", str(images), "--workers", "2", "--batch-size", "8", "--shuffle", "16"]) == 0
    out = capsys.readouterr().out
    assert "2 workers · shuffle 16" in out
    assert f"samples      {N} in 3 batches" in out
    rate = float(out.split("throughput")[1].split("samples/s")[0].replace(",", ""))
    assert rate > 0
    assert "MiB/s" in out and "first batch" in out


def test_plot_writes_png(images: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib", reason="--plot needs matplotlib")
    plot = tmp_path / "throughput.png"
    out = bench_json(capsys, str(images), "--workers", "0", "--batch-size", "4", "--plot", str(plot))
    assert out["plot"] == str(plot)
    img = Image.open(plot)
    assert img.format == "PNG" and img.size == (800, 700)  # throughput above, the stage breakdown below
    pixels = np.asarray(img.convert("L"))
    assert pixels[:350].std() > 5 and pixels[350:].std() > 5
    assert list(out["stages"]) == ["fetch", "read", "decode", "transform", "collate", "handover"]
    assert sum(out["stages"].values()) > 0 and out["verdict"].startswith("the loop waited for data")


def test_seconds_stops_early(images: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = bench_json(capsys, str(images), "--workers", "0", "--batch-size", "4", "--seconds", "0")
    assert out["samples"] == 4 and out["batches"] == 1
    assert out["epoch_complete"] is False
    assert out["bytes"] == round(4 * tar_bytes(images) / N)  # estimated from the manifest


def test_without_manifest_bytes_come_from_the_files(images: Path, capsys: pytest.CaptureFixture[str]) -> None:
    os.remove(images / MANIFEST_NAME)
    out = bench_json(capsys, str(images), "--workers", "0", "--batch-size", "6", "--decode", "none")
    assert out["samples"] == N
    assert out["bytes"] == tar_bytes(images) and out["bytes_from"] == "shard file sizes"


def test_config_file_and_flag_overrides(images: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "pipeline.yaml"
    cfg.write_text(
        f"source: {images}\nshuffle: 8\nseed: 3\ndecode: numpy\nfields: [jpg, cls]\nbatch_size: 6\nnum_workers: 0\n"
    )
    out = bench_json(capsys, "--config", str(cfg))
    assert out["samples"] == N and out["batches"] == 4
    assert out["config"]["shuffle"] == 8 and out["config"]["seed"] == 3 and out["config"]["fields"] == ["jpg", "cls"]
    out = bench_json(capsys, "--config", str(cfg), "--batch-size", "12", "--decode", "none")
    assert out["batches"] == 2
    assert out["config"]["batch_size"] == 12 and out["config"]["decode"] is None and out["config"]["seed"] == 3


def test_needs_a_source(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench"]) == 1
    assert "give a dataset URL or --config" in capsys.readouterr().err


def test_bad_config_key_is_reported(images: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(f"source: {images}\nbatchsize: 4\n")
    assert main(["bench", "--config", str(cfg)]) == 1
    err = capsys.readouterr().err
    assert "unknown config key(s) 'batchsize' (did you mean 'batch_size'?)" in err


def test_the_plot_shows_the_rate_that_is_printed(images: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    import shardflow.cli.bench as bench

    drawn = {}

    def fake_plot(timeline, path, *, title="", mean=None, **_):
        drawn.update(timeline=timeline, mean=mean)

    monkeypatch.setattr(bench, "plot_throughput", fake_plot)
    out = bench_json(capsys, str(images), "--workers", "0", "--batch-size", "4", "--plot", str(tmp_path / "p.png"))
    assert drawn["mean"] == out["samples_per_s"]
    # "seconds" is printed rounded to 0.1 ms and a pass over 8 tiny images can take a few ms:
    # the printed rate must lie within what that rounding allows (plus its own 0.01 rounding)
    low, high = out["samples"] / (out["seconds"] + 5e-5), out["samples"] / max(out["seconds"] - 5e-5, 1e-9)
    assert low - 0.005 <= out["samples_per_s"] <= high + 0.005
    # the pass ends with its last batch: the rate is not diluted by the workers' shut-down
    assert out["seconds"] + 5e-5 >= drawn["timeline"][-1][0]  # "seconds" is rounded to 0.1 ms


def mixed_folder(root: Path) -> None:
    """Two classes of JPEG and PNG images of different sizes, and one corrupt image."""
    rng = np.random.default_rng(7)
    for c in ("a", "b"):
        (root / c).mkdir(parents=True)
        for i in range(6):
            fmt, ext = ("JPEG", "jpg") if i % 2 else ("PNG", "png")
            buf = io.BytesIO()
            Image.fromarray(rng.integers(0, 256, (20 + 3 * i, 30 + 5 * i, 3), dtype=np.uint8)).save(buf, fmt)
            (root / c / f"{i}.{ext}").write_bytes(buf.getvalue())
    (root / "a" / "broken.jpg").write_bytes(jpeg(0)[:60])


def test_bench_works_by_default_on_a_converted_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    mixed_folder(tmp_path / "src")
    assert main(["convert", "imagefolder", str(tmp_path / "src"), str(tmp_path / "shards"), "--workers", "1"]) == 0
    capsys.readouterr()
    assert main(["bench", str(tmp_path / "shards"), "--workers", "2", "--batch-size", "4"]) == 0
    out = capsys.readouterr().out
    assert "resize       every image to 224x224 (bench default" in out
    rate = next(line for line in out.splitlines() if line.startswith("throughput"))
    assert float(rate.split()[1].replace(",", "")) > 0
    assert "samples      12 in 3 batches" in out
    # --resize none keeps the sizes: a one-line error that names the way out, exit 1
    assert main(["bench", str(tmp_path / "shards"), "--workers", "2", "--resize", "none"]) == 1
    err = capsys.readouterr().err
    assert "cannot batch field 'image'" in err and "--resize H,W" in err and "Traceback" not in err


def test_bench_skips_and_counts_corrupt_samples(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "raw"
    with ShardWriter(str(folder / "train-%06d.tar"), max_count=5) as w:
        for i in range(12):
            w.write({"__key__": f"k{i:03d}", "jpg": jpeg(i) if i != 4 else b"\xff\xd8garbage", "cls": i % 2})
    out = bench_json(capsys, str(folder), "--workers", "2", "--batch-size", "4")
    assert out["samples"] == 11 and out["skipped"] == 1 and out["skipped_by_reason"] == {"decode": 1}
    assert out["config"]["on_error"] == "skip" and out["samples_per_s"] > 0
    assert main(["bench", str(folder), "--workers", "2", "--on-error", "raise"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "sample 'k004': cannot decode field 'jpg'" in err[0]
    assert err[0].endswith("(in DataLoader worker process 0)") or err[0].endswith("(in DataLoader worker process 1)")
