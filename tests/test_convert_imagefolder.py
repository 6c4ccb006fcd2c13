"""Tests for shardflow.convert.images.imagefolder (cases C14, C15) and the writer under interruption (C08).

Every tree is made of real image files written by Pillow; the C15 tree is 100 classes x 1,000
hard links to a few real JPEGs. Conversions run for real (in-process or through the CLI in a
subprocess); crashes are real ``kill -9``s.
"""

from __future__ import annotations

import contextlib
import filecmp
import glob
import io
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
import webdataset
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

import shardflow
from shardflow.convert.engine.engine import ConvertOptions
from shardflow.convert.images.imagefolder import (
    IMAGE_EXTENSIONS,
    key_names as _key_names,
    convert_imagefolder,
    count_images,
    find_classes,
    key_to_path,
)
from shardflow.convert.engine.mixorder import input_order
from shardflow.errors import ConversionError
from shardflow.format.keys import check_key, split_name
from shardflow.format.journal import manifest_from_journal
from shardflow.format.manifest import JOURNAL_SUFFIX, MANIFEST_NAME, Manifest
from shardflow.format.tar import iter_samples

CLI = [sys.executable, "-m", "shardflow.cli"]


# --------------------------------------------------------------------------------------------
# builders


def image_bytes(fmt: str, seed: int, size: tuple[int, int] = (12, 10)) -> bytes:
    """A small real image with random pixels, encoded by Pillow."""
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, fmt)
    return out.getvalue()


