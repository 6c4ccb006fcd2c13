"""The image-field alias, per-field transforms (map_fields) and batches of mixed image sizes."""

from __future__ import annotations

import io
import pickle

import numpy as np
import pytest
import torch
from PIL import Image

import shardflow
from shardflow.codecs import IMAGE_FIELD, field_alternatives, is_image_field
from shardflow.errors import MissingFieldError, SampleError
from shardflow.transforms import FieldMap, map_fields


def image_bytes(h: int, w: int, fmt: str, seed: int = 0) -> bytes:
    arr = np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format=fmt)
    return buf.getvalue()


def crop_top_left(size: int):
    """A stand-in for torchvision's v2 transforms: one image in, one image out (CHW)."""
    def crop(img: torch.Tensor) -> torch.Tensor:
        return img[:, :size, :size]
    return crop


class Crop:
    """A picklable crop, as torchvision transforms are."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __call__(self, img: torch.Tensor) -> torch.Tensor:
        return img[:, : self.size, : self.size]


@pytest.fixture
def mixed(tmp_path):
    """6 samples: JPEG 20x30 and PNG 24x16 alternating, each with a class."""
    with shardflow.ShardWriter(str(tmp_path / "s-%06d.tar"), max_count=4) as w:
        for i in range(6):
            fmt, ext, (h, wd) = ("JPEG", "jpg", (20, 30)) if i % 2 == 0 else ("PNG", "png", (24, 16))
            w.write({"__key__": f"{i:04d}", ext: image_bytes(h, wd, fmt, i), "cls": i % 3})
    return tmp_path


def test_alias_expands_to_every_image_extension():
    alts = field_alternatives("image")
    assert alts[0] == "image" and alts[1:5] == ["jpg", "jpeg", "png", "webp"]
    assert field_alternatives("jpg;png") == ["jpg", "png"]
    assert field_alternatives("seg.png;image")[:3] == ["seg.png", "image", "jpg"]
    assert field_alternatives("cls") == ["cls"]
    assert is_image_field("image") and is_image_field("seg.png") and is_image_field("jpeg")
    assert not is_image_field("cls") and not is_image_field("npy")
    assert IMAGE_FIELD == "image"


def test_mixed_jpeg_png_read_as_one_image_field(mixed):
    ds = shardflow.ShardDataset(mixed, decode="torch", fields=("image", "cls"))
    samples = list(ds)
    assert [tuple(s) for s in samples] == [("__key__", "__url__", "image", "cls", "__source__")] * 6
    assert [tuple(s["image"].shape) for s in samples] == [(3, 20, 30), (3, 24, 16)] * 3
    assert [s["cls"] for s in samples] == [0, 1, 2, 0, 1, 2]
    # an alias the manifest cannot satisfy is refused up front, listing what exists
    with pytest.raises(MissingFieldError, match=r"'webp'.*\['cls', 'jpg', 'png'\]"):
        shardflow.ShardDataset(mixed, fields=("webp", "cls"))


def test_mixed_sizes_in_a_batch_say_how_to_resize(mixed):
    ds = shardflow.ShardDataset(mixed, decode="torch", fields=("image", "cls"))
    with pytest.raises(SampleError, match=r"cannot batch field 'image': image '0000' has shape \(3, 20, 30\), "
                                          r"image '0001' has shape \(3, 24, 16\).*v2\.Resize"):
        next(iter(shardflow.loader(ds, batch_size=4)))
    # numpy images too
    ds = shardflow.ShardDataset(mixed, decode="numpy", fields=("image",))
    with pytest.raises(SampleError, match=r"\(20, 30, 3\).*\(24, 16, 3\)"):
        next(iter(shardflow.loader(ds, batch_size=2)))


def test_a_per_field_transform_gives_one_batch_tensor(mixed):
    ds = shardflow.ShardDataset(mixed, decode="torch", fields=("image", "cls"), transform={"image": Crop(16)})
    batches = list(shardflow.loader(ds, batch_size=3, num_workers=2))
    assert [b["image"].shape for b in batches] == [torch.Size([3, 3, 16, 16])] * 2
    assert batches[0]["image"].dtype == torch.uint8
    assert torch.equal(batches[0]["cls"], torch.tensor([0, 1, 2]))
    # the pixels are the stored ones, cropped
    direct = list(shardflow.ShardDataset(mixed, decode="torch", fields=("image",)))
    assert torch.equal(batches[1]["image"][2], direct[5]["image"][:, :16, :16])


def test_map_fields_by_stored_name_and_by_alias_without_selection(mixed):
    # no fields= selection: "image" finds jpg in even samples, png in odd ones
    t = map_fields(image=crop_top_left(8), cls=lambda c: c * 10)
    out = [t(s) for s in shardflow.ShardDataset(mixed, decode="torch")]
    assert [("jpg" in s, "png" in s) for s in out[:2]] == [(True, False), (False, True)]
    assert {tuple(s.get("jpg", s.get("png")).shape) for s in out} == {(3, 8, 8)}
    assert [s["cls"] for s in out] == [0, 10, 20, 0, 10, 20]
    with pytest.raises(MissingFieldError, match=r"sample '0000': no field 'txt' to transform \(fields present: \['cls', 'jpg'\]\)"):
        map_fields({"txt": str})(next(iter(shardflow.ShardDataset(mixed, decode=None))))


def test_field_map_checks_and_pickles():
    with pytest.raises(TypeError, match="not callable"):
        FieldMap({"image": 3})
    with pytest.raises(TypeError, match="non-empty str"):
        FieldMap({"": str})
    t = pickle.loads(pickle.dumps(map_fields({"seg.png": Crop(2)}, cls=int)))
    assert sorted(t.functions) == ["cls", "seg.png"]
    assert "Crop" in repr(t)
    with pytest.raises(TypeError, match="cannot be pickled"):
        # a mapping of lambdas is wrapped too, and refused before workers spawn
        from shardflow.dataset import check_picklable_transform

        check_picklable_transform(map_fields(image=lambda x: x))


def test_indexed_dataset_takes_a_field_mapping(mixed):
    ix = shardflow.IndexedShardDataset(mixed, decode="torch", transform={"image": Crop(4)})
    assert tuple(ix[1]["png"].shape) == (3, 4, 4) and tuple(ix[0]["jpg"].shape) == (3, 4, 4)
