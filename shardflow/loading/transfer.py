"""How a DataLoader worker's batch reaches the main process under :func:`shardflow.loader`.

Torch sends every CPU tensor of a batch through a shared-memory segment of its own: a new file
in ``/dev/shm``, its descriptor passed over a socket, and a first-touch page fault per 4 KiB in
the worker that fills it and again in the main process that maps it: a sizeable part of what
decoding the batch costs (docs/benchmarks.md). Here instead:

* tensors of at most :data:`BY_VALUE_MAX_BYTES` travel by value, pickled with the batch;
* larger ones are stacked by :func:`shardflow.loading.collation.collate` straight into a slot of a small
  pool of shared-memory buffers that each worker keeps (:func:`shared_out`); the main process
  maps a slot once, and for every later batch copies it out into memory of its own and hands
  the slot back (a flag in a shared array), so batch after batch reuses the same pages;
* the first tensor a worker stacks (its first batch's images, say), when it is at most
  :data:`FIRST_BY_VALUE_MAX_BYTES`, is stacked into private memory and travels by value too:
  torch's way (a descriptor fetched from the worker's ``resource_sharer`` listener thread,
  which answers only when the worker's interpreter lock lets it, while the worker decodes its
  next batch) kept the main process waiting for the first batch 25-50 ms, and a slot would be
  mapped and copied out; a larger one goes the way torch sends it, mapped once and kept;
* anything else (no free slot, another collate, graphs) goes the way torch sends it.

The main process keeps a worker's slots mapped until :func:`forget` (the loader calls it when
its workers have stopped).
"""

from __future__ import annotations

import os
import threading
from typing import Any

import numpy as np
import torch

from .. import fastpath
from ..compat.torch import new_shared, storage_uses
from ..errors import ShardflowError

__all__ = [
    "BY_VALUE_MAX_BYTES", "FIRST_BY_VALUE_MAX_BYTES", "POOL_SLOTS", "shared_out", "to_wire", "from_wire", "release", "forget",
]

BY_VALUE_MAX_BYTES: int = 1 << 16
"""Tensors up to this many bytes (64 KiB: labels, indices, small features) travel by value."""

FIRST_BY_VALUE_MAX_BYTES: int = 1 << 20
"""The first tensor a worker stacks travels by value up to this many bytes (1 MiB: 64 images
of 3x64x64 uint8 take 768 KiB). Larger, its bytes through the pipe (64 KiB at a time) take
longer than the descriptor's way."""

POOL_SLOTS: int = 4
"""Shared-memory buffers per worker process: the DataLoader keeps ``prefetch_factor`` (2)
batches of a worker in flight, and the main process frees a slot as soon as it has a batch."""

# dtypes that Tensor.numpy() and torch.from_numpy carry unchanged
_NUMPY_DTYPES = frozenset({
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
    torch.float16, torch.float32, torch.float64, torch.complex64, torch.complex128,
})  # fmt: skip


