"""``shardflow.loader(..., trace=PATH)``: a Chrome/Perfetto trace of the first batches
(shardflow.loading.tracing), checked against the trace-event format's complete events."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import shardflow
import shardflow.loading.tracing
from shardflow.accounting import STAGES


def write(folder: Path, n: int, per: int) -> None:
    with shardflow.ShardWriter(str(folder / "train-%06d.tar"), max_count=per) as w:
        for i in range(n):
            w.write({"__key__": f"{i:06d}", "npy": np.full(16, i, np.float32), "cls": i % 10})


def events(path: Path) -> list[dict]:
    doc = json.loads(path.read_text())
    assert set(doc) >= {"traceEvents"}
    return doc["traceEvents"]


def test_the_trace_holds_each_workers_stages_and_the_loops_waits(tmp_path):
    write(tmp_path, 96, 24)
    trace = tmp_path / "trace.json"
    loader = shardflow.loader(shardflow.ShardDataset(str(tmp_path), shuffle=True, seed=2), batch_size=8,
                              num_workers=2, trace=str(trace))
    assert sum(len(b["cls"]) for b in loader) == 96
    evs = events(trace)
    complete = [e for e in evs if e["ph"] == "X"]
    for e in evs:
        assert e["ph"] in ("X", "M") and isinstance(e["pid"], int) and isinstance(e["tid"], int), e
        assert isinstance(e["name"], str) and isinstance(e["ts"], (int, float)), e
    for e in complete:
        assert isinstance(e["dur"], (int, float)) and e["dur"] >= 0 and e["ts"] > 0, e
    names = {(e["tid"], e["name"]) for e in evs if e["ph"] == "M"}
    assert names == {(0, "thread_name"), (1, "thread_name"), (2, "thread_name"), (0, "process_name")}
    loop = [e for e in complete if e["tid"] == 0]
    assert [e["name"] for e in loop].count("wait") == sum(1 for e in loop if e["name"] == "step") + 1
    for tid in (1, 2):
        batches = sorted((e for e in complete if e["tid"] == tid and e["name"].startswith("batch")), key=lambda e: e["ts"])
        assert [e["name"] for e in batches] == [f"batch {i}" for i in range(tid - 1, 12, 2)]  # round robin
        for a, b in zip(batches, batches[1:]):
            assert a["ts"] + a["dur"] <= b["ts"] + 1e-3  # one after the other
        spans = batches + [e for e in complete if e["tid"] == tid and e["name"] == "end"]  # the worker's last stretch
        stages = [e for e in complete if e["tid"] == tid and e["name"] in STAGES]
        assert {e["name"] for e in stages} >= {"read", "collate"}
        for s in stages:  # each stage inside one of the worker's batches (or its end)
            assert any(b["ts"] - 1e-3 <= s["ts"] and s["ts"] + s["dur"] <= b["ts"] + b["dur"] + 1e-3 for b in spans), s
    # the waits and the workers' batches share one clock
    first_wait = min(e["ts"] for e in loop if e["name"] == "wait")
    last_batch_end = max(e["ts"] + e["dur"] for e in complete if e["name"].startswith("batch"))
    assert first_wait < last_batch_end <= max(e["ts"] + e["dur"] for e in loop) + 1e-3


def test_only_a_window_of_the_first_epoch_is_traced(tmp_path, monkeypatch):
    monkeypatch.setattr(shardflow.loading.tracing, "TRACE_BATCHES", 3)
    write(tmp_path, 80, 40)
    trace = tmp_path / "trace.json"
    loader = shardflow.loader(shardflow.ShardDataset(str(tmp_path)), batch_size=8, trace=str(trace))
    list(loader)
    first = trace.read_text()
    waits = [e for e in events(trace) if e["name"] == "wait"]
    assert len(waits) == 3
    list(loader)  # a second epoch leaves the file as it is
    assert trace.read_text() == first


def test_the_lightning_recipe_of_the_docs_logs_the_report(tmp_path):
    """docs/frameworks.md: a callback that log_dict()s loader.report() at each epoch's end."""
    L = pytest.importorskip("lightning")
    torch = pytest.importorskip("torch")
    write(tmp_path, 32, 16)

    class LoaderReport(L.Callback):  # as in docs/frameworks.md
        def on_train_epoch_end(self, trainer, pl_module):
            r = trainer.train_dataloader.report().to_dict()
            pl_module.log_dict({f"loader/{k}": v for k, v in r["stages"].items()})
            pl_module.log_dict({"loader/wait_fraction": r["wait_fraction"], "loader/input_bound": float(r["input_bound"]),
                                "loader/bytes_read": float(r["bytes_read"]), "loader/requests": float(r["requests"])})

    class Model(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(16, 1)

        def training_step(self, batch, index):
            return self.lin(batch["npy"]).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), 0.1)

    trainer = L.Trainer(max_epochs=2, callbacks=[LoaderReport()], logger=False, enable_progress_bar=False,
                        enable_checkpointing=False)
    loader = shardflow.loader(shardflow.ShardDataset(str(tmp_path)), batch_size=8)
    trainer.fit(Model(), loader)
    logged = {k: float(v) for k, v in trainer.callback_metrics.items()}
    assert {f"loader/{s}" for s in STAGES} | {"loader/wait_fraction", "loader/requests"} <= set(logged)
    assert logged["loader/bytes_read"] == loader.report().to_dict()["bytes_read"] > 0
