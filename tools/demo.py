"""The main job, end to end, on real images: image folder -> shards -> one shuffled training epoch.

1. Builds an ImageFolder tree from images that installed packages ship:
   scikit-learn's ``load_digits`` (1,797 grey 8x8 digits, classes ``digit_0`` .. ``digit_9``,
   upscaled to 32x32 PNG) and photos (scikit-image's astronaut, coffee, chelsea, rocket,
   camera, coins, immunohistochemistry, colorwheel and scikit-learn's two sample photos), each
   photo a class of deterministic random crops of varied sizes saved as JPEG. A little junk
   (``.DS_Store``, a README) is added, as real folders have.
2. Converts it with the command line: ``shardflow convert imagefolder SRC DST``.
3. Streams one shuffled epoch through ``shardflow.loader(ShardDataset(DST, shuffle=True,
   decode="torch", transform=...), batch_size=64, num_workers=2)``, every image resized to
   3x32x32, and checks that every sample was seen exactly once.

Usage::

    python tools/demo.py [--out DIR] [--crops N]
"""

from __future__ import annotations

import argparse
import collections
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

import shardflow

SIZE = 32
IMAGE_FIELDS = ("jpg", "jpeg", "png")


def photo_sources() -> dict[str, np.ndarray]:
    """Named photos (uint8, HxW or HxWx3) shipped by scikit-image and scikit-learn."""
    import skimage.data
    from sklearn.datasets import load_sample_images

    photos = {
        name: getattr(skimage.data, name)()
        for name in ("astronaut", "coffee", "chelsea", "rocket", "camera", "coins", "immunohistochemistry", "colorwheel")
    }
    sample = load_sample_images()
    for filename, image in zip(sample.filenames, sample.images):
        photos[Path(filename).stem] = image  # china, flower
    return photos


def build_image_folder(root: Path, crops: int) -> int:
    """Write the ImageFolder tree; returns the number of images."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    count = 0
    for i, (pixels, label) in enumerate(zip(digits.images, digits.target)):
        grey = (pixels * (255.0 / 16.0)).round().astype(np.uint8)
        image = Image.fromarray(grey, "L").resize((SIZE, SIZE), Image.Resampling.BILINEAR)
        folder = root / f"digit_{label}"
        folder.mkdir(parents=True, exist_ok=True)
        image.save(folder / f"{i:04d}.png")
        count += 1
    rng = np.random.default_rng(0)
    for name, array in photo_sources().items():
        folder = root / name
        folder.mkdir(parents=True, exist_ok=True)
        height, width = array.shape[:2]
        for j in range(crops):
            side = int(rng.integers(min(height, width) // 4, min(height, width) // 2))
            top = int(rng.integers(0, height - side))
            left = int(rng.integers(0, width - side))
            crop = Image.fromarray(array[top : top + side, left : left + side])
            crop = crop.resize((int(rng.integers(48, 97)), int(rng.integers(48, 97))), Image.Resampling.BILINEAR)
            suffix = ".JPG" if j % 5 == 4 else ".jpg"  # upper-case extensions count too
            crop.convert("RGB").save(folder / f"crop_{j:02d}{suffix}", quality=90)
            count += 1
    (root / ".DS_Store").write_bytes(b"\0\0\0\1Bud1")
    (root / "coffee" / "README.txt").write_text("crops of skimage.data.coffee()\n")
    return count


def to_fixed_size(sample: dict) -> dict:
    """Transform (module level so DataLoader workers can pickle it): any image -> uint8 (3, 32, 32)."""
    image = next(sample[f] for f in IMAGE_FIELDS if f in sample)
    if image.shape[1:] != (SIZE, SIZE):
        resized = F.interpolate(image[None].float(), size=(SIZE, SIZE), mode="bilinear", antialias=True, align_corners=False)
        image = resized[0].round().clamp(0, 255).to(torch.uint8)
    return {"__key__": sample["__key__"], "image": image, "cls": sample["cls"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("/tmp/shardflow-demo"), help="work folder (default /tmp/shardflow-demo)")
    parser.add_argument("--crops", type=int, default=24, help="crops per photo class (default 24)")
    parser.add_argument("--max-count", type=int, default=256, help="samples per shard (default 256)")
    parser.add_argument("--workers", type=int, default=2, help="DataLoader workers and converter processes (default 2)")
    args = parser.parse_args(argv)

    images, shards = args.out / "images", args.out / "shards"
    for folder in (images, shards):
        shutil.rmtree(folder, ignore_errors=True)

    start = time.perf_counter()
    written = build_image_folder(images, args.crops)
    print(f"[1/3] image folder: {written} images in {images} ({time.perf_counter() - start:.1f} s)")

    cmd = [
        sys.executable, "-m", "shardflow.cli", "convert", "imagefolder", str(images), str(shards),
        "--max-count", str(args.max_count), "--workers", str(args.workers),
    ]  # fmt: skip
    print("[2/3] $ shardflow " + " ".join(cmd[3:]))
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        print(done.stderr, file=sys.stderr)
        return done.returncode
    print("      " + done.stdout.strip())

    dataset = shardflow.ShardDataset(str(shards), shuffle=True, seed=0, decode="torch", transform=to_fixed_size)
    manifest = dataset.manifest
    idx_to_class = {i: c for c, i in manifest.meta["class_to_idx"].items()}
    loader = shardflow.loader(dataset, batch_size=64, num_workers=args.workers)
    seen: collections.Counter[str] = collections.Counter()
    labels: collections.Counter[int] = collections.Counter()
    batches = 0
    shapes = set()
    start = time.perf_counter()
    first, first_size = 0.0, 0
    for batch in loader:
        if not batches:
            first, first_size = time.perf_counter() - start, len(batch["__key__"])
        batches += 1
        seen.update(batch["__key__"])
        labels.update(batch["cls"].tolist())
        shapes.add((tuple(batch["image"].shape[1:]), batch["image"].dtype))
    seconds = time.perf_counter() - start
    samples = sum(seen.values())

    print(f"[3/3] one shuffled epoch: shardflow.loader(ShardDataset(shuffle=True, decode='torch'), batch_size=64, num_workers={args.workers})")
    print(f"      samples   {samples}")
    print(f"      classes   {len(idx_to_class)}: " + ", ".join(f"{idx_to_class[i]}={labels[i]}" for i in sorted(idx_to_class)))
    print(f"      shards    {len(manifest.shards)}")
    print(f"      batches   {batches} (image {sorted(shapes)})")
    steady = (samples - first_size) / max(seconds - first, 1e-9)
    print(
        f"      rate      {samples / seconds:,.0f} samples/s over the epoch ({seconds:.2f} s, worker start-up included); "
        f"first batch after {first:.2f} s, then {steady:,.0f} samples/s"
    )
    dupes = [k for k, n in seen.items() if n > 1]
    ok = samples == manifest.num_samples == written and not dupes
    ok = ok and dict(labels) == {manifest.meta["class_to_idx"][c]: n for c, n in manifest.meta["class_counts"].items() if n}
    print(f"      check     every key seen exactly once: {'OK' if ok else 'FAILED'} ({len(seen)} unique keys, {len(dupes)} repeated)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
