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


def _shards(tmp_path, n=8):
    import shardflow

    with shardflow.ShardWriter(str(tmp_path / "s-%06d.tar"), max_count=4) as w:
        for i in range(n):
            w.write({"__key__": f"{i:02d}", "cls": i})
    return str(tmp_path)


def test_shard_loader_is_a_torch_dataloader_with_loaders_defaults(tmp_path):
    import torch

    import shardflow

    folder = _shards(tmp_path)
    assert issubclass(shardflow.ShardLoader, torch.utils.data.DataLoader)
    built = shardflow.ShardLoader(shardflow.ShardDataset(folder))
    made = shardflow.loader(shardflow.ShardDataset(folder))
    assert isinstance(built, torch.utils.data.DataLoader) and isinstance(made, shardflow.ShardLoader)
    # one set of defaults: 64 samples a batch, no workers, the dataset as torch's loader holds it
    for ld in (built, made):
        assert (ld.batch_size, ld.drop_last, ld.num_workers, ld.pin_memory) == (64, False, 0, False)
        assert isinstance(ld.dataset, shardflow.ShardDataset)
        assert [b["cls"].tolist() for b in ld] == [list(range(8))]
    small = shardflow.ShardLoader(shardflow.ShardDataset(folder), 3, drop_last=True)
    assert (small.batch_size, small.drop_last, len(small)) == (3, True, 2)
    assert [b["cls"].tolist() for b in small] == [[0, 1, 2], [3, 4, 5]]


def test_dataloader_keywords_pass_through_to_torch(tmp_path):
    import pytest
    import torch

    import shardflow

    folder = _shards(tmp_path)
    ld = shardflow.loader(shardflow.ShardDataset(folder), batch_size=4, num_workers=2, pin_memory=True,
                          prefetch_factor=3, timeout=120, multiprocessing_context="fork")
    assert (ld.pin_memory, ld.prefetch_factor, ld.timeout) == (True, 3, 120)
    assert ld.multiprocessing_context.get_start_method() == "fork"
    assert sorted(k for b in ld for k in b["__key__"]) == [f"{i:02d}" for i in range(8)]
    # a keyword only torch knows reaches torch's DataLoader, which refuses it for an iterable dataset
    with pytest.raises(ValueError, match="shuffle"):
        shardflow.loader(shardflow.ShardDataset(folder), batch_size=4, shuffle=True)
    with pytest.raises(TypeError):
        shardflow.loader(shardflow.ShardDataset(folder), batch_size=4, no_such_option=1)
    # without workers, the worker-only keywords are ignored as before (torch would refuse them)
    quiet = shardflow.loader(shardflow.ShardDataset(folder), batch_size=4, persistent_workers=True, prefetch_factor=2)
    assert quiet.persistent_workers is False and quiet.prefetch_factor is None
    assert isinstance(next(iter(quiet))["cls"], torch.Tensor)
    with pytest.raises(ValueError, match="in_order"):
        shardflow.loader(shardflow.ShardDataset(folder), batch_size=4, num_workers=2, in_order=False)