def write(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def read_manifest(folder: Path) -> Manifest:
    return Manifest.loads((folder / MANIFEST_NAME).read_bytes())


def shard_samples(path: Path) -> list[tuple[str, dict[str, bytes]]]:
    """Every sample of one shard, read by the library's tar reader."""
    data = path.read_bytes()
    return [(key, fields) for key, _, fields in iter_samples([data], str(path))]


def tars(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.glob("*.tar")) if folder.exists() else []


def same_tree(a: Path, b: Path) -> None:
    """Both folders hold the same non-hidden files, byte for byte."""
    names_a = sorted(p.name for p in a.iterdir() if not p.name.startswith("."))
    names_b = sorted(p.name for p in b.iterdir() if not p.name.startswith("."))
    assert names_a == names_b
    _, mismatch, errors = filecmp.cmpfiles(a, b, names_a, shallow=False)
    assert mismatch == [] and errors == []


def identities(folder: Path, names: list[str]) -> dict[str, tuple[int, int]]:
    return {n: (os.stat(folder / n).st_ino, os.stat(folder / n).st_mtime_ns) for n in names}


# --------------------------------------------------------------------------------------------
# C14: an ImageFolder with junk


@pytest.fixture
def junk_tree(tmp_path: Path) -> Path:
    root = tmp_path / "root"
    write(root / ".ipynb_checkpoints" / "x.jpg", image_bytes("JPEG", 0))
    write(root / ".DS_Store", b"\0\0\0\1Bud1")
    write(root / "cat" / "a.jpg", image_bytes("JPEG", 1))
    write(root / "cat" / "b.jpg", image_bytes("JPEG", 2))
    write(root / "cat" / ".DS_Store", b"\0\0\0\1Bud1")
    write(root / "dog" / "C.JPG", image_bytes("JPEG", 3))
    write(root / "dog" / "D.JPG", image_bytes("JPEG", 4))
    (root / "empty").mkdir()
    write(root / "notes" / "readme.txt", b"not an image\n")
    return root


def test_c14_empty_classes_fail_before_any_shard(junk_tree: Path, tmp_path: Path) -> None:
    dst = tmp_path / "out"
    with pytest.raises(ConversionError) as info:
        convert_imagefolder(junk_tree, str(dst))
    message = str(info.value)
    assert "'empty'" in message and "'notes'" in message
    assert "'cat'" not in message and "'dog'" not in message
    assert "allow_empty" in message
    assert info.value.reason == "empty_class"
    assert tars(dst) == []
    assert not (dst / MANIFEST_NAME).exists()


def test_c14_allow_empty(junk_tree: Path, tmp_path: Path) -> None:
    dst = tmp_path / "out"
    manifest = convert_imagefolder(junk_tree, str(dst), allow_empty=True, order="walk")
    expected_classes = {"cat": 0, "dog": 1, "empty": 2, "notes": 3}
    assert manifest.meta["class_to_idx"] == expected_classes
    assert manifest.num_samples == 4
    stored = json.loads((dst / MANIFEST_NAME).read_text())
    assert stored["meta"]["class_to_idx"] == expected_classes
    assert stored["meta"]["source"] == str(junk_tree.resolve())
    assert stored["meta"]["class_counts"] == {"cat": 2, "dog": 2, "empty": 0, "notes": 0}
    # root/.DS_Store, cat/.DS_Store, notes/readme.txt; .ipynb_checkpoints is a skipped directory
    assert stored["meta"]["ignored_files"] == 3
    assert stored["meta"]["skipped_dirs"] == 1
    assert stored["fields"] == {"cls": "cls", "jpg": "jpg"}

    samples = list(shardflow.ShardDataset(str(dst), decode=None))
    got = {s["__key__"]: (s["jpg"], s["cls"]) for s in samples}
    assert [s["__key__"] for s in samples] == ["cat/a", "cat/b", "dog/C", "dog/D"]
    for key, (data, cls) in got.items():
        cls_name, stem = key.split("/")
        original = next((junk_tree / cls_name).glob(stem + ".*"))
        assert data == original.read_bytes()
        assert cls == str(expected_classes[cls_name]).encode()
    decoded = list(shardflow.ShardDataset(str(dst), decode="numpy"))
    assert [d["cls"] for d in decoded] == [0, 0, 1, 1]
    assert decoded[2]["jpg"].shape == (10, 12, 3)


def test_c14_cli(junk_tree: Path, tmp_path: Path) -> None:
    dst = tmp_path / "out"
    failed = subprocess.run([*CLI, "convert", "imagefolder", str(junk_tree), str(dst)], capture_output=True, text=True)
    assert failed.returncode == 1
    assert "'empty'" in failed.stderr and "'notes'" in failed.stderr and "--allow-empty" in failed.stderr
    assert tars(dst) == []
    ok = subprocess.run(
        [*CLI, "convert", "imagefolder", str(junk_tree), str(dst), "--allow-empty", "--workers", "1", "--prefix", "pets"],
        capture_output=True,
        text=True,
    )
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.startswith("4 samples, 4 classes, 1 shard in ")
    assert "files/s" in ok.stdout
    assert tars(dst) == ["pets-000000.tar"]


def test_find_and_count_classes(junk_tree: Path) -> None:
    assert find_classes(junk_tree) == ["cat", "dog", "empty", "notes"]
    assert count_images(junk_tree) == {"cat": 2, "dog": 2, "empty": 0, "notes": 0}
    assert count_images(junk_tree, extensions=("txt",)) == {"cat": 0, "dog": 0, "empty": 0, "notes": 1}


def test_no_class_folders_and_destination_inside_source(tmp_path: Path) -> None:
    root = tmp_path / "flat"
    write(root / "a.jpg", image_bytes("JPEG", 0))
    with pytest.raises(ConversionError, match="no class folders"):
        convert_imagefolder(root, str(tmp_path / "out"))
    write(root / "cat" / "b.jpg", image_bytes("JPEG", 1))
    with pytest.raises(ConversionError, match="inside the source tree"):
        convert_imagefolder(root, str(root / "shards"))
    with pytest.raises(FileNotFoundError):
        convert_imagefolder(tmp_path / "missing", str(tmp_path / "out"))


# --------------------------------------------------------------------------------------------
# names, extensions, nesting, key rule


@pytest.fixture
def odd_tree(tmp_path: Path) -> Path:
    """Mixed formats, upper-case extensions, dotted names, shared stems, nesting, symlinks."""
    root = tmp_path / "odd"
    files = {
        "bird/x.jpg": ("JPEG", 10),
        "bird/x.png": ("PNG", 11),
        "bird/a.b.jpg": ("JPEG", 12),
        "bird/Z.JPEG": ("JPEG", 13),
        "bird/__init.png": ("PNG", 14),
        "bird/100%~.webp": ("WEBP", 15),
        "bird/sub/deep/y.bmp": ("BMP", 16),
        "bird/sub/w.gif": ("GIF", 17),
        "bird/sub.d/t.tiff": ("TIFF", 18),
        "bird/.hidden/h.jpg": ("JPEG", 19),
        "bird/sub/.h.jpg": ("JPEG", 20),
        "fish/n.ppm": ("PPM", 21),
        "fish/x.jpg": ("JPEG", 22),
    }
    for rel, (fmt, seed) in files.items():
        write(root / rel, image_bytes(fmt, seed))
    write(root / "bird" / "notes.md", b"# not an image\n")
    write(root / "bird" / "noext", b"plain")
    os.symlink("..", root / "bird" / "sub" / "loop")  # a symlink loop: skipped, not followed forever
    os.symlink("missing.jpg", root / "fish" / "broken.jpg")  # a dangling symlink: not a sample
    outside = tmp_path / "outside"
    write(outside / "o.jpg", image_bytes("JPEG", 23))
    os.symlink(outside, root / "fish" / "linked")  # a symlinked directory: followed
    return root


ODD_KEYS = [
    # per directory: images sorted by name, then subdirectories sorted by name, depth first
    ("bird/100%25%7E", "webp", "bird/100%~.webp"),
    ("bird/Z", "jpeg", "bird/Z.JPEG"),
    ("bird/%5F_init", "png", "bird/__init.png"),
    ("bird/a%2Eb", "jpg", "bird/a.b.jpg"),
    ("bird/x~jpg", "jpg", "bird/x.jpg"),
    ("bird/x~png", "png", "bird/x.png"),
    ("bird/sub/w", "gif", "bird/sub/w.gif"),
    ("bird/sub/deep/y", "bmp", "bird/sub/deep/y.bmp"),
    ("bird/sub.d/t", "tiff", "bird/sub.d/t.tiff"),
    ("fish/n", "ppm", "fish/n.ppm"),
    ("fish/x", "jpg", "fish/x.jpg"),
    ("fish/linked/o", "jpg", "fish/linked/o.jpg"),
]


def test_keys_fields_order_and_nesting(odd_tree: Path, tmp_path: Path) -> None:
    dst = tmp_path / "out"
    manifest = convert_imagefolder(
        odd_tree, str(dst), options=ConvertOptions(max_count=5, workers=1), follow_links=True, order="walk"
    )
    assert manifest.meta["class_to_idx"] == {"bird": 0, "fish": 1}
    assert manifest.meta["class_counts"] == {"bird": 9, "fish": 3}
    # bird/.hidden, bird/sub/loop (a symlink loop)
    assert manifest.meta["skipped_dirs"] == 2
    # bird/notes.md, bird/noext, bird/sub/.h.jpg, fish/broken.jpg
    assert manifest.meta["ignored_files"] == 4
    assert sorted((e["path"], e["reason"].split(" (")[0]) for e in manifest.meta["ignored"]) == [
        ("bird/.hidden", "hidden"),
        ("bird/noext", "not an image"),
        ("bird/notes.md", "not an image"),
        ("bird/sub/.h.jpg", "hidden"),
        ("bird/sub/loop", "a symlink loop"),
        ("fish/broken.jpg", "not a regular file"),
    ]
    assert manifest.meta["skipped"] == [] and manifest.meta["skipped_count"] == 0
    assert [s.samples for s in manifest.shards] == [5, 5, 2]
    samples = [s for name in tars(dst) for s in shard_samples(dst / name)]
    assert [(k, sorted(f)) for k, f in samples] == [(k, sorted([field, "cls"])) for k, field, _ in ODD_KEYS]
    for (key, fields), (_, field, rel) in zip(samples, ODD_KEYS):
        assert fields[field] == (odd_tree / rel).read_bytes()  # original bytes, no re-encode
        assert fields["cls"] == (b"0" if rel.startswith("bird/") else b"1")
        path, ext = key_to_path(key)
        original = rel.rsplit(".", 1)
        assert path == original[0]
        assert ext in (None, original[1])
        assert ext is not None or original[1].lower() == field
    assert set(manifest.fields) == {"cls", "jpg", "jpeg", "png", "webp", "gif", "bmp", "tiff", "ppm"}
    decoded = list(shardflow.ShardDataset(str(dst), decode="numpy"))
    for sample in decoded:
        image = next(v for k, v in sample.items() if k in IMAGE_EXTENSIONS)
        assert image.shape == (10, 12, 3) and image.dtype == np.uint8


stems = st.text(st.characters(blacklist_characters="/\x00", blacklist_categories=("Cs",)), min_size=1, max_size=10)
extensions = st.sampled_from(["jpg", "JPG", "jpeg", "png", "Png", "webp"])


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(stems.filter(lambda s: not s.startswith(".")), extensions), max_size=12))
def test_key_rule_property(files: list[tuple[str, str]]) -> None:
    """Any directory of image names gives distinct, valid keys that split and invert exactly."""
    names = sorted({f"{stem}.{ext}" for stem, ext in files})
    keys = [f"cls/sub/{base}" for base in _key_names(names)]
    assert len(set(keys)) == len(keys)
    for name, key in zip(names, keys):
        stem, _, ext = name.rpartition(".")
        assert check_key(key) == key
        assert split_name(f"{key}.{ext.lower()}") == (key, ext.lower())  # the webdataset key/field split
        path, recorded = key_to_path(key)
        assert path == f"cls/sub/{stem}"
        assert recorded in (None, ext)
        assert (recorded is None) == (sum(n.rpartition(".")[0] == stem for n in names) == 1)


