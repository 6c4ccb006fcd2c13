"""The order of the record converters (issue 30): arrays, LMDB, Parquet, PyG (a dataset and a
generator) and JSON lines, each on a class-sorted input of 60 samples.

For each: the shuffled output holds exactly the walk's samples (keys and field bytes, read with
``tarfile``); its order is the one :mod:`shardflow.convert.engine.mixorder` documents, computed
independently (:mod:`tests.order_reference`); a re-run writes the same bytes and another seed
another order; ``order="walk"`` keeps the input's order; a conversion killed after its first
shards resumes, byte-identical to an uninterrupted one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from shardflow.convert.engine.engine import ConvertOptions
from tests.order_reference import reference_parquet, reference_permutation, reference_window
from tests.reference import read_dataset

N, CLASSES, MAX_COUNT, LINE_WINDOW = 60, 3, 8, 10
ROOT = Path(__file__).resolve().parents[1]
OPTIONS = ConvertOptions(max_count=MAX_COUNT, workers=1)


def label(i: int) -> int:
    """Sample ``i``'s class: the inputs are sorted by class (20 of each)."""
    return i * CLASSES // N


def make_arrays(folder: Path) -> str:
    np.save(folder / "x.npy", np.arange(N * 4, dtype=np.int32).reshape(N, 4))
    np.save(folder / "y.npy", np.array([label(i) for i in range(N)], dtype=np.int64))
    return str(folder / "x.npy")


def run_arrays(src: str, dst: str, **kw) -> object:
    from shardflow.convert.records.arrays import convert_arrays

    return convert_arrays(src, dst, labels=os.path.join(os.path.dirname(src), "y.npy"), options=OPTIONS, **kw)


def make_lmdb(folder: Path) -> str:
    lmdb = pytest.importorskip("lmdb")
    env = lmdb.open(str(folder / "db"), map_size=1 << 24)
    with env.begin(write=True) as txn:
        for i in range(N):
            txn.put(f"c{label(i)}/{i:03d}".encode(), f"value {i}".encode())
    env.close()
    return str(folder / "db")


def run_lmdb(src: str, dst: str, **kw) -> object:
    from shardflow.convert.records.lmdb import convert_lmdb

    return convert_lmdb(src, dst, field="bin", options=OPTIONS, **kw)


def make_parquet(folder: Path) -> str:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    table = pa.table({"label": pa.array([label(i) for i in range(N)], pa.int64()),
                      "text": [f"row {i}" for i in range(N)]})  # fmt: skip
    pq.write_table(table, folder / "t.parquet", row_group_size=5)  # 12 row groups of 5 rows
    return str(folder / "t.parquet")


def run_parquet(src: str, dst: str, **kw) -> object:
    from shardflow.convert.records.parquet import convert_parquet

    return convert_parquet(src, dst, options=OPTIONS, **kw)


def make_lines(folder: Path) -> str:
    (folder / "d.jsonl").write_text("".join(json.dumps({"cls": label(i), "i": i}) + "\n" for i in range(N)))
    return str(folder / "d.jsonl")


def run_lines(src: str, dst: str, **kw) -> object:
    from shardflow.convert.records.lines import convert_lines

    return convert_lines(src, dst, window=LINE_WINDOW, options=OPTIONS, **kw)


def graphs(num: int = N) -> list:
    """The PyG case's dataset (a dataset spec: module-level, rebuilt the same in any process)."""
    import torch
    from torch_geometric.data import Data

    return [Data(x=torch.full((2, 3), float(i)), edge_index=torch.tensor([[0, 1], [1, 0]]),
                 y=torch.tensor([label(i)])) for i in range(num)]  # fmt: skip


def graph_stream(num: int = N):
    """The same graphs as a generator (a plain iterable: window-shuffled, one shard's window)."""
    yield from graphs(num)


def make_pyg(folder: Path) -> str:
    pytest.importorskip("torch_geometric")
    return "tests.test_convert_record_orders:graphs"


