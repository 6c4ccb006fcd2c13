"""The streaming dataset, :class:`ShardDataset`: its configuration, size and plan
(:mod:`.streaming`, the forms of its arguments in :mod:`.options`), its epochs
(:mod:`.epochs`) and one run per epoch (:mod:`.epochrun`), for a direct iteration and for
the loader alike, which holds the position, resume point, layout and stats; a worker's pass
(:mod:`.iteration`), states checked and resumed (:mod:`.resumable`), and the first batches'
bytes requested as forked workers start (:mod:`.warmstart`)."""

from ..loading.batching import Batching, WorkerItem
from ..state import STATE_VERSION
from .epochrun import EpochRun
from .streaming import ShardDataset, check_picklable_transform

__all__ = ["ShardDataset", "EpochRun", "Batching", "WorkerItem", "STATE_VERSION", "check_picklable_transform"]
