"""shardflow.loading.dataloader: torch's worker-count warning is printed once, not twice (torch checks at
construction and again at iter(), from two call sites)."""

from __future__ import annotations

import os
import subprocess
import sys


def test_worker_count_warning_once(tmp_path):
    import shardflow

    with shardflow.ShardWriter(str(tmp_path / "s-%06d.tar"), max_count=4) as w:
        for i in range(8):
            w.write({"__key__": f"{i}", "cls": i})
    many = len(os.sched_getaffinity(0)) + 1 if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1) + 1
    code = (
        "import shardflow, sys\n"
        f"ds = shardflow.ShardDataset({str(tmp_path)!r})\n"
        f"loader = shardflow.loader(ds, batch_size=2, num_workers={many})\n"
        "for epoch in range(2):\n"
        "    print(sum(len(b['cls']) for b in loader))\n"
        # torch's own DataLoader, for reference: twice
        "import torch.utils.data as tud\n"
        f"list(tud.DataLoader(list(range(4)), num_workers={many}))\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "PYTHONWARNINGS": "default"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True, timeout=300)
    assert out.stdout.split() == ["8", "8"]
    lines = [line for line in out.stderr.splitlines() if f"will create {many} worker processes" in line]
    ours = [line for line in lines if os.path.join("shardflow", "loading", "dataloader.py") in line]
    assert len(lines) == 3, out.stderr  # once for shardflow's two epochs, twice for the plain DataLoader
    assert len(ours) == 1