@pytest.mark.parametrize("workers", [1, 2])
def test_shuffled_odd_tree_is_the_walk_permuted(odd_tree: Path, tmp_path: Path, workers: int) -> None:
    """The shuffled order lists names alone (:mod:`shardflow.convert.images.imagelist`): on a tree
    with escaped and suffixed keys, nesting, links, hidden and ignored entries and many formats
    it writes the walk's samples in the seeded permutation, with the walk's counts and names."""
    options = ConvertOptions(max_count=5, workers=workers)
    walk = convert_imagefolder(odd_tree, str(tmp_path / "walk"), options=options, follow_links=True, order="walk")
    walked = [s for name in tars(tmp_path / "walk") for s in shard_samples(tmp_path / "walk" / name)]
    mixed = convert_imagefolder(odd_tree, str(tmp_path / "mixed"), options=options, follow_links=True)
    samples = [s for name in tars(tmp_path / "mixed") for s in shard_samples(tmp_path / "mixed" / name)]
    assert samples == [walked[i] for i in input_order(len(walked), 0)]
    assert [s.samples for s in mixed.shards] == [5, 5, 2]
    assert mixed.meta["order"] == "shuffled" and walk.meta["order"] == "walk"
    same = ("class_to_idx", "class_counts", "image_fields", "ignored_files", "skipped_dirs", "ignored", "skipped_count")
    assert {k: mixed.meta[k] for k in same} == {k: walk.meta[k] for k in same}
    assert mixed.fields == walk.fields


