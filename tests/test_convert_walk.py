"""Symlinks in an ImageFolder tree (shardflow.convert.images.walk): a folder link back into the tree
(a loop through the root, a link to another class) or out of it is skipped and named, from the
root down; out-of-tree links are followed with follow_links=True. Real trees, real links."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import shardflow
from shardflow.convert.engine.engine import ConvertOptions
from shardflow.convert.images.imagefolder import convert_imagefolder, count_images, find_classes
from tests.helpers import tiny_image

pytestmark = pytest.mark.skipif(not hasattr(os, "symlink"), reason="needs symlinks")


def build_tree(root: Path) -> dict[str, bytes]:
    """cat, dog, owl with 5 images each (15 in all); returns path -> bytes."""
    files = {}
    for c, cls in enumerate(["cat", "dog", "owl"]):
        for j in range(5):
            rel = f"{cls}/{j:02d}.jpg"
            files[rel] = tiny_image("JPEG", 10 * c + j)
            (root / cls).mkdir(parents=True, exist_ok=True)
            (root / rel).write_bytes(files[rel])
    return files


def read_back(dst: Path) -> dict[str, tuple[bytes, int]]:
    return {s["__key__"]: (s["jpg"], int(s["cls"])) for s in shardflow.ShardDataset(str(dst), decode=None)}


def test_a_loop_through_the_root_is_skipped_and_named(tmp_path: Path) -> None:
    root = tmp_path / "tree"
    files = build_tree(root)
    os.symlink("..", root / "dog" / "all")  # dog/all -> the root: cat and owl again under dog
    m = convert_imagefolder(root, str(tmp_path / "out"), options=ConvertOptions(workers=1))
    assert m.num_samples == 15
    assert m.meta["class_counts"] == {"cat": 5, "dog": 5, "owl": 5}
    assert m.meta["skipped_dirs"] == 1
    [entry] = m.meta["ignored"]
    assert entry["path"] == "dog/all" and entry["reason"].startswith("a symlink loop (to ., a folder above it)")
    got = read_back(tmp_path / "out")
    idx = {"cat": 0, "dog": 1, "owl": 2}
    assert got == {rel[: -len(".jpg")]: (data, idx[rel.split("/")[0]]) for rel, data in files.items()}
    assert count_images(root) == {"cat": 5, "dog": 5, "owl": 5}


def test_links_into_the_tree_and_out_of_it(tmp_path: Path) -> None:
    root = tmp_path / "tree"
    build_tree(root)
    os.symlink("../cat", root / "dog" / "cats")  # into the tree: another class's folder
    os.symlink("cat", root / "kitty")  # a class folder that is a link to another class
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "o.jpg").write_bytes(tiny_image("JPEG", 99))
    os.symlink(outside, root / "owl" / "more")  # out of the tree
    os.symlink(root / "owl", outside / "back")  # from outside back in (reached with follow_links)
    m = convert_imagefolder(root, str(tmp_path / "out"), options=ConvertOptions(workers=1))
    assert find_classes(root) == ["cat", "dog", "owl"] == list(m.meta["class_to_idx"])
    assert m.num_samples == 15
    reasons = {e["path"]: e["reason"] for e in m.meta["ignored"]}
    assert sorted(reasons) == ["dog/cats", "kitty", "owl/more"]
    assert reasons["dog/cats"].startswith("a symlink into the tree (to cat")
    assert reasons["kitty"].startswith("a symlink into the tree (to cat")
    assert reasons["owl/more"].startswith(f"a symlink out of the tree (to {outside}")
    # followed out of the tree, and the link from there back in is still refused
    f = convert_imagefolder(root, str(tmp_path / "out2"), options=ConvertOptions(workers=1), follow_links=True)
    assert f.num_samples == 16 and f.meta["class_counts"] == {"cat": 5, "dog": 5, "owl": 6}
    reasons = {e["path"]: e["reason"] for e in f.meta["ignored"]}
    assert sorted(reasons) == ["dog/cats", "kitty", "owl/more/back"]
    assert reasons["owl/more/back"].startswith("a symlink into the tree (to owl")
    assert count_images(root, follow_links=True) == {"cat": 5, "dog": 5, "owl": 6}
    assert "owl/more/o" in read_back(tmp_path / "out2")


def test_a_loop_outside_the_tree_with_follow_links(tmp_path: Path) -> None:
    root = tmp_path / "tree"
    build_tree(root)
    outside = tmp_path / "outside" / "a"
    outside.mkdir(parents=True)
    (outside / "o.jpg").write_bytes(tiny_image("JPEG", 98))
    os.symlink("..", outside / "up")  # outside/a/up -> outside: a loop out there
    os.symlink(outside, root / "cat" / "ext")
    m = convert_imagefolder(root, str(tmp_path / "out"), options=ConvertOptions(workers=1), follow_links=True)
    # cat/ext/o once, and cat/ext/up/a/o once more (outside/a reached again through its parent
    # is the loop: up -> outside, outside/a is on the current path)
    keys = sorted(read_back(tmp_path / "out"))
    assert [k for k in keys if k.startswith("cat/ext")] == ["cat/ext/o"]
    assert [e["path"] for e in m.meta["ignored"]] == ["cat/ext/up/a"]


def test_cli_names_the_skipped_link(tmp_path: Path) -> None:
    from shardflow.cli import main

    root = tmp_path / "tree"
    build_tree(root)
    os.symlink("..", root / "dog" / "all")
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["convert", "imagefolder", str(root), str(tmp_path / "out"), "--workers", "1"]) == 0
    text = out.getvalue()
    assert text.startswith("15 samples, 3 classes, 1 shard in ")
    assert "ignored: 1\n  dog/all: a symlink loop (to ., a folder above it)" in text
