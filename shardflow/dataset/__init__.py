"""The streaming dataset, :class:`ShardDataset`, in four parts: the dataset itself
(:mod:`.streaming`), a pass over it (:mod:`.iteration`), its resume state
(:mod:`.resumable`) and the loader's side of the contract (:mod:`.contract`)."""

from ..batching import Batching, WorkerItem
from ..state import STATE_VERSION
from .streaming import ShardDataset, check_picklable_transform

__all__ = ["ShardDataset", "Batching", "WorkerItem", "STATE_VERSION", "check_picklable_transform"]