def test_shuffled_keeps_an_empty_class_with_allow_empty(junk_tree: Path, tmp_path: Path) -> None:
    manifest = convert_imagefolder(junk_tree, str(tmp_path / "out"), allow_empty=True, options=ConvertOptions(workers=1))
    assert manifest.meta["class_counts"] == {"cat": 2, "dog": 2, "empty": 0, "notes": 0}
    assert sorted(k for name in tars(tmp_path / "out") for k, _ in shard_samples(tmp_path / "out" / name)) == [
        "cat/a", "cat/b", "dog/C", "dog/D"]  # fmt: skip


def test_extensions_option(odd_tree: Path, tmp_path: Path) -> None:
    manifest = convert_imagefolder(odd_tree, str(tmp_path / "out"), extensions=(".PNG", "jpeg"), allow_empty=True)
    assert manifest.meta["class_counts"] == {"bird": 3, "fish": 0}
    assert manifest.meta["extensions"] == ["jpeg", "png"]
    with pytest.raises(TypeError):
        convert_imagefolder(odd_tree, str(tmp_path / "out2"), extensions="jpg")
    with pytest.raises(ValueError, match="invalid image extensions"):
        convert_imagefolder(odd_tree, str(tmp_path / "out2"), extensions=("jpg", "tar.gz"))


def test_default_walk_skips_and_names_the_link_out_of_the_tree(odd_tree: Path, tmp_path: Path) -> None:
    manifest = convert_imagefolder(odd_tree, str(tmp_path / "out"), options=ConvertOptions(max_count=5, workers=1),
                                   order="walk")
    assert manifest.meta["class_counts"] == {"bird": 9, "fish": 2}
    assert manifest.meta["skipped_dirs"] == 3
    named = {e["path"]: e["reason"] for e in manifest.meta["ignored"]}
    assert named["fish/linked"].startswith("a symlink out of the tree (to " + str(tmp_path / "outside"))
    keys = [s["__key__"] for s in shardflow.ShardDataset(str(tmp_path / "out"), decode=None)]
    assert keys == [k for k, _, _ in ODD_KEYS if k != "fish/linked/o"]