class _Pool:
    """A worker's slots; ``state[i]`` is 1 while slot i holds a batch the main process has not
    copied out yet (the worker sets it, the main process clears it)."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.token = int.from_bytes(os.urandom(8), "little") >> 1
        self.state = torch.zeros(POOL_SLOTS, dtype=torch.int64).share_memory_()
        self.slots: list[torch.Tensor | None] = [None] * POOL_SLOTS
        self.sent = [False] * POOL_SLOTS  # whether the main process has the slot mapped
        self.fresh = [False] * POOL_SLOTS  # filled by collate since it was last sent
        self.state_sent = False
        self.by_address: dict[int, int] = {}
        self.first = True  # no batch handed out yet (see shared_out)
        self.by_value: set[int] = set()  # addresses of first batches in private memory, to send by value


_pool: _Pool | None = None


def _worker_pool() -> _Pool:
    global _pool
    if _pool is None or _pool.pid != os.getpid():  # a forked child starts a pool of its own
        _pool = _Pool()
    return _pool


def shared_out(count: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised tensor of shape ``(count, *shape)`` for collate to stack a batch into
    in a DataLoader worker: a free slot of the worker's pool (grown or replaced to fit), or a
    fresh shared tensor when every slot is in flight. The worker's first one (its first
    batch's) waits for no mapping of a slot: up to :data:`FIRST_BY_VALUE_MAX_BYTES` it is
    private memory that :func:`to_wire` sends by value, larger a fresh shared tensor that the
    main process maps and keeps as it is, the way torch sends tensors."""
    if not fastpath.enabled() or _SOLE_USE is None:  # torch's own way: a new segment per batch
        return new_shared((count, *shape), dtype)
    nbytes = count * dtype.itemsize
    for n in shape:
        nbytes *= n
    pool = _worker_pool()
    first, pool.first = pool.first, False
    if first and nbytes <= FIRST_BY_VALUE_MAX_BYTES:
        out = torch.empty((count, *shape), dtype=dtype)
        pool.by_value.add(out.untyped_storage().data_ptr())
        return out
    for i in range(0 if first else POOL_SLOTS):
        if pool.state[i].item():
            continue
        slot = pool.slots[i]
        fits = slot is not None and nbytes <= slot.numel() <= 4 * nbytes
        if fits and _held_elsewhere(pool, i):
            continue  # a batch kept in this worker (a collate_fn holding the last one) still reads it
        if not fits:
            if slot is not None:
                del pool.by_address[slot.data_ptr()]
            slot = new_shared((nbytes,), torch.uint8)
            pool.slots[i], pool.sent[i] = slot, False
            pool.by_address[slot.data_ptr()] = i
        pool.state[i] = 1
        pool.fresh[i] = True
        return slot[:nbytes].view(dtype).view(count, *shape)
    return new_shared((count, *shape), dtype)


_SOLE_USE = storage_uses(torch.empty(1))  # one tensor alone (None: this torch cannot tell)


def _held_elsewhere(pool: _Pool, i: int) -> bool:
    """Whether a tensor other than the pool's own uses slot ``i``'s memory in this process (a
    batch, or a view of one, that a collate_fn or the pipeline still holds): writing the slot
    would change it. True when torch cannot tell (the slot is then not reused)."""
    uses = storage_uses(pool.slots[i])  # type: ignore[arg-type]
    if uses is None or _SOLE_USE is None:
        return True
    mapped = _received.get(pool.token)  # (only where one process sends and receives: tests)
    return uses > _SOLE_USE + (mapped is not None and i in mapped[1])


class _ByValue:
    """A tensor travelling as a numpy array (numpy pickles its bytes in-band)."""

    __slots__ = ("array",)

    def __init__(self, array: Any) -> None:
        self.array = array

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return (_ByValue, (self.array,))


class _InSlot:
    """A batch tensor in slot ``index`` of pool ``token`` (at ``offset`` elements, with
    ``stride``: a view of a slot is copied out as the view it is); ``slot`` and ``state`` ride
    along the first time the main process needs them."""

    __slots__ = ("token", "index", "dtype", "shape", "slot", "state", "offset", "stride")

    def __init__(self, token: int, index: int, dtype: torch.dtype, shape: tuple[int, ...],
                 slot: torch.Tensor | None, state: torch.Tensor | None,
                 offset: int = 0, stride: tuple[int, ...] | None = None) -> None:
        self.token, self.index, self.dtype, self.shape, self.slot, self.state = token, index, dtype, shape, slot, state
        self.offset, self.stride = offset, stride

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return (_InSlot, (self.token, self.index, self.dtype, self.shape, self.slot, self.state,
                          self.offset, self.stride))


def to_wire(data: Any) -> Any:
    """``data`` (dicts, lists, tuples of values) ready to pickle in a worker: small plain CPU
    tensors as :class:`_ByValue`, batches in a pool slot as :class:`_InSlot`, the rest as is
    (all of it as is with the fast paths off: torch then sends every tensor itself)."""
    return _wire(data, set()) if fastpath.enabled() else data


def _wire(data: Any, claimed: set[int]) -> Any:
    """:func:`to_wire` of one batch; ``claimed``: the slots this batch sends (filled here)."""
    kind = type(data)
    if kind is dict:
        return {k: _wire(v, claimed) for k, v in data.items()}
    if kind is list or kind is tuple:
        return kind(_wire(v, claimed) for v in data)
    if kind is not torch.Tensor or data.device.type != "cpu" or data.layout != torch.strided:
        return data
    if data.requires_grad or data.is_conj() or data.is_neg():
        return data
    if data.is_shared():
        return _slot_of(data, claimed)
    if data.dtype not in _NUMPY_DTYPES:
        return data
    if data.numel() * data.element_size() > BY_VALUE_MAX_BYTES and not _first_by_value(data):
        return data
    try:
        return _ByValue(data.numpy())
    except (RuntimeError, TypeError):  # a tensor numpy cannot view (named dimensions, ...)
        return data


