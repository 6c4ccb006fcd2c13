"""shardflow.write_shards: output independent of the worker count, the boundary rule,
resuming after a crash, errors naming the input, and refusing another dataset."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import shardflow
from shardflow.errors import ConversionError, DestinationExistsError, SampleError
from shardflow.format.manifest import Manifest

pytestmark = pytest.mark.timeout(120)

N = 60


def fan(i: int):
    """0, 1 or many samples per input: None for i % 5 == 0, one dict for i % 5 == 1,
    a list of i % 4 samples otherwise (of different sizes)."""
    if i % 5 == 0:
        return None
    if i % 5 == 1:
        return {"__key__": f"in{i:04d}", "txt": f"one sample of input {i}"}
    return [{"__key__": f"in{i:04d}-{j}", "bin": bytes([i % 251]) * (100 * i + j), "cls": j} for j in range(i % 4)]


def fails_at_37(i: int):
    if i == 37 and os.environ.get("SHARDFLOW_TEST_FAIL"):
        raise RuntimeError("disk on fire")
    return fan(i)


def folder_bytes(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


def test_bytes_do_not_depend_on_workers(tmp_path: Path) -> None:
    runs = {}
    for workers in (1, 3):
        dst = tmp_path / f"w{workers}"
        shardflow.write_shards(fan, range(N), str(dst), max_count=7, group_size=10, max_bytes=8 << 10, workers=workers)
        runs[workers] = folder_bytes(dst)
    assert runs[1] == runs[3]
    assert any(name.endswith(".tar") for name in runs[1])


def test_boundary_rule(tmp_path: Path) -> None:
    """Groups of 10 inputs; a group's samples fill shards of at most 7; names by group and part."""
    m = shardflow.write_shards(fan, range(N), str(tmp_path / "d"), max_count=7, group_size=10, workers=1)
    expected: list[tuple[str, list[str]]] = []
    for g in range(N // 10):
        keys = []
        for i in range(10 * g, 10 * g + 10):
            out = fan(i)
            keys += [] if out is None else [out["__key__"]] if isinstance(out, dict) else [s["__key__"] for s in out]
        parts = [keys[k : k + 7] for k in range(0, len(keys), 7)]
        names = [f"train-{g:06d}.tar"] + [f"train-{g:06d}_{k:04d}.tar" for k in range(1, len(parts))]
        expected += list(zip(names, parts))
    assert [(s.url, s.samples) for s in m.shards] == [(n, len(k)) for n, k in expected]
    got = [s["__key__"] for s in shardflow.ShardDataset(str(tmp_path / "d"), decode=None)]
    assert got == [k for _, keys in expected for k in keys]
    assert sorted(s.url for s in m.shards) == [s.url for s in m.shards]  # sorted names are stream order


def test_max_bytes_cuts_inside_a_group(tmp_path: Path) -> None:
    samples = lambda i: [{"__key__": f"k{i}-{j}", "bin": b"x" * 3000} for j in range(4)]  # noqa: E731
    m = shardflow.write_shards(samples, range(2), str(tmp_path / "d"), max_count=100, max_bytes=8000, workers=1)
    # 3,000 bytes + header counted as 4,023: two samples fit in 8,000 bytes
    assert [(s.url, s.samples) for s in m.shards] == [
        ("train-000000.tar", 2), ("train-000000_0001.tar", 2), ("train-000000_0002.tar", 2), ("train-000000_0003.tar", 2),
    ]  # fmt: skip


def test_crash_mid_run_resumes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    clean = tmp_path / "clean"
    shardflow.write_shards(fails_at_37, range(N), str(clean), max_count=7, group_size=10, workers=2)
    dst = tmp_path / "crashed"
    monkeypatch.setenv("SHARDFLOW_TEST_FAIL", "1")
    with pytest.raises(ConversionError, match=r"input 37.*disk on fire") as err:
        shardflow.write_shards(fails_at_37, range(N), str(dst), max_count=7, group_size=10, workers=1)
    assert "train-000003" in str(err.value)  # the shard it was writing
    crashed = Manifest.loads((dst / "shardflow.json").read_bytes())
    assert crashed.meta["conversion"]["complete"] is False
    kept = {s.url: (dst / s.url).stat().st_mtime_ns for s in crashed.shards}
    assert {u[: len("train-000000")] for u in kept} == {"train-000000", "train-000001", "train-000002"}
    monkeypatch.delenv("SHARDFLOW_TEST_FAIL")
    seen: list[int] = []

    class Progress:
        def __call__(self, n: int) -> None:
            seen.append(n)

        def kept(self, shards: int) -> None:
            seen.append(-shards)

    shardflow.write_shards(fails_at_37, range(N), str(dst), max_count=7, group_size=10, workers=2, progress=Progress())
    assert {u: (dst / u).stat().st_mtime_ns for u in kept} == kept  # finished shards were not rewritten
    assert -len(kept) in seen
    assert folder_bytes(dst) == folder_bytes(clean)


def test_errors_name_the_input(tmp_path: Path) -> None:
    with pytest.raises(ConversionError, match=r"input 'b': fn returned a int"):
        shardflow.write_shards(lambda x: 3, ["a", "b"][1:], str(tmp_path / "a"), workers=1)
    with pytest.raises(SampleError, match=r"input 'x'.*__key__"):
        shardflow.write_shards(lambda x: {"txt": "no key"}, ["x"], str(tmp_path / "b"), workers=1)


def test_refuses_another_dataset_unless_overwrite(tmp_path: Path) -> None:
    dst = tmp_path / "d"
    with shardflow.ShardWriter(str(dst / "old-%06d.tar"), max_count=2) as sink:
        for i in range(5):
            sink.write({"__key__": f"o{i}", "txt": "old"})
    before = folder_bytes(dst)
    with pytest.raises(DestinationExistsError, match="already holds a dataset not written by a shardflow converter"):
        shardflow.write_shards(fan, range(10), str(dst), max_count=7, workers=1)
    assert folder_bytes(dst) == before  # nothing touched
    (dst / "notes.md").write_text("mine")
    m = shardflow.write_shards(fan, range(10), str(dst), max_count=7, workers=1, overwrite=True)
    names = sorted(p.name for p in dst.iterdir())
    assert not any(n.startswith("old-") for n in names)  # the old shards are gone, not left beside
    assert "notes.md" in names
    assert [(s.url, s.samples) for s in m.shards] == [("train-000000.tar", 7), ("train-000001.tar", 4)]
    # the same conversion again is not another dataset: it resumes (everything kept)
    again = shardflow.write_shards(fan, range(10), str(dst), max_count=7, workers=1)
    assert again.to_json() == m.to_json()
    # tar files without a manifest are a dataset too
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "x.tar").write_bytes(b"\0" * 1024)
    with pytest.raises(DestinationExistsError, match="1 tar file"):
        shardflow.write_shards(fan, range(3), str(bare), workers=1)