def test_webdataset_reads_the_shards(odd_tree: Path, tmp_path: Path) -> None:
    dst = tmp_path / "out"
    convert_imagefolder(odd_tree, str(dst), options=ConvertOptions(max_count=4, workers=2), follow_links=True,
                        order="walk")
    urls = [str(dst / name) for name in tars(dst)]
    ours = list(shardflow.ShardDataset(str(dst), decode=None))
    theirs = list(webdataset.WebDataset(urls, shardshuffle=False, empty_check=False))
    assert [s["__key__"] for s in theirs] == [k for k, _, _ in ODD_KEYS] == [s["__key__"] for s in ours]
    for a, b, (_, field, rel) in zip(ours, theirs, ODD_KEYS):
        assert b[field] == a[field] == (odd_tree / rel).read_bytes()
        assert b["cls"] == a["cls"]
        assert set(b) - {"__key__", "__url__", "__source__", "__local_path__"} == {field, "cls"}


def test_memory_destination(junk_tree: Path) -> None:
    manifest = convert_imagefolder(junk_tree, "memory://imagefolder-test/out", allow_empty=True, order="walk")
    assert manifest.num_samples == 4
    keys = [s["__key__"] for s in shardflow.ShardDataset("memory://imagefolder-test/out", decode=None)]
    assert keys == ["cat/a", "cat/b", "dog/C", "dog/D"]


def test_rerun_rewrites_only_the_shard_whose_file_changed(odd_tree: Path, tmp_path: Path) -> None:
    dst = tmp_path / "out"
    options = ConvertOptions(max_count=5, workers=1)
    convert_imagefolder(odd_tree, str(dst), options=options, follow_links=True, order="walk")
    names = tars(dst)
    before = identities(dst, names)
    # same path, new content and size: the shard that holds it is rewritten, the others kept
    new_bytes = image_bytes("PNG", 99, size=(30, 20))
    write(odd_tree / "fish" / "x.jpg", new_bytes)
    manifest = convert_imagefolder(odd_tree, str(dst), options=options, follow_links=True, order="walk")
    after = identities(dst, names)
    assert [n for n in names if before[n] != after[n]] == ["train-000002.tar"]
    fields = dict(shard_samples(dst / "train-000002.tar"))
    assert fields["fish/x"]["jpg"] == new_bytes
    assert manifest.meta["conversion"]["complete"] is True


# --------------------------------------------------------------------------------------------
# C15: a million files (CI size: 100 classes x 1,000 files)

CLASSES, PER_CLASS, MAX_COUNT = 100, 1_000, 1_000


@pytest.fixture(scope="module")
def big_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """100 classes x 1,000 hard links to 4 real JPEGs; every class has 0001.jpg."""
    base = tmp_path_factory.mktemp("c15")
    originals = [write(base / "originals" / f"{i}.jpg", image_bytes("JPEG", 100 + i, size=(16 + i, 16))) for i in range(4)]
    root = base / "tree"
    for c in range(CLASSES):
        folder = root / f"c{c:04d}"
        folder.mkdir(parents=True)
        for j in range(PER_CLASS):
            os.link(originals[(c + j) % 4], folder / f"{j + 1:04d}.jpg")
    return root


def expected_keys() -> list[str]:
    return [f"c{c:04d}/{j + 1:04d}" for c in range(CLASSES) for j in range(PER_CLASS)]


class CountingScandir:
    """Wraps ``os.scandir`` to count directories opened and entries read."""

    def __init__(self, real) -> None:
        self.real = real
        self.calls: list[str] = []
        self.entries = 0

    def __call__(self, path=".", *args, **kwargs):
        self.calls.append(os.fspath(path))
        counter = self

        class Iter:
            def __init__(self, it) -> None:
                self.it = it

            def __enter__(self):
                return self

            def __exit__(self, *exc) -> None:
                self.it.close()

            def __iter__(self):
                return self

            def __next__(self):
                entry = next(self.it)
                counter.entries += 1
                return entry

            def close(self) -> None:
                self.it.close()

        return Iter(self.real(path, *args, **kwargs))


def forbidden(*args, **kwargs):
    raise AssertionError("the converter must walk with os.scandir, not list or glob the tree")


