"""Class indices of convert imagefolder (shardflow.convert.images.imageclasses): --classes-from takes
another dataset's class_to_idx (a val split lacking a class keeps train's indices) or a JSON /
text list of names; a class folder missing from it is an error naming it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import shardflow
from shardflow.cli import main
from shardflow.convert.engine.engine import ConvertOptions
from shardflow.convert.images.imageclasses import class_indices, classes_from
from shardflow.convert.images.imagefolder import convert_imagefolder
from shardflow.errors import ConversionError
from tests.helpers import tiny_image


def tree(root: Path, classes: list[str]) -> Path:
    for c, cls in enumerate(classes):
        (root / cls).mkdir(parents=True)
        (root / cls / "x.jpg").write_bytes(tiny_image("JPEG", c))
    return root


def labels(dst: Path) -> dict[str, int]:
    return {s["__key__"]: int(s["cls"]) for s in shardflow.ShardDataset(str(dst), decode=None)}


def test_val_lacking_a_class_gets_train_indices(tmp_path: Path) -> None:
    train = tree(tmp_path / "train", ["a", "b", "c", "d"])
    val = tree(tmp_path / "val", ["a", "b", "d"])
    convert_imagefolder(train, str(tmp_path / "train-shards"), options=ConvertOptions(workers=1))
    alone = convert_imagefolder(val, str(tmp_path / "v0"), options=ConvertOptions(workers=1))
    assert alone.meta["class_to_idx"] == {"a": 0, "b": 1, "d": 2}  # what happens without it
    m = convert_imagefolder(val, str(tmp_path / "v1"), options=ConvertOptions(workers=1),
                            classes_from=str(tmp_path / "train-shards"))
    assert m.meta["class_to_idx"] == {"a": 0, "b": 1, "d": 3}
    assert m.meta["classes_from"] == str(tmp_path / "train-shards")
    assert labels(tmp_path / "v1") == {"a/x": 0, "b/x": 1, "d/x": 3}
    # the manifest URL itself works too, and the CLI flag
    rc = main(["convert", "imagefolder", str(val), str(tmp_path / "v2"), "--workers", "1",
               "--classes-from", str(tmp_path / "train-shards" / "shardflow.json")])
    assert rc == 0 and labels(tmp_path / "v2") == {"a/x": 0, "b/x": 1, "d/x": 3}


def test_lists_of_names(tmp_path: Path) -> None:
    val = tree(tmp_path / "val", ["a", "d"])
    (tmp_path / "names.txt").write_text("a\nb\n\nc\nd\n")
    (tmp_path / "names.json").write_text(json.dumps(["d", "c", "b", "a"]))
    (tmp_path / "map.json").write_text(json.dumps({"a": 7, "d": 2}))
    assert classes_from(str(tmp_path / "names.txt")) == {"a": 0, "b": 1, "c": 2, "d": 3}
    assert classes_from(str(tmp_path / "names.json")) == {"d": 0, "c": 1, "b": 2, "a": 3}
    m = convert_imagefolder(val, str(tmp_path / "o1"), options=ConvertOptions(workers=1),
                            classes_from=str(tmp_path / "names.json"), order="walk")
    # classes in index order: d (0) before a (3)
    assert list(m.meta["class_to_idx"].items()) == [("d", 0), ("a", 3)]
    assert [s["__key__"] for s in shardflow.ShardDataset(str(tmp_path / "o1"), decode=None)] == ["d/x", "a/x"]
    m = convert_imagefolder(val, str(tmp_path / "o2"), options=ConvertOptions(workers=1),
                            classes_from=str(tmp_path / "map.json"))
    assert labels(tmp_path / "o2") == {"a/x": 7, "d/x": 2}
    m = convert_imagefolder(val, str(tmp_path / "o3"), options=ConvertOptions(workers=1), classes_from=["x", "a", "d"])
    assert m.meta["class_to_idx"] == {"a": 1, "d": 2}


def test_a_folder_missing_from_the_list_is_an_error(tmp_path: Path) -> None:
    val = tree(tmp_path / "val", ["a", "b", "zebra"])
    with pytest.raises(ConversionError, match=r"class folder\(s\) 'zebra' are not among the 2 classes") as info:
        convert_imagefolder(val, str(tmp_path / "o"), classes_from=["a", "b"])
    assert info.value.reason == "unknown_class"
    assert not (tmp_path / "o").exists()
    rc = main(["convert", "imagefolder", str(val), str(tmp_path / "o"), "--classes-from", str(tmp_path / "nothing")])
    assert rc != 0


def test_bad_lists_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ConversionError, match="listed twice: 'a'"):
        class_indices(["a", "b", "a"], "x")
    with pytest.raises(ConversionError, match="share the indices"):
        class_indices({"a": 1, "b": 1}, "x")
    with pytest.raises(ConversionError, match="non-negative"):
        class_indices({"a": -1}, "x")
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "shardflow.json").write_text(json.dumps({"format": "shardflow", "version": 1, "shards": []}))
    with pytest.raises(ConversionError, match="no meta.class_to_idx"):
        classes_from(str(tmp_path / "m"))