def test_record_beside_manifest(tmp_path: Path) -> None:
    dst = tmp_path / "d"
    shardflow.write_shards(fan, range(20), str(dst), max_count=7, group_size=10, workers=1)
    record = json.loads((dst / ".shardflow-convert.json").read_bytes())
    assert record["identity"] == {"converter": "write_shards", "fn": "tests.test_convert_write.fan"}
    assert sorted(record["groups"]) == ["0", "1"]
    manifest = json.loads((dst / "shardflow.json").read_bytes())
    assert manifest["meta"] == {"conversion": {"complete": True}}  # nothing run-specific in the manifest


def test_a_second_conversion_into_a_busy_folder_is_refused(tmp_path):
    """One writer per local destination: while a conversion runs, another one (or a
    ShardWriter) into the same folder gets DestinationLockedError naming the holder."""
    from shardflow.storage import DestinationLockedError

    dst = tmp_path / "out"
    seen = []

    def fn(i):
        if i == 3 and not seen:
            with pytest.raises(DestinationLockedError, match=f"pid {os.getpid()}"):
                shardflow.write_shards(lambda j: {"__key__": f"{j:04d}", "cls": j}, range(2), str(dst), workers=1)
            seen.append(True)
        return {"__key__": f"{i:04d}", "cls": i}

    manifest = shardflow.write_shards(fn, range(6), str(dst), max_count=4, workers=1)
    assert seen == [True]
    assert [s.samples for s in manifest.shards] == [4, 2]
    assert not (dst / ".shardflow.lock").exists()  # released, and removed, at the end
    again = shardflow.write_shards(fn, range(6), str(dst), max_count=4, workers=1)  # free again: resumes
    assert [s.samples for s in again.shards] == [4, 2]


def test_a_build_function_that_does_not_pickle_is_an_error_with_workers(tmp_path: Path) -> None:
    """It used to hang: the process pool's feeder thread dropped the task, and its shutdown waited forever."""
    dst = tmp_path / "out"
    with pytest.raises(ConversionError, match=r"cannot be sent to a worker process.*workers=1") as info:
        shardflow.write_shards(lambda i: {"__key__": f"{i:04d}", "cls": i}, range(50), str(dst), max_count=10, workers=2)
    assert info.value.__cause__ is not None  # pickle's own error, chained
    assert not list(dst.glob("*.tar")) and not (dst / "shardflow.json").exists()
    # an input that does not pickle (a lock) is the same error; a module-level function works
    import threading

    with pytest.raises(ConversionError, match="cannot be sent to a worker process"):
        shardflow.write_shards(fan, [1, threading.Lock()], str(tmp_path / "lock"), max_count=1, workers=2)
    m = shardflow.write_shards(fan, range(N), str(tmp_path / "ok"), max_count=10, workers=2)
    assert m.num_samples == sum(0 if i % 5 == 0 else 1 if i % 5 == 1 else i % 4 for i in range(N))
