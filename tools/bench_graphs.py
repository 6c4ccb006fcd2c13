"""Graph throughput and peak memory: shardflow against InMemoryDataset and webdataset, side by side.

The graphs are those of ``shared/BASELINES.md``: ``FakeDataset(num_graphs=G,
avg_num_nodes=60, avg_degree=4, num_channels=32, edge_dim=4, task="graph")``
generated once after ``torch.manual_seed(0)`` (and ``random.seed(0)``: FakeDataset
draws labels from ``random``), saved as an ``InMemoryDataset``. From that one
file, for G and for ``--scale`` x G graphs:

- **shardflow**: ``to_shards(InMemoryDataset)`` once, then
  ``ShardDataset(shards, shuffle=True)`` + ``shardflow.loader(batch_size=64,
  num_workers=0)`` (the default collate builds one PyG ``Batch`` per batch);
- **InMemoryDataset**: the loaded dataset + PyG ``DataLoader(batch_size=64,
  shuffle=True)``, 0 workers; its first epoch separates every graph out of the
  collated storage (and keeps a copy of each), later epochs reuse the copies;
- **webdataset**: tars of ``torch.save`` dicts (tensors cloned, so each graph
  holds its own elements), read with ``WebDataset(...).shuffle(1000)``,
  ``torch.load(weights_only=True)`` and PyG's ``DataLoader(batch_size=64)``.

Every pipeline is measured in its own fresh process (one per pipeline and
size): graphs/s for each epoch and the process's peak RSS (``ru_maxrss``; the
parent process stays small, and ``VmHWM``, which starts afresh at exec, is
checked to agree). Conversions and the dataset build run in other processes.
``--repeat`` (default 3) measures each pipeline that many times at the first
size, alternating (shardflow, InMemoryDataset, webdataset, shardflow, ...), and
reports medians with their ranges, and the ratios of runs next to each other, by
wall time and by the process's CPU time (the machine's other load moves the
first; the rates per CPU second are the steadier comparison); the larger size,
there for memory, is measured once. Set-up time
(imports, loading the dataset, reading the manifest) is reported apart from
the epochs. ``--profile``
adds a cProfile of one shardflow epoch, grouped by stage.

Usage::

    python tools/bench_graphs.py WORKDIR [--graphs 20000] [--scale 4] [--repeat 3] [--threads N] [--profile]

Prints Markdown tables with the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

BATCH = 64
FAKE = {"avg_num_nodes": 60, "avg_degree": 4, "num_channels": 32, "edge_dim": 4, "task": "graph"}
PIPELINES = ("shardflow", "inmemory", "webdataset")
LABELS = {
    "shardflow": "shardflow `ShardDataset(shuffle=True)` + `shardflow.loader` -> `Batch`",
    "inmemory": "`InMemoryDataset` + PyG `DataLoader(shuffle=True)`",
    "webdataset": "webdataset tar of `torch.save` dicts + `torch.load(weights_only=True)` + PyG `DataLoader`",
}


# ------------------------------------------------------------------ child steps (each in a fresh process)


def _peak() -> dict[str, int]:
    hwm = 0
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                hwm = int(line.split()[1])
    return {"ru_maxrss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, "vmhwm_kb": hwm}


def _mem_class():  # noqa: ANN202 - built lazily: importing torch_geometric is the child's job
    from torch_geometric.data import InMemoryDataset

    class BenchGraphs(InMemoryDataset):
        """The benchmark graphs, saved once by ``prepare``."""

        def __init__(self, root: str, data_list: list | None = None) -> None:
            self._pending = data_list
            super().__init__(root, log=False)
            self.load(self.processed_paths[0])

        @property
        def processed_file_names(self) -> list[str]:
            return ["graphs.pt"]

        def process(self) -> None:
            if self._pending is None:
                raise RuntimeError(f"{self.root}: no processed graphs; run the prepare step first")
            self.save(self._pending, self.processed_paths[0])

    return BenchGraphs


def step_prepare(work: str, graphs: int) -> dict:
    import random

    import torch
    from torch_geometric.datasets import FakeDataset

    random.seed(0)
    torch.manual_seed(0)
    t = time.perf_counter()
    src = FakeDataset(num_graphs=graphs, **FAKE)
    data_list = [src[i] for i in range(len(src))]
    _mem_class()(os.path.join(work, "mem"), data_list)
    own = sum(v.numel() * v.element_size() for g in data_list for _, v in g if isinstance(v, torch.Tensor))
    return {"seconds": time.perf_counter() - t, "own_tensor_bytes": own}


def step_convert(work: str, graphs: int) -> dict:
    from shardflow.convert.pyg import to_shards

    ds = _mem_class()(os.path.join(work, "mem"))
    t = time.perf_counter()
    m = to_shards(ds, os.path.join(work, "shards"), max_count=5000, workers=os.cpu_count(), resume=False)
    seconds = time.perf_counter() - t
    return {"seconds": seconds, "rate": graphs / seconds, "bytes": sum(s.bytes for s in m.shards), "shards": len(m.shards)}


def step_wds_write(work: str, graphs: int) -> dict:
    import webdataset as wds

    ds = _mem_class()(os.path.join(work, "mem"))
    out = os.path.join(work, "wds")
    os.makedirs(out, exist_ok=True)
    t = time.perf_counter()
    with wds.ShardWriter(os.path.join(out, "g-%06d.tar"), maxcount=5000, verbose=0) as sink:
        for i in range(len(ds)):
            d = ds[i]
            sink.write({"__key__": f"{i:08d}", "pth": {k: (v.clone() if hasattr(v, "clone") else v) for k, v in d.to_dict().items()}})
    seconds = time.perf_counter() - t
    size = sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out))
    return {"seconds": seconds, "rate": graphs / seconds, "bytes": size}


def _epochs(make_iter, epochs: int) -> tuple[list[float], list[float]]:
    """Graphs per wall second and per CPU second (all threads of the process) of each epoch."""
    rates, cpu_rates = [], []
    for epoch in range(epochs):
        t, c = time.perf_counter(), time.process_time()
        n = 0
        for batch in make_iter(epoch):
            n += batch.num_graphs
        rates.append(n / (time.perf_counter() - t))
        cpu_rates.append(n / max(time.process_time() - c, 1e-9))
    return rates, cpu_rates


def step_read(work: str, graphs: int, pipeline: str, epochs: int) -> dict:
    """One pipeline, ``epochs`` passes; the set-up (imports, loading) is timed apart."""
    t0 = time.perf_counter()
    import torch
    import torch_geometric.data  # noqa: F401 - every pipeline imports PyG before its first pass

    if pipeline == "shardflow":
        import shardflow
        import shardflow.graph.codec  # noqa: F401 - decode_graph's lazy imports, done before timing

        ds = shardflow.ShardDataset(os.path.join(work, "shards"), shuffle=True)
        loader = shardflow.loader(ds, batch_size=BATCH, num_workers=0)

        def make_iter(epoch: int):
            ds.set_epoch(epoch)
            return (b["graph.pyg"] for b in loader)

    elif pipeline == "inmemory":
        from torch_geometric.loader import DataLoader

        ds = _mem_class()(os.path.join(work, "mem"))
        loader = DataLoader(ds, batch_size=BATCH, shuffle=True)

        def make_iter(epoch: int):
            return iter(loader)

    elif pipeline == "webdataset":
        import glob
        import io

        import webdataset as wds
        from torch_geometric.data import Data
        from torch_geometric.loader import DataLoader

        shards = sorted(glob.glob(os.path.join(work, "wds", "*.tar")))

        def to_data(sample: dict) -> Data:
            return Data(**torch.load(io.BytesIO(sample["pth"]), weights_only=True))

        def make_iter(epoch: int):
            pipe = wds.WebDataset(shards, shardshuffle=False).shuffle(1000).map(to_data)
            return iter(DataLoader(pipe, batch_size=BATCH))

    else:
        raise ValueError(pipeline)
    setup = time.perf_counter() - t0
    rates, cpu_rates = _epochs(make_iter, epochs)
    return {"rates": rates, "cpu_rates": cpu_rates, "setup": setup, **_peak()}


def step_profile(work: str) -> dict:
    import cProfile
    import pstats

    import shardflow

    ds = shardflow.ShardDataset(os.path.join(work, "shards"), shuffle=True)
    loader = shardflow.loader(ds, batch_size=BATCH, num_workers=0)
    for _ in loader:  # warm: imports, page cache
        pass
    prof = cProfile.Profile()
    t = time.perf_counter()
    prof.enable()
    for _ in loader:
        pass
    prof.disable()
    wall = time.perf_counter() - t
    stats = pstats.Stats(prof).stats  # {(file, line, func): (cc, nc, tottime, cumtime, callers)}
    total = sum(v[2] for v in stats.values())

    def cum(fragment: str, func: str) -> float:
        return sum(v[3] for (f, _, fn), v in stats.items() if fragment in f and fn == func)

    def own(*fragments: str) -> float:
        return sum(v[2] for (f, _, _), v in stats.items() if any(x in f for x in fragments))

    parts = {
        "decode_graph_record (header, checks, array views)": cum("shardflow/graph/records.py", "decode_graph_record"),
        "collate_records (Batch)": cum("shardflow/graph/records.py", "collate_records"),
        "decode_graph / collate_graphs (graphs that are not records)": cum("shardflow/graph/decode.py", "decode_graph")
        + cum("shardflow/graph/collate.py", "collate_graphs"),
        "tar parse (shardflow/format/tar.py)": own("shardflow/format/tar.py"),
        "file reads (shardflow/storage/, builtin read)": own("shardflow/storage/")
        + sum(v[2] for (f, _, fn), v in stats.items() if f == "~" and "read" in fn),
        "shuffle buffer, plan, stages (own time)": own("shardflow/reader", "shardflow/planning/plan.py", "shardflow/sources/source.py"),
        "dataset + loader (own time)": own("shardflow/dataset.py", "shardflow/loading/shardloader.py", "shardflow/loading/collation.py"),
        "torch DataLoader machinery (own time)": own("torch/utils/data/"),
    }
    top = sorted(stats.items(), key=lambda kv: kv[1][2], reverse=True)[:15]
    return {
        "wall": wall,
        "graphs": len(ds),
        "profiled_total": total,
        "parts": parts,
        "top": [[f"{os.path.relpath(f) if f.startswith('/') else f}:{ln}({fn})", v[0], v[2], v[3]] for (f, ln, fn), v in top],
    }


# ------------------------------------------------------------------ orchestration (stays small: no torch here)


def _run(args: argparse.Namespace, step: str, work: str, graphs: int, *extra: str) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--step", step, "--work", work, "--graphs", str(graphs), *extra]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"step {step} ({graphs} graphs) failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def _mb(kb: float) -> str:
    return f"{kb / 1024:,.0f} MB"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("workdir", nargs="?")
    parser.add_argument("--graphs", type=int, default=20_000)
    parser.add_argument("--scale", type=int, default=4, help="the larger dataset has SCALE x GRAPHS graphs")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=3,
                        help="measure each pipeline this many times, alternating (medians and ranges reported)")
    parser.add_argument("--threads", type=int, default=0, help="torch.set_num_threads in every process (0: torch's default)")
    parser.add_argument("--profile", action="store_true", help="also cProfile one shardflow epoch")
    parser.add_argument("--step", help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    parser.add_argument("--pipeline", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.step:  # a child
        if args.threads:
            import torch

            torch.set_num_threads(args.threads)
        import warnings

        warnings.filterwarnings("ignore")
        if args.step == "prepare":
            result = step_prepare(args.work, args.graphs)
        elif args.step == "convert":
            result = step_convert(args.work, args.graphs)
        elif args.step == "wds-write":
            result = step_wds_write(args.work, args.graphs)
        elif args.step == "read":
            result = step_read(args.work, args.graphs, args.pipeline, args.epochs)
        elif args.step == "profile":
            result = step_profile(args.work)
        else:
            raise SystemExit(f"unknown step {args.step}")
        print(json.dumps(result))
        return 0

    if not args.workdir:
        parser.error("WORKDIR is required")
    sizes = sorted({args.graphs, args.graphs * args.scale})  # --scale 1: the one size, measured once
    results: dict[int, dict] = {}
    for g in sizes:
        work = os.path.join(args.workdir, f"g{g}")
        os.makedirs(work, exist_ok=True)
        r: dict = {"prepare": _run(args, "prepare", work, g)}
        r["convert"] = _run(args, "convert", work, g)
        r["wds"] = _run(args, "wds-write", work, g)
        reads: dict[str, list[dict]] = {p: [] for p in PIPELINES}
        for _ in range(args.repeat if g == sizes[0] else 1):  # the larger size is there for memory
            for p in PIPELINES:
                epochs = args.epochs if p != "webdataset" else 1
                reads[p].append(_run(args, "read", work, g, "--pipeline", p, "--epochs", str(epochs)))
        r["read"] = {
            p: {
                "rates": [_median([run["rates"][e] for run in runs]) for e in range(len(runs[0]["rates"]))],
                "range": [[min(run["rates"][e] for run in runs), max(run["rates"][e] for run in runs)]
                          for e in range(len(runs[0]["rates"]))],
                "cpu_rates": [_median([run["cpu_rates"][e] for run in runs]) for e in range(len(runs[0]["rates"]))],
                "ratios": [[a["rates"][e] / b["rates"][e] for a, b in zip(reads["shardflow"], runs)]
                           for e in range(min(len(runs[0]["rates"]), len(reads["shardflow"][0]["rates"])))],
                "setup": min(run["setup"] for run in runs),
                "ru_maxrss_kb": max(run["ru_maxrss_kb"] for run in runs),
                "vmhwm_kb": max(run["vmhwm_kb"] for run in runs),
            }
            for p, runs in reads.items()
        }
        results[g] = r
        print(f"<!-- {g} graphs done: {json.dumps(r)} -->", flush=True)

    _report(args, sizes, results)
    if args.profile:
        prof = _run(args, "profile", os.path.join(args.workdir, f"g{sizes[0]}"), sizes[0])
        _report_profile(prof)
    return 0


def _report(args: argparse.Namespace, sizes: list[int], results: dict[int, dict]) -> None:
    g = sizes[0]
    r = results[g]["read"]
    sf = r["shardflow"]["rates"]
    print(f"\n### Throughput, {g:,} graphs (~60 nodes, 32 features, edge_dim 4), batch {BATCH}, 0 workers")
    print(f"torch threads: {args.threads or 'default'}; medians of {args.repeat} alternating run(s) "
          "(A B C A B C ..., each a fresh process), [min-max]; graphs/s\n")
    print("| pipeline | set-up s | epoch 1 | epoch 2 | shardflow / this, epoch 1 | shardflow / this, epoch 2 |")
    print("|---|---:|---:|---:|---:|---:|")
    for p in PIPELINES:
        rates, spans, ratios = r[p]["rates"], r[p]["range"], r[p]["ratios"]
        cells = []
        for e in range(2):
            cells.append(f"{rates[e]:,.0f} [{spans[e][0]:,.0f}-{spans[e][1]:,.0f}]" if len(rates) > e else "-")
        for e in range(2):
            if len(ratios) > e and p != "shardflow":
                cells.append(f"{_median(ratios[e]):.2f}x [{min(ratios[e]):.2f}-{max(ratios[e]):.2f}]")
            else:
                cells.append("1.00x" if len(rates) > e else "-")
        print(f"| {LABELS[p]} | {r[p]['setup']:.1f} | {' | '.join(cells)} |")
    print("\nRatios are those of runs next to each other (run i of shardflow against run i of the peer).")
    print("Per CPU second (all threads of the process; less sensitive to other load on the machine):\n")
    print("| pipeline | epoch 1 | epoch 2 | shardflow / this, epoch 1 | epoch 2 |")
    print("|---|---:|---:|---:|---:|")
    scpu = r["shardflow"]["cpu_rates"]
    for p in PIPELINES:
        cpu = r[p]["cpu_rates"]
        e2 = f"{cpu[1]:,.0f}" if len(cpu) > 1 else "-"
        q2 = f"{scpu[1] / cpu[1]:.2f}x" if len(cpu) > 1 else "-"
        print(f"| {LABELS[p]} | {cpu[0]:,.0f} | {e2} | {scpu[0] / cpu[0]:.2f}x | {q2} |")
    big = sizes[-1]
    if big == g:  # --scale 1: one data set
        print("\n### Peak RSS of the reading process (ru_maxrss)\n")
        print(f"| pipeline | {g:,} graphs |\n|---|---:|")
        for p in PIPELINES:
            print(f"| {LABELS[p]} | {_mb(results[g]['read'][p]['ru_maxrss_kb'])} |")
        _report_conversion(sizes, results)
        return
    print(f"\n### Peak RSS of the reading process (ru_maxrss), dataset grown {args.scale}x\n")
    print(f"| pipeline | {g:,} graphs | {big:,} graphs | growth |")
    print("|---|---:|---:|---:|")
    for p in PIPELINES:
        a = results[g]["read"][p]["ru_maxrss_kb"]
        b = results[big]["read"][p]["ru_maxrss_kb"]
        print(f"| {LABELS[p]} | {_mb(a)} | {_mb(b)} | {b / a:.2f}x |")
    print(f"\n### Throughput at {big:,} graphs (graphs/s, one run)\n")
    print("| pipeline | epoch 1 | epoch 2 |")
    print("|---|---:|---:|")
    for p in PIPELINES:
        rates = results[big]["read"][p]["rates"]
        print(f"| {LABELS[p]} | {rates[0]:,.0f} | {f'{rates[1]:,.0f}' if len(rates) > 1 else '-'} |")
    _report_conversion(sizes, results)


def _report_conversion(sizes: list[int], results: dict[int, dict]) -> None:
    print("\n### Conversion (once per dataset)\n")
    print("| graphs | `to_shards` graphs/s (all CPUs) | shard bytes / graphs' own tensor bytes | webdataset write graphs/s |")
    print("|---:|---:|---:|---:|")
    for n in sizes:
        c = results[n]["convert"]
        print(
            f"| {n:,} | {c['rate']:,.0f} | {c['bytes'] / results[n]['prepare']['own_tensor_bytes']:.2f} | "
            f"{results[n]['wds']['rate']:,.0f} |"
        )
    mismatch = [
        (n, p) for n in sizes for p in PIPELINES
        if abs(results[n]["read"][p]["ru_maxrss_kb"] - results[n]["read"][p]["vmhwm_kb"]) > 0.05 * results[n]["read"][p]["vmhwm_kb"]
    ]  # fmt: skip
    if mismatch:
        print(f"\nnote: ru_maxrss and VmHWM differ by more than 5% for {mismatch}")


def _report_profile(prof: dict) -> None:
    print(f"\n### Where one shardflow epoch goes (cProfile, {prof['graphs']:,} graphs, {prof['wall']:.2f} s profiled)\n")
    print("| stage | seconds | share of profiled time |")
    print("|---|---:|---:|")
    total = prof["profiled_total"]
    for name, sec in prof["parts"].items():
        print(f"| {name} | {sec:.2f} | {sec / total:.0%} |")
    print("\nTop functions by own time:\n")
    print("| function | calls | own s | cumulative s |")
    print("|---|---:|---:|---:|")
    for name, calls, own, cum in prof["top"]:
        print(f"| `{name}` | {calls:,} | {own:.3f} | {cum:.3f} |")


if __name__ == "__main__":
    sys.exit(main())