def make_pyg_stream(folder: Path) -> str:
    pytest.importorskip("torch_geometric")
    return "tests.test_convert_record_orders:graph_stream"


def run_pyg(src: str, dst: str, **kw) -> object:
    from shardflow.convert.pyg import convert_pyg

    return convert_pyg(src, dst, options=OPTIONS, **kw)


@dataclass(frozen=True)
class Case:
    make: Callable[[Path], str]
    run: Callable[..., object]
    walk_keys: list[str]  # today's order
    shuffled: Callable[[int], list[int]]  # seed -> the shuffled order, as positions in the walk


CASES = {
    "arrays": Case(make_arrays, run_arrays, [f"{i:09d}" for i in range(N)], lambda s: reference_permutation(N, s)),
    "lmdb": Case(make_lmdb, run_lmdb, sorted(f"c{label(i)}/{i:03d}" for i in range(N)),
                 lambda s: reference_permutation(N, s)),
    "parquet": Case(make_parquet, run_parquet, [f"{i:09d}" for i in range(N)],
                    lambda s: reference_parquet([5] * 12, MAX_COUNT, s)),
    "lines": Case(make_lines, run_lines, [f"line-{i:09d}" for i in range(1, N + 1)],
                  lambda s: reference_window(N, LINE_WINDOW, s)),
    "pyg": Case(make_pyg, run_pyg, [f"{i:09d}" for i in range(N)], lambda s: reference_permutation(N, s)),
    "pyg-stream": Case(make_pyg_stream, run_pyg, [f"{i:09d}" for i in range(N)],
                       lambda s: reference_window(N, MAX_COUNT, s)),
}  # fmt: skip


def samples(dst: Path) -> list[tuple[str, dict[str, bytes]]]:
    """Every sample of the dataset, in stored order, read by the reference reader (``tarfile``)."""
    return [(s.key, s.fields) for s in read_dataset(dst)[0]]


def shard_files(dst: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(dst.iterdir()) if ".tar" in p.name}


@pytest.mark.parametrize("name", list(CASES))
def test_shuffled_is_the_documented_permutation_of_the_walk(name: str, tmp_path: Path) -> None:
    case = CASES[name]
    src = case.make(tmp_path)
    walk = case.run(src, str(tmp_path / "walk"), order="walk")
    assert walk.meta["order"] == "walk" and walk.meta["order_seed"] == 0
    walked = samples(tmp_path / "walk")
    assert [k for k, _ in walked] == case.walk_keys  # (d) the walk is today's order
    # the default is the shuffle, seed 0
    shuffled = case.run(src, str(tmp_path / "a"))
    assert shuffled.meta["order"] == "shuffled" and shuffled.meta["order_seed"] == 0
    got = samples(tmp_path / "a")
    assert sorted(got) == sorted(walked)  # (a) exactly the same samples, key and bytes
    assert [k for k, _ in got] == [case.walk_keys[i] for i in case.shuffled(0)]  # (b) the documented order
    assert [s.samples for s in shuffled.shards] == [s.samples for s in walk.shards]
    # the classes mixed: the walk's shards hold 1 or 2 classes each, the shuffled ones more
    assert len({label(case.walk_keys.index(k)) for k, _ in got[:MAX_COUNT * 2]}) == CLASSES or name in (
        "lines", "pyg-stream")  # (a stream's window of 8-10 samples mixes only its neighbours)
    # (c) a re-run writes the same bytes; another seed another order, as documented
    case.run(src, str(tmp_path / "b"))
    assert shard_files(tmp_path / "a") == shard_files(tmp_path / "b")
    other = case.run(src, str(tmp_path / "c"), seed=1)
    assert other.meta["order_seed"] == 1
    assert [k for k, _ in samples(tmp_path / "c")] == [case.walk_keys[i] for i in case.shuffled(1)] != [
        k for k, _ in got]


