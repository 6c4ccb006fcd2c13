"""torch internals that shardflow uses, each with a public fallback.

* ``torch._C._storage_Use_Count(storage._cdata)``: how many tensors use a
  storage, so that :mod:`shardflow.loading.transfer` reuses a buffer only when nothing
  else reads it. Without it a buffer is never reused (the slot pool stays off).
* ``TypedStorage._new_shared`` and ``._untyped_storage``: a tensor allocated in
  shared memory directly, as ``torch.utils.data.default_collate`` does. The
  fallback, ``share_memory_()``, copies from private memory first.
* ``torch.utils.data._utils.pin_memory.pin_memory``: what the DataLoader runs to
  pin a batch; the fallback pins tensors in dicts, lists and tuples.
* ``_MultiProcessingDataLoaderIter._shutdown_workers``: stop a DataLoader's
  workers now rather than when its iterator is collected; without it the
  iterator is only dropped.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["REQUIRED", "storage_uses", "new_shared", "pin_memory", "shutdown_workers", "drop_iterator", "missing"]

REQUIRED = (
    "torch._C._storage_Use_Count",
    "torch.UntypedStorage._cdata",
    "torch.TypedStorage._new_shared",
    "torch.TypedStorage._untyped_storage",
    "torch.utils.data._utils.pin_memory.pin_memory",
    "torch.utils.data.dataloader._MultiProcessingDataLoaderIter._shutdown_workers",
    "torch.utils.data.DataLoader._iterator",
)
"""The private names used here (``tests/test_compat.py`` checks each one exists)."""

_use_count: Callable[[int], int] | None = getattr(torch._C, "_storage_Use_Count", None)


def storage_uses(tensor: torch.Tensor) -> int | None:
    """How many tensors (and storage objects) use ``tensor``'s memory, or None when this torch
    cannot tell (``tensor`` itself counts, and must stay alive throughout)."""
    if _use_count is None:
        return None
    return _use_count(tensor.untyped_storage()._cdata)


def new_shared(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor of ``shape`` and ``dtype`` in a new shared-memory segment."""
    numel = 1
    for n in shape:
        numel *= n
    typed = torch.empty(0, dtype=dtype)._typed_storage()
    if not hasattr(typed, "_new_shared"):
        return torch.empty(shape, dtype=dtype).share_memory_()
    storage = typed._new_shared(numel, device="cpu")
    return torch.empty(0, dtype=dtype).set_(storage._untyped_storage, 0, shape)


def pin_memory(data: Any, device: Any = None) -> Any:
    """``data`` pinned as the DataLoader pins a batch (``device``: as its ``pin_memory_device``)."""
    try:
        from torch.utils.data._utils.pin_memory import pin_memory as pin
    except ImportError:
        return _pin(data, device)
    return pin(data) if device is None else pin(data, device)


def _pin(data: Any, device: Any) -> Any:
    if isinstance(data, torch.Tensor):
        return data.pin_memory() if device is None else data.pin_memory(device)
    if isinstance(data, dict):
        return {k: _pin(v, device) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return type(data)(_pin(v, device) for v in data)
    return data


def shutdown_workers(iterator: Any) -> None:
    """Stop the workers of a DataLoader iterator now (a no-op for a single-process one)."""
    shutdown = getattr(iterator, "_shutdown_workers", None)
    if shutdown is not None:
        shutdown()


def drop_iterator(loader: Any) -> None:
    """Make a DataLoader's next ``iter()`` start new workers: its persistent iterator, if any,
    is forgotten and its workers stopped now."""
    iterator = getattr(loader, "_iterator", None)
    loader._iterator = None
    if iterator is not None:
        shutdown_workers(iterator)


def missing() -> list[str]:
    """The names of :data:`REQUIRED` that this torch does not have."""
    from torch.utils.data import dataloader

    typed = torch.empty(0)._typed_storage()
    present = {
        "torch._C._storage_Use_Count": _use_count is not None,
        "torch.UntypedStorage._cdata": hasattr(torch.empty(0).untyped_storage(), "_cdata"),
        "torch.TypedStorage._new_shared": hasattr(typed, "_new_shared"),
        "torch.TypedStorage._untyped_storage": hasattr(typed, "_untyped_storage"),
        "torch.utils.data._utils.pin_memory.pin_memory": _has_pin(),
        "torch.utils.data.dataloader._MultiProcessingDataLoaderIter._shutdown_workers": hasattr(
            getattr(dataloader, "_MultiProcessingDataLoaderIter", None), "_shutdown_workers"
        ),
        "torch.utils.data.DataLoader._iterator": "_iterator" in vars(dataloader.DataLoader([])),
    }
    return [name for name in REQUIRED if not present[name]]


def _has_pin() -> bool:
    try:
        from torch.utils.data._utils.pin_memory import pin_memory  # noqa: F401
    except ImportError:
        return False
    return True
