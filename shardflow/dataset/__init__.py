"""The streaming dataset, :class:`ShardDataset`, in five parts: the dataset itself
(:mod:`.streaming`), a pass over it (:mod:`.iteration`), its resume state
(:mod:`.resumable`), and the contract with the loader: the two methods it calls
(:mod:`.contract`) and the per-epoch object it talks to (:mod:`.epochrun`)."""

from ..loading.batching import Batching, WorkerItem
from ..state import STATE_VERSION
from .epochrun import EpochRun
from .streaming import ShardDataset, check_picklable_transform

__all__ = ["ShardDataset", "EpochRun", "Batching", "WorkerItem", "STATE_VERSION", "check_picklable_transform"]
