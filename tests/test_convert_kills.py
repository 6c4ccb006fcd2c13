"""A conversion killed at any point resumes without ``--overwrite``, byte-identical to an
uninterrupted run (issue 25, case k).

Every point where a conversion makes something durable calls
``shardflow.convert.engine.destination.checkpoint(point)`` (a no-op). A subprocess runs the conversion
with that function replaced by one that ``os._exit``-s at the n-th call of one point (a real kill:
no ``finally``, no cleanup); then the same conversion runs again here, without ``overwrite``, and
every file of the destination must equal an uninterrupted run's. Every ``(point, n)`` that the
uninterrupted run reaches is tried, not a sample.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import shardflow

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parents[1]
INPUTS = 7
MAX_COUNT = 2


def sample(i: int) -> dict:
    return {"__key__": f"{i:06d}", "txt": f"sample {i} " * 20, "cls": i}


def _run(dest: Path, point: str | None = None, n: int = 0) -> tuple[int, list[str]]:
    script = textwrap.dedent(f"""
        import json, os, sys
        from shardflow.convert.engine import destination
        seen, log = {{}}, []
        def checkpoint(point):
            seen[point] = seen.get(point, 0) + 1
            log.append([point, seen[point]])
            if (point, seen[point]) == ({point!r}, {n}):
                os._exit(9)
        destination.checkpoint = checkpoint
        import shardflow
        from tests.test_convert_kills import sample
        shardflow.write_shards(sample, range({INPUTS}), {str(dest)!r}, max_count={MAX_COUNT}, workers=1)
        print(json.dumps(log))
    """)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    if proc.returncode == 0:
        return 0, [f"{p}#{k}" for p, k in json.loads(proc.stdout.strip().splitlines()[-1])]
    assert proc.returncode == 9, proc.stderr
    return 9, []


def _files(dest: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(dest.iterdir())}


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, bytes], list[str]]:
    dest = tmp_path_factory.mktemp("reference") / "out"
    rc, points = _run(dest)
    assert rc == 0
    return _files(dest), points


def test_the_conversion_has_checkpoints_at_every_durable_step(reference) -> None:
    files, points = reference
    kinds = {p.split("#")[0] for p in points}
    assert kinds == {"record:start", "shard:committed", "record:written", "manifest:written"}, points
    assert sum(p.startswith("shard:committed") for p in points) == 8  # 7 inputs, 2 per shard: 4 shards + 4 indexes
    assert sorted(n for n in files if n.endswith(".tar")) == [f"train-{i:06d}.tar" for i in range(4)]


def test_every_kill_point_resumes_byte_identical_without_overwrite(reference, tmp_path: Path) -> None:
    files, points = reference
    tried = 0
    for at in points:
        point, n = at.split("#")
        dest = tmp_path / f"kill-{point.replace(':', '-')}-{n}" / "out"
        rc, _ = _run(dest, point, int(n))
        assert rc == 9, f"{at}: the conversion was not killed there"
        tried += 1
        shardflow.write_shards(sample, range(INPUTS), str(dest), max_count=MAX_COUNT, workers=1)  # no overwrite
        got = _files(dest)
        assert sorted(got) == sorted(files), at
        for name in files:
            assert got[name] == files[name], f"killed at {at}: {name} differs after the resume"
    assert tried == len(points) >= 8
