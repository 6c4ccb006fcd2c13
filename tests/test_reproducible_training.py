"""A run killed with SIGKILL in the middle of epoch 2 and resumed from its checkpoint in a
fresh process ends with weights bit-identical (``torch.equal``) to an uninterrupted run:
on one process with 2 DataLoader workers, and on 2 ranks over gloo (DESIGN.md §10).

The training script is tests/resume_training.py (a Linear(16, 2), SGD with momentum, a
noise augmentation drawn from torch's global generator per sample, deterministic
algorithms, one thread, a checkpoint after every step).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from shardflow import ShardWriter

SCRIPT = Path(__file__).with_name("resume_training.py")
ROOT = Path(__file__).resolve().parent.parent
STEPS_PER_EPOCH = 30  # 240 samples, batch 8, one rank
DEADLINE = 240.0


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("train") / "shards"
    folder.mkdir()
    rng = np.random.default_rng(0)
    w = rng.normal(size=16)
    with ShardWriter(str(folder / "train-%06d.tar"), max_count=60) as writer:
        for i in range(240):
            x = rng.normal(size=16).astype(np.float32)
            writer.write({"__key__": f"s{i:04d}", "npy": x, "cls": int(x @ w > 0)})
    return folder


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra or {})
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(data: Path, ckpt: Path, out: Path, world: int, port: int, *extra: str) -> list[subprocess.Popen]:
    procs = []
    for rank in range(world):
        env = _env({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                    "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)} if world > 1 else None)
        procs.append(subprocess.Popen([sys.executable, str(SCRIPT), str(data), str(ckpt), str(out), *extra],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    return procs


def _wait(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        out, _ = p.communicate(timeout=DEADLINE)
        assert p.returncode == 0, out.decode(errors="replace")[-3000:]


def _run(data: Path, ckpt: Path, out: Path, world: int, *extra: str) -> None:
    _wait(_start(data, ckpt, out, world, _free_port(), *extra))


def _step(ckpt: Path) -> int:
    try:
        return int((ckpt.parent / (ckpt.name + ".step")).read_text() or 0)
    except (FileNotFoundError, ValueError):
        return 0


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2])
def test_killed_and_resumed_run_ends_bit_identical(data: Path, tmp_path: Path, world: int) -> None:
    steps = STEPS_PER_EPOCH // world
    _run(data, tmp_path / "whole.pt", tmp_path / "whole.w", world)
    reference = torch.load(tmp_path / "whole.w")

    ckpt, out = tmp_path / "cut.pt", tmp_path / "cut.w"
    kill_after = steps + steps // 3  # a third into epoch 2
    procs = _start(data, ckpt, out, world, _free_port(), "--slow-from", str(kill_after - 2))
    t0 = time.monotonic()
    while _step(ckpt) < kill_after:
        assert time.monotonic() - t0 < DEADLINE, "the run never reached the kill point"
        assert all(p.poll() is None for p in procs), "the run ended before it was killed"
        time.sleep(0.01)
    for p in procs:
        p.send_signal(signal.SIGKILL)
    for p in procs:
        p.wait(timeout=30)
    reached = torch.load(ckpt)["step"]
    assert steps < reached < 2 * steps, f"killed at step {reached}, not in the middle of epoch 2"
    assert not out.exists()

    _run(data, ckpt, out, world)  # a fresh process resumes from the checkpoint
    resumed = torch.load(out)
    assert reference.keys() == resumed.keys()
    for name in reference:
        assert torch.equal(reference[name], resumed[name]), name
