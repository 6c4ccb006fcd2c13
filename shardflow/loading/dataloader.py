"""The ``torch.utils.data.DataLoader`` that :func:`shardflow.loader` runs.

torch checks the worker count (a ``UserWarning`` "This DataLoader will create N worker
processes in total ..." when ``num_workers`` exceeds the CPUs this process may use) when a
DataLoader is built and again when each iterator starts, from two call sites, so Python's
once-per-location warning filter printed it twice. Here the check runs once per DataLoader
(at construction), so the warning appears once per process.
"""

from __future__ import annotations

from torch.utils.data import DataLoader as TorchDataLoader

__all__ = ["DataLoader"]


class DataLoader(TorchDataLoader):
    """torch's DataLoader, its worker-count check done once (see the module docstring)."""

    _worker_count_checked = False

    def check_worker_number_rationality(self) -> None:
        if self._worker_count_checked:
            return
        self._worker_count_checked = True
        super().check_worker_number_rationality()
