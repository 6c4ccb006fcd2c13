"""Issue 32, what a newcomer and a hostile name still met: names printed raw to the terminal,
look-alike class folders, Hugging Face configs merged without a word, parquet images by path,
torchdata's StatefulDataLoader, and the newcomer's stumbles (a misspelt bucket, the "jpg" field
on ImageNet, graphs without torch_geometric, logging inside the progress bar, SIGTERM).

Each case ran on the code before its fix and failed there (see each test's docstring).
"""

from __future__ import annotations

import os
import subprocess
import sys
import unicodedata
from pathlib import Path

import pytest

import shardflow
from shardflow.convert.engine.engine import ConvertOptions
from shardflow.errors import ConversionError
from tests.helpers import tiny_image

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[1]


def cli(*argv: str, **kwargs) -> subprocess.CompletedProcess:
    """``shardflow ARGV`` in a fresh interpreter (its own logging setup, as a user runs it)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "shardflow.cli", *argv], capture_output=True, text=True,
                          timeout=100, env=env, **kwargs)


# ------------------------------------------------------------------ terminal and names


def test_convert_prints_hostile_file_names_escaped(tmp_path: Path) -> None:
    """A file name's escape sequence reached the terminal raw and a newline in a name printed
    a line of the attacker's (here a fake summary line)."""
    cls = tmp_path / "src" / "dog"
    cls.mkdir(parents=True)
    (cls / "good.png").write_bytes(tiny_image("PNG", 0))
    (cls / "\x1b[2J\x1b]0;pwned\x07bad.png").write_bytes(b"not a png")
    (cls / "x.png\n1000000 samples, 1 class, 1 shard in 0.1 s -> elsewhere").write_bytes(b"not a png")
    (cls / "notes\x1b[31m.txt").write_bytes(b"not an image")
    proc = cli("convert", "imagefolder", str(tmp_path / "src"), str(tmp_path / "out"), "--workers", "1")
    assert proc.returncode == 0, proc.stderr
    for text in (proc.stdout, proc.stderr):
        assert "\x1b" not in text and "\x07" not in text
        assert not [line for line in text.splitlines() if line.startswith("1000000 samples")]
    assert proc.stdout.splitlines()[0].startswith("1 sample, 1 class, 1 shard")
    assert "dog/\\x1b[2J\\x1b]0;pwned\\x07bad.png" in proc.stdout  # named, escaped as repr() does
    assert "dog/x.png\\n1000000 samples" in proc.stdout
    assert "notes\\x1b[31m.txt" in proc.stdout + proc.stderr


def test_class_folders_that_differ_only_in_normalization_are_refused(tmp_path: Path) -> None:
    """'café' written NFC and NFD were two classes (0 and 1) printed identically."""
    from shardflow.convert.images.imagefolder import convert_imagefolder

    nfc, nfd = unicodedata.normalize("NFC", "café"), unicodedata.normalize("NFD", "café")
    for i, name in enumerate((nfc, nfd)):
        (tmp_path / "src" / name).mkdir(parents=True)
        (tmp_path / "src" / name / "a.png").write_bytes(tiny_image("PNG", i))
    if len(os.listdir(tmp_path / "src")) != 2:
        pytest.skip("this file system normalizes names: the two folders are one")
    with pytest.raises(ConversionError) as info:
        convert_imagefolder(str(tmp_path / "src"), str(tmp_path / "out"), options=ConvertOptions(workers=1))
    assert "'caf\\xe9'" in str(info.value) and "'cafe\\u0301'" in str(info.value)
    assert "Unicode normalization" in str(info.value)
    assert not (tmp_path / "out" / "shardflow.json").exists()


