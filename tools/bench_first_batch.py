#!/usr/bin/env python3
"""Time to the first batch, shardflow against LitData, fresh and after a mid-epoch resume.

What is timed is what ``tools/bench_peers.py`` times (``measure()``): building the
dataset and its 2-worker loader (``load_state_dict`` of a mid-epoch state for the
resumed case), ``iter()`` and the first ``next()``. Each timing runs in a fresh
process that has imported torch, PIL, numpy and the library and decoded nothing yet,
as a training script's first batch is: the libraries and the names the script uses
(``ShardDataset``, ``loader``; ``StreamingDataset``, ``StreamingDataLoader``) are imported
before the timing (``--warm-up module`` imports the packages only, so that shardflow's
lazily imported names fall inside the timing; ``--warm-up decode`` also decodes one sample
first, untimed, as in ``bench_peers.py`` where the raw and decode passes come first);
the processes alternate the libraries (A B A B ...) for ``--rounds`` rounds. The
mid-epoch states are taken once per library and data set, half an epoch in, and
saved under ``--work``.

Data: the converted data sets of ``tools/bench_peers.py`` (``--data DIR`` holding
``shardflow-small-20000``, ``litdata-small-20000``, ``shardflow-photo-5000``,
``litdata-photo-5000``; made by ``bench_peers.py --work DIR``).

usage: python tools/bench_first_batch.py --data DIR [--rounds 10] [--sets small,photo] [--work DIR]
                                         [--warm-up module|imports|decode]
"""

from __future__ import annotations

import argparse
import os
import pickle
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

BATCH = 64
WORKERS = 2
SETS = {"small": ("small-20000", 20000), "photo": ("photo-5000", 5000)}
LIBS = ("shardflow", "litdata")


def _to_chw(b: bytes) -> Any:
    import io

    import numpy as np
    import torch
    from PIL import Image

    with Image.open(io.BytesIO(b)) as im:
        return torch.from_numpy(np.asarray(im.convert("RGB"))).permute(2, 0, 1)


def _lit_decode(item: dict[str, Any]) -> tuple[Any, int]:
    return _to_chw(item["jpg"]), item["cls"]


def make_loader(lib: str, data: str, state: Any = None) -> Any:
    """The loader of ``bench_peers.py`` (2 workers, shuffle, batch 64, CHW uint8)."""
    if lib == "shardflow":
        import shardflow

        ds = shardflow.ShardDataset(data, shuffle=True, decode=shardflow.DecodeOptions(image="torch"), fields=("jpg", "cls"))
        ld = shardflow.loader(ds, batch_size=BATCH, num_workers=WORKERS)
    else:
        import litdata

        ds = litdata.StreamingDataset(data, shuffle=True, transform=_lit_decode)
        ld = litdata.StreamingDataLoader(ds, batch_size=BATCH, num_workers=WORKERS)
    if state is not None:
        ld.load_state_dict(state)
    return ld


def import_only(lib: str, names: bool = True) -> None:
    """What a training script has imported before it builds its loader.

    ``import litdata`` imports all of LitData (about 0.5 s); ``import shardflow`` imports
    nothing of its reading path until a name is first used (``shardflow.ShardDataset``:
    about 0.1 s of imports). With ``names`` (the default) the names the script uses are
    imported as well, as ``from shardflow import ShardDataset, loader`` at its top does;
    without, those imports fall inside the timing.
    """
    import numpy  # noqa: F401
    import PIL.Image  # noqa: F401
    import torch.utils.data  # noqa: F401

    if lib == "shardflow":
        import shardflow  # noqa: F401

        if names:
            from shardflow import DecodeOptions, ShardDataset, loader  # noqa: F401
    else:
        import litdata  # noqa: F401

        if names:
            from litdata import StreamingDataLoader, StreamingDataset  # noqa: F401


def warm_up(lib: str, data: str) -> None:
    """Imports and one decoded sample in this process, untimed."""
    if lib == "shardflow":
        import shardflow

        ds = shardflow.ShardDataset(data, decode=shardflow.DecodeOptions(image="numpy"), fields=("jpg", "cls"))
        next(iter(ds))
        import shardflow.loading.shardloader  # noqa: F401 - bench_peers.py has built a loader before (its simplejpeg epoch)
    else:
        import litdata

        ds = litdata.StreamingDataset(data)
        _lit_decode(ds[0])
    import torch.utils.data  # noqa: F401


