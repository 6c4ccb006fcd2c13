"""``convert pyg``: PyG datasets, lists and generators of graphs into shards (C13 and the view trap)."""

import json
import os
import random
import subprocess
import sys

import numpy as np
import pytest
import torch

import shardflow
from shardflow.convert.engine.engine import ConvertOptions
from shardflow.errors import ConversionError, DestinationExistsError, SampleError

pyg = pytest.importorskip("torch_geometric")
from torch_geometric.data import Data, HeteroData, InMemoryDataset, OnDiskDataset  # noqa: E402

from shardflow.convert.pyg import DatasetSpec, convert_pyg, graph_schema, merge_schemas  # noqa: E402
from shardflow.convert.pyg import to_shards  # noqa: E402
from tests.order_reference import reference_permutation, reference_window  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIELD = "graph.pyg"
ONE_GRAPH = Data(x=torch.zeros(2, 1))


# ------------------------------------------------------------------ graph sources (importable by spec)


def c13_graph(i: int, seed: int = 0) -> Data:
    """Graph ``i`` of the C13 stream: 5-50 nodes, 4-dim float32 edge_attr, all from (seed, i)."""
    rng = np.random.Generator(np.random.Philox(key=seed << 32 | i))
    n = int(rng.integers(5, 51))
    e = int(rng.integers(n, 3 * n + 1))
    return Data(
        x=torch.from_numpy(rng.standard_normal((n, 3), dtype=np.float32)),
        edge_index=torch.from_numpy(rng.integers(0, n, (2, e))),
        edge_attr=torch.from_numpy(rng.standard_normal((e, 4), dtype=np.float32)),
        y=i % 7,
    )


def c13_graphs(num_graphs: int = 50_000, seed: int = 0):
    """C13: a generator (not indexable) of ``num_graphs`` graphs."""
    for i in range(num_graphs):
        yield c13_graph(i, seed)


def graph_list(num_graphs: int = 30):
    """A plain list of graphs (indexable): a spec may return one."""
    return [c13_graph(i, 1) for i in range(num_graphs)]


def _own_bytes(graph) -> int:
    return sum(v.numel() * v.element_size() for _, v in graph if isinstance(v, torch.Tensor))


class TinyGraphs(InMemoryDataset):
    """An InMemoryDataset on disk: random networkx graphs turned into Data, saved by ``save``."""

    def __init__(self, root, num_graphs=300, transform=None):
        self.num = num_graphs
        super().__init__(root, transform, log=False)
        self.load(self.processed_paths[0])

    @property
    def processed_file_names(self):
        return [f"graphs-{self.num}.pt"]

    def process(self):
        import networkx as nx
        from torch_geometric.utils import from_networkx

        rng = np.random.default_rng(3)
        graphs = []
        for i in range(self.num):
            n = int(rng.integers(20, 61))
            g = from_networkx(nx.gnm_random_graph(n, 2 * n, seed=i))
            g.x = torch.from_numpy(rng.standard_normal((n, 16), dtype=np.float32))
            g.edge_attr = torch.from_numpy(rng.standard_normal((g.num_edges, 4), dtype=np.float32))
            g.y = torch.tensor([i % 3])
            g.name = f"g{i}"
            graphs.append(g)
        self.save(graphs, self.processed_paths[0])


class DiskGraphs(OnDiskDataset):
    """An OnDiskDataset (SQLite) of C13 graphs."""

    def __init__(self, root, num_graphs=40):
        self.num = num_graphs
        super().__init__(root, log=False)

    def process(self):
        self.extend([c13_graph(i, 2) for i in range(self.num)])


def assert_graph_equal(got, want):
    assert type(got) is type(want)
    assert sorted(got.keys()) == sorted(want.keys())
    for key in want.keys():
        a, b = got[key], want[key]
        if isinstance(b, torch.Tensor):
            assert a.dtype == b.dtype and a.shape == b.shape, key
            assert torch.equal(a, b), key
        else:
            assert a == b, key
    assert got.num_nodes == want.num_nodes


def read_all(folder):
    ds = shardflow.ShardDataset(folder)
    return {s["__key__"]: s[FIELD] for s in ds}


# ------------------------------------------------------------------ C13


