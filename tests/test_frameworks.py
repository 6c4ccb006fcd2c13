"""shardflow under other training frameworks: PyTorch Lightning's data module, torchdata's StatefulDataLoader.

tools/lightning_example.py is the Lightning example docs/frameworks.md shows; the reference for
its batches is shardflow's own loader iterated by hand.
"""

from __future__ import annotations

import importlib.util
import warnings
from pathlib import Path

import pytest

import shardflow
from tests.helpers import make_shards

ROOT = Path(__file__).resolve().parents[1]


def _example():
    spec = importlib.util.spec_from_file_location("lightning_example", ROOT / "tools" / "lightning_example.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _trainer(L, module, tmp_path, callbacks=(), **kwargs):
    return L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                     enable_model_summary=False, default_root_dir=str(tmp_path),
                     callbacks=[module.ShardEpochs(), *callbacks], **kwargs)  # fmt: skip


def _reference(folder: str, epochs: int, batch_size: int = 32) -> list[list[str]]:
    """The batches' keys of shardflow's loader alone, epoch after epoch, as the data module builds it."""
    ds = shardflow.ShardDataset(folder, shuffle=True, seed=0, decode="numpy")
    loader = shardflow.loader(ds, batch_size=batch_size)
    return [list(b["__key__"]) for _ in range(epochs) for b in loader]


@pytest.fixture(scope="module")
def example(tmp_path_factory):
    pytest.importorskip("lightning")
    module = _example()
    work = tmp_path_factory.mktemp("lightning")
    module.write_shards(str(work / "train"), 300, seed=0)
    module.write_shards(str(work / "val"), 64, seed=1)
    return module, work


@pytest.mark.parametrize("workers", [0, 2])
def test_lightning_data_module_epochs_are_shardflow_epochs(example, tmp_path, workers):
    module, work = example
    import lightning as L

    model = module.Regression()
    data = module.ShardDataModule(str(work / "train"), str(work / "val"), num_workers=workers)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _trainer(L, module, tmp_path, max_epochs=2).fit(model, datamodule=data)
    ref = _reference(str(work / "train"), 2)
    assert len(ref) == 20  # 300 samples, batches of 32: 10 per epoch
    assert model.seen == ref
    first, second = ([k for b in model.seen[e * 10 : (e + 1) * 10] for k in b] for e in (0, 1))
    assert sorted(first) == sorted(second) == [f"{i:06d}" for i in range(300)] and first != second


class _Stop(Exception):
    pass


def test_lightning_resumes_a_mid_epoch_checkpoint_exactly(example, tmp_path):
    module, work = example
    import lightning as L

    ckpt = tmp_path / "mid.ckpt"

    class SaveAndStop(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == 13:  # epoch 1, batch 3
                trainer.save_checkpoint(ckpt)
                raise _Stop

    first = module.Regression()
    with warnings.catch_warnings(), pytest.raises(_Stop):
        warnings.simplefilter("ignore")
        _trainer(L, module, tmp_path, [SaveAndStop()], max_epochs=2).fit(
            first, datamodule=module.ShardDataModule(str(work / "train"), num_workers=2))
    resumed = module.Regression()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _trainer(L, module, tmp_path, max_epochs=2).fit(
            resumed, datamodule=module.ShardDataModule(str(work / "train"), num_workers=2), ckpt_path=str(ckpt))
    ref = _reference(str(work / "train"), 2)
    assert first.seen == ref[:13]
    assert resumed.seen == ref[13:]


def _stateful_run(folder, workers, stop):
    from torchdata.stateful_dataloader import StatefulDataLoader

    def make():
        return StatefulDataLoader(shardflow.ShardDataset(folder, shuffle=True, seed=3, decode=None),
                                  batch_size=8, num_workers=workers)  # fmt: skip

    full = [list(b["__key__"]) for b in make()]
    dl = make()
    it = iter(dl)
    head = [list(next(it)["__key__"]) for _ in range(stop)]
    state = dl.state_dict()
    del it
    again = make()
    again.load_state_dict(state)
    return full, head, [list(b["__key__"]) for b in again]


def test_stateful_dataloader_resumes_exactly_without_workers(tmp_path):
    pytest.importorskip("torchdata.stateful_dataloader")
    root = make_shards(tmp_path, [40, 40, 40, 40])
    full, head, rest = _stateful_run(str(root), 0, 5)
    assert len(full) == 20 and head + rest == full


def test_stateful_dataloader_with_workers_refuses_to_resume_use_shardflow_loader(tmp_path):
    """What docs/frameworks.md says: with num_workers > 0 the worker copies' dataset states do
    not describe the rank's position; the resumed run repeated samples (200 of a 160-sample
    epoch, silently) and is now refused in the worker with a StateError naming shardflow.loader
    (its resume is exact for any num_workers: tests/test_resume.py)."""
    pytest.importorskip("torchdata.stateful_dataloader")
    from shardflow.errors import StateError

    root = make_shards(tmp_path, [40, 40, 40, 40])
    with pytest.raises(StateError, match="shardflow.loader"):
        _stateful_run(str(root), 2, 5)