@pytest.fixture(scope="module")
def big_converted(big_tree: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Manifest, CountingScandir]:
    """One conversion with 2 workers, the walk instrumented."""
    dst = tmp_path_factory.mktemp("c15-out") / "clean"
    counter = CountingScandir(os.scandir)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(os, "scandir", counter)
        for name in ("glob", "iglob"):
            mp.setattr(glob, name, forbidden)
        mp.setattr(os, "listdir", forbidden)
        mp.setattr(os, "walk", forbidden)
        manifest = convert_imagefolder(big_tree, str(dst), options=ConvertOptions(max_count=MAX_COUNT, workers=2))
    return dst, manifest, counter


@pytest.mark.slow
def test_c15_one_streaming_walk(big_tree: Path, big_converted) -> None:
    _, manifest, counter = big_converted
    root = str(big_tree)
    # the source tree: the root once, each class twice (the empty-class check, which stops at the
    # first image, and the walk); the destination is listed once for a crashed run's temporaries
    source_calls = [c for c in counter.calls if c == root or c.startswith(root + os.sep)]
    assert source_calls.count(root) == 1
    assert len(source_calls) == 1 + 2 * CLASSES
    assert sorted(set(source_calls)) == sorted([root] + [os.path.join(root, f"c{c:04d}") for c in range(CLASSES)])
    assert len(counter.calls) - len(source_calls) == 1
    # every file entry is read once by the walk; the check reads one entry per class; the
    # destination's listing holds one entry, the lock file of this run (.shardflow.lock)
    assert counter.entries == CLASSES + CLASSES * PER_CLASS + CLASSES + 1
    assert manifest.meta["class_counts"] == {f"c{c:04d}": PER_CLASS for c in range(CLASSES)}


@pytest.mark.slow
def test_c15_keys_unique_sorted_disjoint_shards(big_converted) -> None:
    dst, manifest, _ = big_converted
    walked = expected_keys()
    keys = [walked[j] for j in input_order(len(walked), 0)]  # the default order: the walk, shuffled
    assert manifest.num_samples == CLASSES * PER_CLASS
    assert [s.url for s in manifest.shards] == [f"train-{i:06d}.tar" for i in range(100)]
    assert tars(dst) == [s.url for s in manifest.shards]
    seen: list[str] = []
    for i, shard in enumerate(manifest.shards):
        samples = shard_samples(dst / shard.url)
        # shard i holds exactly samples i*max_count .. (i+1)*max_count - 1 of the shuffled stream
        assert [k for k, _ in samples] == keys[i * MAX_COUNT : (i + 1) * MAX_COUNT]
        assert all(f["cls"] == str(int(k[1:5])).encode() for k, f in samples)
        assert shard.samples == len(samples) == MAX_COUNT
        seen += [k for k, _ in samples]
    assert len(seen) == len(set(seen)) == CLASSES * PER_CLASS
    assert sum(k.endswith("/0001") for k in seen) == CLASSES  # the same file name in every class


@pytest.mark.slow
def test_c15_rerun_identical_with_other_worker_count(big_tree: Path, big_converted, tmp_path: Path) -> None:
    dst, _, _ = big_converted
    other = tmp_path / "serial"
    convert_imagefolder(big_tree, str(other), options=ConvertOptions(max_count=MAX_COUNT, workers=1))
    same_tree(dst, other)
    # and a re-run into the finished destination keeps every shard as it is
    names = tars(dst)
    before = identities(dst, names)
    manifest = convert_imagefolder(big_tree, str(dst), options=ConvertOptions(max_count=MAX_COUNT, workers=2))
    assert identities(dst, names) == before
    assert manifest.num_samples == CLASSES * PER_CLASS
    same_tree(dst, other)