_RSS_SCRIPT = """
import json, sys, time
from shardflow.convert.pyg import convert_pyg
from shardflow.convert.engine.engine import ConvertOptions
t = time.perf_counter()
m = convert_pyg("tests.test_convert_pyg:c13_graphs", sys.argv[1], kwargs={"num_graphs": int(sys.argv[2])},
                options=ConvertOptions(max_count=1000))
# VmHWM: this process's peak RSS since exec (ru_maxrss can carry the forking parent's peak)
hwm = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:"))
print(json.dumps({"rss_kb": hwm, "seconds": time.perf_counter() - t, "shards": len(m.shards)}))
"""


def _convert_in_subprocesses(jobs):
    """Run one conversion per (dst, count) in its own process, at the same time;
    returns their reports (peak RSS of each process in KiB, seconds, shards)."""
    if not os.path.exists("/proc/self/status"):
        pytest.skip("peak RSS is read from /proc/self/status (Linux)")
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _RSS_SCRIPT, str(dst), str(n)],
            cwd=REPO, env={**os.environ, "PYTHONPATH": REPO}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        for dst, n in jobs
    ]
    reports = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
        reports.append(json.loads(out.strip().splitlines()[-1]))
    return reports


@pytest.mark.slow
def test_c13_generator_streams_flat_memory_and_reads_back(tmp_path):
    """C13: 50,000 generated graphs, shards of 1,000: peak RSS flat against 12,500,
    50 shards adding up to 50,000, random graphs read back exactly."""
    small, big = _convert_in_subprocesses([(tmp_path / "small", 12_500), (tmp_path / "big", 50_000)])
    assert small["shards"] == 13 and big["shards"] == 50
    # 4x the graphs, the same peak memory (one shard of encoded bytes is held at a time);
    # holding the graphs would add ~100 MB per 12,500 graphs of this size
    assert big["rss_kb"] <= small["rss_kb"] * 1.10, (small, big)

    manifest = shardflow.ShardDataset(str(tmp_path / "big")).manifest
    assert len(manifest.shards) == 50
    assert [s.samples for s in manifest.shards] == [1000] * 50
    assert sum(s.samples for s in manifest.shards) == 50_000
    assert manifest.meta["num_graphs"] == 50_000
    assert manifest.meta["size_columns"] == ["num_nodes", "num_edges"]
    attrs = manifest.meta["graph"]["stores"][0]["attrs"]
    assert attrs["edge_attr"] == {"dtype": "float32", "shape": [None, 4]}
    assert attrs["edge_index"] == {"dtype": "int64", "shape": [2, None]}

    # a generator's graphs go through the window shuffle of one shard (1,000 graphs, the default)
    assert manifest.meta["order"] == "shuffled" and manifest.meta["order_window"] == 1000
    stored = reference_window(50_000, 1000)  # position p holds graph stored[p]
    ds = shardflow.IndexedShardDataset(str(tmp_path / "big"))
    rng = np.random.default_rng(13)
    for p in sorted(rng.choice(50_000, size=40, replace=False).tolist()) + [0, 49_999]:
        sample = ds[p]
        assert sample["__key__"] == f"{stored[p]:09d}"
        assert_graph_equal(sample[FIELD], c13_graph(stored[p]))
    # the sizes index holds (num_nodes, num_edges) of every graph
    costs = shardflow.ShardDataset(str(tmp_path / "big")).source.load_costs("num_edges", shardflow.IOOptions())
    assert costs[:5].tolist() == [c13_graph(i).num_edges for i in stored[:5]]


def test_generator_resume_keeps_finished_shards(tmp_path):
    dst = str(tmp_path / "out")
    spec = "tests.test_convert_pyg:c13_graphs"
    first = convert_pyg(spec, dst, kwargs={"num_graphs": 250}, options=ConvertOptions(max_count=100))
    mtimes = {s.url: os.stat(os.path.join(dst, s.url)).st_mtime_ns for s in first.shards}
    again = convert_pyg(spec, dst, kwargs={"num_graphs": 250}, options=ConvertOptions(max_count=100))
    assert [s.sha256 for s in again.shards] == [s.sha256 for s in first.shards]
    assert {s.url: os.stat(os.path.join(dst, s.url)).st_mtime_ns for s in again.shards} == mtimes
    # another source into the same folder is another dataset: refused unless overwrite (issue 15)
    with pytest.raises(DestinationExistsError, match="seed"):
        convert_pyg(spec, dst, kwargs={"num_graphs": 250, "seed": 5}, options=ConvertOptions(max_count=100))
    other = convert_pyg(
        spec, dst, kwargs={"num_graphs": 250, "seed": 5}, options=ConvertOptions(max_count=100, overwrite=True)
    )
    assert all(a.sha256 != b.sha256 for a, b in zip(other.shards, first.shards))


