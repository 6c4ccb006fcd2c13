"""Bad input, the whole kind, through ShardDataset and through the loader with workers.

Sample-level faults (undecodable, truncated and oversized images, a duplicated
field, a missing field, a transform that raises) and shard-level faults (cut
short, zero bytes, a bad header checksum, garbage) under ``on_error`` = raise,
skip and warn, with exact counts. Under skip/warn whole samples are dropped, never
part of one, and counted per reason in ``dataset.stats``; with DataLoader workers
the loader adds up the workers' counters and an error reaches the main process
naming the shard, the key and what was wrong (C07, C09).
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import re

import numpy as np
import pytest

import shardflow
from shardflow.errors import DecodeError, MissingFieldError, SampleError, ShardflowError, ShardFormatError, TruncatedShardError
from shardflow.format.manifest import MANIFEST_NAME, Manifest, ShardInfo
from shardflow.format.tar import END_OF_ARCHIVE, encode_member, encode_sample
from shardflow.writing.writer import write_manifest

pytestmark = pytest.mark.usefixtures("fast_paths")  # the reader tests run with the fast paths on and off

MAX_PIXELS = 5000  # the "bomb" below is 100 x 100 = 10,000 pixels


def jpeg(seed: int, size: int = 32) -> bytes:
    from PIL import Image

    arr = np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def png(side: int) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (side, side), (10, 20, 30)).save(buf, format="PNG")
    return buf.getvalue()


GOOD = jpeg(0)

# key -> (tar bytes of the sample, reason it is bad or None, what the error says)
BAD_KINDS = {
    "garbage_image": (b"garbage!" * 10, "decode", "cannot decode field 'jpg': not an image format"),
    "truncated_image": (GOOD[: len(GOOD) // 2], "decode", "image file is truncated"),
    "bomb": (png(100), "decode", "10000 pixels exceeds max_pixels=5000"),
    "duplicate_field": (None, "duplicate_field", "has the field 'jpg' twice"),
    "missing_field": (None, "missing_field", "has no field 'cls' (fields present: ['jpg'])"),
    "transform_raises": (GOOD, "transform", "transform crash_on_99 raised RuntimeError: bad crop"),
}


def crash_on_99(sample):
    if sample["cls"] == 99:
        raise RuntimeError("bad crop")
    return sample


def bad_sample(key: str, kind: str) -> bytes:
    data, _, _ = BAD_KINDS[kind]
    if kind == "duplicate_field":
        return encode_member(f"{key}.cls", b"1") + encode_member(f"{key}.jpg", GOOD) + encode_member(f"{key}.jpg", GOOD)
    if kind == "missing_field":
        return encode_sample(key, {"jpg": GOOD})
    return encode_sample(key, {"cls": b"99" if kind == "transform_raises" else b"1", "jpg": data})


def good_sample(key: str, i: int) -> bytes:
    return encode_sample(key, {"cls": str(i).encode(), "jpg": jpeg(i + 1)})


def write_tar(path, samples: list[bytes]) -> str:
    path.write_bytes(b"".join(samples) + END_OF_ARCHIVE)
    return str(path)


def manifest_for(folder, counts: dict[str, int]) -> None:
    """A manifest listing ``name -> samples`` (no offset index), in that order.

    Each shard is listed at the size its ``n`` samples took before it was damaged (at least
    one tar block a sample, else the manifest itself is refused as impossible)."""
    shards = []
    for name, n in counts.items():
        data = (folder / name).read_bytes()
        size = max(len(data), n * 512 * 9 + 1024)  # jpg (3000 bytes) + cls: 9 blocks a sample
        shards.append(ShardInfo(url=name, samples=n, bytes=size, sha256=hashlib.sha256(data).hexdigest()))
    write_manifest(str(folder / MANIFEST_NAME), Manifest(shards=shards, fields={"cls": "cls", "jpg": "jpg"}))


def dataset(source, **kwargs):
    return shardflow.ShardDataset(source, fields=("jpg", "cls"), max_pixels=MAX_PIXELS, transform=crash_on_99, **kwargs)


# --------------------------------------------------------------------------- sample level


@pytest.mark.parametrize("kind", list(BAD_KINDS))
def test_each_bad_sample_raises_naming_shard_key_and_reason(tmp_path, kind):
    url = write_tar(tmp_path / f"{kind}.tar", [good_sample("a0", 0), bad_sample("bad", kind), good_sample("a2", 2)])
    with pytest.raises(SampleError) as info:
        list(dataset([url]))
    _, reason, says = BAD_KINDS[kind]
    message = str(info.value)
    assert url in message and "'bad'" in message and says in message, message
    assert info.value.reason == reason
    if kind == "missing_field":
        assert isinstance(info.value, MissingFieldError)
    if reason == "decode":
        assert isinstance(info.value, DecodeError)
    ds = dataset([url], on_error="skip")
    assert [s["__key__"] for s in ds] == ["a0", "a2"]
    assert dict(ds.stats) == {"samples": 2, "skipped": 1, reason: 1}


def test_oversized_image_decodes_under_the_default_limit(tmp_path):
    url = write_tar(tmp_path / "bomb.tar", [encode_sample("big", {"cls": b"1", "png": png(100)})])
    (s,) = shardflow.ShardDataset([url])
    assert s["png"].shape == (100, 100, 3)
    with pytest.raises(DecodeError, match="exceeds max_pixels=9999"):
        list(shardflow.ShardDataset([url], max_pixels=9999))


def mixed_shards(folder) -> list[str]:
    """Two shards of 6 samples: each bad kind once, 6 good samples (g0 .. g5)."""
    folder.mkdir()
    kinds = list(BAD_KINDS)
    urls = []
    for s in range(2):
        samples = []
        for j in range(6):
            i = 6 * s + j
            samples.append(bad_sample(f"b{i:02d}", kinds[i // 2]) if i % 2 else good_sample(f"g{i:02d}", i))
        urls.append(write_tar(folder / f"mixed-{s}.tar", samples))
    return urls


GOOD_KEYS = [f"g{i:02d}" for i in range(0, 12, 2)]
EXPECTED_STATS = {"samples": 6, "skipped": 6, "decode": 3, "duplicate_field": 1, "missing_field": 1, "transform": 1}


@pytest.mark.parametrize("sized", [False, True], ids=["no-manifest", "manifest"])
def test_skip_drops_whole_samples_and_counts_each_reason(tmp_path, sized):
    urls = mixed_shards(tmp_path / "m")
    if sized:
        manifest_for(tmp_path / "m", {"mixed-0.tar": 6, "mixed-1.tar": 6})
    ds = dataset(str(tmp_path / "m") if sized else urls, on_error="skip")
    assert ds.sized is sized
    samples = list(ds)
    assert [s["__key__"] for s in samples] == GOOD_KEYS
    assert all(sorted(s) == ["__key__", "__source__", "__url__", "cls", "jpg"] and s["jpg"].shape == (32, 32, 3) for s in samples)
    assert dict(ds.stats) == EXPECTED_STATS


def test_warn_logs_each_dropped_sample(tmp_path, caplog):
    urls = mixed_shards(tmp_path / "m")
    ds = dataset(urls, on_error="warn")
    with caplog.at_level(logging.WARNING, logger="shardflow.policy"):
        assert [s["__key__"] for s in ds] == GOOD_KEYS
    assert dict(ds.stats) == EXPECTED_STATS
    warned = [r.getMessage() for r in caplog.records if r.name == "shardflow.policy"]
    assert len(warned) == 7
    assert all(re.search(r"mixed-[01]\.tar: sample 'b\d\d'", m) for m in warned[:6]), warned
    # then the total of the pass, by reason
    assert warned[6] == ("on_error='warn': skipped 6 of 12 samples in this pass "
                         "(decode 3, duplicate_field 1, missing_field 1, transform 1)")


def test_through_loader_workers_stats_are_added_up(tmp_path):
    urls = mixed_shards(tmp_path / "m")
    ds = dataset(urls, on_error="skip")
    loader = shardflow.loader(ds, batch_size=2, num_workers=2)
    keys = sorted(k for batch in loader for k in batch["__key__"])
    assert keys == GOOD_KEYS
    assert dict(ds.stats) == EXPECTED_STATS


@pytest.mark.parametrize("kind", ["garbage_image", "duplicate_field", "missing_field"])
def test_through_loader_workers_error_names_shard_key_and_reason(tmp_path, kind):
    folder = tmp_path / "w"
    folder.mkdir()
    first = write_tar(folder / "ok.tar", [good_sample(f"k{i}", i) for i in range(4)])
    url = write_tar(folder / f"{kind}.tar", [good_sample("a0", 0), bad_sample("bad", kind)])
    loader = shardflow.loader(dataset([first, url]), batch_size=2, num_workers=2)
    with pytest.raises(SampleError) as info:
        list(loader)
    message = str(info.value)
    # DataLoader re-raises the worker's exception type with the worker's traceback text
    assert "DataLoader worker process" in message
    assert url in message and "'bad'" in message and BAD_KINDS[kind][2] in message, message


# --------------------------------------------------------------------------- shard level


def c07_bytes() -> tuple[bytes, int]:
    """C07: 10 samples (cls 1 byte, jpg 3000 bytes); the size of one sample."""
    samples = [encode_sample(f"{i:06d}", {"cls": b"1", "jpg": b"\xff" * 3000}) for i in range(10)]
    return b"".join(samples) + END_OF_ARCHIVE, len(samples[0])


def shard_faults(folder) -> dict[str, str]:
    """One shard per fault, plus a good one; returns name -> what the error says."""
    folder.mkdir()
    data, per = c07_bytes()
    (folder / "a-cut.tar").write_bytes(data[: 6 * per + 1024 + 1500])  # 1500 bytes into 000006.jpg
    (folder / "b-zero.tar").write_bytes(b"")
    bad = bytearray(data)
    bad[3 * per + 10] ^= 0xFF  # a byte of the name in sample 3's first header
    (folder / "c-checksum.tar").write_bytes(bytes(bad))
    (folder / "d-garbage.tar").write_bytes(np.random.default_rng(7).integers(0, 256, 5000, dtype=np.uint8).tobytes())
    (folder / "e-good.tar").write_bytes(data)
    (folder / "f-empty.tar").write_bytes(b"\0" * 1024)  # a valid empty tar: 0 samples, no error
    return {
        "a-cut.tar": f"truncated inside member '000006.jpg' (header at byte {6 * per + 512 + 512}",
        "b-zero.tar": "empty file (0 bytes), not a tar archive",
        "c-checksum.tar": f"bad tar header checksum at byte {3 * per}",
        "d-garbage.tar": "header at byte 0 has a non-octal checksum field",
    }


# what skip keeps of each faulty shard, and the reason counted
KEPT = {"a-cut.tar": 6, "b-zero.tar": 0, "c-checksum.tar": 2, "d-garbage.tar": 0}
REASON = {"a-cut.tar": "truncated_shard", "b-zero.tar": "truncated_shard", "c-checksum.tar": "bad_shard", "d-garbage.tar": "bad_shard"}


@pytest.mark.parametrize("name", list(KEPT))
def test_each_bad_shard_raises_naming_it(tmp_path, name):
    says = shard_faults(tmp_path / "s")
    url = str(tmp_path / "s" / name)
    with pytest.raises(ShardFormatError) as info:
        list(shardflow.ShardDataset([url], decode=None))
    assert url in str(info.value) and says[name] in str(info.value), str(info.value)
    assert info.value.reason == REASON[name]
    if REASON[name] == "truncated_shard":
        assert isinstance(info.value, TruncatedShardError)


@pytest.mark.parametrize("sized", [False, True], ids=["no-manifest", "manifest"])
def test_bad_shards_skip_exact(tmp_path, sized):
    shard_faults(tmp_path / "s")
    names = ["a-cut.tar", "b-zero.tar", "c-checksum.tar", "d-garbage.tar", "e-good.tar", "f-empty.tar"]
    if sized:  # the manifest says what each shard should hold
        manifest_for(tmp_path / "s", {n: (0 if n == "f-empty.tar" else 10) for n in names})
    source = str(tmp_path / "s") if sized else [str(tmp_path / "s" / n) for n in names]
    ds = shardflow.ShardDataset(source, decode=None, on_error="skip")
    keys = [(s["__url__"].rsplit("/", 1)[-1], s["__key__"]) for s in ds]
    expected = [(n, f"{i:06d}") for n in names for i in range(KEPT.get(n, 10 if n == "e-good.tar" else 0))]
    assert keys == expected
    # never a partial sample: every kept sample has both fields, whole
    assert all(len(s["jpg"]) == 3000 and s["cls"] == b"1" for s in ds)
    # without a manifest, the damaged sample of a-cut and of c-checksum is counted (how many
    # followed it is unknown); b-zero and d-garbage hold no sample to lose
    stats = {"samples": 18, "truncated_shard": 2, "bad_shard": 2, "lost_samples": 2, "skipped": 2}
    if sized:  # the manifest counts tell how many samples each shard took with it
        stats["lost_samples"] = stats["skipped"] = 4 + 10 + 8 + 10
    assert dict(ds.stats) == stats


def test_bad_shards_through_loader_workers(tmp_path):
    shard_faults(tmp_path / "s")
    names = ["a-cut.tar", "b-zero.tar", "c-checksum.tar", "e-good.tar"]
    manifest_for(tmp_path / "s", {n: 10 for n in names})
    # batch 10 = one shard per batch, in stored order: worker 0 reads a, c and worker 1 reads b, e
    ds = shardflow.ShardDataset(str(tmp_path / "s"), decode=None, on_error="skip")
    loader = shardflow.loader(ds, batch_size=10, num_workers=2)
    batches = list(loader)
    assert len(batches) == len(loader) == 4
    keys = sorted((u.rsplit("/", 1)[-1], k) for b in batches for u, k in zip(b["__url__"], b["__key__"]))
    # the batch of b-zero.tar lost every sample: the loader repeats the batch before it (a-cut's)
    # so that len(loader) batches still come out (DDP ranks stay in step)
    assert keys == sorted([("a-cut.tar", f"{i:06d}") for i in range(6)] * 2) + [("c-checksum.tar", f"{i:06d}") for i in range(2)] + [
        ("e-good.tar", f"{i:06d}") for i in range(10)
    ]
    assert dict(ds.stats) == {
        "samples": 18,
        "truncated_shard": 2,
        "bad_shard": 1,
        "lost_samples": 22,
        "skipped": 22,
        "repeated_batches": 1,
    }
    ds = shardflow.ShardDataset(str(tmp_path / "s"), decode=None)
    with pytest.raises(TruncatedShardError, match=re.escape(str(tmp_path / "s" / "a-cut.tar")) + ": truncated inside member '000006.jpg'"):
        list(shardflow.loader(ds, batch_size=10, num_workers=2))


# --------------------------------------------------------------------------- a pass that can yield nothing


def all_bad(folder) -> str:
    folder.mkdir()
    for s in range(3):
        write_tar(folder / f"bad-{s}.tar", [bad_sample(f"{s}-{i}", "garbage_image") for i in range(4)])
    return str(folder)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_pass_that_yields_nothing_fails(tmp_path, workers):
    folder = all_bad(tmp_path / "x")
    ds = dataset(folder, on_error="skip")
    with pytest.raises(ShardflowError, match="yielded no sample") as info:
        list(shardflow.loader(ds, batch_size=2, num_workers=workers))
    assert "'decode': 12" in str(info.value)
    assert ds.stats["skipped"] == 12 and ds.stats["samples"] == 0


def test_a_long_run_of_bad_samples_fails_before_the_end(tmp_path):
    folder = tmp_path / "long"
    folder.mkdir()
    write_tar(folder / "bad.tar", [bad_sample(f"{i:05d}", "garbage_image") for i in range(1100)] + [good_sample("zz", 1)])
    ds = dataset(str(folder), on_error="skip")
    with pytest.raises(ShardflowError, match="1000 bad samples in a row and none good"):
        list(ds)
    assert ds.stats["decode"] == 1000 and ds.stats["samples"] == 0


def test_a_field_no_sample_has_fails_fast_over_a_remote_manifest(http_server, tmp_path):
    with shardflow.ShardWriter(str(tmp_path / "f" / "f-%06d.tar")) as sink:
        for i in range(5):
            sink.write({"__key__": f"{i:04d}", "input.jpg": GOOD})
    for name in os.listdir(tmp_path / "f"):
        http_server.put(name, (tmp_path / "f" / name).read_bytes())
    with pytest.raises(MissingFieldError, match=r"'jpg'.*\['input.jpg'\]"):
        shardflow.ShardDataset(http_server.url, fields=("jpg",))