@pytest.mark.slow
def test_c15_killed_run_resumes_keeping_finished_shards(big_tree: Path, big_converted, tmp_path: Path) -> None:
    clean, _, _ = big_converted
    dst = tmp_path / "crashed"
    cmd = [*CLI, "convert", "imagefolder", str(big_tree), str(dst), "--max-count", str(MAX_COUNT), "--workers", "2"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                # the first record (written when the first group is done; later ones at most once
                # a second) is the moment to kill: on a quiet machine the next one may be the last
                if len(read_manifest(dst).shards) >= 1:
                    break
            except (FileNotFoundError, ValueError):
                pass
            time.sleep(0.01)
        assert proc.poll() is None, "the conversion finished before it could be killed"
        workers = psutil.Process(proc.pid).children(recursive=True)
        os.kill(proc.pid, signal.SIGKILL)  # the converting process only, not its writer workers
        proc.wait()
        # the orphaned writer workers notice and exit by themselves
        _, alive = psutil.wait_procs(workers, timeout=60)  # returns once they are gone (they look twice a second)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # whatever is left of the run
        proc.wait()
    assert len(workers) == 2 and alive == []
    crashed = read_manifest(dst)
    assert crashed.meta["conversion"]["complete"] is False
    kept = [s.url for s in crashed.shards]
    assert 1 <= len(kept) < 100
    for name in kept:  # listed shards are complete
        assert (dst / name).stat().st_size == next(s.bytes for s in crashed.shards if s.url == name)
    before = identities(dst, kept)
    resumed = subprocess.run(cmd, capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr
    assert identities(dst, kept) == before  # finished shards were kept, not rewritten
    same_tree(dst, clean)  # and the result is the clean run's, byte for byte


# --------------------------------------------------------------------------------------------
# C08: a writer interrupted


def c08_sample(i: int) -> dict:
    return {"__key__": f"s{i:05d}", "x.npy": np.full((3,), i, dtype=np.int64), "y.txt": f"label {i}"}


def check_c08_folder(folder: Path, expected_listed: list[tuple[str, int]], manifest: Manifest | None = None) -> None:
    """The manifest lists exactly ``expected_listed``; every shard on disk has only complete samples."""
    manifest = manifest or read_manifest(folder)
    assert [(s.url, s.samples) for s in manifest.shards] == expected_listed
    for shard in manifest.shards:
        samples = shard_samples(folder / shard.url)
        assert len(samples) == shard.samples == 500
        assert (folder / shard.url).stat().st_size == shard.bytes
    on_disk = tars(folder)
    assert on_disk[: len(expected_listed)] == [u for u, _ in expected_listed]
    for name in on_disk:
        samples = shard_samples(folder / name)
        assert samples, f"{name} is empty"
        start = int(name[len("train-") : -len(".tar")]) * 500
        assert len(samples) in (500, 200)
        for n, (key, fields) in enumerate(samples):
            assert key == f"s{start + n:05d}"
            assert sorted(fields) == ["x.npy", "y.txt"]  # never a sample missing a field
            assert np.load(io.BytesIO(fields["x.npy"])).tolist() == [start + n] * 3
            assert fields["y.txt"] == f"label {start + n}".encode()


def test_c08_closed_normally(tmp_path: Path) -> None:
    with shardflow.ShardWriter(str(tmp_path / "train-%06d.tar"), max_count=500) as sink:
        for i in range(1000):
            sink.write(c08_sample(i))
    assert tars(tmp_path) == ["train-000000.tar", "train-000001.tar"]
    check_c08_folder(tmp_path, [("train-000000.tar", 500), ("train-000001.tar", 500)])
    samples = list(shardflow.ShardDataset(str(tmp_path), decode="numpy"))
    assert len(samples) == 1000
    assert all(s["x.npy"].tolist() == [i] * 3 and s["y.txt"] == f"label {i}" for i, s in enumerate(samples))


def test_c08_exception_after_700_writes(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="boom"):
        with shardflow.ShardWriter(str(tmp_path / "train-%06d.tar"), max_count=500) as sink:
            for i in range(1000):
                if i == 700:
                    raise RuntimeError("boom")
                sink.write(c08_sample(i))
    check_c08_folder(tmp_path, [("train-000000.tar", 500)])
    assert tars(tmp_path) == ["train-000000.tar"]  # shard 1 was dropped, not left partial
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary file left
    assert len(list(shardflow.ShardDataset(str(tmp_path), decode=None))) == 500


def test_c08_writer_killed_mid_shard(tmp_path: Path) -> None:
    script = textwrap.dedent(
        f"""
        import sys, time
        import numpy as np
        import shardflow
        sink = shardflow.ShardWriter({str(tmp_path / "train-%06d.tar")!r}, max_count=500)
        for i in range(700):
            sink.write({{"__key__": f"s{{i:05d}}", "x.npy": np.full((3,), i, dtype=np.int64), "y.txt": f"label {{i}}"}})
        print("wrote 700", flush=True)
        time.sleep(60)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "wrote 700"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    # the manifest is written at close; the journal of finished shards stands in for it
    assert not (tmp_path / MANIFEST_NAME).exists()
    journal = (tmp_path / (MANIFEST_NAME + JOURNAL_SUFFIX)).read_bytes()
    check_c08_folder(tmp_path, [("train-000000.tar", 500)], manifest_from_journal(journal, str(tmp_path / MANIFEST_NAME)))
    assert tars(tmp_path) == ["train-000000.tar"]  # shard 1 never appears under its name
    ds = shardflow.ShardDataset(str(tmp_path), decode=None)  # replays the journal
    assert len(ds) == 500 and len(list(ds)) == 500


@pytest.mark.parametrize("size", [-1, 0, 99, 100, 101, 5000])
@pytest.mark.parametrize("length", [0, 100, 3 << 20])
def test_local_tree_reads_the_whole_file_whatever_size_was_listed(tmp_path, size, length):
    from shardflow.convert.images.walk import LocalTree

    data = np.random.default_rng(length).bytes(length)
    write(tmp_path / "a" / "b.jpg", data)
    assert LocalTree(str(tmp_path)).read("a/b.jpg", size) == data


@pytest.mark.parametrize("order", ["walk", "shuffled"])
def test_a_file_that_changed_size_since_the_listing_is_an_error(tmp_path, monkeypatch, order):
    from shardflow.convert.images.walk import LocalTree

    src = tmp_path / "src"
    write(src / "cat" / "a.jpg", image_bytes("jpeg", 1))
    write(src / "cat" / "b.jpg", image_bytes("jpeg", 2))
    if order == "walk":  # the size the listing's stat saw
        real = LocalTree.stat
        monkeypatch.setattr(LocalTree, "stat", lambda self, rel: (lambda s: (s[0] + (rel == "cat/b.jpg"), s[1]))(real(self, rel)))
    else:  # the shuffled order lists names alone: the size the open file had (fstat) before its read
        real_read = LocalTree.read_versioned
        monkeypatch.setattr(LocalTree, "read_versioned",
                            lambda self, rel: (lambda d, n, v: (d, n + (rel == "cat/b.jpg"), v))(*real_read(self, rel)))
    with pytest.raises(ConversionError, match=r"cat/b\.jpg: changed during the conversion"):
        convert_imagefolder(src, str(tmp_path / "out"), options=ConvertOptions(workers=1), order=order)
    assert not (tmp_path / "out" / "train-000000.tar").exists()


@pytest.mark.parametrize("length", [0, 100, 3 << 20])
def test_local_tree_read_versioned_takes_size_and_version_from_the_open_file(tmp_path, length):
    from shardflow.convert.images.walk import LocalTree

    data = np.random.default_rng(length).bytes(length)
    write(tmp_path / "a" / "b.jpg", data)
    os.utime(tmp_path / "a" / "b.jpg", ns=(1, 1_234_567_891_011))
    tree = LocalTree(str(tmp_path))
    assert tree.read_versioned("a/b.jpg") == (data, length, 1_234_567_891_011)
    assert tree.stat("a/b.jpg") == (length, 1_234_567_891_011)  # what a re-run compares it with
    with pytest.raises(FileNotFoundError):
        tree.read_versioned("a/missing.jpg")


@pytest.mark.slow
def test_c15_walk_memory_is_flat_in_the_file_count(big_tree: Path) -> None:
    """C15 "memory under 500 MB at 1M": the walk holds no listing of the tree. Python's peak
    while walking 10 classes (10,000 files) and all 100 (100,000) differs by under 1 MiB
    (a held list of 100,000 descriptors alone would be ~20 MiB), so 1,000 classes stay flat too."""
    import tracemalloc

    from shardflow.convert.images.imageclasses import ClassWalk
    from shardflow.convert.images.walk import Ignored, LocalTree
    from shardflow.format.keys import IMAGE_EXTENSIONS

    classes = sorted(p.name for p in big_tree.iterdir())
    assert len(classes) == CLASSES

    def peak(n: int) -> tuple[int, int]:
        walk = ClassWalk(LocalTree(str(big_tree)), classes[:n], list(range(n)), frozenset(IMAGE_EXTENSIONS), None, Ignored())
        tracemalloc.start()
        try:
            count = sum(1 for _ in walk.descriptors())
            return count, tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    (small, small_peak), (large, large_peak) = peak(10), peak(CLASSES)
    assert (small, large) == (10 * PER_CLASS, CLASSES * PER_CLASS)
    assert large_peak - small_peak < 1 << 20, (small_peak, large_peak)