# ------------------------------------------------------------------ InMemoryDataset / OnDiskDataset roots


@pytest.mark.parametrize("workers", [1, 2])
def test_in_memory_dataset_root_bytes_proportional(tmp_path, workers):
    """Graphs of an InMemoryDataset are views into the collated storage: each is stored by
    its own elements (the 78 GB trap would write the whole storage per graph)."""
    root = str(tmp_path / "root")
    ds = TinyGraphs(root)
    assert ds[0].x.untyped_storage().nbytes() > 50 * ds[0].x.numel() * 4  # really views
    m = convert_pyg(
        "tests.test_convert_pyg:TinyGraphs", str(tmp_path / "shards"), root=root,
        options=ConvertOptions(max_count=64, workers=workers),
    )  # fmt: skip
    own = sum(_own_bytes(ds[i]) for i in range(len(ds)))
    total = sum(s.bytes for s in m.shards)
    assert own < total < 2 * own
    assert [s.samples for s in m.shards] == [64, 64, 64, 64, 44]
    meta = m.meta
    assert meta["dataset_class"] == "tests.test_convert_pyg.TinyGraphs"
    assert meta["num_graphs"] == 300 and meta["num_classes"] == 3
    assert meta["num_node_features"] == 16 and meta["num_edge_features"] == 4
    attrs = meta["graph"]["stores"][0]["attrs"]
    assert attrs["x"] == {"dtype": "float32", "shape": [None, 16]}
    assert attrs["name"] == {"type": "str"}
    assert "TinyGraphs" in meta["source"] and root in meta["source"]
    got = read_all(str(tmp_path / "shards"))
    assert list(got) == [f"{i:09d}" for i in reference_permutation(300)]  # the default, shuffled order
    for i in (0, 1, 150, 299):
        assert_graph_equal(got[f"{i:09d}"], ds[i])
        assert got[f"{i:09d}"].name == f"g{i}"


def test_conversion_drops_in_memory_cache(tmp_path):
    ds = TinyGraphs(str(tmp_path / "root"), num_graphs=50)
    to_shards(ds, str(tmp_path / "s"), workers=1)
    assert all(g is None for g in ds._data_list)  # InMemoryDataset's per-graph copies were dropped


def test_on_disk_dataset_root(tmp_path):
    root = str(tmp_path / "disk")
    DiskGraphs(root).close()
    m = convert_pyg("tests.test_convert_pyg:DiskGraphs", str(tmp_path / "s"), root=root,
                    options=ConvertOptions(max_count=16, workers=2))
    assert [s.samples for s in m.shards] == [16, 16, 8]
    got = read_all(str(tmp_path / "s"))
    for i in range(40):
        assert_graph_equal(got[f"{i:09d}"], c13_graph(i, 2))


# ------------------------------------------------------------------ specs and objects


_SPAWN_SCRIPT = """
import multiprocessing, sys
from shardflow.convert.engine.engine import ConvertOptions
from shardflow.convert.pyg import convert_pyg
if __name__ == "__main__":
    multiprocessing.set_start_method("spawn")
    opts = ConvertOptions(max_count=10, workers=2)
    m = convert_pyg("tests.test_convert_pyg:graph_list", sys.argv[1], kwargs={"num_graphs": 25}, options=opts)
    print("samples", m.num_samples)
"""


@pytest.mark.slow
def test_spawned_workers_rebuild_the_dataset_from_the_spec(tmp_path):
    """Workers that do not fork build the dataset again from the spec."""
    script = tmp_path / "spawn_check.py"
    script.write_text(_SPAWN_SCRIPT)
    out = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "s")],
        cwd=REPO, env={**os.environ, "PYTHONPATH": REPO}, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "samples 25" in out.stdout
    got = read_all(str(tmp_path / "s"))
    for i in (0, 24):
        assert_graph_equal(got[f"{i:09d}"], c13_graph(i, 1))


_FORK_AFTER_THREADS_SCRIPT = """
import sys, torch
from torch_geometric.data import Data
from shardflow.convert.pyg import to_shards
torch.set_num_threads(2)
big = torch.randn(4, 200_000)
big.clone()  # a parallel copy: torch's OpenMP threads run before the workers fork
graphs = [Data(x=big[i % 4].view(-1, 4)) for i in range(8)]  # views: the codec copies their own elements
print("samples", to_shards(graphs, sys.argv[1], max_count=2, workers=2).num_samples)
"""


