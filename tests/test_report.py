"""``loader.report()``: where an epoch's time and bytes went, and the verdict (shardflow.loading.report,
shardflow.accounting). Counters are compared with what the files hold and with what a loopback
HTTP server counted; the stage shares with a transform or a training step that sleeps."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np
import pytest

import shardflow
from shardflow.loading.report import ADVICE, INPUT_BOUND, verdict
from shardflow.storage import IOOptions


def write(folder: Path, n: int, per: int, size: int = 64) -> list[Path]:
    with shardflow.ShardWriter(str(folder / "train-%06d.tar"), max_count=per) as w:
        for i in range(n):
            w.write({"__key__": f"{i:06d}", "npy": np.full(size, i, np.float32), "cls": i % 10})
    return sorted(folder.glob("*.tar"))


def sub(tmp_path: Path) -> Path:
    (tmp_path / "d").mkdir()
    return tmp_path / "d"


def sleepy(sample):
    time.sleep(0.002)
    return sample


def test_a_slow_transform_is_the_slowest_stage_and_the_loop_input_bound(tmp_path):
    write(tmp_path, 1280, 320, size=16)
    ds = shardflow.ShardDataset(str(tmp_path), shuffle=True, seed=1, transform=sleepy, decode=None)
    loader = shardflow.loader(ds, batch_size=16, num_workers=2, collate_fn=list)
    assert sum(len(b) for b in loader) == 1280
    out = loader.report().to_dict()
    share = out["stages"]["transform"] / sum(out["stages"].values())
    assert out["slowest_stage"] == "transform" and share >= 0.8, sorted(out["stages"].items())
    assert out["input_bound"] is True and out["wait_fraction"] >= INPUT_BOUND, out
    assert out["batches"] == 80 and out["samples"] == 1280 and out["workers"] == 2
    assert out["stages"]["transform"] >= 1280 * 0.002  # every sample's sleep, summed over the workers
    per_worker = out["worker_stages"]
    assert sorted(per_worker) == ["0", "1"] and all(w["transform"] >= 640 * 0.002 for w in per_worker.values())
    assert "input-bound" in out["sentence"] and "in the transform" in out["sentence"]
    assert ADVICE["transform"] in out["sentence"]


def test_a_training_step_slower_than_the_loader_is_not_input_bound(tmp_path):
    write(tmp_path, 160, 80)
    ds = shardflow.ShardDataset(str(tmp_path), shuffle=True, seed=1)
    loader = shardflow.loader(ds, batch_size=8)
    for _ in loader:
        time.sleep(0.1)  # the step: 100 ms against about a millisecond of reading 8 samples
    out = loader.report().to_dict()
    assert out["wait_fraction"] < 0.05 and out["input_bound"] is False, out
    assert out["step_s"] >= 20 * 0.1
    assert "not input-bound" in out["sentence"]


def test_counters_are_the_bytes_in_the_files(tmp_path):
    """In-process, unshuffled: every shard read once from its start to its end."""
    shards = write(tmp_path, 120, 40)
    ds = shardflow.ShardDataset(str(tmp_path), shuffle=False)
    loader = shardflow.loader(ds, batch_size=10)
    list(loader)
    out = loader.report().to_dict()
    assert out["bytes_local"] == sum(p.stat().st_size for p in shards) == out["bytes_read"]
    assert out["bytes_network"] == 0 and out["requests"] == 0 and out["retries"] == 0
    assert out["samples"] == 120 and out["batches"] == 12


def tar_gets(srv) -> int:
    return sum(v for k, v in srv.stats.gets_by_path.items() if k.endswith(".tar"))


@pytest.mark.parametrize("workers", [0, 3])
def test_requests_and_bytes_are_those_the_server_counted(http_server, tmp_path, workers):
    srv = http_server
    write(sub(tmp_path), 300, 100, size=400)
    for name in sorted(os.listdir(tmp_path / "d")):
        srv.put(name, (tmp_path / "d" / name).read_bytes())
    io = IOOptions(backoff=0.0, staging_dir=str(tmp_path / "staging"))
    ds = shardflow.ShardDataset(srv.url, shuffle=True, seed=3, io=io)
    srv.reset_stats()  # the manifest was read by the constructor
    loader = shardflow.loader(ds, batch_size=16, num_workers=workers)
    assert sum(len(b["cls"]) for b in loader) == 300
    out = loader.report().to_dict()
    assert out["requests"] == tar_gets(srv) > 0, (out, srv.stats.gets_by_path)
    assert out["bytes_network"] + out["meta_bytes"] == srv.stats.body_bytes, (out, srv.stats)
    assert out["meta_requests"] == srv.stats.gets - tar_gets(srv)


def test_through_a_slow_link_the_fetch_stage_leads(flaky_http_server, tmp_path):
    srv = flaky_http_server
    write(sub(tmp_path), 200, 100, size=2000)  # 2 shards of ~800 KB
    for name in sorted(os.listdir(tmp_path / "d")):
        srv.put(name, (tmp_path / "d" / name).read_bytes())
    ds = shardflow.ShardDataset(srv.url, shuffle=False, io=IOOptions(backoff=0.0, staging=False))
    srv.faults.delay = 0.02  # per 64 KiB: ~0.25 s per shard
    loader = shardflow.loader(ds, batch_size=20)
    list(loader)
    out = loader.report().to_dict()
    assert out["slowest_stage"] == "fetch" and out["input_bound"], out
    assert "waiting for shard bytes" in out["sentence"] and ADVICE["fetch"] in out["sentence"]


def test_accounting_off_times_no_stage(tmp_path):
    write(tmp_path, 40, 20)
    loader = shardflow.loader(shardflow.ShardDataset(str(tmp_path)), batch_size=8, num_workers=2, accounting=False)
    list(loader)
    out = loader.report().to_dict()
    assert set(out["stages"].values()) == {0.0} and out["bytes_read"] == 0 and out["slowest_stage"] == ""
    assert out["batches"] == 5 and out["samples"] == 40


def test_report_before_iterating_says_so(tmp_path):
    write(tmp_path, 8, 8)
    with pytest.raises(shardflow.ShardflowError, match="iterate the loader first"):
        shardflow.loader(shardflow.ShardDataset(str(tmp_path)), batch_size=4).report()


def test_one_json_line_per_finished_epoch(tmp_path):
    write(sub(tmp_path), 30, 10)
    path = tmp_path / "epochs.jsonl"
    loader = shardflow.loader(shardflow.ShardDataset(str(tmp_path / "d")), batch_size=8, report_path=str(path))
    for _ in range(2):
        list(loader)
    it = iter(loader)
    next(it)
    it.close()  # an epoch stopped early writes no line
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [x["epoch"] for x in lines] == [0, 1] and [x["samples"] for x in lines] == [30, 30]
    assert {"wait_fraction", "stages", "slowest_stage", "input_bound", "bytes_read", "requests", "sentence"} <= set(lines[0])


def test_the_rules_of_the_sentence():
    stages = {"fetch": 0.1, "read": 0.2, "decode": 7.8, "transform": 1.5, "collate": 0.3, "handover": 0.1}
    bound, slowest, sentence = verdict(0.41, stages, 4)
    assert bound and slowest == "decode"
    assert sentence == ("the loop waited for data 41% of the epoch: input-bound; workers spent 78% of their time "
                        f"decoding fields; try {ADVICE['decode']}.")
    bound, slowest, sentence = verdict(0.41, stages, 0)
    assert sentence.endswith(f"try num_workers >= 2 (now 0), then {ADVICE['decode']}.")
    bound, slowest, sentence = verdict(0.099, stages, 4)
    assert not bound and sentence == ("the loop waited for data 10% of the epoch: not input-bound, the loader needs "
                                      "no change; workers spent 78% of their time decoding fields.")
    assert verdict(0.5, dict.fromkeys(stages, 0.0), 2) == (True, "", "the loop waited for data 50% of the epoch: "
                                                           "input-bound; try more workers.")
    # a tie goes to the innermost stage
    assert verdict(0.5, {"fetch": 1.0, "decode": 1.0}, 2)[1] == "fetch"


def test_gather_names_the_slowest_rank(tmp_path):
    dist = pytest.importorskip("torch.distributed")
    write(sub(tmp_path), 16, 8)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        loader = shardflow.loader(shardflow.ShardDataset(str(tmp_path / "d")), batch_size=4)
        list(loader)
        out = loader.report(gather=True).to_dict()
    finally:
        dist.destroy_process_group()
    assert out["slowest_rank"]["rank"] == 0 and out["slowest_rank"]["wait_s"] == out["wait_s"]
    assert "slowest_rank" not in loader.report().to_dict()