def _run_on_a_terminal(argv: list[str]) -> tuple[int, str]:
    """``shardflow ARGV`` with standard error on a pseudo-terminal (so a progress bar is drawn);
    returns its exit status and what the terminal received."""
    import pty

    import fcntl
    import struct
    import termios

    main_fd, sub_fd = pty.openpty()
    fcntl.ioctl(sub_fd, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # 24 rows, 100 columns
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "100"}
    proc = subprocess.Popen([sys.executable, "-m", "shardflow.cli", *argv], stdout=subprocess.DEVNULL,
                            stderr=sub_fd, env=env)
    os.close(sub_fd)
    chunks = []
    while True:
        try:
            data = os.read(main_fd, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(main_fd)
    return proc.wait(timeout=100), b"".join(chunks).decode("utf-8", "replace")


def test_warnings_print_above_the_progress_bar_not_inside_it(tmp_path: Path) -> None:
    """A warning was written after the bar's text on the bar's own line
    ('imagefolder:  50%|...| 1/2 [..]WARNING ...')."""
    cls = tmp_path / "src" / "dog"
    cls.mkdir(parents=True)
    (cls / "a.png").write_bytes(tiny_image("PNG", 0))
    (cls / "b.png").write_bytes(b"not a png")
    code, text = _run_on_a_terminal(["convert", "imagefolder", str(tmp_path / "src"), str(tmp_path / "out"),
                                     "--workers", "1"])
    assert code == 0, text
    assert "imagefolder" in text  # a bar was drawn
    warned = [line for line in text.replace("\r\n", "\n").split("\n") if "WARNING" in line]
    assert warned, text
    for line in warned:  # what the terminal shows of the line: the text after its last carriage return
        assert line.split("\r")[-1].lstrip(" ").startswith("WARNING"), repr(line)


def test_sigterm_ends_a_conversion_with_a_word_and_a_rerun_resumes(flaky_http_server, tmp_path: Path) -> None:
    """SIGTERM ended `convert` with no output at all (status -15); now it says it was
    interrupted and that a re-run resumes, which the re-run does."""
    import signal

    from tests.servers import wait_until

    srv = flaky_http_server
    srv.put("lines.txt", b"".join(b"line %06d\n" % i for i in range(400_000)))  # 4.4 MB
    # the first 4 MiB block (381,300 lines) comes whole, the rest never until the server stops
    srv.faults.stall_after = 4_300_000
    dst = tmp_path / "out"
    argv = ["convert", "lines", srv.url + "/lines.txt", str(dst), "--workers", "1", "--max-count", "50000"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "shardflow.cli", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert wait_until(lambda: len(list(dst.glob("train-*.tar"))) >= 3)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 143, (proc.returncode, err)
    assert "shardflow convert: interrupted (SIGTERM)" in err
    assert "re-running the same command resumes" in err
    srv.faults.stall_after = None
    again = cli(*argv)
    assert again.returncode == 0, again.stderr
    assert "400000 samples from 400000 lines" in again.stdout
    assert "(kept " in again.stdout  # the shards finished before SIGTERM were kept
    lines = [s["txt"] for s in shardflow.ShardDataset(str(dst), decode=None)]
    assert lines == [b"line %06d" % i for i in range(400_000)]


# ------------------------------------------------------------------ formats and frameworks


def test_stateful_dataloader_with_workers_warns_at_save_and_refuses_the_resume(tmp_path: Path) -> None:
    """torchdata's StatefulDataLoader with 2 workers resumed into 200 samples of a 160-sample
    epoch without a word (docs/frameworks.md said so, nothing at run time did)."""
    pytest.importorskip("torchdata.stateful_dataloader")
    from tests.helpers import make_shards

    root = make_shards(tmp_path, [40, 40, 40, 40])
    script = f"""
import logging
logging.basicConfig(level=logging.WARNING)
import shardflow
from torchdata.stateful_dataloader import StatefulDataLoader

def make():
    return StatefulDataLoader(shardflow.ShardDataset({str(root)!r}, decode=None), batch_size=8, num_workers=2)

dl = make()
it = iter(dl)
head = [next(it) for _ in range(5)]
state = dl.state_dict()
del it
again = make()
again.load_state_dict(state)
try:
    n = sum(len(b["__key__"]) for b in again)
except shardflow.errors.StateError as e:
    print("REFUSED", str(e).splitlines()[-1][-40:])
else:
    print("RESUMED", 40 + n)
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=100,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.stdout.startswith("REFUSED"), (proc.stdout, proc.stderr[-3000:])
    assert "ShardDataset.state_dict() was called in DataLoader worker" in proc.stderr
    assert proc.stderr.count("ShardDataset.state_dict() was called") == 2  # once per worker process


def _hf_repo(root: Path, configs: dict[str, dict[str, int]]) -> None:
    """A Hugging Face repo folder: ``root/<config>/<split>-00000-of-00001.parquet`` of ``n`` rows each."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    for config, splits in configs.items():
        (root / config).mkdir(parents=True)
        for split, n in splits.items():
            table = pa.table({"text": [f"{config}/{split} {i}" for i in range(n)]})
            pq.write_table(table, root / config / f"{split}-00000-of-00001.parquet")


def test_hugging_face_configs_convert_one_at_a_time_unless_merged(tmp_path: Path) -> None:
    """A repo whose configs data/ and extra/ each hold a train split was merged into one
    dataset of 7 rows without a word."""
    from shardflow.convert.records.parquet import convert_parquet

    _hf_repo(tmp_path / "repo", {"data": {"train": 4}, "extra": {"train": 3}})
    with pytest.raises(ConversionError) as info:
        convert_parquet(str(tmp_path / "repo"), str(tmp_path / "out"), options=ConvertOptions(workers=1))
    text = str(info.value)
    assert "2 Hugging Face configs" in text and "data/ (train), extra/ (train)" in text
    assert "--merge-configs" in text and str(tmp_path / "repo" / "data") in text
    with pytest.raises(ConversionError, match="2 Hugging Face configs"):  # a glob over both is the same merge
        convert_parquet(str(tmp_path / "repo" / "**" / "train-*.parquet"), str(tmp_path / "out"))
    one = convert_parquet(str(tmp_path / "repo" / "data"), str(tmp_path / "one"), options=ConvertOptions(workers=1))
    got = sorted(shardflow.ShardDataset(str(tmp_path / "one")), key=lambda s: s["__key__"])  # (stored shuffled)
    assert [s["txt"] for s in got] == [f"data/train {i}" for i in range(4)]
    assert one.num_samples == 4
    both = convert_parquet(str(tmp_path / "repo"), str(tmp_path / "both"), merge_configs=True,
                           options=ConvertOptions(workers=1))
    assert both.num_samples == 7


def test_the_several_splits_refusal_suggests_a_glob_within_one_config(tmp_path: Path) -> None:
    """The refusal of a repo of several splits suggested 'repo/**/test-*.parquet', which merges
    the configs' test splits."""
    from shardflow.convert.records.parquet import convert_parquet

    _hf_repo(tmp_path / "repo", {"data": {"train": 4, "test": 2}})
    with pytest.raises(ConversionError) as info:
        convert_parquet(str(tmp_path / "repo"), str(tmp_path / "out"), options=ConvertOptions(workers=1))
    glob = str(tmp_path / "repo" / "data" / "test-*.parquet")
    assert f"give a glob such as {glob}" in str(info.value) and "**" not in str(info.value)
    assert convert_parquet(glob, str(tmp_path / "out"), options=ConvertOptions(workers=1)).num_samples == 2


def _images_by_path(tmp_path: Path, paths: list[str]) -> Path:
    """A parquet file as ``datasets``' to_parquet() writes local images: {bytes: null, path}."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    image = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    table = pa.table({"image": pa.array([{"bytes": None, "path": p} for p in paths], image),
                      "label": list(range(len(paths)))})
    (tmp_path / "ds").mkdir(exist_ok=True)
    pq.write_table(table, tmp_path / "ds" / "train.parquet")
    return tmp_path / "ds" / "train.parquet"


def test_parquet_images_by_path_are_packed_from_the_named_folder(tmp_path: Path) -> None:
    """Images referenced by path were refused ('only images stored inside the file') and could
    not be packed at all."""
    from shardflow.cli import main

    images = tmp_path / "ds" / "images"
    images.mkdir(parents=True)
    want = [tiny_image("PNG", 0), tiny_image("JPEG", 1)]
    (images / "a.png").write_bytes(want[0])
    (images / "b.jpg").write_bytes(want[1])
    src = _images_by_path(tmp_path, ["images/a.png", str(images / "b.jpg")])  # relative, absolute
    assert main(["convert", "parquet", str(src), str(tmp_path / "out"), "--images-root", str(tmp_path / "ds"),
                 "--workers", "1"]) == 0  # fmt: skip
    got = sorted(shardflow.ShardDataset(str(tmp_path / "out"), decode=None), key=lambda s: s["__key__"])
    assert [(s.get("png") or s.get("jpg"), s["cls"]) for s in got] == [(want[0], b"0"), (want[1], b"1")]
    with pytest.raises(ConversionError, match="--images-root DIR"):  # without the option: the option is named
        from shardflow.convert.records.parquet import convert_parquet

        convert_parquet(str(src), str(tmp_path / "out2"), options=ConvertOptions(workers=1))


@pytest.mark.parametrize("path", ["../secret.png", "/etc/passwd", "images/link.png"])
def test_a_parquet_image_path_out_of_the_images_root_is_refused(tmp_path: Path, path: str) -> None:
    from shardflow.convert.records.imagepaths import ImagePathError
    from shardflow.convert.records.parquet import convert_parquet

    (tmp_path / "secret.png").write_bytes(tiny_image("PNG", 7))
    (tmp_path / "ds" / "images").mkdir(parents=True)
    (tmp_path / "ds" / "images" / "link.png").symlink_to(tmp_path / "secret.png")
    src = _images_by_path(tmp_path, [path])
    with pytest.raises(ImagePathError) as info:
        convert_parquet(str(src), str(tmp_path / "out"), images_root=str(tmp_path / "ds"),
                        options=ConvertOptions(workers=2))  # raised in a worker process
    assert repr(path) in str(info.value) and "outside images_root" in str(info.value)
    assert "key 000000000" in str(info.value)


# ------------------------------------------------------------------ a newcomer's stumbles


def test_a_misspelt_s3_prefix_or_bucket_is_a_file_not_found_at_build(s3_prefix, s3_options, tmp_path) -> None:
    """A typo in an s3:// URL built a one-"shard" dataset: len() then advised `shardflow index`
    and inspect printed 0 samples."""
    import fsspec

    from tests.helpers import make_shards

    folder = make_shards(tmp_path, [5, 5])
    fs = fsspec.filesystem("s3", **s3_options)
    fs.put(str(folder) + "/", s3_prefix + "data/", recursive=True)
    io = shardflow.IOOptions(storage_options=s3_options)
    assert len(shardflow.ShardDataset(s3_prefix + "data/", io=io)) == 10  # the real one
    bucket = s3_prefix.split("/")[2]
    for typo in (s3_prefix + "dta/", s3_prefix + "dta", s3_prefix.replace(bucket, bucket + "-typo") + "data/"):
        with pytest.raises(FileNotFoundError, match="nothing at this URL") as info:
            shardflow.ShardDataset(typo, io=io)
        assert typo.rstrip("/") in str(info.value)


def test_asking_for_jpg_on_imagenet_suggests_the_image_alias(tmp_path: Path) -> None:
    """ImageNet's .JPEG files (and its few PNGs) become 'jpeg' / 'png' fields; docs/remote.md's
    fields=("jpg", "cls") failed on them without a word about the 'image' alias."""
    from shardflow.convert.images.imagefolder import convert_imagefolder
    from shardflow.errors import MissingFieldError

    (tmp_path / "src" / "n01440764").mkdir(parents=True)
    (tmp_path / "src" / "n01440764" / "a.JPEG").write_bytes(tiny_image("JPEG", 0))
    (tmp_path / "src" / "n01440764" / "b.png").write_bytes(tiny_image("PNG", 1))
    convert_imagefolder(str(tmp_path / "src"), str(tmp_path / "out"), options=ConvertOptions(workers=1))
    with pytest.raises(MissingFieldError) as info:  # at build: the manifest lists the fields
        shardflow.ShardDataset(str(tmp_path / "out"), fields=("jpg", "cls"))
    assert "its images are stored as 'jpeg', 'png': ask for 'image'" in str(info.value)
    shard = next((tmp_path / "out").glob("*.tar"))
    with pytest.raises(MissingFieldError) as info:  # a shard read without its manifest: at the sample
        list(shardflow.ShardDataset(str(shard), fields=("jpg", "cls")))
    assert "ask for 'image'" in str(info.value)
    got = list(shardflow.ShardDataset(str(tmp_path / "out"), fields=("image", "cls"), decode="numpy"))
    assert sorted(s["image"].shape for s in got) == [(3, 4, 3), (3, 4, 3)]


def test_inspect_of_graphs_without_torch_geometric_names_the_extra(tmp_path: Path) -> None:
    """Without torch_geometric, inspect printed 0 graphs, nodes 0 and edges 0, and advised
    `shardflow verify`, with no word of the missing package."""
    pytest.importorskip("torch_geometric")
    import torch
    from torch_geometric.data import Data

    with shardflow.ShardWriter(str(tmp_path / "g" / "train-%06d.tar"), max_count=10) as w:
        for i in range(4):
            w.write({"__key__": f"g{i}", "pyg": Data(x=torch.zeros(3, 2), edge_index=torch.tensor([[0, 1], [1, 2]])),
                     "cls": i % 2})
    script = ("import sys\nsys.modules['torch_geometric'] = None  # as if it were not installed\n"
              "sys.modules['torch_geometric.data'] = None\n"
              f"from shardflow.cli import main\nsys.exit(main(['inspect', {str(tmp_path / 'g')!r}]))\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=100,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr
    assert "4 graphs not decoded: decoding 'pyg' fields needs the optional package 'torch_geometric'" in proc.stdout
    assert "pip install 'shardflow[graphs]'" in proc.stdout
    assert "nodes per graph  min 0" not in proc.stdout and "shardflow verify" not in proc.stdout


def test_a_quiet_test_run_names_the_missing_azure_emulator_and_its_install() -> None:
    """The README's `python -m pytest -q` showed the Azure tests as 's' only, with no word of
    Azurite or how to get it."""
    from tests import emulators

    pytest.importorskip("adlfs")
    if emulators._azurite_command() is not None:
        pytest.skip("Azurite is installed here: its tests run")
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_clouds.py",
                           "-k", "write_then_read and az"], cwd=ROOT, capture_output=True, text=True, timeout=100,
                          env={**env, "PYTHONPATH": str(ROOT)})  # fmt: skip
    assert "1 skipped" in proc.stdout, proc.stdout[-2000:]
    assert ("note: Azurite (the Azure Blob emulator) is not installed, its tests are skipped: install it with "
            "`npm ci --prefix .ci/azurite` (docs/testing.md)") in proc.stdout


def test_the_images_config_points_at_the_demo_shards_or_the_folder_named() -> None:
    """configs/images.yaml named data/images/shardflow.json, a folder that nothing makes."""
    import re

    from shardflow.config import load_config

    demo = (ROOT / "tools" / "demo.py").read_text()
    out = re.search(r'"--out", type=Path, default=Path\("([^"]+)"\)', demo).group(1)
    assert load_config(ROOT / "configs" / "images.yaml", environ={}).source == out + "/shards"
    mine = load_config(ROOT / "configs" / "images.yaml", environ={"SHARDFLOW_IMAGES": "/data/imagenet-shards"})
    assert mine.source == "/data/imagenet-shards"