def test_forked_workers_after_torch_threads_do_not_hang(tmp_path):
    """Workers forked after the parent used torch's OpenMP threads convert tensors of
    more than 32,768 elements (the copy is parallel) instead of waiting forever."""
    out = subprocess.run(
        [sys.executable, "-c", _FORK_AFTER_THREADS_SCRIPT, str(tmp_path / "s")],
        cwd=REPO, env={**os.environ, "PYTHONPATH": REPO}, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "samples 8" in out.stdout


def test_a_rebuilt_dataset_must_hold_the_same_graphs():
    """What a spawned worker checks: the same length and the same probe graphs as the main process."""
    from shardflow.convert.pyg import workers as conv

    spec = DatasetSpec("tests.test_convert_pyg:graph_list", {"num_graphs": 40})
    probe, _ = conv.probe_graphs(spec.open(), conv.probe_indices(40))
    good = conv.WorkerContext("t-good", spec, FIELD, 40, 9, probe)
    try:
        assert len(conv.worker_dataset(good)) == 40
    finally:
        conv.DATASETS.pop("t-good", None)
    with pytest.raises(ConversionError, match="holds other graphs than in the main process"):
        conv.worker_dataset(conv.WorkerContext("t-bad", spec, FIELD, 40, 9, "0" * 32))
    with pytest.raises(ConversionError, match="not the same: 40 graphs instead of 41"):
        conv.worker_dataset(conv.WorkerContext("t-bad", spec, FIELD, 41, 9, probe))
    with pytest.raises(ConversionError, match="not available in this worker process"):
        conv.worker_dataset(conv.WorkerContext("t-none", None, FIELD, 40, 9, probe))
    assert not {"t-bad", "t-none"} & conv.DATASETS.keys()


def seed_all(seed):
    random.seed(seed)  # FakeDataset draws graph labels from `random`
    torch.manual_seed(seed)


def test_fake_dataset_spec_with_kwargs(tmp_path):
    seed_all(0)
    kwargs = {"num_graphs": 20, "avg_num_nodes": 10, "edge_dim": 4, "task": "graph"}
    m = convert_pyg("torch_geometric.datasets:FakeDataset", str(tmp_path / "s"), kwargs=kwargs,
                    options=ConvertOptions(max_count=8, workers=2))
    seed_all(0)
    want = pyg.datasets.FakeDataset(**kwargs)
    got = read_all(str(tmp_path / "s"))
    assert len(got) == 20 and m.meta["num_graphs"] == 20
    for i in range(20):
        assert_graph_equal(got[f"{i:09d}"], want[i])
    assert m.meta["num_classes"] == 10


def test_list_spec_and_hetero_schema(tmp_path):
    m = convert_pyg("tests.test_convert_pyg:graph_list", str(tmp_path / "s"), kwargs={"num_graphs": 12},
                    options=ConvertOptions(max_count=5, workers=1))
    assert [s.samples for s in m.shards] == [5, 5, 2]
    got = read_all(str(tmp_path / "s"))
    for i in range(12):
        assert_graph_equal(got[f"{i:09d}"], c13_graph(i, 1))

    h = HeteroData()
    h["author"].x = torch.ones(1, 3)
    h["venue"].x = torch.zeros(4, 3)
    h["author", "writes", "venue"].edge_index = torch.tensor([[0], [3]])
    schema = graph_schema(h)
    assert schema["kind"] == "HeteroData"
    assert schema["node_types"] == ["author", "venue"]
    assert schema["edge_types"] == [["author", "writes", "venue"]]
    stores = {json.dumps(s["key"]): s["attrs"] for s in schema["stores"]}
    assert stores['"venue"']["x"] == {"dtype": "float32", "shape": [None, 3]}
    assert stores['["author", "writes", "venue"]']["edge_index"] == {"dtype": "int64", "shape": [2, None]}


def test_merge_schemas_marks_optional_and_varying():
    a = graph_schema(Data(x=torch.zeros(3, 2), edge_attr=torch.zeros(4, 4), edge_index=torch.zeros(2, 4, dtype=torch.long)))
    b = graph_schema(Data(x=torch.zeros(5, 2, dtype=torch.float64), edge_index=torch.zeros(2, 1, dtype=torch.long)))
    m = merge_schemas(a, b)
    attrs = m["stores"][0]["attrs"]
    assert attrs["x"] == {"dtype": ["float32", "float64"], "shape": [None, 2]}
    assert attrs["edge_attr"]["optional"] is True
    assert "optional" not in attrs["edge_index"]


def test_to_shards_of_a_generator_and_errors(tmp_path):
    m = to_shards((c13_graph(i) for i in range(7)), str(tmp_path / "s"), max_count=3, workers=2)
    assert [s.samples for s in m.shards] == [3, 3, 1]
    assert m.meta["num_graphs"] == 7 and m.meta["graph_schema_from"] == 7
    varied = [c13_graph(i) for i in range(40)]
    varied[35].x = varied[35].x.double()  # a new structure after the first 32 graphs is merged in
    m = to_shards(iter(varied), str(tmp_path / "v"))
    assert m.meta["graph_schema_from"] == 33
    assert m.meta["graph"]["stores"][0]["attrs"]["x"]["dtype"] == ["float32", "float64"]

    with pytest.raises(ConversionError, match=r"graph 1: the dataset gave a builtins\.str"):
        to_shards([c13_graph(0), "not a graph"], str(tmp_path / "bad"), workers=1)
    g = c13_graph(0)
    g.obj = object()
    with pytest.raises(SampleError, match=r"graph 0: .*'data\.obj'"):
        to_shards(iter([g]), str(tmp_path / "bad2"))
    with pytest.raises(ValueError, match="must end in '.pyg'"):
        to_shards([c13_graph(0)], str(tmp_path / "bad3"), field="graph")


def test_bad_specs(tmp_path):
    with pytest.raises(ConversionError, match="cannot import module 'no_such_module_x'"):
        convert_pyg("no_such_module_x:f", str(tmp_path))
    with pytest.raises(ConversionError, match="has no attribute 'nope'"):
        convert_pyg("tests.test_convert_pyg:nope", str(tmp_path))
    with pytest.raises(ConversionError, match="expected 'module:callable'"):
        convert_pyg("justaname", str(tmp_path))
    with pytest.raises(ConversionError, match="building the dataset .* failed: TypeError"):
        convert_pyg("tests.test_convert_pyg:graph_list", str(tmp_path), kwargs={"bogus": 1})
    for target in ("FIELD", "ONE_GRAPH"):  # a str, a single graph
        with pytest.raises(ConversionError, match="expected a dataset .* or an iterable of graphs, got a"):
            convert_pyg(f"tests.test_convert_pyg:{target}", str(tmp_path))
    spec = DatasetSpec("tests.test_convert_pyg:graph_list", {"num_graphs": 2})
    assert convert_pyg(spec, str(tmp_path / "ok"), options=ConvertOptions(workers=1)).num_samples == 2


# ------------------------------------------------------------------ command line


def test_cli_convert_pyg_end_to_end(tmp_path, capsys):
    from shardflow.cli import main

    dst = str(tmp_path / "cli")
    kwargs = json.dumps({"num_graphs": 25})
    rc = main(["convert", "pyg", "tests.test_convert_pyg:graph_list", dst, "--kwargs", kwargs,
               "--max-count", "10", "--workers", "2"])
    assert rc == 0
    assert "25 graphs of tests.test_convert_pyg:graph_list" in capsys.readouterr().out
    m = shardflow.ShardDataset(dst).manifest
    assert [s.samples for s in m.shards] == [10, 10, 5]
    got = read_all(dst)
    assert_graph_equal(got["000000024"], c13_graph(24, 1))

    root = str(tmp_path / "root")
    rc = main(["convert", "pyg", "tests.test_convert_pyg:TinyGraphs", str(tmp_path / "cli2"), "--root", root,
               "--kwargs", '{"num_graphs": 20}', "--max-count", "8", "--workers", "1", "--field", "mol.pyg"])
    assert rc == 0
    sample = next(iter(shardflow.ShardDataset(str(tmp_path / "cli2"))))
    assert sorted(sample) == ["__key__", "__source__", "__url__", "mol.pyg"]

    assert main(["convert", "pyg", "tests.test_convert_pyg:graph_list", dst, "--kwargs", "[1]"]) == 1
    assert "--kwargs must be a JSON object" in capsys.readouterr().err
    assert main(["convert", "pyg", "nope_module:x", dst]) == 1
    assert "cannot import module 'nope_module'" in capsys.readouterr().err


def test_cli_help_lists_pyg():
    out = subprocess.run(
        [sys.executable, "-m", "shardflow.cli", "convert", "pyg", "--help"],
        cwd=REPO, capture_output=True, text=True, check=True, timeout=120,
    ).stdout
    assert "--root" in out and "--kwargs" in out and "--max-count" in out