def _first_by_value(data: torch.Tensor) -> bool:
    """Whether ``data`` is (a view of) the worker's first batch as :func:`shared_out` made it,
    to be sent by value (once: the address may serve another tensor later)."""
    pool = _pool
    if pool is None or not pool.by_value or pool.pid != os.getpid():
        return False
    address = data.untyped_storage().data_ptr()
    if address not in pool.by_value:
        return False
    pool.by_value.discard(address)  # once: a later tensor at that address is another
    return True


def _slot_of(data: torch.Tensor, claimed: set[int]) -> Any:
    pool = _pool
    if pool is None or pool.pid != os.getpid():
        return data
    index = pool.by_address.get(data.untyped_storage().data_ptr())
    if index is None:
        return data
    if index not in claimed:
        if not pool.fresh[index]:
            # a slot sent with an earlier batch (a collate_fn that adds the last batch to this
            # one): the main process may have handed it back already, so it goes as a copy
            return _wire(data.clone(), claimed)
        pool.fresh[index] = False
        claimed.add(index)
    slot = None if pool.sent[index] else pool.slots[index]
    state = None if pool.state_sent else pool.state
    pool.sent[index] = pool.state_sent = True
    # A view of a slot (a collate_fn that adds ``batch[1:]`` or a permuted batch) is copied out
    # as well: sent as torch sends it, it would map the slot, which is reused once handed back.
    plain = not data.storage_offset() and data.is_contiguous()
    offset, stride = (0, None) if plain else (data.storage_offset(), tuple(data.stride()))
    return _InSlot(pool.token, index, data.dtype, tuple(data.shape), slot, state, offset, stride)


_received: dict[int, tuple[torch.Tensor, dict[int, torch.Tensor]]] = {}
_received_lock = threading.Lock()


def from_wire(data: Any, freed: list[tuple[int, torch.Tensor, int]]) -> Any:
    """Undo :func:`to_wire` in the main process: slots are copied out into new tensors and
    listed in ``freed`` as ``(token, state, index)``, for the caller to hand back once the
    whole batch is out (:func:`release`)."""
    kind = type(data)
    if kind is dict:
        return {k: from_wire(v, freed) for k, v in data.items()}
    if kind is list or kind is tuple:
        return kind(from_wire(v, freed) for v in data)
    if kind is _ByValue:
        return torch.from_numpy(data.array)  # unpickled arrays are writable: no copy, no warning
    if kind is not _InSlot:
        return data
    with _received_lock:
        if data.state is not None:
            _received[data.token] = (data.state, {})
        entry = _received.get(data.token)
        if entry is None:
            raise ShardflowError("internal: a batch arrived from a worker whose buffers were forgotten")
        if data.slot is not None:
            entry[1][data.index] = data.slot
        slot = entry[1][data.index]
    nbytes = data.dtype.itemsize
    for n in data.shape:
        nbytes *= n
    out = torch.empty(data.shape, dtype=data.dtype)
    if data.stride is not None:  # a view of the slot: copy the view's elements
        view = torch.empty(0, dtype=data.dtype).set_(slot.untyped_storage(), data.offset, data.shape, data.stride)
        out.copy_(view)
    elif nbytes:  # numpy's copy: torch's copy_ would wake (and spin) its intra-op threads here
        np.copyto(out.view(-1).view(torch.uint8).numpy(), slot[:nbytes].numpy())
    freed.append((data.token, entry[0], data.index))
    return out


def release(freed: list[tuple[int, torch.Tensor, int]]) -> None:
    """Hand the slots listed by :func:`from_wire` back to their workers."""
    for _, state, index in freed:
        state[index] = 0


def forget(tokens: set[int]) -> None:
    """Unmap the slots of these pools in the main process (their workers have stopped)."""
    with _received_lock:
        for token in tokens:
            _received.pop(token, None)