def child(lib: str, data: str, state_file: str | None, warm: str) -> None:
    if warm == "decode":
        warm_up(lib, data)
    else:
        import_only(lib, names=warm == "imports")
    state = None
    if state_file:
        with open(state_file, "rb") as f:
            state = pickle.load(f)
    t0 = time.perf_counter()
    ld = make_loader(lib, data, state)
    it = iter(ld)
    next(it)
    dt = time.perf_counter() - t0
    print(f"RESULT {dt:.6f}", flush=True)
    del it, ld


def save_state(lib: str, data: str, n: int, out: str) -> None:
    """Half an epoch, then the loader's state (pickled to ``out``)."""
    ld = make_loader(lib, data)
    half = n // BATCH // 2
    state = None
    for j, _ in enumerate(ld):
        if j + 1 == half:
            state = ld.state_dict()
            break
    with open(out, "wb") as f:
        pickle.dump(state, f)


def run(args: list[str]) -> float:
    cmd = [sys.executable, os.path.abspath(__file__), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"{' '.join(args)} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return float(lines[-1].split()[1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", help="folder with the bench_peers.py data sets")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--sets", default="small,photo")
    p.add_argument("--cases", default="fresh,resume")
    p.add_argument("--work", default=None, help="where the mid-epoch states are kept (default: a temporary folder)")
    p.add_argument("--warm-up", choices=("module", "imports", "decode"), default="imports",
                   help="before the timing, in each fresh process: `import shardflow` / `import litdata` only "
                        "(shardflow's names are then imported inside the timing), those and the names the loader "
                        "uses (`from shardflow import ShardDataset, loader`), or also one decoded sample")
    p.add_argument("--child", nargs=4, metavar=("LIB", "DATA", "STATE", "WARM"), help=argparse.SUPPRESS)
    p.add_argument("--save-state", nargs=4, metavar=("LIB", "DATA", "N", "OUT"), help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        lib, data, state, warm = a.child
        child(lib, data, None if state == "-" else state, warm)
        return 0
    if a.save_state:
        lib, data, n, out = a.save_state
        save_state(lib, data, int(n), out)
        print("RESULT 0")
        return 0
    if not a.data:
        p.error("--data is required")
    work = a.work or tempfile.mkdtemp(prefix="first-batch-")
    os.makedirs(work, exist_ok=True)
    cases = a.cases.split(",")
    for name in a.sets.split(","):
        suffix, n = SETS[name]
        paths = {lib: os.path.join(a.data, f"{lib}-{suffix}") for lib in LIBS}
        states = {lib: os.path.join(work, f"state-{lib}-{suffix}.pkl") for lib in LIBS}
        if "resume" in cases:
            for lib in LIBS:
                if not os.path.exists(states[lib]):
                    run(["--save-state", lib, paths[lib], str(n), states[lib]])
        times: dict[tuple[str, str], list[float]] = {(lib, c): [] for lib in LIBS for c in cases}
        for r in range(a.rounds):
            for case in cases:
                order = LIBS if r % 2 == 0 else LIBS[::-1]
                for lib in order:
                    st = states[lib] if case == "resume" else "-"
                    times[(lib, case)].append(run(["--child", lib, paths[lib], st, a.warm_up]))
        print(f"\n{name} ({n} samples), {a.rounds} rounds, warm-up: {a.warm_up}, median [min-max] seconds")
        for case in cases:
            sf, lt = times[("shardflow", case)], times[("litdata", case)]
            ratios = [b / x for x, b in zip(sf, lt)]
            print(
                f"  {case:6s} shardflow {statistics.median(sf):.3f} [{min(sf):.3f}-{max(sf):.3f}]"
                f"  litdata {statistics.median(lt):.3f} [{min(lt):.3f}-{max(lt):.3f}]"
                f"  litdata/shardflow: median ratio of rounds {statistics.median(ratios):.2f}x,"
                f" of medians {statistics.median(lt) / statistics.median(sf):.2f}x"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