_KILLED = """
import sys
from shardflow.convert.engine import destination
seen = [0]
def checkpoint(point):
    if point == "shard:committed":  # a shard or its index made durable
        seen[0] += 1
        if seen[0] == 6:  # in the fourth shard's commit
            import os
            os._exit(9)
destination.checkpoint = checkpoint
from tests.test_convert_record_orders import CASES
CASES[sys.argv[1]].run(sys.argv[2], sys.argv[3], order="shuffled")
"""


@pytest.mark.parametrize("name", list(CASES))
def test_a_killed_shuffled_conversion_resumes_byte_identical(name: str, tmp_path: Path) -> None:
    case = CASES[name]
    src = case.make(tmp_path)
    clean = case.run(src, str(tmp_path / "clean"), order="shuffled")
    assert clean.meta["order"] == "shuffled"
    dst = tmp_path / "killed"
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(_KILLED), name, src, str(dst)], cwd=ROOT,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 9, proc.stderr  # killed in its fourth shard's commit: some shards done, not all
    assert 1 <= len(list(dst.glob("*.tar"))) < len(list((tmp_path / "clean").glob("*.tar")))
    case.run(src, str(dst), order="shuffled")  # no overwrite: it resumes (a record's shards kept, the rest rewritten)
    assert {p.name: p.read_bytes() for p in sorted(dst.iterdir())} == {
        p.name: p.read_bytes() for p in sorted((tmp_path / "clean").iterdir())}


@pytest.mark.parametrize("window", [1, 2, 7, 100, 5000])
def test_the_window_shuffle_holds_at_most_window_inputs(window: int) -> None:
    """The stream's bound: when output ``p`` leaves, fewer than ``p + window + 1`` inputs were read;
    an input moves by less than ``window`` positions, either way."""
    from shardflow.convert.engine.mixorder import in_window_order, window_shuffled

    n, read = 3000, [0]

    def stream():
        for j in range(n):
            read[0] += 1
            yield j

    out = []
    for p, j in enumerate(window_shuffled(stream(), window, 5)):
        assert read[0] - p <= window  # held now: read but not given out, this one included
        out.append(j)
    assert out == reference_window(n, window, 5)
    assert max(abs(p - j) for p, j in enumerate(out)) < window
    assert out == list(range(n)) if window == 1 else out != list(range(n))
    assert list(in_window_order(iter(range(5)), "walk", 0, 3)) == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match="order must be one of"):
        in_window_order(iter(()), "sorted", 0)
    with pytest.raises(ValueError, match="window must be >= 1"):
        list(window_shuffled(iter(()), 0, 0))


def test_the_cli_passes_order_seed_and_window(tmp_path: Path) -> None:
    """``--order``, ``--seed`` and (lines) ``--window`` reach the converters; text lines keep the
    file's order unless asked, JSON lines are window-shuffled."""
    from shardflow.cli import main

    src = make_lines(tmp_path)
    common = ["--max-count", str(MAX_COUNT), "--workers", "1"]
    assert main(["convert", "lines", src, str(tmp_path / "j"), "--seed", "3", "--window", "7", *common]) == 0
    meta = json.loads((tmp_path / "j" / "shardflow.json").read_text())["meta"]
    assert (meta["order"], meta["order_seed"], meta["order_window"]) == ("shuffled", 3, 7)
    assert [k for k, _ in samples(tmp_path / "j")] == [CASES["lines"].walk_keys[i] for i in reference_window(N, 7, 3)]
    assert main(["convert", "lines", src, str(tmp_path / "t"), "--text", *common]) == 0
    assert [k for k, _ in samples(tmp_path / "t")] == CASES["lines"].walk_keys
    arrays = make_arrays(tmp_path)
    assert main(["convert", "arrays", arrays, str(tmp_path / "a"), "--order", "walk", *common]) == 0
    assert [k for k, _ in samples(tmp_path / "a")] == CASES["arrays"].walk_keys
    assert main(["convert", "arrays", arrays, str(tmp_path / "b"), "--seed", "2", *common]) == 0
    assert [k for k, _ in samples(tmp_path / "b")] == [f"{i:09d}" for i in reference_permutation(N, 2)]
